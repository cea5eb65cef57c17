"""Onca inside TRL's trainers, with one line::

    import onca.integrations.trl
    onca.integrations.trl.enable()          # or: with onca.integrations.trl.enabled(): trainer.train()

TRL (1.16) scores every token of every trainer that trains a causal LM (``SFTTrainer``,
``DPOTrainer``, ``GRPOTrainer``, ``KTOTrainer``, ``RLOOTrainer``) through its fused LM head:
``trl.trainer.utils.add_fused_lm_head`` wraps the model's forward, and
``model(..., labels=..., fused_lm_head=True)`` calls ``ChunkedLogProbFunction.apply(hidden, weight,
bias, targets, temperature, chunk_size, final_logit_softcapping, logit_scale, outputs)``, looked up
in ``trl.trainer.utils`` on every call, for the per-token log-probabilities (and entropies, top-1
flags, mean logits, ``log sum p^2``) that every one of those trainers' losses and metrics is
computed from. :func:`enable` puts :class:`ChunkedLogProbFunction` there (and in ``trl.kernels``):
the same contract on Onca's chunk driver (:func:`onca.functional.fused_linear_logprobs`'s ops).
Models patched before or after, trainers built before or after: the next forward uses Onca's.

Why this route, and not a loss per trainer: TRL's losses (DPO's eleven types, GRPO's four
aggregations, KTO's batch KL, SFT's NLL/DFT) are scalar arithmetic on the per-token log-probs; all
of their logits-sized work (the head matmuls, softmax statistics, the logits' gradient) is this one
function, which is what Onca's fused post-training losses (``fused_linear_dpo``,
``fused_linear_grpo``, ...) are built from (``onca::chunked_logprob_forward`` / ``_backward``;
where a loss's gradient is known inside the chunk loop, the paired losses, KTO and GRPO with
token-level ratios run the same kernels on chunks that compute it in the forward pass). So with
:func:`enable`, every TRL trainer runs Onca's fused losses' kernels, with TRL's own options, metrics
and scalar arithmetic kept as they are.

It composes with ``onca.apply`` (norms, MLPs, RoPE, the causal-LM loss of the plain forward), in
either order: ``apply`` wraps TRL's fused-head forward and passes ``fused_lm_head=True`` through.
Under DeepSpeed ZeRO-3 the backward gathers the head again through TRL's own
``maybe_gather_lm_head_ctx``, as TRL's function does.

Differences from TRL's kernel: ``chunk_size`` (TRL's vocabulary tile) is ignored (Onca chunks
tokens over the whole vocabulary, sized from the free device memory); a head whose dtype differs
from the hidden states' (``cast_lm_head_to_fp32``) or from the autocast dtype is cast whole
before the call (TRL casts per vocabulary tile), and its gradient is accumulated in fp32 and
rounded to that dtype once. ``enable(keep_logits=True)`` keeps each call's logits for its backward
(three head matmuls instead of TRL's four, ``tokens x vocab`` elements more memory per call).
"""

from __future__ import annotations

import contextlib
from collections import Counter

import torch
from torch import Tensor

from onca.ops._chunked_head import chunked_logprob_forward, head_inputs, logprob_grads
from onca.ops._validate import check_bool
from onca.ops.fused_linear_logprobs import OPTIONAL_OUTPUTS

__all__ = ["ChunkedLogProbFunction", "calls", "disable", "enable", "enabled", "is_enabled"]

# What enable() replaced: (module, attribute) -> the original object.
_REPLACED: dict[tuple[object, str], object] = {}
_CALLS: Counter = Counter()
# enable()'s keep_logits, read by every forward (one slot, so that a later enable() changes it).
_KEEP_LOGITS = [False]


def calls() -> dict[str, int]:
    """How many times TRL's fused head ran through Onca since import: ``{"forward": n, "backward": m}``."""
    return {"forward": _CALLS["forward"], "backward": _CALLS["backward"]}


def _gather(weight, bias):
    """TRL's ZeRO-3 gather of the head for the backward's recompute (a null context unless the
    tensors are DeepSpeed parameters)."""
    params = [p for p in (weight, bias) if p is not None and hasattr(p, "ds_status")]
    if not params:
        return contextlib.nullcontext()
    from trl.trainer.utils import maybe_gather_lm_head_ctx

    return maybe_gather_lm_head_ctx(*params)


