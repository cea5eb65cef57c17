"""Deterministic reduction of per-program partial sums (weight and bias gradients).

Kernels that reduce across rows accumulate, per program of a persistent grid, one fp32 row of
partial sums. Programs ``p`` and ``p + rows`` share row ``p`` of a zeroed ``(rows, cols)`` buffer,
``rows = ceil(grid / 2)``, adding into it atomically: with at most two contributions to a zero, the
result does not depend on their order (``0 + a + b == 0 + b + a`` exactly, floating-point addition
being commutative), so this halves the buffer and stays bitwise deterministic (a row per program,
stored whole, needs no fill but doubles the buffer: on an H200, 8.6 MB for LayerNorm's two planes
at 4096 columns, its peak then 1.06x liger-kernel's at 2048 tokens). ``sum_partials`` then adds
the rows in a fixed order, many a step, column tiles in parallel (``torch.sum`` over dim 0 of a few
hundred rows took 10-15 us on an H200, several times a kernel that reads 4 MB). An op with several
parameter gradients (LayerNorm's weight and bias; DyT's alpha, weight and bias) keeps them in planes
of one buffer: one fill, and one summing launch per two planes, each launch being a host-path step
at medium sizes.

At host-bound sizes (a few rows) the zero fill and the summing launch cost more than the work:
there one program reduces every row and stores the gradient itself (``DIRECT``), one launch in all.

A loss summed over rows (:func:`sum_scaled`) is one launch too: the row losses added in a fixed
order, times the reduction's scale, stored in the loss's dtype, where torch's ``sum``, the
multiplication and the cast were three kernels (and three host-path steps).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from onca.device import get_profile
from onca.ops._launch import fast_launch
from onca.tiling import cdiv, next_power_of_2


@fast_launch
@triton.jit
def _sum_partials_kernel(src_ptr, dst_ptr, second_dst_ptr, scale_ptr, second_scale_ptr, n_rows, n_cols,
                         plane_stride, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr,
                         SCALED: tl.constexpr):
    # Axis 1 of the grid is the plane: the buffer's first (dst_ptr) or second (second_dst_ptr),
    # ``plane_stride`` elements apart (0: both sums are of one plane, times their own scales).
    plane = tl.program_id(1)
    src_ptr += plane.to(tl.int64) * plane_stride
    cols = tl.program_id(0) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    col_mask = cols < n_cols
    acc = tl.zeros([BLOCK_ROWS, BLOCK_COLS], dtype=tl.float32)
    for start in range(0, n_rows, BLOCK_ROWS):
        rows = start + tl.arange(0, BLOCK_ROWS)
        mask = (rows < n_rows)[:, None] & col_mask[None, :]
        acc += tl.load(src_ptr + rows.to(tl.int64)[:, None] * n_cols + cols[None, :], mask=mask, other=0.0)
    total = tl.sum(acc, axis=0)
    if plane == 0:
        if SCALED:
            total = total * tl.load(scale_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
        tl.store(dst_ptr + cols, total.to(dst_ptr.dtype.element_ty), mask=col_mask)
    else:
        if SCALED:
            total = total * tl.load(second_scale_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
        tl.store(second_dst_ptr + cols, total.to(second_dst_ptr.dtype.element_ty), mask=col_mask)


def fill_wanted(wanted, items, absent=None) -> list:
    """One entry per flag of ``wanted``: the next of ``items`` where it is set, ``absent`` elsewhere
    (the planes or sums of the gradients an op computes, placed among the ones it does not)."""
    it = iter(items)
    return [next(it) if w else absent for w in wanted]


def partial_rows(grid: int) -> int:
    """Rows of a partial buffer for ``grid`` programs (two programs share a row)."""
    return (grid + 1) // 2


def partial_buffer(grid: int, cols: int, device, planes: int | None = None) -> torch.Tensor:
    """The zeroed ``(ceil(grid / 2), cols)`` fp32 buffer that ``accumulate_partial`` adds into; with
    ``planes``, ``(planes, ceil(grid / 2), cols)``: one plane per gradient, all zeroed by one fill
    (:func:`sum_partials` sums two planes per launch). An op that zeroes other buffers too may
    instead take ``partial_rows(grid)`` rows of one zeroed buffer of its own."""
    rows = partial_rows(grid)
    shape = (rows, cols) if planes is None else (planes, rows, cols)
    return torch.zeros(shape, dtype=torch.float32, device=device)


@triton.jit
def program_row_blocks(n_row_blocks, CONTIGUOUS: tl.constexpr):
    """``(first, end, step)``: this program's row blocks of a persistent grid, for
    ``tl.range(first, end, step)``. Strided by the grid (every ``programs``-th block from its own),
    or with ``CONTIGUOUS`` one range of ``ceil(n_row_blocks / programs)`` blocks (fewer for the
    last programs); either way no program gets more blocks than another but one.

    Which is faster is measured, kernel by kernel and tile by tile (see the caller)."""
    n_programs = tl.num_programs(0)
    if CONTIGUOUS:
        per = tl.cdiv(n_row_blocks, n_programs)
        first = tl.program_id(0) * per
        end = tl.minimum(first + per, n_row_blocks)
        step = 1
    else:
        first = tl.program_id(0)
        end = n_row_blocks
        step = n_programs
    return first, end, step


@triton.jit
def partial_row(buffer_ptr, n_cols):
    """This program's row of a ``partial_buffer``: shared with at most one other program."""
    rows = (tl.num_programs(0) + 1) // 2
    return buffer_ptr + (tl.program_id(0) % rows).to(tl.int64) * n_cols


