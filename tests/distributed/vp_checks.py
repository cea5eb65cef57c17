"""Checks of vocabulary-parallel cross entropy on two ranks (run by ``test_vocab_parallel.py``):
each rank holds a slice of the vocabulary; losses and gradients are compared with the unsharded
float64 loss."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from onca import functional as OF
from tests.contract import assert_op_contract
from tests.helpers import SCALE, assert_close

IGNORE = -100
# (tokens, hidden, vocab): the vocabulary odd so that uneven shards are tested too.
TOKENS, HIDDEN, VOCAB = (13, 16, 37) if SCALE == "cpu" else (2048, 1024, 32003)
CHUNK = 4 if SCALE == "cpu" else 512


def _same_on_every_rank(t: torch.Tensor) -> torch.Tensor:
    """``t`` from rank 0 (the inputs every rank must share)."""
    dist.broadcast(t, src=0)
    return t


def _targets(device, tokens=TOKENS, vocab=VOCAB) -> torch.Tensor:
    y = torch.randint(0, vocab, (tokens,), device=device)
    y[1] = IGNORE
    y[-1] = vocab - 1  # the last class: on the last shard
    y[0] = 0
    return _same_on_every_rank(y)


def _shard_bounds(rank: int, vocab: int, even: bool) -> tuple[int, int]:
    if even:
        per = vocab // 2
        return rank * per, (rank + 1) * per
    cut = vocab // 2 + 1  # uneven: 19 and 18 classes
    return (0, cut) if rank == 0 else (cut, vocab)


def _reference_ce(logits64, y, reduction, z_scale):
    lse = torch.logsumexp(logits64, dim=-1)
    valid = y != IGNORE
    ce = F.cross_entropy(logits64, y, ignore_index=IGNORE, reduction="none")
    per = ce + torch.where(valid, z_scale * lse * lse, 0.0)
    if reduction == "none":
        return per
    return per.sum() / valid.sum() if reduction == "mean" else per.sum()


def _check_logits(rank, device, *, even=True, reduction="mean", z_scale=0.0, dtype=torch.float32, sized=False):
    vocab = VOCAB - 1 if even else VOCAB
    full = _same_on_every_rank(torch.randn(TOKENS, vocab, device=device) * 3).to(dtype)
    y = _targets(device, vocab=vocab)
    lo, hi = _shard_bounds(rank, vocab, even)
    shard = full[:, lo:hi].clone().requires_grad_()
    loss = OF.vocab_parallel_cross_entropy(shard, y, vocab_start=None if even else lo, reduction=reduction,
                                           lse_square_scale=z_scale, vocab_size=vocab if sized else None)
    ref_in = full.to(torch.float64).requires_grad_()
    ref = _reference_ce(ref_in, y, reduction, z_scale)
    seed = torch.randn_like(ref) if reduction == "none" else torch.ones_like(ref)
    _same_on_every_rank(seed)
    (loss.to(torch.float64) * seed).sum().backward()
    (ref * seed).sum().backward()
    assert loss.dtype == torch.float32
    assert_close(loss, ref.to(dtype).to(torch.float64), dtype, "loss")
    assert_close(shard.grad, ref_in.grad[:, lo:hi], dtype, "logits' gradient")


def _check_fused(rank, device, *, even=True, bias=False, z_scale=0.0, reduction="mean", dtype=torch.float32,
                 dtensor=False):
    vocab = VOCAB - 1 if even else VOCAB
    x = _same_on_every_rank(torch.randn(TOKENS, HIDDEN, device=device)).to(dtype)
    w = _same_on_every_rank(torch.randn(vocab, HIDDEN, device=device) * HIDDEN ** -0.5).to(dtype)
    b = _same_on_every_rank(torch.randn(vocab, device=device) * 0.1).to(dtype) if bias else None
    y = _targets(device, vocab=vocab)
    lo, hi = _shard_bounds(rank, vocab, even)
    xs = x.clone().requires_grad_()
    if dtensor:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor

        mesh = init_device_mesh(device.type, (2,))
        ws = torch.nn.Parameter(distribute_tensor(w, mesh, [Shard(0)]))
        bs = torch.nn.Parameter(distribute_tensor(b, mesh, [Shard(0)])) if bias else None
        loss = OF.fused_linear_cross_entropy(xs, ws, y, bs, lse_square_scale=z_scale, reduction=reduction,
                                             chunk_tokens=CHUNK)
    else:
        ws = w[lo:hi].clone().requires_grad_()
        bs = b[lo:hi].clone().requires_grad_() if bias else None
        loss = OF.vocab_parallel_fused_linear_cross_entropy(
            xs, ws, y, bs, vocab_start=None if even else lo, lse_square_scale=z_scale, reduction=reduction,
            chunk_tokens=CHUNK)
    (loss * 1.5).backward()
    x64, w64 = x.to(torch.float64).requires_grad_(), w.to(torch.float64).requires_grad_()
    b64 = b.to(torch.float64).requires_grad_() if bias else None
    logits = F.linear(x64, w64, b64)
    if dtype != torch.float32:
        logits = logits.to(dtype).to(torch.float64)  # the kernel reads logits rounded to the dtype
    ref = _reference_ce(logits, y, reduction, z_scale)
    (ref * 1.5).backward()
    assert loss.dtype == torch.float32
    assert_close(loss, ref, dtype, "loss")
    assert_close(xs.grad, x64.grad, dtype, "hidden's gradient")
    wgrad = ws.grad.to_local() if dtensor else ws.grad
    assert_close(wgrad, w64.grad[lo:hi], dtype, "the head shard's gradient")
    if bias:
        bgrad = bs.grad.to_local() if dtensor else bs.grad
        assert_close(bgrad, b64.grad[lo:hi], dtype, "the bias shard's gradient")


def _check_dtensor_logits(rank, device):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh(device.type, (2,))
    full = _same_on_every_rank(torch.randn(TOKENS, VOCAB, device=device) * 2)
    y = _targets(device)
    logits = distribute_tensor(full, mesh, [Shard(1)]).requires_grad_()  # uneven: 19 + 18
    loss = OF.vocab_parallel_cross_entropy(logits, y)
    loss.backward()
    ref_in = full.to(torch.float64).requires_grad_()
    ref = _reference_ce(ref_in, y, "mean", 0.0)
    ref.backward()
    assert_close(loss, ref, torch.float32, "loss")
    assert_close(logits.grad.full_tensor(), ref_in.grad, torch.float32, "logits' gradient")


def _check_bad_and_ignored(rank, device):
    full = _same_on_every_rank(torch.randn(TOKENS, VOCAB - 1, device=device))
    lo, hi = _shard_bounds(rank, VOCAB - 1, True)
    y = torch.full((TOKENS,), IGNORE, device=device)
    shard = full[:, lo:hi].clone().requires_grad_()
    loss = OF.vocab_parallel_cross_entropy(shard, y)
    loss.backward()
    assert torch.isnan(loss) and torch.equal(shard.grad, torch.zeros_like(shard)), "all ignored: NaN, 0 grads"
    y = _targets(device, vocab=VOCAB - 1)
    y[3] = VOCAB + 5  # outside the whole vocabulary, on no shard
    shard.grad = None
    per = OF.vocab_parallel_cross_entropy(shard, y, reduction="none")
    per.sum().backward()
    assert torch.isnan(per[3]) and torch.isfinite(per[torch.arange(TOKENS) != 3]).all()
    assert torch.isnan(shard.grad[3]).all() and torch.isfinite(shard.grad[4]).all()
    x = torch.randn(0, HIDDEN, device=device, requires_grad=True)
    w = torch.randn(4, HIDDEN, device=device, requires_grad=True)
    loss = OF.vocab_parallel_fused_linear_cross_entropy(x, w, torch.zeros(0, dtype=torch.long, device=device))
    loss.backward()
    assert torch.isnan(loss) and torch.equal(w.grad, torch.zeros_like(w))


def _check_bad_inputs(rank, device):
    import pytest

    x = torch.randn(4, HIDDEN, device=device)
    w = torch.randn(5, HIDDEN, device=device)
    y = torch.zeros(4, dtype=torch.long, device=device)
    for call, match in (
        (lambda: OF.vocab_parallel_fused_linear_cross_entropy(x, w[:, :3], y), "weight"),
        (lambda: OF.vocab_parallel_fused_linear_cross_entropy(x, w, y, reduction="none"), "reduction"),
        (lambda: OF.vocab_parallel_fused_linear_cross_entropy(x, w.double(), y), "weight"),
        (lambda: OF.vocab_parallel_fused_linear_cross_entropy(x, w, y.float()), "target"),
        (lambda: OF.vocab_parallel_cross_entropy(x, y[:3]), "target"),
        (lambda: OF.vocab_parallel_cross_entropy(x, y, lse_square_scale=-1.0), "lse_square_scale"),
        (lambda: OF.vocab_parallel_cross_entropy(x, y, vocab_start=-2), "vocab_start"),
    ):
        with pytest.raises((TypeError, ValueError), match=match):
            call()


def _check_contract(rank, device):
    full = _same_on_every_rank(torch.randn(5, 16, device=device))
    y = _same_on_every_rank(torch.tensor([0, 3, IGNORE, 15, 9], device=device))
    shard = full[:, rank * 8:(rank + 1) * 8].clone().requires_grad_()
    assert_op_contract(lambda s: OF.vocab_parallel_cross_entropy(s, y, lse_square_scale=1e-2), [shard],
                       expect_ops=("vocab_parallel_cross_entropy_forward",
                                   "vocab_parallel_cross_entropy_backward"))
    x = _same_on_every_rank(torch.randn(5, 8, device=device)).requires_grad_()
    w = torch.randn(8, 8, device=device, requires_grad=True)
    assert_op_contract(lambda a, b: OF.vocab_parallel_fused_linear_cross_entropy(a, b, y, chunk_tokens=2),
                       [x, w], expect_ops=("vocab_parallel_fused_linear_cross_entropy_forward",
                                           "scale_forward_gradient"))


CHECKS = {
    "logits_even": lambda r, d: _check_logits(r, d),
    "logits_uneven_sum_zloss": lambda r, d: _check_logits(r, d, even=False, reduction="sum", z_scale=1e-2),
    "logits_uneven_sized": lambda r, d: _check_logits(r, d, even=False, sized=True),
    "logits_none_bf16": lambda r, d: _check_logits(r, d, reduction="none", dtype=torch.bfloat16),
    "logits_dtensor": _check_dtensor_logits,
    "fused_even": lambda r, d: _check_fused(r, d),
    "fused_uneven_bias_zloss_sum": lambda r, d: _check_fused(r, d, even=False, bias=True, z_scale=1e-2,
                                                             reduction="sum"),
    "fused_bf16": lambda r, d: _check_fused(r, d, dtype=torch.bfloat16),
    "fused_dtensor_weight": lambda r, d: _check_fused(r, d, even=False, bias=True, dtensor=True),
    "bad_and_ignored": _check_bad_and_ignored,
    "bad_inputs": _check_bad_inputs,
    "op_contract": _check_contract,
}
