"""Multi-token attention forward and backward against a float64 reference: causal mask, softmax
(or a sort-based sparsemax), the probabilities rounded to the input dtype as the convolution reads
them, conv2d, the output's upper triangle zeroed."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from onca.ops import multi_token_attention as op
from onca.ops.multi_token_attention import multi_token_attention
from tests.contract import assert_op_contract
from tests.helpers import SCALE, assert_close, leaf, randn

# (batch, C_in, L), (C_out, kernel)
BASE = {"cpu": ((1, 3, 9), (4, 3)), "gpu": ((2, 16, 1024), (16, 5))}[SCALE]


def sparsemax64(z):
    """Sort-based sparsemax over the last dimension (differentiable through the sort)."""
    zs, _ = z.sort(dim=-1, descending=True)
    k = torch.arange(1, z.shape[-1] + 1, dtype=z.dtype, device=z.device)
    cs = zs.cumsum(-1)
    support = 1 + k * zs > cs
    kz = support.sum(-1, keepdim=True)
    tau = (cs.gather(-1, kz - 1) - 1) / kz
    return torch.clamp(z - tau, min=0)


def upper(h, w, device):
    return torch.arange(w, device=device)[None, :] > torch.arange(h, device=device)[:, None]


def reference(scores, weight, bias, stride=1, padding=0, dilation=1, groups=1, sparse=False):
    s64, w64 = (t.detach().to(torch.float64).requires_grad_(True) for t in (scores, weight))
    b64 = bias.detach().to(torch.float64).requires_grad_(True) if bias is not None else None
    L = scores.shape[-1]
    z = s64.masked_fill(upper(L, L, scores.device), float("-inf"))
    probs = sparsemax64(z) if sparse else torch.softmax(z, -1)
    probs = probs + (probs.to(scores.dtype).to(torch.float64) - probs).detach()  # rounded, straight through
    out = F.conv2d(probs, w64, b64, stride=stride, padding=padding, dilation=dilation, groups=groups)
    out = out.masked_fill(upper(*out.shape[-2:], scores.device), 0.0)
    return out, probs, (s64, w64, b64)



@pytest.fixture(autouse=True)
def _fp32_convolutions():
    """The op's convolutions are torch's, which run fp32 as TF32 on CUDA by default (as for any
    conv2d): off here, so that the float64 comparison judges Onca's kernels at fp32."""
    with torch.backends.cudnn.flags(enabled=torch.backends.cudnn.enabled, allow_tf32=False):
        yield

def check(scores, weight, bias, sparse=False, **conv):
    sk, wk = leaf(scores), leaf(weight)
    bk = leaf(bias) if bias is not None else None
    out = multi_token_attention(sk, wk, bk, sparse=sparse, **conv)
    ref, probs, leaves = reference(scores, weight, bias, sparse=sparse, **conv)
    assert out.dtype == scores.dtype and out.shape == ref.shape
    assert_close(out, ref, scores.dtype, "out")
    dout = randn(*out.shape, dtype=out.dtype, device=out.device)
    out.backward(dout)
    ref.backward(dout.to(torch.float64))
    if sparse:
        # Compare dscores on the rows away from sparsemax's kinks (rows are independent there).
        keep = (sparsemax_margin(scores) > 1e-4)[..., None]
        assert keep.float().mean() > 0.8
        sk.grad = torch.where(keep, sk.grad, 0)
        leaves[0].grad = torch.where(keep, leaves[0].grad, 0.0)
    for name, mine, theirs in zip(("dscores", "dweight", "dbias"), (sk, wk, bk), leaves):
        if mine is not None:
            assert mine.grad.dtype == scores.dtype
            assert_close(mine.grad, theirs.grad, scores.dtype, name)
    return probs


def sparsemax_margin(scores):
    """Per row, the smallest ``|z - tau|`` over its visible scores: how far the row is from a kink
    of sparsemax (a score on its support's boundary), where the gradient is a matter of convention;
    bf16 inputs sit on a grid coarse enough to land there."""
    L = scores.shape[-1]
    z = scores.double().masked_fill(upper(L, L, scores.device), float("-inf"))
    p = sparsemax64(z)
    tau = (z - p).masked_fill(p == 0, float("inf")).amin(-1, keepdim=True)
    return (z - tau).abs().masked_fill(upper(L, L, scores.device), float("inf")).amin(-1)


