"""mHC: manifold-constrained hyper-connections (DeepSeek, 2025), as liger-kernel's ``mhc`` ops.

The residual stream is widened to ``HC`` streams, ``x (..., HC, C)``. Per token, three small
mixing coefficients come from the whole (RMS-normalised) stream:

    mix    = (x_flat @ phi) * rsqrt(mean(x_flat**2) + rms_eps)          x_flat: (HC * C,), phi: (HC*C, M)
    h_pre  = sigmoid(alpha_pre  * mix[:HC]      + b[:HC]) + pre_eps       (HC,)
    h_post = sigmoid(alpha_post * mix[HC:2HC]   + b[HC:2HC]) * post_mult  (HC,)
    h_res  = sinkhorn(alpha_res * mix[2HC:] + b[2HC:])                    (HC, HC), doubly stochastic

with ``M = HC*HC + 2*HC`` and ``sinkhorn``: a row softmax plus ``sinkhorn_eps``, a column
normalisation, then ``tmax - 1`` alternating row and column normalisations (each divides by the sum
plus ``sinkhorn_eps``). The layer then runs on the mixed-down input and its output is mixed back:

    x_in  = sum_h h_pre[h] * x[h]                               (..., C)   (mhc_pre)
    x_out = h_res @ x + h_post[:, None] * layer(x_in)[None, :]   (..., HC, C) (mhc_post_res)

Kernels: ``mhc_pre`` and ``mhc_post_res`` (the bandwidth-bound parts, reading the whole widened
stream) are Triton kernels, forward and backward, one program per block of tokens computing in
fp32 and storing in ``x``'s dtype; their coefficient gradients are reduced over ``C`` in registers.
``mhc_coeffs`` is two kernels forward. The projection kernel reads ``x`` once: each work item
(a block of tokens times a slice of ``HC * C`` when there are too few token blocks to fill the
device) accumulates its partial ``x_flat @ phi`` and sum of squares in fp32. The coefficient kernel
sums those slices, applies the RMS factor, the sigmoids, the softmax and the ``2 * tmax - 1``
Sinkhorn normalisations over blocks of tokens (each token's ``HC x HC`` block in registers), and
stores the projection and the RMS factor, which are saved (``M + 1`` floats per token) so that the
backward never recomputes them. The backward walks the Sinkhorn loop back in one kernel (nothing of
the loop is kept: each program reruns it for its tokens into a scratch of its own, then reads the
iterates back in reverse) that also reduces ``db`` and the ``alpha`` gradients per program; one more
kernel computes ``dx = d_proj @ phi.T - coef * x`` and ``dphi``'s partial sums per token share
(summed by ``onca.ops._partials.sum_partials`` in a fixed order: deterministic).
As a torch composition the loop was about 640 small kernels per forward + backward. Coefficients
are fp32, as in liger-kernel. The projections take fp32 operands (``phi``, ``d_proj``) without
TF32's 10-bit mantissa loss: an fp32 operand is split into bf16 high and low parts and multiplied in
three bf16 tensor-core dots (hi*hi + hi*lo + lo*hi, about 16 mantissa bits, near fp32 after the
fp32 accumulation). Each k step's product starts from a fresh accumulator and is added in
registers, because the tensor cores round toward zero when they accumulate: carried through the
whole k loop, that bias measured 1.6e-4 of a coefficient on the H100.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from torch import Tensor

from onca.device import DeviceProfile, get_profile, interpreter_active
from onca.ops._contract import custom_op, register_autograd
from onca.ops._launch import fast_launch
from onca.ops._partials import sum_partials
from onca.ops._validate import check_float, check_number, check_same_device, check_tensor
from onca.tiling import MatmulPlan, RowPlan, cdiv, next_power_of_2, plan_matmul, plan_rows

__all__ = ["mhc", "mhc_coeffs", "mhc_pre", "mhc_post_res", "plan"]


def _pre_tiles(hc: int) -> dict:
    # x's HC rows of a tile, the output; HC fp32 upcasts and the accumulator (backward: dx, dh too).
    return dict(live_tiles=hc + 2, fp32_tiles=2 * hc + 2)


def _post_tiles(hc: int) -> dict:
    # x's HC rows, f, HC outputs; their fp32 copies (backward: dout's HC rows, dx's, df).
    return dict(live_tiles=2 * hc + 1, fp32_tiles=3 * hc + 2)


# ----------------------------------------------------------------------------------------- kernels


@fast_launch
@triton.jit
def _mhc_pre_forward_kernel(
    x_ptr, h_ptr, out_ptr, n_rows, n_cols, hc,
    HC_BLOCK: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr, COL_TILES: tl.constexpr,
):
    """``out[n, c] = sum_h h[n, h] * x[n, h, c]`` (x contiguous ``(N, HC, C)``, h ``(N, HC)`` fp32)."""
    pid = tl.program_id(0)
    n_row_blocks = tl.cdiv(n_rows, BLOCK_ROWS)
    hs = tl.arange(0, HC_BLOCK)
    col_offsets = tl.arange(0, BLOCK_COLS)
    for row_block in tl.range(pid, n_row_blocks, tl.num_programs(0)):
        rows = row_block * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        row_mask = rows < n_rows
        rows64 = rows.to(tl.int64)
        hmask = row_mask[:, None] & (hs < hc)[None, :]
        h = tl.load(h_ptr + rows64[:, None] * hc + hs[None, :], mask=hmask, other=0.0)
        for tile in range(COL_TILES):
            cols = tile * BLOCK_COLS + col_offsets
            mask3 = hmask[:, :, None] & (cols < n_cols)[None, None, :]
            x = tl.load(x_ptr + (rows64[:, None, None] * hc + hs[None, :, None]) * n_cols + cols[None, None, :],
                        mask=mask3, other=0.0).to(tl.float32)
            out = tl.sum(x * h[:, :, None], axis=1)
            tl.store(out_ptr + rows64[:, None] * n_cols + cols[None, :], out.to(out_ptr.dtype.element_ty),
                     mask=row_mask[:, None] & (cols < n_cols)[None, :])


@fast_launch
@triton.jit
def _mhc_pre_backward_kernel(
    dout_ptr, x_ptr, h_ptr, dx_ptr, dh_ptr, n_rows, n_cols, hc,
    HC_BLOCK: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr, COL_TILES: tl.constexpr,
):
    """``dx[n, h, c] = h[n, h] * dout[n, c]``, ``dh[n, h] = sum_c dout[n, c] * x[n, h, c]``."""
    pid = tl.program_id(0)
    n_row_blocks = tl.cdiv(n_rows, BLOCK_ROWS)
    hs = tl.arange(0, HC_BLOCK)
    col_offsets = tl.arange(0, BLOCK_COLS)
    for row_block in tl.range(pid, n_row_blocks, tl.num_programs(0)):
        rows = row_block * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        row_mask = rows < n_rows
        rows64 = rows.to(tl.int64)
        hmask = row_mask[:, None] & (hs < hc)[None, :]
        h = tl.load(h_ptr + rows64[:, None] * hc + hs[None, :], mask=hmask, other=0.0)
        dh = tl.zeros([BLOCK_ROWS, HC_BLOCK], dtype=tl.float32)
        for tile in range(COL_TILES):
            cols = tile * BLOCK_COLS + col_offsets
            col_mask = cols < n_cols
            mask3 = hmask[:, :, None] & col_mask[None, None, :]
            offs3 = (rows64[:, None, None] * hc + hs[None, :, None]) * n_cols + cols[None, None, :]
            x = tl.load(x_ptr + offs3, mask=mask3, other=0.0).to(tl.float32)
            dout = tl.load(dout_ptr + rows64[:, None] * n_cols + cols[None, :],
                           mask=row_mask[:, None] & col_mask[None, :], other=0.0).to(tl.float32)
            dh += tl.sum(x * dout[:, None, :], axis=2)
            tl.store(dx_ptr + offs3, (h[:, :, None] * dout[:, None, :]).to(dx_ptr.dtype.element_ty), mask=mask3)
        tl.store(dh_ptr + rows64[:, None] * hc + hs[None, :], dh, mask=hmask)


@fast_launch
@triton.jit
def _mhc_post_res_forward_kernel(
    x_ptr, f_ptr, hpost_ptr, hres_ptr, out_ptr, n_rows, n_cols, hc,
    HC_BLOCK: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr, COL_TILES: tl.constexpr,
):
    """``out[n, i, c] = sum_j h_res[n, i, j] * x[n, j, c] + h_post[n, i] * f[n, c]``."""
    pid = tl.program_id(0)
    n_row_blocks = tl.cdiv(n_rows, BLOCK_ROWS)
    hs = tl.arange(0, HC_BLOCK)
    col_offsets = tl.arange(0, BLOCK_COLS)
    for row_block in tl.range(pid, n_row_blocks, tl.num_programs(0)):
        rows = row_block * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        row_mask = rows < n_rows
        rows64 = rows.to(tl.int64)
        hmask = row_mask[:, None] & (hs < hc)[None, :]
        hpost = tl.load(hpost_ptr + rows64[:, None] * hc + hs[None, :], mask=hmask, other=0.0)
        for tile in range(COL_TILES):
            cols = tile * BLOCK_COLS + col_offsets
            col_mask = cols < n_cols
            mask3 = hmask[:, :, None] & col_mask[None, None, :]
            offs3 = (rows64[:, None, None] * hc + hs[None, :, None]) * n_cols + cols[None, None, :]
            x = tl.load(x_ptr + offs3, mask=mask3, other=0.0).to(tl.float32)
            f = tl.load(f_ptr + rows64[:, None] * n_cols + cols[None, :],
                        mask=row_mask[:, None] & col_mask[None, :], other=0.0).to(tl.float32)
            out = hpost[:, :, None] * f[:, None, :]
            for i in range(hc):
                # row i of h_res: (BLOCK_ROWS, HC)
                hres_i = tl.load(hres_ptr + (rows64[:, None] * hc + i) * hc + hs[None, :], mask=hmask, other=0.0)
                mixed = tl.sum(hres_i[:, :, None] * x, axis=1)
                out += tl.where((hs == i)[None, :, None], mixed[:, None, :], 0.0)
            tl.store(out_ptr + offs3, out.to(out_ptr.dtype.element_ty), mask=mask3)


@fast_launch
@triton.jit
def _mhc_post_res_backward_kernel(
    dout_ptr, x_ptr, f_ptr, hpost_ptr, hres_ptr, dx_ptr, df_ptr, dhpost_ptr, dhres_ptr, n_rows, n_cols, hc,
    HC_BLOCK: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr, COL_TILES: tl.constexpr,
):
    """``dx[n, j] = sum_i h_res[n, i, j] dout[n, i]``, ``df[n] = sum_i h_post[n, i] dout[n, i]``,
    ``dh_post[n, i] = dout[n, i] . f[n]``, ``dh_res[n, i, j] = dout[n, i] . x[n, j]``."""
    pid = tl.program_id(0)
    n_row_blocks = tl.cdiv(n_rows, BLOCK_ROWS)
    hs = tl.arange(0, HC_BLOCK)
    col_offsets = tl.arange(0, BLOCK_COLS)
    for row_block in tl.range(pid, n_row_blocks, tl.num_programs(0)):
        rows = row_block * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        row_mask = rows < n_rows
        rows64 = rows.to(tl.int64)
        hmask = row_mask[:, None] & (hs < hc)[None, :]
        hpost = tl.load(hpost_ptr + rows64[:, None] * hc + hs[None, :], mask=hmask, other=0.0)
        dhpost = tl.zeros([BLOCK_ROWS, HC_BLOCK], dtype=tl.float32)
        for tile in range(COL_TILES):
            cols = tile * BLOCK_COLS + col_offsets
            col_mask = cols < n_cols
            mask2 = row_mask[:, None] & col_mask[None, :]
            mask3 = hmask[:, :, None] & col_mask[None, None, :]
            offs3 = (rows64[:, None, None] * hc + hs[None, :, None]) * n_cols + cols[None, None, :]
            dout = tl.load(dout_ptr + offs3, mask=mask3, other=0.0).to(tl.float32)
            f = tl.load(f_ptr + rows64[:, None] * n_cols + cols[None, :], mask=mask2, other=0.0).to(tl.float32)
            df = tl.sum(hpost[:, :, None] * dout, axis=1)
            tl.store(df_ptr + rows64[:, None] * n_cols + cols[None, :], df.to(df_ptr.dtype.element_ty), mask=mask2)
            dhpost += tl.sum(dout * f[:, None, :], axis=2)
            dx = tl.zeros([BLOCK_ROWS, HC_BLOCK, BLOCK_COLS], dtype=tl.float32)
            for i in range(hc):
                hres_i = tl.load(hres_ptr + (rows64[:, None] * hc + i) * hc + hs[None, :], mask=hmask, other=0.0)
                dout_i = tl.sum(tl.where((hs == i)[None, :, None], dout, 0.0), axis=1)  # (BLOCK_ROWS, BLOCK_COLS)
                dx += hres_i[:, :, None] * dout_i[:, None, :]
            tl.store(dx_ptr + offs3, dx.to(dx_ptr.dtype.element_ty), mask=mask3)
        tl.store(dhpost_ptr + rows64[:, None] * hc + hs[None, :], dhpost, mask=hmask)
    # dh_res[n, i, :] = sum_c dout[n, i, c] x[n, :, c], row i at a time (a second pass over the tiles)
    for row_block in tl.range(pid, n_row_blocks, tl.num_programs(0)):
        rows = row_block * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        row_mask = rows < n_rows
        rows64 = rows.to(tl.int64)
        hmask = row_mask[:, None] & (hs < hc)[None, :]
        for i in range(hc):
            acc = tl.zeros([BLOCK_ROWS, HC_BLOCK], dtype=tl.float32)
            for tile in range(COL_TILES):
                cols = tile * BLOCK_COLS + col_offsets
                col_mask = cols < n_cols
                mask3 = hmask[:, :, None] & col_mask[None, None, :]
                offs3 = (rows64[:, None, None] * hc + hs[None, :, None]) * n_cols + cols[None, None, :]
                x = tl.load(x_ptr + offs3, mask=mask3, other=0.0).to(tl.float32)
                dout_i = tl.load(dout_ptr + (rows64[:, None] * hc + i) * n_cols + cols[None, :],
                                 mask=row_mask[:, None] & col_mask[None, :], other=0.0).to(tl.float32)
                acc += tl.sum(x * dout_i[:, None, :], axis=2)
            tl.store(dhres_ptr + (rows64[:, None] * hc + i) * hc + hs[None, :], acc, mask=hmask)


# How the projection's matmuls multiply (a constexpr): fp32 operands in full IEEE fp32 (an fp32
# stream, as torch's fp32 matmul does by default); each fp32 operand split into two bf16 parts on
# the tensor cores; or those same parts multiplied as fp32 (Triton's interpreter cannot multiply
# bf16: the products of bf16 values are exact in fp32, so the result is the same).
DOT_IEEE, DOT_SPLIT, DOT_SPLIT_FP32 = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)


@triton.jit
def _dot_fresh(a, b, DOT: tl.constexpr):
    # Two helpers rather than one taking ``acc=None``: Ascend's Triton (3.2) cannot pass a None
    # accumulator through a jitted call to ``tl.dot``.
    if DOT == DOT_SPLIT_FP32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _dot_into(a, b, acc, DOT: tl.constexpr):
    if DOT == DOT_SPLIT_FP32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def _precise_dot(a, b, SPLIT_A: tl.constexpr, SPLIT_B: tl.constexpr, DOT: tl.constexpr):
    """``a @ b`` (fp32) with about 16 significant bits per operand on bf16 tensor cores: an operand
    that is not exact in bf16 (``SPLIT_*``: fp32, fp16) is split into ``hi = bf16(v)`` and ``lo =
    bf16(v - hi)``; the product is ``a_hi b_hi + a_hi b_lo + a_lo b_hi`` (``a_lo b_lo`` is below
    the rest's rounding). The projection's sums run over the whole widened stream (``HC * C``
    terms): a single bf16 product would put bf16's rounding into every coefficient.

    A fresh accumulator per call, which the caller adds to its own: the tensor cores round their
    additions toward zero, and over thousands of them (a long ``k`` loop accumulating in the dot)
    that bias reached 1.6e-4 of a coefficient on the H100; the caller's own adds round to nearest."""
    if DOT == DOT_IEEE:
        acc = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        a_hi = a.to(tl.bfloat16)
        b_hi = b.to(tl.bfloat16)
        acc = _dot_fresh(a_hi, b_hi, DOT)
        if SPLIT_B:
            acc = _dot_into(a_hi, (b.to(tl.float32) - b_hi.to(tl.float32)).to(tl.bfloat16), acc, DOT)
        if SPLIT_A:
            acc = _dot_into((a.to(tl.float32) - a_hi.to(tl.float32)).to(tl.bfloat16), b_hi, acc, DOT)
    return acc


@fast_launch
@triton.jit
def _mhc_projection_kernel(
    x_ptr, phi_ptr, proj_ptr, squares_ptr, n_rows, k_cols, m_cols, k_splits, split_cols,
    SPLIT_X: tl.constexpr, DOT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    M_BLOCK: tl.constexpr,
):
    """For work items ``(block of tokens, split of x_flat's columns)``: the split's share of ``proj
    = x_flat @ phi`` (``proj[split]``, ``(N, M)`` fp32) and of ``sum(x_flat**2)`` (``squares[split]``,
    ``(N,)``), reading the stream once in its own dtype. Splitting the columns keeps every compute
    unit busy with few tokens (each program reads ``phi``'s rows of its split once per block of
    tokens: the fewer blocks, the less of that); the coefficient kernel adds the splits up."""
    ms = tl.arange(0, M_BLOCK)
    m_mask = ms < m_cols
    for item in tl.range(tl.program_id(0), tl.cdiv(n_rows, BLOCK_N) * k_splits, tl.num_programs(0)):
        split = item % k_splits
        rows = (item // k_splits) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_mask = rows < n_rows
        rows64 = rows.to(tl.int64)
        acc = tl.zeros([BLOCK_N, M_BLOCK], dtype=tl.float32)
        squares = tl.zeros([BLOCK_N], dtype=tl.float32)
        for k0 in range(split * split_cols, tl.minimum((split + 1) * split_cols, k_cols), BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            col_mask = cols < k_cols
            x = tl.load(x_ptr + rows64[:, None] * k_cols + cols[None, :],
                        mask=row_mask[:, None] & col_mask[None, :], other=0.0)
            xf = x.to(tl.float32)
            squares += tl.sum(xf * xf, axis=1)
            phi = tl.load(phi_ptr + cols[:, None] * m_cols + ms[None, :], mask=col_mask[:, None] & m_mask[None, :],
                          other=0.0)
            acc += _precise_dot(x, phi, SPLIT_X, True, DOT)
        part = split.to(tl.int64) * n_rows + rows64
        tl.store(proj_ptr + part[:, None] * m_cols + ms[None, :], acc, mask=row_mask[:, None] & m_mask[None, :])
        tl.store(squares_ptr + part, squares, mask=row_mask)


@fast_launch
@triton.jit
def _mhc_projection_backward_kernel(
    x_ptr, phi_ptr, d_proj_ptr, rms_coef_ptr, dx_ptr, dphi_ptr, n_rows, k_cols, m_cols, n_shares,
    SPLIT_X: tl.constexpr, DOT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    M_BLOCK: tl.constexpr,
):
    """The projection's backward for work items ``(column tile of x_flat, share of the tokens)``:
    ``dx = d_proj @ phi.T - rms_coef * x_flat`` (the RMS factor's term folded in), stored in
    ``x``'s dtype, and the share's ``dphi = x_flat.T @ d_proj`` (fp32, in ``dphi[share]``; the
    launcher sums the shares: no atomics, the same sum on every run). Each item reads its ``x``
    tile once for both products."""
    ms = tl.arange(0, M_BLOCK)
    m_mask = ms < m_cols
    n_row_blocks = tl.cdiv(n_rows, BLOCK_N)
    for item in tl.range(tl.program_id(0), tl.cdiv(k_cols, BLOCK_K) * n_shares, tl.num_programs(0)):
        share = item % n_shares
        cols = (item // n_shares) * BLOCK_K + tl.arange(0, BLOCK_K)
        col_mask = cols < k_cols
        phi_t = tl.load(phi_ptr + cols[None, :] * m_cols + ms[:, None], mask=m_mask[:, None] & col_mask[None, :],
                        other=0.0)
        dphi = tl.zeros([BLOCK_K, M_BLOCK], dtype=tl.float32)
        for row_block in range(share, n_row_blocks, n_shares):
            rows = row_block * BLOCK_N + tl.arange(0, BLOCK_N)
            row_mask = rows < n_rows
            rows64 = rows.to(tl.int64)
            mask = row_mask[:, None] & col_mask[None, :]
            x = tl.load(x_ptr + rows64[:, None] * k_cols + cols[None, :], mask=mask, other=0.0)
            d_proj = tl.load(d_proj_ptr + rows64[:, None] * m_cols + ms[None, :],
                             mask=row_mask[:, None] & m_mask[None, :], other=0.0)
            coef = tl.load(rms_coef_ptr + rows64, mask=row_mask, other=0.0)
            dx = _precise_dot(d_proj, phi_t, True, True, DOT) - coef[:, None] * x.to(tl.float32)
            tl.store(dx_ptr + rows64[:, None] * k_cols + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)
            dphi += _precise_dot(tl.trans(x), d_proj, SPLIT_X, True, DOT)
        tl.store(dphi_ptr + share.to(tl.int64) * k_cols * m_cols + cols[:, None] * m_cols + ms[None, :], dphi,
                 mask=col_mask[:, None] & m_mask[None, :])


@triton.jit
def _sinkhorn_step(m, t, eps):
    """Iterate ``t`` (1-based) of the Sinkhorn loop over ``m (rows, HC, HC)``: the first and every
    odd iterate divide each column by its sum plus ``eps``, the even ones each row. Padding stays 0."""
    sums = tl.where(t % 2 == 0, tl.sum(m, axis=2)[:, :, None], tl.sum(m, axis=1)[:, None, :]) + eps
    return m / _nonzero(sums)


@triton.jit
def _nonzero(sums):
    """A divisor for the Sinkhorn sums: only a padding row or column (all zeros) sums to zero (with
    ``sinkhorn_eps=0``), and 0/0 there would spread NaN into the real block through the next sums."""
    return tl.where(sums == 0.0, 1.0, sums)


@triton.jit
def _residual_softmax(proj_ptr, b_ptr, rows64, valid, square, res_cols, invr, a_res, hc, m_cols):
    """``softmax(alpha_res * mix_res + b_res)`` over each row of the ``(HC, HC)`` block, 0 outside
    ``valid``; also returns the block's ``mix_res``."""
    res_offsets = 2 * hc + res_cols
    mix = tl.load(proj_ptr + rows64[:, None, None] * m_cols + res_offsets[None, :, :], mask=valid,
                  other=0.0) * invr[:, None, None]
    logits = mix * a_res + tl.load(b_ptr + res_offsets, mask=square, other=0.0).to(tl.float32)[None, :, :]
    peak = tl.max(tl.where(valid, logits, float("-inf")), axis=2)
    peak = tl.where(peak == float("-inf"), 0.0, peak)  # an all-padding row: no NaN from -inf - -inf
    e = tl.where(valid, tl.exp(logits - peak[:, :, None]), 0.0)
    total = tl.sum(e, axis=2)
    return e / tl.where(total == 0.0, 1.0, total)[:, :, None], mix


@triton.jit
def _shared_coefficients(b_ptr, a_pre_ptr, a_post_ptr, a_res_ptr, hc, HC_BLOCK: tl.constexpr):
    """What every token of both passes shares: the stream offsets, the ``HC x HC`` block's offsets
    and mask, the three alphas and the pre/post biases (fp32)."""
    hs = tl.arange(0, HC_BLOCK)
    res_cols = hs[:, None] * hc + hs[None, :]
    square = (hs < hc)[:, None] & (hs < hc)[None, :]
    a_pre = tl.load(a_pre_ptr).to(tl.float32)
    a_post = tl.load(a_post_ptr).to(tl.float32)
    a_res = tl.load(a_res_ptr).to(tl.float32)
    b_pre = tl.load(b_ptr + hs, mask=hs < hc, other=0.0).to(tl.float32)
    b_post = tl.load(b_ptr + hc + hs, mask=hs < hc, other=0.0).to(tl.float32)
    return hs, res_cols, square, a_pre, a_post, a_res, b_pre, b_post


@triton.jit
def _sum_projection_splits(parts_ptr, squares_ptr, proj_ptr, invr_ptr, rows64, row_mask, n_rows, m_cols, k_cols,
                           k_splits, rms_eps, BLOCK_ROWS: tl.constexpr, M_BLOCK: tl.constexpr):
    """``proj`` and ``invr = rsqrt(mean(x_flat**2) + rms_eps)`` of a block of tokens from the
    projection kernel's column splits."""
    ms = tl.arange(0, M_BLOCK)
    mask = row_mask[:, None] & (ms < m_cols)[None, :]
    proj = tl.zeros([BLOCK_ROWS, M_BLOCK], dtype=tl.float32)
    squares = tl.zeros([BLOCK_ROWS], dtype=tl.float32)
    for split in range(k_splits):
        part = split * n_rows + rows64
        proj += tl.load(parts_ptr + part[:, None] * m_cols + ms[None, :], mask=mask, other=0.0)
        squares += tl.load(squares_ptr + part, mask=row_mask, other=0.0)
    tl.store(proj_ptr + rows64[:, None] * m_cols + ms[None, :], proj, mask=mask)
    tl.store(invr_ptr + rows64, 1.0 / tl.sqrt(squares / k_cols + rms_eps), mask=row_mask)


@fast_launch
@triton.jit
def _mhc_coeffs_forward_kernel(
    parts_ptr, squares_ptr, proj_ptr, invr_ptr, b_ptr, a_pre_ptr, a_post_ptr, a_res_ptr, pre_ptr, post_ptr,
    res_ptr, n_rows, hc, k_cols, k_splits, rms_eps, pre_eps, sinkhorn_eps, post_mult, tmax,
    HC_BLOCK: tl.constexpr, BLOCK_ROWS: tl.constexpr, M_BLOCK: tl.constexpr,
):
    """The coefficients of a block of tokens: the projection's column splits added up into ``proj =
    x_flat @ phi`` (``(N, M)``) and the RMS factor ``invr`` (``(N,)``), both stored for the backward
    (fp32), then the two sigmoids and the softmax plus Sinkhorn iterations, in registers."""
    pid = tl.program_id(0)
    m_cols = hc * hc + 2 * hc
    hs, res_cols, square, a_pre, a_post, a_res, b_pre, b_post = _shared_coefficients(
        b_ptr, a_pre_ptr, a_post_ptr, a_res_ptr, hc, HC_BLOCK)
    for row_block in tl.range(pid, tl.cdiv(n_rows, BLOCK_ROWS), tl.num_programs(0)):
        rows = row_block * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        row_mask = rows < n_rows
        rows64 = rows.to(tl.int64)
        _sum_projection_splits(parts_ptr, squares_ptr, proj_ptr, invr_ptr, rows64, row_mask, n_rows, m_cols,
                               k_cols, k_splits, rms_eps, BLOCK_ROWS, M_BLOCK)
        tl.debug_barrier()  # proj's row, written by other threads of this program, is read back below
        invr = tl.load(invr_ptr + rows64, mask=row_mask, other=0.0)
        hmask = row_mask[:, None] & (hs < hc)[None, :]
        proj_row = proj_ptr + rows64[:, None] * m_cols + hs[None, :]
        mix_pre = tl.load(proj_row, mask=hmask, other=0.0) * invr[:, None]
        mix_post = tl.load(proj_row + hc, mask=hmask, other=0.0) * invr[:, None]
        h_pre = tl.sigmoid(mix_pre * a_pre + b_pre[None, :]) + pre_eps
        h_post = tl.sigmoid(mix_post * a_post + b_post[None, :]) * post_mult
        tl.store(pre_ptr + rows64[:, None] * hc + hs[None, :], h_pre, mask=hmask)
        tl.store(post_ptr + rows64[:, None] * hc + hs[None, :], h_post, mask=hmask)
        valid = row_mask[:, None, None] & square[None, :, :]
        soft, _ = _residual_softmax(proj_ptr, b_ptr, rows64, valid, square, res_cols, invr, a_res, hc, m_cols)
        mat = tl.where(valid, soft + sinkhorn_eps, 0.0)
        for t in range(1, 2 * tmax):
            mat = _sinkhorn_step(mat, t, sinkhorn_eps)
        tl.store(res_ptr + rows64[:, None, None] * (hc * hc) + res_cols[None, :, :], mat, mask=valid)


@fast_launch
@triton.jit
def _mhc_coeffs_backward_kernel(
    proj_ptr, invr_ptr, b_ptr, a_pre_ptr, a_post_ptr, a_res_ptr, d_pre_ptr, d_post_ptr, d_res_ptr,
    d_proj_ptr, rms_coef_ptr, partial_ptr, iterates_ptr,
    n_rows, hc, k_cols, sinkhorn_eps, post_mult, tmax,
    HC_BLOCK: tl.constexpr, BLOCK_ROWS: tl.constexpr,
):
    """Per token: ``d_proj = dL/d(x_flat @ phi)`` (``(N, M)``) and the RMS factor's term
    ``rms_coef = (d_mix . proj) * r**3 / K``, so that ``dx = d_proj @ phi.T - rms_coef * x_flat``;
    per program, the partial sums of ``db`` (``M`` values) and of the three ``d_alpha`` (after them).

    The Sinkhorn iterates are not kept between forward and backward: each block of tokens runs the
    loop forward once more, storing its ``2 * tmax - 1`` iterates in this program's own scratch
    (``iterates``: a few KB per token, in L2), then walks back reading them. Recomputing each
    iterate from the softmax instead (registers only) is quadratic in ``tmax``: on the H100 that
    made this kernel six times liger-kernel's equivalent."""
    pid = tl.program_id(0)
    m_cols = hc * hc + 2 * hc
    n_iterates = 2 * tmax - 1
    block_size: tl.constexpr = BLOCK_ROWS * HC_BLOCK * HC_BLOCK
    block_offsets = (tl.arange(0, BLOCK_ROWS)[:, None, None] * HC_BLOCK + tl.arange(0, HC_BLOCK)[None, :, None]) \
        * HC_BLOCK + tl.arange(0, HC_BLOCK)[None, None, :]
    scratch = iterates_ptr + pid.to(tl.int64) * n_iterates * block_size + block_offsets
    hs, res_cols, square, a_pre, a_post, a_res, b_pre, b_post = _shared_coefficients(
        b_ptr, a_pre_ptr, a_post_ptr, a_res_ptr, hc, HC_BLOCK)
    db_pre = tl.zeros([HC_BLOCK], dtype=tl.float32)
    db_post = tl.zeros([HC_BLOCK], dtype=tl.float32)
    db_res = tl.zeros([HC_BLOCK, HC_BLOCK], dtype=tl.float32)
    da_pre = tl.zeros([BLOCK_ROWS], dtype=tl.float32)
    da_post = tl.zeros([BLOCK_ROWS], dtype=tl.float32)
    da_res = tl.zeros([BLOCK_ROWS], dtype=tl.float32)
    for row_block in tl.range(pid, tl.cdiv(n_rows, BLOCK_ROWS), tl.num_programs(0)):
        rows = row_block * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        row_mask = rows < n_rows
        rows64 = rows.to(tl.int64)
        invr = tl.load(invr_ptr + rows64, mask=row_mask, other=0.0)  # padding tokens add nothing
        hmask = row_mask[:, None] & (hs < hc)[None, :]
        proj_row = proj_ptr + rows64[:, None] * m_cols + hs[None, :]
        proj_pre = tl.load(proj_row, mask=hmask, other=0.0)
        proj_post = tl.load(proj_row + hc, mask=hmask, other=0.0)
        mix_pre = proj_pre * invr[:, None]
        mix_post = proj_post * invr[:, None]
        s_pre = tl.sigmoid(mix_pre * a_pre + b_pre[None, :])
        s_post = tl.sigmoid(mix_post * a_post + b_post[None, :])
        grad_row = rows64[:, None] * hc + hs[None, :]
        dl_pre = tl.load(d_pre_ptr + grad_row, mask=hmask, other=0.0) * s_pre * (1.0 - s_pre)
        dl_post = tl.load(d_post_ptr + grad_row, mask=hmask, other=0.0) * post_mult * s_post * (1.0 - s_post)
        valid = row_mask[:, None, None] & square[None, :, :]
        soft, mix_res = _residual_softmax(proj_ptr, b_ptr, rows64, valid, square, res_cols, invr, a_res, hc, m_cols)
        first = tl.where(valid, soft + sinkhorn_eps, 0.0)
        d = tl.load(d_res_ptr + rows64[:, None, None] * (hc * hc) + res_cols[None, :, :], mask=valid, other=0.0)
        # Iterate j (the input of step j + 1) at scratch + j * block_size, padding included (zeros).
        mat = first
        tl.store(scratch, mat)
        for t in range(1, n_iterates):
            mat = _sinkhorn_step(mat, t, sinkhorn_eps)
            tl.store(scratch + t * block_size, mat)
        tl.debug_barrier()  # the walk back reads iterates other threads of this program wrote
        for back in range(0, n_iterates):
            step = n_iterates - back  # walking back from the last step
            mat = tl.load(scratch + (step - 1) * block_size)
            # d/dmat of mat / (sum + eps): d / s - sum(d * mat) / s**2 over the step's dimension
            by_rows = step % 2 == 0
            sums = _nonzero(tl.where(by_rows, tl.sum(mat, axis=2)[:, :, None], tl.sum(mat, axis=1)[:, None, :])
                            + sinkhorn_eps)
            dots = tl.where(by_rows, tl.sum(d * mat, axis=2)[:, :, None], tl.sum(d * mat, axis=1)[:, None, :])
            d = tl.where(valid, d / sums - dots / (sums * sums), 0.0)
        dl_res = soft * (d - tl.sum(d * soft, axis=2)[:, :, None])
        d_mix_pre = dl_pre * a_pre
        d_mix_post = dl_post * a_post
        d_mix_res = dl_res * a_res
        proj_res = tl.load(proj_ptr + rows64[:, None, None] * m_cols + 2 * hc + res_cols[None, :, :], mask=valid,
                           other=0.0)
        d_r = (tl.sum(d_mix_pre * proj_pre, axis=1) + tl.sum(d_mix_post * proj_post, axis=1)
               + tl.sum(tl.sum(d_mix_res * proj_res, axis=2), axis=1))
        tl.store(rms_coef_ptr + rows64, d_r * invr * invr * invr / k_cols, mask=row_mask)
        d_row = d_proj_ptr + rows64[:, None] * m_cols + hs[None, :]
        tl.store(d_row, d_mix_pre * invr[:, None], mask=hmask)
        tl.store(d_row + hc, d_mix_post * invr[:, None], mask=hmask)
        tl.store(d_proj_ptr + rows64[:, None, None] * m_cols + 2 * hc + res_cols[None, :, :],
                 d_mix_res * invr[:, None, None], mask=valid)
        db_pre += tl.sum(dl_pre, axis=0)
        db_post += tl.sum(dl_post, axis=0)
        db_res += tl.sum(dl_res, axis=0)
        da_pre += tl.sum(dl_pre * mix_pre, axis=1)
        da_post += tl.sum(dl_post * mix_post, axis=1)
        da_res += tl.sum(tl.sum(dl_res * mix_res, axis=2), axis=1)
        tl.debug_barrier()  # every thread is done reading this block's iterates before the next's
    partial = partial_ptr + pid * (m_cols + 3)
    tl.store(partial + hs, db_pre, mask=hs < hc)
    tl.store(partial + hc + hs, db_post, mask=hs < hc)
    tl.store(partial + 2 * hc + res_cols, db_res, mask=square)
    tl.store(partial + m_cols, tl.sum(da_pre, axis=0))
    tl.store(partial + m_cols + 1, tl.sum(da_post, axis=0))
    tl.store(partial + m_cols + 2, tl.sum(da_res, axis=0))


# --------------------------------------------------------------------------------------- launchers


def plan(shape, dtype: torch.dtype, profile: DeviceProfile | None = None) -> dict[str, RowPlan]:
    """The kernels' plans for ``x`` of ``shape`` ``(..., HC, C)``: tokens are rows, ``C`` the
    columns, each tile holding all ``HC`` streams of its tokens."""
    tokens = 1
    for s in shape[:-2]:
        tokens *= int(s)
    hc, c = int(shape[-2]), int(shape[-1])
    hb = next_power_of_2(hc)
    tokens = max(1, tokens)
    return {
        "pre": plan_rows(tokens, c, dtype, profile=profile, **_pre_tiles(hb)),
        "post_res": plan_rows(tokens, c, dtype, profile=profile, **_post_tiles(hb)),
        "coeffs": _coeff_plan(tokens, hc, profile),
        "projection": _projection_plan(tokens, hc * c, hc, dtype, profile),
        "projection_backward": _projection_backward_plan(tokens, hc * c, hc, dtype, profile),
    }


def _launch(kernel, tiles, n: int, c: int, hc: int, dtype, *args) -> None:
    grid, constexprs = _rows_config(tiles, n, c, hc, dtype, get_profile())
    kernel[grid](*args, n, c, hc, **constexprs)


# The launch configurations below are kept per shape (each is a few plans and divisions, which at
# small sizes cost more host time than the launch); callers unpack, never modify, their dicts.
@functools.lru_cache(maxsize=1024)
def _rows_config(tiles, n: int, c: int, hc: int, dtype, profile) -> tuple[tuple, dict]:
    hb = next_power_of_2(hc)
    p = plan_rows(n, c, dtype, profile=profile, **tiles(hb))
    return (p.grid,), dict(HC_BLOCK=hb, BLOCK_ROWS=p.block_rows, BLOCK_COLS=p.block_cols,
                           COL_TILES=p.col_tiles, num_warps=p.num_warps)


@custom_op("mhc_pre_forward")
def mhc_pre_forward(x: Tensor, h_pre: Tensor) -> Tensor:
    """``x (N, HC, C)`` contiguous, ``h_pre (N, HC)`` fp32 -> ``(N, C)`` in x's dtype."""
    n, hc, c = x.shape
    out = x.new_empty((n, c))
    if n:
        _launch(_mhc_pre_forward_kernel, _pre_tiles, n, c, hc, x.dtype, x, h_pre, out)
    return out


@mhc_pre_forward.register_fake
def _(x, h_pre):
    return x.new_empty((x.shape[0], x.shape[2]))


@custom_op("mhc_pre_backward")
def mhc_pre_backward(dout: Tensor, x: Tensor, h_pre: Tensor) -> tuple[Tensor, Tensor]:
    n, hc, c = x.shape
    dx = torch.empty_like(x)
    dh = torch.empty_like(h_pre)  # the kernel stores every row's (one program per row block)
    if n:
        _launch(_mhc_pre_backward_kernel, _pre_tiles, n, c, hc, x.dtype, dout.contiguous(), x, h_pre, dx, dh)
    return dx, dh


@mhc_pre_backward.register_fake
def _(dout, x, h_pre):
    return torch.empty_like(x), torch.empty_like(h_pre)


def _pre_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _pre_backward(ctx, dout):
    x, h_pre = ctx.saved_tensors
    return mhc_pre_backward(dout, x, h_pre)


register_autograd(mhc_pre_forward, _pre_backward, setup_context=_pre_setup)


@custom_op("mhc_post_res_forward")
def mhc_post_res_forward(x: Tensor, f_out: Tensor, h_post: Tensor, h_res: Tensor) -> Tensor:
    """``x (N, HC, C)``, ``f_out (N, C)`` contiguous, ``h_post (N, HC)``, ``h_res (N, HC, HC)`` fp32."""
    n, hc, c = x.shape
    out = torch.empty_like(x)
    if n:
        _launch(_mhc_post_res_forward_kernel, _post_tiles, n, c, hc, x.dtype, x, f_out, h_post, h_res, out)
    return out


@mhc_post_res_forward.register_fake
def _(x, f_out, h_post, h_res):
    return torch.empty_like(x)


@custom_op("mhc_post_res_backward")
def mhc_post_res_backward(dout: Tensor, x: Tensor, f_out: Tensor, h_post: Tensor, h_res: Tensor
                          ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    n, hc, c = x.shape
    dx, df = torch.empty_like(x), torch.empty_like(f_out)
    dh_post, dh_res = torch.empty_like(h_post), torch.empty_like(h_res)  # every row stored by its program
    if n:
        _launch(_mhc_post_res_backward_kernel, _post_tiles, n, c, hc, x.dtype, dout.contiguous(), x, f_out,
                h_post, h_res, dx, df, dh_post, dh_res)
    return dx, df, dh_post, dh_res


@mhc_post_res_backward.register_fake
def _(dout, x, f_out, h_post, h_res):
    return torch.empty_like(x), torch.empty_like(f_out), torch.empty_like(h_post), torch.empty_like(h_res)


def _post_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _post_backward(ctx, dout):
    return mhc_post_res_backward(dout, *ctx.saved_tensors)


register_autograd(mhc_post_res_forward, _post_backward, setup_context=_post_setup)


def _coeff_plan(n: int, hc: int, profile: DeviceProfile | None = None) -> RowPlan:
    """Tokens per program of the coefficient kernels, over rows of ``proj`` (``M`` fp32): the
    per-token ``HC x HC`` blocks (a handful of them live at once, fp32) bound the rows."""
    hb = next_power_of_2(hc)
    return plan_rows(n, hc * hc + 2 * hc, torch.float32, live_tiles=1, fp32_tiles=2, persistent=True,
                     max_block_rows=max(1, 128 // (hb * hb)), profile=profile)


def _m_block(hc: int) -> int:
    """The projection's columns (``M = HC*HC + 2*HC``) as one ``tl.dot`` side (16 at least)."""
    return max(16, next_power_of_2(hc * hc + 2 * hc))


def _projection_plan(n: int, k: int, hc: int, dtype: torch.dtype, profile: DeviceProfile | None = None
                     ) -> MatmulPlan:
    """``x_flat (N, K) @ phi (K, M)``, skinny: reading ``x`` is its whole cost. Up to 128 tokens a
    program by a k step of 128 over 8 warps, the fastest of 24 launch configurations timed on the
    H100 at 8192 tokens (C 1024 and 4096); :func:`_projection_splits` splits ``K`` when that
    leaves compute units idle."""
    return plan_matmul(n, _m_block(hc), k, dtype, profile, max_block_k=128, num_warps=8)


def _projection_splits(n: int, k: int, p: MatmulPlan, profile: DeviceProfile) -> int:
    """Column splits of the projection: enough work items for two per compute unit, each split
    at least eight ``k`` steps long."""
    wanted = cdiv(2 * profile.compute_units, cdiv(n, p.block_m))
    return max(1, min(wanted, cdiv(k, 8 * p.block_k)))


def _projection_backward_plan(n: int, k: int, hc: int, dtype: torch.dtype, profile: DeviceProfile | None = None
                              ) -> MatmulPlan:
    """``d_proj (N, M) @ phi.T (M, K)`` by tiles of 16 tokens x 256 columns of ``x_flat`` over 8
    warps, with ``x``'s tile, ``dx`` and ``dphi``'s tile (fp32) alive beside the accumulator: the
    fastest of ten configurations timed on the H100 (as the forward's), 3.8x the slowest."""
    return plan_matmul(n, k, _m_block(hc), dtype, profile, epilogue_tiles=2, block_m=16, max_block_n=256,
                       num_warps=8)


def _dot_mode(dtype: torch.dtype) -> int:
    if dtype == torch.float32:
        return DOT_IEEE.value
    return DOT_SPLIT_FP32.value if interpreter_active() else DOT_SPLIT.value


def _item_grid(items: int, profile: DeviceProfile) -> int:
    """Programs for ``items`` work items: one each, or at most one per compute unit where the
    profile runs persistent programs (the kernels loop over their items)."""
    return min(items, profile.compute_units) if profile.persistent else items


@functools.lru_cache(maxsize=1024)
def _projection_config(n: int, k: int, hc: int, dtype, profile) -> tuple[tuple, int, int, dict]:
    """``(grid, splits, split_cols, constexprs)`` of the projection kernel."""
    p = _projection_plan(n, k, hc, dtype, profile)
    splits = _projection_splits(n, k, p, profile)
    split_cols = cdiv(cdiv(k, p.block_k), splits) * p.block_k
    splits = cdiv(k, split_cols)  # none empty
    items = cdiv(n, p.block_m) * splits
    constexprs = dict(SPLIT_X=dtype != torch.bfloat16, BLOCK_N=p.block_m, BLOCK_K=p.block_k,
                      M_BLOCK=_m_block(hc), num_warps=p.num_warps, num_stages=p.num_stages)
    return (_item_grid(items, profile),), splits, split_cols, constexprs


def _project(x: Tensor, phi: Tensor) -> tuple[Tensor, Tensor]:
    """The projection's column splits: ``(proj parts (S, N, M), squares parts (S, N))``, fp32."""
    n, hc, c = x.shape
    k, m = hc * c, phi.shape[1]
    grid, splits, split_cols, constexprs = _projection_config(n, k, hc, x.dtype, get_profile())
    parts, squares = x.new_empty((splits, n, m), dtype=torch.float32), x.new_empty((splits, n), dtype=torch.float32)
    _mhc_projection_kernel[grid](x, phi, parts, squares, n, k, m, splits, split_cols, DOT=_dot_mode(x.dtype),
                                 **constexprs)
    return parts, squares


@functools.lru_cache(maxsize=1024)
def _projection_backward_config(n: int, k: int, hc: int, dtype, profile) -> tuple[tuple, int, dict]:
    """``(grid, token shares, constexprs)`` of the projection's backward kernel."""
    p = _projection_backward_plan(n, k, hc, dtype, profile)
    col_tiles, row_blocks = cdiv(k, p.block_n), cdiv(n, p.block_m)
    # Token shares for four items per compute unit (timed: 1.3x two), each a few row blocks.
    shares = max(1, min(row_blocks, cdiv(4 * profile.compute_units, col_tiles)))
    constexprs = dict(SPLIT_X=dtype != torch.bfloat16, BLOCK_N=p.block_m, BLOCK_K=p.block_n,
                      M_BLOCK=_m_block(hc), num_warps=p.num_warps, num_stages=p.num_stages)
    return (_item_grid(col_tiles * shares, profile),), shares, constexprs


def _project_backward(x: Tensor, phi: Tensor, d_proj: Tensor, rms_coef: Tensor) -> tuple[Tensor, Tensor]:
    """``(dx_flat in x's dtype, dphi fp32)`` of the projection and the RMS factor's term."""
    n, hc, c = x.shape
    k, m = hc * c, d_proj.shape[1]
    grid, shares, constexprs = _projection_backward_config(n, k, hc, x.dtype, get_profile())
    dx = torch.empty_like(x)
    dphi = d_proj.new_empty((shares, k, m))
    _mhc_projection_backward_kernel[grid](x, phi, d_proj, rms_coef, dx, dphi, n, k, m, shares,
                                          DOT=_dot_mode(x.dtype), **constexprs)
    return dx, sum_partials(dphi.view(shares, k * m)).view(k, m)


def _coeff_launch(kernel, n: int, hc: int, *args, **constexprs) -> None:
    grid, planned = _coeff_config(n, hc, get_profile())
    kernel[grid](*args, **planned, **constexprs)


@functools.lru_cache(maxsize=1024)
def _coeff_config(n: int, hc: int, profile) -> tuple[tuple, dict]:
    p = _coeff_plan(n, hc, profile)
    return (p.grid,), dict(HC_BLOCK=next_power_of_2(hc), BLOCK_ROWS=p.block_rows, num_warps=p.num_warps)


@custom_op("mhc_coeffs_forward")
def mhc_coeffs_forward(x: Tensor, phi: Tensor, b: Tensor, alpha_pre: Tensor, alpha_post: Tensor,
                       alpha_res: Tensor, tmax: int, rms_eps: float, pre_eps: float, sinkhorn_eps: float,
                       post_mult: float) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(h_pre (N, HC), h_post (N, HC), h_res (N, HC, HC))`` fp32 for ``x (N, HC, C)``, and what
    the backward keeps of the forward: ``proj = x_flat @ phi (N, M)`` and the RMS factor ``invr
    (N,)`` (fp32, a few numbers per token). One kernel reads ``x`` once for the projection and the
    RMS factor, one computes everything per token."""
    n, hc, c = x.shape
    m = hc * hc + 2 * hc
    f32 = dict(dtype=torch.float32)
    h_pre, h_post, h_res = x.new_empty((n, hc), **f32), x.new_empty((n, hc), **f32), x.new_empty((n, hc, hc), **f32)
    proj, invr = x.new_empty((n, m), **f32), x.new_empty((n,), **f32)
    if n:
        parts, squares = _project(x, phi)
        _coeff_launch(_mhc_coeffs_forward_kernel, n, hc, parts, squares, proj, invr, b, alpha_pre, alpha_post,
                      alpha_res, h_pre, h_post, h_res, n, hc, hc * c, parts.shape[0], rms_eps, pre_eps, sinkhorn_eps,
                      post_mult, tmax, M_BLOCK=next_power_of_2(m))
    return h_pre, h_post, h_res, proj, invr


@mhc_coeffs_forward.register_fake
def _(x, phi, b, alpha_pre, alpha_post, alpha_res, tmax, rms_eps, pre_eps, sinkhorn_eps, post_mult):
    n, hc, _ = x.shape
    f32 = dict(dtype=torch.float32)
    return (x.new_empty((n, hc), **f32), x.new_empty((n, hc), **f32), x.new_empty((n, hc, hc), **f32),
            x.new_empty((n, hc * hc + 2 * hc), **f32), x.new_empty((n,), **f32))


@custom_op("mhc_coeffs_backward")
def mhc_coeffs_backward(d_pre: Tensor, d_post: Tensor, d_res: Tensor, x: Tensor, phi: Tensor, b: Tensor,
                        alpha_pre: Tensor, alpha_post: Tensor, alpha_res: Tensor, proj: Tensor, invr: Tensor,
                        tmax: int, sinkhorn_eps: float, post_mult: float) -> tuple[Tensor, Tensor, Tensor]:
    """``(dx, dphi, d_small)``: the gradients of ``x`` and ``phi``, and those of ``b`` and the three
    ``alpha`` in one fp32 vector (``M + 3``: ``db`` then ``d_alpha_pre, _post, _res``), split by
    the autograd backward (a custom op's outputs may not be views of one another). The per-token
    chain (sigmoids, softmax, Sinkhorn walked back) is one kernel, which also writes each program's
    partial ``db`` and ``alpha`` sums (all summed in one launch, in a fixed order), then the
    projection's backward (``dx`` and ``dphi``) one more."""
    n, hc, c = x.shape
    m = hc * hc + 2 * hc
    d_proj = proj.new_empty((n, m))
    rms_coef = proj.new_empty((n,))
    (grid,), planned = _coeff_config(max(n, 1), hc, get_profile())
    partials = proj.new_empty((grid, m + 3))  # every program stores its whole row
    hb = planned["HC_BLOCK"]
    iterates = proj.new_empty((grid * (2 * tmax - 1) * planned["BLOCK_ROWS"] * hb * hb,) if n else (0,))
    if not n:
        return torch.zeros_like(x), phi.new_zeros(phi.shape), proj.new_zeros(m + 3)
    _coeff_launch(_mhc_coeffs_backward_kernel, n, hc, proj, invr, b, alpha_pre, alpha_post, alpha_res, d_pre,
                  d_post, d_res, d_proj, rms_coef, partials, iterates, n, hc, hc * c, sinkhorn_eps, post_mult,
                  tmax)
    dx, dphi = _project_backward(x, phi, d_proj, rms_coef)
    return dx, dphi.to(phi.dtype), sum_partials(partials)


@mhc_coeffs_backward.register_fake
def _(d_pre, d_post, d_res, x, phi, b, alpha_pre, alpha_post, alpha_res, proj, invr, tmax, sinkhorn_eps,
      post_mult):
    return torch.empty_like(x), torch.empty_like(phi), proj.new_empty(b.shape[0] + 3)


def _coeffs_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:6], *output[3:])
    ctx.mark_non_differentiable(*output[3:])
    tmax, _, _, sinkhorn_eps, post_mult = inputs[6:]
    ctx.options = (tmax, sinkhorn_eps, post_mult)


def _coeffs_backward(ctx, d_pre, d_post, d_res, _d_proj, _d_invr):
    x, phi, b, alpha_pre, alpha_post, alpha_res = ctx.saved_tensors[:6]
    n, hc, _ = x.shape
    # The backward kernel takes all three gradients (each a few numbers per token): zeros for an
    # unused coefficient.
    d_pre, d_post = ((x.new_zeros((n, hc), dtype=torch.float32) if d is None else d.contiguous())
                     for d in (d_pre, d_post))
    d_res = x.new_zeros((n, hc, hc), dtype=torch.float32) if d_res is None else d_res.contiguous()
    dx, dphi, d_small = mhc_coeffs_backward(d_pre, d_post, d_res, *ctx.saved_tensors, *ctx.options)
    m = b.shape[0]
    # Views of the one vector (no kernel; a cast only for a parameter that is not fp32).
    d_alphas = (d_small[m + i].to(a.dtype) for i, a in enumerate((alpha_pre, alpha_post, alpha_res)))
    return (dx, dphi, d_small[:m].to(b.dtype), *d_alphas, None, None, None, None, None)


register_autograd(mhc_coeffs_forward, _coeffs_backward, setup_context=_coeffs_setup)


# ------------------------------------------------------------------------------------------ public


def _check_stream(x) -> tuple[int, int, int]:
    check_float(x, "x")
    if x.dim() < 3 or x.shape[-1] == 0 or x.shape[-2] == 0:
        raise ValueError(f"x must be (..., HC, C) with HC, C >= 1 and at least one leading dimension, "
                         f"got shape {tuple(x.shape)}")
    hc, c = x.shape[-2], x.shape[-1]
    return x.numel() // (hc * c), hc, c


def _check_coeff(t, name: str, x, shape: tuple[int, ...]) -> None:
    check_float(t, name)
    check_same_device(t, name, x, "x")
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(t.shape)}")


def _check_scalar(t, name: str, x) -> None:
    check_tensor(t, name)
    check_float(t, name)
    check_same_device(t, name, x, "x")
    if t.numel() != 1:
        raise ValueError(f"{name} must be a one-element tensor, got shape {tuple(t.shape)}")


def mhc_coeffs(x: Tensor, phi: Tensor, b: Tensor, alpha_pre: Tensor, alpha_post: Tensor, alpha_res: Tensor, *,
               tmax: int = 20, rms_eps: float = 1e-6, pre_eps: float = 0.0, sinkhorn_eps: float = 1e-6,
               post_mult: float = 2.0) -> tuple[Tensor, Tensor, Tensor]:
    """The mHC coefficients ``(h_pre (..., HC), h_post (..., HC), h_res (..., HC, HC))``, fp32, of
    the widened stream ``x (..., HC, C)`` (see the module docstring): ``phi (HC*C, HC*HC + 2*HC)``,
    ``b (HC*HC + 2*HC,)``, one-element ``alpha_*``. liger-kernel's ``liger_mhc_coeffs`` arguments
    and defaults; every tensor argument gets a gradient."""
    n, hc, c = _check_stream(x)
    m = hc * hc + 2 * hc
    _check_coeff(phi, "phi", x, (hc * c, m))
    _check_coeff(b, "b", x, (m,))
    for name, t in (("alpha_pre", alpha_pre), ("alpha_post", alpha_post), ("alpha_res", alpha_res)):
        _check_scalar(t, name, x)
    if isinstance(tmax, bool) or not isinstance(tmax, int) or tmax < 1:
        raise ValueError(f"tmax must be an int >= 1, got {tmax!r}")
    for name, v in (("rms_eps", rms_eps), ("pre_eps", pre_eps), ("sinkhorn_eps", sinkhorn_eps)):
        check_number(v, name, minimum=0.0)
    check_number(post_mult, "post_mult")
    h_pre, h_post, h_res, _, _ = mhc_coeffs_forward(
        # The kernels read phi and b at unit stride (a transposed phi, a strided b, are copied).
        x.reshape(n, hc, c).contiguous(), phi.contiguous(), b.contiguous(), alpha_pre.reshape(()),
        alpha_post.reshape(()), alpha_res.reshape(()), tmax, float(rms_eps), float(pre_eps), float(sinkhorn_eps), float(post_mult))
    lead = tuple(x.shape[:-2])
    return h_pre.view(*lead, hc), h_post.view(*lead, hc), h_res.view(*lead, hc, hc)


def mhc_pre(x: Tensor, h_pre: Tensor) -> Tensor:
    """The layer's input ``sum_h h_pre[..., h] * x[..., h, :]`` of ``x (..., HC, C)``, in ``x``'s
    dtype (fp32 arithmetic); ``h_pre (..., HC)`` (any float dtype, used in fp32)."""
    n, hc, c = _check_stream(x)
    _check_coeff(h_pre, "h_pre", x, tuple(x.shape[:-1]))
    out = mhc_pre_forward(x.reshape(n, hc, c).contiguous(), h_pre.reshape(n, hc).float().contiguous())
    return out.view(*x.shape[:-2], c)


def mhc_post_res(x: Tensor, f_out: Tensor, h_post: Tensor, h_res: Tensor) -> Tensor:
    """The next widened stream ``h_res @ x + h_post[..., None] * f_out[..., None, :]`` (``x (..., HC,
    C)``, the layer's output ``f_out (..., C)``, ``h_post (..., HC)``, ``h_res (..., HC, HC)``), in
    ``x``'s dtype (fp32 arithmetic)."""
    n, hc, c = _check_stream(x)
    lead = tuple(x.shape[:-2])
    _check_coeff(f_out, "f_out", x, lead + (c,))
    _check_coeff(h_post, "h_post", x, lead + (hc,))
    _check_coeff(h_res, "h_res", x, lead + (hc, hc))
    out = mhc_post_res_forward(x.reshape(n, hc, c).contiguous(), f_out.reshape(n, c).to(x.dtype).contiguous(),
                               h_post.reshape(n, hc).float().contiguous(),
                               h_res.reshape(n, hc, hc).float().contiguous())
    return out.view(x.shape)


def mhc(x: Tensor, layer, phi: Tensor, b: Tensor, alpha_pre: Tensor, alpha_post: Tensor, alpha_res: Tensor, *,
        tmax: int = 20, rms_eps: float = 1e-6, pre_eps: float = 0.0, sinkhorn_eps: float = 1e-6,
        post_mult: float = 2.0, return_coeffs: bool = False):
    """One mHC-wrapped layer (liger-kernel's ``liger_mhc_forward``): the coefficients of ``x (...,
    HC, C)`` (:func:`mhc_coeffs`), the layer on the mixed-down input (:func:`mhc_pre`, cast to the
    layer's parameter dtype), its output mixed back (:func:`mhc_post_res`). ``layer``: any callable
    ``(..., C) -> (..., C)``. Returns ``x_out (..., HC, C)``, with ``(h_pre, h_post, h_res)`` too when
    ``return_coeffs``."""
    h_pre, h_post, h_res = mhc_coeffs(x, phi, b, alpha_pre, alpha_post, alpha_res, tmax=tmax, rms_eps=rms_eps,
                                      pre_eps=pre_eps, sinkhorn_eps=sinkhorn_eps, post_mult=post_mult)
    x_in = mhc_pre(x, h_pre)
    params = getattr(layer, "parameters", None)
    first = next(iter(params()), None) if params is not None else None
    if first is not None and first.dtype != x_in.dtype:
        x_in = x_in.to(first.dtype)
    x_out = mhc_post_res(x, layer(x_in), h_post, h_res)
    return (x_out, (h_pre, h_post, h_res)) if return_coeffs else x_out
