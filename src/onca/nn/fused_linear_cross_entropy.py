"""``onca.nn.FusedLinearCrossEntropyLoss``: an LM head's matmul and cross entropy, without the logits."""

from __future__ import annotations

import torch
from torch import nn

from onca.ops._validate import check_float
from onca.ops.cross_entropy import validate_options
from onca.ops.fused_linear_cross_entropy import fused_linear_cross_entropy


class FusedLinearCrossEntropyLoss(nn.Module):
    """``cross_entropy(hidden @ weight.T + bias, target)`` without materialising the logits.

    ``forward(hidden, weight, target, bias=None)``: the head's weight is an argument (it belongs to
    the model, e.g. ``model.lm_head.weight``, possibly tied to the embedding), so this module has
    no parameters. Options as :class:`CrossEntropyLoss` (per-class weights are ``ce_weight``, a
    buffer, as liger-kernel names them) plus ``accum_dtype`` (``torch.float32``: accumulate the
    weight gradient in fp32), ``chunk_tokens`` (override the tokens per chunk) and
    ``use_token_scaling`` (each token's loss times its detached probability of the target). See
    :func:`onca.ops.fused_linear_cross_entropy.fused_linear_cross_entropy`.
    """

    def __init__(self, ignore_index: int = -100, label_smoothing: float = 0.0, reduction: str = "mean",
                 lse_square_scale: float = 0.0, softcap: float | None = None, return_z_loss: bool = False,
                 accum_dtype: torch.dtype | None = None, chunk_tokens: int | None = None, *,
                 ce_weight: torch.Tensor | None = None, use_token_scaling: bool = False,
                 return_token_accuracy: bool = False, return_predicted_tokens: bool = False):
        super().__init__()
        if ce_weight is not None:
            check_float(ce_weight, "ce_weight")
        self.register_buffer("ce_weight", ce_weight)
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
        self.use_token_scaling = use_token_scaling
        self.return_token_accuracy = return_token_accuracy
        self.return_predicted_tokens = return_predicted_tokens

    def forward(self, hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                bias: torch.Tensor | None = None):
        return fused_linear_cross_entropy(
            hidden, weight, target, bias, self.ignore_index, self.label_smoothing, self.reduction,
            self.lse_square_scale, self.softcap, self.return_z_loss, self.accum_dtype, self.chunk_tokens,
            ce_weight=self.ce_weight, use_token_scaling=self.use_token_scaling,
            return_token_accuracy=self.return_token_accuracy,
            return_predicted_tokens=self.return_predicted_tokens,
        )

    def extra_repr(self) -> str:
        extras = f"ignore_index={self.ignore_index}, reduction={self.reduction!r}, label_smoothing={self.label_smoothing}"
        if self.lse_square_scale:
            extras += f", lse_square_scale={self.lse_square_scale}"
        if self.softcap is not None:
            extras += f", softcap={self.softcap}"
        if self.accum_dtype is not None:
            extras += f", accum_dtype={self.accum_dtype}"
        if self.use_token_scaling:
            extras += ", use_token_scaling=True"
        return extras
