"""onca.nn.MHC: liger-kernel's LigerMHC parameters, and the functional mhc it runs."""

from __future__ import annotations

import pytest
import torch

from onca.nn import MHC
from onca.ops.mhc import mhc


def test_module_runs_the_functional_op(device):
    layer = torch.nn.Linear(16, 16, device=device)
    module = MHC(layer, hc=2, c=16, tmax=3, device=device)
    assert {n for n, _ in module.named_parameters()} >= {"phi", "b", "alpha_pre", "alpha_post", "alpha_res"}
    assert module.phi.shape == (32, 8)
    x = torch.randn(3, 2, 16, device=device, requires_grad=True)
    out = module(x)
    expected = mhc(x, layer, module.phi, module.b, module.alpha_pre, module.alpha_post, module.alpha_res, tmax=3)
    assert torch.equal(out, expected)
    out.sum().backward()
    assert module.phi.grad is not None and layer.weight.grad is not None and x.grad is not None
    with pytest.raises(ValueError, match="x must be"):
        module(torch.randn(3, 4, 16, device=device))
