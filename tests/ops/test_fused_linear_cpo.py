"""Fused linear CPO forward and backward against TRL 1.16's CPO formulas on float64 full logits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from onca.ops.fused_linear_cpo import LOSS_TYPES, cpo_loss_grads, cpo_losses, fused_linear_cpo
from tests.ops.posttrain_reference import (
    BASE,
    CHUNK,
    IGNORE,
    assert_loss_contract,
    check_against,
    logps64,
    make_inputs,
)


def reference_cpo(pi, mask, loss_type, beta, gamma=0.5, ls=0.0, nll_weight=1.0):
    b = pi.shape[0] // 2
    seq = pi.sum(-1)
    if loss_type in ("ipo", "simpo"):
        seq = seq / mask.sum(-1).clamp(min=1)
    x = seq[:b] - seq[b:]
    if loss_type == "simpo":
        x = x - gamma / beta
    if loss_type in ("sigmoid", "simpo"):
        losses = -F.logsigmoid(beta * x) * (1 - ls) - F.logsigmoid(-beta * x) * ls
    elif loss_type == "hinge":
        losses = torch.relu(1 - beta * x)
    else:
        losses = (x - 1 / (2 * beta)) ** 2
    return losses.mean() + nll_weight * -pi[:b][mask[:b]].mean()


def run(dtype, device, loss_type, beta=0.1, ls=0.0, nll_weight=1.0, bias=False, shape=BASE, empty_row=None,
        chunk_tokens=CHUNK):
    h, w, b, labels = make_inputs(shape, dtype, device, bias=bias, empty_row=empty_row)
    fn = lambda h_, w_, b_: fused_linear_cpo(h_, w_, labels, bias=b_, beta=beta, loss_type=loss_type,
                                             label_smoothing=ls, nll_weight=nll_weight, chunk_tokens=chunk_tokens)
    ref = lambda h64, w64, b64: reference_cpo(logps64(h64, w64, b64, labels, dtype),
                                              labels != IGNORE, loss_type, beta, ls=ls, nll_weight=nll_weight)
    return check_against(fn, ref, h, w, b, labels, name=loss_type)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_sigmoid(profile, device, dtype):
    run(dtype, device, "sigmoid", ls=0.1, bias=True, empty_row=3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_sigmoid_on_pair_chunks(profile, device, dtype, paired_calls):
    """The gradient computed in the forward pass, one pair per chunk (an ignored sequence, a bias,
    label smoothing, the NLL term), against the same reference."""
    run(dtype, device, "sigmoid", ls=0.1, bias=True, empty_row=3, chunk_tokens=None)
    assert paired_calls == [1, 1]


@pytest.mark.parametrize("chunk_tokens", [CHUNK, None], ids=["two-pass", "pairs"])
@pytest.mark.parametrize("loss_type", ["hinge", "ipo", "simpo"])
def test_loss_types(device, loss_type, chunk_tokens, paired_calls):
    run(torch.float32, device, loss_type, beta=0.5, nll_weight=0.0 if loss_type == "ipo" else 1.0,
        shape=(2, 6, 8, 61), chunk_tokens=chunk_tokens)
    assert paired_calls == ([] if chunk_tokens else [1])


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_closed_form_pair_gradients(loss_type):
    """The pair-aligned path's derivatives against autograd of the loss, on both sides of the
    hinge's kink (beta x = 1 at x = 2) and SimPO's margin."""
    x = torch.tensor([-30.0, -3.0, -0.4, 0.0, 0.7, 1.4, 2.0, 2.5, 40.0], dtype=torch.float64, requires_grad=True)
    losses = cpo_losses(loss_type, 0.5, 0.7, 0.15, x)
    (want,) = torch.autograd.grad(losses.sum(), x)
    got, got_dx = cpo_loss_grads(loss_type, 0.5, 0.7, 0.15, x.detach())
    torch.testing.assert_close(got, losses.detach())
    torch.testing.assert_close(got_dx, want)


def test_aux_and_bad_input(device):
    h, w, _, labels = make_inputs(BASE, torch.float32, device)
    _, aux = fused_linear_cpo(h, w, labels, beta=0.3, return_aux=True)
    pi = logps64(h.double(), w.double(), None, labels, torch.float32).sum(-1)
    torch.testing.assert_close(aux["rejected_rewards"].double(), 0.3 * pi[2:], rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="loss_type"):
        fused_linear_cpo(h, w, labels, loss_type="kto")
    with pytest.raises(ValueError, match="even"):
        fused_linear_cpo(h[:1], w, labels[:1])
    with pytest.raises(ValueError, match="label_smoothing"):
        fused_linear_cpo(h, w, labels, label_smoothing=0.7)


def test_op_contract(device):
    h, w, _, labels = make_inputs((2, 5, 8, 24), torch.float32, device, prompt=1)
    fn = lambda h, w, labels: fused_linear_cpo(h, w, labels, loss_type="simpo", chunk_tokens=4)
    assert_loss_contract(fn, (h.requires_grad_(), w.requires_grad_(), labels))


def test_op_contract_on_pair_chunks(device, paired_calls):
    h, w, _, labels = make_inputs((4, 5, 8, 24), torch.float32, device, prompt=1)
    fn = lambda h, w, labels: fused_linear_cpo(h, w, labels, loss_type="hinge")
    assert_loss_contract(fn, (h.requires_grad_(), w.requires_grad_(), labels), expect_ops=("paired_loss_forward",))
    assert paired_calls
