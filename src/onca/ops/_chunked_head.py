"""The one chunk driver of the post-training losses: per-token log-probabilities (and entropies)
of ``hidden @ weight.T + bias`` without the ``(tokens, vocab)`` logits ever existing in full.

Every post-training loss of Onca (``fused_linear_dpo``, ``_simpo``, ``_orpo``, ``_cpo``, ``_kto``,
``_grpo``) is a function of per-token log-probabilities ``logp[t] = log_softmax(z_t)[y_t]`` with
``z_t = (hidden[t] @ weight.T + bias) / temperature``; distillation (``fused_linear_distill``)
needs whole rows of both models' log-softmaxes and uses the same chunk loop with a row kernel of
its own. This module owns

- the chunk plan (tokens per chunk from the free device memory, as fused linear cross entropy:
  :func:`onca.ops.fused_linear_cross_entropy.chunk_plan`);
- :func:`head_logits` (one chunk's logits by one matmul into a reused scratch in the input dtype)
  and :func:`chunk_loop`, which runs the chunks and accumulates ``dHidden`` (per chunk, by matmul),
  ``dWeight`` (in the weight's dtype, or fp32 cast once at the end) and ``dBias`` (fp32) from
  whatever gradient a visitor writes over each chunk's logits;
- the backward's tiles (:func:`grad_tiles`, :func:`grad_tile_loop`): the same scratch reshaped to
  up to ``GRAD_TILE_TOKENS`` tokens by an equal share of the vocabulary, so that the weight
  gradient's GEMM runs ``GRAD_TILE_TOKENS`` deep (its accumulator read and written once per tile,
  not once per 512-token chunk); ``dHidden`` sums over the vocabulary's tiles in fp32;
- two Triton kernels: the per-token statistics (online log-sum-exp over column tiles, the target's
  logit, optionally the entropy) and the gradient of ``sum_t g_lp[t] * logp[t] + g_ent[t] *
  entropy[t]`` w.r.t. the logits, written over the chunk's logits;
- the custom ops ``onca::chunked_logprob_forward`` / ``onca::chunked_logprob_backward`` and
  :func:`chunked_logprobs`, the differentiable entry point the losses call.

Interface (for the losses here, and for a TRL ``_ChunkedLogProbFunction``-style kernel later)::

    logp, entropy = chunked_logprobs(hidden, weight, labels, bias=None, *, ignore_index=-100,
                                     temperature=1.0, entropy=False, chunk_tokens=None)

``hidden`` ``(..., H)``, ``weight`` ``(V, H)``, ``labels`` ``(...)`` int (already aligned with
``hidden``: position ``t`` is scored against ``labels[t]``). Returns fp32 ``logp`` shaped like
``labels`` (0 where the label is ``ignore_index``; NaN for a label outside ``[0, V)``) and the fp32
entropy of ``softmax(z_t)`` (0 where ignored) or None. Both are differentiable: their gradients
reach ``hidden``, ``weight`` and ``bias``.

Small calls (logits of at most :func:`onca.ops._small_calls.limit` elements, eager, on CUDA) take
:func:`torch_logprobs` instead: the logits by one GEMM and torch's fp32 ``log_softmax``, autograd
for the gradient (a post-training loss at a few tokens is bound by its host path, and this one is
the unfused reference's). The paired losses then take this entry too, not the pair-aligned path.

Why two passes (per-token statistics in forward, recomputed logits in backward) rather than the
gradient computed in forward as fused linear cross entropy does: a preference or RL loss's gradient
w.r.t. a token's log-probability is known only once every sequence's sum is known (DPO's sigmoid of
a chosen-rejected margin, KTO's batch KL, GRPO's token-count normalisations), so an in-forward
gradient would need per-loss knowledge inside the chunk loop, or chunks aligned with whole
sequence pairs (liger-kernel's way: chunk sizes then grow with sequence length). Here the forward
pass keeps one fp32 ``lse`` (and entropy) per token and nothing of the logits; the loss itself is
plain torch on ``(tokens,)`` and ``(sequences,)`` tensors (graph-friendly: no host syncs, any loss
composes), and autograd hands the backward op ``dL/dlogp`` per token. Cost: one extra head matmul
per chunk (4 in all, against 3) for the same scratch (one ``(chunk, V)`` buffer in the input dtype);
the reference model's pass is forward only (1 matmul). Where the memory is there, ``keep_logits=True``
keeps the forward's logits (the whole ``(tokens, vocab)``, in the input dtype, in chunks of up to
``GRAD_TILE_TOKENS`` tokens) for the backward to read: 3 matmuls, and the backward's scratch
holds only the gradient tiles it writes (the kept logits are never overwritten: a second backward
reads them again).
The paired losses (DPO, CPO, SimPO, ORPO: sums over pairs) take the other way where it pays
(:mod:`onca.ops._paired_head`: chunks of whole pairs, the per-pair derivatives in closed form, 3
matmuls), and so do GRPO with token-level ratios, whose derivative per token needs only the
token's own log-probability, and KTO, whose needs only its sequence's sum
(:mod:`onca.ops._token_head`: chunks of tokens or of whole sequences). ``dWeight`` accumulates
over the chunks in the weight's dtype by default (liger-kernel's chunked losses do the same): an
fp32 accumulator (``accum_dtype=torch.float32``, TRL's choice, the default of
:func:`fused_linear_logprobs`) and its final cast hold three bytes per head element more at the
backward's peak (3 GB for a bf16 Llama-3 head).

Gradient (per token, ``p = softmax(z)``, ``zbar = sum_j p_j z_j = lse - entropy``)::

    dlogits_j = (g_lp * ([j == y] - p_j) - g_ent * p_j * (z_j - zbar)) / temperature

Saved for backward: the inputs (already alive in the caller's graph), the fp32 ``lse`` and
entropy per token, and, with ``keep_logits``, the logits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from onca.device import DeviceProfile, accelerator
from onca.ops import _small_calls as small_calls
from onca.ops._contract import custom_op, register_autograd
from onca.ops._launch import fast_launch
from onca.ops._matmul import accumulate_dw, accumulate_mm
from onca.ops._rows import as_rows
from onca.ops._validate import (
    autocast_enabled,
    check_accum_dtype,
    check_bool,
    check_float,
    check_index,
    check_number,
    check_same_device,
    check_tensor,
)
from onca.ops.fused_linear_cross_entropy import chunk_plan as _flce_chunk_plan
from onca.tiling import ChunkPlan, RowPlan, cdiv, plan_rows, plan_token_chunks

__all__ = [
    "TILES",
    "WIDE_TILES",
    "chunk_loop",
    "checked_logprobs",
    "chunk_plan",
    "chunked_logprobs",
    "grad_tile_loop",
    "grad_tiles",
    "head_inputs",
    "head_logits",
    "head_scales",
    "launch_grad",
    "launch_stats",
    "logprob_grads",
    "plan",
    "small_head",
    "torch_logprobs",
    "validate_head",
]

# Live tiles of both kernels: the logits tile as loaded and the gradient as stored (input dtype);
# the fp32 logits, their exponentials, the gradient and one temporary (fp32).
TILES = dict(live_tiles=2, fp32_tiles=4)
# With soft-capping or the extra per-token statistics (squared exponentials, the masked tile for
# the top-1 test, tanh's intermediate): two more fp32 tiles.
WIDE_TILES = dict(live_tiles=2, fp32_tiles=6)


# ----------------------------------------------------------------------------------------- kernels


@triton.jit
def _head_transform(x, pre, post, HAS_SOFTCAP: tl.constexpr):
    """The logits the distribution is taken over, from the head's output ``x`` (fp32):
    ``post * tanh(pre * x)`` with soft-capping (``pre = scale / cap``, ``post = cap / T``), else
    ``post * x`` (``post = scale / T``). ``tanh(u) = 2 sigmoid(2u) - 1``."""
    if HAS_SOFTCAP:
        return (2.0 * tl.sigmoid(2.0 * (x * pre)) - 1.0) * post
    return x * post


@fast_launch
@triton.jit
def _logprob_stats_kernel(
    x_ptr, target_ptr, logp_ptr, lse_ptr, ent_ptr, sq_ptr, mean_ptr, top1_ptr,
    n_rows, n_cols, x_row_stride, ignore_index, pre, post, inv_cols,
    HAS_SOFTCAP: tl.constexpr,
    HAS_ENTROPY: tl.constexpr,
    HAS_SQ: tl.constexpr,
    HAS_MEAN: tl.constexpr,
    HAS_TOP1: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    COL_TILES: tl.constexpr,
):
    """Per row of ``z = transform(x)``: ``lse`` (online over the column tiles), ``logp = z_y -
    lse`` and, each when asked for, the entropy ``lse - sum_j p_j z_j``, ``log sum_j p_j^2``, the
    mean of ``z`` and whether ``y`` is the first argmax of ``z``. Ignored rows load nothing and get
    0 (False); a target outside ``[0, n_cols)`` gets a NaN ``logp`` and is never used as an offset."""
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    n_row_blocks = tl.cdiv(n_rows, BLOCK_ROWS)
    col_offsets = tl.arange(0, BLOCK_COLS)
    for row_block in tl.range(pid, n_row_blocks, n_programs):
        rows = row_block * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        row_mask = rows < n_rows
        y = tl.load(target_ptr + rows, mask=row_mask, other=ignore_index)
        valid = row_mask & (y != ignore_index)
        bad = valid & ((y < 0) | (y >= n_cols))
        readable = valid & ~bad
        y = tl.where(readable, y, 0)
        rows64 = rows.to(tl.int64)
        x_y = tl.load(x_ptr + rows64 * x_row_stride + y.to(tl.int64), mask=readable, other=0.0)
        z_y = _head_transform(x_y.to(tl.float32), pre, post, HAS_SOFTCAP)
        x_rows = x_ptr + rows64[:, None] * x_row_stride
        m = tl.full([BLOCK_ROWS], float("-inf"), dtype=tl.float32)
        d = tl.zeros([BLOCK_ROWS], dtype=tl.float32)
        s = tl.zeros([BLOCK_ROWS], dtype=tl.float32)
        sq = tl.zeros([BLOCK_ROWS], dtype=tl.float32)
        zsum = tl.zeros([BLOCK_ROWS], dtype=tl.float32)
        before = tl.full([BLOCK_ROWS], float("-inf"), dtype=tl.float32)
        for tile in range(COL_TILES):
            cols = tile * BLOCK_COLS + col_offsets
            mask = valid[:, None] & (cols < n_cols)[None, :]
            z = tl.load(x_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            z = _head_transform(z, pre, post, HAS_SOFTCAP)
            if HAS_MEAN:
                zsum += tl.sum(tl.where(mask, z, 0.0), axis=1)
            z = tl.where(mask, z, float("-inf"))
            if HAS_TOP1:
                # The first argmax: a tie with an earlier column does not make y the top-1.
                before = tl.maximum(before, tl.max(tl.where(cols[None, :] < y[:, None], z, float("-inf")), axis=1))
            m_new = tl.maximum(m, tl.max(z, axis=1))
            # Rows with nothing loaded yet keep m = -inf: shift them by 0 (no -inf - -inf).
            shift = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m - shift)
            e = tl.exp(z - shift[:, None])
            d = d * alpha + tl.sum(e, axis=1)
            if HAS_ENTROPY:
                s = s * alpha + tl.sum(e * tl.where(mask, z, 0.0), axis=1)
            if HAS_SQ:
                sq = sq * (alpha * alpha) + tl.sum(e * e, axis=1)
            m = m_new
        m = tl.where(valid, m, 0.0)
        d = tl.where(valid, d, 1.0)
        log_d = tl.log(d)
        lse = tl.where(valid, m + log_d, 0.0)
        logp = tl.where(bad, float("nan"), tl.where(valid, z_y - lse, 0.0))
        tl.store(logp_ptr + rows, logp, mask=row_mask)
        tl.store(lse_ptr + rows, lse, mask=row_mask)
        if HAS_ENTROPY:
            tl.store(ent_ptr + rows, tl.where(valid, lse - s / d, 0.0), mask=row_mask)
        if HAS_SQ:
            # sum_j p_j^2 = sum_j exp(2 (z_j - m)) / d^2
            tl.store(sq_ptr + rows, tl.where(valid, tl.log(tl.where(valid, sq, 1.0)) - 2.0 * log_d, 0.0),
                     mask=row_mask)
        if HAS_MEAN:
            tl.store(mean_ptr + rows, tl.where(valid, zsum * inv_cols, 0.0), mask=row_mask)
        if HAS_TOP1:
            top1 = readable & (z_y >= m) & (z_y > before)
            tl.store(top1_ptr + rows, top1.to(tl.int8), mask=row_mask)


@fast_launch
@triton.jit
def _logprob_grad_kernel(
    x_ptr, grad_ptr, target_ptr, lse_ptr, ent_ptr, g_lp_ptr, g_ent_ptr,
    n_rows, n_cols, vocab, col_start, x_row_stride, grad_row_stride, ignore_index, pre, post,
    HAS_SOFTCAP: tl.constexpr,
    HAS_LP_GRAD: tl.constexpr,
    HAS_ENT_GRAD: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    COL_TILES: tl.constexpr,
):
    """``grad = (g_lp * (onehot(y) - p) - g_ent * p * (z - zbar)) * dz/dx`` per row, from the saved
    ``lse`` (and entropy), with ``dz/dx = post`` (``post * pre * (1 - tanh^2)`` when soft-capped);
    zero rows where ignored. The ``n_cols`` columns are the vocabulary's ``[col_start, col_start +
    n_cols)`` (a vocabulary tile of the backward); ``vocab`` decides which targets are bad.
    ``grad_ptr`` may be ``x_ptr``: each tile is read before it is written and no other program
    touches the row."""
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    n_row_blocks = tl.cdiv(n_rows, BLOCK_ROWS)
    col_offsets = tl.arange(0, BLOCK_COLS)
    for row_block in tl.range(pid, n_row_blocks, n_programs):
        rows = row_block * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        row_mask = rows < n_rows
        y = tl.load(target_ptr + rows, mask=row_mask, other=ignore_index)
        valid = row_mask & (y != ignore_index)
        bad = valid & ((y < 0) | (y >= vocab))
        # The target's column in this tile; -1 (never a column) for rows that are ignored or bad,
        # or whose target lies in another tile: they take no one-hot term here.
        y = tl.where(valid & ~bad, y - col_start, -1)
        lse = tl.load(lse_ptr + rows, mask=valid, other=0.0)
        if HAS_LP_GRAD:
            g_lp = tl.load(g_lp_ptr + rows, mask=valid, other=0.0).to(tl.float32)
            g_lp = tl.where(bad, float("nan"), g_lp)
        if HAS_ENT_GRAD:
            g_ent = tl.load(g_ent_ptr + rows, mask=valid, other=0.0).to(tl.float32)
            zbar = lse - tl.load(ent_ptr + rows, mask=valid, other=0.0)
        rows64 = rows.to(tl.int64)
        x_rows = x_ptr + rows64[:, None] * x_row_stride
        g_rows = grad_ptr + rows64[:, None] * grad_row_stride
        for tile in range(COL_TILES):
            cols = tile * BLOCK_COLS + col_offsets
            col_mask = cols < n_cols
            mask = valid[:, None] & col_mask[None, :]
            x = tl.load(x_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            if HAS_SOFTCAP:
                t = 2.0 * tl.sigmoid(2.0 * (x * pre)) - 1.0
                z = t * post
            else:
                z = x * post
            p = tl.where(mask, tl.exp(z - lse[:, None]), 0.0)
            g = tl.zeros([BLOCK_ROWS, BLOCK_COLS], dtype=tl.float32)
            if HAS_LP_GRAD:
                g = -p * g_lp[:, None]
                g = tl.where(cols[None, :] == y[:, None], g + g_lp[:, None], g)
            if HAS_ENT_GRAD:
                g -= (p * g_ent[:, None]) * (z - zbar[:, None])
            if HAS_SOFTCAP:
                g = g * (post * pre) * (1.0 - t * t)
            else:
                g = g * post
            tl.store(g_rows + cols[None, :], g.to(grad_ptr.dtype.element_ty),
                     mask=row_mask[:, None] & col_mask[None, :])


# ------------------------------------------------------------------------------------------- plans

# Tokens per forward chunk. Fused linear cross entropy aims at twice this because its chunks also
# run the weight gradient's update; here the backward does that in its own taller tiles (below),
# so the forward's chunk only sets the logits GEMM's height and the scratch.
FORWARD_CHUNK_TOKENS = 512


def chunk_plan(tokens: int, hidden: int, vocab: int, dtype: torch.dtype, *, accum_fp32: bool = True,
               chunk_tokens: int | None = None, device=None) -> ChunkPlan:
    """Tokens per chunk: one row of logits in ``dtype`` per token is the scratch; the default aims
    at ``FORWARD_CHUNK_TOKENS`` (twice that for an fp32 ``dWeight``), capped by a share of the free
    device memory, as fused linear cross entropy's plan. ``chunk_tokens`` overrides it."""
    return _flce_chunk_plan(tokens, hidden, vocab, dtype, accum_bytes=4 if accum_fp32 else None,
                            chunk_tokens=chunk_tokens or None, device=device,
                            target_tokens=FORWARD_CHUNK_TOKENS)


