"""Fused linear SimPO forward and backward against the SimPO formula on float64 full logits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from onca.ops.fused_linear_simpo import fused_linear_simpo
from tests.ops.posttrain_reference import (
    BASE,
    CHUNK,
    IGNORE,
    assert_loss_contract,
    check_against,
    logps64,
    make_inputs,
)


def reference_simpo(pi, mask, beta, gamma, ls=0.0, nll_weight=0.0):
    b = pi.shape[0] // 2
    avg = pi.sum(-1) / mask.sum(-1).clamp(min=1)
    margin = beta * (avg[:b] - avg[b:]) - gamma
    loss = (-(1 - ls) * F.logsigmoid(margin) - ls * F.logsigmoid(-margin)).mean()
    if nll_weight:
        loss = loss - nll_weight * pi[:b][mask[:b]].mean()
    return loss


@pytest.mark.parametrize("chunk_tokens", [CHUNK, None], ids=["two-pass", "pairs"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_matches_reference(profile, device, dtype, chunk_tokens, paired_calls):
    h, w, b, labels = make_inputs(BASE, dtype, device, bias=True, empty_row=0)
    fn = lambda h_, w_, b_: fused_linear_simpo(h_, w_, labels, bias=b_, beta=2.5, gamma=0.7,
                                               chunk_tokens=chunk_tokens)
    ref = lambda h64, w64, b64: reference_simpo(logps64(h64, w64, b64, labels, dtype), labels != IGNORE,
                                                2.5, 0.7)
    check_against(fn, ref, h, w, b, labels)
    assert paired_calls == ([] if chunk_tokens else [1, 1])


def test_smoothing_nll_one_pair(device):
    h, w, _, labels = make_inputs((2, 7, 12, 97), torch.float32, device)
    fn = lambda h_, w_, b_: fused_linear_simpo(h_, w_, labels, label_smoothing=0.2, nll_weight=0.5)
    ref = lambda h64, w64, b64: reference_simpo(logps64(h64, w64, None, labels, torch.float32),
                                                labels != IGNORE, 2.0, 0.5, 0.2, 0.5)
    check_against(fn, ref, h, w, None, labels)


def test_aux_and_bad_input(device):
    h, w, _, labels = make_inputs(BASE, torch.float32, device)
    _, aux = fused_linear_simpo(h, w, labels, return_aux=True)
    mask = labels != IGNORE
    avg = logps64(h.double(), w.double(), None, labels, torch.float32).sum(-1) / mask.sum(-1)
    torch.testing.assert_close(aux["chosen_logps"].double(), avg[:2], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="even"):
        fused_linear_simpo(h[:3], w, labels[:3])
    with pytest.raises(ValueError, match="beta"):
        fused_linear_simpo(h, w, labels, beta=-1.0)
    with pytest.raises(TypeError, match="gamma"):
        fused_linear_simpo(h, w, labels, gamma="0.5")


def test_op_contract(device):
    h, w, _, labels = make_inputs((2, 5, 8, 24), torch.float32, device, prompt=1)
    fn = lambda h, w, labels: fused_linear_simpo(h, w, labels, nll_weight=0.1, chunk_tokens=4)
    assert_loss_contract(fn, (h.requires_grad_(), w.requires_grad_(), labels))
