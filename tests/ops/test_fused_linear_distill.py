"""Fused linear distillation forward and backward against float64 full logits of both heads."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from onca.ops.fused_linear_distill import DIVERGENCES, fused_linear_distill, scratch_buffers
from tests.contract import assert_op_contract
from tests.helpers import MEMCHECK, assert_close, leaf, randn, rounded, zero_fills_during
from tests.ops.posttrain_reference import IGNORE

SHAPE = (37, 16, 12, 301)  # tokens, student hidden, teacher hidden, vocab


def reference(sh, sw, sb, th, tw, labels, divergence, beta, temperature, w_hard, w_soft):
    h64 = sh.detach().double().requires_grad_(True)
    w64 = sw.detach().double().requires_grad_(True)
    b64 = sb.detach().double().requires_grad_(True) if sb is not None else None
    s = h64 @ w64.T + (b64 if b64 is not None else 0)
    t = th.double() @ tw.double().T
    if sh.dtype != torch.float32:  # the logits rounded as the eager heads round them (fp32 for cosine)
        logits_dtype = torch.float32 if divergence == "cosine" else sh.dtype
        s, t = rounded(s, logits_dtype), rounded(t, logits_dtype)
    valid = (labels != IGNORE).double() if labels is not None else torch.ones(s.shape[0], dtype=torch.float64, device=s.device)
    lq, lp = torch.log_softmax(s / temperature, -1), torch.log_softmax(t / temperature, -1)
    if divergence == "forward_kl":
        per = (lp.exp() * (lp - lq)).sum(-1)
    elif divergence == "reverse_kl":
        per = (lq.exp() * (lq - lp)).sum(-1)
    elif divergence == "jsd":
        lm = (beta * lp.exp() + (1 - beta) * lq.exp()).log()
        per = beta * (lp.exp() * (lp - lm)).sum(-1) + (1 - beta) * (lq.exp() * (lq - lm)).sum(-1)
    else:
        per = 1 - F.cosine_similarity(s, t, dim=-1)
    loss = w_soft * (per * valid).sum() / valid.sum().clamp(min=1)
    if w_hard:
        loss = loss + w_hard * F.cross_entropy(s, labels, ignore_index=IGNORE)
    return loss, (h64, w64, b64)


def check(dtype, device, divergence, *, beta=0.3, temperature=2.0, w_hard=0.4, w_soft=0.6, bias=True,
          with_labels=True, shape=SHAPE, chunk_tokens=16):
    n, hs, ht, v = shape
    sh, sw = randn(n, hs, dtype=dtype, device=device), randn(v, hs, dtype=dtype, device=device, std=0.3)
    sb = randn(v, dtype=dtype, device=device, std=0.5) if bias else None
    th, tw = randn(n, ht, dtype=dtype, device=device), randn(v, ht, dtype=dtype, device=device, std=0.4)
    labels = None
    if with_labels:
        labels = torch.randint(0, v, (n,), device=device)
        labels[::5] = IGNORE
    shk, swk = leaf(sh), leaf(sw)
    sbk = leaf(sb) if bias else None
    loss = fused_linear_distill(shk, swk, th, tw, labels, student_bias=sbk, divergence=divergence, beta=beta,
                                temperature=temperature, weight_hard_loss=w_hard, weight_soft_loss=w_soft,
                                chunk_tokens=chunk_tokens)
    ref, (h64, w64, b64) = reference(sh, sw, sb, th, tw, labels, divergence, beta, temperature, w_hard, w_soft)
    assert loss.dtype == torch.float32 and loss.shape == ()
    assert_close(loss, ref, torch.float32, "loss")
    loss.backward()
    ref.backward()
    assert_close(shk.grad, h64.grad, dtype, "dstudent_hidden")
    assert_close(swk.grad, w64.grad, dtype, "dstudent_weight")
    if bias:
        assert_close(sbk.grad, b64.grad, dtype, "dstudent_bias")


def test_loss_without_gradient(profile, device):
    """Evaluation: with no gradient asked for, the hard-label loss is a log-sum-exp pass alone (on a
    GPU, in the streaming tile) and the loss is still the reference's."""
    n, hs, ht, v = SHAPE
    sh, sw = randn(n, hs, device=device), randn(v, hs, device=device, std=0.3)
    th, tw = randn(n, ht, device=device), randn(v, ht, device=device, std=0.4)
    labels = torch.randint(0, v, (n,), device=device)
    labels[::5] = IGNORE
    with torch.no_grad():
        loss = fused_linear_distill(sh, sw, th, tw, labels, weight_hard_loss=0.4, weight_soft_loss=0.6,
                                    temperature=2.0, chunk_tokens=16)
    ref, _ = reference(sh, sw, None, th, tw, labels, "forward_kl", 0.5, 2.0, 0.4, 0.6)
    assert not loss.requires_grad
    assert_close(loss, ref, torch.float32, "loss")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_forward_kl_with_hard_labels(profile, device, dtype):
    check(dtype, device, "forward_kl")


@pytest.mark.parametrize("divergence", [d for d in DIVERGENCES if d != "forward_kl"])
def test_divergences(device, divergence):
    check(torch.float32, device, divergence, shape=(21, 8, 8, 97), chunk_tokens=None)


