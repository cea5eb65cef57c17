"""tools.kernel_variants: an op's kernels rebuilt from substituted source, swapped into its module
while they run, compared with the base and timed beside it (on the CPU: the interpreter)."""

from __future__ import annotations

import pytest
import torch

from onca.bench import harness
from onca.ops import _small_calls as small_calls
from onca.ops import rms_norm
from tools import kernel_variants

ONE_TILE = "rstd = tl.rsqrt(tl.sum(x * x, axis=1) / n_cols + eps)"


def test_a_variant_runs_in_place_of_the_kernel_and_is_compared_with_the_base(tmp_path, device, monkeypatch):
    monkeypatch.setattr(small_calls, "_limit", 0)  # on a GPU the probe size would run torch's op
    bench = harness.load("rms_norm")
    same = kernel_variants.variant_names(rms_norm, [], "same", str(tmp_path))
    scaled = ONE_TILE.replace("+ eps)", "+ eps) * 1.25")
    off = kernel_variants.variant_names(rms_norm, [[ONE_TILE, scaled]], "off", str(tmp_path))
    assert "FORWARD_TILES" in off and any(callable(v) for v in off.values())
    kernel = next(name for name, obj in off.items() if callable(obj))
    original = getattr(rms_norm, kernel)
    lines = []
    times = kernel_variants.time_points(bench, rms_norm, {"same": same, "off": off},
                                        [("probe", dict(bench.probe))], device=device, rounds=1,
                                        peers=("torch",), report=lines.append)
    assert getattr(rms_norm, kernel) is original  # swapped back
    assert "probe same: bitwise equal" in lines
    assert any(line.startswith("probe off: max abs diff") for line in lines)
    assert set(times["probe"]) == {"base", "same", "off", "torch"}


def test_a_peer_the_op_lacks_is_named(device):
    bench = harness.load("rms_norm")
    with pytest.raises(ValueError, match="no provider 'nonesuch'"):
        kernel_variants.time_points(bench, rms_norm, {}, [("probe", dict(bench.probe))], device=device,
                                    rounds=1, peers=("nonesuch",), report=lambda line: None)


def test_a_substitution_must_match_exactly_once(tmp_path):
    with pytest.raises(ValueError, match="variant 'missing'.*occurs 0 times"):
        kernel_variants.variant_names(rms_norm, [["no such text", "x"]], "missing", str(tmp_path))


def test_compare_reports_bitwise_equality_or_the_largest_difference():
    a = [torch.ones(3), torch.zeros(2)]
    assert kernel_variants.compare(a, [t.clone() for t in a]) == "bitwise equal"
    assert kernel_variants.compare(a, [torch.ones(3), torch.tensor([0.0, 0.5])]) == "max abs diff 0.5"


def test_a_constant_that_does_not_reach_the_launches_is_reported(tmp_path, device, monkeypatch):
    """A tile declaration that changes the plan at the point reaches the launches, also through a
    launcher that holds the dict object (the row map's: softmax), and is swapped back afterwards;
    one that leaves the plan as it was is reported."""
    from onca.ops import relu_squared, softmax

    monkeypatch.setattr(small_calls, "_limit", 0)
    cases = ((relu_squared, "FORWARD_TILES = dict(live_tiles=2, fp32_tiles=2", ", max_block_cols=128", True),
             (softmax, "FORWARD_TILES = dict(live_tiles=2, fp32_tiles=2", ", max_block_cols=256", True),
             (softmax, "FORWARD_TILES = dict(live_tiles=2, fp32_tiles=2", ", max_block_cols=1 << 20", False))
    for op, tiles, extra, reaches in cases:
        subs = [[tiles, tiles + extra]]
        assert not kernel_variants.changes_kernels(op, subs, "v")
        bench = harness.load(op.__name__.rsplit(".", 1)[-1])
        before = dict(op.FORWARD_TILES)
        variant = kernel_variants.variant_names(op, subs, "v", str(tmp_path))
        lines = []
        point = {**bench.probe, "tokens": 4}  # four rows: the interpreter runs every variant twice
        kernel_variants.time_points(bench, op, {"v": variant}, [("probe", point)], device=device,
                                    rounds=1, constants_only=frozenset({"v"}), report=lines.append)
        assert any(line.startswith("probe v: ") for line in lines)  # compared with the base
        assert any("did not reach the launches" in line for line in lines) != reaches, (op, extra, lines)
        assert op.FORWARD_TILES == before
    assert kernel_variants.changes_kernels(rms_norm, [[ONE_TILE, ONE_TILE.replace("eps)", "eps * 2)")]], "k")


