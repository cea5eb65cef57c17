"""Fixtures shared by the op tests."""

from __future__ import annotations

import pytest

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
