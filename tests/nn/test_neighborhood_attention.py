"""``onca.nn.NeighborhoodAttention`` against the same module computed with masked full attention."""

from __future__ import annotations

import pytest
import torch

import onca
from tests.helpers import assert_close, randn
from tests.ops.test_neighborhood_attention import neighborhood_mask


def test_module_matches_masked_attention(device):
    torch.manual_seed(0)
    module = onca.nn.NeighborhoodAttention(32, 4, kernel_size=5, dilation=2).to(device)
    assert set(dict(module.named_parameters())) == {
        f"{p}_proj.{w}" for p in ("q", "k", "v", "out") for w in ("weight", "bias")}
    x = randn(2, 11, 32, device=device, requires_grad=True)
    out = module(x)
    out.square().sum().backward()
    grads = [p.grad.clone() for p in module.parameters()]
    dx = x.grad.clone()
    module.zero_grad()
    x.grad = None

    def split(t):
        return t.view(2, 11, 4, 8).transpose(1, 2)

    q, k, v = split(module.q_proj(x)), split(module.k_proj(x)), split(module.v_proj(x))
    mask = neighborhood_mask(11, 5, 2, device)
    scores = (q @ k.transpose(-1, -2)) * module.scale
    attn = torch.softmax(scores.masked_fill(~mask, float("-inf")), -1) @ v
    ref = module.out_proj(attn.transpose(1, 2).reshape(2, 11, 32))
    assert_close(out, ref, torch.float32, "out")
    ref.square().sum().backward()
    assert_close(dx, x.grad, torch.float32, "dx")
    for mine, theirs in zip(grads, (p.grad for p in module.parameters())):
        assert_close(mine, theirs, torch.float32, "parameter gradient")


def test_module_options():
    with pytest.raises(ValueError, match="divisible"):
        onca.nn.NeighborhoodAttention(30, 4)
    with pytest.raises(ValueError, match="odd"):
        onca.nn.NeighborhoodAttention(32, 4, kernel_size=4)
    module = onca.nn.NeighborhoodAttention(32, 4, bias=False, dropout=0.1)
    assert module.q_proj.bias is None and "kernel_size=7" in repr(module)
    with pytest.raises(NotImplementedError):
        module(torch.zeros(1, 3, 32), attention_mask=torch.ones(1, 3))
