"""``onca.nn.AttnRes``: parameters, initialisation, and the same results as the functional op."""

from __future__ import annotations

import pytest
import torch

import onca
from tests.helpers import SCALE, assert_close, randn

HIDDEN = {"cpu": 96, "gpu": 4096}[SCALE]
SHAPE = {"cpu": (4, 2, 5, HIDDEN), "gpu": (8, 2, 2048, HIDDEN)}[SCALE]


def test_parameters_and_initialisation(device):
    m = onca.nn.AttnRes(HIDDEN, eps=1e-5).to(device)
    assert [name for name, _ in m.named_parameters()] == ["w_query", "w_norm"]
    assert torch.equal(m.w_query.detach(), torch.zeros(HIDDEN, device=device))
    assert torch.equal(m.w_norm.detach(), torch.ones(HIDDEN, device=device))
    assert m.eps == 1e-5 and repr(m) == f"AttnRes({HIDDEN}, eps=1e-05)"
    # At initialisation every source has weight 1/N: the output is their mean.
    v = randn(*SHAPE, device=device)
    assert_close(m(v), v.to(torch.float64).mean(0), torch.float32, "h")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_matches_functional(device, dtype):
    m = onca.nn.AttnRes(HIDDEN).to(device=device, dtype=dtype)
    with torch.no_grad():
        m.w_query.normal_(std=0.3)
        m.w_norm.uniform_(0.5, 1.5)
    v = randn(*SHAPE, dtype=dtype, device=device)
    v1, v2 = v.clone().requires_grad_(), v.clone().requires_grad_()
    wq, wn = (t.detach().clone().requires_grad_() for t in (m.w_query, m.w_norm))
    h_mod, h_fn = m(v1), onca.functional.attn_res(v2, wq, wn, m.eps)
    assert torch.equal(h_mod, h_fn)
    dh = randn(*h_mod.shape, dtype=dtype, device=device)
    h_mod.backward(dh)
    h_fn.backward(dh)
    assert torch.equal(v1.grad, v2.grad)
    assert torch.equal(m.w_query.grad, wq.grad) and torch.equal(m.w_norm.grad, wn.grad)
    # The query moves from its zero start: its gradient is non-zero.
    assert m.w_query.grad.abs().max() > 0


def test_bad_arguments():
    with pytest.raises(ValueError, match="hidden_size must be a positive int"):
        onca.nn.AttnRes(0)
    with pytest.raises(ValueError, match="hidden_size must be a positive int"):
        onca.nn.AttnRes(64.0)
    with pytest.raises(ValueError, match="eps must be a non-negative number"):
        onca.nn.AttnRes(64, eps=-1.0)