def inputs(batch, c_in, L, c_out, k, dtype, device, groups=1, bias=True, std=2.0):
    scores = randn(batch, c_in, L, L, dtype=dtype, device=device, std=std)
    weight = randn(c_out, c_in // groups, k, k, dtype=dtype, device=device, std=0.5)
    b = randn(c_out, dtype=dtype, device=device, std=0.1) if bias else None
    return scores, weight, b


@pytest.mark.parametrize("sparse", [False, True], ids=["softmax", "sparsemax"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_matches_reference(profile, device, dtype, sparse):
    (b, c, L), (c_out, k) = BASE
    probs = check(*inputs(b, c, L, c_out, k, dtype, device), sparse=sparse, padding=k // 2)
    if sparse:  # a real sparse test: some of the causal columns are 0, not only the masked ones
        causal = ~upper(L, L, device)
        assert ((probs == 0) & causal).any() and ((probs > 0) & causal).any()


@pytest.mark.parametrize("conv", [
    dict(stride=2, padding=1), dict(dilation=2, padding=2), dict(groups=2, padding=(1, 0)),
    dict(stride=(1, 2), padding=0),
], ids=["stride", "dilation", "groups", "rectangular-output"])
def test_conv_options(device, conv):
    groups = conv.get("groups", 1)
    check(*inputs(1, 4, 9, 2 * groups, 3, torch.float32, device, groups=groups, bias=groups == 1), **conv)


def test_fp16_sparse_no_bias(device):
    check(*inputs(1, 2, 13, 2, 3, torch.float16, device, bias=False), sparse=True, padding=1)


@pytest.mark.parametrize("sparse", [False, True], ids=["softmax", "sparsemax"])
def test_column_tiled_rows(device, onchip_bytes, sparse):
    """Rows wider than a (forced) tiny budget: the online softmax / multi-pass sparsemax paths."""
    forced = onchip_bytes(512)
    plans = op.plan((1, 1, 17, 17), torch.float32, forced)
    assert plans["activation_forward"].col_tiles > 1 and plans["activation_backward"].col_tiles > 1
    check(*inputs(1, 1, 17, 1, 3, torch.float32, device, std=3.0), sparse=sparse, padding=1)


@pytest.mark.parametrize("layout", ["channels_last", "padded", "unaligned", "other_device"])
def test_layouts(device, monkeypatch, layout):
    """The convolution's operands channels-last (channels per group a multiple of 8, or padded to one
    with zeros, on CUDA or the CPU) or NCHW (channels too few to pad, other devices): the same
    values either way, the probabilities kept in that layout (the padding zero), the output and the
    gradients NCHW and unpadded; scores that are a strided view (not contiguous) are read as they
    are."""
    if layout == "other_device":
        monkeypatch.setattr(op, "CHANNELS_LAST_DEVICES", ())
    channels, c_out, kept = {"padded": (12, 6, 16), "unaligned": (3, 6, 3)}.get(layout, (8, 8, 8))
    fmt = torch.contiguous_format if layout in ("unaligned", "other_device") else torch.channels_last
    scores, weight, bias = inputs(2, channels, 7, c_out, 3, torch.float32, device)
    strided = scores.transpose(-1, -2).contiguous().transpose(-1, -2)  # same values, column-major
    assert not strided.is_contiguous()
    check(strided, weight, bias, padding=1)
    out, probs = op.multi_token_attention_forward(scores, weight, bias, [1, 1], [1, 1], [1, 1], 1, False)
    assert probs.shape == (2, kept, 7, 7) and probs.is_contiguous(memory_format=fmt)
    assert probs.is_contiguous() == (fmt == torch.contiguous_format) and out.is_contiguous()
    assert out.shape == (2, c_out, 7, 7) and torch.equal(probs[:, channels:], torch.zeros_like(probs[:, channels:]))


def test_conv_layout_rule():
    cuda, other = torch.device("cuda"), torch.device("meta")  # meta: a device type not in the list
    last, nchw = torch.channels_last, torch.contiguous_format
    assert op.conv_layout(cuda, (32, 32, 3, 3), 1) == (last, 32, 32)
    assert op.conv_layout(cuda, (16, 8, 3, 3), 2) == (last, 16, 16)  # 8 in, 8 out a group
    assert op.conv_layout(cuda, (28, 28, 3, 3), 1) == (last, 32, 32)  # padded: 1.31x the work
    assert op.conv_layout(cuda, (12, 12, 3, 3), 1) == (last, 16, 16)  # 1.78x
    assert op.conv_layout(cuda, (4, 4, 3, 3), 1) == (nchw, 4, 4)  # 4x: not padded
    assert op.conv_layout(cuda, (12, 6, 3, 3), 2) == (nchw, 12, 12)  # groups: not padded
    assert op.conv_layout(other, (32, 32, 3, 3), 1) == (nchw, 32, 32)


def test_channel_blocks(device, onchip_bytes):
    """More channels than a tile's rows, channels-last: every channel block of every (batch, query)
    pair, the last one partly masked where the rows do not divide the channels."""
    forced = onchip_bytes(8192)
    block_rows = op.plan((1, 24, 9, 9), torch.float32, forced)["activation_forward"].block_rows
    assert block_rows < 24
    if forced.kind != "cuda":  # the GPU rule may give 8 rows, which divide 24
        assert 24 % block_rows
    check(*inputs(2, 24, 9, 8, 3, torch.float32, device), padding=1)


def test_sparsemax_rows_sum_to_one(device):
    scores = randn(2, 2, 17, 17, device=device, std=3.0)
    weight = torch.zeros(2, 2, 1, 1, device=device)
    weight[0, 0] = weight[1, 1] = 1.0  # the identity convolution: out is the probabilities
    out = multi_token_attention(scores, weight, sparse=True)
    assert torch.allclose(out.sum(-1), torch.ones(2, 2, 17, device=device), atol=1e-5)
    assert (out >= 0).all() and (out[..., upper(17, 17, device)] == 0).all()
    assert out[0, 0, 0, 0] == 1.0  # the first query sees one key


def test_empty_batch(device):
    scores = randn(0, 2, 5, 5, device=device, requires_grad=True)
    weight = randn(3, 2, 3, 3, device=device, requires_grad=True)
    out = multi_token_attention(scores, weight, padding=1)
    assert out.shape == (0, 3, 5, 5)
    out.sum().backward()
    assert scores.grad.shape == scores.shape and torch.equal(weight.grad, torch.zeros_like(weight))


def test_bad_input(device):
    s, w = randn(1, 2, 5, 5, device=device), randn(3, 2, 3, 3, device=device)
    with pytest.raises(ValueError, match="scores must be 4-D"):
        multi_token_attention(randn(1, 2, 5, 4, device=device), w)
    with pytest.raises(TypeError, match="weight must have scores' dtype"):
        multi_token_attention(s, w.half())
    with pytest.raises(ValueError, match="weight must be 4-D"):
        multi_token_attention(s, w[0])
    with pytest.raises(ValueError, match="groups=1 does not fit"):
        multi_token_attention(s, randn(3, 4, 3, 3, device=device))
    with pytest.raises(ValueError, match="bias must have shape"):
        multi_token_attention(s, w, randn(2, device=device))
    with pytest.raises(TypeError, match="stride must be an int or a pair"):
        multi_token_attention(s, w, stride=1.5)
    with pytest.raises(ValueError, match="padding must be >= 0"):
        multi_token_attention(s, w, padding=-1)
    with pytest.raises(TypeError, match="sparse must be a bool"):
        multi_token_attention(s, w, sparse=1)
    with pytest.raises(TypeError, match="scores must have a floating dtype"):
        multi_token_attention(s.long(), w)


@pytest.mark.parametrize("channels", [2, 8, 12], ids=["nchw", "channels_last", "padded"])
def test_op_contract(device, channels):
    """Every layout: the fake implementations give the probabilities' channels-last strides and
    padded channels too."""
    scores = randn(1, channels, 6, 6, dtype=torch.bfloat16, device=device).requires_grad_()
    weight = randn(channels, channels, 3, 3, dtype=torch.bfloat16, device=device, std=0.5).requires_grad_()
    bias = randn(channels, dtype=torch.bfloat16, device=device).requires_grad_()
    fn = lambda s, w, b: multi_token_attention(s, w, b, padding=1, sparse=True)  # noqa: E731
    assert_op_contract(fn, (scores, weight, bias), expect_ops={"multi_token_attention_forward",
                                                               "multi_token_attention_backward"})


def test_small_calls_keep_one_causal_mask_per_length(device, monkeypatch):
    """The small-call route's causal mask is made once per (length, device) and kept (never dropped:
    a CUDA graph may read it); past the cap, and while a CUDA graph is being captured, it is made
    per call and not kept."""
    from onca.ops import _small_calls as small_calls

    monkeypatch.setattr(small_calls, "_kept", {})
    dev = torch.device(device)
    first = op._later_keys(5, dev)
    assert torch.equal(first.cpu(), torch.ones(5, 5, dtype=torch.bool).triu(1))
    assert op._later_keys(5, dev) is first and len(small_calls._kept) == 1
    monkeypatch.setattr(small_calls, "MAX_KEPT", 1)
    other = op._later_keys(6, dev)
    assert op._later_keys(6, dev) is not other and len(small_calls._kept) == 1
    if dev.type == "cuda":
        monkeypatch.setattr(small_calls, "MAX_KEPT", 64)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            op._later_keys(7, dev)
        assert len(small_calls._kept) == 1
