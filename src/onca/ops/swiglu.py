"""SwiGLU: ``c = silu(a) * b`` (``a``: gate projection, ``b``: up projection, ``(..., intermediate)``).

The kernels are the gated-activation kernels of :mod:`onca.ops._glu` with the SiLU activation;
that module's docstring describes rounding, layouts and memory. In short:

- forward: ``silu(a)`` in fp32, rounded to the input dtype, times ``b`` in fp32, rounded (as
  ``act_fn(gate_proj(x)) * up_proj(x)`` in the Hugging Face MLPs);
- backward: ``db = dc * silu(a)``, ``da = dc * b * silu'(a)``, with ``silu(a)`` recomputed from the
  saved ``a`` (saved for backward: ``a`` and ``b``, nothing else);
- ``a`` and ``b`` may be strided row views (the two halves of Phi-3's fused ``gate_up_proj``
  output), taken without a copy; ``b=None`` passes the fused ``[gate | up]`` tensor itself;
- ``in_place=True`` writes ``da``/``db`` over ``a``/``b`` (no allocation in the backward);
- :func:`swiglu_linear` is the MLP tail ``linear(silu(a) * b, W, bias)`` that stores no product.
"""

from __future__ import annotations

import torch

from onca.device import DeviceProfile
from onca.ops import _glu
from onca.ops._glu import GLUFunction, GLULinearFunction
from onca.tiling import RowPlan

__all__ = ["swiglu", "swiglu_linear", "plan", "SwiGLUFunction", "SwiGLULinearFunction"]

# The autograd Functions (shared with GeGLU; the activation is an argument).
SwiGLUFunction = GLUFunction
SwiGLULinearFunction = GLULinearFunction


def plan(shape, dtype: torch.dtype, profile: DeviceProfile | None = None) -> dict[str, RowPlan]:
    """The forward, backward and MLP-tail backward plans for ``a`` of ``shape`` ``(..., I)``."""
    return _glu.plan(shape, dtype, profile)


def swiglu(a, b=None, in_place: bool = False, guard: bool = False) -> torch.Tensor:
    """``silu(a) * b`` over the last dimension. ``b=None``: ``a`` is the fused ``[gate | up]``
    tensor ``(..., 2 * I)`` and the result is ``(..., I)``. See the module docstring."""
    return GLUFunction.apply(a, b, "silu", in_place, guard)


def swiglu_linear(a, b, weight, bias=None, in_place: bool = False) -> torch.Tensor:
    """``linear(silu(a) * b, weight, bias)`` with the product recomputed in the backward pass."""
    return GLULinearFunction.apply(a, b, weight, bias, "silu", in_place)