# Tokens per tile of the backward. Each tile's ``dW[tile] += G.T @ h`` reads and writes its rows of
# the weight gradient once (4 bytes per element in bf16, 8 with an fp32 accumulator) for ``2 *
# tokens`` flops per element: at the forward's 512-1024-token chunks that GEMM is bound by the
# accumulator's traffic (H100, Llama-3 head, 16384 tokens: 39.7 ms against 27.5 for TRL's
# 4096-token tiles). The backward therefore tiles the same scratch as tall as this and as wide as
# the vocabulary allows; it can, because each token's ``lse`` is known from the forward.
GRAD_TILE_TOKENS = 4096
# Vocabulary tiles are multiples of this (whole GEMM tiles).
VOCAB_TILE_MULTIPLE = 128


def grad_tiles(tokens: int, hidden: int, vocab: int, dtype: torch.dtype, *, accum_fp32: bool = True,
               chunk_tokens: int | None = None, device=None) -> tuple[ChunkPlan, int]:
    """The backward's tiles: ``(token chunks, vocabulary tile width)``. The scratch is
    :func:`chunk_plan`'s (one ``(chunk, vocab)`` buffer), reshaped to up to
    ``GRAD_TILE_TOKENS`` tokens by an equal split of the vocabulary into the widest tiles that fit
    (multiples of ``VOCAB_TILE_MULTIPLE``). ``chunk_tokens`` keeps whole-vocabulary chunks of
    that many tokens."""
    chunks = chunk_plan(tokens, hidden, vocab, dtype, accum_fp32=accum_fp32, chunk_tokens=chunk_tokens,
                        device=device)
    rows = min(tokens, GRAD_TILE_TOKENS)
    if chunk_tokens or chunks.chunk >= rows:
        return chunks, vocab
    itemsize = dtype.itemsize
    fit = max(VOCAB_TILE_MULTIPLE, chunks.bytes_per_chunk // (rows * itemsize))
    n_tiles = cdiv(vocab, fit)
    width = cdiv(vocab, n_tiles)
    width = min(vocab, cdiv(width, VOCAB_TILE_MULTIPLE) * VOCAB_TILE_MULTIPLE)
    return plan_token_chunks(tokens, width * itemsize, rows * width * itemsize, multiple=1), width


def plan(shape, dtype: torch.dtype, profile: DeviceProfile | None = None) -> dict[str, ChunkPlan | RowPlan]:
    """Plans for ``shape = (tokens, hidden, vocab)``: the forward's token chunks (from this
    machine's free accelerator memory), the backward's tiles (:func:`grad_tiles`) and the two
    kernels' tiling of one chunk or tile of logits."""
    shape = tuple(int(s) for s in shape)
    if len(shape) != 3:
        raise ValueError(f"chunked log-prob plans take shape (tokens, hidden, vocab), got {shape}")
    tokens, hidden, vocab = shape
    chunks = chunk_plan(tokens, hidden, vocab, dtype, device=accelerator())
    grad_chunks, width = grad_tiles(tokens, hidden, vocab, dtype, device=accelerator())
    return {"chunks": chunks, "logprob": plan_rows(chunks.chunk, vocab, dtype, profile=profile, **TILES),
            "backward_chunks": grad_chunks,
            "logprob_grad": plan_rows(grad_chunks.chunk, width, dtype, profile=profile, **TILES)}


# ------------------------------------------------------------------------------------ chunk driver


def head_logits(h: Tensor, weight: Tensor, bias: Tensor | None, out: Tensor) -> Tensor:
    """``out = h @ weight.T + bias`` (``out`` a scratch slice: the input dtype, or fp32 for
    bf16/fp16 operands, then without rounding the product where torch can)."""
    if out.dtype == h.dtype and bias is not None:
        return torch.addmm(bias, h, weight.t(), out=out)
    accumulate_mm(out, h, weight.t(), first=True)
    if bias is not None:
        out += bias
    return out


def chunk_loop(hidden: Tensor, weight: Tensor, bias: Tensor | None, chunks: ChunkPlan, visit, *,
               dx: Tensor | None = None, dw: Tensor | None = None, db: Tensor | None = None,
               logits_dtype: torch.dtype | None = None, kept: Tensor | None = None) -> None:
    """Run the chunks of consecutive tokens of the 2-D ``hidden``: each chunk's logits by one matmul
    into a reused scratch (``logits_dtype``, default the input dtype), then ``visit(logits, start,
    end)``, which reads them and, when any of ``dx``/``dw``/``db`` is given, returns
    ``dLoss/dLogits`` in the input dtype (usually written over the logits themselves; ``None``
    means the logits buffer holds it), zero rows for tokens that take no gradient; then
    ``dx[chunk] = g @ W``, ``dw += g.T @ h`` (``=`` on the first chunk: ``dw`` may be
    uninitialised), ``db += g.sum(0)``. With ``kept`` (``(tokens, vocab)``, the caller's), each
    chunk's logits are written into its rows there instead of the scratch, and stay."""
    vocab = weight.shape[0]
    if kept is None:
        scratch = torch.empty((chunks.chunk, vocab), dtype=logits_dtype or hidden.dtype, device=hidden.device)
    for index in range(chunks.n_chunks):
        start, end = chunks.bounds(index)
        h = hidden[start:end]
        logits = head_logits(h, weight, bias, scratch[: end - start] if kept is None else kept[start:end])
        g = visit(logits, start, end)
        g = logits if g is None else g
        if dx is not None:
            torch.mm(g, weight, out=dx[start:end])
        if dw is not None:
            accumulate_dw(dw, g, h, first=index == 0)
        if db is not None:
            db += g.sum(dim=0, dtype=torch.float32)


def grad_tile_loop(hidden: Tensor, weight: Tensor, bias: Tensor | None, chunks: ChunkPlan, width: int, visit, *,
                   dx: Tensor | None = None, dw: Tensor | None = None, db: Tensor | None = None,
                   kept: Tensor | None = None) -> None:
    """The backward's loop over ``(token chunk, vocabulary tile)`` tiles (:func:`grad_tiles`): each
    tile's logits ``h @ weight[v0:v1].T (+ bias)`` by one matmul into a reused scratch (or, with
    ``kept``, the forward's whole logits, the tile read from them: no matmul), then ``visit(logits,
    grad, start, end, v0)`` writes ``dLoss/dLogits`` into ``grad`` (the scratch tile; the logits
    themselves unless ``kept``); then ``dw[v0:v1] += g.T @ h`` (written, not added, by the first
    token chunk: ``dw`` may be uninitialised), ``db[v0:v1] += g.sum(0)`` and ``dx[chunk] += g @
    weight[v0:v1]`` (accumulated in fp32 over the tiles, one rounding at the end, where the
    vocabulary takes more than one tile). The kept logits are only read: a second backward through
    the same graph finds them as the forward left them."""
    vocab = weight.shape[0]
    scratch = torch.empty(chunks.chunk * width, dtype=hidden.dtype, device=hidden.device)
    tiled = width < vocab
    dx_acc = (torch.empty((chunks.chunk, hidden.shape[1]), dtype=torch.float32, device=hidden.device)
              if dx is not None and tiled else None)
    for index in range(chunks.n_chunks):
        start, end = chunks.bounds(index)
        h = hidden[start:end]
        for v0 in range(0, vocab, width):
            v1 = min(v0 + width, vocab)
            w = weight[v0:v1]
            g = scratch[: (end - start) * (v1 - v0)].view(end - start, v1 - v0)
            if kept is None:
                logits = head_logits(h, w, bias[v0:v1] if bias is not None else None, g)
            else:
                logits = kept[start:end, v0:v1]
            visit(logits, g, start, end, v0)
            if dx is not None and not tiled:
                torch.mm(g, w, out=dx[start:end])
            elif dx is not None:
                accumulate_mm(dx_acc[: end - start], g, w, first=v0 == 0)
            if dw is not None:
                accumulate_dw(dw[v0:v1], g, h, first=index == 0)
            if db is not None:
                db[v0:v1] += g.sum(dim=0, dtype=torch.float32)
        if dx_acc is not None:
            dx[start:end].copy_(dx_acc[: end - start])


def head_scales(temperature: float, softcap: float, logit_scale: float) -> tuple[float, float]:
    """The kernels' ``(pre, post)`` for ``z = tanh(x * scale / cap) * cap / T`` (``softcap > 0``) or
    ``z = x * scale / T`` (``softcap == 0``): see :func:`_head_transform`."""
    if softcap:
        return logit_scale / softcap, softcap / temperature
    return 1.0, logit_scale / temperature


def _tiles(wide: bool) -> dict:
    return WIDE_TILES if wide else TILES


def launch_stats(logits, target, logp, lse, ent, sq, mean, top1, ignore_index, temperature, softcap,
                 logit_scale) -> None:
    """The statistics kernel over one chunk of logits (the optional outputs None where not wanted)."""
    rows, cols = logits.shape
    wide = bool(softcap) or sq is not None or mean is not None or top1 is not None
    p = plan_rows(rows, cols, logits.dtype, **_tiles(wide))
    pre, post = head_scales(temperature, softcap, logit_scale)
    _logprob_stats_kernel[(p.grid,)](
        logits, target, logp, lse, ent if ent is not None else lse, sq if sq is not None else lse,
        mean if mean is not None else lse, top1 if top1 is not None else target,
        rows, cols, logits.stride(0), ignore_index, pre, post, 1.0 / cols,
        HAS_SOFTCAP=bool(softcap), HAS_ENTROPY=ent is not None, HAS_SQ=sq is not None,
        HAS_MEAN=mean is not None, HAS_TOP1=top1 is not None,
        BLOCK_ROWS=p.block_rows, BLOCK_COLS=p.block_cols, COL_TILES=p.col_tiles, num_warps=p.num_warps,
    )


def launch_grad(logits, target, lse, ent, g_lp, g_ent, ignore_index, temperature, softcap,
                logit_scale, *, vocab: int, col_start: int, out: Tensor | None = None) -> None:
    """The gradient kernel over one tile of logits (columns ``[col_start, col_start + cols)`` of a
    ``vocab``-wide head), written into ``out`` (a tile of their shape, rows of unit column stride),
    by default over the logits themselves."""
    rows, cols = logits.shape
    out = logits if out is None else out
    p = plan_rows(rows, cols, logits.dtype, **_tiles(bool(softcap)))
    pre, post = head_scales(temperature, softcap, logit_scale)
    _logprob_grad_kernel[(p.grid,)](
        logits, out, target, lse, ent if g_ent is not None else lse,
        g_lp if g_lp is not None else lse, g_ent if g_ent is not None else lse,
        rows, cols, vocab, col_start, logits.stride(0), out.stride(0), ignore_index, pre, post,
        HAS_SOFTCAP=bool(softcap), HAS_LP_GRAD=g_lp is not None, HAS_ENT_GRAD=g_ent is not None,
        BLOCK_ROWS=p.block_rows, BLOCK_COLS=p.block_cols, COL_TILES=p.col_tiles, num_warps=p.num_warps,
    )


# -------------------------------------------------------------------------------------- custom ops


@custom_op("chunked_logprob_forward")
def chunked_logprob_forward(hidden: Tensor, weight: Tensor, bias: Tensor | None, target: Tensor,
                            ignore_index: int, temperature: float, softcap: float, logit_scale: float,
                            entropy: bool, log_sum_sq_probs: bool, mean_logits: bool, is_top1: bool,
                            chunk_tokens: int, accum_fp32: bool, keep_logits: bool
                            ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(logp, lse, entropy, log_sum_sq_probs, mean_logits, is_top1, logits)`` per token of the 2-D
    ``hidden`` (fp32; ``is_top1`` bool; each optional one empty unless asked for), over the logits
    ``transform(hidden @ weight.T + bias)`` (``logit_scale``, soft-capping at ``softcap`` unless it
    is 0, ``temperature``). One head matmul per chunk and the statistics kernel; nothing else is
    kept, unless ``keep_logits``: then the chunks (up to ``GRAD_TILE_TOKENS`` tall) write into one
    ``(tokens, vocab)`` buffer in the input dtype, returned as ``logits`` for the backward to read
    instead of recomputing them (empty otherwise). ``accum_fp32`` is the backward's (its weight gradient
    accumulated in fp32): the chunks take the backward's scratch budget."""
    tokens, vocab = hidden.shape[0], weight.shape[0]
    f32 = dict(dtype=torch.float32, device=hidden.device)
    logp = torch.empty(tokens, **f32)
    lse = torch.empty(tokens, **f32)
    ent = torch.empty(tokens if entropy else 0, **f32)
    sq = torch.empty(tokens if log_sum_sq_probs else 0, **f32)
    mean = torch.empty(tokens if mean_logits else 0, **f32)
    top1 = torch.empty(tokens if is_top1 else 0, dtype=torch.int8, device=hidden.device)
    kept = hidden.new_empty((tokens, vocab) if keep_logits else (0,))
    if tokens:
        if keep_logits:
            # Chunks as tall as the backward's tiles, each written into its rows of the kept logits
            # (tall enough for the GEMM, and no single GEMM output beyond 2**31 elements).
            row_bytes = vocab * kept.element_size()
            chunks = plan_token_chunks(tokens, row_bytes, GRAD_TILE_TOKENS * row_bytes, multiple=1)
        else:
            # The backward's scratch budget (twice the tokens with an fp32 weight gradient): the
            # backward holds that much anyway, and the head's GEMM runs deeper in the token dimension.
            chunks = chunk_plan(tokens, hidden.shape[1], vocab, hidden.dtype, accum_fp32=accum_fp32,
                                chunk_tokens=chunk_tokens, device=hidden.device)

        def visit(logits, start, end):
            def part(t, wanted):
                return t[start:end] if wanted else None

            launch_stats(logits, target[start:end], logp[start:end], lse[start:end], part(ent, entropy),
                         part(sq, log_sum_sq_probs), part(mean, mean_logits), part(top1, is_top1),
                         ignore_index, temperature, softcap, logit_scale)

        chunk_loop(hidden, weight, bias, chunks, visit, kept=kept if keep_logits else None)
    return logp, lse, ent, sq, mean, top1.view(torch.bool), kept


@chunked_logprob_forward.register_fake
def _(hidden, weight, bias, target, ignore_index, temperature, softcap, logit_scale, entropy, log_sum_sq_probs,
      mean_logits, is_top1, chunk_tokens, accum_fp32, keep_logits):
    tokens = hidden.shape[0]
    f32 = dict(dtype=torch.float32)
    return (hidden.new_empty(tokens, **f32), hidden.new_empty(tokens, **f32),
            hidden.new_empty(tokens if entropy else 0, **f32),
            hidden.new_empty(tokens if log_sum_sq_probs else 0, **f32),
            hidden.new_empty(tokens if mean_logits else 0, **f32),
            hidden.new_empty(tokens if is_top1 else 0, dtype=torch.bool),
            hidden.new_empty((tokens, weight.shape[0]) if keep_logits else (0,)))


@custom_op("chunked_logprob_backward")
def chunked_logprob_backward(grad_logp: Tensor | None, grad_entropy: Tensor | None, hidden: Tensor, weight: Tensor,
                             bias: Tensor | None, target: Tensor, lse: Tensor, entropy: Tensor,
                             logits: Tensor,
                             ignore_index: int, temperature: float, softcap: float, logit_scale: float,
                             chunk_tokens: int, accum_fp32: bool, grad_hidden: bool, grad_weight: bool,
                             grad_bias: bool) -> tuple[Tensor, Tensor, Tensor]:
    """``(dhidden, dweight, dbias)`` for per-token incoming gradients of ``logp`` and of the
    entropy (either may be None: no such term): each chunk's logits recomputed (or, where the
    forward kept them, ``logits`` non-empty, read from there), their gradient written into a scratch
    tile by one kernel, then the gradient matmuls, over :func:`grad_tiles`' tiles of tokens and
    vocabulary; ``dweight`` accumulates in the
    weight's dtype (one rounding per chunk) or, with ``accum_fp32``, in fp32 (cast once at the end:
    a head-sized fp32 buffer and its cast alive together), ``dbias`` in fp32. Empty tensors for the
    gradients not asked for."""
    tokens, width = hidden.shape
    dx = torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device) if grad_hidden else None
    dw_dtype = torch.float32 if accum_fp32 else weight.dtype
    # dw is written by the first token chunk of the tile loop; zero only where no loop runs.
    dw = torch.empty(weight.shape, dtype=dw_dtype, device=hidden.device) if grad_weight else None
    db = torch.zeros(bias.shape, dtype=torch.float32, device=hidden.device) if grad_bias else None
    wanted = grad_hidden or grad_weight or grad_bias
    if not tokens or (wanted and grad_logp is None and grad_entropy is None):
        for t in (dx, dw):
            if t is not None:
                t.zero_()
    elif wanted:
        g_lp = grad_logp.to(torch.float32).contiguous() if grad_logp is not None else None
        g_ent = grad_entropy.to(torch.float32).contiguous() if grad_entropy is not None else None
        vocab = weight.shape[0]
        chunks, tile = grad_tiles(tokens, width, vocab, hidden.dtype,
                                  accum_fp32=grad_weight and dw_dtype == torch.float32, chunk_tokens=chunk_tokens,
                                  device=hidden.device)

        def visit(logits, grad, start, end, col_start):
            launch_grad(logits, target[start:end], lse[start:end],
                        entropy[start:end] if g_ent is not None else None,
                        g_lp[start:end] if g_lp is not None else None,
                        g_ent[start:end] if g_ent is not None else None, ignore_index, temperature, softcap,
                        logit_scale, vocab=vocab, col_start=col_start, out=grad)

        grad_tile_loop(hidden, weight, bias, chunks, tile, visit, dx=dx, dw=dw, db=db,
                       kept=logits if logits.numel() else None)
    empty = hidden.new_empty(0)
    return (dx if dx is not None else empty, dw.to(weight.dtype) if dw is not None else empty,
            db.to(bias.dtype) if db is not None else empty)


