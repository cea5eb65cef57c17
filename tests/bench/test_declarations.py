"""Every op's benchmark declaration, and its first D1 point run on this device (the harness's
smoke-test size on the CPU; at GPU scale, 40 ops' first points at full size: a GPU shard of its own)."""

from __future__ import annotations

import pytest
import torch

from onca.bench import harness


@pytest.mark.parametrize("op", harness.list_ops())
def test_every_op_benchmark_declaration(op, device):
    """Each op declares D1 and D2 sweeps, positive estimates, and runs the first point of its first D1
    sweep here."""
    bench = harness.load(op)
    assert bench.name == op
    assert bench.sweep("d1") and bench.sweep("d2")
    for provider in bench.providers:  # the harness's own and the op's peers
        for mode in bench.modes:
            assert bench.memory_estimate(bench.probe, torch.bfloat16, provider, mode) > 0
    # Short timings (a GPU's default times each call for 100 ms, 40 ops' first points): what is
    # tested is that the point runs and is recorded, not its time.
    settings = harness.Settings(device=device, dtype=torch.float32, providers=("onca", "torch"), peers=False,
                                modes=("forward", "full"), cpu_reps=1, max_points=1, warmup_ms=1, rep_ms=5)
    new = harness.Harness(settings, progress=False).run(bench, bench.sweep("d1")[:1])
    statuses = {p.status for r in new if r.metric_name == "speed" for p in r.points}
    assert statuses == {"ok"}, [(r.kernel_provider, p.note) for r in new for p in r.points if p.status != "ok"]


def test_neighborhood_attention_refuses_liger_above_its_int32_scores():
    """liger-kernel's neighborhood attention faults from 2**31 scores (an illegal memory access
    that ends a sweep's process): its factory refuses those points, named in the error, before
    importing liger-kernel; the sweep records them as errors and goes on."""
    from onca.bench.ops import neighborhood_attention as na

    largest = {"batch": 2, "heads": 16, "seq": 8192, "head_dim": 128}  # 2**31 scores
    with pytest.raises(NotImplementedError, match="2147483648 scores"):
        na.liger(largest, {})
    below = {**largest, "seq": 4096}
    assert below["batch"] * below["heads"] * below["seq"] ** 2 <= na.LIGER_MAX_SCORES
    try:  # below the limit the factory goes on to liger-kernel (absent in CI)
        na.liger(below, {"q": None, "k": None, "v": None})
    except ImportError:
        pass
