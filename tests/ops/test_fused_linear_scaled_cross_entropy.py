"""Fused linear scaled cross entropy (per-token NLL and entropy of ``hidden @ W.T / temperature``)
forward and backward against float64 full logits, with liger-kernel's output conventions."""

from __future__ import annotations

import pytest
import torch

from onca.ops.fused_linear_scaled_cross_entropy import fused_linear_scaled_cross_entropy
from tests.contract import assert_op_contract
from tests.helpers import SCALE, assert_close, leaf, non_contiguous, randn
from tests.ops.posttrain_reference import CHUNK, IGNORE, make_inputs, reference_logps

SHAPES = {
    "cpu": [(3, 7, 16, 203), (1, 1, 24, 77)],
    "gpu": [(2, 1024, 4096, 151936), (1, 1, 4096, 128256)],
}[SCALE]
BASE = SHAPES[0]


def check(hidden, weight, bias, target, temperature=1.0, entropy=True, chunk_tokens=CHUNK,
          grads=("nll", "ent"), keep_logits=False):
    """Onca's outputs and the gradients of ``sum(g_nll * nll + g_ent * entropy)`` against float64."""
    dtype = hidden.dtype
    hk, wk = leaf(hidden), leaf(weight)
    bk = leaf(bias) if bias is not None else None
    out = fused_linear_scaled_cross_entropy(hk, wk, target, temperature, IGNORE, return_entropy=entropy, bias=bk,
                                            chunk_tokens=chunk_tokens, keep_logits=keep_logits)
    nll, ent = out if entropy else (out, None)
    per, ref_ent, mask, (h64, w64, b64) = reference_logps(hidden, weight, bias, target, temperature)
    assert nll.dtype == torch.float32 and nll.shape == target.shape
    # fp32 from the rounded logits; a 16-bit GEMM can round a logit one step the other way than
    # the reference does: 16-bit inputs are judged at their dtype.
    assert_close(nll, -per, dtype, "nll")
    assert torch.all(nll[~mask] == 0)
    total, total64 = 0.0, 0.0
    if "nll" in grads:
        g = torch.randn(target.shape, dtype=torch.float64, device=hidden.device)
        total, total64 = (nll * g.float()).sum(), (-per * g).sum()
    if entropy:
        assert ent.dtype == dtype and ent.shape == target.shape  # liger: the entropy in the logits' dtype
        assert_close(ent, ref_ent, dtype, "entropy")
        assert torch.all(ent[~mask] == 0)
        if "ent" in grads:
            g = torch.randn(target.shape, dtype=torch.float64, device=hidden.device)
            total, total64 = total + (ent.float() * g.float()).sum(), total64 + (ref_ent * g).sum()
    total.backward()
    total64.backward()
    assert hk.grad.dtype == dtype and wk.grad.dtype == dtype
    assert_close(hk.grad, h64.grad, dtype, "dhidden")
    assert_close(wk.grad, w64.grad, dtype, "dweight")
    if bias is not None:
        assert_close(bk.grad, b64.grad, dtype, "dbias")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_matches_reference(profile, device, dtype):
    h, w, _, target = make_inputs(BASE, dtype, device, empty_row=1)
    check(h, w, None, target, temperature=0.7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_keep_logits(profile, device, dtype):
    """The logits kept from the forward and read by the backward, with a bias and an ignored row."""
    h, w, b, target = make_inputs(BASE, dtype, device, bias=True, empty_row=1)
    check(h, w, b, target, temperature=0.7, keep_logits=True)


@pytest.mark.parametrize("grads", [("nll",), ("ent",)], ids=["nll-only", "entropy-only"])
def test_gradient_of_one_output(device, grads):
    """Only one output reaches the loss: the other's gradient arrives as None (zeros)."""
    h, w, b, target = make_inputs(BASE, torch.float32, device, bias=True)
    check(h, w, b, target, temperature=1.5, grads=grads)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_shapes_without_entropy(device, shape):
    h, w, _, target = make_inputs(shape, torch.float32, device, prompt=0)
    check(h, w, None, target, entropy=False, chunk_tokens=None)


def test_fp16_and_int32_targets(device):
    h, w, _, target = make_inputs(BASE, torch.float16, device)
    check(h, w, None, target.to(torch.int32), temperature=2.0)


def test_non_contiguous_hidden_and_column_tiles(device, onchip_bytes):
    """A padded-row hidden state; a vocabulary wider than an 8 KiB budget (column-tiled kernels)."""
    onchip_bytes(8192)
    h, w, _, target = make_inputs((2, 5, 16, 1000), torch.bfloat16, device, prompt=1)
    check(non_contiguous(h, "cols"), w, None, target, temperature=0.9)


def test_matches_liger_fallback_formulas(device):
    """liger-kernel 0.8.5's reference path (verl's formulas): logits / temperature in the input dtype,
    upcast, NLL and entropy per token (0 where ignored), the entropy cast back to the logits' dtype."""
    h, w, _, target = make_inputs((2, 6, 16, 97), torch.bfloat16, device)
    h2, t2 = h.reshape(-1, 16), target.reshape(-1)
    valid = t2 != IGNORE
    logits = ((h2 @ w.t()) / 0.8).float()
    lse = torch.logsumexp(logits, -1)
    ent = lse - (logits.softmax(-1) * logits).sum(-1)
    nll = lse - logits.gather(1, t2.clamp(min=0)[:, None])[:, 0]
    nll_o, ent_o = fused_linear_scaled_cross_entropy(h2, w, t2, 0.8, return_entropy=True)
    assert_close(nll_o, torch.where(valid, nll, 0.0), torch.bfloat16, "nll")
    assert_close(ent_o, torch.where(valid, ent, 0.0).to(torch.bfloat16), torch.bfloat16, "entropy")


def test_empty_input(device):
    h = randn(0, 16, device=device, requires_grad=True)
    w = randn(50, 16, device=device, requires_grad=True)
    nll, ent = fused_linear_scaled_cross_entropy(h, w, torch.zeros(0, dtype=torch.long, device=device),
                                                 return_entropy=True)
    assert nll.shape == ent.shape == (0,)
    (nll.sum() + ent.sum()).backward()
    assert h.grad.shape == h.shape and torch.equal(w.grad, torch.zeros_like(w))


def test_out_of_range_target_is_nan(device):
    h, w = randn(3, 8, device=device), randn(11, 8, device=device)
    nll = fused_linear_scaled_cross_entropy(h, w, torch.tensor([1, 11, IGNORE], device=device))
    assert torch.isnan(nll[1]) and torch.isfinite(nll[0]) and nll[2] == 0


def test_bad_input(device):
    h, w = randn(4, 8, device=device), randn(11, 8, device=device)
    t = torch.zeros(4, dtype=torch.long, device=device)
    with pytest.raises(ValueError, match="target must have shape"):
        fused_linear_scaled_cross_entropy(h, w, t[:3])
    with pytest.raises(TypeError, match="target must be an int32 or int64"):
        fused_linear_scaled_cross_entropy(h, w, t.float())
    with pytest.raises(ValueError, match="temperature"):
        fused_linear_scaled_cross_entropy(h, w, t, 0.0)
    with pytest.raises(TypeError, match="return_entropy must be a bool"):
        fused_linear_scaled_cross_entropy(h, w, t, return_entropy=1)
    with pytest.raises(ValueError, match="weight must be"):
        fused_linear_scaled_cross_entropy(h, w[:, :5], t)
    with pytest.raises(TypeError, match="hidden must be a torch.Tensor"):
        fused_linear_scaled_cross_entropy([1.0], w, t)
    with pytest.raises(TypeError, match="ignore_index must be an int"):
        fused_linear_scaled_cross_entropy(h, w, t, 1.0, 1.5)
    with pytest.raises(TypeError, match="keep_logits must be a bool"):
        fused_linear_scaled_cross_entropy(h, w, t, keep_logits=None)


def test_op_contract(device):
    """With the entropy (the path without it is the same ops, checked in test_chunked_head)."""
    h = randn(2, 5, 16, dtype=torch.bfloat16, device=device).requires_grad_()
    w = randn(37, 16, dtype=torch.bfloat16, device=device, std=0.25).requires_grad_()
    target = torch.randint(0, 37, (2, 5), device=device)
    target[0, :2] = IGNORE
    fn = lambda h, w: fused_linear_scaled_cross_entropy(h, w, target, 0.9, return_entropy=True,  # noqa: E731
                                                        chunk_tokens=4)
    assert_op_contract(fn, (h, w), expect_ops={"chunked_logprob_forward", "chunked_logprob_backward"})