@chunked_logprob_backward.register_fake
def _(grad_logp, grad_entropy, hidden, weight, bias, target, lse, entropy, logits, ignore_index, temperature,
      softcap, logit_scale, chunk_tokens, accum_fp32, grad_hidden, grad_weight, grad_bias):
    empty = hidden.new_empty(0)
    return (hidden.new_empty(hidden.shape) if grad_hidden else empty,
            weight.new_empty(weight.shape) if grad_weight else empty,
            bias.new_empty(bias.shape) if grad_bias else empty)


def _setup_context(ctx, inputs, output):
    """Saves the inputs, the fp32 ``lse`` (and entropy) per token and the kept logits (empty unless
    ``keep_logits``). Gradients are not materialised: an output that takes none (the entropy,
    logged only) costs nothing in backward."""
    (hidden, weight, bias, target, ignore_index, temperature, softcap, logit_scale, entropy, _sq, _mean, _top1,
     chunk_tokens, accum_fp32, _keep) = inputs
    _logp, lse, ent, sq, mean, top1, kept = output
    ctx.mark_non_differentiable(lse, sq, mean, top1, kept)
    ctx.options = (ignore_index, temperature, softcap, logit_scale, chunk_tokens, accum_fp32)
    ctx.entropy = entropy
    ctx.save_for_backward(hidden, weight, bias, target, lse, ent, kept)


