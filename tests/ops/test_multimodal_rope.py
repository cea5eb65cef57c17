"""Multimodal RoPE (Qwen2-VL / Qwen2.5-VL / Qwen3-VL) against a float64 reference and transformers."""

from __future__ import annotations

import types

import pytest
import torch

import onca
from tests.contract import assert_op_contract
from tests.helpers import DTYPES, SCALE, assert_close, leaf, randn

transformers = pytest.importorskip("transformers")
from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLRotaryEmbedding
from transformers.models.qwen2_vl.modeling_qwen2_vl import apply_rotary_pos_emb as qwen2_vl_rope
from transformers.models.qwen2_vl.modeling_qwen2_vl import rotate_half
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding

multimodal_rope = onca.functional.multimodal_rope

# (batch, seq, q heads, kv heads, head_dim, mrope_section); rotary_dim = 2 * sum(section)
SHAPES = {
    "cpu": [
        (2, 5, 4, 2, 32, (4, 6, 6)),  # GQA, Qwen2-VL's proportions at head_dim 32
        (2, 4, 3, 1, 48, (2, 5, 5)),  # partial rotary (24 of 48), non-power-of-two half (12), odd heads
        (1, 3, 2, 1, 32, (0, 9, 7)),  # an empty stream; sections ending off a vector's width
    ],
    "gpu": [
        (4, 2048, 28, 4, 128, (16, 24, 24)),  # Qwen2.5-VL-7B
        (2, 4096, 32, 8, 128, (24, 20, 20)),  # Qwen3-VL
        (1, 1, 16, 2, 128, (16, 24, 24)),
        (2, 1024, 12, 2, 128, (8, 12, 12)),  # partial rotary
    ],
}[SCALE]


def _id(shape):
    return "x".join(str(s) if not isinstance(s, tuple) else "-".join(map(str, s)) for s in shape)


def make(shape, dtype, device, layout=1, cos_batch="batch", real=False, cos_dtype=None):
    """q/k in the layout (strided views of a (B, S, H, D) projection for layout 1) and per-stream
    cos/sin of shape (3, 1 or B, S, rotary_dim): real tables (three position streams, duplicated
    halves) or arbitrary values."""
    b, s, hq, hk, d, sec = shape
    r = 2 * sum(sec)

    def qk(h):
        t = randn(b, s, h, d, dtype=dtype, device=device)
        return t.transpose(1, 2) if layout == 1 else t

    cb = b if cos_batch == "batch" else 1
    if real:
        inv_freq = 1.0 / (10000 ** (torch.arange(0, r, 2, dtype=torch.float64) / r))
        pos = torch.randint(0, 50, (3, cb, s)).to(torch.float64)
        freqs = pos[..., None] * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
    else:
        cos, sin = torch.randn(3, cb, s, r, dtype=torch.float64), torch.randn(3, cb, s, r, dtype=torch.float64)
    cdt = cos_dtype or dtype
    return qk(hq), qk(hk), cos.to(device=device, dtype=cdt), sin.to(device=device, dtype=cdt)


def assemble(t, sec, interleaved):
    """The per-column table (batch, seq, rotary_dim) of a per-stream one (3, batch, seq, rotary_dim):
    transformers 4.x's ``split(mrope_section * 2)`` for contiguous sections, Qwen3-VL's layout on
    each half for interleaved ones. Written out here for arbitrary (non-duplicated) tables."""
    if not interleaved:
        return torch.cat([m[i % 3] for i, m in enumerate(t.split(list(sec) * 2, dim=-1))], dim=-1)
    half = t.shape[-1] // 2
    out = t[0].clone()
    for stream, offset in ((1, 1), (2, 2)):
        for start in (0, half):
            idx = slice(start + offset, start + min(3 * sec[stream], half), 3)
            out[..., idx] = t[stream][..., idx]
    return out


def reference(q, k, cos, sin, sec, interleaved, layout=1):
    """Float64: the assembled tables, then the partial-rotary RoPE expression."""
    q64 = q.detach().to(torch.float64).requires_grad_(True)
    k64 = k.detach().to(torch.float64).requires_grad_(True)
    c = assemble(cos.to(torch.float64), sec, interleaved).unsqueeze(layout)
    s = assemble(sin.to(torch.float64), sec, interleaved).unsqueeze(layout)
    r = c.shape[-1]

    def rot(x):
        xr, xp = x[..., :r], x[..., r:]
        return torch.cat((xr * c + rotate_half(xr) * s, xp), dim=-1)

    return rot(q64), rot(k64), q64, k64


