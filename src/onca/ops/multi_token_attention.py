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
``B * C_in * L`` rows of the score matrix, a tile being a block of channels of one ``(batch, query)``
pair, with the causal mask fused (the masked columns are never loaded), online over column tiles
where a row does not fit one tile. The convolution and its two gradients are torch's (cuDNN on a
GPU: a matmul-bound part Onca does not re-implement), all inside the custom ops, on channels-last
operands where the channels per group are multiples of 8, or are padded to them with zeros
(:func:`conv_layout`): cuDNN's kernels are NHWC, and NCHW operands cost a layout conversion each
way. The kernels take any strides, so the layout changes inside passes that are made anyway: the
forward activation reads the NCHW scores and writes channels-last probabilities; the output mask
(with the bias added) reads the convolution's channels-last output and writes the NCHW output;
backward, the mask writes the incoming gradient channels-last, and the activation's backward reads
the channels-last gradient of the probabilities and writes the NCHW gradient of the scores.

Sparsemax (Martins & Astudillo, 2016): ``p = max(z - tau, 0)`` with ``tau`` such that ``p`` sums to
1. The kernel finds ``tau`` without sorting: bisection on ``[max(z) - 1, max(z)]`` (where
``sum(max(z - tau, 0)) - 1`` changes sign), then two exact steps ``tau = (sum_{z > tau} z - 1) /
|{z > tau}|`` from below (each exact once the support is). Its gradient: ``dz = g - mean_S(g)`` on the
support ``S = {p > 0}``, 0 elsewhere. Softmax's: ``dz = p * (g - sum(g * p))``. Both are computed in
fp32 for every input dtype (liger-kernel's sparse path takes fp32 only).

A small eager softmax call on CUDA (scores or output of at most ``onca.ops._small_calls.limit() /
SMALL_CALL_WEIGHT`` elements) takes torch's ops instead: the masked softmax (its causal mask kept
per length), the convolution and ``tril``.

Saved for backward: the probabilities (``scores``' dtype and the convolution's layout and padded
channels, as the convolution reads them) and the convolution's weight; the masked scores are not kept.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from onca.device import DeviceProfile, get_profile
from onca.ops import _small_calls as small_calls
from onca.ops._contract import custom_op, register_autograd
from onca.ops._launch import fast_launch, launch_config, prepared_key
from onca.ops._validate import check_bool, check_float, check_same_device, check_tensor
from onca.tiling import RowPlan, cdiv, plan_rows

__all__ = ["multi_token_attention", "plan"]

# Live tiles (input dtype, fp32) of each kernel.
FORWARD_TILES = dict(live_tiles=2, fp32_tiles=3)  # scores, probs; z, e / the sparsemax terms, a temporary
BACKWARD_TILES = dict(live_tiles=3, fp32_tiles=4)  # dprobs, probs, dscores; their fp32 copies, a product
# in, out; its column tiles are independent (no per-row state).
OUTPUT_MASK_TILES = dict(live_tiles=2, fp32_tiles=0, row_state=False)
# Bisection steps for sparsemax's threshold on an interval of width 1 (then two exact steps).
SPARSEMAX_BISECTIONS = 24
# A small call (onca.ops._small_calls) counts each element of its largest tensor this many times:
# torch's route (an NCHW convolution, the masks unfused) is the slower one on the device long
# before the host stops deciding. H200, bf16, 2 x 8 heads: Onca's kernels took 0.133 against
# torch's 0.293 ms of device time at 256 tokens (1M elements) and 0.351 against 0.918 at 512 (4M),
# where the route ran at 0.948 ms a call against the kernels' 0.839; at 16 tokens of 32 heads (8K
# elements) the route took 0.50 to 0.75 ms against the kernels' 0.90 to 1.14. So the route is
# taken up to the limit's 1/64th: 64K elements by default.
SMALL_CALL_WEIGHT = 64


# ----------------------------------------------------------------------------------------- kernels


