"""``tools.kernel_times`` (per-kernel device time of a benchmark point) runs its steps on any machine:
on the CPU it lists torch's CPU ops, which checks the point, the providers and the step."""

from __future__ import annotations

import pytest
import torch

from tools.kernel_times import idle_gaps, main, point_params
from onca.bench import harness


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU listing; on a GPU it times kernels")
def test_lists_each_provider_and_reports_failures(capsys):
    providers = ["onca", "torch", "torch_compile", "nope"]
    assert main(["rms_norm", "--small", *providers, "--top", "3", "--steps", "2"]) == 0
    out = capsys.readouterr().out
    assert "== rms_norm onca {'tokens': 16, 'hidden': 1024} (CPU ops, not a measurement)" in out
    assert "== rms_norm torch" in out and "aten::" in out
    # The harness's compiled provider runs (its top ops differ between runs: no op name checked).
    assert "== rms_norm torch_compile {" in out and "torch_compile: failed" not in out
    assert "== rms_norm nope: failed: ValueError: rms_norm has no provider 'nope'" in out


def test_points_are_the_benchmarks_own():
    bench = harness.load("mhc")
    assert point_params(bench, "qwen3-0.6b") == {"model": "qwen3-0.6b", "tokens": 8192, "hc": 4, "c": 1024}
    with pytest.raises(SystemExit, match="no D2 point 'gpt-2'"):
        point_params(bench, "gpt-2")


def test_idle_gaps_name_the_kernels_and_the_launching_host_op():
    """Kernels at 0-10, 12-20 (overlapping 15-18) and 50-60 us: gaps of 30 and 2 us, the longest
    first, the one after the gap launched inside aten::mm."""
    def kernel(name, ts, dur, corr):
        return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"correlation": corr}}

    trace = {"traceEvents": [
        kernel("a", 0, 10, 1), kernel("b", 12, 8, 2), kernel("c", 15, 3, 3), kernel("d", 50, 10, 4),
        {"ph": "X", "cat": "cpu_op", "name": "onca::op", "ts": 30, "dur": 30},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 40, "dur": 5},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 41, "dur": 1,
         "args": {"correlation": 4}},
    ]}
    span, gaps = idle_gaps(trace, 5)
    assert span == 60
    assert gaps == [(30, "c", "d", "aten::mm"), (2, "a", "b", "?")]
    assert idle_gaps({"traceEvents": []}, 3) == (0.0, [])
