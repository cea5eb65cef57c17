"""``tools.kernel_times`` (per-kernel device time of a benchmark point) runs its steps on any machine:
on the CPU it lists torch's CPU ops, which checks the point, the providers and the step."""

from __future__ import annotations

import pytest
import torch

from tools.kernel_times import main, point_params
from onca.bench import harness


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU listing; on a GPU it times kernels")
def test_lists_each_provider_and_reports_failures(capsys):
    assert main(["rms_norm", "--small", "onca", "torch", "nope", "--top", "3", "--steps", "2"]) == 0
    out = capsys.readouterr().out
    assert "== rms_norm onca {'tokens': 16, 'hidden': 1024} (CPU ops, not a measurement)" in out
    assert "== rms_norm torch" in out and "aten::" in out
    assert "== rms_norm nope: failed: ValueError: rms_norm has no provider 'nope'" in out


def test_points_are_the_benchmarks_own():
    bench = harness.load("mhc")
    assert point_params(bench, "qwen3-0.6b") == {"model": "qwen3-0.6b", "tokens": 8192, "hc": 4, "c": 1024}
    with pytest.raises(SystemExit, match="no D2 point 'gpt-2'"):
        point_params(bench, "gpt-2")
