"""Every benchmarked op gives the same values and gradients whatever the layout of its inputs: each
op's benchmark inputs at its overhead point (fp32), once as made (contiguous) and once relaid with
the same values: ``strided``, every integer input a strided view and every float matrix column-major;
``offset``, every input a contiguous view one element into its storage (not 16-byte aligned, which
compiled Triton specializes on). A kernel that reads a tensor at unit stride without making it so
reads the wrong elements (cross entropy's targets and mHC's ``phi`` did, 2026-12-04).

The rotary embeddings' benchmarks ask for their in-place modes (the inputs rotated in place, the
gradients written over the incoming ones), which a comparison of two calls cannot line up: their
layouts are checked with the modes off in their own tests (``test_rope.py``'s non-contiguous cases).
"""

from __future__ import annotations

import pytest
import torch

from onca.bench import harness
from onca.bench.spec import build

IN_PLACE_BENCHMARKS = {"rope", "multimodal_rope", "llama4_rope"}


def _strided(t: torch.Tensor) -> torch.Tensor:
    """The values of ``t`` in every other element of a buffer twice as wide (last dimension)."""
    wide = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype, device=t.device)
    wide[..., ::2] = t
    return wide[..., ::2]


def _offset(t: torch.Tensor) -> torch.Tensor:
    """A contiguous buffer one element longer than ``t``, holding ``t``'s values from its second
    element: a view of it is contiguous but not 16-byte aligned (unless the element is 16 bytes)."""
    buffer = torch.zeros(t.numel() + 1, dtype=t.dtype, device=t.device)
    buffer[1:] = t.reshape(-1)
    return buffer


def _relaid(t: torch.Tensor, layout: str):
    """``(the tensor the op gets, the leaf that takes its gradient, the gradient as t's)``, or None
    where ``layout`` leaves ``t`` as it is."""
    grad = t.requires_grad
    if layout == "offset":
        buffer = _offset(t.detach()).requires_grad_(grad)
        return buffer[1:].view(t.shape), buffer, lambda g: g[1:].view(t.shape)
    if not t.dtype.is_floating_point:
        return _strided(t), None, None
    if t.dim() >= 2 and min(t.shape[-2:]) > 1:  # column-major: the leaf holds the matrix transposed
        storage = t.detach().transpose(-1, -2).contiguous().requires_grad_(grad)
        return storage.transpose(-1, -2), storage, lambda g: g.transpose(-1, -2)
    return None


def _layouts(inputs: dict, layout: str) -> tuple[dict, dict, list, list, list[str]]:
    """``(contiguous inputs, relaid inputs, their leaves, the relaid leaves with the map of each
    one's gradient to its input's, the names relaid)``."""
    plain, relaid, leaves, relaid_leaves, names = {}, {}, [], [], []
    for name, t in inputs.items():
        if not isinstance(t, torch.Tensor) or t.dim() == 0:
            plain[name] = relaid[name] = t
            continue
        grad = t.requires_grad
        plain[name] = t.detach().clone().requires_grad_(grad)
        other = _relaid(t, layout)
        if other is None:
            relaid[name] = plain[name].detach().clone().requires_grad_(grad)
            leaf, as_input = relaid[name], (lambda g: g)
        else:
            relaid[name], leaf, as_input = other
            names.append(name)
        if grad:
            leaves.append(plain[name])
            relaid_leaves.append((leaf, as_input))
    return plain, relaid, leaves, relaid_leaves, names


def _outputs_and_grads(bench, params, inputs, leaves):
    result = build(bench.onca, params, inputs)()
    items = result if isinstance(result, (tuple, list)) else (result,)
    outs = [o for o in items if isinstance(o, torch.Tensor)]
    differentiable = [o for o in outs if o.requires_grad]
    generator = torch.Generator().manual_seed(3)
    seeds = [torch.randn(o.shape, generator=generator).to(o) for o in differentiable]
    if differentiable:
        torch.autograd.backward(differentiable, seeds)
    return [o.detach() for o in outs], [leaf.grad for leaf in leaves]


def _same(a, b, name):
    assert (a is None) == (b is None), name
    if a is not None:
        assert a.shape == b.shape, name
        torch.testing.assert_close(a.float(), b.float(), rtol=1e-4, atol=1e-5, equal_nan=True, msg=name)


@pytest.mark.parametrize("layout", ["strided", "offset"])
@pytest.mark.parametrize("op", sorted(set(harness.list_ops()) - IN_PLACE_BENCHMARKS))
def test_every_input_layout_gives_the_same_result(op, layout, device):
    bench = harness.load(op)
    params = dict(bench.overhead_sweep().points[0][1])
    torch.manual_seed(0)
    plain, relaid, leaves, relaid_leaves, names = _layouts(bench.make_inputs(params, torch.float32, device),
                                                           layout)
    if not names:
        pytest.skip(f"{op}: no input with another layout")
    want, want_grads = _outputs_and_grads(bench, params, plain, leaves)
    got, got_grads = _outputs_and_grads(bench, params, relaid, [leaf for leaf, _ in relaid_leaves])
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        _same(a, b, f"{op} output {i} with {names} {layout}")
    for (_, as_input), a, b in zip(relaid_leaves, got_grads, want_grads):
        _same(None if a is None else as_input(a), b, f"{op} gradient with {names} {layout}")
