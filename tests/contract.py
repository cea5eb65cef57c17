"""The op contract, checked the same way for every op (see ``onca/ops/_contract.py``).

An op's test file calls :func:`assert_op_contract` with a function that runs the public entry
point forward and backward on small inputs. The helper

- records every ``torch.ops.onca.*`` call that function makes (forward and backward) and runs
  ``torch.library.opcheck`` on each: schema, fake implementation, autograd registration, and
  AOT tracing with dynamic shapes;
- compiles the function with ``torch.compile(fullgraph=True)`` (a graph break is an error) and
  checks that the compiled outputs and gradients equal the eager ones;
- on a CUDA device, runs it under ``torch.cuda.set_sync_debug_mode("error")``: any host
  synchronisation in a forward or backward fails the test.
"""

from __future__ import annotations

import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from onca.ops._contract import NAMESPACE, OPS


class _RecordOncaCalls(TorchDispatchMode):
    """Records (op name, args, kwargs) of every onca op dispatched while active."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == NAMESPACE:
            copy = lambda a: a.detach().clone() if isinstance(a, torch.Tensor) else a  # noqa: E731
            self.calls.append((func._opname, [copy(a) for a in args], {k: copy(v) for k, v in kwargs.items()}))
        return func(*args, **kwargs)


def _as_tuple(out):
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def _forward_backward(fn, inputs):
    """Outputs of ``fn(*inputs)`` and the gradients of every input that requires them."""
    leaves = [t.detach().clone().requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) else t
              for t in inputs]
    outs = _as_tuple(fn(*leaves))
    diff = [o for o in outs if isinstance(o, torch.Tensor) and o.requires_grad]
    grads = []
    if diff:
        seeds = [torch.ones_like(o) if o.dim() == 0 else torch.randn_like(o) for o in diff]
        wrt = [t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad]
        grads = torch.autograd.grad(diff, wrt, seeds, allow_unused=True)
    return [o.detach() for o in outs if isinstance(o, torch.Tensor)], list(grads)


def recorded_calls(fn, inputs):
    """Every onca op call ``fn(*inputs)`` makes, forward and backward."""
    recorder = _RecordOncaCalls()
    with recorder:
        _forward_backward(fn, inputs)
    return recorder.calls


def opcheck_calls(calls) -> set[str]:
    """``torch.library.opcheck`` on each recorded call; returns the op names checked."""
    checked = set()
    for name, args, kwargs in calls:
        op = OPS[name]
        if op.differentiable:  # check the autograd registration with the floating inputs as leaves
            args = [a.requires_grad_() if isinstance(a, torch.Tensor) and a.is_floating_point() else a
                    for a in args]
        torch.library.opcheck(op.overload, tuple(args), kwargs)
        checked.add(name)
    return checked


def assert_compiles_like_eager(fn, inputs, backend: str = "aot_eager"):
    """``torch.compile(fn, fullgraph=True)`` gives eager's outputs and gradients, bit for bit."""
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend=backend, fullgraph=True)
    seed = torch.seed()
    torch.manual_seed(seed)
    expected = _forward_backward(fn, inputs)
    torch.manual_seed(seed)
    actual = _forward_backward(compiled, inputs)
    for kind, a_list, e_list in (("output", actual[0], expected[0]), ("gradient", actual[1], expected[1])):
        assert len(a_list) == len(e_list)
        for i, (a, e) in enumerate(zip(a_list, e_list)):
            assert (a is None) == (e is None), f"compiled {kind} {i}: present in one run only"
            if a is not None:
                torch.testing.assert_close(a, e, rtol=0, atol=0, equal_nan=True,
                                           msg=lambda m, i=i, kind=kind: f"compiled {kind} {i}: {m}")


@contextlib.contextmanager
def no_host_sync(device):
    """On CUDA, any synchronisation with the host inside the block raises."""
    if torch.device(device).type != "cuda":
        yield
        return
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def assert_op_contract(fn, inputs, *, expect_ops=(), backend: str = "aot_eager"):
    """The whole contract for ``fn(*inputs)`` (the public entry point, forward and backward).

    ``expect_ops``: op names that must be among those ``fn`` reaches (guards against a test that
    silently checks nothing).
    """
    device = next(t.device for t in inputs if isinstance(t, torch.Tensor))
    with no_host_sync(device):
        _forward_backward(fn, inputs)
    calls = recorded_calls(fn, inputs)
    checked = opcheck_calls(calls)
    assert checked, "the function reached no onca op"
    missing = set(expect_ops) - checked
    assert not missing, f"expected onca ops not reached: {sorted(missing)}"
    assert_compiles_like_eager(fn, inputs, backend)
