"""The op contract: every op's kernels are reached through PyTorch custom ops in the ``onca``
namespace, so that ``torch.compile(fullgraph=True)`` traces a whole model without a break, CUDA
graphs capture it, and ``torch.library.opcheck`` can check it.

An op file declares its launchers with :func:`custom_op` (a thin layer over
``torch.library.custom_op``) and gives each a fake implementation (shapes and dtypes only), then
registers the differentiable ones with :func:`register_autograd`. Calling the resulting
:class:`Op` picks the route:

- **eager** (plain tensors, nothing tracing): the launcher runs directly, and a differentiable
  op goes through a ``torch.autograd.Function`` built from the same ``setup_context`` and
  ``backward``. This skips the dispatcher's Python custom-op layers, which cost tens of
  microseconds per call: at small and medium sizes that is more than the kernel.
- **traced** (``torch.compile``, ``make_fx``, fake tensors, tensor subclasses, dispatch modes):
  the registered ``torch.ops.onca.*`` op, which tracers see as one opaque node whose shapes come
  from its fake implementation.

Both routes run the same launcher, fake-free, and the same backward formula: the route changes
nothing but the Python path to the kernel. Launchers never synchronise with the host (no
``.item()``, ``.tolist()``, ``bool(tensor)``): counts and scales stay on the device.
"""

from __future__ import annotations

import torch

__all__ = ["NAMESPACE", "OPS", "Op", "PLAIN_TYPES", "custom_op", "register_autograd", "tracing"]

NAMESPACE = "onca"

# Every registered op by its name in the namespace (tests walk it: every op is checked).
OPS: dict[str, Op] = {}

# Tensor types the launchers can run on directly; anything else (FakeTensor, FunctionalTensor,
# DTensor, other subclasses) goes through the dispatcher.
PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)


def tracing(*tensors) -> bool:
    """Whether these tensors are being traced rather than computed (the registered op's route)."""
    if torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() > 0:
        return True
    return any(t is not None and type(t) not in PLAIN_TYPES for t in tensors)


# The argument types an op call passes on the eager route without a closer look: plain tensors and
# the schema's scalars. A set lookup of the type before isinstance: 0.5 against 1.4 us for an
# 11-argument call on the CI host (every op call pays it, forward and backward).
_EAGER_ARGUMENT_TYPES = frozenset({*PLAIN_TYPES, int, float, bool, str, type(None), torch.dtype})


def _traced(args: tuple) -> bool:
    """:func:`tracing` of an op's arguments, whatever their types: one loop, it runs every call."""
    if torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() > 0:
        return True
    for a in args:
        if type(a) not in _EAGER_ARGUMENT_TYPES and isinstance(a, torch.Tensor):
            return True
    return False


class Op:
    """One launcher registered as ``torch.ops.onca.<name>``, callable on either route."""

    def __init__(self, name: str, fn, mutates_args):
        self.name = name
        self.fn = fn
        self.registered = torch.library.custom_op(f"{NAMESPACE}::{name}", fn, mutates_args=mutates_args)
        self._function = None  # the eager autograd.Function, once register_autograd has run
        OPS[name] = self

    def register_fake(self, fake):
        self.registered.register_fake(fake)
        return fake

    @property
    def differentiable(self) -> bool:
        return self._function is not None

    @property
    def overload(self):
        """``torch.ops.onca.<name>.default``: what tracers record and what opcheck checks."""
        return getattr(getattr(torch.ops, NAMESPACE), self.name).default

    def __call__(self, *args):
        if _traced(args):
            return self.registered(*args)
        if self._function is not None and torch.is_grad_enabled():
            return self._function.apply(*args)
        return self.fn(*args)


def custom_op(name: str, *, mutates_args=()):
    """Decorator: register a launcher as ``torch.ops.onca.<name>`` and return its :class:`Op`.

    The launcher's type annotations are its schema (``torch.library.custom_op``'s rules): tensors,
    ``float``, ``int``, ``bool``, ``str``, optional tensors, lists of those; outputs are tensors
    or tuples of tensors that never alias an input.
    """

    def wrap(fn) -> Op:
        return Op(name, fn, mutates_args)

    return wrap


def register_autograd(op: Op, backward, *, setup_context, materialize_grads: bool = False) -> None:
    """Register ``backward``/``setup_context`` for ``op`` on both routes.

    ``setup_context(ctx, inputs, output)`` and ``backward(ctx, *grads)`` follow
    ``torch.library.register_autograd``; ``backward`` calls the op's backward :class:`Op`, which
    picks its own route, so the compiled graph records it as a custom op too.

    An output that received no gradient reaches ``backward`` as None, not as zeros: autograd would
    otherwise allocate and fill a zero tensor for every output nothing used, the non-differentiable
    ones included (a head-sized one for the weight gradient fused linear cross entropy returns, a
    logits-sized one for cross entropy's, one fill launch per statistic for the norms).
    ``materialize_grads=True`` is for a backward that needs every output's gradient as a tensor.
    """

    def setup(ctx, inputs, output):
        ctx.set_materialize_grads(materialize_grads)
        setup_context(ctx, inputs, output)

    op.registered.register_autograd(backward, setup_context=setup)

    # Old-style forward(ctx, *args) on purpose: a Function with its own setup_context binds its
    # arguments through inspect.signature on every call, tens of microseconds per call.
    def forward(ctx, *args):
        output = op.fn(*args)
        setup(ctx, args, output)
        return output

    op._function = type(
        f"{op.name}_function",
        (torch.autograd.Function,),
        {"forward": staticmethod(forward), "backward": staticmethod(backward)},
    )