@triton.jit
def _tile_rows(tile, n_channel_blocks, height, n_channels, n_stored, BLOCK_ROWS: tl.constexpr):
    """Tile ``tile``'s ``(b, h)`` (int64 scalars), its ``BLOCK_ROWS`` channels, and which of them are
    read (``< n_channels``) and written (``< n_stored``): a tile is a block of channels of one
    ``(batch, row)`` pair, so that a channels-last tensor's tile is contiguous along the channels
    while an NCHW one's rows are contiguous along the columns."""
    bh = tile // n_channel_blocks
    channels = (tile % n_channel_blocks) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    b, h = (bh // height).to(tl.int64), (bh % height).to(tl.int64)
    return b, h, channels, channels < n_channels, channels < n_stored


@triton.jit
def _rows(ptr, b, h, channels, s_b, s_c, s_h):
    """The pointers to the tile rows' first columns: ``(BLOCK_ROWS, 1)``."""
    return ptr + (b * s_b + h * s_h) + channels.to(tl.int64)[:, None] * s_c


@triton.jit
def _masked_row(x_rows, x_col_stride, cols, row_mask, pos, n_cols):
    """The fp32 tile of ``z`` with the causal mask: columns past the row's position, or past the
    end, are -inf (and never loaded)."""
    mask = row_mask[:, None] & (cols[None, :] <= pos) & (cols < n_cols)[None, :]
    z = tl.load(x_rows + cols[None, :] * x_col_stride, mask=mask, other=0.0).to(tl.float32)
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
    x_ptr, p_ptr, n_tiles, n_channel_blocks, n_channels, n_stored, height, n_cols,
    x_sb, x_sc, x_sh, x_sw, p_sb, p_sc, p_sh, p_sw,
    SPARSE: tl.constexpr,
    BISECTIONS: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    COL_TILES: tl.constexpr,
):
    """Row ``(b, c, h)``: the softmax / sparsemax of its columns up to its position ``h``; 0 past
    it. Any strides on either side (the probabilities are written channels-last for cuDNN); the
    channels ``n_channels <= c < n_stored`` (the convolution's padding) are written as zeros (a
    row with every score masked: ``p`` is 0 there)."""
    pid = tl.program_id(0)
    col_offsets = tl.arange(0, BLOCK_COLS)
    for tile in tl.range(pid, n_tiles, tl.num_programs(0)):
        b, pos, channels, row_mask, store_mask = _tile_rows(
            tile, n_channel_blocks, height, n_channels, n_stored, BLOCK_ROWS)
        x_rows = _rows(x_ptr, b, pos, channels, x_sb, x_sc, x_sh)
        p_rows = _rows(p_ptr, b, pos, channels, p_sb, p_sc, p_sh)
        if COL_TILES == 1:
            z = _masked_row(x_rows, x_sw, col_offsets, row_mask, pos, n_cols)
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
            tl.store(p_rows + col_offsets[None, :] * p_sw, p.to(p_ptr.dtype.element_ty),
                     mask=store_mask[:, None] & (col_offsets < n_cols)[None, :])
        else:
            m = tl.full([BLOCK_ROWS], float("-inf"), dtype=tl.float32)
            den = tl.zeros([BLOCK_ROWS], dtype=tl.float32)
            for col_tile in range(COL_TILES):
                z = _masked_row(x_rows, x_sw, col_tile * BLOCK_COLS + col_offsets, row_mask, pos, n_cols)
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
                    for col_tile in range(COL_TILES):
                        cols = col_tile * BLOCK_COLS + col_offsets
                        acc += _relu_sum(_masked_row(x_rows, x_sw, cols, row_mask, pos, n_cols), mid)
                    above = acc >= 1.0
                    lo = tl.where(above, mid, lo)
                    hi = tl.where(above, hi, mid)
                tau = lo
                for _ in range(2):
                    total = tl.zeros([BLOCK_ROWS], dtype=tl.float32)
                    count = tl.zeros([BLOCK_ROWS], dtype=tl.float32)
                    for col_tile in range(COL_TILES):
                        t_sum, t_count = _support_sums(_masked_row(
                            x_rows, x_sw, col_tile * BLOCK_COLS + col_offsets, row_mask, pos, n_cols), tau)
                        total += t_sum
                        count += t_count
                    tau = (total - 1.0) / tl.maximum(count, 1.0)
            else:
                den = tl.where(row_mask, den, 1.0)
            for col_tile in range(COL_TILES):
                cols = col_tile * BLOCK_COLS + col_offsets
                z = _masked_row(x_rows, x_sw, cols, row_mask, pos, n_cols)
                if SPARSE:
                    p = tl.maximum(z - tau[:, None], 0.0)
                else:
                    p = tl.exp(z - m[:, None]) / den[:, None]
                tl.store(p_rows + cols[None, :] * p_sw, p.to(p_ptr.dtype.element_ty),
                         mask=store_mask[:, None] & (cols < n_cols)[None, :])


