"""Per-head RMSNorm + RoPE against a float64 reference that rounds where the two Hugging Face steps
(the q/k norm module, then ``apply_rotary_pos_emb``) round, and against Onca's two ops apart."""

from __future__ import annotations

import pytest
import torch

from onca.ops import rms_norm_rope as op
from onca.ops.rms_norm import rms_norm
from onca.ops.rms_norm_rope import rms_norm_rope
from onca.ops.rope import rotary_pos_emb
from tests.contract import assert_op_contract
from tests.helpers import DTYPES, SCALE, assert_close, leaf, randn, rounded
from tests.ops.test_rms_norm import reference as rms_norm_reference

CASTINGS = ("llama", "gemma", "none")

# (batch, seq, q heads, kv heads, head_dim)
BASE_SHAPE = {"cpu": (2, 7, 3, 2, 32), "gpu": (4, 2048, 16, 8, 128)}[SCALE]
SHAPES = {
    "cpu": [(1, 1, 1, 1, 2), (1, 5, 2, 1, 6), (2, 3, 5, 5, 96), (3, 4, 4, 1, 128), (1, 9, 4, 2, 256)],
    "gpu": [(4, 2048, 32, 8, 128), (2, 4096, 64, 8, 128), (1, 8192, 8, 4, 256), (3, 1000, 5, 1, 96),
            (1, 1, 1, 1, 64)],
}[SCALE]


def tables(batch, seq, head_dim, dtype, device, per_batch=False):
    """``cos``/``sin`` as transformers builds them: ``cat(freqs, freqs)`` angles of positions."""
    inv = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    shift = torch.arange(batch)[:, None] * 3 if per_batch else 0
    pos = torch.arange(seq, dtype=torch.float64)[None, :] + shift
    angles = pos[..., None] * inv
    emb = torch.cat([angles, angles], -1)
    return emb.cos().to(dtype).to(device), emb.sin().to(dtype).to(device)


def reference(x, w, cos, sin, eps=1e-6, offset=0.0, casting="llama"):
    """float64, rounding as the modules do: the norm's output in x's dtype, then the rotation of
    that in the promoted dtype (rounded once here; the kernel computes it in fp32)."""
    if w is None:
        x64, w64 = x.detach().to(torch.float64).requires_grad_(True), None
        y = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps)
    else:  # RMSNorm's own reference, casting modes and all
        y, x64, w64 = rms_norm_reference(x, w, eps, offset, casting)
    y = rounded(y, x.dtype)
    c = (cos if cos.dim() == 3 else cos[None]).to(torch.float64)[:, :, None, :]
    s = (sin if sin.dim() == 3 else sin[None]).to(torch.float64)[:, :, None, :]
    half = x.shape[-1] // 2
    rotated = torch.cat([-y[..., half:], y[..., :half]], -1)
    return y * c + rotated * s, x64, w64


def check(q, k, wq, wk, cos, sin, eps=1e-6, offset=0.0, casting="llama", dys=None, overwrite=False):
    """Both outputs and every gradient against the reference; the inputs left as they were."""
    leaves = [leaf(q), leaf(k)] + [None if w is None else leaf(w) for w in (wq, wk)]
    before = [q.clone(), k.clone()]
    outs = rms_norm_rope(*leaves, cos, sin, eps, offset, casting, overwrite)
    expected_dtype = torch.promote_types(torch.promote_types(q.dtype, cos.dtype), sin.dtype)
    if dys is None:
        dys = [randn(*x.shape, dtype=expected_dtype, device=x.device) for x in (q, k)]
    seeds = [dy.clone() for dy in dys]  # the kernel may write over dys (overwrite)
    expected_grads = []
    for x, w, out, dy, name in ((q, wq, outs[0], seeds[0], "q"), (k, wk, outs[1], seeds[1], "k")):
        assert out.shape == x.shape and out.dtype == expected_dtype and out.is_contiguous()
        ref, x64, w64 = reference(x, w, cos, sin, eps, offset, casting)
        # x's dtype's tolerance: the norm's output is rounded to it before the rotation, and a
        # GPU's approximate rsqrt moves an element across a rounding boundary now and then.
        assert_close(out, ref, x.dtype, f"{name}_embed")
        ref.backward(dy.to(torch.float64))
        expected_grads.append((x64.grad, None if w is None else w64.grad))
    torch.autograd.backward(outs, dys)
    for (x, w, x_leaf, w_leaf, name), (dx, dw) in zip(
            ((q, wq, leaves[0], leaves[2], "q"), (k, wk, leaves[1], leaves[3], "k")), expected_grads):
        assert_close(x_leaf.grad, dx, x.dtype, f"d{name}")
        assert x_leaf.grad.dtype == x.dtype
        if w is not None:
            assert_close(w_leaf.grad, dw, x.dtype, f"d{name}_weight")
            assert w_leaf.grad.dtype == w.dtype
    assert torch.equal(q, before[0]) and torch.equal(k, before[1]), "an input was changed"
    return leaves


