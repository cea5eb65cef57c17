"""``onca.nn.FusedLinearJSD``: the distillation loss over two LM heads without their logits
(liger-kernel's ``LigerFusedLinearJSD``)."""

from __future__ import annotations

import torch
from torch import nn

from onca.ops.fused_linear_jsd import REDUCTIONS, fused_linear_jsd
from onca.ops.jsd import check_beta, check_temperature


class FusedLinearJSD(nn.Module):
    """``jsd(student_hidden @ student_weight.T, teacher_hidden @ teacher_weight.T)`` at ``temperature``,
    chunked over tokens; see :mod:`onca.ops.fused_linear_jsd`. The module holds no parameters:
    ``forward(student_hidden, student_weight, teacher_hidden, teacher_weight, labels=None)`` takes
    both heads' weights (``(vocab, hidden)``, e.g. ``model.lm_head.weight``). ``accum_dtype=torch.float32``
    sums the student head's gradient over the chunks in fp32 (default: in the head's dtype)."""

    def __init__(self, beta: float = 0.5, ignore_index: int = -100, temperature: float = 1.0,
                 reduction: str = "mean", accum_dtype: torch.dtype | None = None):
        super().__init__()
        check_beta(beta)
        check_temperature(temperature)
        if reduction not in REDUCTIONS:
            raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
        self.beta = float(beta)
        self.ignore_index = ignore_index
        self.temperature = float(temperature)
        self.reduction = reduction
        floating = isinstance(accum_dtype, torch.dtype) and accum_dtype.is_floating_point
        if accum_dtype is not None and not floating:
            raise ValueError(f"accum_dtype must be None or a floating torch.dtype, got {accum_dtype!r}")
        self.accum_dtype = accum_dtype

    def forward(self, student_hidden: torch.Tensor, student_weight: torch.Tensor,
                teacher_hidden: torch.Tensor, teacher_weight: torch.Tensor,
                labels: torch.Tensor | None = None) -> torch.Tensor:
        return fused_linear_jsd(student_hidden, student_weight, teacher_hidden, teacher_weight, labels,
                                self.beta, self.ignore_index, self.temperature, self.reduction,
                                self.accum_dtype)

    def extra_repr(self) -> str:
        extras = "" if self.accum_dtype is None else f", accum_dtype={self.accum_dtype}"
        return (f"beta={self.beta}, ignore_index={self.ignore_index}, temperature={self.temperature}, "
                f"reduction={self.reduction!r}{extras}")
