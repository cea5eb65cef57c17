"""Shape helpers shared by the row-wise ops: every op sees its input as ``(rows, cols)``."""

from __future__ import annotations

import math

import torch

__all__ = ["rows_cols", "as_rows", "as_rows_over", "from_rows_over"]


def rows_cols(shape) -> tuple[int, int]:
    """``(rows, cols)`` of a ``(..., cols)`` shape: the leading dimensions flattened."""
    shape = tuple(int(s) for s in shape)
    return math.prod(shape[:-1]), shape[-1]


def as_rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a 2-D ``(rows, last_dim)`` matrix with unit column stride, copying only if needed."""
    # The row count comes from the shape, not -1: a zero-width input is a valid (empty) matrix.
    if t.is_contiguous():  # the common case, on every launch: keep it cheap
        return t.view(math.prod(t.shape[:-1]), t.shape[-1])
    if t.dim() > 0 and t.stride(-1) != 1:
        t = t.contiguous()
    rows = t.reshape(math.prod(t.shape[:-1]), t.shape[-1])
    if rows.stride(1) != 1 or (rows.shape[0] > 1 and rows.stride(0) < rows.shape[1]):
        rows = rows.contiguous()
    return rows


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
