"""Shape helpers shared by the row-wise ops: every op sees its input as ``(rows, cols)``."""

from __future__ import annotations

import math

import torch

__all__ = ["as_rows", "moved_back", "moved_last", "rows_cols", "rows_in_place", "rows_ready",
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


def rows_in_place(t: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """``(t, rows, row_stride)``: ``t`` read as a ``(rows, last_dim)`` matrix with unit column
    stride, as :func:`as_rows` gives it but without making the view: ``t`` itself where it is one
    in place (see :func:`views_as_rows`), else a contiguous copy, with the stride between its rows.

    For the launchers of ops whose host path is their cost at small sizes: inside an autograd op a
    view costs several microseconds of host time, and a row kernel needs only the pointer and the
    row stride."""
    cols = t.shape[-1]
    if not t.is_contiguous():
        if views_as_rows(t):
            return t, math.prod(t.shape[:-1]), _row_stride(t)
        t = t.contiguous()
    return t, (t.numel() // cols if cols else math.prod(t.shape[:-1])), cols


def _row_stride(t: torch.Tensor) -> int:
    """The stride between the rows of ``t`` (one that :func:`views_as_rows`): its innermost
    leading dimension's, size-1 dimensions aside; the row width where it has at most one row."""
    for size, stride in zip(reversed(t.shape[:-1]), reversed(t.stride()[:-1])):
        if size != 1:
            return stride
    return t.shape[-1]


def rows_ready(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself where :func:`as_rows` reads it in place, else a contiguous copy.

    An op that takes its input whole (any leading shape) and reads its rows in the forward and
    again, from the saved input, in the backward calls this first, outside the op: a layout that
    needs a copy is copied once, by a differentiable copy, not by both passes."""
    return t if views_as_rows(t) else t.contiguous()


def moved_last(t: torch.Tensor, dim: int) -> torch.Tensor:
    """``t`` with ``dim`` (non-negative) moved last, ready for a row op that takes its input whole
    (:func:`rows_ready`): ``t`` itself, with no view, where ``dim`` is already last and the layout
    reads in place; undo on the op's result with :func:`moved_back`."""
    return rows_ready(t if dim == t.dim() - 1 else t.movedim(dim, -1))


def moved_back(t: torch.Tensor, dim: int) -> torch.Tensor:
    """The result of an op on :func:`moved_last`'s tensor with its last dimension at ``dim`` again
    (a view; ``t`` itself where ``dim`` is last)."""
    return t if dim == t.dim() - 1 else t.movedim(-1, dim)
