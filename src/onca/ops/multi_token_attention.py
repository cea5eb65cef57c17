"""Multi-token attention (Golovneva et al., 2025, arXiv:2504.00927), liger-kernel's
``multi_token_attention``: a convolution over the attention weights of neighbouring queries and keys
(and across heads), so that an attention weight can depend on several query-key pairs.

For ``scores`` ``(B, C_in, L, L)`` (e.g. ``q @ k^T`` per head, heads as channels)::

    probs = softmax(mask_{-inf}(scores))            over the last dimension (or sparsemax: sparse=True)
    out   = mask_{0}(conv2d(probs, weight, bias, stride, padding, dilation, groups))

with ``mask_{-inf}`` the causal mask (key ``j > `` query ``i`` set to minus infinity: liger-kernel uses
``-1e9``, which gives the same probabilities) and ``mask_{0}`` zeroing the output's positions above
its diagonal (column > row).

Kernels: the masked row activation (forward and backward) is Onca's Triton kernel over the
``B * C_in * L`` rows of the score matrix, one or more rows per tile with the causal mask fused (the
masked columns are never loaded), online over column tiles where a row does not fit one tile;
the output mask is a Triton kernel applied in place to the convolution's output (and, out of place,
to the incoming gradient). The convolution and its two gradients are torch's (cuDNN on a GPU: a
matmul-bound part Onca does not re-implement), all inside the custom ops.

Sparsemax (Martins & Astudillo, 2016): ``p = max(z - tau, 0)`` with ``tau`` such that ``p`` sums to
1. The kernel finds ``tau`` without sorting: bisection on ``[max(z) - 1, max(z)]`` (where
``sum(max(z - tau, 0)) - 1`` changes sign), then two exact steps ``tau = (sum_{z > tau} z - 1) /
|{z > tau}|`` from below (each exact once the support is). Its gradient: ``dz = g - mean_S(g)`` on the
support ``S = {p > 0}``, 0 elsewhere. Softmax's: ``dz = p * (g - sum(g * p))``. Both are computed in
fp32 for every input dtype (liger-kernel's sparse path takes fp32 only).

Saved for backward: the probabilities (``scores``' dtype, as the convolution reads them) and the
convolution's weight; the masked scores are not kept.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from onca.device import DeviceProfile
from onca.ops._contract import custom_op, register_autograd
from onca.ops._launch import fast_launch
from onca.ops._rows import as_rows
from onca.ops._validate import check_bool, check_float, check_same_device, check_tensor
from onca.tiling import RowPlan, plan_rows

__all__ = ["multi_token_attention", "plan"]

# Live tiles (input dtype, fp32) of each kernel.
FORWARD_TILES = dict(live_tiles=2, fp32_tiles=3)  # scores, probs; z, e / the sparsemax terms, a temporary
BACKWARD_TILES = dict(live_tiles=3, fp32_tiles=4)  # dprobs, probs, dscores; their fp32 copies, a product
MASK_TILES = dict(live_tiles=2, fp32_tiles=0)  # in, out
# Bisection steps for sparsemax's threshold on an interval of width 1 (then two exact steps).
SPARSEMAX_BISECTIONS = 24


# ----------------------------------------------------------------------------------------- kernels


@triton.jit
def _masked_row(x_rows, cols, row_mask, pos, n_cols):
    """The fp32 tile of ``z`` with the causal mask: columns past the row's position, or past the
    end, are -inf (and never loaded)."""
    mask = row_mask[:, None] & (cols[None, :] <= pos[:, None]) & (cols < n_cols)[None, :]
    z = tl.load(x_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    return tl.where(mask, z, float("-inf"))


@triton.jit
def _relu_sum(z, tau):
    return tl.sum(tl.maximum(z - tau[:, None], 0.0), axis=1)


@triton.jit
def _support_sums(z, tau):
    """``(sum of z over z > tau, count)`` per row."""
    s = z > tau[:, None]
    return tl.sum(tl.where(s, z, 0.0), axis=1), tl.sum(s.to(tl.float32), axis=1)


@fast_launch
@triton.jit
def _causal_activation_forward_kernel(
    x_ptr, p_ptr, n_rows, n_cols, x_row_stride, p_row_stride, seq_len,
    SPARSE: tl.constexpr,
    BISECTIONS: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    COL_TILES: tl.constexpr,
):
    """Row ``r`` (query position ``r % seq_len``): the softmax / sparsemax of its columns up to its
    position; 0 past it."""
    pid = tl.program_id(0)
    n_row_blocks = tl.cdiv(n_rows, BLOCK_ROWS)
    col_offsets = tl.arange(0, BLOCK_COLS)
    for row_block in tl.range(pid, n_row_blocks, tl.num_programs(0)):
        rows = row_block * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        row_mask = rows < n_rows
        pos = rows % seq_len
        rows64 = rows.to(tl.int64)
        x_rows = x_ptr + rows64[:, None] * x_row_stride
        p_rows = p_ptr + rows64[:, None] * p_row_stride
        if COL_TILES == 1:
            z = _masked_row(x_rows, col_offsets, row_mask, pos, n_cols)
            # Column 0 is never masked on a real row: the max is finite there.
            m = tl.where(row_mask, tl.max(z, axis=1), 0.0)
            if SPARSE:
                lo = m - 1.0
                hi = m
                for _ in range(BISECTIONS):
                    mid = (lo + hi) * 0.5
                    above = _relu_sum(z, mid) >= 1.0
                    lo = tl.where(above, mid, lo)
                    hi = tl.where(above, hi, mid)
                tau = lo
                for _ in range(2):
                    total, count = _support_sums(z, tau)
                    tau = (total - 1.0) / tl.maximum(count, 1.0)
                p = tl.maximum(z - tau[:, None], 0.0)
            else:
                e = tl.exp(z - m[:, None])
                p = e / tl.where(row_mask, tl.sum(e, axis=1), 1.0)[:, None]
            tl.store(p_rows + col_offsets[None, :], p.to(p_ptr.dtype.element_ty),
                     mask=row_mask[:, None] & (col_offsets < n_cols)[None, :])
        else:
            m = tl.full([BLOCK_ROWS], float("-inf"), dtype=tl.float32)
            den = tl.zeros([BLOCK_ROWS], dtype=tl.float32)
            for tile in range(COL_TILES):
                z = _masked_row(x_rows, tile * BLOCK_COLS + col_offsets, row_mask, pos, n_cols)
                m_new = tl.maximum(m, tl.max(z, axis=1))
                shift = tl.where(m_new == float("-inf"), 0.0, m_new)
                if not SPARSE:
                    den = den * tl.exp(m - shift) + tl.sum(tl.exp(z - shift[:, None]), axis=1)
                m = m_new
            m = tl.where(row_mask, m, 0.0)
            if SPARSE:
                lo = m - 1.0
                hi = m
                for _ in range(BISECTIONS):
                    mid = (lo + hi) * 0.5
                    acc = tl.zeros([BLOCK_ROWS], dtype=tl.float32)
                    for tile in range(COL_TILES):
                        acc += _relu_sum(_masked_row(x_rows, tile * BLOCK_COLS + col_offsets, row_mask, pos,
                                                     n_cols), mid)
                    above = acc >= 1.0
                    lo = tl.where(above, mid, lo)
                    hi = tl.where(above, hi, mid)
                tau = lo
                for _ in range(2):
                    total = tl.zeros([BLOCK_ROWS], dtype=tl.float32)
                    count = tl.zeros([BLOCK_ROWS], dtype=tl.float32)
                    for tile in range(COL_TILES):
                        t_sum, t_count = _support_sums(
                            _masked_row(x_rows, tile * BLOCK_COLS + col_offsets, row_mask, pos, n_cols), tau)
                        total += t_sum
                        count += t_count
                    tau = (total - 1.0) / tl.maximum(count, 1.0)
            else:
                den = tl.where(row_mask, den, 1.0)
            for tile in range(COL_TILES):
                cols = tile * BLOCK_COLS + col_offsets
                z = _masked_row(x_rows, cols, row_mask, pos, n_cols)
                if SPARSE:
                    p = tl.maximum(z - tau[:, None], 0.0)
                else:
                    p = tl.exp(z - m[:, None]) / den[:, None]
                tl.store(p_rows + cols[None, :], p.to(p_ptr.dtype.element_ty),
                         mask=row_mask[:, None] & (cols < n_cols)[None, :])


@fast_launch
@triton.jit
def _causal_activation_backward_kernel(
    g_ptr, p_ptr, dx_ptr, n_rows, n_cols, g_row_stride, p_row_stride, dx_row_stride, seq_len,
    SPARSE: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    COL_TILES: tl.constexpr,
):
    """softmax: ``dz = p * (g - sum(g * p))``; sparsemax: ``dz = g - mean(g over p > 0)`` where
    ``p > 0``; 0 past each row's position."""
    pid = tl.program_id(0)
    n_row_blocks = tl.cdiv(n_rows, BLOCK_ROWS)
    col_offsets = tl.arange(0, BLOCK_COLS)
    for row_block in tl.range(pid, n_row_blocks, tl.num_programs(0)):
        rows = row_block * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        row_mask = rows < n_rows
        pos = rows % seq_len
        rows64 = rows.to(tl.int64)
        g_rows = g_ptr + rows64[:, None] * g_row_stride
        p_rows = p_ptr + rows64[:, None] * p_row_stride
        dx_rows = dx_ptr + rows64[:, None] * dx_row_stride
        total = tl.zeros([BLOCK_ROWS], dtype=tl.float32)
        count = tl.zeros([BLOCK_ROWS], dtype=tl.float32)
        for tile in range(COL_TILES):
            cols = tile * BLOCK_COLS + col_offsets
            mask = row_mask[:, None] & (cols[None, :] <= pos[:, None]) & (cols < n_cols)[None, :]
            g = tl.load(g_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            p = tl.load(p_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            if SPARSE:
                total += tl.sum(tl.where(p > 0.0, g, 0.0), axis=1)
                count += tl.sum((p > 0.0).to(tl.float32), axis=1)
            else:
                total += tl.sum(g * p, axis=1)
        if SPARSE:
            total = total / tl.maximum(count, 1.0)
        for tile in range(COL_TILES):
            cols = tile * BLOCK_COLS + col_offsets
            mask = row_mask[:, None] & (cols[None, :] <= pos[:, None]) & (cols < n_cols)[None, :]
            g = tl.load(g_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            p = tl.load(p_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            if SPARSE:
                dz = tl.where(p > 0.0, g - total[:, None], 0.0)
            else:
                dz = p * (g - total[:, None])
            tl.store(dx_rows + cols[None, :], dz.to(dx_ptr.dtype.element_ty),
                     mask=row_mask[:, None] & (cols < n_cols)[None, :])


@fast_launch
@triton.jit
def _upper_zero_kernel(
    x_ptr, y_ptr, n_rows, n_cols, x_row_stride, y_row_stride, height,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    COL_TILES: tl.constexpr,
):
    """``y = x`` with the columns past each row's position (``row % height``) zeroed; ``y`` may be
    ``x`` (in place: each element is read before it is written, by its own program only)."""
    pid = tl.program_id(0)
    n_row_blocks = tl.cdiv(n_rows, BLOCK_ROWS)
    col_offsets = tl.arange(0, BLOCK_COLS)
    for row_block in tl.range(pid, n_row_blocks, tl.num_programs(0)):
        rows = row_block * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        row_mask = rows < n_rows
        pos = rows % height
        rows64 = rows.to(tl.int64)
        for tile in range(COL_TILES):
            cols = tile * BLOCK_COLS + col_offsets
            keep = row_mask[:, None] & (cols[None, :] <= pos[:, None]) & (cols < n_cols)[None, :]
            x = tl.load(x_ptr + rows64[:, None] * x_row_stride + cols[None, :], mask=keep, other=0.0)
            tl.store(y_ptr + rows64[:, None] * y_row_stride + cols[None, :], x,
                     mask=row_mask[:, None] & (cols < n_cols)[None, :])


# --------------------------------------------------------------------------------------- launchers


def plan(shape, dtype: torch.dtype, profile: DeviceProfile | None = None) -> dict[str, RowPlan]:
    """The row kernels' plans for ``scores`` of ``shape`` ``(B, C_in, L, L)`` (the output mask's plan
    is that of an output of the same shape)."""
    *lead, seq, width = (int(s) for s in shape)
    rows = seq
    for s in lead:
        rows *= s
    return {
        "activation_forward": plan_rows(rows, width, dtype, profile=profile, **FORWARD_TILES),
        "activation_backward": plan_rows(rows, width, dtype, profile=profile, **BACKWARD_TILES),
        "output_mask": plan_rows(rows, width, dtype, profile=profile, **MASK_TILES),
    }


def _launch(kernel, tiles, rows2d_shape, dtype, *args, **constexprs) -> None:
    rows, cols = rows2d_shape
    p = plan_rows(rows, cols, dtype, **tiles)
    kernel[(p.grid,)](*args, BLOCK_ROWS=p.block_rows, BLOCK_COLS=p.block_cols, COL_TILES=p.col_tiles,
                      num_warps=p.num_warps, **constexprs)


def _upper_zero(x: Tensor, out: Tensor) -> None:
    """``out = x`` with the positions above each matrix's diagonal zeroed (``x``, ``out`` 4-D)."""
    height = x.shape[-2]
    x2, o2 = as_rows(x), out.view(-1, out.shape[-1])
    rows, cols = o2.shape
    if rows == 0 or cols == 0:
        return
    _launch(_upper_zero_kernel, MASK_TILES, (rows, cols), x.dtype,
            x2, o2, rows, cols, x2.stride(0), o2.stride(0), height)


def _conv_args(stride, padding, dilation, groups) -> dict:
    return dict(stride=tuple(stride), padding=tuple(padding), dilation=tuple(dilation), groups=groups)


@custom_op("multi_token_attention_forward")
def multi_token_attention_forward(scores: Tensor, weight: Tensor, bias: Tensor | None, stride: list[int],
                                  padding: list[int], dilation: list[int], groups: int,
                                  sparse: bool) -> tuple[Tensor, Tensor]:
    """``(out, probs)`` for 4-D ``scores`` ``(B, C_in, L, L)``: the causal softmax / sparsemax
    ``probs`` (``scores``' dtype, contiguous) and the masked convolution ``out``."""
    x2 = as_rows(scores)
    rows, width = x2.shape
    probs = torch.empty(scores.shape, dtype=scores.dtype, device=scores.device)
    if rows:
        p2 = probs.view(rows, width)
        _launch(_causal_activation_forward_kernel, FORWARD_TILES, (rows, width), scores.dtype,
                x2, p2, rows, width, x2.stride(0), p2.stride(0), scores.shape[-2],
                SPARSE=sparse, BISECTIONS=SPARSEMAX_BISECTIONS)
    out = F.conv2d(probs, weight, bias, **_conv_args(stride, padding, dilation, groups)).contiguous()
    _upper_zero(out, out)
    return out, probs


@multi_token_attention_forward.register_fake
def _(scores, weight, bias, stride, padding, dilation, groups, sparse):
    out = F.conv2d(scores, weight, bias, **_conv_args(stride, padding, dilation, groups))
    return torch.empty_like(out, memory_format=torch.contiguous_format), torch.empty_like(
        scores, memory_format=torch.contiguous_format)


@custom_op("multi_token_attention_backward")
def multi_token_attention_backward(grad_out: Tensor, probs: Tensor, weight: Tensor, stride: list[int],
                                   padding: list[int], dilation: list[int], groups: int, sparse: bool,
                                   has_bias: bool) -> tuple[Tensor, Tensor, Tensor]:
    """``(dscores, dweight, dbias)``; ``dbias`` empty without a bias."""
    conv = _conv_args(stride, padding, dilation, groups)
    grad_conv = torch.empty(grad_out.shape, dtype=grad_out.dtype, device=grad_out.device)
    _upper_zero(grad_out, grad_conv)
    grad_probs = torch.nn.grad.conv2d_input(probs.shape, weight, grad_conv, **conv)
    grad_weight = torch.nn.grad.conv2d_weight(probs, weight.shape, grad_conv, **conv)
    grad_bias = grad_conv.sum(dim=(0, 2, 3)) if has_bias else probs.new_empty(0)
    g2, p2 = as_rows(grad_probs), probs.view(-1, probs.shape[-1])
    rows, width = p2.shape
    grad_scores = torch.empty(probs.shape, dtype=probs.dtype, device=probs.device)
    if rows:
        d2 = grad_scores.view(rows, width)
        _launch(_causal_activation_backward_kernel, BACKWARD_TILES, (rows, width), probs.dtype,
                g2, p2, d2, rows, width, g2.stride(0), p2.stride(0), d2.stride(0), probs.shape[-2], SPARSE=sparse)
    return grad_scores, grad_weight, grad_bias


@multi_token_attention_backward.register_fake
def _(grad_out, probs, weight, stride, padding, dilation, groups, sparse, has_bias):
    return (torch.empty_like(probs), torch.empty_like(weight, memory_format=torch.contiguous_format),
            probs.new_empty(weight.shape[0] if has_bias else 0))


# ---------------------------------------------------------------------------------------- autograd


def _setup_context(ctx, inputs, output):
    """Saves the probabilities and the weight."""
    _scores, weight, bias, stride, padding, dilation, groups, sparse = inputs
    _out, probs = output
    ctx.mark_non_differentiable(probs)
    ctx.save_for_backward(probs, weight)
    ctx.options = (stride, padding, dilation, groups, sparse)
    ctx.has_bias = bias is not None


def _backward(ctx, grad_out, _grad_probs):
    probs, weight = ctx.saved_tensors
    d_scores, d_weight, d_bias = multi_token_attention_backward(grad_out, probs, weight, *ctx.options,
                                                                ctx.has_bias)
    return d_scores, d_weight, d_bias if ctx.has_bias else None, None, None, None, None, None


register_autograd(multi_token_attention_forward, _backward, setup_context=_setup_context)


# ------------------------------------------------------------------------------------------ public


def _pair(value, name: str, minimum: int) -> list[int]:
    pair = list(value) if isinstance(value, (tuple, list)) else [value, value]
    if len(pair) != 2 or any(isinstance(v, bool) or not isinstance(v, int) for v in pair):
        raise TypeError(f"{name} must be an int or a pair of ints, got {value!r}")
    if any(v < minimum for v in pair):
        raise ValueError(f"{name} must be >= {minimum}, got {value!r}")
    return pair


def multi_token_attention(
    scores: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    stride=1,
    padding=0,
    dilation=1,
    groups: int = 1,
    sparse: bool = False,
) -> Tensor:
    """Multi-token attention: ``mask_0(conv2d(softmax(mask_-inf(scores)), weight, bias, stride,
    padding, dilation, groups))``, as liger-kernel's ``multi_token_attention``.

    ``scores`` ``(B, C_in, L, L)`` (attention logits, heads as channels); the causal mask sets each
    query's scores of later keys to -inf before the softmax over the last dimension (``sparse=True``:
    sparsemax instead), and the output's positions above its diagonal are zeroed. ``weight``
    ``(C_out, C_in // groups, kH, kW)`` and ``bias`` ``(C_out,)`` as ``torch.nn.functional.conv2d``'s,
    of ``scores``' dtype; ``stride``, ``padding``, ``dilation``: an int or a pair of ints (use
    ``padding = kernel_size // 2`` with stride 1 to keep the ``(L, L)`` size). Returns
    ``(B, C_out, H_out, W_out)`` in ``scores``' dtype, differentiable w.r.t. ``scores``, ``weight``
    and ``bias``. The probabilities are kept for backward (one ``(B, C_in, L, L)`` tensor).
    """
    check_float(scores, "scores")
    if scores.dim() != 4 or scores.shape[-1] != scores.shape[-2]:
        raise ValueError(f"scores must be 4-D (batch, channels, L, L) with square score matrices, "
                         f"got shape {tuple(scores.shape)}")
    check_float(weight, "weight")
    if weight.dim() != 4:
        raise ValueError(f"weight must be 4-D (C_out, C_in // groups, kH, kW), got shape {tuple(weight.shape)}")
    if weight.dtype != scores.dtype:
        raise TypeError(f"weight must have scores' dtype {scores.dtype}, got {weight.dtype}")
    check_same_device(weight, "weight", scores, "scores")
    if isinstance(groups, bool) or not isinstance(groups, int) or groups < 1:
        raise ValueError(f"groups must be a positive int, got {groups!r}")
    if scores.shape[1] != weight.shape[1] * groups or weight.shape[0] % groups:
        raise ValueError(f"weight of shape {tuple(weight.shape)} with groups={groups} does not fit scores' "
                         f"{scores.shape[1]} channels (needs C_in // groups = {scores.shape[1] // groups} and "
                         f"C_out divisible by groups)")
    if bias is not None:
        check_tensor(bias, "bias")
        check_float(bias, "bias")
        if tuple(bias.shape) != (weight.shape[0],):
            raise ValueError(f"bias must have shape ({weight.shape[0]},) (C_out), got {tuple(bias.shape)}")
        if bias.dtype != scores.dtype:
            raise TypeError(f"bias must have scores' dtype {scores.dtype}, got {bias.dtype}")
        check_same_device(bias, "bias", scores, "scores")
    stride = _pair(stride, "stride", 1)
    padding = _pair(padding, "padding", 0)
    dilation = _pair(dilation, "dilation", 1)
    check_bool(sparse, "sparse")
    out, _ = multi_token_attention_forward(scores, weight.contiguous(), None if bias is None else bias.contiguous(),
                                           stride, padding, dilation, groups, sparse)
    return out