def logprob_grads(saved, options, entropy: bool, needs_input_grad, grad_logp, grad_ent):
    """``(dhidden, dweight, dbias)`` (None where not needed) from the tensors and options
    :func:`_setup_context` saves: the backward of ``chunked_logprob_forward``, shared by its
    autograd registration and by wrappers that must run it inside a context of their own (TRL's
    ZeRO-3 gather, ``onca.integrations.trl``)."""
    hidden, weight, bias, target, lse, ent, kept = saved
    need_h, need_w, need_b = needs_input_grad[:3]
    need_b = bias is not None and need_b
    grad_ent = grad_ent if entropy else None
    dx, dw, db = chunked_logprob_backward(grad_logp, grad_ent, hidden, weight, bias, target, lse, ent, kept,
                                          *options, need_h, need_w, need_b)
    return dx if need_h else None, dw if need_w else None, db if need_b else None


def _backward(ctx, grad_logp, _grad_lse, grad_ent, *_):
    dx, dw, db = logprob_grads(ctx.saved_tensors, ctx.options, ctx.entropy, ctx.needs_input_grad, grad_logp,
                               grad_ent)
    return (dx, dw, db) + (None,) * 12


register_autograd(chunked_logprob_forward, _backward, setup_context=_setup_context)


# ------------------------------------------------------------------------------------------ public


