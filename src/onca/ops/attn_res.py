"""Attention residuals: softmax attention over depth (Kimi's AttnRes).

For ``V`` of shape ``[N, ..., D]`` (the outputs of ``N`` earlier layers, e.g. ``[N, B, T, D]``) and
learned vectors ``w_query``, ``w_norm`` of shape ``[D]``, per position (row) ``r`` and layer ``n``:

    K[n, r]     = V[n, r] * rstd[n, r] * w_norm,   rstd = 1 / sqrt(mean(V[n, r] ** 2) + eps)
    score[n, r] = <w_query, K[n, r]>  =  rstd[n, r] * <u, V[n, r]>,   u = w_query * w_norm
    alpha       = softmax(score, dim=0)        (over the N layers)
    h[r]        = sum_n alpha[n, r] * V[n, r]

Everything is computed in fp32 (no intermediate rounding; liger-kernel's kernel rounds ``K`` to the
weight dtype before the dot product, which only moves the scores by that rounding); ``h`` is stored
in ``V``'s dtype.

Backward, with ``g = dL/dh``, ``p_n = <u, V[n]>`` and ``c = sum_n alpha_n <g, V[n]>``:

    d score_n = alpha_n * (<g, V[n]> - c)
    dV[n]     = alpha_n * g + d score_n * rstd_n * (u - p_n * rstd_n ** 2 / D * V[n])
    dw_query  = w_norm  * G,   dw_norm = w_query * G,   G = sum_{r, n} d score_n * rstd_n * V[n, r]

Kernels. Rows are the ``R = prod(...)`` positions, columns the hidden size ``D``; the plans come from
``plan_rows(R, D)``, with the live tiles below. Each program streams the ``N`` layer slabs of its
row block one at a time, so only one slab (and the next one's load, issued before the current one
is used, in every sweep that reads ``V`` from memory) is on chip, and any ``N`` works.

- Forward, single pass (a whole row fits): an online softmax over the slabs (running max, running
  sum, running weighted sum), so ``V`` is read exactly once.
- Backward, single pass: no ``dV[n]`` can be written before ``c``, which needs every slab. A first
  sweep over the row block's slabs collects each slab's sum of squares, ``p_n`` and ``<g, V[n]>``
  (``[rows, N]`` vectors); a second sweep writes ``dV``. The second sweep re-reads slabs that the
  program read a moment before (``N * rows * D`` elements per program), so on a GPU they come from
  the L2 cache and memory sees ``V`` about once. (Using the saved output instead, ``c = <g, h>``,
  would save that sweep but loses precision: ``h`` is rounded to bf16, and the error of ``c`` grows
  with ``sqrt(D)``.)
- D-tiled (a row does not fit: large ``D``): the same two sweeps, each over ``D``'s column tiles; the
  forward's first sweep collects the scores, its second writes ``h``.

``G`` is reduced deterministically: each program of the (persistent) backward grid sums its rows into
its own row of an fp32 partial buffer, summed once at the end by one launch that also multiplies
the sum by ``w_norm`` and by ``w_query`` and stores both weight gradients. Saved for backward: ``V``
and the two weights only; ``rstd``, the scores and ``alpha`` are recomputed (the backward reads
``V`` anyway).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from onca.device import DeviceProfile, get_profile
from torch import Tensor

from onca.ops._contract import custom_op, register_autograd
from onca.ops._launch import fast_launch
from onca.ops._partials import sum_partials_times
from onca.ops._rows import rows_cols
from onca.ops._validate import check_float, check_number, check_same_device
from onca.tiling import RowPlan, next_power_of_2, plan_rows

__all__ = ["attn_res", "plan"]

# Live tiles of each kernel (tiles in V's dtype, fp32 tiles), as the planner counts them, before
# their address tiles: the element offsets of the slab loads (forward) and of the slab loads and dV
# stores (backward) stay live across the loop over slabs, one fp32-sized tile each when they are
# int32, two when int64 (see _row_index). The backward's per-row state (six [rows, N] fp32
# vectors) counts as one fp32 tile, which holds it for rows of at least 6 * N columns; the D-tiled
# forward's state sits in the half of the budget that the planner keeps back for two-pass kernels.
FORWARD_TILES = dict(live_tiles=3, fp32_tiles=4)  # v, next v, h; v, acc, u, a product in fp32
BACKWARD_TILES = dict(live_tiles=4, fp32_tiles=6)  # v, next v, dh, dv; v, dh, dv, u, G, state in fp32
ADDRESS_TILES = {"forward": 1, "backward": 2}

# One row per GPU program (the planner's max_gpu_rows; its warps and persistent grid follow):
# measured on an H100 (kernels alone, CUDA-graph replay, bf16, N = 8) against the 2-8 rows it gave
# before, the backward took 123 -> 84 us at 4096 x 1024, 82 -> 75 at 1024 x 4096, 345 -> 273 at
# 8192 x 2048, 322 -> 290 at 4096 x 4096; the forward within 3%. Other devices ignore it.
GPU_ROWS = 1
# Rows wider than this take at most GPU_WIDE_PROGRAMS backward programs an SM on a GPU: there the
# 4-warp program took 214-216 registers a thread (sm_90, at 4096 and 8192 columns), so only two fit
# an SM's register file, and the planner's four a unit left half the grid waiting, with twice the
# partial rows. H200, bf16, N = 8, forward + backward (CUDA-graph replays): Llama-3-8B 351.9 ->
# 345.4 us, Gemma-2-9B 328.2 -> 320.1, Llama-3.1-405B 1745.5 -> 1728.0, 4 MB less peak memory at
# 4096 columns; at 1024 and 2048 columns (80 and 126 registers) it was 25% and 16% slower. At
# 8192 columns the tile is 8 warps (216 registers: one program fits); one program an SM there
# measured within 1% (H200, same timing: Llama-3-70B 0.741 -> 0.737 ms, Gemma-3-27B 0.665 -> 0.659)
# and 0.74-0.78x at 4096 and 16384 columns, so the grid keeps one rule.
GPU_WIDE_COLS = 2048
GPU_WIDE_PROGRAMS = 2


# ----------------------------------------------------------------------------------------- kernels


@triton.jit
def _row_index(rows, OFFSETS_64: tl.constexpr):
    """Row numbers as a column for address arithmetic: int32 where every offset inside one slab
    fits (its addresses then take half the registers), int64 where it may not. Slabs are reached
    by advancing a 64-bit pointer, so only the offset inside a slab matters."""
    if OFFSETS_64:
        return rows.to(tl.int64)[:, None]
    else:
        return rows[:, None]


@triton.jit
def _weights(wq_ptr, wn_ptr, cols, col_mask):
    """``u = w_query * w_norm`` over ``cols``, in fp32."""
    return (tl.load(wq_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
            * tl.load(wn_ptr + cols, mask=col_mask, other=0.0).to(tl.float32))


@triton.jit
def _score(v, u, n_cols, eps):
    """rstd, <u, v> and the score of each row of a whole-row fp32 tile ``v``."""
    rstd = tl.rsqrt(tl.sum(v * v, axis=1) / n_cols + eps)
    p = tl.sum(v * u[None, :], axis=1)
    return rstd, p, rstd * p


@fast_launch
@triton.jit
def _attn_res_forward_kernel(
    v_ptr, wq_ptr, wn_ptr, h_ptr,
    n_slabs, n_rows, n_cols, slab_stride, v_row_stride, h_row_stride, eps,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    COL_TILES: tl.constexpr,
    N_PAD: tl.constexpr,
    OFFSETS_64: tl.constexpr,
):
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    n_row_blocks = tl.cdiv(n_rows, BLOCK_ROWS)
    col_offsets = tl.arange(0, BLOCK_COLS)
    if COL_TILES == 1:
        col_mask = col_offsets < n_cols
        u = (tl.load(wq_ptr + col_offsets, mask=col_mask, other=0.0).to(tl.float32)
             * tl.load(wn_ptr + col_offsets, mask=col_mask, other=0.0).to(tl.float32))
        for row_block in tl.range(pid, n_row_blocks, n_programs):
            rows = row_block * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
            row_mask = rows < n_rows
            row_idx = _row_index(rows, OFFSETS_64)
            mask = row_mask[:, None] & col_mask[None, :]
            v_offs = row_idx * v_row_stride + col_offsets[None, :]
            # Online softmax over the slabs: running max m, running sum l, running weighted sum acc.
            m = tl.full([BLOCK_ROWS], float("-inf"), tl.float32)
            l = tl.zeros([BLOCK_ROWS], dtype=tl.float32)
            acc = tl.zeros([BLOCK_ROWS, BLOCK_COLS], dtype=tl.float32)
            v_next = tl.load(v_ptr + v_offs, mask=mask, other=0.0)
            next_ptr = v_ptr + slab_stride
            for n in range(n_slabs):
                v = v_next.to(tl.float32)
                # (A tensor, not a scalar condition: the interpreter's masks must be arrays.)
                more = (tl.zeros([BLOCK_ROWS], dtype=tl.int32) + n + 1) < n_slabs
                v_next = tl.load(next_ptr + v_offs, mask=mask & more[:, None], other=0.0)
                next_ptr += slab_stride
                rstd, p, s = _score(v, u, n_cols, eps)
                m_new = tl.maximum(m, s)
                rescale = tl.exp(m - m_new)
                e = tl.exp(s - m_new)
                l = l * rescale + e
                acc = acc * rescale[:, None] + e[:, None] * v
                m = m_new
            h = acc / l[:, None]
            tl.store(h_ptr + row_idx * h_row_stride + col_offsets[None, :], h.to(h_ptr.dtype.element_ty), mask=mask)
    else:
        slab_ids = tl.arange(0, N_PAD)
        for row_block in tl.range(pid, n_row_blocks, n_programs):
            rows = row_block * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
            row_mask = rows < n_rows
            row_idx = _row_index(rows, OFFSETS_64)
            sum_sq = tl.zeros([BLOCK_ROWS, N_PAD], dtype=tl.float32)
            dot = tl.zeros([BLOCK_ROWS, N_PAD], dtype=tl.float32)
            for tile in range(COL_TILES):
                cols = tile * BLOCK_COLS + col_offsets
                col_mask = cols < n_cols
                mask = row_mask[:, None] & col_mask[None, :]
                u = (tl.load(wq_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
                     * tl.load(wn_ptr + cols, mask=col_mask, other=0.0).to(tl.float32))
                v_offs = row_idx * v_row_stride + cols[None, :]
                v_next = tl.load(v_ptr + v_offs, mask=mask, other=0.0)
                next_ptr = v_ptr + slab_stride
                for n in range(n_slabs):
                    v = v_next.to(tl.float32)
                    more = (tl.zeros([BLOCK_ROWS], dtype=tl.int32) + n + 1) < n_slabs
                    v_next = tl.load(next_ptr + v_offs, mask=mask & more[:, None], other=0.0)
                    next_ptr += slab_stride
                    sel = (slab_ids == n)[None, :]
                    sum_sq = tl.where(sel, sum_sq + tl.sum(v * v, axis=1)[:, None], sum_sq)
                    dot = tl.where(sel, dot + tl.sum(v * u[None, :], axis=1)[:, None], dot)
            s = tl.rsqrt(sum_sq / n_cols + eps) * dot
            s = tl.where((slab_ids < n_slabs)[None, :], s, float("-inf"))
            m = tl.max(s, axis=1)
            e = tl.exp(s - m[:, None])
            l = tl.sum(e, axis=1)
            alpha = e / l[:, None]
            for tile in range(COL_TILES):
                cols = tile * BLOCK_COLS + col_offsets
                mask = row_mask[:, None] & (cols < n_cols)[None, :]
                v_offs = row_idx * v_row_stride + cols[None, :]
                acc = tl.zeros([BLOCK_ROWS, BLOCK_COLS], dtype=tl.float32)
                slab_ptr = v_ptr
                for n in range(n_slabs):
                    v = tl.load(slab_ptr + v_offs, mask=mask, other=0.0).to(tl.float32)
                    slab_ptr += slab_stride
                    a = tl.sum(tl.where((slab_ids == n)[None, :], alpha, 0.0), axis=1)
                    acc += a[:, None] * v
                tl.store(h_ptr + row_idx * h_row_stride + cols[None, :], acc.to(h_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _slab_softmax_grads(sum_sq, dot, d_alpha, row_mask, slab_ids, n_slabs, n_cols, eps):
    """From each (row, slab)'s sum of squares, ``<u, v>`` and ``<dh, v>`` ([rows, N_PAD] fp32):
    alpha, and the coefficients of ``u`` and of ``v`` in ``dV`` (``dr``, ``coef``)."""
    slab_valid = (slab_ids < n_slabs)[None, :]
    rstd = tl.rsqrt(sum_sq / n_cols + eps)
    s = tl.where(slab_valid, rstd * dot, float("-inf"))
    e = tl.where(slab_valid, tl.exp(s - tl.max(s, axis=1)[:, None]), 0.0)
    alpha = e / tl.sum(e, axis=1)[:, None]
    c = tl.sum(alpha * d_alpha, axis=1)
    # Rows past the end are zeros: keep them out of G even where rstd is infinite (eps = 0).
    valid = row_mask[:, None] & slab_valid
    dr = tl.where(valid, alpha * (d_alpha - c[:, None]) * rstd, 0.0)
    coef = tl.where(valid, dr * dot * rstd * rstd / n_cols, 0.0)
    return alpha, dr, coef


@triton.jit
def _pick(x, sel):
    """Column ``n`` of a [rows, N_PAD] tensor, as a [rows] vector (``sel`` marks it)."""
    return tl.sum(tl.where(sel, x, 0.0), axis=1)


@fast_launch
@triton.jit
def _attn_res_backward_kernel(
    v_ptr, wq_ptr, wn_ptr, dh_ptr, dv_ptr, g_partial_ptr,
    n_slabs, n_rows, n_cols, slab_stride, v_row_stride, dh_row_stride, dv_slab_stride, dv_row_stride, eps,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    COL_TILES: tl.constexpr,
    N_PAD: tl.constexpr,
    OFFSETS_64: tl.constexpr,
    SAME_ROWS: tl.constexpr,
):
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    n_row_blocks = tl.cdiv(n_rows, BLOCK_ROWS)
    col_offsets = tl.arange(0, BLOCK_COLS)
    slab_ids = tl.arange(0, N_PAD)
    # This program's own row of the partial-sum buffer for G: no other program writes it.
    g_row = g_partial_ptr + pid.to(tl.int64) * n_cols
    if COL_TILES == 1:
        col_mask = col_offsets < n_cols
        g_acc = tl.zeros([BLOCK_COLS], dtype=tl.float32)
        for row_block in tl.range(pid, n_row_blocks, n_programs):
            rows = row_block * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
            row_mask = rows < n_rows
            row_idx = _row_index(rows, OFFSETS_64)
            mask = row_mask[:, None] & col_mask[None, :]
            dh = tl.load(dh_ptr + row_idx * dh_row_stride + col_offsets[None, :], mask=mask, other=0.0)
            dh = dh.to(tl.float32)
            v_offs = row_idx * v_row_stride + col_offsets[None, :]
            if SAME_ROWS:  # dV's rows are laid out as V's: one offset tile serves both
                dv_offs = v_offs
            else:
                dv_offs = row_idx * dv_row_stride + col_offsets[None, :]
            # Sweep 1: each slab's statistics (the next slab's load is issued before this one is used).
            sum_sq = tl.zeros([BLOCK_ROWS, N_PAD], dtype=tl.float32)
            dot = tl.zeros([BLOCK_ROWS, N_PAD], dtype=tl.float32)
            d_alpha = tl.zeros([BLOCK_ROWS, N_PAD], dtype=tl.float32)
            v_next = tl.load(v_ptr + v_offs, mask=mask, other=0.0)
            next_ptr = v_ptr + slab_stride
            for n in range(n_slabs):
                v = v_next.to(tl.float32)
                # (A tensor, not a scalar condition: the interpreter's masks must be arrays.)
                more = (tl.zeros([BLOCK_ROWS], dtype=tl.int32) + n + 1) < n_slabs
                v_next = tl.load(next_ptr + v_offs, mask=mask & more[:, None], other=0.0)
                next_ptr += slab_stride
                sel = (slab_ids == n)[None, :]
                u = _weights(wq_ptr, wn_ptr, col_offsets, col_mask)
                sum_sq = tl.where(sel, tl.sum(v * v, axis=1)[:, None], sum_sq)
                dot = tl.where(sel, tl.sum(v * u[None, :], axis=1)[:, None], dot)
                d_alpha = tl.where(sel, tl.sum(dh * v, axis=1)[:, None], d_alpha)
            alpha, dr_all, coef_all = _slab_softmax_grads(sum_sq, dot, d_alpha, row_mask, slab_ids, n_slabs,
                                                          n_cols, eps)
            # Sweep 2: dV. These slabs were read just now, so they come back from the L2 cache.
            slab_ptr = v_ptr
            dv_slab = dv_ptr
            for n in range(n_slabs):
                v = tl.load(slab_ptr + v_offs, mask=mask, other=0.0).to(tl.float32)
                slab_ptr += slab_stride
                sel = (slab_ids == n)[None, :]
                dr = _pick(dr_all, sel)
                u = _weights(wq_ptr, wn_ptr, col_offsets, col_mask)
                dv = (_pick(alpha, sel)[:, None] * dh + dr[:, None] * u[None, :]
                      - _pick(coef_all, sel)[:, None] * v)
                tl.store(dv_slab + dv_offs, dv.to(dv_ptr.dtype.element_ty), mask=mask)
                dv_slab += dv_slab_stride
                g_acc += tl.sum(dr[:, None] * v, axis=0)
        tl.store(g_row + col_offsets, g_acc, mask=col_mask)
    else:
        for row_block in tl.range(pid, n_row_blocks, n_programs):
            rows = row_block * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
            row_mask = rows < n_rows
            row_idx = _row_index(rows, OFFSETS_64)
            sum_sq = tl.zeros([BLOCK_ROWS, N_PAD], dtype=tl.float32)
            dot = tl.zeros([BLOCK_ROWS, N_PAD], dtype=tl.float32)
            d_alpha = tl.zeros([BLOCK_ROWS, N_PAD], dtype=tl.float32)
            for tile in range(COL_TILES):
                cols = tile * BLOCK_COLS + col_offsets
                col_mask = cols < n_cols
                mask = row_mask[:, None] & col_mask[None, :]
                u = (tl.load(wq_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
                     * tl.load(wn_ptr + cols, mask=col_mask, other=0.0).to(tl.float32))
                dh = tl.load(dh_ptr + row_idx * dh_row_stride + cols[None, :], mask=mask, other=0.0)
                dh = dh.to(tl.float32)
                v_offs = row_idx * v_row_stride + cols[None, :]
                v_next = tl.load(v_ptr + v_offs, mask=mask, other=0.0)
                next_ptr = v_ptr + slab_stride
                for n in range(n_slabs):
                    v = v_next.to(tl.float32)
                    more = (tl.zeros([BLOCK_ROWS], dtype=tl.int32) + n + 1) < n_slabs
                    v_next = tl.load(next_ptr + v_offs, mask=mask & more[:, None], other=0.0)
                    next_ptr += slab_stride
                    sel = (slab_ids == n)[None, :]
                    sum_sq = tl.where(sel, sum_sq + tl.sum(v * v, axis=1)[:, None], sum_sq)
                    dot = tl.where(sel, dot + tl.sum(v * u[None, :], axis=1)[:, None], dot)
                    d_alpha = tl.where(sel, d_alpha + tl.sum(dh * v, axis=1)[:, None], d_alpha)
            alpha, dr_all, coef_all = _slab_softmax_grads(sum_sq, dot, d_alpha, row_mask, slab_ids, n_slabs,
                                                          n_cols, eps)
            for tile in range(COL_TILES):
                cols = tile * BLOCK_COLS + col_offsets
                col_mask = cols < n_cols
                mask = row_mask[:, None] & col_mask[None, :]
                u = (tl.load(wq_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
                     * tl.load(wn_ptr + cols, mask=col_mask, other=0.0).to(tl.float32))
                dh = tl.load(dh_ptr + row_idx * dh_row_stride + cols[None, :], mask=mask, other=0.0)
                dh = dh.to(tl.float32)
                v_offs = row_idx * v_row_stride + cols[None, :]
                if SAME_ROWS:
                    dv_offs = v_offs
                else:
                    dv_offs = row_idx * dv_row_stride + cols[None, :]
                g_tile = tl.zeros([BLOCK_COLS], dtype=tl.float32)
                slab_ptr = v_ptr
                dv_slab = dv_ptr
                for n in range(n_slabs):
                    v = tl.load(slab_ptr + v_offs, mask=mask, other=0.0).to(tl.float32)
                    slab_ptr += slab_stride
                    sel = (slab_ids == n)[None, :]
                    dr = _pick(dr_all, sel)
                    dv = (_pick(alpha, sel)[:, None] * dh + dr[:, None] * u[None, :]
                          - _pick(coef_all, sel)[:, None] * v)
                    tl.store(dv_slab + dv_offs, dv.to(dv_ptr.dtype.element_ty), mask=mask)
                    dv_slab += dv_slab_stride
                    g_tile += tl.sum(dr[:, None] * v, axis=0)
                partial = tl.load(g_row + cols, mask=col_mask, other=0.0)
                tl.store(g_row + cols, partial + g_tile, mask=col_mask)


# --------------------------------------------------------------------------------------- launchers


def _plans(rows: int, cols: int, dtype: torch.dtype, offsets_64: bool, profile=None) -> dict[str, RowPlan]:
    per_address = 2 if offsets_64 else 1
    plans = {}
    for kind, tiles in (("forward", FORWARD_TILES), ("backward", BACKWARD_TILES)):
        fp32_tiles = tiles["fp32_tiles"] + ADDRESS_TILES[kind] * per_address
        # The backward reduces G across rows into one partial row per program: a persistent grid.
        plans[kind] = plan_rows(rows, cols, dtype, tiles["live_tiles"], profile, fp32_tiles=fp32_tiles,
                                persistent=True if kind == "backward" else None, max_gpu_rows=GPU_ROWS,
                                max_programs=None if kind == "forward" else _backward_programs(cols, profile))
    return plans


def _backward_programs(cols: int, profile) -> int | None:
    """The backward grid's cap on a GPU for rows wider than ``GPU_WIDE_COLS`` (see there), else None."""
    profile = profile or get_profile()
    if profile.kind == "cuda" and cols > GPU_WIDE_COLS:
        return GPU_WIDE_PROGRAMS * profile.compute_units
    return None


