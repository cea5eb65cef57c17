"""Shape helpers shared by the row-wise ops: every op sees its input as ``(rows, cols)``."""

from __future__ import annotations

import math

import torch

__all__ = ["as_rows", "as_rows_over", "from_rows_over", "new_rows", "rows_cols", "rows_ready",
           "views_as_rows"]


def rows_cols(shape) -> tuple[int, int]:
    """``(rows, cols)`` of a ``(..., cols)`` shape: the leading dimensions flattened."""
    shape = tuple(int(s) for s in shape)
    return math.prod(shape[:-1]), shape[-1]


def views_as_rows(t: torch.Tensor) -> bool:
    """Whether ``t`` is a ``(rows, last_dim)`` matrix without a copy: unit stride along the last
    dimension, leading dimensions that merge into one (size-1 ones aside), and rows that do not
    overlap."""
    if t.is_contiguous():
        return t.dim() > 0
    if t.dim() == 0 or t.stride(-1) != 1:
        return False
    lead = [(size, stride) for size, stride in zip(t.shape[:-1], t.stride()[:-1]) if size != 1]
    for (_, outer), (size, inner) in zip(lead, lead[1:]):
        if outer != inner * size:
            return False
    return not lead or lead[-1][1] >= t.shape[-1]


def as_rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a 2-D ``(rows, last_dim)`` matrix with unit column stride, copying only if needed."""
    # The row count comes from the shape, not -1: a zero-width input is a valid (empty) matrix.
    # Two ints, not a tuple: torch parses a shape tuple several microseconds slower, on every launch.
    rows, cols = math.prod(t.shape[:-1]), t.shape[-1]
    if views_as_rows(t):
        return t.view(rows, cols)
    return t.contiguous().view(rows, cols)


def rows_ready(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself where :func:`as_rows` reads it in place, else a contiguous copy.

    An op that takes its input whole (any leading shape) and reads its rows in the forward and
    again, from the saved input, in the backward calls this first, outside the op: a layout that
    needs a copy is copied once, by a differentiable copy, not by both passes."""
    return t if views_as_rows(t) else t.contiguous()


def new_rows(t: torch.Tensor, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A new contiguous tensor of ``t``'s shape (and ``dtype``, default ``t``'s) and its
    ``(rows, last_dim)`` view: an op returns the first, its kernel writes the second."""
    # empty_like: torch.empty(shape, dtype=, device=) parses its arguments three times slower.
    out = torch.empty_like(t, dtype=dtype or t.dtype, memory_format=torch.contiguous_format)
    return out, out.view(math.prod(t.shape[:-1]), t.shape[-1])


def as_rows_over(t: torch.Tensor, dim: int) -> torch.Tensor:
    """``t`` as ``(rows, size of dim)``, with ``dim`` (non-negative) moved last (a copy unless it
    already is last); undo with :func:`from_rows_over`."""
    return as_rows(t if dim == t.dim() - 1 else t.movedim(dim, -1))


def from_rows_over(rows: torch.Tensor, shape, dim: int) -> torch.Tensor:
    """The ``(rows, size of dim)`` result of :func:`as_rows_over` in ``shape`` again (a view)."""
    last = len(shape) - 1
    if dim == last:
        return rows.view(shape)
    moved = list(shape)
    moved.append(moved.pop(dim))
    return rows.view(moved).movedim(-1, dim)