def validate_head(hidden, weight, labels, bias, *, hidden_name="hidden", weight_name="weight",
                  labels_name="labels", bias_name="bias") -> None:
    """The checks every chunked head shares: float ``hidden (..., H)`` and ``weight (V, H)`` of one
    dtype and device, integer ``labels`` of ``hidden``'s shape without ``H``, ``bias (V,)``."""
    check_float(hidden, hidden_name)
    check_float(weight, weight_name)
    if hidden.dim() < 1:
        raise ValueError(f"{hidden_name} must be (..., hidden), got a 0-d tensor")
    h = hidden.shape[-1]
    if weight.dim() != 2 or weight.shape[1] != h or weight.shape[0] == 0 or h == 0:
        raise ValueError(f"{weight_name} must be (vocab, hidden) = (V, {h}) with V, hidden >= 1, "
                         f"got shape {tuple(weight.shape)}")
    if weight.dtype != hidden.dtype:
        raise TypeError(f"{weight_name} must have {hidden_name}'s dtype {hidden.dtype}, got {weight.dtype}")
    check_same_device(weight, weight_name, hidden, hidden_name)
    if bias is not None:
        check_tensor(bias, bias_name)
        if bias.dtype != hidden.dtype:
            raise TypeError(f"{bias_name} must have {hidden_name}'s dtype {hidden.dtype}, got {bias.dtype}")
        if tuple(bias.shape) != (weight.shape[0],):
            raise ValueError(f"{bias_name} must have shape ({weight.shape[0]},) (the vocab), "
                             f"got {tuple(bias.shape)}")
        check_same_device(bias, bias_name, hidden, hidden_name)
    check_tensor(labels, labels_name)
    check_index(labels, labels_name)
    if tuple(labels.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(f"{labels_name} must have shape {tuple(hidden.shape[:-1])} ({hidden_name}'s shape "
                         f"without the hidden size), got {tuple(labels.shape)}")
    check_same_device(labels, labels_name, hidden, hidden_name)


def check_options(ignore_index, temperature, chunk_tokens) -> None:
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"ignore_index must be an int, got {ignore_index!r}")
    check_number(temperature, "temperature")
    if not 0.0 < temperature < float("inf"):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
    if chunk_tokens is not None and (isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int)
                                     or chunk_tokens < 1):
        raise ValueError(f"chunk_tokens must be None or a positive int, got {chunk_tokens!r}")