@fast_launch
@triton.jit
def _causal_activation_backward_kernel(
    g_ptr, p_ptr, dx_ptr, n_tiles, n_channel_blocks, n_channels, n_stored, height, n_cols,
    g_sb, g_sc, g_sh, g_sw, p_sb, p_sc, p_sh, p_sw, d_sb, d_sc, d_sh, d_sw,
    SPARSE: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    COL_TILES: tl.constexpr,
):
    """softmax: ``dz = p * (g - sum(g * p))``; sparsemax: ``dz = g - mean(g over p > 0)`` where
    ``p > 0``; 0 past each row's position."""
    pid = tl.program_id(0)
    col_offsets = tl.arange(0, BLOCK_COLS)
    for tile in tl.range(pid, n_tiles, tl.num_programs(0)):
        b, pos, channels, row_mask, store_mask = _tile_rows(
            tile, n_channel_blocks, height, n_channels, n_stored, BLOCK_ROWS)
        g_rows = _rows(g_ptr, b, pos, channels, g_sb, g_sc, g_sh)
        p_rows = _rows(p_ptr, b, pos, channels, p_sb, p_sc, p_sh)
        dx_rows = _rows(dx_ptr, b, pos, channels, d_sb, d_sc, d_sh)
        total = tl.zeros([BLOCK_ROWS], dtype=tl.float32)
        count = tl.zeros([BLOCK_ROWS], dtype=tl.float32)
        for col_tile in range(COL_TILES):
            cols = col_tile * BLOCK_COLS + col_offsets
            mask = row_mask[:, None] & (cols[None, :] <= pos) & (cols < n_cols)[None, :]
            g = tl.load(g_rows + cols[None, :] * g_sw, mask=mask, other=0.0).to(tl.float32)
            p = tl.load(p_rows + cols[None, :] * p_sw, mask=mask, other=0.0).to(tl.float32)
            if SPARSE:
                total += tl.sum(tl.where(p > 0.0, g, 0.0), axis=1)
                count += tl.sum((p > 0.0).to(tl.float32), axis=1)
            else:
                total += tl.sum(g * p, axis=1)
        if SPARSE:
            total = total / tl.maximum(count, 1.0)
        for col_tile in range(COL_TILES):
            cols = col_tile * BLOCK_COLS + col_offsets
            mask = row_mask[:, None] & (cols[None, :] <= pos) & (cols < n_cols)[None, :]
            g = tl.load(g_rows + cols[None, :] * g_sw, mask=mask, other=0.0).to(tl.float32)
            p = tl.load(p_rows + cols[None, :] * p_sw, mask=mask, other=0.0).to(tl.float32)
            if SPARSE:
                dz = tl.where(p > 0.0, g - total[:, None], 0.0)
            else:
                dz = p * (g - total[:, None])
            tl.store(dx_rows + cols[None, :] * d_sw, dz.to(dx_ptr.dtype.element_ty),
                     mask=store_mask[:, None] & (cols < n_cols)[None, :])


