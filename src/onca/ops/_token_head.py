"""Token or sequence chunks with the gradient in the forward pass: a loss that is a sum over
tokens of a function of each token's own log-probability (GRPO with token-level ratios), or over
sequences of a function of each sequence's summed log-probability (KTO), on three head matmuls per
chunk instead of the chunk driver's four.

The chunk driver (:mod:`onca.ops._chunked_head`) recomputes each chunk's logits in the backward,
because in general a token's ``dLoss/dlogp`` is known only once every sequence's sum is. For a loss
``sum_t f(logp[t], extras[:, t])`` it is known per token as soon as the token's own log-probability
is; for ``sum_s f(sum of logp over sequence s, extras)`` as soon as the sequence's tokens are all in
the chunk (chunks of whole sequences, ``seq_len`` tokens each). So each chunk runs one matmul for
its logits, the statistics kernel for its log-probabilities (and entropies), the loss's
closed-form derivative ``dLoss/dlogp[t]``, the gradient kernel writing ``dLoss/dlogp[t] * (onehot -
p) / temperature`` over the logits, and the two gradient matmuls, as fused linear cross entropy
does. The forward pass thus computes ``dhidden``, ``dweight`` and ``dbias`` for a unit incoming
gradient; the backward rescales them (:func:`onca.ops.cross_entropy.keep_forward_gradients`).

The loss's function is registered by name (:func:`register_token_loss`) by the loss's own module;
it returns the chunk's loss terms and, when asked, the derivative in closed form (inside a custom op
autograd is off, and torch.func fails under a dispatch mode: see :mod:`onca.ops._paired_head`).
Chunks hold as many logits as the head's weight has elements, within ``MIN_CHUNK_LOGITS`` and
``MAX_CHUNK_LOGITS`` and at least fused linear cross entropy's ``CHUNK_TOKENS`` tokens (twice that
with an fp32 weight gradient, capped by the free memory), or ``chunk_tokens``, rounded down to whole
sequences (at least one): few chunks, since each one reads and writes the weight's gradient and
runs the loss's elementwise terms. fp16 inputs, calls that want no gradient, sequences whose logits
would take more than :data:`onca.ops._paired_head.MAX_PAIR_SCRATCH_BYTES` and small calls keep the
chunk driver (:func:`use_token_chunks`), as the paired losses do.
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor

from onca.ops._chunked_head import chunk_loop, launch_grad, launch_stats
from onca.ops._contract import custom_op, register_autograd
from onca.ops._paired_head import MAX_PAIR_SCRATCH_BYTES, forward_gradients_apply
from onca.ops._validate import autocast_enabled
from onca.ops.cross_entropy import keep_forward_gradients, take_forward_gradients
from onca.ops.fused_linear_cross_entropy import CHUNK_TOKENS, chunk_plan
from onca.tiling import ChunkPlan, plan_token_chunks

__all__ = ["TOKEN_LOSSES", "register_token_loss", "token_loss", "use_token_chunks"]

# name -> fn(logp, extras, params, grads) returning (the chunk's loss terms, summed by the op, and
# the derivative of the loss w.r.t. each logp, or None when ``grads`` is False), fp32. ``logp`` is
# the chunk's ``(tokens,)``, or ``(sequences, seq_len)`` on sequence chunks; ``extras`` is
# ``(E, *logp.shape)``.
TOKEN_LOSSES: dict = {}


def register_token_loss(name: str, fn) -> None:
    """Make ``fn`` the per-token loss :func:`token_loss` computes for ``loss=name``."""
    TOKEN_LOSSES[name] = fn


def use_token_chunks(hidden: Tensor, weight: Tensor, bias: Tensor | None, seq_len: int = 0) -> bool:
    """Whether a loss takes the gradient-in-forward chunks: the paired path's rule
    (:func:`onca.ops._paired_head.forward_gradients_apply`) and, on sequence chunks, one sequence's
    logits within ``MAX_PAIR_SCRATCH_BYTES``."""
    fits = seq_len * weight.shape[0] * hidden.element_size() <= MAX_PAIR_SCRATCH_BYTES
    return fits and forward_gradients_apply(hidden, weight, bias)


# Each chunk also pays for its loss's closed-form terms and derivative: some 25 elementwise launches
# on the chunk's tokens, whatever the chunk's size. At fused linear cross entropy's 1024 tokens of a
# 32000-column head GRPO ran 0.65 ms of device time behind torch.compile's 9.18 (8192 tokens, hidden
# 4096, H200, 2026-11-28); with half as many chunks it ran 0.05 ms ahead. So a chunk holds at least
# this many logits (1024 tokens of a 64k vocabulary: twice the tokens at 32000).
MIN_CHUNK_LOGITS = 1 << 26
# And each chunk's GEMM reads and writes the whole head-sized weight gradient it accumulates into:
# at 1024 tokens, by arithmetic, about a tenth of the chunk's GEMM time on an H200, whatever the
# head's shape. Chunks of up to this many logits (1 GiB of bf16 scratch) took GRPO from 0.93x-0.98x
# torch.compile to 1.02x-1.05x at Llama-3-70B, Llama-3.1-405B, Qwen2.5-7B and Gemma-2-9B (H200,
# 2026-11-29). A chunk grows only to the head's own size (its scratch no larger than the weight;
# twice the tokens with an fp32 accumulator, as fused linear cross entropy's): the sweep's peaks
# stayed at most 0.97x liger-kernel's.
MAX_CHUNK_LOGITS = 1 << 29


def _chunks(tokens: int, width: int, vocab: int, dtype: torch.dtype, accum_fp32: bool, chunk_tokens: int,
            seq_len: int, device) -> ChunkPlan:
    """Fused linear cross entropy's chunks of as many logits as the head's weight has elements,
    within ``MIN_CHUNK_LOGITS`` and ``MAX_CHUNK_LOGITS`` (or ``chunk_tokens`` tokens), whole
    sequences of ``seq_len`` tokens each when it is not 0 (at least one)."""
    logits = min(MAX_CHUNK_LOGITS, max(MIN_CHUNK_LOGITS, vocab * width))
    target = max(CHUNK_TOKENS, logits // max(1, vocab))
    chunks = chunk_plan(tokens, width, vocab, dtype, accum_bytes=4 if accum_fp32 else None,
                        chunk_tokens=chunk_tokens or None, device=device, target_tokens=target)
    if not seq_len:
        return chunks
    row_bytes = vocab * dtype.itemsize
    rows = max(1, chunks.chunk // seq_len) * seq_len
    return plan_token_chunks(tokens, row_bytes, rows * row_bytes, multiple=seq_len)


@custom_op("token_loss_forward")
def token_loss_forward(hidden: Tensor, weight: Tensor, bias: Tensor | None, target: Tensor, extras: Tensor,
                       loss: str, params: list[float], seq_len: int, ignore_index: int, temperature: float,
                       entropy: bool, chunk_tokens: int, accum_fp32: bool, grad_hidden: bool, grad_weight: bool,
                       grad_bias: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(loss, logp, entropy, dhidden, dweight, dbias)`` for the 2-D ``hidden (N, H)``, ``target
    (N,)`` and ``extras (E, N)``: the fp32 scalar sum of the loss terms of :data:`TOKEN_LOSSES`'s
    ``loss`` over the chunks (whole sequences of ``seq_len`` tokens unless it is 0), the fp32
    per-token log-probabilities (0 where ignored) and entropies (empty unless asked for), and the
    gradients asked for (empty tensors otherwise) for a unit incoming gradient."""
    tokens, width = hidden.shape
    vocab, dev = weight.shape[0], hidden.device
    f32 = dict(dtype=torch.float32, device=dev)
    logp, lse = torch.empty(tokens, **f32), torch.empty(tokens, **f32)
    ent = torch.empty(tokens if entropy else 0, **f32)
    total = torch.zeros((), **f32)
    dx = torch.empty_like(hidden) if grad_hidden else None
    # Written by the first chunk (accumulate_dw's first): no zero fill of a head-sized buffer.
    dw = torch.empty(weight.shape, dtype=torch.float32 if accum_fp32 else weight.dtype, device=dev) \
        if grad_weight else None
    db = torch.zeros(vocab, **f32) if grad_bias else None
    grads = grad_hidden or grad_weight or grad_bias
    fn = TOKEN_LOSSES[loss]
    if tokens:
        chunks = _chunks(tokens, width, vocab, hidden.dtype, accum_fp32, chunk_tokens, seq_len, dev)
        shape = (-1, seq_len) if seq_len else (-1,)

        def visit(logits, start, end):
            rows = slice(start, end)
            launch_stats(logits, target[rows], logp[rows], lse[rows], ent[rows] if entropy else None, None, None,
                         None, ignore_index, temperature, 0.0, 1.0)
            chunk_extras = extras[:, rows].view(extras.shape[0], *shape)
            terms, derivative = fn(logp[rows].view(shape), chunk_extras, params, grads)
            total.add_(terms.sum())
            if grads:
                launch_grad(logits, target[rows], lse[rows], None, derivative.reshape(-1).contiguous(), None,
                            ignore_index, temperature, 0.0, 1.0, vocab=vocab, col_start=0)

        chunk_loop(hidden, weight, bias, chunks, visit, dx=dx, dw=dw, db=db)
    elif dw is not None:
        dw.zero_()
    empty = hidden.new_empty(0)
    return (total, logp, ent, dx if dx is not None else empty, dw.to(weight.dtype) if dw is not None else empty,
            db.to(bias.dtype) if db is not None else empty)


