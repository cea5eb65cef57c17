"""Fixtures shared by the op tests."""

from __future__ import annotations

import pytest
import torch

from onca.ops import _paired_head


@pytest.fixture
def paired_calls(monkeypatch):
    """One pair per chunk on the pair-aligned path (several chunks at CI's shapes); the list of the
    pairs each call of a registered pair loss saw (empty: that path never ran)."""
    monkeypatch.setattr(_paired_head, "GRAD_TILE_TOKENS", 1)
    calls = []

    def counting(fn):
        return lambda sums_c, *rest: calls.append(sums_c.shape[0]) or fn(sums_c, *rest)

    for name, fn in list(_paired_head.PAIR_LOSSES.items()):
        monkeypatch.setitem(_paired_head.PAIR_LOSSES, name, counting(fn))
    return calls


@pytest.fixture
def poisoned_empty(monkeypatch):
    """``torch.empty`` hands out NaN-filled floating buffers: an output that reads memory it never
    wrote (an accumulator written, not zero-filled and added, by its first chunk; a gradient written
    over a dead buffer) turns NaN."""
    empty = torch.empty

    def poisoned(*args, **kwargs):
        t = empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", poisoned)
