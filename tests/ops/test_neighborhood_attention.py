"""Neighborhood attention forward and backward against a float64 reference with liger-kernel's
mask (the full score matrix, masked outside each query's clipped, dilated window)."""

from __future__ import annotations

import math

import pytest
import torch

from onca.ops import neighborhood_attention as op
from onca.ops.neighborhood_attention import neighborhood_attention
from onca.tiling import TilingError
from tests.contract import assert_op_contract
from tests.helpers import SCALE, assert_close, leaf, randn

# (batch, heads, seq_len, head_dim)
SHAPES = {
    "cpu": [(1, 1, 1, 8), (2, 3, 7, 24), (1, 1, 40, 64)],
    "gpu": [(1, 16, 4096, 128), (1, 32, 2048, 96), (4, 12, 1024, 64)],
}[SCALE]
BASE = {"cpu": (1, 2, 9, 40), "gpu": (2, 16, 2048, 128)}[SCALE]


def neighborhood_mask(seq_len, kernel_size, dilation, device):
    """liger-kernel's ``_neighborhood_mask_kernel``: ``[start, end)`` clipped, then the dilation."""
    i = torch.arange(seq_len, device=device)[:, None]
    j = torch.arange(seq_len, device=device)[None, :]
    half = kernel_size // 2
    start = (i - half * dilation).clamp(min=0)
    end = (i + half * dilation + 1).clamp(max=seq_len)
    return (j >= start) & (j < end) & ((j - i) % dilation == 0)


def reference(q, k, v, kernel_size, dilation, scale=None):
    q64, k64, v64 = (t.detach().to(torch.float64).requires_grad_(True) for t in (q, k, v))
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = (q64 @ k64.transpose(-1, -2)) * scale
    mask = neighborhood_mask(q.shape[2], kernel_size, dilation, q.device)
    out = torch.softmax(scores.masked_fill(~mask, float("-inf")), -1) @ v64
    return out, (q64, k64, v64)


def check(q, k, v, kernel_size=7, dilation=1, scale=None):
    qk, kk, vk = leaf(q), leaf(k), leaf(v)
    out = neighborhood_attention(qk, kk, vk, kernel_size, dilation, scale)
    assert out.dtype == q.dtype and out.shape == q.shape
    ref, leaves = reference(q, k, v, kernel_size, dilation, scale)
    assert_close(out, ref, q.dtype, "out")
    dout = randn(*q.shape, dtype=q.dtype, device=q.device)
    out.backward(dout)
    ref.backward(dout.to(torch.float64))
    for name, mine, theirs in zip(("dq", "dk", "dv"), (qk, kk, vk), leaves):
        assert mine.grad.dtype == q.dtype
        assert_close(mine.grad, theirs.grad, q.dtype, name)


def qkv(shape, dtype, device):
    return tuple(randn(*shape, dtype=dtype, device=device) for _ in range(3))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_matches_reference(profile, device, dtype):
    check(*qkv(BASE, dtype, device), kernel_size=7, dilation=2)


def test_fp16(device):
    check(*qkv(BASE, torch.float16, device), kernel_size=5, dilation=1)


@pytest.mark.parametrize("kernel_size, dilation", [(1, 1), (3, 1), (5, 3), (6, 1), (13, 4)])
def test_windows(device, kernel_size, dilation):
    """A window of itself only, small and dilated windows, an even size (kernel_size + 1
    positions, as liger's mask), and a window wider than the sequence's reach near its ends."""
    check(*qkv((1, 1, 17, 16), torch.float32, device), kernel_size, dilation)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_shapes(device, shape):
    check(*qkv(shape, torch.bfloat16, device), kernel_size=5, dilation=1, scale=0.3)


def test_transposed_layout(device):
    """``(B, L, H, D).transpose(1, 2)`` views, as a module's projections give them: read in place."""
    b, h, s, d = BASE
    q, k, v = (randn(b, s, h, d, device=device).transpose(1, 2) for _ in range(3))
    assert not q.is_contiguous()
    check(q, k, v, kernel_size=9, dilation=1)


def test_column_stride_input_is_copied(device):
    b, h, s, d = 1, 2, 11, 8
    q = randn(b, h, s, 2 * d, device=device)[..., ::2]
    check(q, *qkv((b, h, s, d), torch.float32, device)[1:], kernel_size=3)


def test_empty_input(device):
    q, k, v = (randn(0, 2, 5, 8, device=device, requires_grad=True) for _ in range(3))
    out = neighborhood_attention(q, k, v)
    assert out.shape == q.shape
    out.sum().backward()
    assert q.grad.shape == q.shape and k.grad.shape == k.shape


def test_deterministic(device):
    q, k, v = qkv(BASE, torch.bfloat16, device)
    grads = []
    for _ in range(2):
        leaves = [leaf(t) for t in (q, k, v)]
        neighborhood_attention(*leaves, 5, 2).sum().backward()
        grads.append([t.grad for t in leaves])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_head_dim_too_wide_for_the_budget_is_a_clear_error(onchip_bytes):
    forced = onchip_bytes(4096)
    with pytest.raises(TilingError, match="whole head"):
        op.plan((1, 1, 8, 512), torch.float32, forced)


def test_bad_input(device):
    q = randn(1, 2, 8, 16, device=device)
    with pytest.raises(ValueError, match="query must be 4-D"):
        neighborhood_attention(q[0], q[0], q[0])
    with pytest.raises(ValueError, match="key must have query's shape"):
        neighborhood_attention(q, q[:, :1], q)
    with pytest.raises(TypeError, match="value must have query's dtype"):
        neighborhood_attention(q, q, q.half())
    with pytest.raises(TypeError, match="key must have a floating dtype"):
        neighborhood_attention(q, q.long(), q)
    with pytest.raises(ValueError, match="kernel_size must be >= 1"):
        neighborhood_attention(q, q, q, 0)
    with pytest.raises(TypeError, match="dilation must be an int"):
        neighborhood_attention(q, q, q, 3, 1.5)
    with pytest.raises(TypeError, match="scale must be a number"):
        neighborhood_attention(q, q, q, scale="big")
    with pytest.raises(ValueError, match="value is on meta"):
        neighborhood_attention(q, q, torch.empty(q.shape, device="meta"))


def test_op_contract(device):
    q, k, v = (randn(1, 2, 6, 8, dtype=torch.bfloat16, device=device).requires_grad_() for _ in range(3))
    fn = lambda q, k, v: neighborhood_attention(q, k, v, 5, 2)  # noqa: E731
    assert_op_contract(fn, (q, k, v), expect_ops={"neighborhood_attention_forward",
                                                  "neighborhood_attention_backward"})