@token_loss_forward.register_fake
def _(hidden, weight, bias, target, extras, loss, params, seq_len, ignore_index, temperature, entropy,
      chunk_tokens, accum_fp32, grad_hidden, grad_weight, grad_bias):
    tokens, empty = hidden.shape[0], hidden.new_empty(0)
    f32 = dict(dtype=torch.float32)
    return (hidden.new_empty((), **f32), hidden.new_empty(tokens, **f32),
            hidden.new_empty(tokens if entropy else 0, **f32),
            hidden.new_empty(hidden.shape) if grad_hidden else empty,
            weight.new_empty(weight.shape) if grad_weight else empty,
            bias.new_empty(bias.shape) if grad_bias else empty)


def _setup_context(ctx, inputs, output):
    ctx.needs = tuple(inputs[-3:])
    loss, logp, ent, dx, dw, db = output
    ctx.mark_non_differentiable(logp, ent, dx, dw, db)
    keep_forward_gradients(ctx, [t if need else None for t, need in zip((dx, dw, db), ctx.needs)], inputs[0], loss)


def _backward(ctx, grad_loss, *_):
    dx, dw, db = take_forward_gradients(ctx, grad_loss)
    return (dx, dw, db) + (None,) * 13


register_autograd(token_loss_forward, _backward, setup_context=_setup_context)