def head_inputs(hidden: Tensor, *tensors):
    """Under ``torch.autocast``: the floating tensors cast to the autocast dtype, as ``F.linear``
    would cast them, and whether autocast must be switched off around the op; else as they are."""
    device_type = hidden.device.type
    if not autocast_enabled(device_type):
        return (hidden, *tensors), False
    dtype = torch.get_autocast_dtype(device_type)
    cast = lambda t: t.to(dtype) if isinstance(t, Tensor) and t.is_floating_point() else t
    return tuple(cast(t) for t in (hidden, *tensors)), True


def chunked_logprobs(hidden: Tensor, weight: Tensor, labels: Tensor, bias: Tensor | None = None, *,
                     ignore_index: int = -100, temperature: float = 1.0, entropy: bool = False,
                     chunk_tokens: int | None = None, accum_dtype: torch.dtype | None = None,
                     keep_logits: bool = False) -> tuple[Tensor, Tensor | None]:
    """Per-token ``log_softmax((hidden @ weight.T + bias) / temperature)[labels]`` (fp32, shaped like
    ``labels``, 0 where ``labels == ignore_index``) and, with ``entropy=True``, each token's entropy
    (0 where ignored), chunked over tokens so that the logits never exist in full; differentiable
    w.r.t. ``hidden``, ``weight`` and ``bias``. See the module docstring. Under ``torch.autocast``
    the floating inputs are cast to the autocast dtype first, as ``F.linear`` would. The weight
    gradient accumulates over the chunks in the weight's dtype (one rounding per chunk, as
    liger-kernel's chunked losses), or in fp32 with ``accum_dtype=torch.float32`` (as TRL's kernel;
    a head-sized fp32 buffer more at the backward's peak). ``keep_logits=True`` trades memory for
    speed: the forward keeps the whole ``(tokens, vocab)`` logits in the input dtype (``tokens *
    vocab * itemsize`` bytes until the backward has run) and the backward reads them instead of
    recomputing them, three head matmuls instead of four, with the same result to rounding
    (``chunk_tokens`` then sizes only the backward's tiles)."""
    check_tensor(hidden, "hidden")
    check_bool(entropy, "entropy")
    check_bool(keep_logits, "keep_logits")
    check_options(ignore_index, temperature, chunk_tokens)
    (hidden, weight, bias), cast = head_inputs(hidden, weight, bias)
    validate_head(hidden, weight, labels, bias)
    return checked_logprobs(hidden, weight, labels, bias, ignore_index, temperature, entropy, chunk_tokens,
                            check_accum_dtype(accum_dtype, weight.dtype), keep_logits, cast)


