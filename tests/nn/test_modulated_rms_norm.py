"""``onca.nn.ModulatedRMSNorm`` fuses an RMSNorm module with the modulation that follows it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import onca
from tests.helpers import SCALE, assert_close, randn

HIDDEN = {"cpu": 96, "gpu": 3072}[SCALE]
SHAPE = {"cpu": (2, 5, HIDDEN), "gpu": (4, 2048, HIDDEN)}[SCALE]


class RMSNormThenModulate(nn.Module):
    """VibeVoice's diffusion-head pattern: a Llama-style RMSNorm, then ``* (1 + scale) + shift``."""

    def __init__(self, hidden, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.variance_epsilon = eps

    def forward(self, x, scale, shift):
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return (self.weight * h.to(x.dtype)) * (1 + scale) + shift


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_matches_norm_then_modulation(device, dtype):
    ref = RMSNormThenModulate(HIDDEN).to(device)  # fp32 modulation: the fused op rounds once
    with torch.no_grad():
        ref.weight.add_(torch.randn(HIDDEN, device=device) * 0.3)
    ours = onca.nn.ModulatedRMSNorm(HIDDEN).to(device=device, dtype=dtype)
    result = ours.load_state_dict(ref.state_dict())
    assert not result.missing_keys and not result.unexpected_keys
    x = randn(*SHAPE, dtype=dtype, device=device)
    scale = randn(SHAPE[0], 1, HIDDEN, dtype=dtype, device=device, std=0.3)
    shift = randn(SHAPE[0], 1, HIDDEN, dtype=dtype, device=device, std=0.3)
    refs = [t.clone().requires_grad_() for t in (x, scale, shift)]
    ours_in = [t.clone().requires_grad_() for t in (x, scale, shift)]
    # The reference's weight in the input dtype (as the model's), the modulation in fp32.
    ref.weight.data = ref.weight.data.to(dtype)
    y_ref = ref(refs[0], refs[1].float(), refs[2].float())
    y_ours = ours(*ours_in)
    assert y_ours.dtype == dtype
    assert_close(y_ours, y_ref, dtype, "y")
    dy = randn(*SHAPE, dtype=dtype, device=device)
    y_ref.backward(dy.float())
    y_ours.backward(dy)
    for name, a, b in zip(("dx", "dscale", "dshift"), ours_in, refs):
        assert a.grad.dtype == dtype
        assert_close(a.grad, b.grad, dtype, name)
    assert_close(ours.weight.grad, ref.weight.grad, dtype, "dweight")


def test_state_dict_is_rms_norms():
    m = onca.nn.ModulatedRMSNorm(16, elementwise_affine=False)
    assert m.weight is None and list(m.state_dict()) == []
    assert list(onca.nn.ModulatedRMSNorm(16).state_dict()) == ["weight"]