@fast_launch
@triton.jit
def _upper_zero_kernel(
    x_ptr, bias_ptr, y_ptr, n_tiles, n_channel_blocks, n_channels, n_stored, height, n_cols,
    x_sb, x_sc, x_sh, x_sw, y_sb, y_sc, y_sh, y_sw,
    HAS_BIAS: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    COL_TILES: tl.constexpr,
):
    """``y = x (+ bias[c])`` with the columns past each row's position ``h`` zeroed, from any
    layout into any layout (the forward's channels-last convolution output into the NCHW output,
    the incoming gradient into channels-last for the convolution's gradients); the channels
    ``n_channels <= c < n_stored`` are written as zeros."""
    pid = tl.program_id(0)
    col_offsets = tl.arange(0, BLOCK_COLS)
    for tile in tl.range(pid, n_tiles, tl.num_programs(0)):
        b, pos, channels, row_mask, store_mask = _tile_rows(
            tile, n_channel_blocks, height, n_channels, n_stored, BLOCK_ROWS)
        x_rows = _rows(x_ptr, b, pos, channels, x_sb, x_sc, x_sh)
        y_rows = _rows(y_ptr, b, pos, channels, y_sb, y_sc, y_sh)
        if HAS_BIAS:
            shift = tl.load(bias_ptr + channels, mask=row_mask, other=0.0).to(tl.float32)
        for col_tile in range(COL_TILES):
            cols = col_tile * BLOCK_COLS + col_offsets
            keep = row_mask[:, None] & (cols[None, :] <= pos) & (cols < n_cols)[None, :]
            x = tl.load(x_rows + cols[None, :] * x_sw, mask=keep, other=0.0)
            if HAS_BIAS:
                x = tl.where(keep, x.to(tl.float32) + shift[:, None], 0.0)
            tl.store(y_rows + cols[None, :] * y_sw, x.to(y_ptr.dtype.element_ty),
                     mask=store_mask[:, None] & (cols < n_cols)[None, :])


# --------------------------------------------------------------------------------------- launchers

# Device types whose convolutions may run on channels-last tensors: cuDNN's convolutions are NHWC
# kernels, which convert NCHW operands on every call (measured on an H200 for (1, 32, 1024, 1024)
# bf16: 9 layout conversions, 418 of 1184 us a step). The CPU's oneDNN takes either layout (not
# timed): the CPU is listed so that CI's interpreter runs take the layout GPUs take. Elsewhere
# (torch_npu's convolutions are not measured) the tensors stay NCHW; the kernels take any strides.
CHANNELS_LAST_DEVICES = ("cuda", "cpu")
# Channels (per group, in and out) a multiple of this: cuDNN's NHWC tensor-core kernels take them as
# they are; other counts cuDNN pads on every call (an H200, 3 x 3 bf16 convolution forward +
# backward at L 1024, NCHW / channels-last time: 8 channels 2.99, 16 1.68, 24 1.62, 32 1.70, 48
# 1.74, 64 2.00; 28 channels 0.92 and 12 0.88, where cuDNN pads; 4 channels 1.02). Onca pads
# instead, inside passes it makes anyway: with one group, the probabilities get zero channels up to
# the multiple (written by the softmax kernel, as is the masked gradient's padding by the mask
# kernel) and the weight zero rows and columns, where the padded convolution's work is at most
# CHANNELS_LAST_MAX_PADDING times the unpadded one's (28 channels: 32 x 32 / 28 x 28 = 1.31; the
# 32-channel convolution timed 0.573 ms against 28 channels' NCHW 1.132 above). Otherwise NCHW.
CHANNELS_LAST_MULTIPLE = 8
CHANNELS_LAST_MAX_PADDING = 2.0
# Rows (channels) per tile on a GPU when a channels-last tensor is read or written: 16 bf16 channels
# are one 32-byte sector.
CHANNELS_LAST_GPU_ROWS = 16


def _round_up(n: int, multiple: int) -> int:
    return cdiv(n, multiple) * multiple


