"""fused_moe forward and backward against a float64 per-expert loop that rounds where the Hugging
Face expert modules round (Mixtral / Qwen3-MoE SwiGLU experts, GPT-OSS's clamped SwiGLU with biases)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from onca.ops import fused_moe as op
from onca.ops.fused_moe import fused_moe, route
from tests.contract import assert_op_contract
from tests.helpers import SCALE, assert_close, randn, rounded

# (tokens, hidden, intermediate, experts, top_k)
# The option and layout tests at GPU scale: mid-sized (the real widths are in SHAPES); 128 experts
# made each float64 reference a long per-expert loop and the shard ran past its time.
CPU_BASE = (13, 40, 24, 5, 2)
BASE = {"cpu": CPU_BASE, "gpu": (2048, 1024, 512, 32, 4)}[SCALE]
SHAPES = {
    "cpu": [(1, 16, 16, 3, 1), (9, 33, 20, 4, 3)],
    "gpu": [(8192, 4096, 14336, 8, 2), (2048, 2880, 2880, 32, 4), (1, 2048, 768, 128, 8)],
}[SCALE]


def make(tokens, hidden, inter, experts, top_k, dtype, device, layout="mixtral", bias=False):
    x = randn(tokens, hidden, dtype=dtype, device=device)
    if layout == "mixtral":
        w1 = randn(experts, 2 * inter, hidden, dtype=dtype, device=device, std=hidden ** -0.5)
        w2 = randn(experts, hidden, inter, dtype=dtype, device=device, std=inter ** -0.5)
    else:
        w1 = randn(experts, hidden, 2 * inter, dtype=dtype, device=device, std=hidden ** -0.5)
        w2 = randn(experts, inter, hidden, dtype=dtype, device=device, std=inter ** -0.5)
    b1 = randn(experts, 2 * inter, dtype=dtype, device=device, std=0.1) if bias else None
    b2 = randn(experts, hidden, dtype=dtype, device=device, std=0.1) if bias else None
    logits = randn(tokens, experts, device=device)
    index, weights = route(logits, top_k)
    return x, w1, w2, b1, b2, index, weights.detach()


def reference(x, w1, w2, b1, b2, index, weights, layout="mixtral", activation=None, alpha=1.702, limit=7.0):
    """The models' per-expert loop in float64, rounding to x's dtype where they materialise tensors.
    Returns the output and the float64 leaves (x, w1, w2, b1, b2, weights)."""
    dtype = x.dtype
    leaves = [None if t is None else t.detach().to(torch.float64).requires_grad_(True)
              for t in (x, w1, w2, b1, b2, weights)]
    x64, w164, w264, b164, b264, wt64 = leaves
    activation = activation or ("silu" if layout == "mixtral" else "gpt_oss")
    n_experts = w1.shape[0]
    out = torch.zeros_like(x64)
    for e in range(n_experts):
        tok, slot = torch.where(index == e)
        if tok.numel() == 0:
            continue
        h = x64[tok]
        gu = rounded(h @ (w164[e].t() if layout == "mixtral" else w164[e]), dtype)
        if b164 is not None:
            gu = rounded(gu + b164[e], dtype)
        g, u = (gu.chunk(2, -1) if layout == "mixtral" else (gu[:, ::2], gu[:, 1::2]))
        if activation == "silu":
            a = rounded(rounded(F.silu(g), dtype) * u, dtype)
        else:
            g = g.clamp(max=limit)
            u = u.clamp(-limit, limit)
            a = rounded((u + 1) * g * torch.sigmoid(g * alpha), dtype)
        y = rounded(a @ (w264[e].t() if layout == "mixtral" else w264[e]), dtype)
        if b264 is not None:
            y = rounded(y + b264[e], dtype)
        out = out.index_add(0, tok, y * wt64[tok, slot, None])
    return rounded(out, dtype), leaves


def check(x, w1, w2, b1, b2, index, weights, layout="mixtral", **kw):
    """Kernel and reference, forward and backward: out, dx, dW's, db's, d(top_k_weights)."""
    leaves = [None if t is None else t.detach().clone().requires_grad_(True) for t in (x, w1, w2, b1, b2, weights)]
    xk, w1k, w2k, b1k, b2k, wtk = leaves
    out = fused_moe(xk, w1k, w2k, index, wtk, gate_up_proj_bias=b1k, down_proj_bias=b2k, layout=layout, **kw)
    assert out.dtype == x.dtype and out.shape == x.shape
    ref, ref_leaves = reference(x, w1, w2, b1, b2, index, weights, layout, **kw)
    assert_close(out, ref, x.dtype, "out")
    dout = randn(*x.shape, dtype=x.dtype, device=x.device)
    out.backward(dout)
    ref.backward(dout.to(torch.float64))
    for name, mine, theirs in zip(("dx", "d_gate_up_proj", "d_down_proj", "d_gate_up_proj_bias", "d_down_proj_bias",
                                   "d_top_k_weights"), leaves, ref_leaves):
        if mine is not None:
            assert mine.grad.dtype == mine.dtype, name
            assert_close(mine.grad, theirs.grad, x.dtype, name)
    return leaves


@pytest.mark.parametrize("layout, dtype", [("mixtral", torch.float32), ("gpt_oss", torch.bfloat16),
                                           *([("mixtral", torch.bfloat16), ("gpt_oss", torch.float32)]
                                             if SCALE == "gpu" else [])], ids=str)
def test_matches_reference(profile, device, dtype, layout):
    check(*make(*BASE, dtype, device, layout, bias=layout == "gpt_oss"), layout=layout)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_shapes(device, shape):
    check(*make(*shape, torch.bfloat16, device))


def test_fp16_interleaved_layout_with_silu(device):
    """fp16; GPT-OSS's interleaved layout with biases, under plain SwiGLU."""
    check(*make(*BASE, torch.float16, device, "gpt_oss", bias=True), layout="gpt_oss", activation="silu")


