"""``onca.nn.FusedLinearCrossEntropyLoss``: an LM head's matmul and cross entropy, without the logits."""

from __future__ import annotations

import torch
from torch import nn

from onca.ops.cross_entropy import validate_options
from onca.ops.fused_linear_cross_entropy import fused_linear_cross_entropy


class FusedLinearCrossEntropyLoss(nn.Module):
    """``cross_entropy(hidden @ weight.T + bias, target)`` without materialising the logits.

    ``forward(hidden, weight, target, bias=None)``: the head's weight is an argument (it belongs to
    the model, e.g. ``model.lm_head.weight``, possibly tied to the embedding), so this module has
    no parameters. Options as :class:`CrossEntropyLoss` plus ``accum_dtype`` (``torch.float32``:
    accumulate the weight gradient in fp32) and ``chunk_tokens`` (override the tokens per chunk).
    """

    def __init__(self, ignore_index: int = -100, label_smoothing: float = 0.0, reduction: str = "mean",
                 lse_square_scale: float = 0.0, softcap: float | None = None, return_z_loss: bool = False,
                 accum_dtype: torch.dtype | None = None, chunk_tokens: int | None = None):
        super().__init__()
        validate_options(ignore_index, label_smoothing, reduction, lse_square_scale, softcap)
        if accum_dtype is not None and not (isinstance(accum_dtype, torch.dtype) and accum_dtype.is_floating_point):
            raise ValueError(f"accum_dtype must be None or a floating torch.dtype, got {accum_dtype!r}")
        if chunk_tokens is not None and (isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int)
                                         or chunk_tokens < 1):
            raise ValueError(f"chunk_tokens must be None or a positive int, got {chunk_tokens!r}")
        self.ignore_index = ignore_index
        self.label_smoothing = label_smoothing
        self.reduction = reduction
        self.lse_square_scale = lse_square_scale
        self.softcap = softcap
        self.return_z_loss = return_z_loss
        self.accum_dtype = accum_dtype
        self.chunk_tokens = chunk_tokens

    def forward(self, hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                bias: torch.Tensor | None = None):
        return fused_linear_cross_entropy(
            hidden, weight, target, bias, self.ignore_index, self.label_smoothing, self.reduction,
            self.lse_square_scale, self.softcap, self.return_z_loss, self.accum_dtype, self.chunk_tokens,
        )

    def extra_repr(self) -> str:
        extras = f"ignore_index={self.ignore_index}, reduction={self.reduction!r}, label_smoothing={self.label_smoothing}"
        if self.lse_square_scale:
            extras += f", lse_square_scale={self.lse_square_scale}"
        if self.softcap is not None:
            extras += f", softcap={self.softcap}"
        if self.accum_dtype is not None:
            extras += f", accum_dtype={self.accum_dtype}"
        return extras
