"""The GPU test suite in shards, each sized to finish in one device call (under 8 minutes).

    python -m tools.gpu_tests --list            # the shards and their test files
    python -m tools.gpu_tests 1                 # shard 1 at GPU scale (ONCA_TEST_SCALE=gpu)
    python -m tools.gpu_tests all               # every shard, one after the other
    python -m tools.gpu_tests 1 --memcheck      # shard 1 under compute-sanitizer's memcheck
    python -m tools.gpu_tests 19 --times $OUT   # each test's seconds into $OUT/shard-19.tsv as it ends

``--memcheck`` runs the shard's tests at CI scale (small shapes: the sanitizer slows kernels down
by orders of magnitude) under ``compute-sanitizer --tool memcheck``; any memory error fails the
run. Extra arguments after ``--`` go to pytest (e.g. ``-- -x -k contract``). The exit status is
pytest's (or the sanitizer's), the first non-zero one over the shards run.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time

# Sized from the H200 runs: the RMSNorm files alone take 195 s at GPU scale on a fresh machine
# (Triton compiles every variant), and five shards run side by side with memcheck did not finish
# the three op shards in 9 minutes: one or two ops per shard.
SHARDS: dict[str, tuple[str, ...]] = {
    "1": ("tests/ops/test_rms_norm.py", "tests/nn/test_rms_norm.py", "tests/ops/test_partials.py"),
    "2": ("tests/ops/test_fused_add_rms_norm.py", "tests/nn/test_fused_add_rms_norm.py",
          "tests/ops/test_layer_norm.py", "tests/nn/test_layer_norm.py"),
    "3": ("tests/ops/test_swiglu.py", "tests/ops/test_geglu.py", "tests/nn/test_mlp.py",
          "tests/ops/test_tiled_mlp.py"),
    "4": ("tests/ops/test_rope.py", "tests/ops/test_embedding.py", "tests/nn/test_embedding.py",
          "tests/ops/test_fill.py", "tests/ops/test_multimodal_rope.py", "tests/ops/test_llama4_rope.py",
          "tests/ops/test_rms_norm_rope.py",
          "tests/ops/test_attn_res.py", "tests/nn/test_attn_res.py"),
    "5": ("tests/ops/test_cross_entropy.py", "tests/nn/test_cross_entropy.py",
          "tests/ops/test_fused_linear_cross_entropy.py", "tests/nn/test_fused_linear_cross_entropy.py",
          "tests/ops/test_vocab_parallel_cross_entropy.py"),
    "6": ("tests/ops/test_kl_div.py", "tests/nn/test_kl_div.py", "tests/ops/test_jsd.py", "tests/nn/test_jsd.py",
          "tests/ops/test_fused_linear_jsd.py", "tests/ops/test_grpo_loss.py"),
    "7": ("tests/integrations/test_convergence.py", "tests/integrations/test_families.py"),
    # Patched models, then compiled (inductor compiles every family, shard 19): on an H200 the three
    # files had run 80 of their 90 tests when a 470 s call ended (2026-11-27, beside shards 17, 18).
    "8": ("tests/integrations/test_patching.py", "tests/integrations/test_frameworks.py"),
    "9": ("tests/integrations/test_kernels_mapping.py", "tests/integrations/test_trl.py"),  # kernels, TRL
    "10": ("tests/ops/test_dyt.py", "tests/nn/test_dyt.py", "tests/ops/test_poly_norm.py", "tests/nn/test_poly_norm.py",
           "tests/ops/test_modulated_rms_norm.py", "tests/nn/test_modulated_rms_norm.py",
           "tests/ops/test_group_norm.py", "tests/nn/test_group_norm.py"),  # issue 16's norms
    "11": ("tests/ops/test_fused_moe.py", "tests/nn/test_fused_moe.py", "tests/ops/test_mhc.py",
           "tests/nn/test_mhc.py"),  # MoE and attention-side ops
    "12": (  # post-training losses on the chunk driver
        "tests/ops/test_chunked_head.py", "tests/ops/test_fused_linear_dpo.py", "tests/ops/test_fused_linear_simpo.py",
        "tests/ops/test_fused_linear_orpo.py", "tests/ops/test_fused_linear_cpo.py",
        "tests/ops/test_fused_linear_kto.py", "tests/ops/test_fused_linear_grpo.py",
        "tests/ops/test_fused_linear_distill.py", "tests/nn/test_posttrain.py",
        "tests/ops/test_fused_linear_logprobs.py", "tests/ops/test_matmul.py",
    ),
    "13": (  # row activations and TVD (issue 16)
        "tests/ops/test_softmax.py", "tests/nn/test_softmax.py", "tests/ops/test_sparsemax.py",
        "tests/nn/test_sparsemax.py", "tests/ops/test_relu_squared.py", "tests/nn/test_relu_squared.py",
        "tests/ops/test_tvd.py", "tests/nn/test_tvd.py", "tests/ops/test_small_calls.py",
    ),
    # Two ranks: NCCL where two GPUs are visible, else gloo on the CPU (the GPU hidden).
    "14": ("tests/distributed",),
    "15": (  # issue 16's last ops: attention-side and the scaled fused linear cross entropy
        "tests/ops/test_multi_token_attention.py", "tests/nn/test_multi_token_attention.py",
        "tests/ops/test_neighborhood_attention.py", "tests/nn/test_neighborhood_attention.py",
        "tests/ops/test_fused_linear_scaled_cross_entropy.py", "tests/nn/test_fused_linear_scaled_cross_entropy.py",
    ),
    # Shard 8's other files, split off on an H200 (2026-11-27): these two and the first 49 of the
    # harness's 75 tests took the whole 430 s of a device call; alone these two took 35 s.
    "16": ("tests/integrations/test_cuda_graph.py", "tests/integrations/test_causal_mask.py"),  # graphs, SDPA
    # The benchmark harness, timing on the device; every op's first D1 point at full size (20: 37 of
    # the 40 ops took most of a 470 s call beside shards 8 and 18 on an H200; alone on an H100 after
    # the frozen heap, 2026-11-28: 17 in 20 s, 20 in about 250 s).
    "17": ("tests/bench/test_harness.py", "tests/bench/test_gemm_limit.py", "tests/bench/test_input_layouts.py",
           "tests/bench/test_small_call_routes.py"),
    "18": (  # the command line, the device and tiling, the tools, direct launches
        "tests/test_cli.py", "tests/test_device.py", "tests/test_tiling.py", "tests/test_gpu_shards.py",
        "tests/test_host_path.py", "tests/test_kernel_times.py", "tests/test_step_kernels.py",
        "tests/test_kernel_variants.py",
        "tests/ops/test_launch.py", "tests/ops/test_rows.py",
    ),
    # Every text family under torch.compile (inductor): on an H200 alone (2026-11-28) the file with
    # the multimodal families in it had run 44 of its 58 tests when a 380 s call ended: those 16 are
    # shard 21 (alone on an H100, 2026-11-28: its 15 tests in 206 s).
    "19": ("tests/integrations/test_compile.py",),
    "20": ("tests/bench/test_declarations.py",),
    "21": ("tests/integrations/test_compile_multimodal.py",),  # the multimodal families compiled
}
# Shards whose tests run kernels (what memcheck is for).
KERNEL_SHARDS = ("1", "2", "3", "4", "5", "6", "10", "11", "12", "13", "15")


def command(shard: str, memcheck: bool, pytest_args: list[str],
            times: str | None = None) -> tuple[list[str], dict[str, str]]:
    env = dict(os.environ, ONCA_TEST_SCALE="cpu" if memcheck else "gpu", PYTHONUNBUFFERED="1",
               ONCA_MEMCHECK="1" if memcheck else "0")
    if times:  # tests/conftest.py appends each test's seconds there as it ends
        env["ONCA_TEST_TIMES"] = os.path.join(times, f"shard-{shard}.tsv")
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *SHARDS[shard], *pytest_args]
    if memcheck:
        sanitizer = shutil.which("compute-sanitizer") or "compute-sanitizer"
        # --error-exitcode: a memory error fails the run even when the test itself passed.
        # --report-api-errors no: NCCL's init probes kernels this device has no image for, which
        # the sanitizer counts as errors (48 in shard 5, all from NCCL); Onca calls no CUDA API
        # itself, and a failed launch of its own raises in the test anyway.
        cmd = [sanitizer, "--tool", "memcheck", "--report-api-errors", "no", "--target-processes", "all",
               "--error-exitcode", "97",
               "--print-limit", "20", *cmd]
    return cmd, env


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    pytest_args = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(prog="python -m tools.gpu_tests", description=__doc__.split("\n")[0])
    parser.add_argument("shard", nargs="?", help=f"one of {', '.join(SHARDS)}, or all")
    parser.add_argument("--list", action="store_true", help="print the shards and exit")
    parser.add_argument("--memcheck", action="store_true", help="under compute-sanitizer memcheck, CI scale")
    parser.add_argument("--times", metavar="DIR", help="append each test's seconds and outcome to "
                        "DIR/shard-N.tsv as it ends (kept when a device call's time limit cuts the run)")
    args = parser.parse_args(argv)
    if args.list or not args.shard:
        for name, files in SHARDS.items():
            print(f"{name}: {' '.join(files)}")
        return 0
    if args.shard != "all" and args.shard not in SHARDS:
        parser.error(f"unknown shard {args.shard!r}; shards: {', '.join(SHARDS)}, all")
    shards = list(KERNEL_SHARDS if args.memcheck else SHARDS) if args.shard == "all" else [args.shard]
    if args.times:
        os.makedirs(args.times, exist_ok=True)
    status = 0
    for shard in shards:
        cmd, env = command(shard, args.memcheck, pytest_args, args.times)
        print(f"== shard {shard}: {' '.join(cmd)}", flush=True)
        start = time.perf_counter()
        code = subprocess.call(cmd, env=env)
        # The shard's time, so that a shard that outgrows one device call shows it.
        print(f"== shard {shard}: exit {code} in {time.perf_counter() - start:.0f} s", flush=True)
        status = status or code
    return status


if __name__ == "__main__":
    raise SystemExit(main())
