"""Kernel launches per forward + backward at the overhead sweep's size (16 tokens), per op: at
host-bound sizes each launch costs tens of microseconds of Triton's Python launcher on a GPU, so
the count is part of an op's host overhead (issue 12). Measured with the launches stubbed out
(``tools.host_path``), so it runs anywhere. A new op states its count here; an op whose count
changes updates it (lower: say so in the commit; higher: justify it)."""

from __future__ import annotations

import pytest

from onca.bench import harness
from tools.host_path import HOST_SYNC, measure, stubbed_launches

# Vocabulary-parallel cross entropy's 5: on the benchmark's one-rank group it is cross entropy
# (2026-12-04), whose forward + backward without overwrite_logits launches one kernel more than the
# benchmark's cross entropy with it. Its sharded passes launched 8.
# Embedding's third launch is its weight gradient's zero fill, Onca's kernel in place of torch's
# (onca.ops._fill: 1.27x faster on an H200), so its launches overall did not change.
LAUNCHES = {
    "attn_res": 3, "cross_entropy": 4, "dyt": 2, "embedding": 3, "fused_add_rms_norm": 2,
    "fused_linear_cpo": 4, "fused_linear_cross_entropy": 5, "fused_linear_distill": 3, "fused_linear_dpo": 5,
    "fused_linear_grpo": 4, "fused_linear_jsd": 4, "fused_linear_kto": 5, "fused_linear_logprobs": 2,
    "fused_linear_orpo": 4, "fused_linear_scaled_cross_entropy": 2, "fused_linear_simpo": 4, "fused_moe": 8,
    "geglu": 2, "group_norm": 3, "grpo_loss": 2, "jsd": 3, "kl_div": 3, "layer_norm": 2, "llama4_rope": 2,
    "mhc": 10, "modulated_rms_norm": 4, "multi_token_attention": 4, "multimodal_rope": 2,
    "neighborhood_attention": 3, "poly_norm": 3, "relu_squared": 2, "rms_norm": 2, "rms_norm_rope": 2,
    "rope": 2, "softmax": 2, "sparsemax": 2, "swiglu": 2, "tiled_mlp": 2, "tvd": 3,
    "vocab_parallel_cross_entropy": 5,
}


def test_every_benchmarked_op_has_a_launch_count():
    assert sorted(LAUNCHES) == harness.list_ops()


# Ops whose forward + backward is their Triton kernels alone: no torch kernel beside them (before
# the op contract stopped autograd's zero fills, every norm launched one per statistic it returns).
KERNELS_ONLY = ("attn_res", "fused_add_rms_norm", "fused_linear_jsd", "geglu", "group_norm", "jsd", "kl_div",
                "layer_norm", "mhc", "modulated_rms_norm", "neighborhood_attention", "relu_squared", "rms_norm",
                "rms_norm_rope", "softmax", "sparsemax", "swiglu", "tvd")


# The torch kernels a kernels-only op's benchmark step still runs, and why. Fused add + RMSNorm's
# x and residual get one gradient: the benchmark makes both leaves, and two leaves' .grad must not
# share storage, so autograd copies it for one of them (in a model x and residual are not leaves,
# and nothing is copied).
# mHC's stream x feeds three ops (coefficients, mix-down, mix-back): autograd adds their three
# gradients (add, add_); silu and its backward are the benchmark's layer. (Its coefficients ran
# ~640 small torch kernels per step before their kernels, then four sums and four zero fills.)
# Modulated RMSNorm zeroes one buffer: dW's partial rows and the modulation's slots, all accumulated
# into.
BESIDE_KERNELS = {"fused_add_rms_norm": ["aten::copy_"],
                  "mhc": ["aten::add", "aten::add_", "aten::silu", "aten::silu_backward"],
                  "modulated_rms_norm": ["aten::zero_"]}


@pytest.mark.parametrize("op", sorted(LAUNCHES))
def test_launches_per_step(op):
    launches, kernels = measure(op, timed=False)[:2]
    assert launches == LAUNCHES[op], f"{op}: {launches} launches per forward + backward, the table says {LAUNCHES[op]}"
    assert HOST_SYNC not in kernels, f"{op} reads a device value on the host"
    if op in KERNELS_ONLY:
        assert kernels == BESIDE_KERNELS.get(op, []), f"{op} launches torch kernels beside its own: {kernels}"