def _needs_offsets_64(rows: int, cols: int, *row_strides: int) -> bool:
    """Whether an element offset inside one slab (row * stride + column) can pass int32."""
    return any((rows - 1) * stride + cols > 2**31 - 1 for stride in row_strides)


def plan(shape, dtype: torch.dtype, profile: DeviceProfile | None = None) -> dict[str, RowPlan]:
    """The forward and backward plans for a contiguous ``V`` of ``shape`` (``(N, ..., D)``)."""
    if len(shape) < 2:
        raise ValueError(f"attn_res plans take V's shape (N, ..., D), got {tuple(shape)}")
    rows, cols = rows_cols(shape[1:])
    return _plans(rows, cols, dtype, _needs_offsets_64(rows, cols, cols), profile)


def _n_pad(n_slabs: int, p: RowPlan, backward: bool) -> int:
    # Per-slab vectors: the backward always keeps them, the forward only when it tiles D.
    return next_power_of_2(n_slabs) if backward or not p.single_pass else 1


@custom_op("attn_res_forward")
def attn_res_forward(v: Tensor, w_query: Tensor, w_norm: Tensor, eps: float) -> Tensor:
    """``h`` ``(R, D)`` for ``V`` as ``(N, R, D)`` slabs with unit column stride."""
    n_slabs, rows, cols = v.shape
    if n_slabs == 0:  # a sum over no layers, as torch's
        return torch.zeros((rows, cols), dtype=v.dtype, device=v.device)
    h = torch.empty((rows, cols), dtype=v.dtype, device=v.device)
    if rows == 0 or cols == 0:
        return h
    offsets_64 = _needs_offsets_64(rows, cols, v.stride(1), cols)
    p = _plans(rows, cols, v.dtype, offsets_64)["forward"]
    _attn_res_forward_kernel[(p.grid,)](
        v, w_query, w_norm, h,
        n_slabs, rows, cols, v.stride(0), v.stride(1), h.stride(0), eps,
        BLOCK_ROWS=p.block_rows, BLOCK_COLS=p.block_cols, COL_TILES=p.col_tiles,
        N_PAD=_n_pad(n_slabs, p, False), OFFSETS_64=offsets_64, num_warps=p.num_warps,
    )
    return h


