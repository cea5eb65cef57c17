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
``mhc_coeffs`` runs the projection ``x_flat @ phi`` as one fp32 matmul and everything per token
(the RMS factor, the sigmoids, the softmax and the ``2 * tmax - 1`` Sinkhorn normalisations) in
one Triton kernel over blocks of tokens, each token's ``HC x HC`` block in registers. Its backward
recomputes the projection, walks the Sinkhorn loop back in one kernel (nothing of the loop is kept
between forward and backward: each program reruns it for its tokens into a scratch of its own,
then reads the iterates back in reverse) that also reduces ``db`` and the ``alpha`` gradients per
program, and finishes with the projection's two matmuls.
As a torch composition the loop was about 640 small kernels per forward + backward. Coefficients
are fp32, as in liger-kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from onca.device import DeviceProfile
from onca.ops._contract import custom_op, register_autograd
from onca.ops._launch import fast_launch
from onca.ops._validate import check_float, check_number, check_same_device, check_tensor
from onca.tiling import RowPlan, next_power_of_2, plan_rows

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
def _inverse_rms(x_ptr, rows64, row_mask, k_cols, rms_eps,
                 BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr, COL_TILES: tl.constexpr):
    """``rsqrt(mean(x_flat**2) + rms_eps)`` per token of the ``(N, HC * C)`` stream, in fp32."""
    col_offsets = tl.arange(0, BLOCK_COLS)
    squares = tl.zeros([BLOCK_ROWS, BLOCK_COLS], dtype=tl.float32)
    for tile in range(COL_TILES):
        cols = tile * BLOCK_COLS + col_offsets
        x = tl.load(x_ptr + rows64[:, None] * k_cols + cols[None, :],
                    mask=row_mask[:, None] & (cols < k_cols)[None, :], other=0.0).to(tl.float32)
        squares += x * x
    return 1.0 / tl.sqrt(tl.sum(squares, axis=1) / k_cols + rms_eps)


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


@fast_launch
@triton.jit
def _mhc_coeffs_forward_kernel(
    x_ptr, proj_ptr, b_ptr, a_pre_ptr, a_post_ptr, a_res_ptr, pre_ptr, post_ptr, res_ptr,
    n_rows, hc, k_cols, tmax, rms_eps, pre_eps, sinkhorn_eps, post_mult,
    HC_BLOCK: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr, COL_TILES: tl.constexpr,
):
    """The coefficients of a block of tokens from ``proj = x_flat @ phi`` (fp32, ``(N, M)``): the RMS
    factor from ``x``, the two sigmoids and the softmax plus Sinkhorn iterations, in registers."""
    pid = tl.program_id(0)
    m_cols = hc * hc + 2 * hc
    hs, res_cols, square, a_pre, a_post, a_res, b_pre, b_post = _shared_coefficients(
        b_ptr, a_pre_ptr, a_post_ptr, a_res_ptr, hc, HC_BLOCK)
    for row_block in tl.range(pid, tl.cdiv(n_rows, BLOCK_ROWS), tl.num_programs(0)):
        rows = row_block * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        row_mask = rows < n_rows
        rows64 = rows.to(tl.int64)
        invr = _inverse_rms(x_ptr, rows64, row_mask, k_cols, rms_eps, BLOCK_ROWS, BLOCK_COLS, COL_TILES)
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
    x_ptr, proj_ptr, b_ptr, a_pre_ptr, a_post_ptr, a_res_ptr, d_pre_ptr, d_post_ptr, d_res_ptr,
    d_proj_ptr, rms_coef_ptr, partial_ptr, iterates_ptr,
    n_rows, hc, k_cols, tmax, rms_eps, sinkhorn_eps, post_mult,
    HC_BLOCK: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr, COL_TILES: tl.constexpr,
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
        invr = _inverse_rms(x_ptr, rows64, row_mask, k_cols, rms_eps, BLOCK_ROWS, BLOCK_COLS, COL_TILES)
        invr = tl.where(row_mask, invr, 0.0)  # padding tokens add nothing to the partial sums
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
    return {
        "pre": plan_rows(max(1, tokens), c, dtype, profile=profile, **_pre_tiles(hb)),
        "post_res": plan_rows(max(1, tokens), c, dtype, profile=profile, **_post_tiles(hb)),
    }


