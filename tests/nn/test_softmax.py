"""``onca.nn.Softmax`` is a drop-in for ``torch.nn.Softmax`` (over the last dimension by default)."""

from __future__ import annotations

import torch

import onca
from tests.helpers import randn


def test_module(device):
    m = onca.nn.Softmax()
    assert isinstance(m, torch.nn.Softmax) and m.dim == -1 and list(m.state_dict()) == []
    x = randn(3, 40, device=device)
    torch.testing.assert_close(m(x), torch.softmax(x, -1))
    torch.testing.assert_close(onca.nn.Softmax(0)(x), torch.softmax(x, 0))
