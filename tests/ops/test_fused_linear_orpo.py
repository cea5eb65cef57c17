"""Fused linear ORPO forward and backward against TRL 1.16's ORPO formula on float64 full logits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from onca.ops.fused_linear_orpo import fused_linear_orpo, odds_ratio_grads, odds_ratios
from tests.ops.posttrain_reference import (
    BASE,
    CHUNK,
    IGNORE,
    assert_loss_contract,
    check_against,
    logps64,
    make_inputs,
)


def log1mexp(x):
    return torch.log(-torch.expm1(x))


def reference_orpo(pi, mask, beta, nll_weight=1.0):
    b = pi.shape[0] // 2
    n = mask.sum(-1)
    avg = pi.sum(-1) / n.clamp(min=1)
    log_odds = (avg[:b] - avg[b:]) - (log1mexp(avg[:b]) - log1mexp(avg[b:]))
    present = (n[:b] > 0) & (n[b:] > 0)
    ratio = torch.where(present, F.logsigmoid(torch.where(present, log_odds, 0.0)), 0.0)
    return nll_weight * -pi[:b][mask[:b]].mean() - beta * ratio.mean()


@pytest.mark.parametrize("chunk_tokens", [CHUNK, None], ids=["two-pass", "pairs"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_matches_reference(profile, device, dtype, chunk_tokens, paired_calls):
    h, w, b, labels = make_inputs(BASE, dtype, device, bias=True)
    fn = lambda h_, w_, b_: fused_linear_orpo(h_, w_, labels, bias=b_, beta=0.5, chunk_tokens=chunk_tokens)
    ref = lambda h64, w64, b64: reference_orpo(logps64(h64, w64, b64, labels, dtype), labels != IGNORE, 0.5)
    check_against(fn, ref, h, w, b, labels)
    assert paired_calls == ([] if chunk_tokens else [1, 1])


@pytest.mark.parametrize("chunk_tokens", [CHUNK, None], ids=["two-pass", "pairs"])
def test_empty_sequence_one_pair(device, chunk_tokens):
    """A rejected sequence with every label ignored: its pair has no odds term (finite gradients)."""
    h, w, _, labels = make_inputs((2, 7, 12, 97), torch.float32, device, empty_row=1)
    fn = lambda h_, w_, b_: fused_linear_orpo(h_, w_, labels, beta=1.0, nll_weight=0.3, chunk_tokens=chunk_tokens)
    ref = lambda h64, w64, b64: reference_orpo(logps64(h64, w64, None, labels, torch.float32),
                                               labels != IGNORE, 1.0, 0.3)
    check_against(fn, ref, h, w, None, labels)


def test_closed_form_pair_gradients():
    """The pair-aligned path's derivatives against autograd of the odds ratio, near 0 and far below
    it, on both sides of log1mexp's switch at -log 2, and for a pair without odds."""
    avg_c = torch.tensor([-0.01, -0.5, -0.69, -0.7, -3.0, -12.0, -1.0], dtype=torch.float64, requires_grad=True)
    avg_r = torch.tensor([-2.0, -0.2, -0.71, -9.0, -0.05, -11.0, -1.5], dtype=torch.float64, requires_grad=True)
    present = torch.tensor([True] * 6 + [False])
    log_odds, ratio = odds_ratios(avg_c, avg_r, present)
    want_c, want_r = torch.autograd.grad(ratio.sum(), (avg_c, avg_r))
    got, got_c, got_r = odds_ratio_grads(avg_c.detach(), avg_r.detach(), present)
    torch.testing.assert_close(got, ratio.detach())
    torch.testing.assert_close(got_c, want_c)
    torch.testing.assert_close(got_r, want_r)
    assert got_c[-1] == 0 and got_r[-1] == 0


def test_aux_and_bad_input(device):
    h, w, _, labels = make_inputs(BASE, torch.float32, device)
    _, aux = fused_linear_orpo(h, w, labels, return_aux=True)
    mask = labels != IGNORE
    pi = logps64(h.double(), w.double(), None, labels, torch.float32)
    avg = pi.sum(-1) / mask.sum(-1)
    log_odds = (avg[:2] - avg[2:]) - (log1mexp(avg[:2]) - log1mexp(avg[2:]))
    torch.testing.assert_close(aux["log_odds_chosen"].double(), log_odds.mean(), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(aux["log_odds_ratio"].double(), F.logsigmoid(log_odds).mean(), rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="even"):
        fused_linear_orpo(h[:1], w, labels[:1])
    with pytest.raises(ValueError, match="nll_weight"):
        fused_linear_orpo(h, w, labels, nll_weight=-1.0)


def test_op_contract(device):
    h, w, _, labels = make_inputs((2, 5, 8, 24), torch.float32, device, prompt=1)
    fn = lambda h, w, labels: fused_linear_orpo(h, w, labels, chunk_tokens=4)
    assert_loss_contract(fn, (h.requires_grad_(), w.requires_grad_(), labels))


def test_op_contract_on_pair_chunks(device, paired_calls):
    h, w, _, labels = make_inputs((4, 5, 8, 24), torch.float32, device, prompt=1)
    fn = lambda h, w, labels: fused_linear_orpo(h, w, labels)
    assert_loss_contract(fn, (h.requires_grad_(), w.requires_grad_(), labels), expect_ops=("paired_loss_forward",))
    assert paired_calls
