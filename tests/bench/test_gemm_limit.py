"""The fused heads' limit row (``gemm_limit``): the matmuls alone, run on the benchmarks' inputs."""

from __future__ import annotations

import pytest
import torch

from onca.bench import harness
from onca.bench.ops._gemm_limit import HeadGemms
from onca.bench.spec import build

HEADS = ("fused_linear_cross_entropy", "fused_linear_logprobs", "fused_linear_scaled_cross_entropy",
         "fused_linear_dpo", "fused_linear_simpo", "fused_linear_orpo", "fused_linear_cpo",
         "fused_linear_kto", "fused_linear_grpo", "fused_linear_distill", "fused_linear_jsd")


def test_head_gemms_backward_is_the_logits_through_the_two_gradient_matmuls():
    hidden = torch.randn(2, 3, 8, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(5, 8, dtype=torch.float64, requires_grad=True)
    frozen_hidden = torch.randn(6, 8, dtype=torch.float64)
    frozen_weight = torch.randn(5, 8, dtype=torch.float64)
    HeadGemms.apply(hidden, weight, frozen_hidden, frozen_weight).backward()
    rows = hidden.detach().reshape(6, 8)
    logits = rows @ weight.detach().t()
    torch.testing.assert_close(hidden.grad, (logits @ weight.detach()).reshape(2, 3, 8))
    torch.testing.assert_close(weight.grad, logits.t() @ rows)


@pytest.mark.parametrize("op", HEADS)
def test_every_fused_head_has_a_limit_row_that_runs_on_its_inputs(op):
    """The limit row is declared, estimated, and its forward + backward runs at the probe size,
    reaching the trained head's gradients only."""
    bench = harness.load(op)
    assert "gemm_limit" in bench.providers
    inputs = bench.make_inputs(bench.probe, torch.float32, "cpu")
    run = build(bench.peers["gemm_limit"], bench.probe, inputs)
    run().backward()
    trained = [name for name, t in inputs.items() if isinstance(t, torch.Tensor) and t.requires_grad]
    assert trained and all(inputs[name].grad is not None for name in trained)
    assert bench.memory_estimate(bench.probe, torch.bfloat16, "gemm_limit", "full") > 0