def test_a_variant_of_an_op_that_caches_no_launch_configurations_is_not_judged(tmp_path, device):
    """Fused MoE plans its grouped GEMMs at each call and caches no launch configuration: a tile
    variant is reported as not checked, never as one that did not reach the launches (an H200 run
    of 2026-12-01 said so of variants whose tiles measured 1.2x faster)."""
    from onca.ops import fused_moe

    up = '"up": dict(max_block_n=128, '
    subs = [[up, '"up": dict(max_block_n=64, ']]
    assert not kernel_variants.changes_kernels(fused_moe, subs, "v")
    bench = harness.load("fused_moe")
    variant = kernel_variants.variant_names(fused_moe, subs, "v", str(tmp_path))
    lines = []
    point = {**bench.probe, "tokens": 4}
    kernel_variants.time_points(bench, fused_moe, {"v": variant}, [("probe", point)], device=device, rounds=1,
                                constants_only=frozenset({"v"}), report=lines.append)
    assert any(line.startswith("probe v: ") for line in lines)
    assert any("not checked" in line for line in lines), lines
    assert not any("did not reach the launches" in line for line in lines), lines


def test_a_constant_variant_whose_results_differ_is_not_reported_as_timing_the_base(tmp_path, device):
    """Distillation's ``FP32_LOGITS`` changes the logits' dtype, not a cached launch configuration:
    its results differ from the base's, so its constant reached the computation and the variant is
    not reported as one that times the base's code."""
    from onca.ops import fused_linear_distill

    subs = [["FP32_LOGITS = False", "FP32_LOGITS = True"]]
    assert not kernel_variants.changes_kernels(fused_linear_distill, subs, "v")
    bench = harness.load("fused_linear_distill")
    variant = kernel_variants.variant_names(fused_linear_distill, subs, "v", str(tmp_path))
    lines = []
    kernel_variants.time_points(bench, fused_linear_distill, {"v": variant}, [("probe", bench.probe)],
                                device=device, dtype=torch.bfloat16, rounds=1,
                                constants_only=frozenset({"v"}), report=lines.append)
    assert any(line.startswith("probe v: max abs diff") for line in lines), lines
    assert not any("did not reach the launches" in line for line in lines), lines


def test_a_kernel_edit_reaches_an_op_that_holds_its_kernel(tmp_path, device, monkeypatch):
    """Softmax's ops are registered with its kernel objects (the row map's): a kernel edit is
    swapped into those objects, so the variant computes something else (a deliberately wrong edit
    here), and the base is the base again after the swap."""
    from onca.ops import softmax

    monkeypatch.setattr(small_calls, "_limit", 0)
    subs = [["y = e / tl.sum(e, axis=1)[:, None]", "y = 2.0 * e / tl.sum(e, axis=1)[:, None]"]]
    assert kernel_variants.changes_kernels(softmax, subs, "v")
    bench = harness.load("softmax")
    variant = kernel_variants.variant_names(softmax, subs, "v", str(tmp_path))
    point = {**bench.probe, "tokens": 4}
    base = kernel_variants._result(bench, point, device, torch.float32, "forward")
    with kernel_variants.swapped(softmax, variant):
        doubled = kernel_variants._result(bench, point, device, torch.float32, "forward")
    torch.testing.assert_close(doubled[0], 2 * base[0])
    assert torch.equal(kernel_variants._result(bench, point, device, torch.float32, "forward")[0], base[0])
