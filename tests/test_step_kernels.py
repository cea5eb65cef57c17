"""``tools.step_kernels`` (device time of a whole training step per kind of kernel): its variants,
its kernel kinds, and that one variant's patch never leaks into the next."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from onca.integrations.transformers import family_of  # noqa: E402
from tools.step_kernels import by_kind, kind, main, onca_kernel_names, parse_variant  # noqa: E402


def test_kernels_are_sorted_by_kind():
    names = onca_kernel_names()
    assert {"_rope_kernel", "_rms_norm_forward_kernel", "_cross_entropy_kernel"} <= names
    cases = {
        "_rope_kernel": "onca",
        "triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0": "inductor",
        "nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_TNT": "gemm",
        "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26_64x64x128": "attention",
        "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<...>": "optimizer",
        "Memcpy DtoD (Device -> Device)": "copy/fill",
        "void at::native::reduce_kernel<128, 4>": "other",
    }
    for name, expected in cases.items():
        assert kind(name, names) == expected, name
    totals = by_kind([("_rope_kernel", 3.0, 1), ("Memset (Device)", 1.0, 1), ("_rope_kernel", 2.0, 1)], names)
    assert totals["onca"] == 5.0 and totals["copy/fill"] == 1.0 and totals["gemm"] == 0.0


def test_variants_and_their_switches():
    assert parse_variant("huggingface") == ("huggingface", {})
    assert parse_variant("onca:rope=off,mlp=on") == ("onca", {"rope": False, "mlp": True})
    with pytest.raises(SystemExit, match="unknown variant 'tvm'"):
        parse_variant("tvm")
    with pytest.raises(SystemExit, match="must be name=on or name=off"):
        parse_variant("onca:rope=no")
    with pytest.raises(SystemExit, match="switches apply to onca only"):
        parse_variant("huggingface:rope=off")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU check; on a GPU it profiles a real step")
def test_each_variant_runs_and_leaves_nothing_patched(capsys, monkeypatch):
    """Onca's RoPE patch is module-level: a variant after ``onca`` with ``rope=off`` must run
    Hugging Face's rotary function (the first GPU profiles of this tool did not)."""
    import tools.step_kernels as tool

    modeling = family_of("qwen3").modeling()
    original_rope = modeling.apply_rotary_pos_emb
    seen = []
    build = tool.build_step

    def recording_build(settings, config, variant, switches):
        seen.append(modeling.apply_rotary_pos_emb is original_rope)
        return build(settings, config, variant, switches)

    monkeypatch.setattr(tool, "build_step", recording_build)
    traces = []
    export = torch.profiler.profile.export_chrome_trace
    monkeypatch.setattr(torch.profiler.profile, "export_chrome_trace",
                        lambda self, path: (traces.append(path), export(self, path)))
    # --gaps: each variant's host-traced profile is exported (its gaps are printed on a GPU only)
    argv = ["--preset", "tiny", "--steps", "1", "--gaps", "2", "onca", "onca:rope=off", "huggingface"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.count("ms per step on the CPU") == 3, out
    assert seen == [True, True, True]
    assert len(set(traces)) == 3, traces  # one trace per variant
    assert modeling.apply_rotary_pos_emb is original_rope
