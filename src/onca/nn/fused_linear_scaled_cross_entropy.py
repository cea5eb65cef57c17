"""``onca.nn.FusedLinearScaledCrossEntropy``: per-token NLL (and entropy) of an LM head's
temperature-scaled logits, without the logits."""

from __future__ import annotations

import torch
from torch import nn

from onca.ops._chunked_head import check_options
from onca.ops._validate import check_bool
from onca.ops.fused_linear_scaled_cross_entropy import fused_linear_scaled_cross_entropy


class FusedLinearScaledCrossEntropy(nn.Module):
    """Per-token ``-log_softmax((hidden @ weight.T + bias) / temperature)[target]`` (fp32, 0 where
    ignored) and, with ``return_entropy=True``, each token's entropy in ``hidden``'s dtype, as
    liger-kernel's ``LigerFusedLinearScaledCrossEntropyFunction`` (an RL trainer's log-probabilities
    and entropy bonus). ``forward(hidden, weight, target, bias=None)``: the head's weight is an
    argument (it belongs to the model), so this module has no parameters. See
    :func:`onca.ops.fused_linear_scaled_cross_entropy.fused_linear_scaled_cross_entropy`.
    """

    def __init__(self, temperature: float = 1.0, ignore_index: int = -100, return_entropy: bool = False,
                 chunk_tokens: int | None = None, accum_dtype: torch.dtype | None = None,
                 keep_logits: bool = False):
        super().__init__()
        check_options(ignore_index, temperature, chunk_tokens)
        check_bool(return_entropy, "return_entropy")
        check_bool(keep_logits, "keep_logits")
        self.temperature = temperature
        self.ignore_index = ignore_index
        self.return_entropy = return_entropy
        self.chunk_tokens = chunk_tokens
        self.accum_dtype = accum_dtype
        self.keep_logits = keep_logits

    def forward(self, hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                bias: torch.Tensor | None = None):
        return fused_linear_scaled_cross_entropy(hidden, weight, target, self.temperature, self.ignore_index,
                                                 return_entropy=self.return_entropy, bias=bias,
                                                 chunk_tokens=self.chunk_tokens, accum_dtype=self.accum_dtype,
                                                 keep_logits=self.keep_logits)

    def extra_repr(self) -> str:
        return (f"temperature={self.temperature}, ignore_index={self.ignore_index}, "
                f"return_entropy={self.return_entropy}" + (", keep_logits=True" if self.keep_logits else ""))
