"""Fused linear GRPO forward and backward against TRL 1.16's GRPO formulas on float64 full logits."""

from __future__ import annotations

import pytest
import torch

from onca.ops.fused_linear_grpo import LOSS_TYPES, fused_linear_grpo
from tests.helpers import randn
from tests.ops.posttrain_reference import (
    BASE,
    CHUNK,
    IGNORE,
    assert_loss_contract,
    check_against,
    logps64,
    make_inputs,
)
from tests.contract import assert_op_contract


def reference_grpo(logp, old, ref, adv, mask, loss_type, beta, eps_low, eps_high, level="token", delta=None,
                   max_len=None):
    mask = mask.to(logp.dtype)
    adv = adv.unsqueeze(1) if adv.dim() == 1 else adv
    old = logp.detach() if old is None else old
    log_ratio = logp - old
    if level == "sequence":
        log_ratio = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    coef_1 = torch.exp(log_ratio)
    coef_2 = torch.clamp(coef_1, 1 - eps_low, 1 + eps_high)
    if delta is not None:
        coef_1 = torch.clamp(coef_1, max=delta)
    per_token = -torch.min(coef_1 * adv, coef_2 * adv)
    if beta:
        per_token = per_token + beta * (torch.exp(ref - logp) - (ref - logp) - 1)
    if loss_type == "grpo":
        return ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    if loss_type == "bnpo":
        return (per_token * mask).sum() / mask.sum().clamp(min=1.0)
    if loss_type == "dr_grpo":
        return (per_token * mask).sum() / (per_token.size(0) * (max_len or per_token.size(1)))
    return (per_token * mask).sum() / mask.sum().clamp(min=1.0)


def run(dtype, device, loss_type, beta=0.0, level="token", delta=None, shape=BASE, chunk_tokens=CHUNK, bias=False,
        temperature=1.0, per_token_adv=False, ref_from_hidden=False):
    h, w, b, labels = make_inputs(shape, dtype, device, bias=bias, empty_row=1)
    n, t = labels.shape
    adv = torch.randn((n, t) if per_token_adv else (n,), device=device)
    mask = labels != IGNORE
    with torch.no_grad():
        base = logps64(h.double(), w.double(), b.double() if b is not None else None, labels, dtype, temperature)
    old = (base + 0.3 * torch.randn_like(base)) * mask  # ratios on both sides of the clip range
    rh = h + 0.2 * randn(*h.shape, dtype=dtype, device=device)
    ref = logps64(rh.double(), w.double(), None, labels, dtype, temperature).detach()
    kw = dict(ref_hidden=rh, ref_weight=w) if ref_from_hidden else dict(ref_logps=ref.float() if beta else None)
    fn = lambda h_, w_, b_: fused_linear_grpo(
        h_, w_, labels, adv, old.float(), bias=b_, beta=beta, epsilon_low=0.2, epsilon_high=0.28, delta=delta,
        loss_type=loss_type, importance_sampling_level=level, temperature=temperature, chunk_tokens=chunk_tokens,
        **kw)
    reference = lambda h64, w64, b64: reference_grpo(
        logps64(h64, w64, b64, labels, dtype, temperature), old, ref, adv.double(), mask, loss_type, beta, 0.2,
        0.28, level, delta)
    return check_against(fn, reference, h, w, b, labels, name=loss_type)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_dapo_with_kl(profile, device, dtype):
    run(dtype, device, "dapo", beta=0.05, bias=True, temperature=0.8)


@pytest.mark.parametrize("loss_type", [t for t in LOSS_TYPES if t != "dapo"])
def test_loss_types(device, loss_type):
    run(torch.float32, device, loss_type, shape=(3, 6, 8, 61), chunk_tokens=None, per_token_adv=loss_type == "bnpo")


def test_sequence_level_delta_reference_hidden(device):
    run(torch.float32, device, "grpo", beta=0.1, level="sequence", delta=1.5, shape=(2, 6, 8, 61),
        chunk_tokens=None, ref_from_hidden=True)


def test_on_policy_aux(device):
    """No old log-probs (on-policy: ratio 1); the aux metrics."""
    h, w, _, labels = make_inputs(BASE, torch.float32, device)
    adv = torch.tensor([1.0, -1.0, 0.5, 0.0], device=device)
    loss, aux = fused_linear_grpo(h, w, labels, adv, loss_type="grpo", return_aux=True)
    mask = (labels != IGNORE).double()
    torch.testing.assert_close(loss.double(), -(adv.double()).mean(), rtol=1e-6, atol=1e-6)
    assert aux["clip_ratio_region"].item() == 0.0
    per = logps64(h.double(), w.double(), None, labels, torch.float32)
    torch.testing.assert_close(aux["logps"].double(), per, rtol=1e-5, atol=1e-5)
    assert aux["entropy"].shape == labels.shape and (aux["entropy"][mask == 0] == 0).all()


