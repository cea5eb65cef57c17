"""GeGLU: ``c = gelu(a) * b`` (``a``: gate projection, ``b``: up projection, ``(..., intermediate)``).

``approximate="tanh"`` is PyTorch's ``gelu(approximate="tanh")`` (Gemma's ``gelu_pytorch_tanh``),
evaluated as ``a * sigmoid(2u)``, the same function as ``0.5 * a * (1 + tanh(u))`` without its
cancellation for negative ``a`` (closer to float64 than PyTorch's own fp32 kernel);
``approximate="none"`` is the exact ``a * Phi(a)`` with ``erf``. The kernels are the gated-activation kernels of :mod:`onca.ops._glu`; that module's
docstring describes rounding, layouts and memory. In short:

- forward: ``gelu(a)`` in fp32, rounded to the input dtype, times ``b`` in fp32, rounded (as
  ``act_fn(gate_proj(x)) * up_proj(x)`` in Gemma's MLP);
- backward: ``db = dc * gelu(a)``, ``da = dc * b * gelu'(a)``, ``gelu(a)`` recomputed from the saved
  ``a`` (saved for backward: ``a`` and ``b``, nothing else);
- strided row views of ``a``/``b`` are taken without a copy; ``b=None`` passes a fused
  ``[gate | up]`` tensor; ``in_place=True`` writes ``da``/``db`` over ``a``/``b``;
- :func:`geglu_linear` is the MLP tail ``linear(gelu(a) * b, W, bias)`` that stores no product.
"""

from __future__ import annotations

import torch

from onca.device import DeviceProfile
from onca.ops import _glu
from onca.ops._glu import GLUFunction, GLULinearFunction
from onca.tiling import RowPlan

__all__ = ["geglu", "geglu_linear", "plan", "APPROXIMATIONS", "GeGLUFunction", "GeGLULinearFunction"]

# ``approximate`` argument -> the kernels' activation.
APPROXIMATIONS = {"tanh": "gelu_tanh", "none": "gelu"}

GeGLUFunction = GLUFunction
GeGLULinearFunction = GLULinearFunction


def plan(shape, dtype: torch.dtype, profile: DeviceProfile | None = None) -> dict[str, RowPlan]:
    """The forward, backward and MLP-tail backward plans for ``a`` of ``shape`` ``(..., I)``."""
    return _glu.plan(shape, dtype, profile)


def _activation(approximate) -> str:
    if approximate not in APPROXIMATIONS:
        raise ValueError(f"approximate must be one of {sorted(APPROXIMATIONS)}, got {approximate!r}")
    return APPROXIMATIONS[approximate]


def geglu(a, b=None, approximate: str = "tanh", in_place: bool = False, guard: bool = False) -> torch.Tensor:
    """``gelu(a) * b`` over the last dimension. ``b=None``: ``a`` is the fused ``[gate | up]``
    tensor ``(..., 2 * I)`` and the result is ``(..., I)``. See the module docstring."""
    return GLUFunction.apply(a, b, _activation(approximate), in_place, guard)


def geglu_linear(a, b, weight, bias=None, approximate: str = "tanh", in_place: bool = False) -> torch.Tensor:
    """``linear(gelu(a) * b, weight, bias)`` with the product recomputed in the backward pass."""
    return GLULinearFunction.apply(a, b, weight, bias, _activation(approximate), in_place)
