"""``onca.nn.DyT`` matches the DyT paper's ``DynamicTanh`` module and loads its state dict."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import onca
from tests.helpers import SCALE, assert_close, randn

HIDDEN = {"cpu": 96, "gpu": 4096}[SCALE]
SHAPE = {"cpu": (2, 5, HIDDEN), "gpu": (4, 2048, HIDDEN)}[SCALE]


class DynamicTanh(nn.Module):
    """The paper's module (github.com/jiachenzhu/DyT), channels last."""

    def __init__(self, normalized_shape, alpha_init_value=0.5):
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(1) * alpha_init_value)
        self.weight = nn.Parameter(torch.ones(normalized_shape))
        self.bias = nn.Parameter(torch.zeros(normalized_shape))

    def forward(self, x):
        return torch.tanh(self.alpha * x) * self.weight + self.bias


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_matches_the_paper_module(device, dtype):
    ref = DynamicTanh(HIDDEN).to(device=device, dtype=dtype)
    with torch.no_grad():
        ref.weight.add_(torch.randn(HIDDEN, device=device) * 0.3)
        ref.bias.add_(torch.randn(HIDDEN, device=device) * 0.3)
    ours = onca.nn.DyT(HIDDEN).to(device=device, dtype=dtype)
    result = ours.load_state_dict(ref.state_dict())
    assert not result.missing_keys and not result.unexpected_keys
    x = randn(*SHAPE, dtype=dtype, device=device, std=2.0)
    x_ref, x_ours = x.clone().requires_grad_(), x.clone().requires_grad_()
    # The reference in fp32 from the same parameters: the eager bf16 module rounds at each step.
    with torch.no_grad():
        ref32 = DynamicTanh(HIDDEN).to(device)
        ref32.load_state_dict({k: v.float() for k, v in ref.state_dict().items()})
    y_ref, y_ours = ref32(x_ref.float()), ours(x_ours)
    assert y_ours.dtype == dtype
    assert_close(y_ours, y_ref, dtype, "y")
    dy = randn(*SHAPE, dtype=dtype, device=device)
    y_ref.backward(dy.float())
    y_ours.backward(dy)
    assert_close(x_ours.grad, x_ref.grad, dtype, "dx")
    for (name, p_ours), p_ref in zip(ours.named_parameters(), ref32.parameters()):
        assert p_ours.grad.dtype == dtype and p_ours.grad.shape == p_ref.shape
        assert_close(p_ours.grad, p_ref.grad, dtype, f"d{name}")


def test_options_and_repr():
    m = onca.nn.DyT(8, alpha_init_value=0.7, bias=False, alpha_per_channel=True)
    assert m.alpha.shape == (8,) and torch.equal(m.alpha.detach(), torch.full((8,), 0.7))
    assert m.bias is None and list(m.state_dict()) == ["alpha", "weight"]
    assert "alpha_per_channel=True" in repr(m)
    with pytest.raises(ValueError, match="hidden_size"):
        onca.nn.DyT(0)