def test_gpt_oss_clamping(device):
    """GPT-OSS's activation with a limit that clamps many gate and up values (both clamps' gradients).

    At the CPU size at every scale: a pre-activation within fp32 rounding of the limit is clamped
    on one side by the kernel and on the other by the float64 reference, which changes that
    token's whole dx row. At the GPU size (2048 tokens x 4 x 1024 values) one such row is likely
    (the H100 run had one); at this size the chance is about 1e-3.
    """
    x, *rest = make(*CPU_BASE, torch.float32, device, "gpt_oss", bias=True)
    check(x * 4, *rest, layout="gpt_oss", limit=0.5, alpha=1.5)


def test_masked_slots_contribute_nothing(device):
    """An index outside [0, E) (Hugging Face's E under expert parallelism, or -1) is skipped, and its
    weight's gradient is zero."""
    x, w1, w2, b1, b2, index, weights = make(*BASE, torch.float32, device)
    index = index.clone()
    index[0, 0] = w1.shape[0]
    index[3, -1] = -1
    index[5] = w1.shape[0]  # a token with no expert at all
    grad = check(x, w1, w2, b1, b2, index, weights)[-1].grad
    assert grad[0, 0] == 0 and grad[3, -1] == 0 and (grad[5] == 0).all()


@pytest.mark.parametrize("routing", ["softmax_topk", "topk_softmax"])
def test_router_logits_route_and_take_gradients(device, routing):
    tokens, hidden, inter, experts, top_k = BASE
    x, w1, w2, *_ = make(*BASE, torch.float32, device)
    logits = randn(tokens, experts, device=device)
    lk = logits.clone().requires_grad_(True)
    out = fused_moe(x, w1, w2, router_logits=lk, top_k=top_k, routing=routing, norm_topk_prob=False)
    l64 = logits.to(torch.float64).requires_grad_(True)
    if routing == "softmax_topk":  # Mixtral / Qwen3-MoE routers
        weights, index = torch.topk(torch.softmax(l64, -1), top_k, -1)
    else:  # GPT-OSS's router
        top, index = torch.topk(l64, top_k, -1)
        weights = torch.softmax(top, -1)
    assert torch.equal(index, route(logits, top_k, routing)[0])
    ref, (x64, *_, wt64) = reference(x, w1, w2, None, None, index, weights.detach())
    assert_close(out, ref, torch.float32, "out")
    dout = randn(tokens, hidden, device=device)
    out.backward(dout)
    ref.backward(dout.to(torch.float64))
    weights.backward(wt64.grad)
    assert_close(lk.grad, l64.grad, torch.float32, "d_router_logits")


