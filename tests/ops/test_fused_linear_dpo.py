"""Fused linear DPO forward and backward against TRL 1.16's DPO formulas on float64 full logits."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from onca.ops import _paired_head
from onca.ops.fused_linear_dpo import LOSS_TYPES, dpo_loss_grads, dpo_losses, fused_linear_dpo
from tests.contract import assert_op_contract
from tests.helpers import leaf, randn
from tests.ops.posttrain_reference import (
    BASE,
    CHUNK,
    IGNORE,
    assert_loss_contract,
    check_against,
    logps64,
    make_inputs,
)


def reference_dpo(pi, ref, mask, loss_type, beta, ls=0.0, nll_weight=0.0):
    """TRL 1.16 ``DPOTrainer`` on per-token float64 log-probabilities (``(2B, T)``)."""
    b = pi.shape[0] // 2
    sums, ref_sums, n = pi.sum(-1), ref.sum(-1), mask.sum(-1).to(pi.dtype).clamp(min=1)
    clr, rlr = sums[:b] - ref_sums[:b], sums[b:] - ref_sums[b:]
    d = beta * (clr - rlr)
    if loss_type == "sigmoid":
        losses = -F.logsigmoid(d)
    elif loss_type == "hinge":
        losses = torch.relu(1 - d)
    elif loss_type == "ipo":
        losses = (clr / n[:b] - rlr / n[b:] - 1 / (2 * beta)) ** 2
    elif loss_type == "robust":
        losses = (-(1 - ls) * F.logsigmoid(d) + ls * F.logsigmoid(-d)) / (1 - 2 * ls)
    elif loss_type == "exo_pair":
        losses = (torch.sigmoid(d) * (F.logsigmoid(d) - math.log(1 - ls))
                  + torch.sigmoid(-d) * (F.logsigmoid(-d) - math.log(ls)))
    elif loss_type == "nca_pair":
        losses = (-F.logsigmoid(beta * clr) - 0.5 * F.logsigmoid(-beta * clr) - 0.5 * F.logsigmoid(-beta * rlr))
    elif loss_type == "bco_pair":
        losses = -F.logsigmoid(beta * clr) - F.logsigmoid(-beta * rlr)
    elif loss_type == "sppo_hard":
        losses = (clr - 0.5 / beta) ** 2 + (rlr + 0.5 / beta) ** 2
    elif loss_type == "apo_zero":
        losses = (1 - torch.sigmoid(beta * clr)) + torch.sigmoid(beta * rlr)
    elif loss_type == "apo_down":
        losses = torch.sigmoid(beta * clr) + (1 - torch.sigmoid(beta * (clr - rlr)))
    elif loss_type == "sigmoid_norm":
        losses = -F.logsigmoid(beta * (clr / n[:b] - rlr / n[b:]))
    loss = losses.mean()
    if nll_weight:
        loss = loss - nll_weight * pi[:b][mask[:b]].mean()
    return loss


def run(dtype, device, loss_type="sigmoid", beta=0.1, ls=0.0, nll_weight=0.0, bias=False, shape=BASE,
        empty_row=None, precomputed=False, chunk_tokens=CHUNK):
    h, w, b, labels = make_inputs(shape, dtype, device, bias=bias, empty_row=empty_row)
    rh = randn(*h.shape[:-1], 12, dtype=dtype, device=device)  # the reference's own hidden size
    rw = randn(w.shape[0], 12, dtype=dtype, device=device, std=12 ** -0.5 * 2)
    ref = logps64(rh.double(), rw.double(), None, labels, dtype).detach()
    n = shape[0] // 2
    kwargs = dict(beta=beta, loss_type=loss_type, label_smoothing=ls, nll_weight=nll_weight, chunk_tokens=chunk_tokens)
    if precomputed:
        sums = ref.sum(-1).float()
        fn = lambda h_, w_, b_: fused_linear_dpo(h_, w_, labels, bias=b_, ref_chosen_logps=sums[:n],
                                                 ref_rejected_logps=sums[n:], **kwargs)
    else:
        fn = lambda h_, w_, b_: fused_linear_dpo(h_, w_, labels, rh, rw, bias=b_, **kwargs)

    def reference(h64, w64, b64):
        pi = logps64(h64, w64, b64, labels, dtype)
        return reference_dpo(pi, ref, labels != IGNORE, loss_type, beta, ls, nll_weight)

    return check_against(fn, reference, h, w, b, labels, name=loss_type)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_sigmoid(profile, device, dtype):
    run(dtype, device, bias=True, nll_weight=0.5, empty_row=2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_sigmoid_on_pair_chunks(profile, device, dtype, paired_calls):
    """The gradient computed in the forward pass, one pair per chunk (an ignored sequence, a bias,
    the NLL term), against the same reference."""
    run(dtype, device, bias=True, nll_weight=0.5, empty_row=2, chunk_tokens=None)
    assert paired_calls == [1, 1]


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_closed_form_pair_gradients(loss_type):
    """The pair-aligned path's derivatives of each loss type against autograd of the loss itself,
    at margins on both sides of every kink (hinge's at 1)."""
    ls = {"robust": 0.1, "exo_pair": 0.2}.get(loss_type, 0.0)
    clr = torch.tensor([-30.0, -3.0, -0.4, 0.0, 0.7, 2.5, 40.0], dtype=torch.float64, requires_grad=True)
    rlr = torch.tensor([5.0, -1.0, 0.9, -0.3, -6.0, 0.1, -2.0], dtype=torch.float64, requires_grad=True)
    nc = torch.tensor([1.0, 4, 9, 2, 7, 3, 5], dtype=torch.float64)
    nr = torch.tensor([3.0, 1, 2, 8, 5, 6, 1], dtype=torch.float64)
    losses = dpo_losses(loss_type, 0.5, ls, clr, rlr, nc, nr)
    want_c, want_r = torch.autograd.grad(losses.sum(), (clr, rlr))
    got, got_c, got_r = dpo_loss_grads(loss_type, 0.5, ls, clr.detach(), rlr.detach(), nc, nr)
    torch.testing.assert_close(got, losses.detach())
    torch.testing.assert_close(got_c, want_c)
    torch.testing.assert_close(got_r, want_r)


def test_pair_chunks_only_where_they_pay(monkeypatch, device, paired_calls):
    """fp16, no gradient, a chunk_tokens override, or a pair too large for the free memory: the
    two-pass driver."""
    h, w, _, labels = make_inputs(BASE, torch.float32, device)
    rh, rw = h + 0.1, w.clone()
    fused_linear_dpo(leaf(h.half()), leaf(w.half()), labels, rh.half(), rw.half())
    fused_linear_dpo(h, w, labels, rh, rw)
    fused_linear_dpo(leaf(h), leaf(w), labels, rh, rw, chunk_tokens=64)
    monkeypatch.setattr(_paired_head, "MAX_PAIR_SCRATCH_BYTES", 1000)
    fused_linear_dpo(leaf(h), leaf(w), labels, rh, rw)
    assert paired_calls == []
    monkeypatch.undo()


@pytest.mark.parametrize("loss_type", [t for t in LOSS_TYPES if t != "sigmoid"])
def test_loss_types(device, loss_type):
    ls = {"robust": 0.1, "exo_pair": 0.2}.get(loss_type, 0.0)
    run(torch.float32, device, loss_type=loss_type, beta=0.5, ls=ls, shape=(4, 6, 8, 61), chunk_tokens=None)


def test_precomputed_reference_one_pair(device):
    """B = 1, the reference as precomputed sums, bf16, one chunk."""
    run(torch.bfloat16, device, shape=(2, 6, 16, 311), precomputed=True, chunk_tokens=None)


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "pair_chunks"])
def test_aux(device, grad):
    h, w, _, labels = make_inputs(BASE, torch.float32, device)
    rh, rw = h + 0.1 * torch.randn_like(h), w.clone()
    _, aux = fused_linear_dpo(leaf(h) if grad else h, w, labels, rh, rw, beta=0.2, return_aux=True)
    pi = logps64(h.double(), w.double(), None, labels, torch.float32).sum(-1)
    ref = logps64(rh.double(), rw.double(), None, labels, torch.float32).sum(-1)
    n = h.shape[0] // 2
    torch.testing.assert_close(aux["chosen_logps"].double(), pi[:n], rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(aux["ref_rejected_logps"].double(), ref[n:], rtol=1e-5, atol=1e-4)
    rewards = 0.2 * (pi - ref)
    torch.testing.assert_close(aux["chosen_rewards"].double(), rewards[:n], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(aux["reward_margins"].double(), rewards[:n] - rewards[n:], rtol=1e-4, atol=1e-4)
    assert torch.equal(aux["reward_accuracies"], (aux["chosen_rewards"] > aux["rejected_rewards"]).float())
    mask = labels != IGNORE
    nll = -logps64(h.double(), w.double(), None, labels, torch.float32)[:n][mask[:n]].mean()
    torch.testing.assert_close(aux["nll_loss"].double(), nll, rtol=1e-5, atol=1e-5)


def test_bad_input(device):
    h, w, _, labels = make_inputs(BASE, torch.float32, device)
    with pytest.raises(ValueError, match="even"):
        fused_linear_dpo(h[:3], w, labels[:3], h[:3], w)
    with pytest.raises(ValueError, match="hidden"):
        fused_linear_dpo(h[0], w, labels[0], h[0], w)
    with pytest.raises(ValueError, match="labels"):
        fused_linear_dpo(h, w, labels[:, 1:], h, w)
    with pytest.raises(ValueError, match="ref_hidden"):
        fused_linear_dpo(h, w, labels, h[:, 1:], w)
    with pytest.raises(ValueError, match="loss_type"):
        fused_linear_dpo(h, w, labels, h, w, loss_type="nope")
    with pytest.raises(ValueError, match="beta"):
        fused_linear_dpo(h, w, labels, h, w, beta=0.0)
    with pytest.raises(ValueError, match="reference"):
        fused_linear_dpo(h, w, labels)
    with pytest.raises(ValueError, match="ref_chosen_logps"):
        fused_linear_dpo(h, w, labels, ref_chosen_logps=torch.zeros(3), ref_rejected_logps=torch.zeros(2))
    with pytest.raises(ValueError, match="label_smoothing"):
        fused_linear_dpo(h, w, labels, h, w, loss_type="robust", label_smoothing=0.5)


def test_op_contract(device):
    h, w, b, labels = make_inputs((2, 5, 8, 24), torch.float32, device, bias=True, prompt=1)
    rh, rw = randn(2, 5, 6, device=device), randn(24, 6, device=device)

    def fn(h, w, b, labels, rh, rw):
        return fused_linear_dpo(h, w, labels, rh, rw, bias=b, nll_weight=0.3, chunk_tokens=4)

    assert_loss_contract(fn, (h.requires_grad_(), w.requires_grad_(), b.requires_grad_(), labels, rh, rw))


def test_op_contract_on_pair_chunks(device, paired_calls):
    h, w, b, labels = make_inputs((4, 5, 8, 24), torch.float32, device, bias=True, prompt=1)
    rh, rw = randn(4, 5, 6, device=device), randn(24, 6, device=device)

    def fn(h, w, b, labels, rh, rw):
        return fused_linear_dpo(h, w, labels, rh, rw, bias=b, nll_weight=0.3, loss_type="ipo")

    assert_op_contract(fn, (h.requires_grad_(), w.requires_grad_(), b.requires_grad_(), labels, rh, rw),
                       expect_ops={"paired_loss_forward", "chunked_logprob_forward"})
    assert paired_calls