def checked_logprobs(hidden: Tensor, weight: Tensor, labels: Tensor, bias: Tensor | None, ignore_index: int,
                     temperature: float, entropy: bool, chunk_tokens: int | None, accum_fp32: bool,
                     keep_logits: bool, autocast: bool) -> tuple[Tensor, Tensor | None]:
    """:func:`chunked_logprobs` of inputs its checks have passed (the post-training losses check
    theirs once, :func:`onca.ops._posttrain.check_common`: a small call's host time is what it
    costs), already in the autocast dtype where ``autocast`` (which is then off around the op)."""
    if small_head(hidden, weight, labels):
        logp, ent, *_ = torch_logprobs(hidden, weight, bias, labels, ignore_index, float(temperature),
                                       0.0, 1.0, entropy)
        return logp, ent
    args = (hidden, weight, labels, bias, ignore_index, temperature, entropy, chunk_tokens, accum_fp32,
            keep_logits)
    if autocast:
        with torch.autocast(hidden.device.type, enabled=False):
            return _chunked_logprobs(*args)
    return _chunked_logprobs(*args)


def small_head(hidden: Tensor, weight: Tensor, labels: Tensor, *, count: bool = True) -> bool:
    """Whether a head call is small (:mod:`onca.ops._small_calls`: its logits at most the limit's
    elements, eager, on CUDA, outside autocast); counted as taken when ``count``."""
    logits = labels.numel() * weight.shape[0]
    if count:
        return small_calls.small(logits, hidden, weight)
    return small_calls.fits(logits, hidden, weight)


