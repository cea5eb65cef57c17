"""RoPE forward and backward against a float64 PyTorch reference and transformers' own function."""

from __future__ import annotations

import pytest
import torch

import onca
from onca.models import MODELS
from onca.device import PROFILES
from onca.ops import llama4_rope
from onca.ops import rope as op
from tests.contract import assert_op_contract
from tests.helpers import DTYPES, SCALE, assert_close, leaf, randn

transformers = pytest.importorskip("transformers")
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as llama_rope
from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb as phi3_rope

rotary_pos_emb = onca.functional.rotary_pos_emb

# (batch, seq, q heads, kv heads, head_dim, rotary_dim)
SHAPES = {
    "cpu": [
        (2, 7, 8, 2, 64, 64),  # GQA
        (1, 1, 4, 4, 128, 128),  # one token
        (3, 5, 6, 2, 96, 96),  # non-power-of-two heads and half width (48), Phi-3's head_dim
        (2, 3, 5, 1, 256, 256),  # MQA, head_dim 256
        (2, 6, 4, 2, 128, 64),  # partial rotary (half the head)
        (1, 4, 3, 3, 80, 24),  # partial rotary, odd sizes
    ],
    "gpu": [
        (4, 2048, 32, 8, 128, 128),
        (2, 4096, 64, 8, 128, 128),
        (4, 1024, 16, 8, 256, 256),
        (4, 2048, 32, 32, 96, 96),
        (2, 2048, 32, 8, 128, 64),
        (1, 1, 32, 8, 128, 128),
    ],
}[SCALE]
BASE = {"cpu": (2, 5, 6, 2, 64, 64), "gpu": (4, 2048, 32, 8, 128, 128)}[SCALE]


def _id(shape):
    return "x".join(map(str, shape))


def make(shape, dtype, device, layout=1, cos_batch=1, real=True, cos_dtype=None):
    """q, k (in the layout's shape, read from a projection-style (B, S, H, D) buffer for layout 1),
    and cos/sin: real rotary tables when ``real``, else arbitrary values (general, not duplicated)."""
    b, s, hq, hk, d, r = shape

    def qk(h):
        t = randn(b, s, h, d, dtype=dtype, device=device)
        return t.transpose(1, 2) if layout == 1 else t

    cb = b if cos_batch == "batch" else 1
    if real:
        inv_freq = 1.0 / (10000 ** (torch.arange(0, r, 2, dtype=torch.float64) / r))
        pos = torch.arange(s, dtype=torch.float64)[None, :] + 3 * torch.arange(cb, dtype=torch.float64)[:, None]
        freqs = pos[..., None] * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
    else:
        cos, sin = torch.randn(cb, s, r, dtype=torch.float64), torch.randn(cb, s, r, dtype=torch.float64)
    cdt = cos_dtype or dtype
    return qk(hq), qk(hk), cos.to(device=device, dtype=cdt), sin.to(device=device, dtype=cdt)


def reference(q, k, cos, sin, layout=1):
    """transformers' partial-rotary expression (Phi-3's; Llama's when rotary_dim == head_dim) in
    float64, with ``cos.unsqueeze(layout)``. The kernel rounds once, at its store."""
    q64 = q.detach().to(torch.float64).requires_grad_(True)
    k64 = k.detach().to(torch.float64).requires_grad_(True)
    qe, ke = phi3_rope(q64, k64, cos.to(torch.float64), sin.to(torch.float64), unsqueeze_dim=layout)
    return qe, ke, q64, k64


def check(q, k, cos, sin, layout=1, dtype=None):
    dtype = dtype or q.dtype
    qk_, kk_ = leaf(q), leaf(k)
    q_embed, k_embed = rotary_pos_emb(qk_, kk_, cos, sin, unsqueeze_dim=layout)
    assert q_embed.shape == q.shape and k_embed.shape == k.shape
    qe, ke, q64, k64 = reference(q, k, cos, sin, layout)
    assert_close(q_embed, qe, dtype, "q_embed")
    assert_close(k_embed, ke, dtype, "k_embed")
    dq_embed, dk_embed = torch.randn_like(q_embed), torch.randn_like(k_embed)
    torch.autograd.backward((q_embed, k_embed), (dq_embed, dk_embed))
    torch.autograd.backward((qe, ke), (dq_embed.to(torch.float64), dk_embed.to(torch.float64)))
    assert_close(qk_.grad, q64.grad, dtype, "dq")
    assert_close(kk_.grad, k64.grad, dtype, "dk")
    assert qk_.grad.dtype == q.dtype and kk_.grad.dtype == k.dtype


