"""Every op whose benchmark call at its overhead point takes torch's small-call route
(:mod:`onca.ops._small_calls`) returns what its kernels return there: the same outputs (dtype,
shape, values to the dtype's rounding) and the same gradients, on the benchmark's own inputs, fp32
and bf16. The hand-made cases of ``tests/ops/test_small_calls.py`` hold each route's options; this
holds the two routes to each other at the size a user's small call has.

The rotary embeddings' benchmarks run in place (see ``test_input_layouts.py``) and take no route.
"""

from __future__ import annotations

import pytest
import torch

from onca.bench import harness
from onca.bench.spec import build
from onca.ops import _small_calls as small_calls

IN_PLACE_BENCHMARKS = {"rope", "multimodal_rope", "llama4_rope"}
# Tolerance relative to the kernels' largest magnitude, by dtype.
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}
# Gradients looser than TOLERANCE, and why. DyT's alpha is one number summed over every element:
# torch's route rounds each bf16 product before the sum (3.2% from an fp64 reference on these
# inputs, where the kernels, summing fp32 products, are 0.29% from it), which is torch's own
# DynamicTanh in bf16.
LOOSER_GRADIENTS = {("dyt", "alpha", torch.bfloat16): 5e-2}


def _run(bench, params, inputs) -> tuple[list[torch.Tensor], dict]:
    """Outputs and the leaves' gradients of the benchmark's Onca call, the seeds fixed."""
    leaves = {k: v for k, v in inputs.items() if isinstance(v, torch.Tensor) and v.requires_grad}
    result = build(bench.onca, params, inputs)()
    items = result if isinstance(result, (tuple, list)) else (result,)
    outs = [o for o in items if isinstance(o, torch.Tensor)]
    differentiable = [o for o in outs if o.requires_grad]
    generator = torch.Generator().manual_seed(3)
    if differentiable:
        torch.autograd.backward(differentiable,
                                [torch.randn(o.shape, generator=generator).to(o) for o in differentiable])
    return [o.detach() for o in outs], {k: v.grad for k, v in leaves.items()}


def _close(got: torch.Tensor, want: torch.Tensor, tolerance: float, name: str) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, (
        f"{name}: {got.dtype} {tuple(got.shape)} on torch's route, "
        f"{want.dtype} {tuple(want.shape)} from the kernels")
    if want.numel():
        scale = max(1e-3, want.float().abs().max().item())
        torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=tolerance * scale, equal_nan=True,
                                   msg=name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("op", sorted(set(harness.list_ops()) - IN_PLACE_BENCHMARKS))
def test_a_small_call_returns_what_the_kernels_return(op, dtype, device, monkeypatch):
    bench = harness.load(op)
    params = dict(bench.overhead_sweep().points[0][1])
    torch.manual_seed(0)
    made = bench.make_inputs(params, dtype, device)
    monkeypatch.setattr(small_calls, "DEVICE_TYPES", (device,))

    def run(limit: int) -> tuple[list[torch.Tensor], dict, int]:
        previous = small_calls.set_limit(limit)
        try:
            inputs = {k: v.detach().clone().requires_grad_(v.requires_grad)
                      if isinstance(v, torch.Tensor) else v for k, v in made.items()}
            before = small_calls.taken
            return (*_run(bench, params, inputs), small_calls.taken - before)
        finally:
            small_calls.set_limit(previous)

    outs, grads, routed = run(small_calls.DEFAULT_LIMIT)  # torch's route, where the call takes it
    if not routed:
        pytest.skip(f"{op}: its overhead call keeps Onca's op")
    want_outs, want_grads, kernels_routed = run(0)  # the kernels
    assert kernels_routed == 0
    assert len(outs) == len(want_outs)
    for i, (got, want) in enumerate(zip(outs, want_outs)):
        _close(got, want, TOLERANCE[dtype], f"{op} output {i}")
    for name, want in want_grads.items():
        got = grads[name]
        assert (got is None) == (want is None), f"{op}: gradient of {name} on one route only"
        if want is not None:
            tolerance = LOOSER_GRADIENTS.get((op, name, dtype), TOLERANCE[dtype])
            _close(got, want, tolerance, f"{op} gradient of {name}")
