"""Vocabulary-parallel cross entropy in one process: a one-rank group holding the whole vocabulary
must give plain cross entropy's loss and gradient; bad input is refused by name. The multi-rank
sharding itself is tested on two ranks in tests/distributed/test_vocab_parallel.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from onca.bench.ops.vocab_parallel_cross_entropy import one_rank_group
from onca.device import get_profile
from onca.ops import vocab_parallel_cross_entropy as op
from onca.ops.vocab_parallel_cross_entropy import (
    vocab_parallel_cross_entropy,
    vocab_parallel_fused_linear_cross_entropy,
)
from onca.tiling import cdiv
from tests.helpers import assert_close, leaf, randn


@pytest.fixture
def world(device):
    """A one-rank group, torn down afterwards: other tests in this worker see no process group."""
    import torch.distributed as dist

    created = not dist.is_initialized()
    yield one_rank_group(device)
    if created:
        dist.destroy_process_group()


@pytest.fixture(params=["cross_entropy", "shard_passes"])
def group(world, request, monkeypatch):
    """The one-rank group, each test run twice: as a one-rank call goes (to cross entropy: the
    shard is the whole vocabulary), and through the sharded passes (told the shard is not the whole
    vocabulary), which one process can run on a one-rank group only so."""
    if request.param == "shard_passes":
        monkeypatch.setattr(op, "_whole_vocabulary", lambda *args: False)
    return world


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_one_rank_matches_cross_entropy(device, group, dtype, reduction):
    logits = randn(37, 203, dtype=dtype, device=device)
    target = torch.randint(0, 203, (37,), device=device)
    target[::5] = -100
    lk = leaf(logits)
    loss = vocab_parallel_cross_entropy(lk, target, group, vocab_start=0, reduction=reduction)
    l64 = logits.detach().double().requires_grad_(True)
    ref = F.cross_entropy(l64, target, ignore_index=-100, reduction=reduction)
    assert_close(loss, ref, dtype, "loss")
    g = torch.randn_like(ref)
    loss.backward(g.to(loss.dtype))
    ref.backward(g)
    assert_close(lk.grad, l64.grad, dtype, "dlogits")


def test_strided_targets_and_an_expanded_gradient(device, group):
    """Per-token losses of (2, 9) logits against strided targets with ``ignore_index=-1`` (another
    shard's class then maps past the shard, not onto -1) and a z-loss, backward through their sum:
    autograd hands the op a stride-0 gradient, read per row."""
    logits = randn(2, 9, 50, device=device)
    wide = torch.randint(0, 50, (2, 18), device=device)
    wide[0, ::3] = -1
    target = wide[:, ::2]
    lk = leaf(logits)
    per = vocab_parallel_cross_entropy(lk, target, group, vocab_start=0, reduction="none", ignore_index=-1,
                                       lse_square_scale=1e-2)
    l64 = logits.detach().double().requires_grad_(True)
    flat = l64.reshape(-1, 50)
    lse = torch.logsumexp(flat, dim=-1)
    valid = target.reshape(-1) != -1
    ref = (F.cross_entropy(flat, target.reshape(-1), ignore_index=-1, reduction="none")
           + torch.where(valid, 1e-2 * lse * lse, 0.0)).view(2, 9)
    assert_close(per, ref, torch.float32, "per-token loss")
    per.sum().backward()
    ref.sum().backward()
    assert_close(lk.grad, l64.grad, torch.float32, "dlogits")


def test_rows_in_several_blocks(device, group, monkeypatch):
    """The per-token kernels in 16-row blocks, with more blocks than the profile's programs (one per
    compute unit, whatever the profile), so programs loop over several."""
    monkeypatch.setattr(op, "ROW_BLOCK", 16)
    rows = 16 * (get_profile().compute_units + 1) + 6
    assert cdiv(rows, 16) > op._row_grid(rows)[0]
    logits = randn(rows, 33, device=device)
    target = torch.randint(0, 33, (rows,), device=device)
    target[::7] = -100
    lk = leaf(logits)
    loss = vocab_parallel_cross_entropy(lk, target, group, vocab_start=0, lse_square_scale=1e-3)
    l64 = logits.detach().double().requires_grad_(True)
    valid = target != -100
    lse = torch.logsumexp(l64, dim=-1)
    ref = F.cross_entropy(l64, target) + (1e-3 * lse * lse)[valid].mean()
    assert_close(loss, ref, torch.float32, "loss")
    loss.backward()
    ref.backward()
    assert_close(lk.grad, l64.grad, torch.float32, "dlogits")


def test_uneven_shards_with_vocab_size_gather_nothing_on_the_host(device, group, monkeypatch):
    """vocab_start with vocab_size: no gather of the shard sizes (a host synchronisation per call);
    without vocab_size the sizes are gathered. Both give the same loss."""
    import torch.distributed as dist

    logits = randn(9, 40, device=device)
    target = torch.randint(0, 40, (9,), device=device)
    gathered = []
    real = dist.all_gather_object
    monkeypatch.setattr(dist, "all_gather_object", lambda *a, **k: (gathered.append(1), real(*a, **k))[1])
    sized = vocab_parallel_cross_entropy(logits, target, group, vocab_start=0, vocab_size=40)
    assert gathered == []
    unsized = vocab_parallel_cross_entropy(logits, target, group, vocab_start=0)
    assert gathered == [1]
    assert torch.equal(sized, unsized)


def test_bad_vocab_size_names_it(device, group):
    logits = randn(4, 10, device=device)
    target = torch.zeros(4, dtype=torch.long, device=device)
    for kwargs in ({"vocab_size": 9}, {"vocab_size": 12}, {"vocab_size": 12, "vocab_start": 5},
                   {"vocab_size": True, "vocab_start": 0}):
        with pytest.raises(ValueError, match="vocab_size"):
            vocab_parallel_cross_entropy(logits, target, group, **kwargs)


def test_bad_input_names_the_argument(device, group):
    logits = randn(4, 10, device=device)
    with pytest.raises((TypeError, ValueError), match="target"):
        vocab_parallel_cross_entropy(logits, torch.zeros(5, dtype=torch.long, device=device), group, vocab_start=0)
    with pytest.raises(ValueError, match="reduction"):
        vocab_parallel_cross_entropy(logits, torch.zeros(4, dtype=torch.long, device=device), group,
                                     vocab_start=0, reduction="avg")


def test_one_rank_group_runs_no_collective(device, group, monkeypatch):
    """On a one-rank group both ops skip their all-reduces (each would return its input) and still
    give plain cross entropy's loss and gradients: the logits op with a z-loss, the fused head in
    two chunks of tokens with a bias."""
    import torch.distributed as dist

    def refuse(*args, **kwargs):
        raise AssertionError("a one-rank group ran a collective")

    monkeypatch.setattr(dist, "all_reduce", refuse)
    logits = randn(13, 40, device=device)
    target = torch.randint(0, 40, (13,), device=device)
    target[::4] = -100
    lk = leaf(logits)
    loss = vocab_parallel_cross_entropy(lk, target, group, lse_square_scale=1e-2)
    l64 = logits.detach().double().requires_grad_(True)
    lse = torch.logsumexp(l64, dim=-1)
    ref = F.cross_entropy(l64, target) + (1e-2 * lse * lse)[target != -100].mean()
    assert_close(loss, ref, torch.float32, "loss")
    loss.backward()
    ref.backward()
    assert_close(lk.grad, l64.grad, torch.float32, "dlogits")

    hidden, weight, bias = randn(13, 16, device=device), randn(40, 16, device=device), randn(40, device=device)
    leaves = [leaf(t) for t in (hidden, weight, bias)]
    loss = vocab_parallel_fused_linear_cross_entropy(*leaves[:2], target, leaves[2], group, chunk_tokens=8)
    refs = [t.detach().double().requires_grad_(True) for t in (hidden, weight, bias)]
    ref = F.cross_entropy(refs[0] @ refs[1].t() + refs[2], target)
    assert_close(loss, ref, torch.float32, "fused loss")
    loss.backward()
    ref.backward()
    for got, want, name in zip(leaves, refs, ("dhidden", "dweight", "dbias")):
        assert_close(got.grad, want.grad, torch.float32, name)


def test_a_one_rank_group_is_cross_entropy(device, world, monkeypatch):
    """A one-rank group holding the whole vocabulary runs Onca's (fused linear) cross entropy with
    the same options, never the sharded passes; a shard that is not the whole vocabulary still
    runs them."""
    calls = []

    def spy(name, real):
        return lambda *args, **kwargs: (calls.append((name, kwargs or args)), real(*args, **kwargs))[1]

    monkeypatch.setattr(op, "checked_cross_entropy", spy("cross_entropy", op.checked_cross_entropy))
    monkeypatch.setattr(op, "fused_linear_cross_entropy", spy("fused", op.fused_linear_cross_entropy))
    forward = op.vocab_parallel_cross_entropy_forward
    monkeypatch.setattr(op, "vocab_parallel_cross_entropy_forward",
                        lambda *args: (calls.append(("shard_passes", {})), forward(*args))[1])
    logits = randn(6, 30, device=device)
    target = torch.randint(0, 30, (6,), device=device)
    vocab_parallel_cross_entropy(logits, target, world, reduction="sum", lse_square_scale=1e-3,
                                 ignore_index=3)
    # (logits, target, target1d, weight, ignore_index, label_smoothing, reduction, lse_square_scale,
    #  softcap, return_z_loss, overwrite_logits, return_token_accuracy, return_predicted_tokens)
    [(name, args)] = calls
    assert name == "cross_entropy" and args[0] is logits and args[3:] == (None, 3, 0.0, "sum", 1e-3, None,
                                                                           False, False, False, False)
    calls.clear()
    hidden, weight = randn(6, 8, device=device), randn(30, 8, device=device)
    vocab_parallel_fused_linear_cross_entropy(hidden, weight, target, None, world, chunk_tokens=4,
                                              return_z_loss=True)
    assert [name for name, _ in calls] == ["fused"] and calls[0][1]["chunk_tokens"] == 4
    calls.clear()
    vocab_parallel_cross_entropy(logits, target, world, vocab_start=0, vocab_size=32)
    assert calls == [("shard_passes", {})]
