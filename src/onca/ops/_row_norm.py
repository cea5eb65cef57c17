"""The launch sequence the row norms share (RMSNorm, fused add + RMSNorm, LayerNorm).

Their kernels differ, their launches do not: the forward plans a ``(rows, cols)`` grid and launches;
the backward plans a persistent grid, zeroes one partial-sum buffer per parameter gradient (see
``onca.ops._partials``), gives the column-tiled path its per-row scratch, launches, and sums the
partial rows. A kernel takes its plan as the constexprs ``BLOCK_ROWS``, ``BLOCK_COLS`` and
``COL_TILES``; a backward kernel's last pointer arguments are its partial buffers, in the order of
``grad_dtypes``, then the scratch.

Up to ``DIRECT_MAX_ELEMENTS`` elements the backward runs as one program that stores the parameter
gradients itself (``DIRECT_PARTIALS``): no fill, no summing launch, where the host path is the cost.

Callers launch only with at least one row and one column (a plan of nothing is an error, and a
zero-size grid is never launched).
"""

from __future__ import annotations

import torch

from onca.device import DeviceProfile
from onca.ops._launch import row_launch
from onca.ops._partials import fill_wanted, partial_buffer, sum_partials
from onca.ops._rows import rows_cols
from onca.tiling import RowPlan, plan_rows

__all__ = ["DIRECT_MAX_ELEMENTS", "backward_plan", "launch_backward", "launch_forward", "plans"]

# 64K elements (16 rows of 4096, 64 of 1024): one program reads them in a few microseconds, less
# than the two launches it saves on the host.
DIRECT_MAX_ELEMENTS = 1 << 16


def backward_plan(rows: int, cols: int, dtype: torch.dtype, tiles: dict,
                  profile: DeviceProfile | None = None) -> RowPlan:
    """The backward's persistent plan: one program up to ``DIRECT_MAX_ELEMENTS`` elements."""
    direct = rows * cols <= DIRECT_MAX_ELEMENTS
    return plan_rows(rows, cols, dtype, profile=profile, persistent=True, max_programs=1 if direct else None,
                     **tiles)


def plans(shape, dtype: torch.dtype, forward_tiles: dict, backward_tiles: dict,
          profile: DeviceProfile | None = None) -> dict[str, RowPlan]:
    """The forward and backward plans a row norm launches for an input of ``shape``
    (``(..., hidden)``): what ``onca plan`` prints."""
    rows, cols = rows_cols(shape)
    return {
        "forward": plan_rows(rows, cols, dtype, profile=profile, **forward_tiles),
        "backward": backward_plan(rows, cols, dtype, backward_tiles, profile),
    }


def launch_forward(kernel, args, rows: int, cols: int, dtype: torch.dtype, tiles: dict, *,
                   cap_registers: bool = False, **constexprs) -> None:
    """Launch a row-norm forward ``kernel(*args)`` over ``rows x cols`` of ``dtype``
    (``cap_registers``: see :func:`onca.ops._launch.row_launch`)."""
    grid, kwargs, _ = row_launch(kernel, rows, cols, dtype, tiles, constexprs,
                                 cap_registers=cap_registers)
    kernel[grid](*args, **kwargs)


def launch_backward(kernel, args, rows: int, cols: int, dtype: torch.dtype, tiles: dict, *,
                    grad_dtypes, row_stats: int, stand_in: torch.Tensor, cap_registers: bool = False,
                    **constexprs) -> list:
    """Launch a row-norm backward ``kernel(*args, *partials, scratch)``; return its parameter
    gradients, one per entry of ``grad_dtypes`` stored in that dtype (None where the entry is None:
    that gradient is not computed, and the kernel gets ``stand_in`` for its buffer).

    ``row_stats``: how many fp32 values per row the column-tiled path keeps between its two phases.
    ``stand_in``: an fp32 tensor on the device, passed for any buffer this plan never touches.
    ``cap_registers``: see :func:`onca.ops._launch.row_launch` (the persistent plan's programs).
    """
    direct = rows * cols <= DIRECT_MAX_ELEMENTS
    grid, kwargs, p = row_launch(kernel, rows, cols, dtype, tiles, {**constexprs, "DIRECT_PARTIALS": direct},
                                 plan=backward_plan, cap_registers=cap_registers)
    device = stand_in.device
    wanted = [d is not None for d in grad_dtypes]
    computed = [d for d in grad_dtypes if d is not None]
    if direct:
        # The gradients themselves: the one program stores its sums in them (1-D: no view to make).
        buffers = [torch.empty(cols, dtype=d, device=device) for d in computed]
    else:
        # One buffer with a plane per computed gradient: one fill, and one summing launch below.
        planes = partial_buffer(p.grid, cols, device, planes=len(computed))
        buffers = planes.unbind(0)
    partials = fill_wanted(wanted, buffers, stand_in)
    scratch = stand_in if p.single_pass else torch.empty(row_stats * rows, dtype=torch.float32, device=device)
    kernel[grid](*args, *partials, scratch, **kwargs)
    return fill_wanted(wanted, buffers if direct else sum_partials(planes, computed))
