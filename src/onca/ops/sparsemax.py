"""Sparsemax (Martins & Astudillo, 2016) over one dimension (the last by default).

``sparsemax(z) = argmin_{p in simplex} ||p - z||**2 = max(z - tau, 0)``, where the threshold
``tau`` makes the row sum to 1: ``sum(max(z - tau, 0)) = 1``. With the support
``S = {i : z_i > tau}``, ``tau = (sum_S z - 1) / |S|``. liger-kernel's ``LigerSparsemax`` /
``liger_sparsemax(input, dim=-1)``: same function, same ``dim`` argument.

How ``tau`` is found (no sort, unlike the paper's and liger-kernel's algorithm, which sort each
row with ``torch.sort`` first): ``f(t) = sum(max(z - t, 0))`` is convex, piecewise linear and
decreasing, and ``tau`` lies in ``[max(z) - 1, max(z))``. The kernel works on ``z - max(z)``
(exact near the top, so the sums over the support stay accurate for rows of any magnitude).
Starting from ``lo = max(z) - 1`` (a lower bound) and ``hi = max(z)``, each step of the kernel
takes one pass over the row and computes both

- a Newton step from ``lo``: ``t = (sum_{z > lo} z - 1) / |{z > lo}|``, which is Michelot's
  projection step; from below it never passes ``tau`` and reaches it exactly once the support is
  right (typically in 3-10 steps on real rows: then ``t == lo`` and the row is done);
- a bisection step on ``[lo, hi]``, which halves the bracket whatever the data (a safeguard for
  adversarial rows on which Newton crawls).

``lo`` becomes the larger of the two lower bounds. The loop stops as soon as no row of the block
moved, and after ``MAX_STEPS`` steps at most (the bracket is then ``2**-MAX_STEPS`` wide: below
fp32 resolution). All of this is fp32; ``y`` is stored once in the input's dtype.

Saved for backward: the output ``y`` (its support is ``y > 0``). The backward pass is the
Jacobian-vector product ``dx_i = dy_i - mean_{j in S}(dy_j)`` on the support and 0 off it, in fp32.

A row in one tile keeps it in registers for all the steps; a row in column tiles re-reads it once
per step (it stays in L2 on a GPU). Another ``dim`` is moved last first (a copy).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from onca.device import DeviceProfile
from onca.ops._launch import fast_launch
from onca.ops._row_map import plans, register_row_map
from onca.ops._rows import moved_back, moved_last
from onca.ops._validate import check_dim, check_float
from onca.tiling import RowPlan

__all__ = ["plan", "sparsemax", "MAX_STEPS"]

# Bisection halves the bracket of width 1 to 2**-32 in this many steps: past fp32 resolution (tau is
# found relative to the row's maximum, in [-1, 0)). Rows stop earlier once Newton has converged.
MAX_STEPS = 32

# Live tiles (input dtype; fp32). Forward: x and y; x, and the step's masked sums' operands (z >
# lo, z - mid) and y in fp32. Backward: y, dy and dx; their fp32 forms and the support mask.
FORWARD_TILES = dict(live_tiles=2, fp32_tiles=4)
BACKWARD_TILES = dict(live_tiles=3, fp32_tiles=4)


# ----------------------------------------------------------------------------------------- kernels


@triton.jit
def _step_sums(z, lo, mid):
    """One step's sums over a tile (fp32, padding at -inf): ``sum(z)`` and ``|z|`` over
    ``z > lo``, and ``f(mid) = sum(max(z - mid, 0))``."""
    above = z > lo[:, None]
    s = tl.sum(tl.where(above, z, 0.0), axis=1)
    k = tl.sum(above.to(tl.float32), axis=1)
    f = tl.sum(tl.maximum(z - mid[:, None], 0.0), axis=1)
    return s, k, f


@triton.jit
def _step_update(lo, hi, mid, s, k, f):
    """The next bracket from one step's sums: ``lo`` the larger of the Newton iterate and (when
    ``f(mid) >= 1``) the midpoint; ``hi`` the midpoint when ``f(mid) < 1``."""
    newton = (s - 1.0) / tl.maximum(k, 1.0)
    below = f >= 1.0
    new_lo = tl.maximum(lo, tl.maximum(newton, tl.where(below, mid, lo)))
    new_hi = tl.where(below, hi, mid)
    return new_lo, new_hi


@fast_launch
@triton.jit
def _sparsemax_forward_kernel(
    x_ptr, y_ptr, n_rows, n_cols, x_row_stride, y_row_stride,
    MAX_STEPS: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    COL_TILES: tl.constexpr,
):
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    n_row_blocks = tl.cdiv(n_rows, BLOCK_ROWS)
    col_offsets = tl.arange(0, BLOCK_COLS)
    for row_block in tl.range(pid, n_row_blocks, n_programs):
        rows = row_block * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        row_mask = rows < n_rows
        rows64 = rows.to(tl.int64)[:, None]
        x_rows = x_ptr + rows64 * x_row_stride
        y_rows = y_ptr + rows64 * y_row_stride
        if COL_TILES == 1:
            mask = row_mask[:, None] & (col_offsets < n_cols)[None, :]
            z = tl.load(x_rows + col_offsets[None, :], mask=mask, other=float("-inf")).to(tl.float32)
            # Rows past the end read as all -inf: give them a finite bracket (their stores are masked).
            top = tl.where(row_mask, tl.max(z, axis=1), 0.0)
            z = z - top[:, None]
        else:
            top = tl.full([BLOCK_ROWS], float("-inf"), tl.float32)
            for tile in range(COL_TILES):
                cols = tile * BLOCK_COLS + col_offsets
                mask = row_mask[:, None] & (cols < n_cols)[None, :]
                z = tl.load(x_rows + cols[None, :], mask=mask, other=float("-inf")).to(tl.float32)
                top = tl.maximum(top, tl.max(z, axis=1))
            top = tl.where(row_mask, top, 0.0)
        # Relative to the row's maximum (z - top, exact near the top), so that the sums over the
        # support stay small and accurate whatever the magnitude of the row: tau - top is in [-1, 0).
        lo = tl.full([BLOCK_ROWS], -1.0, tl.float32)
        hi = tl.zeros([BLOCK_ROWS], dtype=tl.float32)
        moving = 1
        for _step in range(MAX_STEPS):
            if moving != 0:
                mid = 0.5 * (lo + hi)
                if COL_TILES == 1:
                    s, k, f = _step_sums(z, lo, mid)
                else:
                    s = tl.zeros([BLOCK_ROWS], dtype=tl.float32)
                    k = tl.zeros([BLOCK_ROWS], dtype=tl.float32)
                    f = tl.zeros([BLOCK_ROWS], dtype=tl.float32)
                    for tile in range(COL_TILES):
                        cols = tile * BLOCK_COLS + col_offsets
                        mask = row_mask[:, None] & (cols < n_cols)[None, :]
                        zt = tl.load(x_rows + cols[None, :], mask=mask, other=float("-inf")).to(tl.float32)
                        s_t, k_t, f_t = _step_sums(zt - top[:, None], lo, mid)
                        s += s_t
                        k += k_t
                        f += f_t
                new_lo, hi = _step_update(lo, hi, mid, s, k, f)
                # NaN rows never compare equal: they stop with the others once the bracket is spent.
                moving = tl.max(tl.where(row_mask & (new_lo != lo) & (hi > new_lo), 1, 0), axis=0)
                lo = new_lo
        # lo is now tau - top (or, on a pathological row, within 2**-MAX_STEPS of it from below).
        if COL_TILES == 1:
            y = tl.maximum(z - lo[:, None], 0.0)
            tl.store(y_rows + col_offsets[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)
        else:
            for tile in range(COL_TILES):
                cols = tile * BLOCK_COLS + col_offsets
                mask = row_mask[:, None] & (cols < n_cols)[None, :]
                z = tl.load(x_rows + cols[None, :], mask=mask, other=float("-inf")).to(tl.float32)
                y = tl.maximum((z - top[:, None]) - lo[:, None], 0.0)
                tl.store(y_rows + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _support_sums(y_rows, dy_rows, cols, mask):
    """Over one tile: ``sum(dy)`` and ``|S|`` over the support ``y > 0``."""
    y = tl.load(y_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(dy_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    support = y > 0.0
    return tl.sum(tl.where(support, dy, 0.0), axis=1), tl.sum(support.to(tl.float32), axis=1)


@triton.jit
def _support_grad(y_rows, dy_rows, dx_rows, cols, mask, mean):
    y = tl.load(y_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(dy_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    dx = tl.where(y > 0.0, dy - mean[:, None], 0.0)
    tl.store(dx_rows + cols[None, :], dx.to(dx_rows.dtype.element_ty), mask=mask)


@fast_launch
@triton.jit
def _sparsemax_backward_kernel(
    dy_ptr, y_ptr, dx_ptr, n_rows, n_cols, dy_row_stride, y_row_stride, dx_row_stride,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    COL_TILES: tl.constexpr,
):
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    n_row_blocks = tl.cdiv(n_rows, BLOCK_ROWS)
    col_offsets = tl.arange(0, BLOCK_COLS)
    for row_block in tl.range(pid, n_row_blocks, n_programs):
        rows = row_block * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        row_mask = rows < n_rows
        rows64 = rows.to(tl.int64)[:, None]
        dy_rows = dy_ptr + rows64 * dy_row_stride
        y_rows = y_ptr + rows64 * y_row_stride
        dx_rows = dx_ptr + rows64 * dx_row_stride
        if COL_TILES == 1:
            mask = row_mask[:, None] & (col_offsets < n_cols)[None, :]
            y = tl.load(y_rows + col_offsets[None, :], mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(dy_rows + col_offsets[None, :], mask=mask, other=0.0).to(tl.float32)
            support = y > 0.0
            total = tl.sum(tl.where(support, dy, 0.0), axis=1)
            count = tl.sum(support.to(tl.float32), axis=1)
            mean = total / tl.maximum(count, 1.0)
            dx = tl.where(support, dy - mean[:, None], 0.0)
            tl.store(dx_rows + col_offsets[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)
        else:
            total = tl.zeros([BLOCK_ROWS], dtype=tl.float32)
            count = tl.zeros([BLOCK_ROWS], dtype=tl.float32)
            for tile in range(COL_TILES):
                cols = tile * BLOCK_COLS + col_offsets
                mask = row_mask[:, None] & (cols < n_cols)[None, :]
                t, c = _support_sums(y_rows, dy_rows, cols, mask)
                total += t
                count += c
            mean = total / tl.maximum(count, 1.0)
            for tile in range(COL_TILES):
                cols = tile * BLOCK_COLS + col_offsets
                mask = row_mask[:, None] & (cols < n_cols)[None, :]
                _support_grad(y_rows, dy_rows, dx_rows, cols, mask, mean)


# --------------------------------------------------------------------------------------- launchers


def plan(shape, dtype: torch.dtype, profile: DeviceProfile | None = None) -> dict[str, RowPlan]:
    """The forward and backward plans for an input of ``shape`` (``(..., cols)``, sparsemax over
    the last dimension)."""
    return plans(shape, dtype, FORWARD_TILES, BACKWARD_TILES, profile)


sparsemax_forward = register_row_map(
    "sparsemax", _sparsemax_forward_kernel, _sparsemax_backward_kernel, FORWARD_TILES, BACKWARD_TILES, MAX_STEPS=MAX_STEPS,
    forward_doc="``y``, the sparsemax of each row of ``x`` (any leading shape), in ``x``'s dtype.",
    backward_doc="``dx = dy - mean_S(dy)`` on each row's support ``S = {y > 0}``, 0 elsewhere.",
)


# ------------------------------------------------------------------------------------------ public


def sparsemax(input: Tensor, dim: int = -1) -> Tensor:
    """Sparsemax of ``input`` over ``dim`` (liger-kernel's ``liger_sparsemax(input, dim)``): the
    Euclidean projection of each row onto the probability simplex, ``max(z - tau, 0)`` with ``tau``
    such that the row sums to 1 (exact zeros off the support). Computed in fp32, the result in
    ``input``'s dtype and shape; any leading shape, including no rows. Saves the output for the
    backward pass, whose gradient is ``dy - mean(dy over the support)`` on the support, 0 off it."""
    check_float(input, "input")
    if input.dim() == 0:
        raise ValueError("input must have at least one dimension (the one projected), got a 0-d tensor")
    d = check_dim(dim, "dim", input.dim())
    return moved_back(sparsemax_forward(moved_last(input, d)), d)
