"""Modulated RMSNorm (adaptive RMSNorm of diffusion transformers, AdaLN with an RMSNorm):
``y = rms_norm(x, weight) * (1 + scale) + shift`` over the last dimension, in one pass.

The RMSNorm is ``onca.ops.rms_norm``'s (``eps``, ``offset``, ``casting_mode``, optional weight, the
same kernels' helpers); ``scale`` and the optional ``shift`` are modulation rows broadcast over the
tokens, as liger-kernel 0.8.5's ``LigerModulatedRMSNormFunction``: with ``x`` seen as ``N`` rows of
``hidden`` and ``scale`` as ``M`` rows of ``hidden`` (its leading dimensions flattened), ``M``
must divide ``N`` and token row ``i`` uses modulation row ``i // (N // M)``. So ``(hidden,)`` is one
row for every token, ``(B, hidden)`` or ``(B, 1, hidden)`` with ``x`` of ``(B, T, hidden)`` one row
per sequence, and ``x``'s own shape one row per token. ``shift`` has ``scale``'s shape.

Rounding: in the ``llama`` and ``gemma`` modes the normalised row is rounded as RMSNorm rounds it,
and the weight, the modulation and the shift are applied in fp32 with one rounding of ``y`` to
``x``'s dtype (a fused chain is more accurate than the eager one, which rounds after every op). In
the ``none`` mode every step is rounded to ``x``'s dtype, as eager PyTorch in that dtype.

Saved for backward: ``x``, ``weight``, ``scale``, ``shift`` (for its gradient's dtype only) and one
fp32 ``rstd`` per row. With ``r`` the RMSNorm output and ``m = 1 + scale``: ``dscale = dy * r`` and
``dshift = dy``, summed over the tokens that share a modulation row, and the RMSNorm backward runs
on ``dy * m``. The modulation gradients are reduced deterministically without atomics: the
backward's persistent grid gives each program a contiguous range of row blocks (a row block never
straddles two modulation rows); a program sums each modulation row's share in registers and
stores it in its own slot ``program + modulation_row`` of a zeroed fp32 buffer (unique: both
indices only grow along the rows), and a second small kernel sums each modulation row's slots in
order. Per-token modulation (``M == N``) is stored directly. ``dweight`` goes through the shared
partial rows of ``onca.ops._partials``.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from onca.device import DeviceProfile, get_profile
from onca.ops._contract import custom_op, register_autograd
from onca.ops._launch import fast_launch, register_cap
from onca.ops._partials import accumulate_partial, partial_row, partial_rows, rows_per_step, sum_partials
from onca.ops._row_norm import launch_forward
from onca.ops._rows import rows_cols, rows_in_place, rows_ready
from onca.ops._validate import check_float, check_same_device
from onca.ops.rms_norm import (_normalized, _scale, _weight, grad_output_buffer, may_overwrite, validate_options,
                               validate_weight)
from onca.tiling import RowPlan, cdiv, next_power_of_2, plan_rows

__all__ = ["modulated_rms_norm", "plan"]

# Live tiles of each kernel, counted as the planner expects: tiles in the input dtype, fp32 tiles.
# x, w, scale, shift, y; x, scale and y in fp32. A row wider than 8192 takes column tiles of 8192 (the
# planner's whole-budget two-pass GPU tile): H200, bf16, fwd+bwd at 16384 x 16384, CUDA-graph replay,
# 1.695 against 1.772 ms with the one-pass 16384-column tile (110 registers, one program per SM).
FORWARD_TILES = dict(live_tiles=5, fp32_tiles=3, max_block_cols=8192, gpu_whole_two_pass=True)
# x, dy, w, scale, dx; x, dy, n, r, dn, dx and the dW / dscale / dshift column sums in fp32.
BACKWARD_TILES = dict(live_tiles=5, fp32_tiles=8)
# Elements of a backward tile on a GPU at most (GPU_BACKWARD_PROGRAMS a unit). H100, bf16, forward +
# backward with 4 modulation rows, 16384 tokens: 4096-element tiles (4 warps) against the planner's
# 8192-element tiles of 8 warps, device time: hidden 1024 (4 rows a tile) 0.097 against 0.148 ms,
# hidden 4096 (1 row) 0.307 against 0.313; four programs per unit took 0.119 and over 0.33 ms.
# Then 8192 against 4096 (2026-11-28, H100, tools/kernel_variants.py, the benchmark's points,
# wall clock): hidden 1024 0.516 against 0.608 ms, 3072 0.564 against 0.648, 3584 0.510 against
# 0.534, 4096 0.465 against 0.501, 8192 equal (0.669); liger-kernel 0.69-0.86 there. At hidden
# 4096 the 4096-element tile spilled on sm_90 (255 registers, 224 bytes of stack); this one does not.
GPU_BACKWARD_TILE = 8192
# Backward programs a compute unit for those rows (the persistent grid's cap). One: the 8-warp
# tile takes 211-246 registers a thread on sm_90 (onca audit --cuda), so a second program never fit
# beside it and only doubled the partial rows and slots. H200, bf16, forward + backward (CUDA-graph
# replays, tools/kernel_variants.py, the benchmark's points), two programs a unit against one: hidden
# 3072 at 1024 tokens 0.036 -> 0.033 ms and 25.9 -> 22.1 MB peak (liger-kernel 20.2), at 16384
# 0.248 -> 0.241; hidden 4096 0.271 -> 0.262, 5376 0.538 -> 0.525, 8192 0.600 -> 0.585.
GPU_BACKWARD_PROGRAMS = 1
# Wider rows on a GPU: column tiles of at most GPU_WIDE_BACKWARD_COLS, compiled for the registers
# that let GPU_WIDE_BACKWARD_PROGRAMS programs share an SM (maxnreg). H200, bf16, fwd+bwd at 16384 x
# 16384 (CUDA-graph replay): 1.594 against 1.772 ms for the planner's 4096-column tiles (255
# registers and 336 bytes of stack, two programs per SM); the cap alone at hidden 4096 was 4x slower.
GPU_WIDE_BACKWARD_COLS = 4096
GPU_WIDE_BACKWARD_PROGRAMS = 4


# ----------------------------------------------------------------------------------------- kernels


@triton.jit
def _modulation(scale_ptr, mod_rows64, scale_row_stride, cols, mask, CASTING: tl.constexpr,
                X_DTYPE: tl.constexpr):
    """``1 + scale`` of the tile's rows, in fp32 (rounded to ``x``'s dtype in the ``none`` mode)."""
    s = tl.load(scale_ptr + mod_rows64 * scale_row_stride + cols[None, :], mask=mask, other=0.0)
    m = 1.0 + s.to(tl.float32)
    if CASTING == 2:
        m = m.to(X_DTYPE).to(tl.float32)
    return m


@triton.jit
def _rms_output(x, rstd, w, offset, HAS_WEIGHT: tl.constexpr, CASTING: tl.constexpr, X_DTYPE: tl.constexpr):
    """``(n, r)``: the normalised row and the RMSNorm output, as the casting mode rounds them."""
    n = _normalized(x, rstd, CASTING, X_DTYPE)
    r = _scale(n, w, offset, HAS_WEIGHT, CASTING, X_DTYPE)
    if CASTING == 2:
        r = r.to(X_DTYPE).to(tl.float32)
    return n, r


@fast_launch
@triton.jit
def _modulated_rms_norm_forward_kernel(
    x_ptr, w_ptr, scale_ptr, shift_ptr, y_ptr, rstd_ptr,
    n_rows, n_cols, rows_per_mod, x_row_stride, scale_row_stride, shift_row_stride, y_row_stride,
    eps, offset,
    HAS_WEIGHT: tl.constexpr,
    HAS_SHIFT: tl.constexpr,
    CASTING: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    COL_TILES: tl.constexpr,
):
    X_DTYPE: tl.constexpr = x_ptr.dtype.element_ty
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    n_row_blocks = tl.cdiv(n_rows, BLOCK_ROWS)
    col_offsets = tl.arange(0, BLOCK_COLS)
    for row_block in tl.range(pid, n_row_blocks, n_programs):
        rows = row_block * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        row_mask = rows < n_rows
        rows64 = rows.to(tl.int64)[:, None]
        mod_rows64 = (rows // rows_per_mod).to(tl.int64)[:, None]
        x_rows = x_ptr + rows64 * x_row_stride
        if COL_TILES == 1:
            mask = row_mask[:, None] & (col_offsets < n_cols)[None, :]
            x = tl.load(x_rows + col_offsets[None, :], mask=mask, other=0.0).to(tl.float32)
            rstd = tl.rsqrt(tl.sum(x * x, axis=1) / n_cols + eps)
        else:
            sum_sq = tl.zeros([BLOCK_ROWS], dtype=tl.float32)
            for tile in range(COL_TILES):
                cols = tile * BLOCK_COLS + col_offsets
                mask = row_mask[:, None] & (cols < n_cols)[None, :]
                x = tl.load(x_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
                sum_sq += tl.sum(x * x, axis=1)
            rstd = tl.rsqrt(sum_sq / n_cols + eps)
        for tile in range(COL_TILES):
            cols = tile * BLOCK_COLS + col_offsets
            col_mask = cols < n_cols
            mask = row_mask[:, None] & col_mask[None, :]
            if COL_TILES > 1:
                x = tl.load(x_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            w = _weight(w_ptr, cols, col_mask, HAS_WEIGHT)
            _n, r = _rms_output(x, rstd, w, offset, HAS_WEIGHT, CASTING, X_DTYPE)
            y = r * _modulation(scale_ptr, mod_rows64, scale_row_stride, cols, mask, CASTING, X_DTYPE)
            if HAS_SHIFT:
                if CASTING == 2:
                    y = y.to(X_DTYPE).to(tl.float32)
                shift = tl.load(shift_ptr + mod_rows64 * shift_row_stride + cols[None, :], mask=mask, other=0.0)
                y += shift.to(tl.float32)
            tl.store(y_ptr + rows64 * y_row_stride + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)
        tl.store(rstd_ptr + rows, rstd, mask=row_mask)


@fast_launch
@triton.jit
def _modulated_rms_norm_backward_kernel(
    dy_ptr, x_ptr, w_ptr, scale_ptr, rstd_ptr, dx_ptr, dscale_ptr, dshift_ptr, dw_partial_ptr, c_ptr,
    n_rows, n_cols, rows_per_mod, blocks_per_program,
    dy_row_stride, x_row_stride, scale_row_stride, dx_row_stride, offset,
    HAS_WEIGHT: tl.constexpr,
    HAS_SHIFT: tl.constexpr,
    PER_ROW: tl.constexpr,
    CASTING: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    COL_TILES: tl.constexpr,
):
    # PER_ROW: dscale and dshift are (n_rows, n_cols) in their parameters' dtypes, stored directly.
    # Otherwise they are fp32 slot buffers, row `program + modulation_row` holding this program's sum.
    X_DTYPE: tl.constexpr = x_ptr.dtype.element_ty
    pid = tl.program_id(0)
    n_row_blocks = tl.cdiv(n_rows, BLOCK_ROWS)
    first_block = pid * blocks_per_program
    last_block = tl.minimum(first_block + blocks_per_program, n_row_blocks)
    has_rows = first_block < last_block
    col_offsets = tl.arange(0, BLOCK_COLS)
    dw_row = partial_row(dw_partial_ptr, n_cols)
    if COL_TILES > 1:
        # Phase 1, row by row: c = mean(dn * n) of each of this program's rows, kept in `c_ptr`.
        for row_block in range(first_block, last_block):
            rows = row_block * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
            row_mask = rows < n_rows
            rows64 = rows.to(tl.int64)[:, None]
            mod_rows64 = (rows // rows_per_mod).to(tl.int64)[:, None]
            rstd = tl.load(rstd_ptr + rows, mask=row_mask, other=0.0)
            dot = tl.zeros([BLOCK_ROWS], dtype=tl.float32)
            for tile in range(COL_TILES):
                cols = tile * BLOCK_COLS + col_offsets
                col_mask = cols < n_cols
                mask = row_mask[:, None] & col_mask[None, :]
                x = tl.load(x_ptr + rows64 * x_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
                dy = tl.load(dy_ptr + rows64 * dy_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
                m = _modulation(scale_ptr, mod_rows64, scale_row_stride, cols, mask, CASTING, X_DTYPE)
                w = _weight(w_ptr, cols, col_mask, HAS_WEIGHT)
                n = _normalized(x, rstd, CASTING, X_DTYPE)
                dot += tl.sum(_scale(dy * m, w, offset, HAS_WEIGHT, CASTING, X_DTYPE) * n, axis=1)
            tl.store(c_ptr + rows, dot / n_cols, mask=row_mask)
        # The rows' c were written by other threads of this program.
        tl.debug_barrier()
    # Column tile by column tile over this program's rows: dx, and the tile's dW and modulation
    # sums in registers.
    for tile in range(COL_TILES):
        cols = tile * BLOCK_COLS + col_offsets
        col_mask = cols < n_cols
        w = _weight(w_ptr, cols, col_mask, HAS_WEIGHT)
        dw_acc = tl.zeros([BLOCK_COLS], dtype=tl.float32)
        ds_acc = tl.zeros([BLOCK_COLS], dtype=tl.float32)
        dsh_acc = tl.zeros([BLOCK_COLS], dtype=tl.float32)
        group = (first_block * BLOCK_ROWS) // rows_per_mod  # the modulation row being summed
        for row_block in range(first_block, last_block):
            rows = row_block * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
            row_mask = rows < n_rows
            rows64 = rows.to(tl.int64)[:, None]
            mod_rows64 = (rows // rows_per_mod).to(tl.int64)[:, None]
            mask = row_mask[:, None] & col_mask[None, :]
            rstd = tl.load(rstd_ptr + rows, mask=row_mask, other=0.0)
            x = tl.load(x_ptr + rows64 * x_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(dy_ptr + rows64 * dy_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            m = _modulation(scale_ptr, mod_rows64, scale_row_stride, cols, mask, CASTING, X_DTYPE)
            n, r = _rms_output(x, rstd, w, offset, HAS_WEIGHT, CASTING, X_DTYPE)
            dr = dy * m
            if HAS_WEIGHT:
                dw_acc += tl.sum(dr * n, axis=0)
            dn = _scale(dr, w, offset, HAS_WEIGHT, CASTING, X_DTYPE)
            if COL_TILES == 1:
                c = tl.sum(dn * n, axis=1) / n_cols
            else:
                c = tl.load(c_ptr + rows, mask=row_mask, other=0.0)
            dx = (dn - n * c[:, None]) * rstd[:, None]
            tl.store(dx_ptr + rows64 * dx_row_stride + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)
            if PER_ROW:
                tl.store(dscale_ptr + rows64 * n_cols + cols[None, :], (dy * r).to(dscale_ptr.dtype.element_ty),
                         mask=mask)
                if HAS_SHIFT:
                    tl.store(dshift_ptr + rows64 * n_cols + cols[None, :], dy.to(dshift_ptr.dtype.element_ty),
                             mask=mask)
            else:
                # A new modulation row: store the finished one's sum in this program's slot for it.
                block_group = (row_block * BLOCK_ROWS) // rows_per_mod
                flush = block_group != group
                slot = (pid + group).to(tl.int64) * n_cols
                tl.store(dscale_ptr + slot + cols, ds_acc, mask=tl.where(flush, col_mask, False))
                ds_acc = tl.where(flush, 0.0, ds_acc) + tl.sum(dy * r, axis=0)
                if HAS_SHIFT:
                    tl.store(dshift_ptr + slot + cols, dsh_acc, mask=tl.where(flush, col_mask, False))
                    dsh_acc = tl.where(flush, 0.0, dsh_acc) + tl.sum(dy, axis=0)
                group = block_group
        if not PER_ROW:
            slot = (pid + group).to(tl.int64) * n_cols
            tl.store(dscale_ptr + slot + cols, ds_acc, mask=tl.where(has_rows, col_mask, False))
            if HAS_SHIFT:
                tl.store(dshift_ptr + slot + cols, dsh_acc, mask=tl.where(has_rows, col_mask, False))
        if HAS_WEIGHT:
            accumulate_partial(dw_row, cols, dw_acc, col_mask, False)


@fast_launch
@triton.jit
def _sum_slots_kernel(
    ds_slots_ptr, dsh_slots_ptr, dscale_ptr, dshift_ptr,
    n_mod_rows, n_slots, n_cols, rows_per_mod, blocks_per_program,
    HAS_SHIFT: tl.constexpr,
    ROW_BLOCK: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    SLOT_ROWS: tl.constexpr,
):
    """``dscale[g]`` (and ``dshift[g]``): the sum of modulation row ``g``'s slots, ``SLOT_ROWS`` of
    them a step (a fixed order: deterministic)."""
    g = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    col_mask = cols < n_cols
    # The first program whose rows reach modulation row g, plus g: its first slot. The slots up to
    # the next row's first slot are g's (or were never written: zero).
    start = (g * rows_per_mod // ROW_BLOCK) // blocks_per_program + g
    end = tl.where(g + 1 < n_mod_rows,
                   ((g + 1) * rows_per_mod // ROW_BLOCK) // blocks_per_program + g + 1, n_slots)
    ds = tl.zeros([SLOT_ROWS, BLOCK_COLS], dtype=tl.float32)
    dsh = tl.zeros([SLOT_ROWS, BLOCK_COLS], dtype=tl.float32)
    for first in range(start, end, SLOT_ROWS):
        slots = first + tl.arange(0, SLOT_ROWS)
        mask = (slots < end)[:, None] & col_mask[None, :]
        at = slots.to(tl.int64)[:, None] * n_cols + cols[None, :]
        ds += tl.load(ds_slots_ptr + at, mask=mask, other=0.0)
        if HAS_SHIFT:
            dsh += tl.load(dsh_slots_ptr + at, mask=mask, other=0.0)
    out = g.to(tl.int64) * n_cols + cols
    tl.store(dscale_ptr + out, tl.sum(ds, axis=0).to(dscale_ptr.dtype.element_ty), mask=col_mask)
    if HAS_SHIFT:
        tl.store(dshift_ptr + out, tl.sum(dsh, axis=0).to(dshift_ptr.dtype.element_ty), mask=col_mask)


# --------------------------------------------------------------------------------------- launchers


# fp32 elements of each of the slot sum's four live tiles (two sums, two loads).
SLOT_TILE = 512


def _slot_rows(n_slots: int, mod_rows: int, block_cols: int) -> int:
    """Slots the slot sum adds a step: about a modulation row's share of them (grid / rows + 1),
    within ``SLOT_TILE`` (a batch of 4 sequences gives each row a few dozen programs' slots)."""
    return rows_per_step(cdiv(n_slots, max(1, mod_rows)) + 1, block_cols, SLOT_TILE)


def _slot_sum_plan(mod_rows: int, cols: int, profile=None) -> RowPlan:
    """One program per modulation row and column tile (two fp32 accumulators and their loads), the
    tiles narrow enough for about two programs per compute unit: with a few modulation rows (one
    per sequence) whole-row tiles left the device nearly idle (4 programs for a batch of 4, 209 us
    of a 506 us step on the H100)."""
    units = (profile or get_profile()).compute_units
    tiles_per_row = max(1, 2 * units // max(1, mod_rows))
    narrow = max(32, next_power_of_2(cdiv(cols, tiles_per_row)))
    return plan_rows(mod_rows, cols, torch.float32, profile=profile, live_tiles=0, fp32_tiles=4,
                     max_block_cols=narrow)


def _backward_plan(rows: int, cols: int, dtype: torch.dtype, mod_rows: int, profile=None) -> RowPlan:
    """A persistent plan whose row blocks never straddle two modulation rows; on a GPU, rows of at
    most ``GPU_BACKWARD_TILE`` elements take tiles of that size, ``GPU_BACKWARD_PROGRAMS`` programs a
    compute unit, and wider rows column tiles of at most ``GPU_WIDE_BACKWARD_COLS``."""
    rows_per_mod = rows // mod_rows
    grouped = 1 < mod_rows < rows
    # The largest power of two dividing rows_per_mod (its lowest set bit).
    cap = rows_per_mod & -rows_per_mod if grouped else None
    profile = profile or get_profile()
    gpu_rows = programs = None
    tiles = BACKWARD_TILES
    if _gpu_wide_backward(cols, profile):
        tiles = dict(BACKWARD_TILES, max_block_cols=GPU_WIDE_BACKWARD_COLS)
    elif profile.kind == "cuda":
        gpu_rows = GPU_BACKWARD_TILE // next_power_of_2(cols)
        programs = GPU_BACKWARD_PROGRAMS * profile.compute_units
    return plan_rows(rows, cols, dtype, profile=profile, persistent=True, max_block_rows=cap,
                     max_gpu_rows=gpu_rows, max_programs=programs, **tiles)


def _gpu_wide_backward(cols: int, profile: DeviceProfile) -> bool:
    """Whether a GPU backward row is wider than ``GPU_BACKWARD_TILE`` (the wide rows' tiles)."""
    return profile.kind == "cuda" and next_power_of_2(cols) > GPU_BACKWARD_TILE


def _backward_launch_options(cols: int, num_warps: int) -> dict:
    """The backward's launch options: ``num_warps``, and on a GPU's wide rows the register cap."""
    if not _gpu_wide_backward(cols, get_profile()):
        return {"num_warps": num_warps}
    return {"num_warps": num_warps, "maxnreg": register_cap(num_warps, GPU_WIDE_BACKWARD_PROGRAMS)}


def plan(shape, dtype: torch.dtype, profile: DeviceProfile | None = None, *,
         modulation_rows: int = 1) -> dict[str, RowPlan]:
    """The forward and backward plans for an input of ``shape`` (``(..., hidden)``) modulated by
    ``modulation_rows`` rows of ``scale``."""
    rows, cols = rows_cols(shape)
    return {
        "forward": plan_rows(rows, cols, dtype, profile=profile, **FORWARD_TILES),
        "backward": _backward_plan(rows, cols, dtype, modulation_rows, profile),
        "slot_sums": _slot_sum_plan(modulation_rows, cols, profile),
    }


@custom_op("modulated_rms_norm_forward")
def modulated_rms_norm_forward(x: Tensor, weight: Tensor | None, scale: Tensor, shift: Tensor | None, eps: float,
                               offset: float, casting: int, overwrite_grad_output: bool) -> tuple[Tensor, Tensor]:
    """``(y, rstd)`` for ``x`` of any leading shape and ``scale``/``shift`` whose leading dimensions
    flatten to ``M`` rows, ``M`` dividing ``x``'s rows; ``rstd`` is fp32, one per row.
    ``overwrite_grad_output`` is the backward's. The op takes its tensors whole: a reshape outside
    it would add autograd view nodes."""
    cols = x.shape[-1]
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    x, rows, x_stride = rows_in_place(x)
    rstd = x.new_empty(rows, dtype=torch.float32)
    if rows == 0:
        return y, rstd
    scale, mod_rows, scale_stride = rows_in_place(scale)
    sh, _, sh_stride = (x, rows, x_stride) if shift is None else rows_in_place(shift)
    launch_forward(
        _modulated_rms_norm_forward_kernel,
        (x, x if weight is None else weight, scale, sh, y, rstd, rows, cols, rows // mod_rows, x_stride,
         scale_stride, sh_stride, cols, eps, offset),
        rows, cols, x.dtype, FORWARD_TILES,
        HAS_WEIGHT=weight is not None, HAS_SHIFT=shift is not None, CASTING=casting,
    )
    return y, rstd


@modulated_rms_norm_forward.register_fake
def _(x, weight, scale, shift, eps, offset, casting, overwrite_grad_output):
    return x.new_empty(x.shape), x.new_empty(math.prod(x.shape[:-1]), dtype=torch.float32)


@custom_op("modulated_rms_norm_backward")
def modulated_rms_norm_backward(dy: Tensor, x: Tensor, weight: Tensor | None, scale: Tensor, shift: Tensor | None,
                                rstd: Tensor, offset: float, casting: int,
                                overwrite_grad_output: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(dx, dweight, dscale, dshift)``; ``dscale``/``dshift`` in their parameters' shapes and
    dtypes; an absent parameter's gradient is empty. ``shift`` is read for its dtype and shape
    only. With ``overwrite_grad_output`` (eager route only) ``dx`` is written into ``dy``'s storage."""
    cols = x.shape[-1]
    dx = grad_output_buffer(dy, x, overwrite_grad_output)
    x, rows, x_stride = rows_in_place(x)
    scale, mod_rows, scale_stride = rows_in_place(scale)
    empty = x.new_empty(0)
    if rows == 0:
        dw = empty if weight is None else torch.zeros_like(weight)
        return dx, dw, torch.zeros_like(scale), empty if shift is None else torch.zeros_like(shift)
    dy, _, dy_stride = rows_in_place(dy)
    p = _backward_plan(rows, cols, x.dtype, mod_rows)
    rows_per_mod = rows // mod_rows
    per_row = mod_rows == rows
    blocks_per_program = cdiv(p.row_blocks, p.grid)
    # dW's partial rows and the modulation's slots (a slot never written sums as zero) are rows of
    # one buffer: one zero fill for all of them.
    dw_rows = 0 if weight is None else partial_rows(p.grid)
    n_slots = 0 if per_row else p.grid + mod_rows
    slot_planes = 1 if shift is None else 2
    zeroed = torch.zeros((dw_rows + n_slots * slot_planes, cols), dtype=torch.float32, device=x.device)
    dw_partials = rstd if weight is None else zeroed[:dw_rows]
    if per_row:  # the gradients themselves, contiguous rows in their parameters' shapes
        ds_buf = torch.empty_like(scale, memory_format=torch.contiguous_format)
        dsh_buf = None if shift is None else torch.empty_like(shift, memory_format=torch.contiguous_format)
    else:
        ds_buf = zeroed[dw_rows:dw_rows + n_slots]
        dsh_buf = None if shift is None else zeroed[dw_rows + n_slots:]
    c = rstd if p.single_pass else torch.empty(rows, dtype=torch.float32, device=x.device)
    w = x if weight is None else weight
    _modulated_rms_norm_backward_kernel[(p.grid,)](
        dy, x, w, scale, rstd, dx, ds_buf, ds_buf if dsh_buf is None else dsh_buf, dw_partials, c,
        rows, cols, rows_per_mod, blocks_per_program,
        dy_stride, x_stride, scale_stride, cols, offset,
        HAS_WEIGHT=weight is not None, HAS_SHIFT=shift is not None, PER_ROW=per_row, CASTING=casting,
        BLOCK_ROWS=p.block_rows, BLOCK_COLS=p.block_cols, COL_TILES=p.col_tiles,
        **_backward_launch_options(cols, p.num_warps),
    )
    dw = empty if weight is None else sum_partials(dw_partials, weight.dtype)
    if per_row:
        return dx, dw, ds_buf, empty if dsh_buf is None else dsh_buf
    dscale = torch.empty_like(scale, memory_format=torch.contiguous_format)
    dshift = None if shift is None else torch.empty_like(shift, memory_format=torch.contiguous_format)
    sp = _slot_sum_plan(mod_rows, cols)
    _sum_slots_kernel[(mod_rows, sp.col_tiles)](
        ds_buf, ds_buf if dsh_buf is None else dsh_buf, dscale, dscale if dshift is None else dshift,
        mod_rows, ds_buf.shape[0], cols, rows_per_mod, blocks_per_program,
        HAS_SHIFT=shift is not None, ROW_BLOCK=p.block_rows, BLOCK_COLS=sp.block_cols,
        SLOT_ROWS=_slot_rows(ds_buf.shape[0], mod_rows, sp.block_cols),
    )
    return dx, dw, dscale, empty if dshift is None else dshift


@modulated_rms_norm_backward.register_fake
def _(dy, x, weight, scale, shift, rstd, offset, casting, overwrite_grad_output):
    empty = x.new_empty(0)
    return (torch.empty_like(x), empty if weight is None else torch.empty_like(weight), torch.empty_like(scale),
            empty if shift is None else torch.empty_like(shift))


# ---------------------------------------------------------------------------------------- autograd


def _setup_context(ctx, inputs, output):
    x, weight, scale, shift, _eps, offset, casting, overwrite_grad_output = inputs
    _y, rstd = output
    ctx.mark_non_differentiable(rstd)
    ctx.save_for_backward(x, weight, scale, shift, rstd)
    ctx.offset, ctx.casting, ctx.overwrite_grad_output = offset, casting, overwrite_grad_output


def _backward(ctx, dy, _drstd):
    x, weight, scale, shift, rstd = ctx.saved_tensors
    overwrite = may_overwrite(ctx.overwrite_grad_output, dy, x)
    dx, dw, dscale, dshift = modulated_rms_norm_backward(dy, x, weight, scale, shift, rstd, ctx.offset,
                                                         ctx.casting, overwrite)
    need = ctx.needs_input_grad
    return (dx, dw if weight is not None and need[1] else None, dscale if need[2] else None,
            dshift if shift is not None and need[3] else None, None, None, None, None)


register_autograd(modulated_rms_norm_forward, _backward, setup_context=_setup_context)


# ------------------------------------------------------------------------------------------ public


def _modulation_rows(t: Tensor, name: str, x: Tensor) -> None:
    check_float(t, name)
    hidden = x.shape[-1]
    if t.dim() == 0 or t.shape[-1] != hidden:
        raise ValueError(f"{name} must have last dimension {hidden} (x's hidden size), got shape {tuple(t.shape)}")
    rows, mod_rows = x.numel() // hidden, t.numel() // hidden
    if mod_rows == 0 or rows % mod_rows:
        raise ValueError(
            f"{name} must have a number of rows (its leading dimensions flattened) that divides x's {rows} rows, "
            f"got shape {tuple(t.shape)}: use (hidden,), (batch, hidden) or (batch, 1, hidden) with x of "
            f"(batch, seq, hidden), or x's shape"
        )
    check_same_device(t, name, x, "x")


def modulated_rms_norm(
    x: Tensor,
    weight: Tensor | None,
    scale: Tensor,
    shift: Tensor | None = None,
    eps: float = 1e-6,
    offset: float = 0.0,
    casting_mode: str = "llama",
    overwrite_grad_output: bool = False,
) -> Tensor:
    """Modulated RMSNorm over the last dimension: ``rms_norm(x, weight) * (1 + scale) + shift``.

    The RMSNorm is ``onca.functional.rms_norm(x, weight, eps, offset, casting_mode)`` (``weight``
    may be None). ``scale`` and ``shift`` (``shift`` optional, of ``scale``'s shape) are modulation
    rows broadcast over the tokens as in liger-kernel's ``LigerModulatedRMSNormFunction``: their
    leading dimensions flattened give ``M`` rows of ``hidden`` that must divide ``x``'s ``N`` rows,
    and token ``i`` uses row ``i // (N // M)``: ``(hidden,)`` for all tokens, ``(batch, hidden)`` or
    ``(batch, 1, hidden)`` per sequence of ``x`` ``(batch, seq, hidden)``, ``x``'s shape per token.
    The weight, the modulation and the shift are applied in fp32 and rounded once to ``x``'s dtype
    (``casting_mode="none"``: rounded at every step). Each gradient has its parameter's dtype and
    shape. ``overwrite_grad_output=True`` (liger's ``in_place``) lets the backward write ``dx``
    into the storage of the incoming gradient (eager only).
    """
    check_float(x, "x")
    if weight is not None:
        validate_weight(weight, x)
    casting = validate_options(x, eps, offset, casting_mode, overwrite_grad_output)
    _modulation_rows(scale, "scale", x)
    if shift is not None:
        _modulation_rows(shift, "shift", x)
        if shift.shape != scale.shape:
            raise ValueError(f"shift must have scale's shape {tuple(scale.shape)}, got {tuple(shift.shape)}")
    weight = None if weight is None else weight.contiguous()
    y, _ = modulated_rms_norm_forward(rows_ready(x), weight, rows_ready(scale),
                                      None if shift is None else rows_ready(shift), float(eps), float(offset),
                                      casting, overwrite_grad_output)
    return y