@attn_res_forward.register_fake
def _(v, w_query, w_norm, eps):
    return v.new_empty(v.shape[1:])


@custom_op("attn_res_backward")
def attn_res_backward(dh: Tensor, v: Tensor, w_query: Tensor, w_norm: Tensor,
                      eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """``(dV, dw_query, dw_norm)``; ``dh`` ``(R, D)`` and ``V`` ``(N, R, D)`` with unit column stride."""
    n_slabs, rows, cols = v.shape
    dv = torch.empty((n_slabs, rows, cols), dtype=v.dtype, device=v.device)
    if dv.numel() == 0:
        return dv, torch.zeros_like(w_query), torch.zeros_like(w_norm)
    offsets_64 = _needs_offsets_64(rows, cols, v.stride(1), dh.stride(0), cols)
    p = _plans(rows, cols, v.dtype, offsets_64)["backward"]
    # The D-tiled path accumulates into it (zeroed first); the single-pass path writes every row whole.
    g_partial = (torch.zeros if p.col_tiles > 1 else torch.empty)((p.grid, cols), dtype=torch.float32,
                                                                  device=v.device)
    _attn_res_backward_kernel[(p.grid,)](
        v, w_query, w_norm, dh, dv, g_partial,
        n_slabs, rows, cols, v.stride(0), v.stride(1), dh.stride(0), dv.stride(0), dv.stride(1), eps,
        BLOCK_ROWS=p.block_rows, BLOCK_COLS=p.block_cols, COL_TILES=p.col_tiles,
        N_PAD=_n_pad(n_slabs, p, True), OFFSETS_64=offsets_64, SAME_ROWS=v.stride(1) == dv.stride(1),
        num_warps=p.num_warps,
    )
    dw_query, dw_norm = sum_partials_times(g_partial, (w_norm, w_query), (w_query.dtype, w_norm.dtype))
    return dv, dw_query, dw_norm


@attn_res_backward.register_fake
def _(dh, v, w_query, w_norm, eps):
    return v.new_empty(v.shape), w_query.new_empty(w_query.shape), w_norm.new_empty(w_norm.shape)


# ---------------------------------------------------------------------------------------- autograd


def _setup_context(ctx, inputs, output):
    v, w_query, w_norm, eps = inputs
    ctx.save_for_backward(v, w_query, w_norm)
    ctx.eps = eps


def _backward(ctx, dh):
    v, w_query, w_norm = ctx.saved_tensors
    dh = dh if dh.stride(-1) == 1 else dh.contiguous()
    dv, dw_query, dw_norm = attn_res_backward(dh, v, w_query, w_norm, ctx.eps)
    return dv, dw_query, dw_norm, None


register_autograd(attn_res_forward, _backward, setup_context=_setup_context)


# ------------------------------------------------------------------------------------------ public


def _as_slabs(v: Tensor) -> Tensor:
    """``V`` as ``(N, R, D)`` with unit column stride, copying only if its layout needs it (reshape
    copies where the middle dimensions do not merge into one row stride)."""
    if v.stride(-1) != 1:
        v = v.contiguous()
    # The row count from the shape, symbolic under torch.compile (-1 is ambiguous for empty V).
    return v.reshape(v.shape[0], math.prod(v.shape[1:-1]), v.shape[-1])


def _validate(v, w_query, w_norm, eps) -> None:
    check_float(v, "V")
    check_float(w_query, "w_query")
    check_float(w_norm, "w_norm")
    if v.dim() < 2:
        raise ValueError("V must have shape (N, ..., D) with at least 2 dimensions, "
                         f"got shape {tuple(v.shape)}")
    hidden = v.shape[-1]
    for w, name in ((w_query, "w_query"), (w_norm, "w_norm")):
        if w.dim() != 1 or w.shape[0] != hidden:
            raise ValueError(f"{name} must have shape ({hidden},) (V's hidden size), got {tuple(w.shape)}")
        check_same_device(w, name, v, "V")
    check_number(eps, "eps", minimum=0.0)


def attn_res(V: Tensor, w_query: Tensor, w_norm: Tensor, eps: float = 1e-6) -> Tensor:
    """Attention residuals: softmax attention over the first dimension of ``V`` (``(N, ..., D)``,
    e.g. ``[N, B, T, D]``, the outputs of N earlier layers).

    ``K = rms_norm(V) * w_norm`` over D, ``score = <w_query, K>``, ``alpha = softmax(score)`` over N,
    and the result ``sum_n alpha[n] * V[n]`` has shape ``(..., D)`` and ``V``'s dtype. ``w_query``
    and ``w_norm`` have shape ``(D,)``; all arithmetic is in fp32. Differentiable in all three.
    Empty inputs give what PyTorch's formula gives: no positions, an empty result; no layers
    (``N = 0``), zeros; the weights' gradients are then zeros.
    """
    _validate(V, w_query, w_norm, eps)
    h = attn_res_forward(_as_slabs(V), w_query.contiguous(), w_norm.contiguous(), float(eps))
    return h.view(V.shape[1:])
