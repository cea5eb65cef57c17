"""``onca.nn.MultiTokenAttention`` against the same parameters applied by plain torch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import onca
from tests.helpers import assert_close, randn
# TF32 convolutions off here too (autouse): the reference's NCHW convolution and the op's
# channels-last one take different cuDNN kernels, which round TF32 differently.
from tests.ops.test_multi_token_attention import _fp32_convolutions  # noqa: F401


@pytest.mark.parametrize("bias", [True, False])
def test_module_matches_torch(device, bias):
    module = onca.nn.MultiTokenAttention(4, 4, 3, padding=1, bias=bias).to(device)
    if bias:
        torch.nn.init.normal_(module.bias)
    assert ("bias" in dict(module.named_parameters())) == bias and module.weight.shape == (4, 4, 3, 3)
    scores = randn(2, 4, 7, 7, device=device, requires_grad=True)
    out = module(scores)
    upper = torch.ones(7, 7, dtype=torch.bool, device=device).triu(1)
    probs = torch.softmax(scores.masked_fill(upper, float("-inf")), -1)
    ref = F.conv2d(probs, module.weight, module.bias, padding=1).masked_fill(upper, 0.0)
    assert_close(out, ref, torch.float32, "out")
    dout = randn(*out.shape, device=device)
    mine = torch.autograd.grad(out, [scores, *module.parameters()], dout)
    theirs = torch.autograd.grad(ref, [scores, *module.parameters()], dout)
    for a, e in zip(mine, theirs):
        assert_close(a, e, torch.float32, "gradient")


def test_module_repr_and_sparse(device):
    module = onca.nn.MultiTokenAttention(2, 2, 1, sparse=True, bias=False).to(device)
    assert "sparse=True" in repr(module)
    out = module(randn(1, 2, 5, 5, device=device))
    assert out.shape == (1, 2, 5, 5)
