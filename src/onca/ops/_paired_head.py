"""Pair-aligned chunks with the gradient in the forward pass: the paired preference losses (DPO,
CPO, SimPO, ORPO) on three head matmuls per chunk instead of the chunk driver's four.

The chunk driver (:mod:`onca.ops._chunked_head`) keeps only per-token statistics in its forward and
recomputes each chunk's logits in backward, because a preference loss's gradient w.r.t. a token's
log-probability is known only once its sequence's sum (and its pair's) is. Here each chunk holds
whole pairs instead: the B chosen sequences' rows ``[i0, i1)`` and the rejected ones' ``[B + i0, B
+ i1)``, gathered into one buffer. One matmul gives the chunk's logits; the statistics kernel its
per-token log-probabilities; their sums per sequence give the pairs' losses and each sequence's
coefficient ``c_s = dLoss/dsum_s`` (the loss's derivatives in closed form); the gradient kernel
writes ``c_s * (onehot - p)``
over the logits, and the two gradient matmuls follow. The forward pass thus computes ``dhidden``,
``dweight`` and ``dbias`` for a unit incoming gradient; the backward rescales them
(:func:`onca.ops.cross_entropy.keep_forward_gradients`), as fused linear cross entropy does.

A loss is ``sum_pairs loss(pair) / B + nll_weight * (chosen NLL over all chosen tokens)``, both
terms decomposing over chunks of pairs; the per-pair function is registered by name
(:func:`register_pair_loss`) by the loss's own module and called with the chunk's per-sequence sums
and token counts, the per-pair tensors given (``extras``: the reference model's sums) and the
loss's options.

Chunks aim at ``GRAD_TILE_TOKENS`` tokens (the weight gradient's GEMM depth, as the chunk driver's
backward tiles): ``max(1, 4096 // (2 T))`` pairs, so the scratch is ``2 * pairs * T`` rows of logits,
more than the two-pass driver's (525 MB at T = 1024 with a Llama-3 head, against 131 MB). Where one
pair's logits would take more than ``MAX_PAIR_SCRATCH_BYTES``, or the inputs are fp16 (a unit-scale
gradient of ``c_s * p`` underflows before a loss scale could lift it), or no gradient is wanted,
the losses keep the two-pass driver (:func:`use_paired_chunks`).
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor

from onca.ops._chunked_head import GRAD_TILE_TOKENS, head_logits, launch_grad, launch_stats
from onca.ops._contract import custom_op, register_autograd
from onca.ops._matmul import accumulate_dw
from onca.ops._validate import autocast_enabled
from onca.ops.cross_entropy import keep_forward_gradients, take_forward_gradients

__all__ = ["ALIGNED_WHEN_SMALL", "PAIR_LOSSES", "forward_gradients_apply", "pair_chunks", "paired_loss",
           "register_pair_loss", "stack_extras", "use_paired_chunks"]

# name -> fn(chosen_sums, rejected_sums, counts, extras, loss_type, params, grads) returning
# (per-pair losses, their derivatives w.r.t. chosen_sums, w.r.t. rejected_sums), fp32, one per pair
# of the chunk; ``counts()`` gives (chosen_counts, rejected_counts), the counts of non-ignored labels
# (0 for a sequence with none), for the loss types that use them (a small call's torch route makes
# them only then); ``extras`` iterates over the per-pair tensors. The derivatives are in closed form:
# inside a custom op autograd is off (the dispatcher runs it below autograd) and torch.func fails
# under a dispatch mode (a FLOP counter, selective activation checkpointing). With ``grads=False``
# (the two-pass route, which takes the losses' gradient from autograd: they are differentiable
# torch) the derivatives are None and not computed.
PAIR_LOSSES: dict = {}
# The largest scratch of one pair's logits the pair-aligned path takes (a fixed bound, not the free
# memory: the choice is made where torch.compile traces, and must not depend on the moment): 2 GiB
# is pairs of up to 4096-token sequences on a Llama-3 head (128256 columns) in bf16.
MAX_PAIR_SCRATCH_BYTES = 2 << 30


# The pair losses whose small calls keep the pair-aligned op rather than torch's route.
ALIGNED_WHEN_SMALL: set = set()


def register_pair_loss(name: str, fn, *, aligned_when_small: bool = False) -> None:
    """Make ``fn`` the per-pair loss :func:`paired_loss` computes for ``loss=name``. A small call
    (:mod:`onca.ops._small_calls`) of a paired loss takes torch's route through the two-pass entry,
    autograd recording its per-pair formula; ``aligned_when_small`` keeps the pair-aligned op
    instead, for a formula of so many small ops that recording them costs more host time than the
    op's launches (each choice measured)."""
    PAIR_LOSSES[name] = fn
    (ALIGNED_WHEN_SMALL.add if aligned_when_small else ALIGNED_WHEN_SMALL.discard)(name)


