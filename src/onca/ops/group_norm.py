"""GroupNorm: ``torch.nn.functional.group_norm(x, num_groups, weight, bias, eps)`` for ``x`` of
shape ``(batch, channels, *spatial)``: each sample's channels split into ``num_groups`` groups, each
group normalised over its channels and spatial positions (biased variance), then a per-channel
affine transform. Statistics and the affine transform in fp32, one rounding to ``x``'s dtype.

The kernels see ``x`` as ``batch * channels`` channel rows of ``spatial`` elements; a group is
``channels / num_groups`` consecutive channel rows. One program takes one group at a time (a
persistent grid loops over the groups) in tiles of ``BLOCK_ROWS`` channels by ``BLOCK_COLS``
positions, planned by ``onca.tiling.plan_rows``. When the whole group fits one tile it stays in
registers (one read of ``x``); otherwise the statistics are accumulated tile by tile (sums of the
group shifted by its first element, so that a large mean does not cancel the variance) and a second
pass applies them. The backward, where there are too few groups to fill the device (at most half
the plan's programs), splits each group into slices of whole channel blocks, one program per
slice: a first launch stores every slice's sums, a second combines its group's (in slice order)
and computes the slice's ``dx``. The forward, split the same way, measured slower at most of
those shapes, and stays whole.

Saved for backward: ``x``, ``weight``, ``bias`` (for its gradient's dtype only) and one fp32
``mean`` and ``rstd`` per group. With ``xhat = (x - mean) * rstd`` and ``g = weight[channel] * dy``,
``dx = (g - xhat * mean(g * xhat) - mean(g)) * rstd`` over the group, ``dweight[c] = sum dy * xhat``
and ``dbias[c] = sum dy`` over the batch and positions. Each program stores its groups' per-channel
sums, one fp32 value per (sample, channel), and the batch is summed once at the end in a fixed
order (``onca.ops._partials.sum_partials``): deterministic, no atomics.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from onca.device import DeviceProfile, get_profile
from onca.ops import _small_calls as small_calls
from onca.ops._contract import custom_op, register_autograd
from onca.ops._launch import fast_launch, launch_config
from onca.ops._partials import fill_wanted, sum_partials
from onca.ops._validate import check_float, check_number, check_same_device
from onca.tiling import RowPlan, cdiv, next_power_of_2, plan_rows

__all__ = ["group_norm", "plan"]

# Live tiles of each kernel, counted as the planner expects: tiles in the input dtype, fp32 tiles.
FORWARD_TILES = dict(live_tiles=2, fp32_tiles=3)  # x, y; x, x - shift, y in fp32
BACKWARD_TILES = dict(live_tiles=3, fp32_tiles=7)  # x, dy, dx; x, dy, xhat, g, dx, dW and dB sums in fp32


# ----------------------------------------------------------------------------------------- kernels


@triton.jit
def _tile(ptr, group_base, ch, pos, n_ch, n_pos):
    """The fp32 tile of channels ``ch`` (of the group) by positions ``pos``, and its mask."""
    mask = (ch < n_ch)[:, None] & (pos < n_pos)[None, :]
    offsets = group_base + ch.to(tl.int64)[:, None] * n_pos + pos[None, :]
    return tl.load(ptr + offsets, mask=mask, other=0.0).to(tl.float32), offsets, mask


@triton.jit
def _channel_params(w_ptr, b_ptr, channels, ch_mask, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr):
    if HAS_WEIGHT:
        w = tl.load(w_ptr + channels, mask=ch_mask, other=0.0).to(tl.float32)
    else:
        w = tl.full(channels.shape, 1.0, tl.float32)
    if HAS_BIAS:
        b = tl.load(b_ptr + channels, mask=ch_mask, other=0.0).to(tl.float32)
    else:
        b = tl.zeros(channels.shape, tl.float32)
    return w, b


@triton.jit
def _slice_sums(part_ptr, group, slices, SLICES_P2: tl.constexpr):
    """The sums of the two fp32 values every slice of ``group`` stored in ``part``, in slice order."""
    s = tl.arange(0, SLICES_P2)
    at = part_ptr + (tl.cast(group, tl.int64) * slices + s) * 2
    first = tl.sum(tl.load(at, mask=s < slices, other=0.0), axis=0)
    second = tl.sum(tl.load(at + 1, mask=s < slices, other=0.0), axis=0)
    return first, second


@fast_launch
@triton.jit
def _group_norm_forward_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, mean_ptr, rstd_ptr,
    n_groups, num_groups, ch_per_group, n_pos, eps,
    HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    CH_BLOCKS: tl.constexpr,
    COL_TILES: tl.constexpr,
):
    pid = tl.program_id(0)
    ch_offsets = tl.arange(0, BLOCK_ROWS)
    pos_offsets = tl.arange(0, BLOCK_COLS)
    n = ch_per_group * n_pos
    for group in tl.range(pid, n_groups, tl.num_programs(0)):
        group_base = tl.cast(group, tl.int64) * n
        first_channel = (group % num_groups) * ch_per_group
        if CH_BLOCKS * COL_TILES == 1:
            # The whole group in registers: exact two-step variance, one read.
            x, offsets, mask = _tile(x_ptr, group_base, ch_offsets, pos_offsets, ch_per_group, n_pos)
            mean = tl.sum(tl.sum(x, axis=1), axis=0) / n
            xc = tl.where(mask, x - mean, 0.0)
            rstd = tl.rsqrt(tl.sum(tl.sum(xc * xc, axis=1), axis=0) / n + eps)
            w, b = _channel_params(w_ptr, b_ptr, first_channel + ch_offsets, ch_offsets < ch_per_group,
                                   HAS_WEIGHT, HAS_BIAS)
            y = xc * rstd * w[:, None] + b[:, None]
            tl.store(y_ptr + offsets, y.to(y_ptr.dtype.element_ty), mask=mask)
        else:
            shift = tl.load(x_ptr + group_base).to(tl.float32)
            total = tl.zeros([BLOCK_ROWS], dtype=tl.float32)
            total_sq = tl.zeros([BLOCK_ROWS], dtype=tl.float32)
            for cb in range(CH_BLOCKS):
                ch = cb * BLOCK_ROWS + ch_offsets
                for tile in range(COL_TILES):
                    x, offsets, mask = _tile(x_ptr, group_base, ch, tile * BLOCK_COLS + pos_offsets,
                                             ch_per_group, n_pos)
                    xs = tl.where(mask, x - shift, 0.0)
                    total += tl.sum(xs, axis=1)
                    total_sq += tl.sum(xs * xs, axis=1)
            shifted_mean = tl.sum(total, axis=0) / n
            var = tl.maximum(tl.sum(total_sq, axis=0) / n - shifted_mean * shifted_mean, 0.0)
            mean = shifted_mean + shift
            rstd = tl.rsqrt(var + eps)
            for cb in range(CH_BLOCKS):
                ch = cb * BLOCK_ROWS + ch_offsets
                w, b = _channel_params(w_ptr, b_ptr, first_channel + ch, ch < ch_per_group, HAS_WEIGHT, HAS_BIAS)
                for tile in range(COL_TILES):
                    x, offsets, mask = _tile(x_ptr, group_base, ch, tile * BLOCK_COLS + pos_offsets,
                                             ch_per_group, n_pos)
                    y = (x - mean) * rstd * w[:, None] + b[:, None]
                    tl.store(y_ptr + offsets, y.to(y_ptr.dtype.element_ty), mask=mask)
        tl.store(mean_ptr + group, mean)
        tl.store(rstd_ptr + group, rstd)


@fast_launch
@triton.jit
def _group_norm_backward_kernel(
    dy_ptr, x_ptr, w_ptr, mean_ptr, rstd_ptr, dx_ptr, dw_ptr, db_ptr, part_ptr,
    n_groups, num_groups, ch_per_group, n_pos, slices,
    HAS_WEIGHT: tl.constexpr,
    COMPUTE_DW: tl.constexpr,
    COMPUTE_DB: tl.constexpr,
    PHASE: tl.constexpr,
    SLICES_P2: tl.constexpr,
    SLICE_BLOCKS: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    COL_TILES: tl.constexpr,
):
    """Program loops over units ``(group, slice)``: a slice is ``SLICE_BLOCKS`` channel blocks of
    its group. ``PHASE`` 0: both passes of each group (one slice per group). A group split in
    ``slices`` takes two launches: ``PHASE`` 1 stores a slice's channels' dW, dB sums and its share
    of the group's two sums (into ``part``), ``PHASE`` 2 computes a slice's ``dx`` from its group's."""
    # dw_ptr / db_ptr: fp32 (batch * channels) per-(sample, channel) sums of dy * xhat and dy.
    pid = tl.program_id(0)
    ch_offsets = tl.arange(0, BLOCK_ROWS)
    pos_offsets = tl.arange(0, BLOCK_COLS)
    n = ch_per_group * n_pos
    for unit in tl.range(pid, n_groups * slices, tl.num_programs(0)):
        group = unit // slices
        first_block = (unit % slices) * SLICE_BLOCKS
        group_base = tl.cast(group, tl.int64) * n
        first_channel = (group % num_groups) * ch_per_group
        # This group's channels among all (sample, channel) rows: group * ch_per_group + ch.
        sums_base = tl.cast(group, tl.int64) * ch_per_group
        mean = tl.load(mean_ptr + group)
        rstd = tl.load(rstd_ptr + group)
        if PHASE == 2:
            total_gx, total_g = _slice_sums(part_ptr, group, slices, SLICES_P2)
        else:
            # Pass 1: the sums of g * xhat and g over the slice; the per-channel dW, dB sums.
            sum_gx = tl.zeros([BLOCK_ROWS], dtype=tl.float32)
            sum_g = tl.zeros([BLOCK_ROWS], dtype=tl.float32)
            for i in range(SLICE_BLOCKS):
                ch = (first_block + i) * BLOCK_ROWS + ch_offsets
                ch_mask = ch < ch_per_group
                w, _b = _channel_params(w_ptr, w_ptr, first_channel + ch, ch_mask, HAS_WEIGHT, False)
                # Tile-shaped sums, reduced once after the loop: a row sum carried through the loop
                # and used twice below made Triton 3.6's OptimizeThreadLocality pass abort (sm_90,
                # column tiles).
                dw_tiles = tl.zeros([BLOCK_ROWS, BLOCK_COLS], dtype=tl.float32)
                db_tiles = tl.zeros([BLOCK_ROWS, BLOCK_COLS], dtype=tl.float32)
                for tile in range(COL_TILES):
                    pos = tile * BLOCK_COLS + pos_offsets
                    x, offsets, mask = _tile(x_ptr, group_base, ch, pos, ch_per_group, n_pos)
                    dy = tl.load(dy_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
                    xhat = (x - mean) * rstd
                    dw_tiles += dy * xhat
                    db_tiles += dy
                dw_acc = tl.sum(dw_tiles, axis=1)
                db_acc = tl.sum(db_tiles, axis=1)
                # g = w * dy: its sums are the channels' sums times w.
                sum_gx += dw_acc * w
                sum_g += db_acc * w
                if COMPUTE_DW:
                    tl.store(dw_ptr + sums_base + ch, dw_acc, mask=ch_mask)
                if COMPUTE_DB:
                    tl.store(db_ptr + sums_base + ch, db_acc, mask=ch_mask)
            total_gx = tl.sum(sum_gx, axis=0)
            total_g = tl.sum(sum_g, axis=0)
        if PHASE == 1:
            tl.store(part_ptr + tl.cast(unit, tl.int64) * 2, total_gx)
            tl.store(part_ptr + tl.cast(unit, tl.int64) * 2 + 1, total_g)
        else:
            c1 = total_gx / n
            c2 = total_g / n
            # Pass 2: dx (the tiles are reloaded: mostly cache hits for a slice that fits on chip).
            for i in range(SLICE_BLOCKS):
                ch = (first_block + i) * BLOCK_ROWS + ch_offsets
                w, _b = _channel_params(w_ptr, w_ptr, first_channel + ch, ch < ch_per_group, HAS_WEIGHT,
                                        False)
                for tile in range(COL_TILES):
                    pos = tile * BLOCK_COLS + pos_offsets
                    x, offsets, mask = _tile(x_ptr, group_base, ch, pos, ch_per_group, n_pos)
                    dy = tl.load(dy_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
                    xhat = (x - mean) * rstd
                    dx = (dy * w[:, None] - (xhat * c1 + c2)) * rstd
                    tl.store(dx_ptr + offsets, dx.to(dx_ptr.dtype.element_ty), mask=mask)


# --------------------------------------------------------------------------------------- launchers


def _plan(n_groups: int, ch_per_group: int, n_pos: int, dtype, tiles: dict, profile=None) -> RowPlan:
    """Tiles of up to a group's channels by positions; the grid is the plan's, at most one
    program per group."""
    return plan_rows(n_groups * ch_per_group, n_pos, dtype, profile=profile, persistent=True,
                     max_block_rows=next_power_of_2(ch_per_group), **tiles)


def _dims(shape, num_groups: int) -> tuple[int, int, int]:
    """``(groups in all, channels per group, positions)`` of an input of ``shape``."""
    batch, channels = shape[0], shape[1]
    return batch * num_groups, channels // num_groups, math.prod(shape[2:])


def plan(shape, dtype: torch.dtype, profile: DeviceProfile | None = None, *,
         num_groups: int = 32) -> dict[str, RowPlan]:
    """The forward and backward plans for an input of ``shape`` (``(batch, channels, *spatial)``)."""
    n_groups, ch_per_group, n_pos = _dims(shape, num_groups)
    return {
        "forward": _plan(n_groups, ch_per_group, n_pos, dtype, FORWARD_TILES, profile),
        "backward": _plan(n_groups, ch_per_group, n_pos, dtype, BACKWARD_TILES, profile),
    }


# At most this many slices per group (a power of two: the slices' sums are one tile).
MAX_SLICES = 64
# A group of fewer elements stays whole: splitting it saves less device time than its second launch
# costs on the host (the smallest group measured to gain, 64 channels x 1024 positions, saved 3 us;
# the overhead sweep's 2 x 256 positions split only added a launch).
MIN_SPLIT_ELEMENTS = 1 << 16


def _slices(p: RowPlan, n_groups: int, ch_per_group: int) -> tuple[int, int]:
    """``(slices per group, channel blocks per slice)`` of the backward. A group of several channel
    blocks is split into slices of whole blocks, as many as it has (up to ``MAX_SLICES``), where the
    groups would leave at least half the plan's programs idle: one program per group walked its
    group alone (128 groups of 4 x 168 x 1024 on a 264-program grid), and the group holds at least
    ``MIN_SPLIT_ELEMENTS``. Split, the group's sums take a second launch. Measured on an H200
    (bf16, batch 4, 1024 positions, 32 groups, CUDA graphs), the backward (forward + backward less
    forward) split against whole: 5376 channels 0.068 against 0.075 ms, 8192 0.098 against 0.111,
    4096 0.055 against 0.060, 2048 0.027 against 0.030; the forward split was slower at 2048-8192
    channels (4096: 0.051 against 0.045 ms), faster at 5376 only, and stays whole."""
    ch_blocks = cdiv(ch_per_group, p.block_rows)
    if ch_blocks == 1 or 2 * n_groups > p.grid or ch_per_group * p.cols < MIN_SPLIT_ELEMENTS:
        return 1, ch_blocks
    per_slice = cdiv(ch_blocks, min(ch_blocks, MAX_SLICES))
    return cdiv(ch_blocks, per_slice), per_slice


def _launch_args(p: RowPlan, units: int) -> tuple[tuple, dict]:
    """``(grid, constexprs)`` of a launch over ``units`` groups (or slices of groups) planned by ``p``."""
    return (min(p.grid, units),), {"BLOCK_ROWS": p.block_rows, "BLOCK_COLS": p.block_cols,
                                   "COL_TILES": p.col_tiles, "num_warps": p.num_warps}


def _forward_launch(n_groups: int, ch_per_group: int, n_pos: int, dtype) -> tuple[tuple, dict]:
    """The forward's ``(grid, constexprs)``, kept per shape, dtype and profile (``launch_config``):
    planning them again cost more host time per call than the launch at the sizes the host decides."""
    def make():
        p = _plan(n_groups, ch_per_group, n_pos, dtype, FORWARD_TILES)
        grid, constexprs = _launch_args(p, n_groups)
        constexprs["CH_BLOCKS"] = cdiv(ch_per_group, p.block_rows)
        return grid, constexprs

    return launch_config(("group_norm_forward", n_groups, ch_per_group, n_pos, dtype, get_profile()), make)


def _backward_launch(n_groups: int, ch_per_group: int, n_pos: int, dtype) -> tuple[tuple, dict, int]:
    """The backward's ``(grid, constexprs, slices per group)``, kept as the forward's."""
    def make():
        p = _plan(n_groups, ch_per_group, n_pos, dtype, BACKWARD_TILES)
        slices, per_slice = _slices(p, n_groups, ch_per_group)
        grid, constexprs = _launch_args(p, n_groups * slices)
        constexprs.update(SLICES_P2=next_power_of_2(slices), SLICE_BLOCKS=per_slice)
        return grid, constexprs, slices

    return launch_config(("group_norm_backward", n_groups, ch_per_group, n_pos, dtype, get_profile()), make)


def _slice_sums_buffer(n_groups: int, slices: int, stand_in: Tensor) -> Tensor:
    """Two fp32 sums per slice; ``stand_in`` (an fp32 tensor, never read) where groups are whole."""
    if slices == 1:
        return stand_in
    return torch.empty((n_groups * slices * 2,), dtype=torch.float32, device=stand_in.device)


def _phases(slices: int) -> tuple[int, ...]:
    """The launches' phases: one whole pass, or the slices' sums then what they give."""
    return (0,) if slices == 1 else (1, 2)


@custom_op("group_norm_forward")
def group_norm_forward(x: Tensor, weight: Tensor | None, bias: Tensor | None, num_groups: int,
                       eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """``(y, mean, rstd)`` for the contiguous ``x`` ``(batch, channels, *spatial)``; ``mean`` and
    ``rstd`` are fp32 ``(batch, num_groups)``."""
    n_groups, ch_per_group, n_pos = _dims(x.shape, num_groups)
    y = torch.empty_like(x)
    mean = torch.empty((x.shape[0], num_groups), dtype=torch.float32, device=x.device)
    rstd = torch.empty_like(mean)
    if x.numel() == 0:
        return y, mean.zero_(), rstd.zero_()
    grid, constexprs = _forward_launch(n_groups, ch_per_group, n_pos, x.dtype)
    _group_norm_forward_kernel[grid](
        x, x if weight is None else weight, x if bias is None else bias, y, mean, rstd,
        n_groups, num_groups, ch_per_group, n_pos, eps,
        HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None, **constexprs,
    )
    return y, mean, rstd


@group_norm_forward.register_fake
def _(x, weight, bias, num_groups, eps):
    mean = x.new_empty((x.shape[0], num_groups), dtype=torch.float32)
    return torch.empty_like(x), mean, torch.empty_like(mean)


@custom_op("group_norm_backward")
def group_norm_backward(dy: Tensor, x: Tensor, weight: Tensor | None, bias: Tensor | None, mean: Tensor,
                        rstd: Tensor, num_groups: int, compute_dw: bool,
                        compute_db: bool) -> tuple[Tensor, Tensor, Tensor]:
    """``(dx, dweight, dbias)``; a parameter gradient not computed is empty. ``bias`` is read for
    its dtype only."""
    batch, channels = x.shape[0], x.shape[1]
    n_groups, ch_per_group, n_pos = _dims(x.shape, num_groups)
    dx = torch.empty_like(x)
    empty = x.new_empty(0)
    if x.numel() == 0:
        dw = torch.zeros_like(weight) if compute_dw else empty
        db = torch.zeros_like(bias) if compute_db else empty
        return dx, dw, db
    # One buffer with a plane per computed gradient, summed by one launch.
    wanted = (compute_dw, compute_db)
    computed = [t.dtype for t, need in zip((weight, bias), wanted) if need]
    planes = torch.empty((len(computed), batch, channels), dtype=torch.float32, device=x.device)
    sums = fill_wanted(wanted, planes.unbind(0), rstd)
    grid, constexprs, slices = _backward_launch(n_groups, ch_per_group, n_pos, x.dtype)
    part = _slice_sums_buffer(n_groups, slices, rstd)
    for phase in _phases(slices):
        _group_norm_backward_kernel[grid](
            dy, x, x if weight is None else weight, mean, rstd, dx, *sums, part,
            n_groups, num_groups, ch_per_group, n_pos, slices,
            HAS_WEIGHT=weight is not None, COMPUTE_DW=compute_dw, COMPUTE_DB=compute_db, PHASE=phase,
            **constexprs,
        )
    dw, db = fill_wanted(wanted, sum_partials(planes, computed), empty)
    return dx, dw, db


@group_norm_backward.register_fake
def _(dy, x, weight, bias, mean, rstd, num_groups, compute_dw, compute_db):
    empty = x.new_empty(0)
    return (torch.empty_like(x), torch.empty_like(weight) if compute_dw else empty,
            torch.empty_like(bias) if compute_db else empty)


# ---------------------------------------------------------------------------------------- autograd


def _setup_context(ctx, inputs, output):
    x, weight, bias, num_groups, _eps = inputs
    _y, mean, rstd = output
    ctx.mark_non_differentiable(mean, rstd)
    ctx.save_for_backward(x, weight, bias, mean, rstd)
    ctx.num_groups = num_groups


def _backward(ctx, dy, _dmean, _drstd):
    x, weight, bias, mean, rstd = ctx.saved_tensors
    compute_dw = weight is not None and ctx.needs_input_grad[1]
    compute_db = bias is not None and ctx.needs_input_grad[2]
    dx, dw, db = group_norm_backward(dy.contiguous(), x, weight, bias, mean, rstd, ctx.num_groups, compute_dw,
                                     compute_db)
    return dx, dw if compute_dw else None, db if compute_db else None, None, None


register_autograd(group_norm_forward, _backward, setup_context=_setup_context)


# ------------------------------------------------------------------------------------------ public


def group_norm(x: Tensor, num_groups: int, weight: Tensor | None = None, bias: Tensor | None = None,
               eps: float = 1e-5) -> Tensor:
    """GroupNorm: ``torch.nn.functional.group_norm(x, num_groups, weight, bias, eps)``.

    ``x``: ``(batch, channels, *spatial)`` (at least 2-D), ``channels`` divisible by
    ``num_groups``; each sample's group of ``channels / num_groups`` channels is normalised over
    its channels and positions (biased variance), then scaled and shifted per channel by
    ``weight`` and ``bias`` (``(channels,)``, each optional, possibly fp32 with bf16/fp16 ``x``).
    fp32 statistics and affine transform, one rounding to ``x``'s dtype. liger-kernel's
    ``liger_group_norm(X, affine_scaling_weight, affine_shifting_bias, num_channels, num_groups,
    eps)`` computes the same with both parameters required.
    """
    check_float(x, "x")
    if x.dim() < 2:
        raise ValueError(f"x must have shape (batch, channels, *spatial), got shape {tuple(x.shape)}")
    if isinstance(num_groups, bool) or not isinstance(num_groups, int) or num_groups < 1:
        raise ValueError(f"num_groups must be a positive int, got {num_groups!r}")
    channels = x.shape[1]
    if channels % num_groups:
        raise ValueError(f"x's {channels} channels (dimension 1) must be divisible by num_groups={num_groups}")
    for t, name in ((weight, "weight"), (bias, "bias")):
        if t is None:
            continue
        check_float(t, name)
        if t.dim() != 1 or t.shape[0] != channels:
            raise ValueError(f"{name} must be 1-D of x's channels ({channels},), got shape {tuple(t.shape)}")
        check_same_device(t, name, x, "x")
    check_number(eps, "eps", minimum=0.0)
    if small_calls.same_dtype(x, weight, bias) and small_calls.small(x.numel(), x):
        # torch.nn.functional's op without its Python wrapper: the same ATen call, several us less
        # host time a call, and no refusal of one-element groups (its batch-norm-style size check),
        # which Onca's kernels compute (y = bias; ATen to its rounding).
        return torch.group_norm(x, num_groups, weight, bias, eps, torch.backends.cudnn.enabled)
    y, _, _ = group_norm_forward(x.contiguous(), None if weight is None else weight.contiguous(),
                                 None if bias is None else bias.contiguous(), num_groups, float(eps))
    return y