@pytest.mark.parametrize("divergence", DIVERGENCES)
def test_bf16_gradient_over_dead_buffers(device, divergence, poisoned_empty):
    """bf16 without the hard-label term: the divergence kernel writes the bf16 gradient over the
    student's bf16 logits (cosine: over its fp32 logits, copied over the teacher's); several chunks,
    every fresh buffer NaN (the weight gradient is written by the first chunk, not zero-filled)."""
    check(torch.bfloat16, device, divergence, w_hard=0.0, w_soft=1.0, shape=(21, 8, 8, 97))


def test_no_labels_one_token(device):
    check(torch.float32, device, "jsd", w_hard=0.0, w_soft=1.0, bias=False, with_labels=False, shape=(1, 8, 8, 50))


def test_bad_input(device):
    sh, sw, th, tw = (randn(4, 8, device=device), randn(20, 8, device=device), randn(4, 6, device=device),
                      randn(20, 6, device=device))
    with pytest.raises(ValueError, match="divergence"):
        fused_linear_distill(sh, sw, th, tw, divergence="kl")
    with pytest.raises(ValueError, match="labels"):
        fused_linear_distill(sh, sw, th, tw, weight_hard_loss=0.5)
    with pytest.raises(ValueError, match="vocabulary"):
        fused_linear_distill(sh, sw, th, tw[:10])
    with pytest.raises(ValueError, match="teacher_hidden"):
        fused_linear_distill(sh, sw, th[:3], tw)
    with pytest.raises(ValueError, match="beta"):
        fused_linear_distill(sh, sw, th, tw, divergence="jsd", beta=1.5)


def test_op_contract(device):
    sh, sw, th, tw = randn(6, 8, device=device), randn(24, 8, device=device), randn(6, 6, device=device), \
        randn(24, 6, device=device)
    labels = torch.randint(0, 24, (6,), device=device)
    labels[1] = IGNORE
    fn = lambda sh, sw, th, tw, labels: fused_linear_distill(
        sh, sw, th, tw, labels, divergence="jsd", temperature=2.0, weight_hard_loss=0.5, weight_soft_loss=0.5,
        chunk_tokens=4)
    assert_op_contract(fn, (sh.requires_grad_(), sw.requires_grad_(), th, tw, labels),
                       expect_ops={"fused_linear_distill_forward"})


@pytest.mark.parametrize("accum_dtype", [None, torch.float32], ids=str)
def test_forward_gradients_become_the_grads_without_a_copy(device, accum_dtype):
    """The student's gradients computed in the forward pass become its ``.grad`` (rescaled in place
    by the incoming gradient, no head-sized copy at the backward's peak), in the weight's dtype
    whichever accumulator the chunks used."""
    n, hs, ht, v = SHAPE
    sh, sw = leaf(randn(n, hs, dtype=torch.bfloat16, device=device)), leaf(randn(v, hs, dtype=torch.bfloat16,
                                                                                  device=device, std=0.3))
    th, tw = randn(n, ht, dtype=torch.bfloat16, device=device), randn(v, ht, dtype=torch.bfloat16, device=device)
    loss = fused_linear_distill(sh, sw, th, tw, chunk_tokens=8, accum_dtype=accum_dtype)
    written = [g.data_ptr() for g in loss.grad_fn.grads.tensors if g is not None]
    (2 * loss).backward()
    # Under compute-sanitizer autograd hands the weight a copy after a rescaled backward (H100,
    # 2026-11-25: memcheck reports 0 errors; not without the sanitizer, at either test scale).
    if not MEMCHECK:
        assert [sh.grad.data_ptr(), sw.grad.data_ptr()] == written
    assert sw.grad.dtype == torch.bfloat16
    sh2, sw2 = leaf(sh.detach()), leaf(sw.detach())
    fused_linear_distill(sh2, sw2, th, tw, chunk_tokens=8, accum_dtype=accum_dtype).backward()
    assert_close(sw.grad, 2 * sw2.grad, torch.bfloat16, "dstudent_weight x2")


def test_backward_fills_no_zeros_for_the_returned_gradients(device):
    """The student's gradients are forward outputs taking no gradient: no zero fill of their size
    in backward (a head-sized buffer)."""
    n, hs, ht, v = SHAPE
    sh, sw = leaf(randn(n, hs, device=device)), leaf(randn(v, hs, device=device, std=0.3))
    th, tw = randn(n, ht, device=device), randn(v, ht, device=device)
    loss = fused_linear_distill(sh, sw, th, tw, chunk_tokens=8)
    assert zero_fills_during(loss.backward, sh.numel() * sh.element_size()) == []


def test_bad_accum_dtype(device):
    n, hs, ht, v = SHAPE
    sh, sw = randn(n, hs, device=device), randn(v, hs, device=device)
    th, tw = randn(n, ht, device=device), randn(v, ht, device=device)
    with pytest.raises(ValueError, match="accum_dtype"):
        fused_linear_distill(sh, sw, th, tw, accum_dtype=torch.float16)


def test_scratch_counts_the_hard_label_gradient_in_rows_of_logits():
    """Two rows of logits a token, and the hard-label gradient's fp32 row counted in their bytes."""
    assert scratch_buffers(torch.float32, False) == scratch_buffers(torch.bfloat16, False) == 2
    assert scratch_buffers(torch.float32, True) == 3
    assert scratch_buffers(torch.bfloat16, True) == 4
