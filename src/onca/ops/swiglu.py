"""SwiGLU: ``c = silu(a) * b`` (``a``: gate projection, ``b``: up projection, ``(..., intermediate)``).

The kernels are the gated-activation kernels of :mod:`onca.ops._glu` with the SiLU activation;
that module's docstring describes rounding, layouts, multipliers and memory. In short:

- forward: ``silu(a)`` in fp32, rounded to the input dtype, times ``b`` in fp32, rounded (as
  ``act_fn(gate_proj(x)) * up_proj(x)`` in the Hugging Face MLPs);
- backward: ``db = dc * silu(a)``, ``da = dc * b * silu'(a)``, with ``silu(a)`` recomputed from the
  saved ``a`` (saved for backward: ``a`` and ``b``, nothing else);
- ``a`` and ``b`` may be strided row views (the two halves of Phi-3's fused ``gate_up_proj``
  output), taken without a copy; ``b=None`` passes the fused ``[gate | up]`` tensor itself;
- ``overwrite_inputs=True`` writes ``da``/``db`` over ``a``/``b`` (no allocation in the backward);
- ``gate_multiplier``/``down_multiplier``: Falcon-H1's ``mlp_multipliers`` (muP scaling);
- :func:`swiglu_linear` is the MLP tail ``linear(silu(a) * b, W, bias)`` that stores no product.

Custom ops: ``onca::swiglu_forward``/``swiglu_backward`` and
``onca::swiglu_linear_forward``/``swiglu_linear_backward``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from onca.device import DeviceProfile
from onca.ops import _glu
from onca.tiling import RowPlan

__all__ = ["swiglu", "swiglu_linear", "plan"]

swiglu_forward, swiglu_backward = _glu.register_gated("swiglu")
swiglu_linear_forward, swiglu_linear_backward = _glu.register_gated_linear("swiglu_linear")


def plan(shape, dtype: torch.dtype, profile: DeviceProfile | None = None) -> dict[str, RowPlan]:
    """The forward, backward and MLP-tail backward plans for ``a`` of ``shape`` ``(..., I)``."""
    return _glu.plan(shape, dtype, profile)


def swiglu(a: Tensor, b: Tensor | None = None, overwrite_inputs: bool = False, *,
           gate_multiplier: float = 1.0, down_multiplier: float = 1.0) -> Tensor:
    """SwiGLU ``silu(a) * b`` over ``(..., intermediate)``, rounded as the Hugging Face MLPs round.

    ``a`` and ``b`` (gate and up projections) may be strided row views, e.g. the halves of a fused
    ``gate_up`` output, and are not copied. ``b=None``: ``a`` is that fused ``[gate | up]`` tensor
    ``(..., 2 * intermediate)`` itself. ``a`` may have no rows. The backward recomputes
    ``silu(a)``; ``overwrite_inputs=True`` writes the gradients over ``a`` and ``b`` (no allocation;
    do not reuse ``a``/``b``; a second backward through the same graph is an error; eager only).
    ``gate_multiplier`` scales the gate before the activation (``silu(a * gate_multiplier) * b``);
    ``down_multiplier``, meant for the down projection's output, scales the product (the same for a
    down projection without bias), as liger-kernel's ``LigerSiLUMulFunction``.
    """
    return _glu.gated(swiglu_forward, a, b, "silu", gate_multiplier, down_multiplier, overwrite_inputs)


def swiglu_linear(a: Tensor, b: Tensor | None, weight: Tensor, bias: Tensor | None = None,
                  overwrite_inputs: bool = False, *, gate_multiplier: float = 1.0,
                  down_multiplier: float = 1.0) -> Tensor:
    """The SwiGLU MLP tail ``linear(silu(a) * b, weight, bias)``, keeping only ``a`` and ``b`` for
    the backward (the product is recomputed there instead of stored). ``overwrite_inputs=True``
    writes the gradients over ``a``/``b``; a second backward through the same graph is then an
    error. ``gate_multiplier`` scales the gate before the activation and ``down_multiplier`` the
    result, bias included (Falcon-H1's ``down_proj(silu(gate * m_gate) * up) * m_down``)."""
    return _glu.gated_linear(swiglu_linear_forward, a, b, weight, bias, "silu", gate_multiplier,
                             down_multiplier, overwrite_inputs)
