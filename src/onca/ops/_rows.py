"""Shape helpers shared by the row-wise ops: every op sees its input as ``(rows, cols)``."""

from __future__ import annotations

import math

import torch

__all__ = ["rows_cols", "as_rows"]


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