def torch_logprobs(hidden: Tensor, weight: Tensor, bias: Tensor | None, labels: Tensor, ignore_index: int,
                   temperature: float, softcap: float, logit_scale: float, entropy: bool,
                   log_sum_sq_probs: bool = False, mean_logits: bool = False,
                   is_top1: bool = False) -> tuple[Tensor, ...]:
    """A small call's ``(logp, entropy, log_sum_sq_probs, mean_logits, is_top1)`` (each statistic
    None unless asked for; shaped like ``labels``; 0 / False where ignored) by torch's ops: the
    logits in the input dtype by one GEMM, then in fp32 the transform, ``log_softmax`` and ATen's
    ``nll_loss`` (the gather that zeroes ignored labels), where the chunk driver's kernels would
    read the same logits in fp32 (values to rounding, the incoming gradient rounded to the input
    dtype before the GEMMs, as there). ``logp`` and the
    entropy take gradients by autograd; the other statistics are detached, as the op's. One
    difference: a label outside ``[0, V)`` (not ``ignore_index``) stops with torch's device-side
    assertion where the kernels return NaN."""
    z = torch.nn.functional.linear(hidden, weight, bias).float()
    if softcap:
        z = torch.tanh(z * (logit_scale / softcap)) * (softcap / temperature)
    elif logit_scale != 1.0 or temperature != 1.0:
        z = z * (logit_scale / temperature)
    log_probs = torch.log_softmax(z, -1)
    # ATen's nll_loss (no reduction) gathers each label's log-probability and writes 0 where the
    # label is ignore_index, in one kernel each way; with the negation, two forward launches where
    # a mask, a where on the labels, a gather and a where on the result take four (each tens of
    # microseconds of host time on a slow host).
    rows = log_probs if log_probs.dim() == 2 else log_probs.view(-1, log_probs.shape[-1])
    flat = labels.reshape(-1)
    flat = flat if flat.dtype == torch.int64 else flat.long()
    nll = torch._C._nn.nll_loss(rows, flat, None, 0, ignore_index)
    logp = -(nll if labels.dim() == 1 else nll.view(labels.shape))
    if not (entropy or log_sum_sq_probs or mean_logits or is_top1):
        return logp, None, None, None, None
    # The argmax is a class in [0, V): it never equals an ignore_index outside the vocabulary (-100),
    # so the top-1 flags need the mask only for an ignore_index that is a class.
    top1_masked = is_top1 and 0 <= ignore_index < z.shape[-1]
    scored = labels != ignore_index if (entropy or log_sum_sq_probs or mean_logits or top1_masked) else None
    ent = torch.where(scored, -(log_probs.exp() * log_probs).sum(-1), 0.0) if entropy else None
    if not (log_sum_sq_probs or mean_logits or is_top1):
        return logp, ent, None, None, None
    with torch.no_grad():
        sq = torch.where(scored, torch.logsumexp(2 * log_probs, -1), 0.0) if log_sum_sq_probs else None
        mean = torch.where(scored, z.mean(-1), 0.0) if mean_logits else None
        top1 = None
        if is_top1:
            top1 = z.argmax(-1) == labels  # torch's argmax: the first maximum
            top1 = top1 & scored if top1_masked else top1
    return logp, ent, sq, mean, top1


def _chunked_logprobs(hidden, weight, labels, bias, ignore_index, temperature, entropy, chunk_tokens,
                      accum_fp32, keep_logits):
    h2d = as_rows(hidden)
    logp, _lse, ent, _sq, _mean, _top1, _kept = chunked_logprob_forward(
        h2d, weight.contiguous(), bias.contiguous() if bias is not None else None, labels.reshape(-1).contiguous(),
        ignore_index, float(temperature), 0.0, 1.0, entropy, False, False, False, chunk_tokens or 0,
        accum_fp32, keep_logits)
    shape = labels.shape
    return logp.view(shape), (ent.view(shape) if entropy else None)
