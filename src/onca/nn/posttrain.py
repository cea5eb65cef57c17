"""``torch.nn.Module`` wrappers of the post-training losses (:mod:`onca.ops.fused_linear_dpo` and
siblings): each holds its hyperparameters and takes the hidden states, the LM head's weight (and
bias) and the labels in ``forward``; no parameters of its own. The functions validate everything
at call time, so an option a module was built with that is wrong fails on the first call."""

from __future__ import annotations

from torch import nn

from onca.ops.fused_linear_cpo import fused_linear_cpo
from onca.ops.fused_linear_distill import fused_linear_distill
from onca.ops.fused_linear_dpo import fused_linear_dpo
from onca.ops.fused_linear_grpo import fused_linear_grpo
from onca.ops.fused_linear_kto import fused_linear_kto
from onca.ops.fused_linear_orpo import fused_linear_orpo
from onca.ops.fused_linear_simpo import fused_linear_simpo

__all__ = [
    "FusedLinearCPOLoss",
    "FusedLinearDPOLoss",
    "FusedLinearDistillLoss",
    "FusedLinearGRPOLoss",
    "FusedLinearKTOLoss",
    "FusedLinearORPOLoss",
    "FusedLinearSimPOLoss",
]


class _Options(nn.Module):
    _fn = None

    def __init__(self, **options):
        super().__init__()
        self.options = options

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v!r}" for k, v in self.options.items())


class FusedLinearDPOLoss(_Options):
    """:func:`onca.functional.fused_linear_dpo`; ``forward(hidden, weight, labels, ref_hidden=None,
    ref_weight=None, **tensors)`` (``bias``, ``ref_bias``, ``ref_chosen_logps``, ...)."""

    def __init__(self, beta=0.1, loss_type="sigmoid", label_smoothing=0.0, nll_weight=0.0, ignore_index=-100,
                 chunk_tokens=None, accum_dtype=None, return_aux=False):
        super().__init__(beta=beta, loss_type=loss_type, label_smoothing=label_smoothing, nll_weight=nll_weight,
                         ignore_index=ignore_index, chunk_tokens=chunk_tokens, accum_dtype=accum_dtype,
                         return_aux=return_aux)

    def forward(self, hidden, weight, labels, ref_hidden=None, ref_weight=None, **tensors):
        return fused_linear_dpo(hidden, weight, labels, ref_hidden, ref_weight, **tensors, **self.options)


class FusedLinearSimPOLoss(_Options):
    """:func:`onca.functional.fused_linear_simpo`; ``forward(hidden, weight, labels, bias=None)``."""

    def __init__(self, beta=2.0, gamma=0.5, label_smoothing=0.0, nll_weight=0.0, ignore_index=-100,
                 chunk_tokens=None, accum_dtype=None, return_aux=False):
        super().__init__(beta=beta, gamma=gamma, label_smoothing=label_smoothing, nll_weight=nll_weight,
                         ignore_index=ignore_index, chunk_tokens=chunk_tokens, accum_dtype=accum_dtype,
                         return_aux=return_aux)

    def forward(self, hidden, weight, labels, bias=None):
        return fused_linear_simpo(hidden, weight, labels, bias=bias, **self.options)


class FusedLinearORPOLoss(_Options):
    """:func:`onca.functional.fused_linear_orpo`; ``forward(hidden, weight, labels, bias=None)``."""

    def __init__(self, beta=0.1, nll_weight=1.0, ignore_index=-100, chunk_tokens=None, accum_dtype=None,
                 return_aux=False):
        super().__init__(beta=beta, nll_weight=nll_weight, ignore_index=ignore_index, chunk_tokens=chunk_tokens,
                         accum_dtype=accum_dtype, return_aux=return_aux)

    def forward(self, hidden, weight, labels, bias=None):
        return fused_linear_orpo(hidden, weight, labels, bias=bias, **self.options)


