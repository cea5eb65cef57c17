"""``onca.nn.LayerNorm``: a drop-in for ``torch.nn.LayerNorm`` over the last dimension."""

from __future__ import annotations

import numbers

import torch
from torch import nn

from onca.ops.layer_norm import layer_norm


class LayerNorm(nn.LayerNorm):
    """``torch.nn.LayerNorm`` over the last dimension, backed by Onca's kernels.

    Same constructor, attributes (``normalized_shape``, ``eps``, ``elementwise_affine``), parameter
    names (``weight``, ``bias``), initialisation and state dict as ``torch.nn.LayerNorm``, and an
    instance of it, so code that checks ``isinstance(m, nn.LayerNorm)`` (weight initialisation,
    optimiser parameter groups) treats it the same. ``normalized_shape`` must be an int or a
    1-element shape: normalising over several trailing dimensions is not supported.
    """

    def __init__(
        self,
        normalized_shape,
        eps: float = 1e-5,
        elementwise_affine: bool = True,
        bias: bool = True,
        device=None,
        dtype=None,
    ):
        shape = (normalized_shape,) if isinstance(normalized_shape, numbers.Integral) else normalized_shape
        if (isinstance(shape, (str, bytes)) or not hasattr(shape, "__iter__")
                or not all(isinstance(s, numbers.Integral) for s in shape)):
            raise TypeError(f"normalized_shape must be an int or a 1-element shape, got {normalized_shape!r}")
        shape = tuple(int(s) for s in shape)
        if len(shape) != 1:
            raise ValueError(
                f"onca.nn.LayerNorm normalises over the last dimension only: normalized_shape must be an "
                f"int or a 1-element shape, got {tuple(shape)}; use torch.nn.LayerNorm for several dimensions"
            )
        if shape[0] <= 0:
            raise ValueError(f"normalized_shape must be positive, got {shape[0]}")
        super().__init__(shape, eps, elementwise_affine, bias, device, dtype)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        hidden = self.normalized_shape[0]
        if not isinstance(input, torch.Tensor):
            raise TypeError(f"input must be a torch.Tensor, got {type(input).__name__}")
        if input.dim() == 0 or input.shape[-1] != hidden:
            raise ValueError(
                f"input must have last dimension {hidden} (normalized_shape), got shape {tuple(input.shape)}"
            )
        return layer_norm(input, self.weight, self.bias, self.eps)