def weight(head_dim, dtype, device, offset=0.0):
    return randn(head_dim, dtype=dtype, device=device, std=0.5) + (0.0 if offset else 1.0)


def heads(b, s, hq, hk, d, dtype, device):
    return randn(b, s, hq, d, dtype=dtype, device=device), randn(b, s, hk, d, dtype=dtype, device=device)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("casting", CASTINGS)
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_matches_reference(profile, device, dtype, casting, offset):
    b, s, hq, hk, d = BASE_SHAPE
    cos, sin = tables(b, s, d, dtype, device)
    check(*heads(b, s, hq, hk, d, dtype, device), weight(d, dtype, device, offset),
          weight(d, dtype, device, offset), cos, sin, eps=1e-5, offset=offset, casting=casting)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_shapes(profile, device, shape, dtype):
    b, s, hq, hk, d = shape
    cos, sin = tables(b, s, d, dtype, device)
    check(*heads(b, s, hq, hk, d, dtype, device), weight(d, dtype, device), weight(d, dtype, device),
          cos, sin)


@pytest.mark.parametrize("table", ["per_batch", "2d", "fp32"])
def test_tables(profile, device, table):
    """Per-sequence tables, a vision tower's 2-D ones, and fp32 tables with bf16 heads (the result
    is promoted to fp32, as PyTorch's expression promotes it)."""
    b, s, hq, hk, d = BASE_SHAPE
    table_dtype = torch.float32 if table == "fp32" else torch.bfloat16
    cos, sin = tables(b, s, d, table_dtype, device, per_batch=table == "per_batch")
    if table == "2d":
        cos, sin = cos[0], sin[0]
    check(*heads(b, s, hq, hk, d, torch.bfloat16, device), weight(d, torch.bfloat16, device),
          weight(d, torch.bfloat16, device), cos, sin)


@pytest.mark.parametrize("layout", ["transposed", "fused_projection", "strided_grad"])
def test_layouts_read_in_place(profile, device, layout):
    """Heads of a (batch, heads, seq, dim) tensor seen through ``transpose(1, 2)``, q and k slices
    of a fused qkv projection, and gradients arriving through a transpose."""
    b, s, hq, hk, d = BASE_SHAPE
    dtype = torch.bfloat16
    cos, sin = tables(b, s, d, dtype, device)
    if layout == "transposed":
        q = randn(b, hq, s, d, dtype=dtype, device=device).transpose(1, 2)
        k = randn(b, hk, s, d, dtype=dtype, device=device).transpose(1, 2)
    elif layout == "fused_projection":
        qkv = randn(b, s, (hq + 2 * hk) * d, dtype=dtype, device=device)
        q = qkv[..., :hq * d].view(b, s, hq, d)
        k = qkv[..., hq * d:(hq + hk) * d].view(b, s, hk, d)
    else:
        q, k = heads(b, s, hq, hk, d, dtype, device)
    assert layout == "strided_grad" or not (q.is_contiguous() or k.is_contiguous())
    dys = None
    if layout == "strided_grad":
        dys = [randn(b, h, s, d, dtype=dtype, device=device).transpose(1, 2) for h in (hq, hk)]
    check(q, k, weight(d, dtype, device), weight(d, dtype, device), cos, sin, dys=dys)


def test_without_weights(profile, device):
    b, s, hq, hk, d = BASE_SHAPE
    cos, sin = tables(b, s, d, torch.bfloat16, device)
    check(*heads(b, s, hq, hk, d, torch.bfloat16, device), None, None, cos, sin)