def test_bad_input(device):
    h, w, _, labels = make_inputs(BASE, torch.float32, device)
    adv = torch.zeros(4, device=device)
    with pytest.raises(ValueError, match="advantages"):
        fused_linear_grpo(h, w, labels, adv[:3])
    with pytest.raises(ValueError, match="old_logps"):
        fused_linear_grpo(h, w, labels, adv, torch.zeros(4, 3, device=device))
    with pytest.raises(ValueError, match="reference"):
        fused_linear_grpo(h, w, labels, adv, beta=0.1)
    with pytest.raises(ValueError, match="loss_type"):
        fused_linear_grpo(h, w, labels, adv, loss_type="ppo")
    with pytest.raises(ValueError, match="importance_sampling_level"):
        fused_linear_grpo(h, w, labels, adv, importance_sampling_level="group")


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_op_contract(device, level):
    """Token-level ratios on the token chunks (the op opchecked here: no other test does), sequence
    level on the chunk driver."""
    h, w, _, labels = make_inputs((2, 5, 8, 24), torch.float32, device, prompt=1)
    adv, old, ref = (torch.randn(2, device=device), torch.randn(2, 5, device=device) - 3,
                     torch.randn(2, 5, device=device) - 3)
    fn = lambda h, w, labels: fused_linear_grpo(h, w, labels, adv, old, ref, beta=0.04, chunk_tokens=4,
                                                importance_sampling_level=level)
    inputs = (h.requires_grad_(), w.requires_grad_(), labels)
    if level == "token":
        assert_op_contract(fn, inputs, expect_ops={"token_loss_forward"})
    else:
        assert_loss_contract(fn, inputs)


@pytest.mark.parametrize("case", ["off_policy", "on_policy", "two_sided", "kl"])
def test_token_chunks_match_the_chunk_driver(monkeypatch, device, case, poisoned_empty, head_matmuls):
    """The gradient-in-forward token chunks give the chunk driver's loss and gradients (autograd
    through the same formulas), ties of the clipped objective included (on-policy: every ratio 1),
    on half its head matmuls (the logits once, not again in the backward); no buffer is read
    before it is written (``poisoned_empty``)."""
    from onca.ops import fused_linear_grpo as module

    h, w, b, labels = make_inputs(BASE, torch.float32, device, bias=True, empty_row=1)
    n, t = labels.shape
    adv = torch.randn(n, t, device=device)
    adv[0, :3] = 0.0
    old = None if case == "on_policy" else torch.randn(n, t, device=device) * 0.3 - 5.0
    ref = torch.randn(n, t, device=device) - 5.0
    kw = dict(delta=1.1 if case == "two_sided" else None, beta=0.05 if case == "kl" else 0.0,
              ref_logps=ref if case == "kl" else None, chunk_tokens=CHUNK, temperature=0.9)
    results = []
    for token_chunks in (True, False):
        monkeypatch.setattr(module, "use_token_chunks", lambda *a, on=token_chunks: on)
        head_matmuls.clear()
        hk, wk, bk = (t_.detach().clone().requires_grad_() for t_ in (h, w, b))
        loss = fused_linear_grpo(hk, wk, labels, adv, old, bias=bk, **kw)
        loss.backward()
        results.append((loss, hk.grad, wk.grad, bk.grad, len(head_matmuls)))
    (token, *token_grads, token_mm), (driver, *driver_grads, driver_mm) = results
    torch.testing.assert_close(token, driver, rtol=1e-5, atol=1e-6)
    for name, a, b_ in zip(("dhidden", "dweight", "dbias"), token_grads, driver_grads):
        torch.testing.assert_close(a, b_, rtol=1e-4, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")
    chunks = -(-labels.numel() // CHUNK)
    assert (token_mm, driver_mm) == (chunks, 2 * chunks)


def test_token_chunks_hold_as_many_logits_as_the_head_within_the_bounds():
    """A chunk holds as many logits as the weight has elements (each chunk reads and writes the
    weight's gradient), at least ``MIN_CHUNK_LOGITS`` (each chunk's loss terms cost launches
    whatever its size) and at most ``MAX_CHUNK_LOGITS``, never fewer than fused linear cross
    entropy's tokens; sequence chunks round down to whole sequences; ``chunk_tokens`` decides
    when given."""
    from onca.ops import _token_head
    from onca.ops.fused_linear_cross_entropy import CHUNK_TOKENS

    def chunk(vocab, width=4096, seq_len=0, chunk_tokens=0):
        return _token_head._chunks(8192, width, vocab, torch.bfloat16, False, chunk_tokens, seq_len,
                                   torch.device("cpu")).chunk

    assert chunk(128256, width=1024) == CHUNK_TOKENS  # the head's own size: 1024 tokens of logits
    assert chunk(32000, width=4096) == 4096
    assert chunk(32000, width=256) == _token_head.MIN_CHUNK_LOGITS // 32000 // 16 * 16
    largest = _token_head.MAX_CHUNK_LOGITS // 128256
    assert largest - 16 < chunk(128256, width=16384) <= largest
    assert chunk(262144, width=64) == CHUNK_TOKENS
    assert chunk(32000, width=4096, seq_len=1024) == 4096
    assert chunk(32000, width=256, seq_len=1024) == 2048
    assert chunk(32000, chunk_tokens=256) == 256
