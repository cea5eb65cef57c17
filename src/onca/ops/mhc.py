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
``mhc_coeffs`` is a custom op whose matmul (``x_flat @ phi``) and per-token coefficient arithmetic
(``M`` values per token: a few hundred, against ``HC * C`` read) are a torch composition in fp32;
its backward is the closed-form gradient of that composition (Sinkhorn iterates recomputed from
the saved inputs: nothing of it is stored between forward and backward). Coefficients are fp32, as in liger-kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from onca.device import DeviceProfile
from onca.ops._contract import custom_op, register_autograd
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


def _coeffs(x, phi, b, alpha_pre, alpha_post, alpha_res, tmax, rms_eps, pre_eps, sinkhorn_eps, post_mult):
    """The coefficients in fp32 (torch composition: one matmul and a few hundred values per token)."""
    n, hc, c = x.shape
    xm = x.reshape(n, hc * c).float()
    invr = torch.rsqrt(xm.square().mean(-1, keepdim=True) + rms_eps)
    mix = (xm @ phi.float()) * invr
    b = b.float()
    h_pre = torch.sigmoid(mix[:, :hc] * alpha_pre + b[:hc]) + pre_eps
    h_post = torch.sigmoid(mix[:, hc:2 * hc] * alpha_post + b[hc:2 * hc]) * post_mult
    logits = mix[:, 2 * hc:].reshape(n, hc, hc) * alpha_res + b[2 * hc:].reshape(hc, hc)
    mat = torch.softmax(logits, -1) + sinkhorn_eps
    mat = mat / (mat.sum(-2, keepdim=True) + sinkhorn_eps)
    for _ in range(tmax - 1):
        mat = mat / (mat.sum(-1, keepdim=True) + sinkhorn_eps)
        mat = mat / (mat.sum(-2, keepdim=True) + sinkhorn_eps)
    return h_pre, h_post, mat


@custom_op("mhc_coeffs_forward")
def mhc_coeffs_forward(x: Tensor, phi: Tensor, b: Tensor, alpha_pre: Tensor, alpha_post: Tensor,
                       alpha_res: Tensor, tmax: int, rms_eps: float, pre_eps: float, sinkhorn_eps: float,
                       post_mult: float) -> tuple[Tensor, Tensor, Tensor]:
    """``(h_pre (N, HC), h_post (N, HC), h_res (N, HC, HC))`` fp32 for ``x (N, HC, C)``."""
    with torch.no_grad():
        return tuple(t.contiguous() for t in _coeffs(x, phi, b, alpha_pre, alpha_post, alpha_res, tmax, rms_eps,
                                                       pre_eps, sinkhorn_eps, post_mult))


@mhc_coeffs_forward.register_fake
def _(x, phi, b, alpha_pre, alpha_post, alpha_res, tmax, rms_eps, pre_eps, sinkhorn_eps, post_mult):
    n, hc, _ = x.shape
    f32 = dict(dtype=torch.float32)
    return x.new_empty((n, hc), **f32), x.new_empty((n, hc), **f32), x.new_empty((n, hc, hc), **f32)


def _normalised_backward(d_new: Tensor, mat: Tensor, dim: int, eps: float) -> Tensor:
    """Gradient of ``mat / (mat.sum(dim) + eps)`` with respect to ``mat``."""
    s = mat.sum(dim, keepdim=True) + eps
    return d_new / s - (d_new * mat).sum(dim, keepdim=True) / (s * s)


@custom_op("mhc_coeffs_backward")
def mhc_coeffs_backward(d_pre: Tensor, d_post: Tensor, d_res: Tensor, x: Tensor, phi: Tensor, b: Tensor,
                        alpha_pre: Tensor, alpha_post: Tensor, alpha_res: Tensor, tmax: int, rms_eps: float,
                        pre_eps: float, sinkhorn_eps: float, post_mult: float
                        ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Gradients of ``x, phi, b, alpha_pre, alpha_post, alpha_res`` in closed form, the forward's
    per-token intermediates (a few hundred values per token, the Sinkhorn iterates) recomputed."""
    n, hc, c = x.shape
    k = hc * c
    xm = x.reshape(n, k).float()
    phi32, b32 = phi.float(), b.float()
    r = torch.rsqrt(xm.square().mean(-1, keepdim=True) + rms_eps)
    proj = xm @ phi32
    mix = proj * r
    m_pre, m_post, m_res = mix[:, :hc], mix[:, hc:2 * hc], mix[:, 2 * hc:].reshape(n, hc, hc)
    s_pre = torch.sigmoid(m_pre * alpha_pre + b32[:hc])
    s_post = torch.sigmoid(m_post * alpha_post + b32[hc:2 * hc])
    soft = torch.softmax(m_res * alpha_res + b32[2 * hc:].reshape(hc, hc), -1)
    # The Sinkhorn iterates, each with the dimension it is normalised over next.
    mats, dims = [soft + sinkhorn_eps], [-2]
    mat = mats[0] / (mats[0].sum(-2, keepdim=True) + sinkhorn_eps)
    for _ in range(tmax - 1):
        for dim in (-1, -2):
            mats.append(mat)
            dims.append(dim)
            mat = mat / (mat.sum(dim, keepdim=True) + sinkhorn_eps)
    d_mat = d_res.float()
    for mat, dim in zip(reversed(mats), reversed(dims)):
        d_mat = _normalised_backward(d_mat, mat, dim, sinkhorn_eps)
    d_l_res = soft * (d_mat - (d_mat * soft).sum(-1, keepdim=True))
    d_l_pre = d_pre.float() * s_pre * (1 - s_pre)
    d_l_post = d_post.float() * post_mult * s_post * (1 - s_post)
    d_mix = torch.cat((d_l_pre * alpha_pre, d_l_post * alpha_post, d_l_res.reshape(n, hc * hc) * alpha_res), -1)
    d_alpha = [(d * m).sum() for d, m in ((d_l_pre, m_pre), (d_l_post, m_post), (d_l_res, m_res))]
    db = torch.cat((d_l_pre.sum(0), d_l_post.sum(0), d_l_res.sum(0).reshape(hc * hc)))
    d_proj = d_mix * r
    d_r = (d_mix * proj).sum(-1, keepdim=True)
    dphi = xm.t() @ d_proj
    dx = d_proj @ phi32.t() - d_r * r.pow(3) * xm / k
    return (dx.to(x.dtype).view(n, hc, c), dphi.to(phi.dtype), db.to(b.dtype), d_alpha[0].to(alpha_pre.dtype),
            d_alpha[1].to(alpha_post.dtype), d_alpha[2].to(alpha_res.dtype))


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