@pytest.mark.parametrize("strided", [False, True])
def test_overwrite_grad_output_writes_over_the_incoming_gradients(profile, device, strided):
    """Asked for, ``dq``/``dk`` take the incoming gradients' storage (values as without it); a
    strided gradient, whose rows are not ``dq``'s, gets a new buffer and stays as it was."""
    b, s, hq, hk, d = BASE_SHAPE
    dtype = torch.bfloat16
    cos, sin = tables(b, s, d, dtype, device)
    q, k = heads(b, s, hq, hk, d, dtype, device)
    if strided:
        dys = [randn(b, h, s, d, dtype=dtype, device=device).transpose(1, 2) for h in (hq, hk)]
    else:
        dys = [randn(b, s, h, d, dtype=dtype, device=device) for h in (hq, hk)]
    copies = [dy.clone() for dy in dys]
    leaves = check(q, k, weight(d, dtype, device), weight(d, dtype, device), cos, sin, dys=dys,
                   overwrite=True)
    for dy, copy, x_leaf in zip(dys, copies, leaves[:2]):
        if strided:
            assert torch.equal(dy, copy)
        else:
            assert torch.equal(dy, x_leaf.grad)


def test_an_unused_output_gets_zero_gradients(device):
    b, s, hq, hk, d = 2, 5, 3, 1, 32
    q, k = heads(b, s, hq, hk, d, torch.float32, device)
    q, k = leaf(q), leaf(k)
    wq, wk = leaf(weight(d, torch.float32, device)), leaf(weight(d, torch.float32, device))
    cos, sin = tables(b, s, d, torch.float32, device)
    q_embed, _ = rms_norm_rope(q, k, wq, wk, cos, sin)
    q_embed.sum().backward()
    assert torch.equal(k.grad, torch.zeros_like(k)) and torch.equal(wk.grad, torch.zeros_like(wk))
    assert q.grad.abs().sum() > 0 and wq.grad.abs().sum() > 0


