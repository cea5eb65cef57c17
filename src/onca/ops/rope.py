"""Rotary position embedding (RoPE) in the Hugging Face ``rotate_half`` convention.

For a head ``x`` of width ``head_dim`` and ``cos``/``sin`` rows of width ``rotary_dim`` (``R``,
even, at most ``head_dim``), with ``h = R / 2``::

    y[:h]  = x[:h] * cos[:h] - x[h:R] * sin[:h]
    y[h:R] = x[h:R] * cos[h:] + x[:h] * sin[h:]
    y[R:]  = x[R:]                                      (partial rotary: passed through)

which is ``x * cos + rotate_half(x) * sin`` on the first ``R`` dims, as in transformers'
``apply_rotary_pos_emb`` (Llama, Qwen, Mistral: ``R == head_dim``; Phi-3 style partial rotary:
``R < head_dim``). The interleaved convention (GLM's ``x[0::2]``/``x[1::2]`` pairs) is not this op.

One launch rotates ``q`` (``Hq`` heads) and ``k`` (``Hk`` heads, ``Hk`` may differ: GQA/MQA). A
program takes a block of tokens, loads their ``cos``/``sin`` rows once (both halves, so cos/sin need
not be duplicated ``cat(freqs, freqs)`` rows), and applies them to every head of ``q`` and ``k`` of
those tokens, a tile of (tokens x heads x half-width) at a time: each half is one wide load.

Layouts, as ``cos.unsqueeze(unsqueeze_dim)`` broadcasts in transformers: ``cos``/``sin`` of shape
``(1 or batch, seq, rotary_dim)`` with ``unsqueeze_dim=1`` take ``(batch, heads, seq, head_dim)``
tensors, with ``unsqueeze_dim=2`` ``(batch, seq, heads, head_dim)``; the vision towers' 2-D
``(seq, rotary_dim)`` tables do the same with ``unsqueeze_dim`` 0 and 1 (they reach the kernels as a
``(1, seq, rotary_dim)`` view). Any strides with a unit last-dim stride are read in place (e.g.
``q_proj(x).view(B, S, H, D).transpose(1, 2)``); the outputs take the input's memory layout
(``torch.empty_like``), as PyTorch's elementwise ops do. No tokens gives empty results, as in PyTorch.

The output dtype follows PyTorch's promotion of ``q`` (``k``), ``cos`` and ``sin``, as the Hugging
Face expression does; the kernels compute in fp32 and round once.

Backward is the adjoint of the rotation (with duplicated cos/sin rows: the rotation by ``-sin``),
one launch for ``dq`` and ``dk``. Saved for backward: ``cos`` and ``sin`` only (references to the
caller's tensors, no copies). ``cos``/``sin`` get no gradient (``None``): they are derived from
fixed frequencies and positions and are never trained; nor does ``k`` when ``k_embed`` is unused
(likewise ``q``), as in eager PyTorch. ``overwrite_grad_output=True`` (opt-in, eager route only)
writes ``dq``/``dk`` over the incoming gradients instead of new buffers, and ``overwrite_inputs=True``
(likewise) the rotated heads over ``q``/``k`` (the kernel loads each element before storing it).

The launchers are the custom ops ``torch.ops.onca.rope_forward`` and ``rope_backward`` (see
``onca/ops/_contract.py``); ``rotary_pos_emb`` validates and picks the layout.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from onca.device import DeviceProfile, get_profile
from onca.ops._contract import custom_op, register_autograd, tracing
from onca.ops._launch import fast_launch, launch_config, prepared_key
from onca.ops._validate import check_bool, check_float, check_same_device
from onca.tiling import RowPlan, cdiv, next_power_of_2, plan_rows

__all__ = ["RopeTiles", "plan", "rotary_pos_emb", "tiles"]

# Live tiles of the kernel per element of a (tokens x heads x half-width) tile, as the planner
# counts them: x1, x2 as loaded and y1, y2 as stored (input / output dtype); x1, x2, y1, y2 in fp32;
# and the per-token cos/sin halves (c1, c2, s1, s2) as loaded (at most 4 bytes) and in fp32. The
# cos/sin tiles are (tokens x half-width), a head block's fraction of a full tile; they are counted
# as full tiles so the budget holds even for a one-head block. The pass-through copy of a partial
# rotary head uses at most two tiles of twice the half-width (in and out), within this count.
TILES = dict(live_tiles=4, fp32_tiles=4 + 8)

# Warps of a GPU program at most. The planner gives a 128-head tile (Llama-3.1-405B: 128 x 64
# elements per half) 16 warps, which ran fwd+bwd in 601 us on an H100 (CUDA-graph replay, bf16,
# 4 x 2048 tokens) against 430 us with 8; tiles of up to 64 heads keep the planner's 4 or 8.
MAX_WARPS = 8

# Heads per loop step of a GPU program: measured on an H100 (fwd+bwd in place, CUDA-graph replay,
# bf16, 4 x 2048 tokens), steps of 8 heads against the planner's whole-token tile: Llama-3-8B 125
# against 130 us, Gemma-2-9B 152 / 159, Qwen3-0.6B 82 / 86, Llama-3.1-405B 409 / 431, 8192
# positions 474 / 515 (liger-kernel 124, 145, 78, 410, 474); Phi-3-mini 154 / 150. 4 and 16 were
# slower.
GPU_HEAD_BLOCK = 8

# Warps of a GPU program of multimodal RoPE at most (its cos/sin gathered from three position
# streams by column). Measured on an H200 (fwd+bwd in place, CUDA-graph replay, bf16, 4 x 2048
# tokens unless named), 2 warps against the tile's 4, us: Qwen2.5-7B 77.6 / 81.6, Llama-3-8B 92.3 /
# 95.3, Llama-3.1-405B 295.0 / 306.0, Qwen3-0.6B 59.1 / 60.9, Phi-3-mini 110.8 / 122.2, Gemma-3-27B
# 107.7 / 111.4, Llama-3.2-1B 51.8 / 52.5, 8192 positions 285.1 / 300.7, 16384 686.6 / 703.1,
# Gemma-2-9B 111.6 either way; plain RoPE's were mixed (2 to 8% slower at five of ten), so it keeps 4.
MROPE_GPU_WARPS = 2

# Warps of a GPU program of the interleaved rotation (Llama 4's pairs) at most. Measured on an H200
# (fwd+bwd in place, CUDA-graph replay, bf16, ms), 2 warps against the tile's 4 or 8: 4 x 2048 tokens
# of 40 q / 8 kv heads 0.117 / 0.130, Llama-3-8B 0.100 / 0.099, Qwen3-0.6B 0.061 / 0.063, Gemma-2-9B
# 0.109 / 0.113.
INTERLEAVED_GPU_WARPS = 2

# Elements of a GPU program's (tokens x heads x half-width) step at most, in the rotate-half
# layout: the planner's tokens a tile are cut to fit. H200, bf16, fwd+bwd in place at 4 x 2048 tokens
# (CUDA-graph replay), one token against the planner's two, ms: Qwen3-0.6B's 16 + 8 heads of 128
# 0.060 / 0.065 (ncu: two tokens took 64 registers a thread, half the SM's warps resident), M-RoPE
# there 0.063 / 0.067 (liger-kernel 0.058, 0.061); at head dim 64 (Llama-3.2-1B, 8 x 32-column
# steps) two tokens stay faster, 0.052 / 0.055, and so do Llama 4's pairs (INTERLEAVED) at both
# shapes, 0.051 / 0.054 and 0.061 / 0.063: the planner keeps those. Compiling for all 16 four-warp
# programs an SM instead (``maxnreg`` 32, liger-kernel's kernel takes 32 registers) spilled:
# 0.84-0.90x at head dim 256 and Llama-3.1-405B.
GPU_STEP_ELEMENTS = 512


def _head_block(heads: int, widest: int, gpu: bool) -> int:
    """The heads a program rotates per loop step for one side (q or k): ``widest`` (on a GPU at
    most :data:`GPU_HEAD_BLOCK`), or as many as the side has if fewer; on a GPU, half that where
    it leaves fewer idle lanes in the last step, as for Qwen2-VL-7B's and Qwen2.5-7B's 28 query
    heads (4 steps of 8 rotate 32 lanes, 7 of 4 rotate 28). Each step waits on its own loads, so an
    idle lane costs the time of a busy one: H200, bf16, fwd+bwd in place at 4 x 8192 tokens, 28 q /
    4 kv heads (CUDA-graph replay), M-RoPE 301 against 319 us, RoPE 291 against 303; with no idle
    lanes (32 / 8 heads, 4 x 2048 tokens) steps of 4 were 3-4% slower."""
    block = min(widest, next_power_of_2(heads))
    half = block // 2
    if gpu and half and cdiv(heads, half) * half < cdiv(heads, block) * block:
        return half
    return block


# ----------------------------------------------------------------------------------------- kernels


@triton.jit
def _rotate_heads(
    x_ptr, y_ptr, x_tok, y_tok, row_mask, n_heads, x_sh, y_sh,
    j0, j, j_mask, c1, c2, a, b,
    HALF: tl.constexpr, INTERLEAVED: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_J: tl.constexpr,
):
    """Rotate every head of the tokens ``x_tok`` (row offsets) in blocks of ``BLOCK_H`` heads; the
    pair of column ``j`` (``j0 + arange(BLOCK_J)``) is ``(j, j + HALF)``, or ``(2j, 2j + 1)`` when
    ``INTERLEAVED``."""
    h_range = tl.arange(0, BLOCK_H)
    for h0 in tl.range(0, n_heads, BLOCK_H):
        heads = h0 + h_range
        h64 = heads.to(tl.int64)
        if INTERLEAVED:
            # The mask of the pairs' 2 * BLOCK_J contiguous columns, from their column range: built
            # from the pairs' mask (tl.join and a reshape) it hid that the columns are contiguous, and
            # every access was a 2-byte one (H200, bf16, fwd+bwd in place, CUDA-graph replay, Llama 4
            # RoPE: Gemma-2-9B's shape 0.272 against 0.113 ms, Qwen3-0.6B's 0.174 against 0.063).
            cols_mask = (2 * j0 + tl.arange(0, 2 * BLOCK_J)) < 2 * HALF
            mask = row_mask[:, None, None] & (heads < n_heads)[None, :, None] & cols_mask[None, None, :]
            _rotate_pairs(x_ptr + 2 * j0, y_ptr + 2 * j0, x_tok, y_tok, h64, x_sh, y_sh, mask,
                          c1, c2, a, b, BLOCK_T, BLOCK_H, BLOCK_J)
        else:
            mask = row_mask[:, None, None] & (heads < n_heads)[None, :, None] & j_mask[None, None, :]
            x_off = x_tok[:, None, None] + (h64 * x_sh)[None, :, None] + j[None, None, :]
            y_off = y_tok[:, None, None] + (h64 * y_sh)[None, :, None] + j[None, None, :]
            x1 = tl.load(x_ptr + x_off, mask=mask, other=0.0).to(tl.float32)
            x2 = tl.load(x_ptr + x_off + HALF, mask=mask, other=0.0).to(tl.float32)
            y1 = x1 * c1 + x2 * a
            y2 = x2 * c2 + x1 * b
            tl.store(y_ptr + y_off, y1.to(y_ptr.dtype.element_ty), mask=mask)
            tl.store(y_ptr + y_off + HALF, y2.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotate_pairs(x_ptr, y_ptr, x_tok, y_tok, h64, x_sh, y_sh, mask, c1, c2, a, b,
                  BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_J: tl.constexpr):
    """The interleaved rotation of pairs ``(2j, 2j + 1)``, ``j`` in ``[0, BLOCK_J)``: each head's
    ``2 * BLOCK_J`` columns are loaded and stored as one contiguous row and split into the pairs'
    first and second elements in registers, rather than read and written as every other element
    (narrow strided accesses). ``mask`` is the columns' ``(BLOCK_T, BLOCK_H, 2 * BLOCK_J)``."""
    col = tl.arange(0, 2 * BLOCK_J)
    x_off = x_tok[:, None, None] + (h64 * x_sh)[None, :, None] + col[None, None, :]
    y_off = y_tok[:, None, None] + (h64 * y_sh)[None, :, None] + col[None, None, :]
    xx = tl.load(x_ptr + x_off, mask=mask, other=0.0).to(tl.float32)
    x1, x2 = tl.split(tl.reshape(xx, (BLOCK_T, BLOCK_H, BLOCK_J, 2)))
    y1 = x1 * c1 + x2 * a
    y2 = x2 * c2 + x1 * b
    yy = tl.reshape(tl.join(y1, y2), (BLOCK_T, BLOCK_H, 2 * BLOCK_J))
    tl.store(y_ptr + y_off, yy.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _copy_heads(
    x_ptr, y_ptr, x_tok, y_tok, row_mask, n_heads, x_sh, y_sh, p, p_mask, BLOCK_H: tl.constexpr,
):
    """Copy (and cast) the columns ``p`` of every head: the pass-through part of partial rotary."""
    h_range = tl.arange(0, BLOCK_H)
    for h0 in tl.range(0, n_heads, BLOCK_H):
        heads = h0 + h_range
        h64 = heads.to(tl.int64)
        mask = row_mask[:, None, None] & (heads < n_heads)[None, :, None] & p_mask[None, None, :]
        x = tl.load(x_ptr + x_tok[:, None, None] + (h64 * x_sh)[None, :, None] + p[None, None, :],
                    mask=mask, other=0.0)
        tl.store(y_ptr + y_tok[:, None, None] + (h64 * y_sh)[None, :, None] + p[None, None, :],
                 x.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _table_load(at, stream_stride, j, mask, MROPE: tl.constexpr, SEC_T: tl.constexpr, SEC_H: tl.constexpr):
    """Columns ``j`` of a cos/sin table as fp32 (``at``: their addresses in the temporal stream for
    contiguous M-RoPE sections, ``MROPE == 1``). Contiguous sections take one masked load per
    stream, each over consecutive columns (vector loads), rather than one load through a
    per-column stream offset: H100, bf16, fwd+bwd at 4 x 2048 tokens, 84 against 96 us at
    Qwen3-0.6B's heads, 155 against 171 at Gemma-2-9B's."""
    if MROPE == 1:
        in_h = (j >= SEC_T) & (j < SEC_T + SEC_H)
        v = tl.load(at, mask=mask & (j < SEC_T)[None, :], other=0.0).to(tl.float32)
        v += tl.load(at + stream_stride, mask=mask & in_h[None, :], other=0.0).to(tl.float32)
        in_w = j >= SEC_T + SEC_H
        v += tl.load(at + 2 * stream_stride, mask=mask & in_w[None, :], other=0.0).to(tl.float32)
    else:
        v = tl.load(at, mask=mask, other=0.0).to(tl.float32)
    return v


@fast_launch
@triton.jit
def _rope_kernel(
    xq_ptr, xk_ptr, yq_ptr, yk_ptr, cos_ptr, sin_ptr,
    n_rows, seq_len, n_q_heads, n_kv_heads,
    xq_sb, xq_ss, xq_sh, yq_sb, yq_ss, yq_sh,
    xk_sb, xk_ss, xk_sh, yk_sb, yk_ss, yk_sh,
    cos_sb, cos_ss, sin_sb, sin_ss,
    cos_st, sin_st, cos_sc, sin_sc,
    HALF: tl.constexpr,
    PASS: tl.constexpr,
    BACKWARD: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    MROPE: tl.constexpr,
    SEC_T: tl.constexpr,
    SEC_H: tl.constexpr,
    SEC_W: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    BLOCK_J: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    """Rows are tokens (``batch * seq``); row ``r`` is batch ``r // seq_len``, position ``r % seq_len``.

    Forward ``y = x * cos + rotate_half(x) * sin``; backward its adjoint
    ``dx[:h] = dy[:h] * c1 + dy[h:] * s2``, ``dx[h:] = dy[h:] * c2 - dy[:h] * s1``. Both are
    ``y1 = x1 * c1 + x2 * a`` and ``y2 = x2 * c2 + x1 * b`` with ``(a, b)`` = ``(-s1, s2)`` or
    ``(s2, -s1)``.

    Variants (constexpr; the plain RoPE above is ``INTERLEAVED=False, MROPE=0``):

    - ``INTERLEAVED`` (Llama 4's complex form): the pair of element ``j`` is ``(x[2j], x[2j+1])``
      instead of ``(x[j], x[j+HALF])``, and cos/sin rows are ``HALF`` wide (one value per pair:
      ``c2 = c1``, ``s2 = s1``); ``cos_sc``/``sin_sc`` are their column strides (2 when they are
      the real and imaginary parts of a complex tensor, read in place).
    - ``MROPE`` (Qwen2-VL's multimodal RoPE): cos/sin hold three position streams (temporal,
      height, width) ``cos_st``/``sin_st`` apart, and column ``j`` of each half reads stream
      ``0``/``1``/``2`` by section: ``MROPE == 1`` contiguous sections ``[0, SEC_T)``,
      ``[SEC_T, SEC_T + SEC_H)``, the rest; ``MROPE == 2`` interleaved as Qwen3-VL lays them out
      (``j % 3 == 1`` and ``j < 3 * SEC_H``: height; ``j % 3 == 2`` and ``j < 3 * SEC_W``: width;
      else temporal).
    """
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    n_row_blocks = tl.cdiv(n_rows, BLOCK_T)
    t_range = tl.arange(0, BLOCK_T)
    for row_block in tl.range(pid, n_row_blocks, n_programs):
        rows = row_block * BLOCK_T + t_range
        row_mask = rows < n_rows
        rows64 = rows.to(tl.int64)
        bi = rows64 // seq_len
        si = rows64 - bi * seq_len
        xq_tok = bi * xq_sb + si * xq_ss
        yq_tok = bi * yq_sb + si * yq_ss
        xk_tok = bi * xk_sb + si * xk_ss
        yk_tok = bi * yk_sb + si * yk_ss
        cos_tok = bi * cos_sb + si * cos_ss
        sin_tok = bi * sin_sb + si * sin_ss
        for j0 in tl.static_range(0, HALF, BLOCK_J):
            j = j0 + tl.arange(0, BLOCK_J)
            j_mask = j < HALF
            cs_mask = row_mask[:, None] & j_mask[None, :]
            # One load of each cos/sin half per token, shared by all heads of q and k.
            j64 = j.to(tl.int64)
            cos_col = j64 * cos_sc
            sin_col = j64 * sin_sc
            if MROPE == 2:
                # Interleaved sections: the stream of each column by a select (not a sum of
                # booleans cast to int64: triton-ascend's adapter aborted on those casts in one
                # fp32 backward tile).
                r3 = j % 3
                stream = tl.where((r3 == 1) & (j < 3 * SEC_H), 1, tl.where((r3 == 2) & (j < 3 * SEC_W), 2, 0))
                cos_col += stream.to(tl.int64) * cos_st
                sin_col += stream.to(tl.int64) * sin_st
            cos_at = cos_ptr + cos_tok[:, None] + cos_col[None, :]
            sin_at = sin_ptr + sin_tok[:, None] + sin_col[None, :]
            c1 = _table_load(cos_at, cos_st, j, cs_mask, MROPE, SEC_T, SEC_H)
            s1 = _table_load(sin_at, sin_st, j, cs_mask, MROPE, SEC_T, SEC_H)
            if INTERLEAVED:
                c2 = c1
                s2 = s1
            else:
                c2 = _table_load(cos_at + HALF * cos_sc, cos_st, j, cs_mask, MROPE, SEC_T, SEC_H)
                s2 = _table_load(sin_at + HALF * sin_sc, sin_st, j, cs_mask, MROPE, SEC_T, SEC_H)
            if BACKWARD:
                a = s2
                b = -s1
            else:
                a = -s1
                b = s2
            c1 = c1[:, None, :]
            c2 = c2[:, None, :]
            a = a[:, None, :]
            b = b[:, None, :]
            _rotate_heads(xq_ptr, yq_ptr, xq_tok, yq_tok, row_mask, n_q_heads, xq_sh, yq_sh,
                          j0, j, j_mask, c1, c2, a, b, HALF, INTERLEAVED, BLOCK_T, BLOCK_HQ, BLOCK_J)
            _rotate_heads(xk_ptr, yk_ptr, xk_tok, yk_tok, row_mask, n_kv_heads, xk_sh, yk_sh,
                          j0, j, j_mask, c1, c2, a, b, HALF, INTERLEAVED, BLOCK_T, BLOCK_HK, BLOCK_J)
        if PASS > 0:
            for p0 in tl.static_range(0, PASS, BLOCK_P):
                p = 2 * HALF + p0 + tl.arange(0, BLOCK_P)
                p_mask = p < 2 * HALF + PASS
                _copy_heads(xq_ptr, yq_ptr, xq_tok, yq_tok, row_mask, n_q_heads, xq_sh, yq_sh,
                            p, p_mask, BLOCK_HQ)
                _copy_heads(xk_ptr, yk_ptr, xk_tok, yk_tok, row_mask, n_kv_heads, xk_sh, yk_sh,
                            p, p_mask, BLOCK_HK)


# ------------------------------------------------------------------------------------------ plans


@dataclass(frozen=True)
class RopeTiles:
    """The kernel's tile, derived from a ``RowPlan`` over rows = tokens and cols = heads x half.

    A tile is ``block_t`` tokens x ``block_hq`` (``block_hk``) heads x ``block_j`` columns of each
    rotary half; ``block_p`` columns of a partial-rotary head's pass-through part are copied at a
    time. ``plan.grid`` programs loop over the ``plan.row_blocks`` token blocks (a persistent grid
    on Ascend: at most one program per vector core). The plan's cols are ``max(Hq, Hk)`` times the
    half width rounded up to a power of two; when they do not fit one tile (``plan.col_tiles > 1``)
    the kernel loops over head blocks and half-width tiles with the token's cos/sin held, still in
    one pass over memory (the planner's generic "two passes" wording does not apply here).
    """

    plan: RowPlan
    half: int
    pass_cols: int
    block_t: int
    block_hq: int
    block_hk: int
    block_j: int
    block_p: int

    @property
    def j_tiles(self) -> int:
        return cdiv(self.half, self.block_j)

    def working_set_bytes(self, itemsize: int, cos_itemsize: int = 4) -> int:
        """Bytes the kernel holds at once: the rotation tiles of the wider head block, and the
        tokens' cos/sin tiles (the pass-through copy holds less)."""
        tile = self.block_t * max(self.block_hq, self.block_hk) * self.block_j
        cs = self.block_t * self.block_j
        return tile * (4 * itemsize + 4 * 4) + cs * 4 * (cos_itemsize + 4)


def _widest(*dtypes: torch.dtype) -> torch.dtype:
    return max(dtypes, key=lambda d: d.itemsize)


def tiles(tokens: int, n_q_heads: int, n_kv_heads: int, head_dim: int, rotary_dim: int,
          dtype: torch.dtype, profile: DeviceProfile | None = None, interleaved: bool = False) -> RopeTiles:
    """The tile the kernel uses for these sizes on ``profile`` (default: the detected one).

    ``dtype`` is the widest of the tensors the kernel reads and writes (q, k and their outputs);
    ``interleaved``: Llama 4's adjacent pairs (:data:`GPU_STEP_ELEMENTS` does not apply).
    """
    return _tiles(int(tokens), int(n_q_heads), int(n_kv_heads), int(head_dim), int(rotary_dim), dtype,
                  profile or get_profile(), bool(interleaved))


@functools.lru_cache(maxsize=1024)
def _tiles(tokens, n_q_heads, n_kv_heads, head_dim, rotary_dim, dtype, profile, interleaved) -> RopeTiles:
    half = rotary_dim // 2
    half_pad = next_power_of_2(half)
    heads = max(n_q_heads, n_kv_heads)
    step = min(GPU_HEAD_BLOCK, next_power_of_2(heads)) * half_pad
    max_tokens = None if interleaved else max(1, GPU_STEP_ELEMENTS // step)
    p = plan_rows(tokens, heads * half_pad, dtype, profile=profile, max_gpu_rows=max_tokens, **TILES)
    block_j = min(half_pad, p.block_cols)
    block_h = p.block_cols // block_j
    gpu = profile.kind == "cuda"
    if gpu:  # the GPU measurements above
        p = dataclasses.replace(p, num_warps=min(p.num_warps, MAX_WARPS))
        block_h = min(block_h, GPU_HEAD_BLOCK)
    pass_cols = head_dim - rotary_dim
    itemsize = dtype.itemsize
    min_block = next_power_of_2(cdiv(profile.align_bytes, itemsize))
    # Pass-through columns are copied this many at a time (1: no pass-through part, no variant).
    block_p = min(max(next_power_of_2(pass_cols), min_block), 2 * block_j) if pass_cols else 1
    return RopeTiles(
        plan=p, half=half, pass_cols=pass_cols, block_t=p.block_rows,
        block_hq=_head_block(n_q_heads, block_h, gpu), block_hk=_head_block(n_kv_heads, block_h, gpu),
        block_j=block_j, block_p=block_p,
    )


def plan(shape, dtype: torch.dtype, profile: DeviceProfile | None = None,
         interleaved: bool = False) -> dict[str, RowPlan]:
    """The plans for ``shape = (batch, seq, q_heads, kv_heads, head_dim[, rotary_dim])``.

    ``(batch, seq, heads, head_dim)`` means as many kv heads as q heads. Forward and backward use
    the same tile (the backward kernel is the forward one with the adjoint coefficients).
    ``interleaved``: the tile of Llama 4's adjacent pairs (:func:`tiles`).
    """
    shape = tuple(int(s) for s in shape)
    if len(shape) == 4:
        batch, seq, hq, d = shape
        hk, r = hq, d
    elif len(shape) in (5, 6):
        batch, seq, hq, hk, d = shape[:5]
        r = shape[5] if len(shape) == 6 else d
    else:
        raise ValueError(
            "rope plan shape must be (batch, seq, q_heads, kv_heads, head_dim[, rotary_dim]) "
            f"or (batch, seq, heads, head_dim), got {shape}"
        )
    if r % 2 or not 2 <= r <= d:
        raise ValueError(f"rotary_dim must be even and in [2, head_dim={d}], got {r}")
    t = tiles(batch * seq, hq, hk, d, r, dtype, profile, interleaved)
    return {"forward": t.plan, "backward": t.plan}


# --------------------------------------------------------------------------------------- launchers


def _bshd(t: Tensor, heads_first: bool) -> tuple[int, int, int, int]:
    """``(batch, seq, heads, head_dim)`` of a q/k-shaped tensor in its layout."""
    b, s1, s2, d = t.shape
    return (b, s2, s1, d) if heads_first else (b, s1, s2, d)


def _bsh_strides(t: Tensor, heads_first: bool) -> tuple[int, int, int]:
    """(batch, seq, head) strides of a q/k-shaped tensor in its layout."""
    sb, s1, s2, _ = t.stride()
    return (sb, s2, s1) if heads_first else (sb, s1, s2)


def _cs_strides(t: Tensor) -> tuple[int, int]:
    """(batch, seq) strides of a cos/sin tensor; broadcast (size-1) dims read with stride 0."""
    return (t.stride(0) if t.shape[0] > 1 else 0), (t.stride(1) if t.shape[1] > 1 else 0)


def _unit_last(t: Tensor) -> Tensor:
    """``t`` with a unit last-dim stride (the kernels read rows of each head as vectors)."""
    return t if t.stride(-1) == 1 or t.shape[-1] == 1 else t.contiguous()


def _output_like(t: Tensor, dtype: torch.dtype) -> Tensor:
    """A new tensor for the kernel's result over ``t``: ``t``'s shape and, where ``t`` is dense, its
    memory layout (the launchers and the fake implementations both allocate through here)."""
    if t.stride(-1) == 1 or t.shape[-1] == 1:
        return torch.empty_like(t, dtype=dtype, memory_format=torch.preserve_format)
    return t.new_empty(t.shape, dtype=dtype)  # the kernel reads a contiguous copy of ``t``


def _dense(t: Tensor) -> bool:
    """Whether ``t``'s elements fill its storage span exactly once (some permutation is contiguous).
    Kept per layout: a permute and ``is_contiguous`` cost more host time than the kernel at small
    sizes, and so does walking the strides on every call."""
    return _dense_layout(t.shape, t.stride())


@functools.lru_cache(maxsize=1024)
def _dense_layout(shape: torch.Size, strides: tuple[int, ...]) -> bool:
    """:func:`_dense` of a layout: its strides, smallest first, are the running products of its
    sizes (size-1 dimensions aside)."""
    if 0 in shape:
        return True
    expected = 1
    for stride, size in sorted((st, sz) for st, sz in zip(strides, shape) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _reusable(grad: Tensor, dtype: torch.dtype) -> bool:
    """Whether the kernel may write its result over ``grad`` (same dtype, unit last-dim stride,
    no element stored twice)."""
    return grad.dtype == dtype and grad.stride(-1) == 1 and _dense(grad)


def _promoted(x: Tensor, cos: Tensor, sin: Tensor) -> torch.dtype:
    """The dtype of ``x * cos + rotate_half(x) * sin`` in PyTorch."""
    return torch.promote_types(torch.promote_types(x.dtype, cos.dtype), sin.dtype)


def _launch(xq: Tensor | None, xk: Tensor | None, cos: Tensor, sin: Tensor, yq: Tensor, yk: Tensor,
            heads_first: bool, backward: bool, interleaved: bool = False,
            mrope: int = 0, sections: tuple[int, int, int] = (0, 0, 0)) -> None:
    """One launch over ``q`` and ``k`` (or, when ``backward``, their outputs' gradients), writing
    ``yq``/``yk``; ``yq is xq`` computes in place (every element is loaded before its own store).
    An absent side (``None``: a gradient that never came) is skipped as a side with no heads.

    ``cos``/``sin`` are ``(1 or batch, seq, width)``, or ``(3, 1 or batch, seq, width)`` with
    ``mrope`` 1 or 2 (the kernel's ``MROPE``; ``sections`` its ``SEC_T, SEC_H, SEC_W``). With
    ``interleaved`` (Llama 4) their width is half the rotary dim and any column stride is read in
    place (the real and imaginary parts of a complex table).

    Everything but the pointers is kept per layout (:func:`launch_config`): at the sizes where the
    host is the cost, deriving the strides and the tile again on every call cost more than the
    launch."""
    q_absent, k_absent = xq is None, xk is None
    if q_absent and k_absent:
        return
    # The absent side's pointers stand in for nothing: with no heads the kernel never reads them.
    xq, yq = (xk, yk) if q_absent else (xq, yq)
    xk, yk = (xq, yq) if k_absent else (xk, yk)
    xq, xk = _unit_last(xq), _unit_last(xk)
    if not interleaved:
        cos, sin = _unit_last(cos), _unit_last(sin)
    key = (_rope_kernel, heads_first, backward, interleaved, mrope, sections, q_absent, k_absent,
           xq.shape, xq.stride(), yq.stride(), xk.shape, xk.stride(), yk.stride(), cos.shape,
           cos.stride(), sin.stride(), xq.dtype, xk.dtype, yq.dtype, yk.dtype, get_profile())
    grid, scalars, constexprs, scalars_key = launch_config(key, lambda: _launch_config(
        xq, xk, cos, sin, yq, yk, heads_first, backward, interleaved, mrope, sections, q_absent, k_absent))
    if grid is not None:  # None: nothing to rotate, never a zero-size grid
        _rope_kernel.launch_prepared(grid, (xq, xk, yq, yk, cos, sin), scalars, constexprs, scalars_key)


def _launch_config(xq, xk, cos, sin, yq, yk, heads_first, backward, interleaved, mrope, sections,
                   q_absent, k_absent):
    """``(grid, scalar arguments, keyword constexprs, their prepared key)`` of :func:`_launch`'s
    kernel for these layouts (the grid None when there is nothing to rotate). A multimodal table's
    pointer is its temporal stream's (index 0 of its first dim), so the table itself is passed."""
    batch, seq, _, head_dim = _bshd(xq, heads_first)
    hq = 0 if q_absent else _bshd(xq, heads_first)[2]
    hk = 0 if k_absent else _bshd(xk, heads_first)[2]
    if batch * seq == 0 or hq + hk == 0:
        return None, (), {}, None
    cos_st, sin_st = (cos.stride(0), sin.stride(0)) if cos.dim() == 4 else (0, 0)
    cos3, sin3 = (cos[0], sin[0]) if cos.dim() == 4 else (cos, sin)
    dtype = _widest(xq.dtype, xk.dtype, yq.dtype, yk.dtype)
    rotary_dim = cos.shape[-1] * (2 if interleaved else 1)
    profile = get_profile()
    t = tiles(batch * seq, hq or hk, hk or hq, head_dim, rotary_dim, dtype, profile, interleaved)
    warps = t.plan.num_warps
    if mrope and profile.kind == "cuda":
        warps = min(warps, MROPE_GPU_WARPS)
    if interleaved and profile.kind == "cuda":
        warps = min(warps, INTERLEAVED_GPU_WARPS)
    scalars = (
        batch * seq, seq, hq, hk,
        *_bsh_strides(xq, heads_first), *_bsh_strides(yq, heads_first),
        *_bsh_strides(xk, heads_first), *_bsh_strides(yk, heads_first),
        *_cs_strides(cos3), *_cs_strides(sin3),
        cos_st, sin_st, cos.stride(-1), sin.stride(-1),
    )
    constexprs = dict(
        HALF=t.half, PASS=t.pass_cols, BACKWARD=backward,
        INTERLEAVED=interleaved, MROPE=mrope, SEC_T=sections[0], SEC_H=sections[1], SEC_W=sections[2],
        BLOCK_T=t.block_t, BLOCK_HQ=t.block_hq, BLOCK_HK=t.block_hk, BLOCK_J=t.block_j,
        BLOCK_P=t.block_p, num_warps=warps,
    )
    return (t.plan.grid,), scalars, constexprs, prepared_key(scalars, constexprs)


def _rotate_forward(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, q_dtype: torch.dtype,
                    k_dtype: torch.dtype, heads_first: bool, overwrite_inputs: bool,
                    **variant) -> tuple[Tensor, Tensor]:
    """The forward launch of every RoPE op: over ``q`` and ``k`` themselves (returning views of
    them) when ``overwrite_inputs`` and :func:`_in_place` allow it, else into new tensors of
    ``q_dtype``/``k_dtype`` in their layouts. ``variant``: :func:`_launch`'s keyword arguments."""
    if overwrite_inputs and _in_place(q, k, q_dtype, k_dtype):
        _launch(q, k, cos, sin, q, k, heads_first, backward=False, **variant)
        return q.view_as(q), k.view_as(k)  # view_as: a third of view(shape)'s host time
    q_embed, k_embed = _output_like(q, q_dtype), _output_like(k, k_dtype)
    _launch(q, k, cos, sin, q_embed, k_embed, heads_first, backward=False, **variant)
    return q_embed, k_embed


@custom_op("rope_forward")
def rope_forward(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, heads_first: bool,
                 overwrite_grad_output: bool, overwrite_inputs: bool) -> tuple[Tensor, Tensor]:
    """``(q_embed, k_embed)`` for 4-D ``q``/``k`` (``(B, H, S, D)`` when ``heads_first``, else
    ``(B, S, H, D)``) and 3-D ``cos``/``sin``. ``overwrite_grad_output`` is the backward's (see
    ``rotary_pos_emb``). ``overwrite_inputs`` (eager route only) rotates ``q``/``k`` in their own
    storage where :func:`_in_place` allows and returns views of them."""
    return _rotate_forward(q, k, cos, sin, _promoted(q, cos, sin), _promoted(k, cos, sin), heads_first,
                           overwrite_inputs)


@rope_forward.register_fake
def _(q, k, cos, sin, heads_first, overwrite_grad_output, overwrite_inputs):
    return _output_like(q, _promoted(q, cos, sin)), _output_like(k, _promoted(k, cos, sin))


def _in_place(q: Tensor, k: Tensor, q_dtype: torch.dtype, k_dtype: torch.dtype) -> bool:
    """Whether the rotation may be written over ``q`` and ``k``: each holds its result's dtype, is
    read in place (unit last-dim stride) and fills its memory span exactly (so views of one fused
    q/k/v buffer, which leave gaps, get new tensors), and the two spans do not meet (for such
    tensors that means no shared element, which would be rotated twice)."""
    return _reusable(q, q_dtype) and _reusable(k, k_dtype) and not _spans_meet(q, k)


def _spans_meet(a: Tensor, b: Tensor) -> bool:
    """Whether the address ranges of two tensors' elements intersect."""
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + _span_bytes(b) and b0 < a0 + _span_bytes(a)


def _span_bytes(t: Tensor) -> int:
    return (_last_offset(t.shape, t.stride()) + 1) * t.element_size()


@functools.lru_cache(maxsize=1024)
def _last_offset(shape: torch.Size, strides: tuple[int, ...]) -> int:
    """The offset of a layout's last element from its first (in elements)."""
    return sum((n - 1) * st for n, st in zip(shape, strides))


def _gradient_buffer(grad: Tensor | None, dtype: torch.dtype, like: Tensor, overwrite: bool) -> Tensor:
    """Where the gradient of an input goes: ``grad``'s own storage when ``overwrite`` and it can hold
    the result, else a new tensor; an empty one when no gradient came for that output.

    The reused storage is returned as a new view, not as ``grad`` itself: autograd hands a leaf's
    gradient over without a copy only when nothing else holds the tensor object, and the caller of
    ``backward`` still holds ``grad`` (a whole copy of q and k per step otherwise)."""
    if grad is None:
        return like.new_empty(0, dtype=dtype)
    return grad.view_as(grad) if overwrite and _reusable(grad, dtype) else _output_like(grad, dtype)


@custom_op("rope_backward")
def rope_backward(dq_embed: Tensor | None, dk_embed: Tensor | None, cos: Tensor, sin: Tensor,
                  q_dtype: torch.dtype, k_dtype: torch.dtype, heads_first: bool,
                  overwrite_grad_output: bool) -> tuple[Tensor, Tensor]:
    """``(dq, dk)`` in ``q_dtype``/``k_dtype``; a gradient that did not come (``None``) gives an
    empty result. With ``overwrite_grad_output`` (eager route only) ``dq``/``dk`` are written into
    ``dq_embed``/``dk_embed``'s storage where dtype and layout allow."""
    dq = _gradient_buffer(dq_embed, q_dtype, cos, overwrite_grad_output)
    dk = _gradient_buffer(dk_embed, k_dtype, cos, overwrite_grad_output)
    _launch(dq_embed, dk_embed, cos, sin, dq, dk, heads_first, backward=True)
    return dq, dk


@rope_backward.register_fake
def _(dq_embed, dk_embed, cos, sin, q_dtype, k_dtype, heads_first, overwrite_grad_output):
    return (_gradient_buffer(dq_embed, q_dtype, cos, False),
            _gradient_buffer(dk_embed, k_dtype, cos, False))


# ---------------------------------------------------------------------------------------- autograd


def _setup_context(ctx, inputs, output):
    q, k, cos, sin, heads_first, overwrite_grad_output, _ = inputs
    ctx.save_for_backward(cos, sin)
    ctx.q_dtype, ctx.k_dtype = q.dtype, k.dtype
    ctx.heads_first, ctx.overwrite_grad_output = heads_first, overwrite_grad_output


def _backward(ctx, dq_embed, dk_embed):
    dq_embed = dq_embed if ctx.needs_input_grad[0] else None
    dk_embed = dk_embed if ctx.needs_input_grad[1] else None
    if dq_embed is None and dk_embed is None:
        return None, None, None, None, None, None, None
    cos, sin = ctx.saved_tensors
    overwrite = ctx.overwrite_grad_output and not tracing(dq_embed, dk_embed)
    dq, dk = rope_backward(dq_embed, dk_embed, cos, sin, ctx.q_dtype, ctx.k_dtype, ctx.heads_first,
                           overwrite)
    return (None if dq_embed is None else dq), (None if dk_embed is None else dk), None, None, None, None, None


register_autograd(rope_forward, _backward, setup_context=_setup_context)


# ------------------------------------------------------------------------------------------ public

_LAYOUTS = {True: "(batch, heads, seq, head_dim)", False: "(batch, seq, heads, head_dim)"}
_COS_LAYOUTS = {2: "(seq, rotary_dim)", 3: "(1 or batch, seq, rotary_dim)"}


def _heads_first(table_dim: int, unsqueeze_dim) -> bool:
    """The q/k layout that ``cos.unsqueeze(unsqueeze_dim)`` (``cos`` of ``table_dim`` dims)
    broadcasts against, as transformers' ``apply_rotary_pos_emb`` uses it: a new dim before cos's
    seq dim stands for the heads of ``(batch, heads, seq, head_dim)``, one after it for those of
    ``(batch, seq, heads, head_dim)``."""
    before = table_dim - 2  # the unsqueeze_dim that puts the new dim just before seq
    n = table_dim + 1
    if isinstance(unsqueeze_dim, bool) or not isinstance(unsqueeze_dim, int):
        raise TypeError(f"unsqueeze_dim must be an int, got {type(unsqueeze_dim).__name__} {unsqueeze_dim!r}")
    if not -n <= unsqueeze_dim < n or unsqueeze_dim % n not in (before, before + 1):
        raise ValueError(
            f"unsqueeze_dim must be {before} or {before - n} (q/k of shape {_LAYOUTS[True]}) or "
            f"{before + 1} or {before + 1 - n} ({_LAYOUTS[False]}) for {table_dim}-D cos "
            f"{_COS_LAYOUTS[table_dim]}, got {unsqueeze_dim!r}"
        )
    return unsqueeze_dim % n == before


def _validate(q, k, cos, sin, unsqueeze_dim, streams: bool = False) -> bool:
    """Checks every argument; returns whether ``q``/``k`` are ``(batch, heads, seq, head_dim)``.
    With ``streams`` the tables' first dim is their position streams (multimodal RoPE) and the
    rest is checked as a table (no per-stream view is made: host time)."""
    for t, name in ((q, "q"), (k, "k"), (cos, "cos"), (sin, "sin")):
        check_float(t, name)
    table = cos.shape[1:] if streams else cos.shape
    if len(table) not in _COS_LAYOUTS:
        raise ValueError(f"cos must be 2-D {_COS_LAYOUTS[2]} or 3-D {_COS_LAYOUTS[3]}, "
                         f"got shape {tuple(table)}")
    heads_first = _heads_first(len(table), unsqueeze_dim)
    layout = _LAYOUTS[heads_first]
    for t, name in ((q, "q"), (k, "k")):
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D {layout} for unsqueeze_dim={unsqueeze_dim} and "
                             f"{len(table)}-D cos, got shape {tuple(t.shape)}")
    for t, name in ((k, "k"), (cos, "cos"), (sin, "sin")):
        check_same_device(t, name, q, "q")
    batch, seq, _, head_dim = _bshd(q, heads_first)
    k_batch, k_seq, _, k_head_dim = _bshd(k, heads_first)
    if (k_batch, k_seq, k_head_dim) != (batch, seq, head_dim):
        raise ValueError(
            f"k must match q's batch, seq and head_dim in the {layout} layout: q {tuple(q.shape)}, "
            f"k {tuple(k.shape)}"
        )
    if sin.shape != cos.shape:
        raise ValueError(f"sin must have cos's shape {tuple(cos.shape)}, got {tuple(sin.shape)}")
    cos_batch = table[0] if len(table) == 3 else 1
    if cos_batch not in (1, batch) or table[-2] not in (1, seq):
        raise ValueError(
            f"cos must have shape {_COS_LAYOUTS[len(table)]} with batch {batch} and seq {seq} for q "
            f"{tuple(q.shape)} in the {layout} layout, got {tuple(table)}"
        )
    rotary_dim = table[-1]
    if rotary_dim % 2 or not 2 <= rotary_dim <= head_dim:
        raise ValueError(
            f"cos's last dimension (the rotary dim) must be even and in [2, head_dim={head_dim}], "
            f"got {rotary_dim}"
        )
    return heads_first


def _unsqueeze_dim(position_ids, unsqueeze_dim):
    """``unsqueeze_dim`` from the arguments of either transformers version (see ``rotary_pos_emb``)."""
    if position_ids is None or isinstance(position_ids, torch.Tensor):
        return unsqueeze_dim
    if isinstance(position_ids, int) and not isinstance(position_ids, bool) and unsqueeze_dim == 1:
        return position_ids
    raise TypeError(
        "position_ids must be a torch.Tensor or None (it is unused; cos and sin carry the "
        f"positions), got {type(position_ids).__name__}; pass unsqueeze_dim by keyword"
    )


def rotary_pos_emb(
    q: Tensor,
    k: Tensor,
    cos: Tensor,
    sin: Tensor,
    position_ids: Tensor | None = None,
    unsqueeze_dim: int = 1,
    overwrite_grad_output: bool = False,
    overwrite_inputs: bool = False,
) -> tuple[Tensor, Tensor]:
    """Rotary position embedding of ``q`` and ``k`` in one launch: a drop-in for transformers'
    ``apply_rotary_pos_emb`` (Llama, Qwen, Mistral, ...; Phi-3 style partial rotary included).

    Returns ``(q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin)`` on the first
    ``rotary_dim = cos.shape[-1]`` dims of each head, the rest passed through unchanged. ``q``/``k``
    are 4-D, ``k`` with as many or fewer heads (GQA), and broadcast against
    ``cos.unsqueeze(unsqueeze_dim)`` as in transformers: with ``cos``/``sin`` of shape
    ``(1 or batch, seq, rotary_dim)``, ``unsqueeze_dim=1`` takes ``(batch, heads, seq, head_dim)``
    and ``2`` takes ``(batch, seq, heads, head_dim)``; with the vision towers' ``(seq, rotary_dim)``,
    ``0`` takes ``(batch, heads, seq, head_dim)`` and ``1`` takes ``(batch, seq, heads, head_dim)``
    (negative dims as in ``unsqueeze``). Strided views (e.g. transposed projections) are read in
    place; no tokens is fine. The results are new tensors in the inputs' layout and promoted dtype;
    ``cos``/``sin`` get no gradient. ``position_ids`` is ignored, as in transformers (an ``int``
    there is taken as transformers 5's positional ``unsqueeze_dim``).
    ``overwrite_grad_output=True`` lets the backward pass write ``dq``/``dk`` into the storage of
    the gradients that arrive for ``q_embed``/``k_embed`` (saves memory; only when nothing else
    reads those gradients; eager only: compiled graphs manage their own buffers).
    ``overwrite_inputs=True`` writes the rotated heads over ``q`` and ``k`` and returns views of
    them, as liger-kernel's RoPE does (no new q/k-sized tensors; only when nothing else reads
    ``q``/``k`` afterwards, e.g. a projection's output used once; the views must not be modified in
    place; eager only). Where the result's dtype differs from ``q``'s (fp32 ``cos`` with bf16
    ``q``), ``q`` and ``k`` share storage or a layout stores an element twice, new tensors are
    returned as without it.
    """
    unsqueeze_dim = _unsqueeze_dim(position_ids, unsqueeze_dim)
    heads_first = _validate(q, k, cos, sin, unsqueeze_dim)
    check_bool(overwrite_grad_output, "overwrite_grad_output")
    check_bool(overwrite_inputs, "overwrite_inputs")
    if cos.dim() == 2:  # one (seq, rotary_dim) table for every sequence of the batch
        cos, sin = cos.unsqueeze(0), sin.unsqueeze(0)
    overwrite_inputs = overwrite_inputs and not tracing(q, k, cos, sin)
    return rope_forward(q, k, cos, sin, heads_first, overwrite_grad_output, overwrite_inputs)
