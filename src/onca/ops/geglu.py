"""GeGLU: ``c = gelu(a) * b`` (``a``: gate projection, ``b``: up projection, ``(..., intermediate)``).

``approximate="tanh"`` is PyTorch's ``gelu(approximate="tanh")`` (Gemma's ``gelu_pytorch_tanh``),
evaluated as ``a * sigmoid(2u)``, the same function as ``0.5 * a * (1 + tanh(u))`` without its
cancellation for negative ``a`` (closer to float64 than PyTorch's own fp32 kernel);
``approximate="none"`` is the exact ``a * Phi(a)`` with ``erf``. The kernels are the
gated-activation kernels of :mod:`onca.ops._glu`; that module's docstring describes rounding,
layouts and memory. In short:

- forward: ``gelu(a)`` in fp32, rounded to the input dtype, times ``b`` in fp32, rounded (as
  ``act_fn(gate_proj(x)) * up_proj(x)`` in Gemma's MLP);
- backward: ``db = dc * gelu(a)``, ``da = dc * b * gelu'(a)``, ``gelu(a)`` recomputed from the saved
  ``a`` (saved for backward: ``a`` and ``b``, nothing else);
- strided row views of ``a``/``b`` are taken without a copy; ``b=None`` passes a fused
  ``[gate | up]`` tensor; ``overwrite_inputs=True`` writes ``da``/``db`` over ``a``/``b``;
- :func:`geglu_linear` is the MLP tail ``linear(gelu(a) * b, W, bias)`` that stores no product.

Custom ops: ``onca::geglu_forward``/``geglu_backward`` and
``onca::geglu_linear_forward``/``geglu_linear_backward`` (the GELU form is their ``activation``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from onca.device import DeviceProfile
from onca.ops import _glu
from onca.tiling import RowPlan

__all__ = ["geglu", "geglu_linear", "plan", "APPROXIMATIONS"]

# ``approximate`` argument -> the kernels' activation.
APPROXIMATIONS = {"tanh": "gelu_tanh", "none": "gelu"}

geglu_forward, geglu_backward = _glu.register_gated("geglu")
geglu_linear_forward, geglu_linear_backward = _glu.register_gated_linear("geglu_linear")


def plan(shape, dtype: torch.dtype, profile: DeviceProfile | None = None) -> dict[str, RowPlan]:
    """The forward, backward and MLP-tail backward plans for ``a`` of ``shape`` ``(..., I)``."""
    return _glu.plan(shape, dtype, profile)


def _activation(approximate) -> str:
    if approximate not in APPROXIMATIONS:
        raise ValueError(f"approximate must be one of {sorted(APPROXIMATIONS)}, got {approximate!r}")
    return APPROXIMATIONS[approximate]


def geglu(a: Tensor, b: Tensor | None = None, approximate: str = "tanh",
          overwrite_inputs: bool = False) -> Tensor:
    """GeGLU ``gelu(a) * b``; ``approximate="tanh"`` (Gemma's ``gelu_pytorch_tanh``) or ``"none"``
    (exact erf). Layouts, ``b=None``, empty inputs and ``overwrite_inputs`` as in
    :func:`onca.ops.swiglu.swiglu`."""
    return _glu.gated(geglu_forward, a, b, _activation(approximate), 1.0, 1.0, overwrite_inputs)


def geglu_linear(a: Tensor, b: Tensor | None, weight: Tensor, bias: Tensor | None = None,
                 approximate: str = "tanh", overwrite_inputs: bool = False) -> Tensor:
    """The GeGLU MLP tail ``linear(gelu(a) * b, weight, bias)``, as
    :func:`onca.ops.swiglu.swiglu_linear`."""
    return _glu.gated_linear(geglu_linear_forward, a, b, weight, bias, _activation(approximate), 1.0, 1.0,
                             overwrite_inputs)