def _row_op_calls():
    import torch

    from onca.ops.dyt import dyt
    from onca.ops.fused_add_rms_norm import fused_add_rms_norm
    from onca.ops.geglu import geglu
    from onca.ops.layer_norm import layer_norm
    from onca.ops.modulated_rms_norm import modulated_rms_norm
    from onca.ops.poly_norm import poly_norm
    from onca.ops.relu_squared import relu_squared
    from onca.ops.rms_norm import rms_norm
    from onca.ops.softmax import softmax
    from onca.ops.sparsemax import sparsemax
    from onca.ops.swiglu import swiglu

    return {
        "rms_norm": lambda x, w: rms_norm(x, w), "layer_norm": lambda x, w: layer_norm(x, w),
        "fused_add_rms_norm": lambda x, w: fused_add_rms_norm(x, x.detach().clone(), w)[0],
        "dyt": lambda x, w: dyt(x, torch.tensor(0.5), w), "softmax": lambda x, w: softmax(x),
        "sparsemax": lambda x, w: sparsemax(x), "swiglu": lambda x, w: swiglu(x, x.detach().clone()),
        "geglu": lambda x, w: geglu(x, x.detach().clone()),
        "poly_norm": lambda x, w: poly_norm(x, w[:3], w[3]), "relu_squared": lambda x, w: relu_squared(x),
        "modulated_rms_norm": lambda x, w: modulated_rms_norm(x, w, w[None, None, :].expand(2, 1, 8) * 0.5),
    }


@pytest.mark.parametrize("op", ["rms_norm", "layer_norm", "fused_add_rms_norm", "dyt", "softmax", "sparsemax",
                                "swiglu", "geglu", "poly_norm", "relu_squared", "modulated_rms_norm"])
def test_row_ops_take_their_input_whole(op):
    """A 3-D input reaches the op's autograd node as it is: no view node before or after it (the
    op reads its rows in place, with their stride, where autograd records nothing). Each view node
    is one more op on the host in the forward and one more node for the engine in the backward."""
    import torch

    x = torch.randn(2, 3, 8, requires_grad=True)
    w = torch.randn(8, requires_grad=True)
    with stubbed_launches([0]):  # the graph's structure is the question, not the values: any machine
        y = _row_op_calls()[op](x, w)
    assert y.shape == x.shape
    assert y.grad_fn.name() == f"{op}_forward_functionBackward", y.grad_fn.name()
    # The inputs' own nodes: leaves, or (a parameter sliced or scaled by the test) not a view of x.
    nodes = {type(fn).__name__ for fn, _ in y.grad_fn.next_functions if fn is not None}
    assert nodes <= {"AccumulateGrad", "SelectBackward0", "SliceBackward0", "MulBackward0"}, nodes
    assert y.grad_fn.next_functions[0][0].__class__.__name__ == "AccumulateGrad"  # x itself


def test_layer_norm_gradients_share_one_fill_and_one_sum():
    """Past the one-program size, LayerNorm's weight and bias partial sums are two planes of one
    buffer: one fill and one summing launch for both (two of each before), each a host-path step."""
    import torch

    from onca.ops._row_norm import DIRECT_MAX_ELEMENTS
    from onca.ops.layer_norm import layer_norm
    from tools.host_path import torch_kernels

    rows, cols = 2 * DIRECT_MAX_ELEMENTS // 1024, 1024
    x = torch.randn(rows, cols, requires_grad=True)
    w, b = torch.randn(cols, requires_grad=True), torch.randn(cols, requires_grad=True)
    dy = torch.randn(rows, cols)

    def step():
        x.grad = w.grad = b.grad = None
        layer_norm(x, w, b).backward(dy)

    counter = [0]
    with stubbed_launches(counter):
        step()
        counter[0] = 0
        kernels = torch_kernels(step)
    assert counter[0] == 3, f"{counter[0]} launches: forward, backward and one sum expected"
    assert len(kernels) == 1 and kernels[0] in ("aten::zero_", "aten::fill_"), kernels  # one fill


def test_the_small_mode_times_torchs_route_on_the_cpu():
    """``--small`` runs an op's small call through torch's route on the CPU (the route counts it) and
    leaves the route's device types as they were; an op with no such route at its overhead point
    (RMSNorm: its kernels win there) takes none."""
    from onca.ops import _small_calls
    from tools.host_path import measure_small

    before = _small_calls.DEVICE_TYPES
    limit = _small_calls.set_limit(_small_calls.DEFAULT_LIMIT)  # the suite runs with the route off
    try:
        taken, onca_us, torch_us = measure_small("layer_norm")
        assert taken == 1 and onca_us > 0 and torch_us > 0
        assert measure_small("rms_norm", timed=False)[0] == 0
        assert measure_small("fused_linear_dpo", timed=False)[0] == 2  # the policy's head and the reference's
    finally:
        _small_calls.set_limit(limit)
    assert _small_calls.DEVICE_TYPES == before == ("cuda",)
