"""Fixtures shared by the op tests."""

from __future__ import annotations

import pytest
import torch

from onca.ops import _paired_head


@pytest.fixture
def paired_calls(monkeypatch):
    """One pair per chunk on the pair-aligned path (several chunks at CI's shapes); the list of the
    pairs each chunk of that path handed its pair loss (empty: that path never ran). Only the
    pair-aligned op's table is wrapped: the two-pass route's calls of the same losses are not
    counted."""
    monkeypatch.setattr(_paired_head, "GRAD_TILE_TOKENS", 1)
    calls = []

    def counting(fn):
        return lambda sums_c, *rest: calls.append(sums_c.shape[0]) or fn(sums_c, *rest)

    monkeypatch.setattr(_paired_head, "PAIR_LOSSES",
                        {name: counting(fn) for name, fn in _paired_head.PAIR_LOSSES.items()})
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


@pytest.fixture
def head_matmuls(monkeypatch):
    """Every head-logits matmul of the chunked heads (the chunk driver's, the token chunks'),
    counted: a list that grows by one per call."""
    from onca.ops import _chunked_head

    calls = []
    logits = _chunked_head.head_logits
    monkeypatch.setattr(_chunked_head, "head_logits", lambda *a: calls.append(1) or logits(*a))
    return calls