def test_three_d_input_and_non_contiguous_weights(device):
    """(batch, seq, hidden) input and routing; expert weights given as transposed views of the
    other layout's storage (read through strides, not copied)."""
    tokens, hidden, inter, experts, top_k = BASE
    x, w1, w2, _, _, index, weights = make(*BASE, torch.float32, device)
    w1_view = w1.transpose(1, 2).contiguous().transpose(1, 2)
    w2_view = w2.transpose(1, 2).contiguous().transpose(1, 2)
    assert not w1_view.is_contiguous()
    x3 = x.view(1, tokens, hidden)
    out = fused_moe(x3, w1_view, w2_view, index.view(1, tokens, top_k), weights.view(1, tokens, top_k))
    assert out.shape == x3.shape
    assert_close(out.view(tokens, hidden), reference(x, w1, w2, None, None, index, weights)[0], torch.float32)


def test_zero_tokens(device):
    _, w1, w2, *_ = make(*BASE, torch.float32, device)
    x = torch.zeros(0, BASE[1], device=device, requires_grad=True)
    wts = torch.zeros(0, 2, device=device, requires_grad=True)
    w1k = w1.clone().requires_grad_(True)
    out = fused_moe(x, w1k, w2, torch.zeros(0, 2, dtype=torch.int64, device=device), wts)
    assert out.shape == (0, BASE[1])
    out.sum().backward()
    assert x.grad.shape == x.shape and (w1k.grad == 0).all()


def test_does_not_modify_caller_tensors(device):
    inputs = make(*BASE, torch.bfloat16, device, "gpt_oss", bias=True)
    copies = [t.clone() for t in inputs]
    leaves = [t.clone().requires_grad_(t.is_floating_point()) for t in inputs]
    x, w1, w2, b1, b2, index, weights = leaves
    fused_moe(x, w1, w2, index, weights, gate_up_proj_bias=b1, down_proj_bias=b2, layout="gpt_oss").sum().backward()
    assert all(torch.equal(a, b) for a, b in zip(leaves, copies))


def test_deterministic(device):
    x, w1, w2, _, _, index, weights = make(5, 16, 16, 3, 2, torch.bfloat16, device)
    grads = []
    for _ in range(2):
        w1k = w1.clone().requires_grad_(True)
        fused_moe(x, w1k, w2, index, weights).float().square().sum().backward()
        grads.append(w1k.grad)
    assert torch.equal(grads[0], grads[1])


def test_plan_covers_the_kernels(profile):
    plans = op.plan((4096, 2048), torch.bfloat16, profile, num_experts=128, top_k=8, intermediate=768)
    assert {"up", "down", "down_backward", "input_grad", "down_weight_grad", "up_weight_grad", "combine"} <= set(plans)
    for p in plans.values():
        assert p.describe()
        assert getattr(p, "tile_bytes", 0) <= p.onchip_bytes


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gpu_plans_take_the_wide_tiles_within_shared_memory(dtype):
    """On an H200 the 2-byte GEMMs take ``GPU_GEMM_TILES`` (128 x 256, four stages; the gated up
    GEMM two 128 x 128 accumulators), fp32 the planner's defaults; every stage's operand tiles
    fit the shared memory (four stages of fp32 128 x 256 tiles asked 294912 bytes there)."""
    from onca.device import PROFILES

    itemsize = torch.empty((), dtype=dtype).element_size()
    moe_shapes = (((8192, 4096), 8, 2, 14336), ((4096, 2048), 128, 8, 768), ((4096, 2880), 32, 4, 2880))
    for shape, e, k, i in moe_shapes:
        plans = op.plan(shape, dtype, PROFILES["h200"], num_experts=e, top_k=k, intermediate=i)
        wide = itemsize == 2
        assert (plans["down"].block_n, plans["down"].num_stages) == ((256, 4) if wide else (128, 3))
        assert (plans["up"].block_n, plans["up"].block_k) == ((128, 64) if wide else (64, 64))
        for name, p in plans.items():
            if hasattr(p, "block_k"):
                operands = (p.block_m * p.block_k + p.accumulators * p.block_n * p.block_k) * itemsize
                # Every stage counted (Triton keeps one fewer): a margin over the launch's check.
                assert operands * p.num_stages <= PROFILES["h200"].shared_bytes, (name, p.describe())


