"""Llama 4's complex RoPE against a float64 reference and transformers' ``apply_rotary_emb``."""

from __future__ import annotations

import pytest
import torch

import onca
from tests.contract import assert_op_contract
from tests.helpers import DTYPES, SCALE, assert_close, leaf, randn

transformers = pytest.importorskip("transformers")
from transformers.models.llama4.modeling_llama4 import apply_rotary_emb as hf_llama4_rope

llama4_rope = onca.functional.llama4_rope

# (batch, seq, q heads, kv heads, head_dim)
SHAPES = {
    "cpu": [
        (2, 5, 4, 2, 32),  # GQA
        (1, 1, 3, 3, 24),  # one token, non-power-of-two half (12)
        (2, 3, 5, 1, 128),  # MQA, Llama 4's head_dim
    ],
    "gpu": [
        (4, 2048, 40, 8, 128),  # Llama 4 Scout / Maverick
        (2, 8192, 40, 8, 128),
        (1, 1, 40, 8, 128),
    ],
}[SCALE]


def _id(shape):
    return "x".join(map(str, shape))


def make(shape, dtype, device, freqs_batch=1, scaling=1.0):
    """q/k (B, S, H, D) and Llama 4's complex table (1 or B, S, D/2), times ``scaling`` (the
    rotary module's attention scaling: not a unit rotation in general)."""
    b, s, hq, hk, d = shape
    q = randn(b, s, hq, d, dtype=dtype, device=device)
    k = randn(b, s, hk, d, dtype=dtype, device=device)
    fb = b if freqs_batch == "batch" else 1
    inv_freq = 1.0 / (500000 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    pos = torch.arange(s, dtype=torch.float32)[None, :] + 7 * torch.arange(fb, dtype=torch.float32)[:, None]
    freqs = pos[..., None] * inv_freq
    freqs_cis = torch.polar(torch.ones_like(freqs), freqs) * scaling
    return q, k, freqs_cis.to(device)


def reference(q, k, freqs_cis):
    """transformers' expression in float64 / complex128 (the model's own casts q to fp32)."""
    q64 = q.detach().to(torch.float64).requires_grad_(True)
    k64 = k.detach().to(torch.float64).requires_grad_(True)
    f = freqs_cis.to(torch.complex128)
    f = (f[None] if f.dim() == 2 else f)[:, :, None, :]

    def rot(x):
        return torch.view_as_real(torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2)) * f).flatten(3)

    return rot(q64), rot(k64), q64, k64


def check(q, k, freqs_cis):
    dtype = q.dtype
    q1, k1 = leaf(q), leaf(k)
    qe, ke = llama4_rope(q1, k1, freqs_cis)
    assert qe.dtype == q.dtype and ke.dtype == k.dtype
    rq, rk, q64, k64 = reference(q, k, freqs_cis)
    assert_close(qe, rq, dtype, "q_embed")
    assert_close(ke, rk, dtype, "k_embed")
    dq, dk = torch.randn_like(qe), torch.randn_like(ke)
    torch.autograd.backward((qe, ke), (dq, dk))
    torch.autograd.backward((rq, rk), (dq.to(torch.float64), dk.to(torch.float64)))
    assert_close(q1.grad, q64.grad, dtype, "dq")
    assert_close(k1.grad, k64.grad, dtype, "dk")


@pytest.mark.parametrize("shape", SHAPES, ids=_id)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_shapes(profile, device, shape, dtype):
    check(*make(shape, dtype, device))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("freqs_batch", [1, "batch"])