def token_loss(hidden: Tensor, weight: Tensor, bias: Tensor | None, labels: Tensor, extras, *, loss: str,
               params, ignore_index: int, temperature: float = 1.0, entropy: bool = False,
               sequences: bool = False, chunk_tokens: int | None,
               accum_fp32: bool) -> tuple[Tensor, Tensor, Tensor | None]:
    """The fp32 scalar loss (differentiable w.r.t. ``hidden``, ``weight``, ``bias``), and the
    detached fp32 per-token log-probabilities and entropies (None unless ``entropy``), shaped like
    ``labels (B, T)``. ``extras`` is a sequence of tensors shaped like ``labels`` (detached, read in
    fp32); ``sequences`` runs chunks of whole sequences (rows of ``labels``). Inputs are validated by
    the caller."""
    grad = torch.is_grad_enabled()
    shape = labels.shape
    stacked = (torch.stack([e.detach().to(torch.float32).reshape(-1) for e in extras]) if extras
               else torch.zeros((0, labels.numel()), dtype=torch.float32, device=hidden.device))
    args = (hidden.reshape(-1, hidden.shape[-1]).contiguous(), weight.contiguous(),
            bias.contiguous() if bias is not None else None, labels.reshape(-1).contiguous(),
            stacked.contiguous(), loss, [float(p) for p in params], shape[-1] if sequences else 0,
            ignore_index, float(temperature), entropy, chunk_tokens or 0, accum_fp32,
            grad and hidden.requires_grad, grad and weight.requires_grad,
            grad and bias is not None and bias.requires_grad)
    # The inputs are already in the autocast dtype (check_common): the op's matmuls stay in it.
    with torch.autocast(hidden.device.type, enabled=False) if autocast_enabled(hidden.device.type) \
            else contextlib.nullcontext():
        value, logp, ent, _, _, _ = token_loss_forward(*args)
    return value, logp.view(shape), (ent.view(shape) if entropy else None)