def test_bad_input(device):
    x, w1, w2, _, _, index, weights = make(*BASE, torch.float32, device)
    with pytest.raises(ValueError, match="gate_up_proj must have shape"):
        fused_moe(x, w1[:, :, :-1], w2, index, weights)
    with pytest.raises(ValueError, match="down_proj must have shape"):
        fused_moe(x, w1, w2.transpose(1, 2), index, weights)
    with pytest.raises(TypeError, match="down_proj must have x's dtype"):
        fused_moe(x, w1, w2.bfloat16(), index, weights)
    with pytest.raises(TypeError, match="top_k_index must be an int32 or int64"):
        fused_moe(x, w1, w2, index.float(), weights)
    with pytest.raises(ValueError, match="top_k_weights must have top_k_index's shape"):
        fused_moe(x, w1, w2, index, weights[:, :1])
    with pytest.raises(ValueError, match="top_k_index must have shape"):
        fused_moe(x, w1, w2, index[1:], weights[1:])
    with pytest.raises(ValueError, match="needs top_k_index and top_k_weights"):
        fused_moe(x, w1, w2, index)
    with pytest.raises(ValueError, match="top_k must be an int"):
        fused_moe(x, w1, w2, router_logits=randn(BASE[0], BASE[3], device=device), top_k=BASE[3] + 1)
    with pytest.raises(ValueError, match="router_logits must have shape"):
        fused_moe(x, w1, w2, router_logits=randn(BASE[0], 3, device=device), top_k=1)
    with pytest.raises(ValueError, match="layout must be one of"):
        fused_moe(x, w1, w2, index, weights, layout="deepseek")
    with pytest.raises(ValueError, match="activation must be one of"):
        fused_moe(x, w1, w2, index, weights, activation="gelu")
    with pytest.raises(ValueError, match="gate_up_proj_bias must have shape"):
        fused_moe(x, w1, w2, index, weights, gate_up_proj_bias=randn(BASE[3], 3, device=device))
    with pytest.raises(TypeError, match="x must have a floating dtype"):
        fused_moe(x.long(), w1, w2, index, weights)
    with pytest.raises(ValueError, match="routing must be one of"):
        fused_moe(x, w1, w2, router_logits=randn(BASE[0], BASE[3], device=device), top_k=1, routing="sigmoid")


@pytest.mark.parametrize("layout", ["gpt_oss", *(["mixtral"] if SCALE == "gpu" else [])])
def test_op_contract(device, layout):
    x, w1, w2, b1, b2, index, weights = make(5, 16, 16, 3, 2, torch.float32, device, layout, bias=layout == "gpt_oss")
    x.requires_grad_(True)
    w1.requires_grad_(True)
    w2.requires_grad_(True)
    weights.requires_grad_(True)
    if b1 is not None:
        b1.requires_grad_(True)
        b2.requires_grad_(True)
        fn = lambda x, w1, w2, wt, b1, b2: fused_moe(  # noqa: E731
            x, w1, w2, index, wt, gate_up_proj_bias=b1, down_proj_bias=b2, layout=layout)
        inputs = (x, w1, w2, weights, b1, b2)
    else:
        fn = lambda x, w1, w2, wt: fused_moe(x, w1, w2, index, wt, layout=layout)  # noqa: E731
        inputs = (x, w1, w2, weights)
    assert_op_contract(fn, inputs, expect_ops=("fused_moe_forward", "fused_moe_backward"))