def check(q, k, cos, sin, sec, interleaved, layout=1):
    dtype = q.dtype
    q1, k1 = leaf(q), leaf(k)
    qe, ke = multimodal_rope(q1, k1, cos, sin, sec, unsqueeze_dim=layout, mrope_interleaved=interleaved)
    assert qe.shape == q.shape and ke.shape == k.shape
    rq, rk, q64, k64 = reference(q, k, cos, sin, sec, interleaved, layout)
    assert_close(qe, rq, dtype, "q_embed")
    assert_close(ke, rk, dtype, "k_embed")
    dq, dk = torch.randn_like(qe), torch.randn_like(ke)
    torch.autograd.backward((qe, ke), (dq, dk))
    torch.autograd.backward((rq, rk), (dq.to(torch.float64), dk.to(torch.float64)))
    assert_close(q1.grad, q64.grad, dtype, "dq")
    assert_close(k1.grad, k64.grad, dtype, "dk")
    assert q1.grad.dtype == q.dtype and k1.grad.dtype == k.dtype


@pytest.mark.parametrize("shape", SHAPES, ids=_id)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("interleaved", [False, True], ids=["sections", "interleaved"])
def test_shapes(profile, device, shape, dtype, interleaved):
    q, k, cos, sin = make(shape, dtype, device)
    check(q, k, cos, sin, shape[-1], interleaved)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", [1, 2])
@pytest.mark.parametrize("cos_batch", [1, "batch"])
def test_layouts_and_dtypes(device, dtype, layout, cos_batch):
    shape = SHAPES[0]
    q, k, cos, sin = make(shape, dtype, device, layout, cos_batch)
    check(q, k, cos, sin, shape[-1], False, layout)