def pair_chunks(pairs: int, seq: int, vocab: int, dtype: torch.dtype, *, chunk_pairs: int | None = None) -> int | None:
    """Pairs per chunk: ``chunk_pairs``, else enough for ``GRAD_TILE_TOKENS`` tokens (at least one
    pair); None where one pair's ``(2 * seq, vocab)`` logits would take more than
    ``MAX_PAIR_SCRATCH_BYTES``."""
    if chunk_pairs:
        return min(pairs, chunk_pairs)
    if 2 * seq * vocab * dtype.itemsize > MAX_PAIR_SCRATCH_BYTES:
        return None
    return min(pairs, max(1, GRAD_TILE_TOKENS // (2 * seq)))


def forward_gradients_apply(hidden: Tensor, weight: Tensor, bias: Tensor | None) -> bool:
    """The rule every gradient-in-forward chunk path shares (here and :mod:`onca.ops._token_head`):
    a gradient is wanted, and the inputs are not fp16 (a unit-scale gradient of ``c * p``
    underflows there before a loss scale could lift it)."""
    wanted = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad
                                          or (bias is not None and bias.requires_grad))
    return wanted and hidden.dtype != torch.float16


def use_paired_chunks(hidden: Tensor, weight: Tensor, bias: Tensor | None, chunk_tokens: int | None) -> bool:
    """Whether a paired loss takes the pair-aligned path: :func:`forward_gradients_apply`, no
    ``chunk_tokens`` override (which names the two-pass driver's token chunks) and one pair's
    logits fit (:func:`pair_chunks`)."""
    if chunk_tokens is not None or not forward_gradients_apply(hidden, weight, bias):
        return False
    pairs, seq = hidden.shape[0] // 2, hidden.shape[1]
    return pair_chunks(pairs, seq, weight.shape[0], hidden.dtype) is not None


@custom_op("paired_loss_forward")
def paired_loss_forward(hidden: Tensor, weight: Tensor, bias: Tensor | None, labels: Tensor, extras: Tensor,
                        loss: str, loss_type: str, params: list[float], nll_weight: float, ignore_index: int,
                        chunk_pairs: int, accum_fp32: bool, grad_hidden: bool, grad_weight: bool,
                        grad_bias: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(loss, sums, dhidden, dweight, dbias)`` for ``hidden (2B, T, H)`` and ``labels (2B, T)``:
    the fp32 scalar loss, the fp32 per-sequence log-probability sums and the gradients asked for
    (empty tensors otherwise) for a unit incoming gradient; ``extras`` ``(E, B)`` fp32 holds the
    per-pair tensors handed to the loss, ``chunk_pairs`` 0 plans the pairs per chunk."""
    n_seq, seq, width = hidden.shape
    pairs, vocab = n_seq // 2, weight.shape[0]
    dev = hidden.device
    h2d, target = hidden.reshape(n_seq * seq, width), labels.reshape(-1)
    dx = torch.empty_like(h2d) if grad_hidden else None
    # Written by the first chunk (accumulate_dw's first): no zero fill of a head-sized buffer.
    dw = torch.empty(weight.shape, dtype=torch.float32 if accum_fp32 else weight.dtype, device=dev) \
        if grad_weight else None
    db = torch.zeros(vocab, dtype=torch.float32, device=dev) if grad_bias else None
    sums = torch.empty(n_seq, dtype=torch.float32, device=dev)
    total = torch.zeros((), dtype=torch.float32, device=dev)
    counts = (labels != ignore_index).sum(-1, dtype=torch.float32)
    chosen_tokens = counts[:pairs].sum().clamp(min=1.0)
    per_chunk = pair_chunks(pairs, seq, vocab, hidden.dtype, chunk_pairs=chunk_pairs or None) or 1
    rows = 2 * per_chunk * seq
    scratch = torch.empty((rows, vocab), dtype=hidden.dtype, device=dev)
    h_buf = torch.empty((rows, width), dtype=hidden.dtype, device=dev)
    t_buf = torch.empty(rows, dtype=target.dtype, device=dev)
    logp, lse = (torch.empty(rows, dtype=torch.float32, device=dev) for _ in range(2))
    for i0 in range(0, pairs, per_chunk):
        i1 = min(i0 + per_chunk, pairs)
        g, n = i1 - i0, (i1 - i0) * seq
        blocks = (slice(i0 * seq, i1 * seq), slice((pairs + i0) * seq, (pairs + i1) * seq))
        h = h_buf[: 2 * n]
        torch.cat([h2d[blocks[0]], h2d[blocks[1]]], out=h)
        torch.cat([target[blocks[0]], target[blocks[1]]], out=t_buf[: 2 * n])
        logits = head_logits(h, weight, bias, scratch[: 2 * n])
        launch_stats(logits, t_buf[: 2 * n], logp[: 2 * n], lse[: 2 * n], None, None, None, None, ignore_index,
                     1.0, 0.0, 1.0)
        chunk_sums = logp[: 2 * n].view(2, g, seq).sum(-1)
        sums[i0:i1], sums[pairs + i0:pairs + i1] = chunk_sums[0], chunk_sums[1]
        chunk_counts = (counts[i0:i1], counts[pairs + i0:pairs + i1])
        losses, coef_c, coef_r = PAIR_LOSSES[loss](chunk_sums[0], chunk_sums[1], lambda: chunk_counts,
                                                   extras[:, i0:i1], loss_type, params, True)
        total += losses.sum() / pairs
        coef_c, coef_r = coef_c / pairs, coef_r / pairs
        if nll_weight:
            total -= nll_weight * chunk_sums[0].sum() / chosen_tokens
            coef_c = coef_c - nll_weight / chosen_tokens
        if not (grad_hidden or grad_weight or grad_bias):
            continue
        g_lp = torch.stack([coef_c, coef_r]).unsqueeze(-1).expand(2, g, seq).reshape(-1)
        launch_grad(logits, t_buf[: 2 * n], lse[: 2 * n], None, g_lp, None, ignore_index, 1.0, 0.0, 1.0,
                    vocab=vocab, col_start=0)
        if dx is not None:
            torch.mm(logits[:n], weight, out=dx[blocks[0]])
            torch.mm(logits[n:], weight, out=dx[blocks[1]])
        if dw is not None:
            accumulate_dw(dw, logits, h, first=i0 == 0)
        if db is not None:
            db += logits.sum(dim=0, dtype=torch.float32)
    empty = hidden.new_empty(0)
    return (total, sums, dx.view(hidden.shape) if dx is not None else empty,
            dw.to(weight.dtype) if dw is not None else empty, db.to(bias.dtype) if db is not None else empty)


@paired_loss_forward.register_fake
def _(hidden, weight, bias, labels, extras, loss, loss_type, params, nll_weight, ignore_index, chunk_pairs,
      accum_fp32, grad_hidden, grad_weight, grad_bias):
    empty = hidden.new_empty(0)
    f32 = dict(dtype=torch.float32)
    return (hidden.new_empty((), **f32), hidden.new_empty(hidden.shape[0], **f32),
            hidden.new_empty(hidden.shape) if grad_hidden else empty,
            weight.new_empty(weight.shape) if grad_weight else empty,
            bias.new_empty(bias.shape) if grad_bias else empty)


def _setup_context(ctx, inputs, output):
    hidden = inputs[0]
    ctx.needs = tuple(inputs[-3:])
    loss, sums, dx, dw, db = output
    ctx.mark_non_differentiable(sums, dx, dw, db)
    keep_forward_gradients(ctx, [t if need else None for t, need in zip((dx, dw, db), ctx.needs)], hidden, loss)


def _backward(ctx, grad_loss, *_):
    dx, dw, db = take_forward_gradients(ctx, grad_loss)
    return (dx, dw, db) + (None,) * 12


register_autograd(paired_loss_forward, _backward, setup_context=_setup_context)


def stack_extras(extras, hidden: Tensor) -> Tensor:
    """The per-pair tensors handed to a pair loss, detached, as one ``(E, B)`` fp32 tensor."""
    if not extras:
        return torch.zeros((0, hidden.shape[0] // 2), dtype=torch.float32, device=hidden.device)
    return torch.stack([e.detach().to(torch.float32) for e in extras])


def paired_loss(hidden: Tensor, weight: Tensor, bias: Tensor | None, labels: Tensor, extras, *, loss: str,
                loss_type: str, params, nll_weight: float, ignore_index: int, accum_fp32: bool,
                chunk_pairs: int | None = None) -> tuple[Tensor, Tensor]:
    """The fp32 scalar loss (differentiable w.r.t. ``hidden``, ``weight``, ``bias``) and the fp32
    per-sequence log-probability sums ``(2B,)`` (detached), on pair-aligned chunks. Inputs are
    validated by the caller (:func:`onca.ops._posttrain.check_common`, ``check_paired``)."""
    grad = torch.is_grad_enabled()
    args = (hidden.contiguous(), weight.contiguous(), bias.contiguous() if bias is not None else None,
            labels.contiguous(), stack_extras(extras, hidden), loss, loss_type,
            [float(p) for p in params], float(nll_weight), ignore_index, chunk_pairs or 0, accum_fp32,
            grad and hidden.requires_grad, grad and weight.requires_grad,
            grad and bias is not None and bias.requires_grad)
    # The inputs are already in the autocast dtype (check_common): the op's matmuls stay in it.
    with torch.autocast(hidden.device.type, enabled=False) if autocast_enabled(hidden.device.type) \
            else contextlib.nullcontext():
        value, sums, _, _, _ = paired_loss_forward(*args)
    return value, sums
