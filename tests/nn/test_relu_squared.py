"""``onca.nn.ReLUSquared`` computes transformers' ``relu2`` activation (no parameters)."""

from __future__ import annotations

import torch

import onca
from tests.helpers import randn


def test_module(device):
    m = onca.nn.ReLUSquared()
    assert list(m.state_dict()) == []
    x = randn(3, 40, device=device)
    torch.testing.assert_close(m(x), torch.relu(x).square())