@pytest.mark.parametrize("model", ["qwen2_vl", "qwen3_vl"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_matches_transformers(device, model, dtype):
    """transformers 5 assembles the tables in the rotary embedding module
    (``recomposition_frequencies``: Qwen2-VL's contiguous sections, Qwen3-VL's interleaved ones)
    and calls ``apply_rotary_pos_emb``; the op takes the per-stream tables and does both, in the
    same dtype (bf16 tables in, as the rotary module casts them)."""
    b, s, hq, hk, d = 2, 6, 4, 2, 64
    sec, cls, interleaved = {"qwen2_vl": ((8, 12, 12), Qwen2VLRotaryEmbedding, False),
                             "qwen3_vl": ((12, 10, 10), Qwen3VLTextRotaryEmbedding, True)}[model]
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    pos = torch.randint(0, 40, (3, b, s)).float()
    freqs = pos[..., None] * inv_freq  # (3, B, S, D/2), as the module computes them
    this = types.SimpleNamespace(mrope_section=list(sec))
    hf_cos = cls.recomposition_frequencies(this, freqs.cos().clone()).to(dtype).to(device)
    hf_sin = cls.recomposition_frequencies(this, freqs.sin().clone()).to(dtype).to(device)
    cos = torch.cat((freqs, freqs), dim=-1).cos().to(dtype).to(device)  # per stream
    sin = torch.cat((freqs, freqs), dim=-1).sin().to(dtype).to(device)
    q = randn(b, s, hq, d, dtype=dtype, device=device).transpose(1, 2)
    k = randn(b, s, hk, d, dtype=dtype, device=device).transpose(1, 2)
    q1, k1, q2, k2 = leaf(q), leaf(k), leaf(q), leaf(k)
    ours = multimodal_rope(q1, k1, cos, sin, sec, mrope_interleaved=interleaved)
    theirs = qwen2_vl_rope(q2, k2, hf_cos, hf_sin)
    for a, e, name in zip(ours, theirs, ("q_embed", "k_embed")):
        assert a.dtype == e.dtype and a.stride() == e.stride(), name
        assert_close(a, e, dtype, name)
    grads = tuple(torch.randn_like(t) for t in theirs)
    torch.autograd.backward(ours, grads)
    torch.autograd.backward(theirs, grads)
    assert_close(q1.grad, q2.grad, dtype, "dq")
    assert_close(k1.grad, k2.grad, dtype, "dk")


def test_real_tables_bf16_q_fp32_tables(device):
    """bf16 q/k with fp32 tables: the result promotes to fp32 as the torch expression does; the
    gradients come back in bf16."""
    shape = SHAPES[0]
    q, k, cos, sin = make(shape, torch.bfloat16, device, real=True, cos_dtype=torch.float32)
    q1, k1 = leaf(q), leaf(k)
    qe, ke = multimodal_rope(q1, k1, cos, sin, shape[-1])
    assert qe.dtype == ke.dtype == torch.float32
    rq, rk, q64, k64 = reference(q, k, cos, sin, shape[-1], False)
    assert_close(qe, rq, torch.float32, "q_embed")
    assert_close(ke, rk, torch.float32, "k_embed")
    (qe.sum() + ke.sum()).backward()
    (rq.sum() + rk.sum()).backward()
    assert q1.grad.dtype == torch.bfloat16
    assert_close(q1.grad, q64.grad, torch.bfloat16, "dq")


def test_tiled_path(profile, device, onchip_bytes):
    """A tiny on-chip budget: several head blocks and column tiles per half."""
    forced = onchip_bytes(2048)
    shape = (1, 4, 6, 3, 64, (8, 12, 12))
    from onca.ops import rope

    t = rope.tiles(4, 6, 3, 64, 64, torch.float32, forced)
    assert t.plan.col_tiles > 1 and t.j_tiles > 1
    for interleaved in (False, True):
        q, k, cos, sin = make(shape, torch.float32, device)
        check(q, k, cos, sin, shape[-1], interleaved)


def test_gpu_tile_in_steps_of_four_heads(device, monkeypatch):
    """The GPU profile's tile for 12 query heads (3 steps of 4, not 2 of 8: Qwen2-VL-2B's count),
    run on the interpreter (or the GPU itself) against the reference."""
    from onca import device as onca_device
    from onca.ops import rope

    monkeypatch.setenv("ONCA_DEVICE_PROFILE", "h100")
    onca_device.reset()
    try:
        shape = (1, 3, 12, 2, 32, (4, 6, 6))
        t = rope.tiles(3, 12, 2, 32, 32, torch.bfloat16)
        assert (t.block_hq, t.block_hk) == (4, 2)
        for interleaved in (False, True):
            check(*make(shape, torch.bfloat16, device), shape[-1], interleaved)
    finally:
        monkeypatch.delenv("ONCA_DEVICE_PROFILE")
        onca_device.reset()


def test_gpu_programs_of_two_warps(device, monkeypatch):
    """On a GPU profile multimodal RoPE's programs run 2 warps where the tile has more (plain RoPE
    keeps the tile's), forward and backward, and still match the reference."""
    from onca import device as onca_device
    from onca.ops import rope

    monkeypatch.setenv("ONCA_DEVICE_PROFILE", "h100")
    onca_device.reset()
    try:
        shape = (1, 4, 28, 4, 64, (8, 12, 12))
        q, k, cos, sin = make(shape, torch.bfloat16, device)
        tile_warps = rope.tiles(4, 28, 4, 64, 64, torch.bfloat16).plan.num_warps
        assert tile_warps > rope.MROPE_GPU_WARPS
        for backward in (False, True):
            for mrope, (c, s) in ((1, (cos, sin)), (0, (cos[0], sin[0]))):
                config = rope._launch_config(q, k, c, s, q, k, True, backward, False, mrope,
                                             shape[-1] if mrope else (0, 0, 0), False, False)
                assert config[2]["num_warps"] == (rope.MROPE_GPU_WARPS if mrope else tile_warps)
        check(q, k, cos, sin, shape[-1], False)
    finally:
        monkeypatch.delenv("ONCA_DEVICE_PROFILE")
        onca_device.reset()


def test_unused_k_and_no_table_gradient(device):
    shape = SHAPES[0]
    q, k, cos, sin = make(shape, torch.float32, device)
    cos, sin, q1, k1 = leaf(cos), leaf(sin), leaf(q), leaf(k)
    qe, _ = multimodal_rope(q1, k1, cos, sin, shape[-1])
    dq = torch.randn_like(qe)
    qe.backward(dq)
    assert cos.grad is None and sin.grad is None and k1.grad is None
    rq, _, q64, _ = reference(q, k, cos, sin, shape[-1], False)
    rq.backward(dq.double())
    assert_close(q1.grad, q64.grad, torch.float32, "dq")


@pytest.mark.parametrize("case", ["in_place", "promoted", "fused_qk", "compiled"])
def test_overwrite_inputs(device, case):
    """``overwrite_inputs=True`` rotates q and k in their own storage (views of them returned) with
    the values and gradients of new tensors; where the result's dtype is not q's (fp32 tables), q and
    k are views of one buffer, or in a compiled graph: new tensors, q and k untouched."""
    shape = SHAPES[0]
    b, s, hq, hk, d, sec = shape
    q, k, cos, sin = make(shape, torch.bfloat16, device, cos_dtype=torch.float32 if case == "promoted" else None)
    if case == "fused_qk":
        qk = randn(b, s, hq + hk, d, dtype=torch.bfloat16, device=device)
        q, k = qk[:, :, :hq].transpose(1, 2), qk[:, :, hq:].transpose(1, 2)
    q1, k1 = leaf(q), leaf(k)
    expected = multimodal_rope(q1, k1, cos, sin, sec)
    grads = tuple(torch.randn_like(t) for t in expected)
    torch.autograd.backward(expected, grads)
    q2, k2 = leaf(q), leaf(k)
    saved = (q2.detach().clone(), k2.detach().clone())

    def rotate(q, k, cos, sin):
        return multimodal_rope(q, k, cos, sin, sec, overwrite_inputs=True)

    got = (torch.compile(rotate, backend="eager", fullgraph=True) if case == "compiled" else rotate)(q2, k2, cos, sin)
    for out, inp, e, before in zip(got, (q2, k2), expected, saved):
        assert torch.equal(out, e)
        if case == "in_place":
            assert out.data_ptr() == inp.data_ptr() and out.stride() == inp.stride()
            assert torch.equal(inp.detach(), e.detach())
        else:
            assert out.data_ptr() != inp.data_ptr() and torch.equal(inp.detach(), before)
    torch.autograd.backward(got, grads)
    assert torch.equal(q2.grad, q1.grad) and torch.equal(k2.grad, k1.grad)


@pytest.mark.parametrize("layout", [1, 2])
def test_empty_input(device, layout):
    shape = (2, 0, 3, 1, 16, (2, 3, 3))
    q, k, cos, sin = make(shape, torch.bfloat16, device, layout)
    q1, k1 = leaf(q), leaf(k)
    qe, ke = multimodal_rope(q1, k1, cos, sin, shape[-1], unsqueeze_dim=layout)
    assert qe.shape == q.shape and ke.shape == k.shape
    (qe.sum() + ke.sum()).backward()
    assert q1.grad.shape == q.shape and k1.grad.shape == k.shape


def test_bad_input(device):
    shape = SHAPES[0]
    sec = shape[-1]
    q, k, cos, sin = make(shape, torch.float32, device)
    with pytest.raises(TypeError, match="cos must be a torch.Tensor"):
        multimodal_rope(q, k, [1.0], sin, sec)
    with pytest.raises(ValueError, match=r"cos must be 4-D \(3, "):
        multimodal_rope(q, k, cos[0], sin[0], sec)
    with pytest.raises(ValueError, match="sin must be 4-D"):
        multimodal_rope(q, k, cos, sin[:2], sec)
    with pytest.raises(ValueError, match="sin must have cos's shape"):
        multimodal_rope(q, k, cos, sin[..., :-2], sec)
    with pytest.raises(TypeError, match="sin must have a floating dtype"):
        multimodal_rope(q, k, cos, sin.to(torch.int64), sec)
    with pytest.raises(TypeError, match="mrope_section must be a list or tuple"):
        multimodal_rope(q, k, cos, sin, 16)
    with pytest.raises(ValueError, match="mrope_section must be 3"):
        multimodal_rope(q, k, cos, sin, (8, 8))
    with pytest.raises(ValueError, match="mrope_section must sum to half"):
        multimodal_rope(q, k, cos, sin, (4, 6, 7))
    with pytest.raises(ValueError, match="unsqueeze_dim must be"):
        multimodal_rope(q, k, cos, sin, sec, unsqueeze_dim=0)
    with pytest.raises(ValueError, match="q must be 4-D"):
        multimodal_rope(q[0], k, cos, sin, sec)
    with pytest.raises(ValueError, match="k must match q"):
        multimodal_rope(q, k[..., :-2], cos, sin, sec)
    with pytest.raises(TypeError, match="mrope_interleaved must be a bool"):
        multimodal_rope(q, k, cos, sin, sec, mrope_interleaved=1)
    with pytest.raises(TypeError, match="overwrite_inputs must be a bool"):
        multimodal_rope(q, k, cos, sin, sec, overwrite_inputs=1)


@pytest.mark.parametrize("interleaved", [False, True], ids=["sections", "interleaved"])
def test_op_contract(device, interleaved):
    """Custom ops (opcheck), fullgraph compile equal to eager, no host synchronisation; bf16 q/k
    with fp32 tables."""
    q, k, cos, sin = make((2, 3, 2, 1, 16, (2, 3, 3)), torch.bfloat16, device, cos_dtype=torch.float32)
    fn = lambda q, k, cos, sin: multimodal_rope(q, k, cos, sin, [2, 3, 3],  # noqa: E731
                                                mrope_interleaved=interleaved)
    assert_op_contract(fn, (q.requires_grad_(), k.requires_grad_(), cos, sin),
                       expect_ops={"multimodal_rope_forward", "multimodal_rope_backward"})
