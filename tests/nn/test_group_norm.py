"""``onca.nn.GroupNorm`` is a drop-in for ``torch.nn.GroupNorm``."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import onca
from tests.helpers import SCALE, assert_close, randn

SHAPE, GROUPS = {"cpu": ((2, 8, 5, 3), 4), "gpu": ((8, 320, 64, 64), 32)}[SCALE]


@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_matches_torch_module(device, affine, dtype):
    ref = nn.GroupNorm(GROUPS, SHAPE[1], affine=affine).to(device=device, dtype=dtype)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(torch.randn(p.shape, device=device) * 0.3)
    ours = onca.nn.GroupNorm(GROUPS, SHAPE[1], affine=affine).to(device=device, dtype=dtype)
    ours.load_state_dict(ref.state_dict())
    assert isinstance(ours, nn.GroupNorm) and list(ours.state_dict()) == list(ref.state_dict())
    x = randn(*SHAPE, dtype=dtype, device=device)
    x_ref, x_ours = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_ref, y_ours = ref(x_ref), ours(x_ours)
    assert_close(y_ours, y_ref, dtype, "y")
    dy = randn(*SHAPE, dtype=dtype, device=device)
    y_ref.backward(dy)
    y_ours.backward(dy)
    assert_close(x_ours.grad, x_ref.grad, dtype, "dx")
    for (name, p_ours), p_ref in zip(ours.named_parameters(), ref.parameters()):
        assert_close(p_ours.grad, p_ref.grad, dtype, f"d{name}")
