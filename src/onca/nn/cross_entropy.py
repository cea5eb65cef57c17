"""``onca.nn.CrossEntropyLoss``: a drop-in for ``torch.nn.CrossEntropyLoss`` with z-loss, soft-capping and
token metrics."""

from __future__ import annotations

import torch
from torch import nn

from onca.ops._validate import check_float
from onca.ops.cross_entropy import cross_entropy, validate_options


def _legacy_reduction(size_average, reduce, reduction: str) -> str:
    """torch's deprecated ``size_average`` / ``reduce`` arguments, mapped as torch maps them."""
    if size_average is None and reduce is None:
        return reduction
    from torch.nn import _reduction

    return _reduction.legacy_get_string(size_average, reduce, emit_warning=True)


class CrossEntropyLoss(nn.Module):
    """Drop-in for ``torch.nn.CrossEntropyLoss`` over ``(..., vocab)`` logits and class-index targets.

    Same constructor as torch's (``weight``: per-class weights ``(vocab,)``, a buffer as in torch),
    plus ``lse_square_scale`` (z-loss), ``softcap`` (Gemma 2 logit soft-capping),
    ``return_z_loss`` (``forward`` returns ``(loss, z_loss)``), ``return_token_accuracy`` and
    ``return_predicted_tokens`` (``forward`` returns a ``CrossEntropyOutput``, as liger-kernel's
    module) and ``overwrite_logits`` (the gradient is written over the logits in the forward pass;
    the logits are destroyed). See :func:`onca.ops.cross_entropy.cross_entropy`.
    The vocabulary is the last dimension (torch puts classes at dim 1 for inputs of more than two
    dimensions); with 2-D ``(N, C)`` inputs the two agree. All ignored under ``reduction="mean"``
    gives NaN, as torch.
    """

    def __init__(self, weight=None, size_average=None, ignore_index: int = -100, reduce=None,
                 reduction: str = "mean", label_smoothing: float = 0.0, *, lse_square_scale: float = 0.0,
                 softcap: float | None = None, return_z_loss: bool = False, overwrite_logits: bool = False,
                 return_token_accuracy: bool = False, return_predicted_tokens: bool = False):
        super().__init__()
        if weight is not None:
            check_float(weight, "weight")
        self.register_buffer("weight", weight)
        reduction = _legacy_reduction(size_average, reduce, reduction)
        validate_options(ignore_index, label_smoothing, reduction, lse_square_scale, softcap)
        self.ignore_index = ignore_index
        self.reduction = reduction
        self.label_smoothing = label_smoothing
        self.lse_square_scale = lse_square_scale
        self.softcap = softcap
        self.return_z_loss = return_z_loss
        self.overwrite_logits = overwrite_logits
        self.return_token_accuracy = return_token_accuracy
        self.return_predicted_tokens = return_predicted_tokens

    def forward(self, input: torch.Tensor, target: torch.Tensor):
        return cross_entropy(input, target, self.ignore_index, self.label_smoothing, self.reduction,
                             self.lse_square_scale, self.softcap, self.return_z_loss, self.overwrite_logits,
                             weight=self.weight, return_token_accuracy=self.return_token_accuracy,
                             return_predicted_tokens=self.return_predicted_tokens)

    def extra_repr(self) -> str:
        extras = f"ignore_index={self.ignore_index}, reduction={self.reduction!r}, label_smoothing={self.label_smoothing}"
        if self.lse_square_scale:
            extras += f", lse_square_scale={self.lse_square_scale}"
        if self.softcap is not None:
            extras += f", softcap={self.softcap}"
        if self.overwrite_logits:
            extras += ", overwrite_logits=True"
        return extras