class FusedLinearCPOLoss(_Options):
    """:func:`onca.functional.fused_linear_cpo`; ``forward(hidden, weight, labels, bias=None)``."""

    def __init__(self, beta=0.1, loss_type="sigmoid", simpo_gamma=0.5, label_smoothing=0.0, nll_weight=1.0,
                 ignore_index=-100, chunk_tokens=None, accum_dtype=None, return_aux=False):
        super().__init__(beta=beta, loss_type=loss_type, simpo_gamma=simpo_gamma, label_smoothing=label_smoothing,
                         nll_weight=nll_weight, ignore_index=ignore_index, chunk_tokens=chunk_tokens,
                         accum_dtype=accum_dtype, return_aux=return_aux)

    def forward(self, hidden, weight, labels, bias=None):
        return fused_linear_cpo(hidden, weight, labels, bias=bias, **self.options)


class FusedLinearKTOLoss(_Options):
    """:func:`onca.functional.fused_linear_kto`; ``forward(hidden, weight, labels, desirable,
    ref_hidden=None, ref_weight=None, **tensors)`` (``bias``, ``ref_logps``, ``kl``, ...)."""

    def __init__(self, beta=0.1, desirable_weight=1.0, undesirable_weight=1.0, loss_type="kto", ignore_index=-100,
                 chunk_tokens=None, accum_dtype=None, return_aux=False):
        super().__init__(beta=beta, desirable_weight=desirable_weight, undesirable_weight=undesirable_weight,
                         loss_type=loss_type, ignore_index=ignore_index, chunk_tokens=chunk_tokens,
                         accum_dtype=accum_dtype, return_aux=return_aux)

    def forward(self, hidden, weight, labels, desirable, ref_hidden=None, ref_weight=None, **tensors):
        return fused_linear_kto(hidden, weight, labels, desirable, ref_hidden, ref_weight, **tensors, **self.options)


class FusedLinearGRPOLoss(_Options):
    """:func:`onca.functional.fused_linear_grpo`; ``forward(hidden, weight, labels, advantages,
    old_logps=None, ref_logps=None, **tensors)``."""

    def __init__(self, beta=0.0, epsilon_low=0.2, epsilon_high=0.2, delta=None, loss_type="dapo",
                 importance_sampling_level="token", max_completion_length=None, temperature=1.0, ignore_index=-100,
                 chunk_tokens=None, accum_dtype=None, return_aux=False):
        super().__init__(beta=beta, epsilon_low=epsilon_low, epsilon_high=epsilon_high, delta=delta,
                         loss_type=loss_type, importance_sampling_level=importance_sampling_level,
                         max_completion_length=max_completion_length, temperature=temperature,
                         ignore_index=ignore_index, chunk_tokens=chunk_tokens, accum_dtype=accum_dtype,
                         return_aux=return_aux)

    def forward(self, hidden, weight, labels, advantages, old_logps=None, ref_logps=None, **tensors):
        return fused_linear_grpo(hidden, weight, labels, advantages, old_logps, ref_logps, **tensors, **self.options)


class FusedLinearDistillLoss(_Options):
    """:func:`onca.functional.fused_linear_distill`; ``forward(student_hidden, student_weight,
    teacher_hidden, teacher_weight, labels=None, **tensors)``."""

    def __init__(self, divergence="forward_kl", beta=0.5, temperature=1.0, weight_hard_loss=0.0,
                 weight_soft_loss=1.0, ignore_index=-100, chunk_tokens=None, accum_dtype=None, return_aux=False):
        super().__init__(divergence=divergence, beta=beta, temperature=temperature,
                         weight_hard_loss=weight_hard_loss, weight_soft_loss=weight_soft_loss,
                         ignore_index=ignore_index, chunk_tokens=chunk_tokens, accum_dtype=accum_dtype,
                         return_aux=return_aux)

    def forward(self, student_hidden, student_weight, teacher_hidden, teacher_weight, labels=None, **tensors):
        return fused_linear_distill(student_hidden, student_weight, teacher_hidden, teacher_weight, labels,
                                    **tensors, **self.options)