@pytest.mark.parametrize("shape", SHAPES, ids=_id)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_shapes(profile, device, shape, dtype):
    check(*make(shape, dtype, device, real=False))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", [1, 2])
@pytest.mark.parametrize("cos_batch", [1, "batch"])
def test_layouts_and_dtypes(device, dtype, layout, cos_batch):
    check(*make(BASE, dtype, device, layout, cos_batch, real=False), layout=layout)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", [1, 2])
@pytest.mark.parametrize("rotary", ["full", "partial"])
def test_matches_transformers(device, dtype, layout, rotary):
    """A drop-in for transformers' apply_rotary_pos_emb (Llama/Qwen/Mistral; Phi-3 for partial
    rotary), run in the same dtype: outputs, their dtype and memory layout, and gradients."""
    b, s, hq, hk, d, _ = BASE
    shape = (b, s, hq, hk, d, d if rotary == "full" else d // 2)
    q, k, cos, sin = make(shape, dtype, device, layout, cos_batch="batch")
    hf_fn = llama_rope if rotary == "full" else phi3_rope
    q1, k1, q2, k2 = leaf(q), leaf(k), leaf(q), leaf(k)
    ours = rotary_pos_emb(q1, k1, cos, sin, unsqueeze_dim=layout)
    theirs = hf_fn(q2, k2, cos, sin, unsqueeze_dim=layout)
    for a, e, name in zip(ours, theirs, ("q_embed", "k_embed")):
        assert a.dtype == e.dtype, name
        if rotary == "full":  # the same memory layout (Phi-3's torch.cat makes its result contiguous)
            assert a.stride() == e.stride(), name
        assert_close(a, e, dtype, name)
    grads = tuple(torch.randn_like(t) for t in theirs)
    torch.autograd.backward(ours, grads)
    torch.autograd.backward(theirs, grads)
    assert_close(q1.grad, q2.grad, dtype, "dq")
    assert_close(k1.grad, k2.grad, dtype, "dk")


def test_dtype_promotion_like_transformers(device):
    """bf16 q/k with fp32 cos/sin: eager promotes the result to fp32; so does the kernel."""
    q, k, cos, sin = make(BASE, torch.bfloat16, device, cos_dtype=torch.float32)
    q1, k1, q2, k2 = leaf(q), leaf(k), leaf(q), leaf(k)
    ours = rotary_pos_emb(q1, k1, cos, sin)
    theirs = llama_rope(q2, k2, cos, sin)
    for a, e in zip(ours, theirs):
        assert a.dtype == e.dtype == torch.float32
        assert_close(a, e, torch.float32)
    grads = tuple(torch.randn_like(t) for t in theirs)
    torch.autograd.backward(ours, grads)
    torch.autograd.backward(theirs, grads)
    assert q1.grad.dtype == torch.bfloat16
    assert_close(q1.grad, q2.grad, torch.bfloat16, "dq")
    assert_close(k1.grad, k2.grad, torch.bfloat16, "dk")


@pytest.mark.parametrize("how", ["fused_qkv", "strided_cols", "expanded_cos", "grad_layout"])
def test_non_contiguous(device, how):
    b, s, hq, hk, d, r = BASE
    dtype = torch.bfloat16
    q, k, cos, sin = make(BASE, dtype, device, real=False)
    if how == "fused_qkv":
        # q and k sliced out of one fused projection, then transposed: neither dense nor contiguous.
        qkv = randn(b, s, (hq + 2 * hk) * d, dtype=dtype, device=device)
        q = qkv[..., : hq * d].view(b, s, hq, d).transpose(1, 2)
        k = qkv[..., hq * d:(hq + hk) * d].view(b, s, hk, d).transpose(1, 2)
    elif how == "strided_cols":
        q = torch.stack((q, torch.zeros_like(q)), dim=-1)[..., 0]  # last-dim stride 2: copied first
        cos = torch.stack((cos, torch.zeros_like(cos)), dim=-1)[..., 0]
        assert q.stride(-1) == 2 and cos.stride(-1) == 2
    elif how == "expanded_cos":
        cos, sin = cos.expand(b, s, r), sin.expand(b, s, r)  # batch stride 0
    check(q, k, cos, sin)
    if how == "grad_layout":
        # Incoming gradients in another layout (and with a non-unit last-dim stride).
        qk_, kk_ = leaf(q), leaf(k)
        qe, ke = rotary_pos_emb(qk_, kk_, cos, sin)
        dq = randn(*qe.shape, dtype=dtype, device=device)
        dk = randn(*ke.shape[:-1], 2 * d, dtype=dtype, device=device)[..., ::2]
        torch.autograd.backward((qe, ke), (dq, dk))
        re, rk, q64, k64 = reference(q, k, cos, sin)
        torch.autograd.backward((re, rk), (dq.double(), dk.double()))
        assert_close(qk_.grad, q64.grad, dtype, "dq")
        assert_close(kk_.grad, k64.grad, dtype, "dk")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rotary", ["full", "partial"])
def test_tiled_path(profile, device, onchip_bytes, dtype, rotary):
    """A tiny on-chip budget: heads split into several head blocks, each rotary half into several
    column tiles, and (partial rotary) the pass-through part copied in several tiles."""
    forced = onchip_bytes(2048)
    b, s, hq, hk, d = 1, 4, 6, 3, 128
    r = d if rotary == "full" else 48
    t = op.tiles(b * s, hq, hk, d, r, dtype, forced)
    assert t.plan.col_tiles > 1 and t.block_hq < hq and t.j_tiles > 1
    if rotary == "partial":
        assert -(-t.pass_cols // t.block_p) > 1
    assert t.working_set_bytes(torch.empty((), dtype=dtype).element_size()) <= forced.onchip_bytes
    check(*make((b, s, hq, hk, d, r), dtype, device, real=False))


def _d2_points():
    for model in MODELS.values():
        yield model.name, (4 * 2048, model.num_heads, model.num_kv_heads, model.head_dim, model.rotary_dim)


@pytest.mark.parametrize("profile_name", ["ascend910b2", "ascend910b4", "ascend950", "h100", "h200"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_d2_plans_fit_every_profile(profile_name, dtype):
    """Every model-registry point (batch 4 x seq 2048): the tile fits the on-chip budget (the
    Unified Buffer on Ascend), its blocks are 32-byte aligned on Ascend, and a persistent grid
    never exceeds the vector cores."""
    profile = PROFILES[profile_name]
    itemsize = torch.empty((), dtype=dtype).element_size()
    for name, (tokens, hq, hk, d, r) in _d2_points():
        t = op.tiles(tokens, hq, hk, d, r, dtype, profile)
        p = t.plan
        assert p.tile_bytes <= profile.onchip_bytes, name
        assert t.working_set_bytes(itemsize) <= p.tile_bytes, name
        assert p.persistent == profile.persistent, name
        if profile.persistent:
            assert p.grid <= profile.compute_units, name
        if profile.kind == "npu":
            for block in (p.block_cols, t.block_j) + ((t.block_p,) if t.pass_cols else ()):
                assert (block * itemsize) % 32 == 0, (name, block)
        # The tile covers every head and every column of each half.
        assert t.block_hq * -(-hq // t.block_hq) >= hq and t.block_hk * -(-hk // t.block_hk) >= hk
        assert t.block_j * t.j_tiles >= t.half
        assert p.rows == tokens and p.row_blocks * p.block_rows >= tokens


def test_gpu_programs_have_at_most_eight_warps():
    """A 128-head tile (Llama-3.1-405B) gets 8 warps, not the planner's 16; narrower tiles keep theirs."""
    for name in ("h100", "h200"):
        wide = op.tiles(8192, 128, 8, 128, 128, torch.bfloat16, PROFILES[name]).plan
        assert wide.num_warps == op.MAX_WARPS == 8
        assert op.tiles(8192, 32, 8, 128, 128, torch.bfloat16, PROFILES[name]).plan.num_warps == 4


def test_gpu_programs_step_over_heads_eight_at_a_time():
    for name in ("h100", "h200"):
        t = op.tiles(8192, 32, 8, 128, 128, torch.bfloat16, PROFILES[name])
        assert (t.block_hq, t.block_hk) == (op.GPU_HEAD_BLOCK, op.GPU_HEAD_BLOCK) == (8, 8)
        assert op.tiles(8192, 4, 2, 128, 128, torch.bfloat16, PROFILES[name]).block_hq == 4


@pytest.mark.parametrize("hq, hk, head_dim, interleaved, tokens", [
    (16, 8, 128, False, 1),   # Qwen3-0.6B: the planner's two tokens cut to one (8 x 64-column steps)
    (32, 8, 64, False, 2),    # Llama-3.2-1B: 8 x 32-column steps, two tokens fit GPU_STEP_ELEMENTS
    (16, 8, 128, True, 2),    # Llama 4's pairs keep the planner's tokens
])
def test_gpu_tiles_hold_at_most_step_elements(hq, hk, head_dim, interleaved, tokens):
    for name in ("h100", "h200"):
        t = op.tiles(8192, hq, hk, head_dim, head_dim, torch.bfloat16, PROFILES[name], interleaved)
        assert t.block_t == tokens, name
        if not interleaved:
            assert t.block_t * t.block_hq * t.block_j <= op.GPU_STEP_ELEMENTS
    # plan() reports the launches' tiles: RoPE's (and M-RoPE's) cut, Llama 4's not.
    assert op.plan((4, 2048, 16, 8, 128), torch.bfloat16, PROFILES["h200"])["forward"].block_rows == 1
    pairs = llama4_rope.plan((4, 2048, 16, 8, 128), torch.bfloat16, PROFILES["h200"])["forward"]
    assert pairs.block_rows == 2


@pytest.mark.parametrize("hq, hk, blocks", [(28, 4, (4, 4)), (12, 2, (4, 2)), (20, 4, (4, 4)),
                                            (14, 2, (8, 2)), (40, 8, (8, 8)), (3, 1, (4, 1)),
                                            (6, 6, (8, 8))])
def test_gpu_head_steps_leave_fewest_idle_lanes(hq, hk, blocks):
    """Steps of 4 heads where the last step of 8 would leave more idle lanes (28 heads: 7 x 4, not
    4 x 8); elsewhere 8 (14 or 6 heads: 16 lanes either way). Ascend keeps the planner's tile."""
    for name in ("h100", "h200"):
        t = op.tiles(8192, hq, hk, 128, 128, torch.bfloat16, PROFILES[name])
        assert (t.block_hq, t.block_hk) == blocks, name
    npu = op.tiles(8192, 28, 4, 128, 128, torch.bfloat16, PROFILES["ascend910b4"])
    assert (npu.block_hq, npu.block_hk) == (32, 4)  # the planner's whole-token tile


def test_plan_shapes():
    plans = op.plan((4, 2048, 32, 8, 128), torch.bfloat16, PROFILES["ascend910b4"])
    assert set(plans) == {"forward", "backward"} and plans["forward"].rows == 4 * 2048
    assert op.plan((4, 2048, 32, 128), torch.bfloat16)["forward"].rows == 4 * 2048
    assert op.plan((1, 16, 32, 32, 96, 32), torch.float32)["forward"].cols == 32 * 16
    with pytest.raises(ValueError, match="rope plan shape"):
        op.plan((4, 2048, 128), torch.bfloat16)
    with pytest.raises(ValueError, match="rotary_dim"):
        op.plan((4, 2048, 32, 8, 128, 130), torch.bfloat16)


def test_position_ids_and_unsqueeze_dim_compatibility(device):
    q, k, cos, sin = make(BASE, torch.float32, device, layout=2)
    expected = rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=2)
    position_ids = torch.arange(BASE[1], device=device)[None]
    # transformers 4.x: position_ids is accepted and unused.
    for got in (rotary_pos_emb(q, k, cos, sin, position_ids, 2),
                rotary_pos_emb(q, k, cos, sin, position_ids=position_ids, unsqueeze_dim=-2),
                # transformers 5.x: the fifth positional argument is unsqueeze_dim.
                rotary_pos_emb(q, k, cos, sin, 2)):
        assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    with pytest.raises(TypeError, match="position_ids"):
        rotary_pos_emb(q, k, cos, sin, "2")


def test_outputs_are_new_and_inputs_untouched(device):
    q, k, cos, sin = make(BASE, torch.bfloat16, device)
    saved = [t.clone() for t in (q, k, cos, sin)]
    qk_, kk_ = leaf(q), leaf(k)
    qe, ke = rotary_pos_emb(qk_, kk_, cos, sin)
    dq, dk = torch.randn_like(qe), torch.randn_like(ke)
    dq0, dk0 = dq.clone(), dk.clone()
    torch.autograd.backward((qe, ke), (dq, dk))
    for t, t0 in zip((q, k, cos, sin, dq, dk), saved + [dq0, dk0]):
        assert torch.equal(t, t0)
    storages = {t.untyped_storage().data_ptr() for t in (q, k, cos, sin, qk_, kk_)}
    assert qe.untyped_storage().data_ptr() not in storages and ke.untyped_storage().data_ptr() not in storages


@pytest.mark.parametrize("layout", [1, 2])
def test_overwrite_grad_output_reuses_gradients(device, layout):
    q, k, cos, sin = make(BASE, torch.bfloat16, device, layout)
    q1, k1 = leaf(q), leaf(k)
    outs = rotary_pos_emb(q1, k1, cos, sin, unsqueeze_dim=layout)
    grads = tuple(torch.randn_like(t) for t in outs)
    expected = torch.autograd.grad(outs, (q1, k1), tuple(g.clone() for g in grads))
    q2, k2 = leaf(q), leaf(k)
    outs = rotary_pos_emb(q2, k2, cos, sin, unsqueeze_dim=layout, overwrite_grad_output=True)
    got = torch.autograd.grad(outs, (q2, k2), grads)
    for g, buffer, e in zip(got, grads, expected):
        assert g.data_ptr() == buffer.data_ptr(), "overwrite_grad_output=True must write into the gradient"
        assert torch.equal(g, e)


def test_overwritten_gradient_becomes_the_leaf_gradient_without_a_copy(device):
    """With overwrite_grad_output, q.grad and k.grad are the incoming gradients' storage even while
    the caller still holds those tensors (autograd copies a gradient it cannot take over)."""
    q, k, cos, sin = make(BASE, torch.bfloat16, device, 1)
    q1, k1 = leaf(q), leaf(k)
    outs = rotary_pos_emb(q1, k1, cos, sin, overwrite_grad_output=True)
    grads = tuple(torch.randn_like(t) for t in outs)
    torch.autograd.backward(outs, grads)
    assert q1.grad.data_ptr() == grads[0].data_ptr() and k1.grad.data_ptr() == grads[1].data_ptr()


@pytest.mark.parametrize("layout", [1, 2])
@pytest.mark.parametrize("rotary", ["full", "partial"])
def test_overwrite_inputs_rotates_q_and_k_in_their_own_storage(device, layout, rotary):
    """``overwrite_inputs=True`` returns views of ``q``/``k`` holding exactly what the new tensors
    hold, with the same gradients (partial rotary: the pass-through columns stay as they were)."""
    b, s, hq, hk, d, _ = BASE
    q, k, cos, sin = make((b, s, hq, hk, d, d if rotary == "full" else d // 2), torch.bfloat16, device, layout)
    q1, k1 = leaf(q), leaf(k)
    expected = rotary_pos_emb(q1, k1, cos, sin, unsqueeze_dim=layout)
    grads = tuple(torch.randn_like(t) for t in expected)
    torch.autograd.backward(expected, grads)
    q2, k2 = leaf(q), leaf(k)
    got = rotary_pos_emb(q2, k2, cos, sin, unsqueeze_dim=layout, overwrite_inputs=True)
    for out, inp, e in zip(got, (q2, k2), expected):
        assert out.data_ptr() == inp.data_ptr() and out.stride() == inp.stride()
        assert torch.equal(out, e) and torch.equal(inp.detach(), e.detach())
    torch.autograd.backward(got, grads)
    assert torch.equal(q2.grad, q1.grad) and torch.equal(k2.grad, k1.grad)
    with pytest.raises(RuntimeError, match="view"):  # a later in-place change is refused, not lost
        got[0].mul_(2)


@pytest.mark.parametrize("case", ["promoted", "fused_qkv", "k_is_q", "compiled"])
def test_overwrite_inputs_leaves_q_and_k_where_it_cannot_apply(device, case):
    """New tensors, ``q``/``k`` untouched: where the result's dtype is not ``q``'s (fp32 cos/sin), where
    q and k are views of one fused buffer (with gaps between their heads) or one tensor, and in a
    compiled graph (the registered op never writes its inputs)."""
    b, s, hq, hk, d, r = BASE
    q, k, cos, sin = make(BASE, torch.bfloat16, device, cos_dtype=torch.float32 if case == "promoted" else None)
    if case == "fused_qkv":
        qkv = randn(b, s, hq + hk, d, dtype=torch.bfloat16, device=device)
        q, k = qkv[:, :, :hq].transpose(1, 2), qkv[:, :, hq:].transpose(1, 2)
    elif case == "k_is_q":
        k = q
    saved = (q.clone(), k.clone())
    expected = rotary_pos_emb(q, k, cos, sin)

    def rotate(q, k, cos, sin):
        return rotary_pos_emb(q, k, cos, sin, overwrite_inputs=True)

    run = torch.compile(rotate, backend="eager", fullgraph=True) if case == "compiled" else rotate
    got = run(q, k, cos, sin)
    assert torch.equal(q, saved[0]) and torch.equal(k, saved[1])
    assert all(torch.equal(a, e) for a, e in zip(got, expected))


def test_cos_sin_get_no_gradient_and_unused_output(device):
    q, k, cos, sin = make(BASE, torch.float32, device)
    cos, sin = leaf(cos), leaf(sin)
    qk_, kk_ = leaf(q), leaf(k)
    qe, _ = rotary_pos_emb(qk_, kk_, cos, sin)
    dq = torch.randn_like(qe)
    qe.backward(dq)  # k_embed unused: k gets no gradient, as in eager
    assert cos.grad is None and sin.grad is None and kk_.grad is None
    re, _, q64, _ = reference(q, k, cos, sin)
    re.backward(dq.double())
    assert_close(qk_.grad, q64.grad, torch.float32, "dq")


def test_bad_input(device):
    q, k, cos, sin = make(BASE, torch.float32, device)
    with pytest.raises(TypeError, match="q must be a torch.Tensor"):
        rotary_pos_emb([1.0], k, cos, sin)
    with pytest.raises(TypeError, match="k must have a floating dtype"):
        rotary_pos_emb(q, k.to(torch.int32), cos, sin)
    with pytest.raises(TypeError, match="sin must have a floating dtype"):
        rotary_pos_emb(q, k, cos, sin.to(torch.int64))
    with pytest.raises(ValueError, match="unsqueeze_dim"):
        rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=3)
    with pytest.raises(ValueError, match="q must be 4-D"):
        rotary_pos_emb(q[0], k, cos, sin)
    with pytest.raises(ValueError, match="cos must be 2-D .* or 3-D"):
        rotary_pos_emb(q, k, cos[0, 0], sin[0, 0])
    with pytest.raises(ValueError, match="unsqueeze_dim must be 0 or -3 .* or 1 or -2 .* for 2-D cos"):
        rotary_pos_emb(q, k, cos[0], sin[0], unsqueeze_dim=2)
    with pytest.raises(TypeError, match="unsqueeze_dim must be an int"):
        rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1.0)
    with pytest.raises(ValueError, match="k must match q"):
        rotary_pos_emb(q, k[..., :-2], cos, sin)
    with pytest.raises(ValueError, match="sin must have cos's shape"):
        rotary_pos_emb(q, k, cos, sin[..., :-2])
    with pytest.raises(ValueError, match="cos must have shape"):
        rotary_pos_emb(q, k, cos[:, :-1], sin[:, :-1])
    with pytest.raises(ValueError, match="rotary dim"):
        rotary_pos_emb(q, k, cos[..., :-1], sin[..., :-1])
    wide = torch.cat((cos, cos), dim=-1)
    with pytest.raises(ValueError, match="rotary dim"):
        rotary_pos_emb(q, k, wide, wide)
    with pytest.raises(ValueError, match="cos must have shape"):
        rotary_pos_emb(q, k, cos.expand(3, -1, -1), sin.expand(3, -1, -1))
    with pytest.raises(TypeError, match="overwrite_grad_output must be a bool"):
        rotary_pos_emb(q, k, cos, sin, overwrite_grad_output=1)
    with pytest.raises(TypeError, match="overwrite_inputs must be a bool"):
        rotary_pos_emb(q, k, cos, sin, overwrite_inputs="yes")
    with pytest.raises(ValueError, match="cos is on meta"):
        rotary_pos_emb(q, k, torch.empty(cos.shape, device="meta"), sin)


@pytest.mark.parametrize("layout", [1, 2])
@pytest.mark.parametrize("rotary", ["full", "partial"])
def test_2d_cos_as_vision_towers_pass_it(device, layout, rotary):
    """``(seq, rotary_dim)`` cos/sin (Pixtral's vision tower calls ``apply_rotary_pos_emb`` with
    them and ``unsqueeze_dim=0``): ``cos.unsqueeze(unsqueeze_dim)`` decides the layout, as in
    transformers; negative dims too."""
    b, s, hq, hk, d, _ = BASE
    shape = (b, s, hq, hk, d, d if rotary == "full" else d // 2)
    q, k, cos, sin = make(shape, torch.float32, device, layout, real=False)
    for unsqueeze_dim in (layout - 1, layout - 4):  # 0, -3: (B, H, S, D); 1, -2: (B, S, H, D)
        check(q, k, cos[0], sin[0], layout=unsqueeze_dim)


@pytest.mark.parametrize("shape", [(2, 0, 3, 1, 16, 16), (0, 4, 3, 1, 16, 8)], ids=_id)
@pytest.mark.parametrize("layout", [1, 2])
def test_empty_input_as_torch(device, shape, layout):
    """No tokens (an empty batch or sequence): empty results and gradients, as transformers gives."""
    q, k, cos, sin = make(shape, torch.bfloat16, device, layout, real=False, cos_dtype=torch.float32)
    q1, k1, q2, k2 = leaf(q), leaf(k), leaf(q), leaf(k)
    ours = rotary_pos_emb(q1, k1, cos, sin, unsqueeze_dim=layout)
    theirs = phi3_rope(q2, k2, cos, sin, unsqueeze_dim=layout)
    for a, e in zip(ours, theirs):
        assert a.shape == e.shape and a.dtype == e.dtype
    torch.autograd.backward(ours, tuple(torch.ones_like(t) for t in ours))
    torch.autograd.backward(theirs, tuple(torch.ones_like(t) for t in theirs))
    for a, e in ((q1.grad, q2.grad), (k1.grad, k2.grad)):
        assert a.shape == e.shape and a.dtype == e.dtype


# (layout, cos dims, rotary dim, overwrite_grad_output, how the function is called): each a path
CONTRACT_CASES = {
    "bhsd": (1, 3, 16, False, "keyword"),
    "bshd_2d_cos_partial_overwrite": (2, 2, 8, True, "keyword"),
    "position_ids_tensor": (1, 3, 16, False, "position_ids"),
    "transformers5_positional": (2, 3, 16, True, "positional"),
    "k_embed_unused": (1, 3, 16, False, "q_only"),
}


@pytest.mark.parametrize("case", CONTRACT_CASES)
def test_op_contract(device, case):
    """Custom ops (opcheck), fullgraph compile equal to eager, no host synchronisation; bf16 q/k
    with fp32 cos/sin, so the outputs (fp32) and gradients (bf16) differ in dtype."""
    layout, cos_dims, r, overwrite, how = CONTRACT_CASES[case]
    q, k, cos, sin = make((2, 3, 2, 1, 16, r), torch.bfloat16, device, layout, cos_dtype=torch.float32)
    if cos_dims == 2:
        cos, sin = cos[0], sin[0]
    unsqueeze_dim = layout - (3 - cos_dims)
    position_ids = torch.arange(3, device=device)[None]
    calls = {
        "keyword": lambda q, k, cos, sin, pos: rotary_pos_emb(
            q, k, cos, sin, unsqueeze_dim=unsqueeze_dim, overwrite_grad_output=overwrite),
        "position_ids": lambda q, k, cos, sin, pos: rotary_pos_emb(q, k, cos, sin, pos, unsqueeze_dim),
        "positional": lambda q, k, cos, sin, pos: rotary_pos_emb(
            q, k, cos, sin, unsqueeze_dim, overwrite_grad_output=overwrite),
        "q_only": lambda q, k, cos, sin, pos: rotary_pos_emb(q, k, cos, sin, pos)[0],
    }
    inputs = (q.requires_grad_(), k.requires_grad_(), cos, sin, position_ids)
    assert_op_contract(calls[how], inputs, expect_ops={"rope_forward", "rope_backward"})