class _Head(torch.autograd.Function):
    """Onca's forward and backward ops, the backward inside TRL's ZeRO-3 gather."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, softcap, logit_scale, wanted):
        # The weight gradient accumulates in fp32, as in TRL's own kernel.
        accum_fp32 = weight.dtype != torch.float32
        results = chunked_logprob_forward(hidden, weight, bias, targets, -100, temperature, softcap, logit_scale,
                                          *wanted, 0, accum_fp32, _KEEP_LOGITS[0])
        _logp, lse, ent, sq, mean, top1, kept = results
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(lse, sq, mean, top1, kept)
        ctx.options = (-100, temperature, softcap, logit_scale, 0, accum_fp32)
        ctx.entropy = wanted[0]
        ctx.save_for_backward(hidden, weight, bias, targets, lse, ent, kept)
        _CALLS["forward"] += 1
        return results

    @staticmethod
    def backward(ctx, grad_logp, _grad_lse, grad_ent, *_):
        saved = ctx.saved_tensors
        with _gather(saved[1], saved[2]):
            dx, dw, db = logprob_grads(saved, ctx.options, ctx.entropy, ctx.needs_input_grad, grad_logp, grad_ent)
        _CALLS["backward"] += 1
        return dx, dw, db, None, None, None, None, None


class ChunkedLogProbFunction:
    """A drop-in for ``trl.kernels.ChunkedLogProbFunction`` (TRL 1.16): ``apply(hidden (N, H),
    weight (V, H), bias (V,) | None, targets (N,), temperature, chunk_size,
    final_logit_softcapping=None, logit_scale=1.0, outputs=OPTIONAL_OUTPUTS)`` returns
    ``(log_probs, entropy, log_sum_sq_probs, mean_logits, is_top1)`` per token, None for the
    statistics not named in ``outputs``; ``log_probs`` and ``entropy`` are differentiable."""

    @staticmethod
    def apply(hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor, temperature: float,
              chunk_size: int, final_logit_softcapping: float | None = None, logit_scale: float = 1.0,
              outputs: tuple[str, ...] = OPTIONAL_OUTPUTS):
        del chunk_size  # TRL's vocabulary tile: Onca plans token chunks over the whole vocabulary
        (hidden, weight, bias), cast = head_inputs(hidden, weight, bias)
        if weight.dtype != hidden.dtype:  # cast_lm_head_to_fp32: TRL computes in the hidden states' dtype
            weight = weight.to(hidden.dtype)
        if bias is not None and bias.dtype != hidden.dtype:
            bias = bias.to(hidden.dtype)
        wanted = tuple(name in outputs for name in OPTIONAL_OUTPUTS)
        args = (hidden.contiguous(), weight.contiguous(), bias.contiguous() if bias is not None else None,
                targets.contiguous(), float(temperature), float(final_logit_softcapping or 0.0),
                float(logit_scale), wanted)
        with torch.autocast(hidden.device.type, enabled=False) if cast else contextlib.nullcontext():
            logp, _lse, *extras, _kept = _Head.apply(*args)
        return (logp, *(t if want else None for t, want in zip(extras, wanted)))


def _targets():
    try:
        import trl.kernels
        import trl.trainer.utils
    except ImportError as exc:
        raise ImportError(f"onca.integrations.trl needs TRL (>= 1.16) and its trainer dependencies: {exc}") from exc
    if not hasattr(trl.trainer.utils, "_ChunkedLogProbFunction"):
        raise ImportError("this TRL has no fused LM head (trl.trainer.utils._ChunkedLogProbFunction): "
                          "onca.integrations.trl needs TRL >= 1.16")
    return [(trl.trainer.utils, "_ChunkedLogProbFunction"), (trl.kernels, "ChunkedLogProbFunction")]


def enable(*, keep_logits: bool = False) -> None:
    """Make TRL's trainers compute their per-token log-probabilities (their fused LM head) with
    Onca. Idempotent; :func:`disable` restores TRL's kernel. ``keep_logits=True`` keeps each
    call's ``(tokens, vocab)`` logits (in the head's dtype) from the forward to the backward, which
    then reads them instead of recomputing them (:func:`onca.functional.fused_linear_logprobs`'s
    option of that name): faster, at ``tokens * vocab * itemsize`` bytes more per call in flight."""
    check_bool(keep_logits, "keep_logits")
    targets = _targets()
    _KEEP_LOGITS[0] = keep_logits
    for module, name in targets:
        if (module, name) not in _REPLACED:
            _REPLACED[(module, name)] = getattr(module, name)
        setattr(module, name, ChunkedLogProbFunction)


def disable() -> None:
    """Restore what :func:`enable` replaced."""
    for (module, name), original in list(_REPLACED.items()):
        setattr(module, name, original)
    _REPLACED.clear()
    _KEEP_LOGITS[0] = False


def is_enabled() -> bool:
    return bool(_REPLACED)


@contextlib.contextmanager
def enabled(*, keep_logits: bool = False):
    """``with enabled(): trainer.train()``: Onca's fused head inside the block (with
    :func:`enable`'s ``keep_logits``), TRL's after (unless it was enabled before, whose setting is
    then restored)."""
    was, kept_before = is_enabled(), _KEEP_LOGITS[0]
    enable(keep_logits=keep_logits)
    try:
        yield
    finally:
        if not was:
            disable()
        else:
            _KEEP_LOGITS[0] = kept_before
