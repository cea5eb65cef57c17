"""``onca.nn.PolyNorm`` matches PolyCom's ``PolyNorm`` module and loads its state dict."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import onca
from tests.helpers import SCALE, assert_close, randn

SHAPE = {"cpu": (2, 5, 96), "gpu": (4, 2048, 14336)}[SCALE]


class PolyComPolyNorm(nn.Module):
    """PolyCom's reference module (github.com/BryceZhuo/PolyCom)."""

    def __init__(self, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(3) / 3)
        self.bias = nn.Parameter(torch.zeros(1))
        self.eps = eps

    def _norm(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x):
        return self.weight[0] * self._norm(x**3) + self.weight[1] * self._norm(x**2) + self.weight[2] * self._norm(x) \
            + self.bias


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_matches_the_polycom_module(device, dtype):
    ref = PolyComPolyNorm().to(device)  # fp32: the eager module in bf16 rounds at every step
    with torch.no_grad():
        ref.weight.copy_(torch.tensor([0.2, -0.4, 0.9]))
        ref.bias.fill_(0.3)
    ours = onca.nn.PolyNorm().to(device=device, dtype=dtype)
    result = ours.load_state_dict(ref.state_dict())
    assert not result.missing_keys and not result.unexpected_keys
    x = randn(*SHAPE, dtype=dtype, device=device)
    x_ref, x_ours = x.float().clone().requires_grad_(), x.clone().requires_grad_()
    y_ref, y_ours = ref(x_ref), ours(x_ours)
    assert y_ours.dtype == dtype
    assert_close(y_ours, y_ref, dtype, "y")
    dy = randn(*SHAPE, dtype=dtype, device=device)
    y_ref.backward(dy.float())
    y_ours.backward(dy)
    assert_close(x_ours.grad, x_ref.grad, dtype, "dx")
    for (name, p_ours), p_ref in zip(ours.named_parameters(), ref.parameters()):
        assert p_ours.grad.dtype == dtype and p_ours.grad.shape == p_ref.shape
        assert_close(p_ours.grad, p_ref.grad, dtype, f"d{name}")


def test_defaults():
    m = onca.nn.PolyNorm()
    assert torch.allclose(m.weight.detach(), torch.full((3,), 1 / 3)) and torch.equal(m.bias.detach(), torch.zeros(1))
    assert list(m.state_dict()) == ["weight", "bias"] and m.variance_epsilon == 1e-6