def test_dtypes_and_table_batch(device, dtype, freqs_batch):
    check(*make(SHAPES[0], dtype, device, freqs_batch, scaling=0.75))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_matches_transformers(device, dtype):
    """The model's own function in the model's dtypes: same values, dtypes, layout, gradients."""
    q, k, freqs_cis = make(SHAPES[0], dtype, device, "batch")
    q1, k1, q2, k2 = leaf(q), leaf(k), leaf(q), leaf(k)
    ours = llama4_rope(q1, k1, freqs_cis)
    theirs = hf_llama4_rope(q2, k2, freqs_cis)
    for a, e, name in zip(ours, theirs, ("q_embed", "k_embed")):
        assert a.dtype == e.dtype and a.shape == e.shape, name
        assert_close(a, e, dtype, name)
    grads = tuple(torch.randn_like(t) for t in theirs)
    torch.autograd.backward(ours, grads)
    torch.autograd.backward(theirs, grads)
    assert_close(q1.grad, q2.grad, dtype, "dq")
    assert_close(k1.grad, k2.grad, dtype, "dk")


def test_strided_inputs_and_2d_table(device):
    """q/k sliced from a fused projection (unit last-dim stride, gaps between heads' rows), a
    ``(seq, D/2)`` table, and a non-contiguous (expanded) table."""
    b, s, hq, hk, d = SHAPES[0]
    qkv = randn(b, s, (hq + 2 * hk) * d, dtype=torch.bfloat16, device=device)
    q = qkv[..., : hq * d].view(b, s, hq, d)
    k = qkv[..., hq * d:(hq + hk) * d].view(b, s, hk, d)
    _, _, freqs_cis = make(SHAPES[0], torch.bfloat16, device)
    check(q, k, freqs_cis[0])
    check(q, k, freqs_cis.expand(b, -1, -1))
    check(q.transpose(1, 2).contiguous().transpose(1, 2), k, freqs_cis)  # heads-major storage


def test_tiled_path(profile, device, onchip_bytes):
    forced = onchip_bytes(2048)
    from onca.ops import rope

    t = rope.tiles(4, 6, 3, 128, 128, torch.float32, forced)
    assert t.plan.col_tiles > 1 and t.j_tiles > 1
    check(*make((1, 4, 6, 3, 128), torch.float32, device))


def test_unused_k_and_overwrite(device):
    q, k, freqs_cis = make(SHAPES[0], torch.bfloat16, device)
    q1, k1 = leaf(q), leaf(k)
    qe, _ = llama4_rope(q1, k1, freqs_cis)
    qe.backward(torch.ones_like(qe))
    assert k1.grad is None
    q2, k2 = leaf(q), leaf(k)
    outs = llama4_rope(q2, k2, freqs_cis, overwrite_grad_output=True)
    grads = tuple(torch.randn_like(t) for t in outs)
    q3, k3 = leaf(q), leaf(k)
    want = torch.autograd.grad(llama4_rope(q3, k3, freqs_cis), (q3, k3), tuple(g.clone() for g in grads))
    got = torch.autograd.grad(outs, (q2, k2), grads)
    for g, buffer, e in zip(got, grads, want):
        assert g.data_ptr() == buffer.data_ptr()
        assert torch.equal(g, e)


@pytest.mark.parametrize("case", ["in_place", "fused_qk", "compiled"])
def test_overwrite_inputs(device, case):
    """``overwrite_inputs=True`` rotates q and k in their own storage (views of them returned) with
    the values and gradients of new tensors; q and k views of one buffer and a compiled graph get
    new tensors, q and k untouched."""
    b, s, hq, hk, d = SHAPES[0]
    q, k, freqs_cis = make(SHAPES[0], torch.bfloat16, device)
    if case == "fused_qk":
        qk = randn(b, s, hq + hk, d, dtype=torch.bfloat16, device=device)
        q, k = qk[:, :, :hq], qk[:, :, hq:]
    q1, k1 = leaf(q), leaf(k)
    expected = llama4_rope(q1, k1, freqs_cis)
    grads = tuple(torch.randn_like(t) for t in expected)
    torch.autograd.backward(expected, grads)
    q2, k2 = leaf(q), leaf(k)
    saved = (q2.detach().clone(), k2.detach().clone())

    def rotate(q, k, f):
        return llama4_rope(q, k, f, overwrite_inputs=True)

    got = (torch.compile(rotate, backend="eager", fullgraph=True) if case == "compiled" else rotate)(q2, k2, freqs_cis)
    for out, inp, e, before in zip(got, (q2, k2), expected, saved):
        assert torch.equal(out, e)
        if case == "in_place":
            assert out.data_ptr() == inp.data_ptr() and torch.equal(inp.detach(), e.detach())
        else:
            assert out.data_ptr() != inp.data_ptr() and torch.equal(inp.detach(), before)
    torch.autograd.backward(got, grads)
    assert torch.equal(q2.grad, q1.grad) and torch.equal(k2.grad, k1.grad)


