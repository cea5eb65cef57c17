"""The post-training loss modules call their functions with the options they hold."""

from __future__ import annotations

import torch

import onca.functional as F
from onca import nn
from tests.helpers import randn
from tests.ops.posttrain_reference import make_inputs


def test_modules_match_functions(device):
    h, w, _, labels = make_inputs((2, 5, 8, 24), torch.float32, device, prompt=1)
    rh = randn(2, 5, 8, device=device)
    torch.testing.assert_close(nn.FusedLinearDPOLoss(beta=0.3)(h, w, labels, rh, w),
                               F.fused_linear_dpo(h, w, labels, rh, w, beta=0.3))
    torch.testing.assert_close(nn.FusedLinearSimPOLoss(gamma=0.1)(h, w, labels),
                               F.fused_linear_simpo(h, w, labels, gamma=0.1))
    torch.testing.assert_close(nn.FusedLinearORPOLoss()(h, w, labels), F.fused_linear_orpo(h, w, labels))
    torch.testing.assert_close(nn.FusedLinearCPOLoss(loss_type="hinge")(h, w, labels),
                               F.fused_linear_cpo(h, w, labels, loss_type="hinge"))
    flags = torch.tensor([True, False], device=device)
    torch.testing.assert_close(nn.FusedLinearKTOLoss()(h, w, labels, flags, rh, w),
                               F.fused_linear_kto(h, w, labels, flags, rh, w))
    adv = torch.tensor([1.0, -0.5], device=device)
    torch.testing.assert_close(nn.FusedLinearGRPOLoss(loss_type="grpo")(h, w, labels, adv),
                               F.fused_linear_grpo(h, w, labels, adv, loss_type="grpo"))
    torch.testing.assert_close(nn.FusedLinearDistillLoss(divergence="cosine")(h, w, rh, w),
                               F.fused_linear_distill(h, w, rh, w, divergence="cosine"))
    assert "beta=0.3" in repr(nn.FusedLinearDPOLoss(beta=0.3))


def test_every_loss_passes_accum_dtype_to_the_chunk_driver(monkeypatch, device):
    """``accum_dtype=torch.float32`` reaches the weight-gradient accumulator of every policy loss
    (bf16 head), from the module as from the function; the default is the weight's dtype."""
    from tests.ops.test_chunked_head import _accumulator_dtypes

    h, w, _, labels = make_inputs((2, 5, 8, 24), torch.bfloat16, device, prompt=1)
    rh = randn(2, 5, 8, dtype=torch.bfloat16, device=device)
    flags = torch.tensor([True, False], device=device)
    adv = torch.tensor([1.0, -0.5], device=device)
    calls = {
        nn.FusedLinearDPOLoss: lambda m, wk: m(h, wk, labels, rh, w),
        nn.FusedLinearSimPOLoss: lambda m, wk: m(h, wk, labels),
        nn.FusedLinearORPOLoss: lambda m, wk: m(h, wk, labels),
        nn.FusedLinearCPOLoss: lambda m, wk: m(h, wk, labels),
        nn.FusedLinearKTOLoss: lambda m, wk: m(h, wk, labels, flags, rh, w),
        nn.FusedLinearGRPOLoss: lambda m, wk: m(h, wk, labels, adv),
    }
    for module, call in calls.items():
        for accum_dtype, expected in ((None, torch.bfloat16), (torch.float32, torch.float32)):
            seen = _accumulator_dtypes(monkeypatch)
            wk = w.detach().requires_grad_(True)
            call(module(accum_dtype=accum_dtype), wk).backward()
            assert seen and set(seen) == {expected}, module.__name__
            monkeypatch.undo()