def conv_layout(device: torch.device, weight_shape, groups: int) -> tuple[torch.memory_format, int, int]:
    """``(memory format, C_in, C_out)`` of the convolution's operands, the channel counts padded
    where CHANNELS_LAST_MULTIPLE says, for a weight of ``weight_shape`` ``(C_out, C_in // groups, kH,
    kW)`` on ``device``: channels-last on CHANNELS_LAST_DEVICES when the channels per group are
    multiples of CHANNELS_LAST_MULTIPLE or, with one group, once padded to them at a cost of at most
    CHANNELS_LAST_MAX_PADDING; else NCHW, unpadded."""
    c_out, c_in_group = int(weight_shape[0]), int(weight_shape[1])
    c_in, nchw = c_in_group * groups, (torch.contiguous_format, c_in_group * groups, c_out)
    if device.type not in CHANNELS_LAST_DEVICES:
        return nchw
    if c_in_group % CHANNELS_LAST_MULTIPLE == 0 and (c_out // groups) % CHANNELS_LAST_MULTIPLE == 0:
        return torch.channels_last, c_in, c_out
    padded_in, padded_out = _round_up(c_in, CHANNELS_LAST_MULTIPLE), _round_up(c_out, CHANNELS_LAST_MULTIPLE)
    if groups == 1 and padded_in * padded_out <= CHANNELS_LAST_MAX_PADDING * c_in * c_out:
        return torch.channels_last, padded_in, padded_out
    return nchw


def _padded_weight(weight: Tensor, layout: torch.memory_format, c_in: int, c_out: int) -> Tensor:
    """``weight`` in ``layout``, with zero output rows and input columns up to ``c_out``, ``c_in``."""
    if tuple(weight.shape[:2]) == (c_out, c_in):
        return weight.contiguous(memory_format=layout)
    padded = weight.new_zeros((c_out, c_in, *weight.shape[2:])).contiguous(memory_format=layout)
    padded[: weight.shape[0], : weight.shape[1]] = weight
    return padded


def _pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def _row_plan(shape, dtype: torch.dtype, tiles: dict, profile: DeviceProfile | None = None,
              channels_last: bool = True) -> RowPlan:
    """The plan of a row kernel over a 4-D ``shape`` ``(B, C, H, W)``: its rows ``(b, c, h)`` in tiles
    of channels of one ``(batch, row)`` pair (no more than the channels, rounded up to a power of two;
    at least CHANNELS_LAST_GPU_ROWS of them on a GPU where a channels-last tensor is read or written)."""
    return _cached_row_plan(tuple(int(s) for s in shape), dtype, tuple(sorted(tiles.items())),
                            profile or get_profile(), channels_last)


@functools.lru_cache(maxsize=1024)
def _cached_row_plan(shape: tuple, dtype: torch.dtype, tiles: tuple, profile: DeviceProfile,
                     channels_last: bool) -> RowPlan:
    # Cached: the launchers ask on every call, and planning costs tens of microseconds of host time.
    batch, channels, height, width = shape
    return plan_rows(batch * channels * height, width, dtype, profile=profile, **dict(tiles),
                     max_block_rows=_pow2(channels),
                     min_gpu_rows=min(CHANNELS_LAST_GPU_ROWS, _pow2(channels)) if channels_last else None)


def plan(shape, dtype: torch.dtype, profile: DeviceProfile | None = None) -> dict[str, RowPlan]:
    """The row kernels' plans for ``scores`` of ``shape`` ``(B, C_in, L, L)`` on channels-last
    convolutions (the output mask's plan is that of an output of the same shape)."""
    return {
        "activation_forward": _row_plan(shape, dtype, FORWARD_TILES, profile),
        "activation_backward": _row_plan(shape, dtype, BACKWARD_TILES, profile),
        "output_mask": _row_plan(shape, dtype, OUTPUT_MASK_TILES, profile),
    }


def _launch(kernel, tiles, tensors, *pointers, **constexprs) -> None:
    """``kernel`` over the rows of ``tensors`` (4-D, each passed with its four strides after the
    ``pointers``, which are tensors): the first's channels are read, the last's written, its channels
    past the first's as zeros. Everything but the pointers is kept per layout
    (:func:`onca.ops._launch.launch_config`): deriving the plan, the grid and the strides again, and
    keying twenty scalar arguments, cost more host time than the launch at host-bound sizes."""
    key = (kernel, get_profile(), tuple(constexprs.items()),
           *[(t.dtype, t.shape, t.stride()) for t in tensors])
    grid, scalars, kwargs, scalars_key = launch_config(
        key, lambda: _launch_config(tiles, tensors, constexprs))
    if grid is not None:  # None: no rows, never a zero-size grid
        kernel.launch_prepared(grid, pointers, scalars, kwargs, scalars_key)


def _launch_config(tiles, tensors, constexprs) -> tuple:
    """``(grid, scalar arguments, keyword constexprs, their prepared key)`` of :func:`_launch`."""
    batch, channels, height, width = tensors[0].shape
    stored = tensors[-1].shape[1]
    if batch * stored * height * width == 0:
        return None, (), {}, None
    channels_last = any(t.stride(1) == 1 and t.shape[1] > 1 for t in tensors)
    p = _row_plan((batch, stored, height, width), tensors[0].dtype, tiles, channels_last=channels_last)
    n_channel_blocks = cdiv(stored, p.block_rows)
    n_tiles = batch * height * n_channel_blocks
    read = min(channels, stored)  # the channels read: those stored that the first tensor has
    scalars = (n_tiles, n_channel_blocks, read, stored, height, width,
               *[s for t in tensors for s in t.stride()])
    kwargs = dict(BLOCK_ROWS=p.block_rows, BLOCK_COLS=p.block_cols, COL_TILES=p.col_tiles,
                  num_warps=p.num_warps, **constexprs)
    return (min(p.grid, n_tiles),), scalars, kwargs, prepared_key(scalars, kwargs)


def _upper_zero(x: Tensor, out: Tensor, bias: Tensor | None = None) -> None:
    """``out = x (+ bias)`` with the positions above each matrix's diagonal zeroed (4-D; ``x``'s
    channels past ``out``'s are not read, ``out``'s past ``x``'s are zeroed)."""
    _launch(_upper_zero_kernel, OUTPUT_MASK_TILES, (x, out), x,
            bias if bias is not None else x, out, HAS_BIAS=bias is not None)


def _conv_args(stride, padding, dilation, groups) -> dict:
    return dict(stride=list(stride), padding=list(padding), dilation=list(dilation), groups=groups)


def _probs_like(scores: Tensor, layout: torch.memory_format, c_in: int) -> Tensor:
    """The probabilities' buffer: ``scores``' shape with the convolution's (padded) input channels
    ``c_in``, in its ``layout`` (:func:`conv_layout`)."""
    shape = (scores.shape[0], c_in, *scores.shape[2:])
    return torch.empty(shape, dtype=scores.dtype, device=scores.device, memory_format=layout)


@custom_op("multi_token_attention_forward")
def multi_token_attention_forward(scores: Tensor, weight: Tensor, bias: Tensor | None, stride: list[int],
                                  padding: list[int], dilation: list[int], groups: int,
                                  sparse: bool) -> tuple[Tensor, Tensor]:
    """``(out, probs)`` for 4-D ``scores`` ``(B, C_in, L, L)``: the causal softmax / sparsemax
    ``probs`` (``scores``' dtype, in :func:`conv_layout`'s layout and channels, the padding zero)
    and the masked convolution ``out`` (contiguous), the bias added by the mask's kernel."""
    layout, c_in, c_out = conv_layout(scores.device, weight.shape, groups)
    probs = _probs_like(scores, layout, c_in)
    _launch(_causal_activation_forward_kernel, FORWARD_TILES, (scores, probs), scores, probs,
            SPARSE=sparse, BISECTIONS=SPARSEMAX_BISECTIONS)
    conv = _conv_args(stride, padding, dilation, groups)
    conv_out = F.conv2d(probs, _padded_weight(weight, layout, c_in // groups, c_out), None, **conv)
    out = torch.empty((conv_out.shape[0], weight.shape[0], *conv_out.shape[2:]), dtype=conv_out.dtype,
                      device=conv_out.device)
    _upper_zero(conv_out, out, bias)
    return out, probs


@multi_token_attention_forward.register_fake
def _(scores, weight, bias, stride, padding, dilation, groups, sparse):
    out = F.conv2d(scores, weight, bias, **_conv_args(stride, padding, dilation, groups))
    layout, c_in, _ = conv_layout(scores.device, weight.shape, groups)
    probs = _probs_like(scores, layout, c_in)
    return torch.empty_like(out, memory_format=torch.contiguous_format), probs


@custom_op("multi_token_attention_backward")
def multi_token_attention_backward(grad_out: Tensor, probs: Tensor, weight: Tensor, stride: list[int],
                                   padding: list[int], dilation: list[int], groups: int, sparse: bool,
                                   has_bias: bool) -> tuple[Tensor, Tensor, Tensor]:
    """``(dscores, dweight, dbias)``; ``dbias`` empty without a bias. The masked incoming gradient is
    written in the probabilities' layout and (padded) channels, and both convolution gradients come
    from one call."""
    conv = _conv_args(stride, padding, dilation, groups)
    layout, c_in, c_out = conv_layout(probs.device, weight.shape, groups)
    grad_conv = torch.empty((grad_out.shape[0], c_out, *grad_out.shape[2:]), dtype=grad_out.dtype,
                            device=grad_out.device, memory_format=layout)
    _upper_zero(grad_out, grad_conv)
    grad_probs, grad_weight, grad_bias = torch.ops.aten.convolution_backward(
        grad_conv, probs, _padded_weight(weight, layout, c_in // groups, c_out),
        [c_out] if has_bias else None,
        conv["stride"], conv["padding"], conv["dilation"], False, [0, 0], groups, [True, True, has_bias])
    grad_scores = torch.empty(_scores_shape(probs, weight, groups), dtype=probs.dtype, device=probs.device)
    _launch(_causal_activation_backward_kernel, BACKWARD_TILES, (grad_probs, probs, grad_scores),
            grad_probs, probs, grad_scores, SPARSE=sparse)
    c_out_real, c_in_group = weight.shape[:2]
    return (grad_scores, grad_weight[:c_out_real, :c_in_group].contiguous(),
            grad_bias[:c_out_real] if has_bias else probs.new_empty(0))


def _scores_shape(probs: Tensor, weight: Tensor, groups: int) -> tuple[int, ...]:
    """The scores' shape: the probabilities' without the convolution's channel padding."""
    return (probs.shape[0], weight.shape[1] * groups, *probs.shape[2:])


@multi_token_attention_backward.register_fake
def _(grad_out, probs, weight, stride, padding, dilation, groups, sparse, has_bias):
    return (probs.new_empty(_scores_shape(probs, weight, groups)),
            torch.empty_like(weight, memory_format=torch.contiguous_format),
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


def _largest_tensor(scores: Tensor, weight: Tensor, stride, padding, dilation) -> int:
    """Elements of the larger of ``scores`` and the convolution's output."""
    b, c_in, length, _ = scores.shape
    c_out, _, *kernel = weight.shape
    out = [(length + 2 * p - d * (k - 1) - 1) // s + 1
           for s, p, d, k in zip(stride, padding, dilation, kernel)]
    return max(scores.numel(), b * c_out * max(out[0], 0) * max(out[1], 0))


def _later_keys(length: int, device: torch.device) -> Tensor:
    """``(length, length)`` bool, True where the key comes after the query: made once per length
    and device (:func:`onca.ops._small_calls.kept`), two kernels a call less."""
    return small_calls.kept(("mta_later_keys", length, device),
                            lambda: torch.ones(length, length, dtype=torch.bool, device=device).triu_(1))


def _torch_route(scores: Tensor, weight: Tensor, bias: Tensor | None, stride, padding, dilation,
                 groups: int) -> Tensor:
    """A small softmax call by torch's ops (:mod:`onca.ops._small_calls`): the masked softmax, the
    NCHW convolution and ``tril`` for the output mask, autograd for the gradients."""
    later = _later_keys(scores.shape[-1], scores.device)
    probs = torch.softmax(scores.masked_fill(later, float("-inf")), dim=-1)
    return F.conv2d(probs, weight, bias, stride, padding, dilation, groups).tril()


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
    largest = _largest_tensor(scores, weight, stride, padding, dilation)
    if not sparse and small_calls.small(largest * SMALL_CALL_WEIGHT, scores):
        return _torch_route(scores, weight, bias, stride, padding, dilation, groups)
    out, _ = multi_token_attention_forward(scores, weight.contiguous(), None if bias is None else bias.contiguous(),
                                           stride, padding, dilation, groups, sparse)
    return out