def test_no_write_past_the_last_pair(device):
    """A half width that is not a power of two (12 pairs in a 16-pair tile): the rotation writes no
    column past the last pair. q, k and the incoming gradients are rotated in their own storage,
    each the first rows of a larger buffer whose last row is a guard that must keep its value."""
    b, s, hq, hk, d = 2, 3, 5, 2, 24
    _, _, freqs_cis = make((b, s, hq, hk, d), torch.bfloat16, device)

    def guarded(heads):
        buffer = torch.full((b + 1, s, heads, d), 7.0, dtype=torch.bfloat16, device=device)
        buffer[:b] = randn(b, s, heads, d, dtype=torch.bfloat16, device=device)
        return buffer, buffer[:b]

    (bq, q), (bk, k) = guarded(hq), guarded(hk)
    qe, ke = llama4_rope(leaf(q), leaf(k), freqs_cis, overwrite_inputs=True, overwrite_grad_output=True)
    (gq_buffer, gq), (gk_buffer, gk) = guarded(hq), guarded(hk)
    torch.autograd.backward((qe, ke), (gq, gk))
    for buffer in (bq, bk, gq_buffer, gk_buffer):
        assert torch.all(buffer[b] == 7.0)


def test_empty_input(device):
    q, k, freqs_cis = make((2, 0, 3, 1, 16), torch.bfloat16, device)
    q1, k1 = leaf(q), leaf(k)
    qe, ke = llama4_rope(q1, k1, freqs_cis)
    assert qe.shape == q.shape and ke.shape == k.shape
    (qe.sum() + ke.sum()).backward()
    assert q1.grad.shape == q.shape


def test_bad_input(device):
    q, k, freqs_cis = make(SHAPES[0], torch.float32, device)
    with pytest.raises(TypeError, match="q must be a torch.Tensor"):
        llama4_rope([1.0], k, freqs_cis)
    with pytest.raises(TypeError, match="freqs_cis must be a complex tensor"):
        llama4_rope(q, k, freqs_cis.real)
    with pytest.raises(ValueError, match="q must be 4-D"):
        llama4_rope(q[0], k, freqs_cis)
    with pytest.raises(ValueError, match="k must match q"):
        llama4_rope(q, k[..., :-2], freqs_cis)
    with pytest.raises(ValueError, match="freqs_cis must have shape"):
        llama4_rope(q, k, freqs_cis[..., :-1])
    with pytest.raises(ValueError, match="freqs_cis must have shape"):
        llama4_rope(q, k, freqs_cis[:, :-1])
    with pytest.raises(ValueError, match="head_dim must be even"):
        llama4_rope(q[..., :-1], k[..., :-1], freqs_cis)
    with pytest.raises(TypeError, match="overwrite_grad_output must be a bool"):
        llama4_rope(q, k, freqs_cis, overwrite_grad_output=1)
    with pytest.raises(TypeError, match="overwrite_inputs must be a bool"):
        llama4_rope(q, k, freqs_cis, overwrite_inputs="yes")


def test_op_contract(device):
    q, k, freqs_cis = make((2, 3, 2, 1, 16), torch.bfloat16, device, "batch")
    assert_op_contract(lambda q, k, f: llama4_rope(q, k, f), (q.requires_grad_(), k.requires_grad_(), freqs_cis),
                       expect_ops={"llama4_rope_forward", "llama4_rope_backward"})