def _launch(kernel, tiles, n: int, c: int, hc: int, dtype, *args) -> None:
    hb = next_power_of_2(hc)
    p = plan_rows(n, c, dtype, **tiles(hb))
    kernel[(p.grid,)](*args, n, c, hc, HC_BLOCK=hb, BLOCK_ROWS=p.block_rows, BLOCK_COLS=p.block_cols,
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
    dh = torch.zeros_like(h_pre)
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
    dh_post, dh_res = torch.zeros_like(h_post), torch.zeros_like(h_res)
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


def _coeff_plan(n: int, k: int, dtype: torch.dtype, hc: int) -> RowPlan:
    """Tokens per program and the tiles of the RMS pass over ``x_flat (N, HC * C)``. The per-token
    blocks (``HC x HC``, a handful of them live at once, fp32) ride along: they bound the rows."""
    hb = next_power_of_2(hc)
    return plan_rows(n, k, dtype, live_tiles=1, fp32_tiles=2, persistent=True,
                     max_block_rows=max(1, 128 // (hb * hb)))


def _projection(x: Tensor, phi: Tensor) -> tuple[Tensor, Tensor]:
    """``(x_flat, x_flat @ phi)``: the flat stream and its projection, fp32 (one matmul)."""
    n, hc, c = x.shape
    xm = x.reshape(n, hc * c).float()
    return xm, xm @ phi.float()


def _coeff_launch(kernel, x: Tensor, proj: Tensor, *args) -> None:
    n, hc, c = x.shape
    p = _coeff_plan(n, hc * c, x.dtype, hc)
    kernel[(p.grid,)](x, proj, *args, HC_BLOCK=next_power_of_2(hc), BLOCK_ROWS=p.block_rows,
                      BLOCK_COLS=p.block_cols, COL_TILES=p.col_tiles, num_warps=p.num_warps)


@custom_op("mhc_coeffs_forward")
def mhc_coeffs_forward(x: Tensor, phi: Tensor, b: Tensor, alpha_pre: Tensor, alpha_post: Tensor,
                       alpha_res: Tensor, tmax: int, rms_eps: float, pre_eps: float, sinkhorn_eps: float,
                       post_mult: float) -> tuple[Tensor, Tensor, Tensor]:
    """``(h_pre (N, HC), h_post (N, HC), h_res (N, HC, HC))`` fp32 for ``x (N, HC, C)``: the
    projection by one matmul, everything per token by one kernel."""
    n, hc, c = x.shape
    f32 = dict(dtype=torch.float32)
    h_pre, h_post, h_res = x.new_empty((n, hc), **f32), x.new_empty((n, hc), **f32), x.new_empty((n, hc, hc), **f32)
    if n:
        _, proj = _projection(x, phi)
        _coeff_launch(_mhc_coeffs_forward_kernel, x, proj, b, alpha_pre, alpha_post, alpha_res, h_pre, h_post,
                      h_res, n, hc, hc * c, tmax, rms_eps, pre_eps, sinkhorn_eps, post_mult)
    return h_pre, h_post, h_res


@mhc_coeffs_forward.register_fake
def _(x, phi, b, alpha_pre, alpha_post, alpha_res, tmax, rms_eps, pre_eps, sinkhorn_eps, post_mult):
    n, hc, _ = x.shape
    f32 = dict(dtype=torch.float32)
    return x.new_empty((n, hc), **f32), x.new_empty((n, hc), **f32), x.new_empty((n, hc, hc), **f32)


@custom_op("mhc_coeffs_backward")
def mhc_coeffs_backward(d_pre: Tensor, d_post: Tensor, d_res: Tensor, x: Tensor, phi: Tensor, b: Tensor,
                        alpha_pre: Tensor, alpha_post: Tensor, alpha_res: Tensor, tmax: int, rms_eps: float,
                        pre_eps: float, sinkhorn_eps: float, post_mult: float
                        ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Gradients of ``x, phi, b, alpha_pre, alpha_post, alpha_res``: the projection recomputed (one
    matmul), the per-token chain (sigmoids, softmax, Sinkhorn walked back) in one kernel, then the
    two matmuls of the projection's gradient."""
    n, hc, c = x.shape
    m = hc * hc + 2 * hc
    xm, proj = _projection(x, phi)
    d_proj = proj.new_empty((n, m))
    rms_coef = proj.new_empty((n, 1))
    p = _coeff_plan(max(n, 1), hc * c, x.dtype, hc)
    partials = proj.new_zeros((p.grid, m + 3))
    hb = next_power_of_2(hc)
    iterates = proj.new_empty((p.grid * (2 * tmax - 1) * p.block_rows * hb * hb,) if n else (0,))
    if n:
        _coeff_launch(_mhc_coeffs_backward_kernel, x, proj, b, alpha_pre, alpha_post, alpha_res, d_pre, d_post,
                      d_res, d_proj, rms_coef, partials, iterates, n, hc, hc * c, tmax, rms_eps, sinkhorn_eps,
                      post_mult)
    # Separate reductions, not views of one: a custom op's outputs may not alias each other.
    db = partials[:, :m].sum(0)
    d_alphas = [partials[:, m + i].sum() for i in range(3)]
    dphi = xm.t() @ d_proj
    # dx = d_proj @ phi^T - rms_coef * x_flat: the RMS factor's share folded into the matmul's epilogue
    dx = torch.addmm(xm * rms_coef, d_proj, phi.float().t(), alpha=1.0, beta=-1.0) if n else xm.clone()
    return (dx.to(x.dtype).view(n, hc, c), dphi.to(phi.dtype), db.to(b.dtype), d_alphas[0].to(alpha_pre.dtype),
            d_alphas[1].to(alpha_post.dtype), d_alphas[2].to(alpha_res.dtype))


@mhc_coeffs_backward.register_fake
def _(d_pre, d_post, d_res, x, phi, b, alpha_pre, alpha_post, alpha_res, tmax, rms_eps, pre_eps, sinkhorn_eps,
      post_mult):
    return tuple(torch.empty_like(t) for t in (x, phi, b, alpha_pre, alpha_post, alpha_res))


def _coeffs_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:6])
    ctx.options = inputs[6:]


def _coeffs_backward(ctx, d_pre, d_post, d_res):
    d_pre, d_post, d_res = (t.contiguous() for t in (d_pre, d_post, d_res))
    return (*mhc_coeffs_backward(d_pre, d_post, d_res, *ctx.saved_tensors, *ctx.options), None, None, None, None,
            None)


# The coefficients' backward kernel takes all three gradients (each a few numbers per token).
register_autograd(mhc_coeffs_forward, _coeffs_backward, setup_context=_coeffs_setup, materialize_grads=True)


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
    h_pre, h_post, h_res = mhc_coeffs_forward(
        x.reshape(n, hc, c).contiguous(), phi, b, alpha_pre.reshape(()), alpha_post.reshape(()),
        alpha_res.reshape(()), tmax, float(rms_eps), float(pre_eps), float(sinkhorn_eps), float(post_mult))
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