@pytest.mark.parametrize("casting", CASTINGS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_equals_the_two_ops_apart(profile, device, dtype, casting):
    """Onca's RMSNorm then Onca's RoPE give the same values, within the dtype's rounding: the
    kernels round at the same points, but each sums a row's squares in its own order (bit for bit
    under the interpreter, not on a GPU)."""
    b, s, hq, hk, d = BASE_SHAPE
    q, k = heads(b, s, hq, hk, d, dtype, device)
    wq, wk = weight(d, dtype, device), weight(d, dtype, device)
    cos, sin = tables(b, s, d, dtype, device)
    dys = [randn(*x.shape, dtype=dtype, device=device) for x in (q, k)]
    fused_leaves = [leaf(t) for t in (q, k, wq, wk)]
    fused = rms_norm_rope(*fused_leaves, cos, sin, 1e-6, 0.0, casting)
    torch.autograd.backward(fused, dys)
    apart_leaves = [leaf(t) for t in (q, k, wq, wk)]
    qn = rms_norm(apart_leaves[0], apart_leaves[2], 1e-6, 0.0, casting).transpose(1, 2)
    kn = rms_norm(apart_leaves[1], apart_leaves[3], 1e-6, 0.0, casting).transpose(1, 2)
    apart = [t.transpose(1, 2) for t in rotary_pos_emb(qn, kn, cos, sin)]
    torch.autograd.backward(apart, dys)
    for name, a, e in zip(("q", "k"), fused, apart):
        assert_close(a, e, dtype, f"{name}_embed")
    for name, a, e in zip(("dq", "dk", "dq_weight", "dk_weight"), fused_leaves, apart_leaves):
        assert_close(a.grad, e.grad, dtype, name)


def test_no_tokens(profile, device):
    q = randn(2, 0, 3, 32, dtype=torch.bfloat16, device=device).requires_grad_()
    k = randn(2, 0, 1, 32, dtype=torch.bfloat16, device=device).requires_grad_()
    wq, wk = (weight(32, torch.bfloat16, device).requires_grad_() for _ in range(2))
    cos, sin = tables(2, 0, 32, torch.bfloat16, device)
    q_embed, k_embed = rms_norm_rope(q, k, wq, wk, cos, sin)
    assert q_embed.shape == q.shape and k_embed.shape == k.shape
    (q_embed.sum() + k_embed.sum()).backward()
    assert q.grad.shape == q.shape and torch.equal(wq.grad, torch.zeros_like(wq))
    assert torch.equal(wk.grad, torch.zeros_like(wk))


def test_plan_is_one_tile_a_head(profile):
    plans = op.plan((4, 2048, 16, 8, 128), torch.bfloat16, profile)
    assert plans["forward"].col_tiles == 1 and plans["backward"].col_tiles == 1
    assert plans["forward"].block_cols >= 128
    assert plans["backward"].persistent
    same_heads = op.plan((4, 2048, 8, 128), torch.bfloat16, profile)
    assert same_heads == op.plan((4, 2048, 8, 8, 128), torch.bfloat16, profile)
    with pytest.raises(ValueError, match="plan shape"):
        op.plan((4, 2048, 128), torch.bfloat16, profile)


def test_bad_input_names_the_argument(device):
    q, k = heads(2, 5, 3, 1, 32, torch.float32, device)
    w = torch.ones(32, device=device)
    cos, sin = tables(2, 5, 32, torch.float32, device)
    with pytest.raises(ValueError, match="q must be 4-D"):
        rms_norm_rope(q[0], k, w, w, cos, sin)
    with pytest.raises(ValueError, match="head_dim"):
        rms_norm_rope(q[..., :31], k[..., :31], w[:31], w[:31], cos[..., :31], sin[..., :31])
    with pytest.raises(ValueError, match=r"k must be \(batch=2, seq=5, kv_heads, head_dim=32\)"):
        rms_norm_rope(q, k[:, :4], w, w, cos, sin)
    with pytest.raises(ValueError, match="k must be .* of q's dtype"):
        rms_norm_rope(q, k.to(torch.bfloat16), w, w, cos, sin)
    with pytest.raises(ValueError, match="k_weight must be 1-D"):
        rms_norm_rope(q, k, w, torch.ones(16, device=device), cos, sin)
    with pytest.raises(ValueError, match="both be tensors or both be None"):
        rms_norm_rope(q, k, w, None, cos, sin)
    with pytest.raises(ValueError, match=r"cos must be \(1 or batch=2, seq=5, head_dim=32\)"):
        rms_norm_rope(q, k, w, w, cos[..., :16], sin)
    with pytest.raises(ValueError, match="sin must be"):
        rms_norm_rope(q, k, w, w, cos, sin[:, :4])
    with pytest.raises(ValueError, match="casting_mode"):
        rms_norm_rope(q, k, w, w, cos, sin, casting_mode="olmo")
    with pytest.raises(TypeError, match="overwrite_grad_output"):
        rms_norm_rope(q, k, w, w, cos, sin, overwrite_grad_output="yes")
    with pytest.raises(TypeError, match="q"):
        rms_norm_rope(q.to(torch.int32), k, w, w, cos, sin)


@pytest.mark.parametrize("affine", [True, False])
def test_op_contract(device, affine):
    q, k = heads(2, 5, 3, 1, 32, torch.bfloat16, device)
    wq, wk = weight(32, torch.bfloat16, device), weight(32, torch.bfloat16, device)
    cos, sin = tables(2, 5, 32, torch.bfloat16, device)

    def fn(q, k, wq, wk):
        weights = (wq, wk) if affine else (None, None)
        return rms_norm_rope(q, k, *weights, cos, sin, 1e-6, 0.0, "llama", True)

    inputs = [t.requires_grad_() for t in (q, k, wq, wk)]
    assert_op_contract(fn, inputs, expect_ops={"rms_norm_rope_forward", "rms_norm_rope_backward"})


def test_the_16_bit_backward_asks_for_the_register_cap(monkeypatch, device):
    """Its bf16 backward is compiled for the registers its persistent grid's programs share (see
    ``onca.ops._launch.row_launch``'s ``cap_registers``: measured faster on an H200); fp32 not."""
    from onca.ops import _launch, _row_norm

    asked = []

    def spy(*args, cap_registers=False, **kwargs):
        asked.append(cap_registers)
        return _launch.row_launch(*args, cap_registers=cap_registers, **kwargs)

    monkeypatch.setattr(_row_norm, "row_launch", spy)
    for dtype in (torch.bfloat16, torch.float32):
        q, k = heads(1, 3, 2, 1, 32, dtype, device)
        q, k = leaf(q), leaf(k)
        wq, wk = leaf(weight(32, dtype, device)), leaf(weight(32, dtype, device))
        cos, sin = tables(1, 3, 32, dtype, device)
        q_embed, k_embed = rms_norm_rope(q, k, wq, wk, cos, sin)
        (q_embed.sum() + k_embed.sum()).backward()
    assert asked == [False, True, False, False]  # forward, backward; bf16 then fp32