@triton.jit
def accumulate_partial(row_ptr, cols, values, mask, DIRECT: tl.constexpr):
    """Add ``values`` into this program's partial row (order-independent: two adds to a zero), or,
    with ``DIRECT`` (a grid of one program, whose sums are the whole result), store them in the
    buffer's dtype: the buffer is then the gradient itself."""
    if DIRECT:
        tl.store(row_ptr + cols, values.to(row_ptr.dtype.element_ty), mask=mask)
    else:
        tl.atomic_add(row_ptr + cols, values, mask=mask, sem="relaxed")


# Elements of the sum kernel's tile: 16 fp32 a thread at 4 warps.
_SUM_TILE = 2048


class _SumPlan(NamedTuple):
    block_rows: int
    block_cols: int
    col_tiles: int
    num_warps: int


def rows_per_step(n_rows: int, block_cols: int, tile_elements: int = _SUM_TILE) -> int:
    """Rows a summing loop over ``n_rows`` rows of ``block_cols``-wide tiles adds a step: as many
    as ``tile_elements`` holds (a power of two, at least one). One row a step, such a loop waits
    on each load in turn."""
    return max(1, min(next_power_of_2(n_rows), tile_elements // block_cols))


def _sum_plan(n_rows: int, n_cols: int) -> _SumPlan:
    """The summing launch's tiles: one program per column tile, each walking every row. Column
    tiles of at least 32 fp32 (128 bytes: whole memory transactions, and a multiple of any
    profile's alignment), enough of them to spread over the compute units; the rest of the tile
    in rows, so that a few hundred partial rows take a few steps. One row per step, the loop is
    latency-bound: on an H200, 264 rows of 4096 took about 13 us longer than 132 rows did
    (LayerNorm's backward at 4096 x 4096, CUDA-graph replays)."""
    return _sum_tile(n_rows, n_cols, get_profile())


# Cached per shape and profile: every backward with partial sums asks for it.
@functools.lru_cache(maxsize=1024)
def _sum_tile(n_rows: int, n_cols: int, profile) -> _SumPlan:
    spread = next_power_of_2(cdiv(n_cols, profile.compute_units))
    block_cols = min(next_power_of_2(n_cols), _SUM_TILE, max(32, spread))
    block_rows = rows_per_step(n_rows, block_cols)
    num_warps = 4 if profile.kind == "cuda" else 1  # 16 fp32 a thread; warps mean nothing elsewhere
    return _SumPlan(block_rows, block_cols, cdiv(n_cols, block_cols), num_warps)


def sum_partials(partials: torch.Tensor, dtype=torch.float32):
    """Sum a contiguous fp32 ``(programs, cols)`` buffer over its rows, stored in ``dtype``.

    A ``(planes, programs, cols)`` buffer is summed plane by plane, two planes per launch, ``dtype``
    then being a sequence of one dtype per plane: the list of sums is returned."""
    n_rows, n_cols = partials.shape[-2], partials.shape[-1]
    p = _sum_plan(n_rows, n_cols)
    if partials.dim() == 2:
        total = torch.empty(n_cols, dtype=dtype, device=partials.device)
        _sum_planes(partials, [total], p, 0, None)
        return total
    if len(dtype) != partials.shape[0]:
        raise ValueError(f"sum_partials: {partials.shape[0]} planes but {len(dtype)} dtypes")
    totals = [torch.empty(n_cols, dtype=d, device=partials.device) for d in dtype]
    for first in range(0, len(totals), 2):
        src = partials if first == 0 else partials[first]
        _sum_planes(src, totals[first:first + 2], p, n_rows * n_cols, None)
    return totals


def sum_partials_times(partials: torch.Tensor, scales: tuple, dtypes: tuple) -> tuple:
    """``(sum * scales[0], sum * scales[1])`` in ``dtypes``, ``sum`` being a contiguous fp32
    ``(programs, cols)`` buffer summed over its rows (in :func:`sum_partials`' fixed order), in
    fp32, and ``scales`` two contiguous ``(cols,)`` tensors: one launch for two gradients that are
    one reduction times two vectors (attention residuals' ``dw_query = w_norm * G``, ``dw_norm =
    w_query * G``), where torch's sum, casts and products were six kernels."""
    n_rows, n_cols = partials.shape
    totals = [torch.empty(n_cols, dtype=d, device=partials.device) for d in dtypes]
    _sum_planes(partials, totals, _sum_plan(n_rows, n_cols), 0, scales)
    return tuple(totals)


def _sum_planes(src: torch.Tensor, totals: list, p, plane_stride: int, scales) -> None:
    """One launch: the sums of ``src``'s first ``len(totals)`` planes (one or two, ``plane_stride``
    elements apart) into ``totals``, each times its ``scales`` vector where they are given."""
    n_rows, n_cols = src.shape[-2], src.shape[-1]
    scale, second_scale = (src, src) if scales is None else scales
    _sum_partials_kernel[(p.col_tiles, len(totals))](src, totals[0], totals[-1], scale, second_scale, n_rows,
                                                     n_cols, plane_stride, BLOCK_ROWS=p.block_rows,
                                                     BLOCK_COLS=p.block_cols, SCALED=scales is not None,
                                                     num_warps=p.num_warps)


# Elements of a loss's row values added per step by the one program of ``sum_scaled``.
_SUM_BLOCK = 1024


@fast_launch
@triton.jit
def _sum_scaled_kernel(src_ptr, factor_ptr, out_ptr, n, scale, HAS_FACTOR: tl.constexpr, BLOCK: tl.constexpr):
    offsets = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, n, BLOCK):
        idx = start + offsets
        acc += tl.load(src_ptr + idx, mask=idx < n, other=0.0)
    total = tl.sum(acc, axis=0) * scale
    if HAS_FACTOR:
        total = total * tl.load(factor_ptr)
    tl.store(out_ptr, total.to(out_ptr.dtype.element_ty))


def sum_scaled(values: torch.Tensor, dtype: torch.dtype, scale: float = 1.0,
               factor: torch.Tensor | float | None = None) -> torch.Tensor:
    """``values.sum() * scale * factor[0]`` as a 0-d ``dtype`` tensor, in one launch: one program
    adds the contiguous 1-D fp32 ``values`` in a fixed order (deterministic), in fp32. ``factor`` is
    a one-element fp32 device tensor (a token count's reciprocal: no host sync), or a float known on
    the host (folded into ``scale``). A sum over nothing is 0 (times a NaN scale, NaN, as torch's
    mean over nothing)."""
    if isinstance(factor, float):
        scale, factor = scale * factor, None
    out = torch.empty((), dtype=dtype, device=values.device)
    _sum_scaled_kernel[(1,)](values, values if factor is None else factor, out, values.numel(), float(scale),
                             HAS_FACTOR=factor is not None, BLOCK=_SUM_BLOCK, num_warps=4)
    return out
