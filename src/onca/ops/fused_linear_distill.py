"""Fused linear distillation: a divergence between a student head's and a teacher head's
distributions over the same tokens, mixed with the student's hard-label cross entropy, without
either model's ``(tokens, V)`` logits existing in full.

``student_hidden (..., Hs)`` / ``student_weight (V, Hs)`` (+ ``student_bias``), ``teacher_hidden
(..., Ht)`` / ``teacher_weight (V, Ht)`` (+ ``teacher_bias``); ``labels (...)`` (optional unless
``weight_hard_loss > 0``) marks with ``ignore_index`` the tokens that count for nothing. With
``q = softmax(student_logits / T)`` and ``p = softmax(teacher_logits / T)``, per token::

    forward_kl  KL(p || q)
    reverse_kl  KL(q || p)
    jsd         beta KL(p || M) + (1 - beta) KL(q || M),  M = beta p + (1 - beta) q
    cosine      1 - cos(student_logits, teacher_logits)

(the three KL-type divergences are :mod:`onca.ops.jsd`'s kernel), and ``hard = cross_entropy(
student_logits, labels)`` at temperature 1. The loss is ``weight_soft_loss * mean(soft) +
weight_hard_loss * mean(hard)``, means over the tokens not ignored (over all tokens without
labels), as liger-kernel's ``LigerFusedLinearDistillationBase`` mixes them (its defaults are
0.5/0.5; Onca's are 1/0: the divergence alone).

It runs on the chunk driver (:func:`onca.ops._chunked_head.chunk_loop`) in its gradient-in-forward
mode: the loss's gradient w.r.t. each token's logits is known in forward (each token's term only
depends on its own row, the mean's count is counted on the device first), so per chunk the
student's and teacher's logits are computed in the input dtype, as the eager computation rounds them
(two ``(chunk, V)`` buffers; fp32 products for the cosine divergence, see :data:`FP32_LOGITS`; an fp32
one more for the hard-label gradient when it is mixed in), the divergence kernel writes the gradient
over the student's logits, and the driver's matmuls accumulate ``dStudentHidden``, ``dStudentWeight``
and ``dStudentBias`` (fp32). Backward multiplies them by the incoming gradient. The teacher gets no
gradient.

A small call (both heads' logits within :func:`onca.ops._small_calls.limit` elements, eager, on
CUDA; under autocast too, the inputs cast first) takes torch's ops instead: each head's logits by
one GEMM in the input dtype, the divergence and the hard-label loss in fp32, autograd for the
gradient (the kernels' values to rounding: their logits are the same products).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from onca.device import DeviceProfile, accelerator, free_memory
from onca.ops import _small_calls as small_calls
from onca.ops._chunked_head import check_options, chunk_loop, head_logits, validate_head
from onca.ops._contract import custom_op, register_autograd, tracing
from onca.ops._validate import (
    autocast_enabled,
    check_accum_dtype,
    check_bool,
    check_float,
    check_number,
    check_same_device,
    check_tensor,
)
from onca.ops.cross_entropy import (
    ForwardGradients,
    cross_entropy_rows,
    scale_forward_gradient,
    torch_cross_entropy,
)
from onca.ops.jsd import gradient_view, jsd_rows, plan_divergence
from onca.tiling import ChunkPlan, plan_token_chunks

__all__ = ["DIVERGENCES", "chunk_plan", "fused_linear_distill", "plan"]

DIVERGENCES = ("forward_kl", "reverse_kl", "jsd", "cosine")
# Tokens per chunk aimed at (the head matmuls read the weights once per chunk, and the weight gradient
# is read and written once per chunk), and the share of the free memory the scratch may take.
CHUNK_TOKENS = 2048
FREE_FRACTION = 0.25
# Whether the heads' logits are fp32 products for every divergence. False: in the input dtype, as the
# eager computation rounds them before its fp32 log-softmax (liger-kernel's too), except for the
# cosine divergence, whose norms are torch's ops on the logits; the hard-label gradient stays fp32.
# H200, bf16, forward KL, forward + backward (CUDA-graph replay, tools/kernel_variants.py), ms, at
# the benchmark's D2 heads (8192 tokens): 2048-token chunks of bf16 logits (the same scratch as
# 1024 tokens of fp32 ones) against 1024 of fp32: Llama-3-8B 53.54 / 57.49, Llama-3.2-1B 28.46 /
# 31.86, Qwen2.5-7B 57.69 / 62.31, Mistral-7B 13.83 / 14.78, Phi-3-mini 10.61 / 11.57.
FP32_LOGITS = False


def logits_dtype(dtype: torch.dtype, divergence: str) -> torch.dtype:
    """The dtype the chunks' logits are computed in, for inputs of ``dtype``."""
    return torch.float32 if FP32_LOGITS or divergence == "cosine" else dtype


def scratch_buffers(logits_dtype: torch.dtype, hard_gradient: bool) -> int:
    """The scratch per token in rows of logits: the two heads', and the hard-label gradient's fp32
    row (two rows of 16-bit logits) when it is computed."""
    return 2 + (4 // logits_dtype.itemsize if hard_gradient else 0)


def chunk_plan(tokens: int, vocab: int, buffers: int = 2, chunk_tokens: int | None = None, device=None,
               itemsize: int = 4) -> ChunkPlan:
    """Tokens per chunk: ``buffers`` rows of logits per token of ``itemsize`` bytes are the scratch."""
    bytes_per_token = buffers * vocab * itemsize
    if chunk_tokens:
        return plan_token_chunks(tokens, bytes_per_token, chunk_tokens * bytes_per_token, multiple=1)
    budget = min(int(free_memory(device) * FREE_FRACTION), CHUNK_TOKENS * bytes_per_token)
    return plan_token_chunks(tokens, bytes_per_token, budget)


def plan(shape, dtype: torch.dtype, profile: DeviceProfile | None = None) -> dict:
    """Plans for ``shape = (tokens, hidden, vocab)``: the chunks and the divergence kernel's tiling."""
    shape = tuple(int(s) for s in shape)
    if len(shape) != 3:
        raise ValueError(f"fused_linear_distill plans take shape (tokens, hidden, vocab), got {shape}")
    tokens, _hidden, vocab = shape
    dtype = logits_dtype(dtype, "forward_kl")
    chunks = chunk_plan(tokens, vocab, device=accelerator(), itemsize=dtype.itemsize)
    return {"chunks": chunks, "divergence": plan_divergence(chunks.chunk, vocab, dtype, True, profile)}


def _cosine_rows(s: Tensor, t: Tensor, valid: Tensor | None, scale: Tensor, row_loss: Tensor) -> None:
    """``1 - cos(s, t)`` per row into ``row_loss`` and its gradient times ``scale`` over ``s``."""
    s_norm = s.norm(dim=-1, keepdim=True).clamp(min=1e-12)
    t_hat = t / t.norm(dim=-1, keepdim=True).clamp(min=1e-12)
    s_hat = s / s_norm
    cos = (s_hat * t_hat).sum(-1, keepdim=True)
    loss = 1 - cos.squeeze(-1)
    g = (cos * s_hat - t_hat) / s_norm
    if valid is not None:
        loss = loss * valid
        g = g * valid.unsqueeze(-1)
    row_loss.copy_(loss)
    torch.mul(g, scale, out=s)


@custom_op("fused_linear_distill_forward")
def fused_linear_distill_forward(
    student_hidden: Tensor, student_weight: Tensor, student_bias: Tensor | None, teacher_hidden: Tensor,
    teacher_weight: Tensor, teacher_bias: Tensor | None, labels: Tensor | None, divergence: str, beta: float,
    temperature: float, ignore_index: int, weight_hard_loss: float, weight_soft_loss: float, chunk_tokens: int,
    accum_fp32: bool, grad_hidden: bool, grad_weight: bool, grad_bias: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(loss, soft_loss, hard_loss, dhidden, dweight, dbias)``: fp32 scalars and the student's
    gradients for a unit incoming gradient (empty where not asked for); ``dweight`` accumulated
    over the chunks in the weight's dtype, or in fp32 with ``accum_fp32``."""
    sh, sw, sb, th, tw, tb = (student_hidden, student_weight, student_bias, teacher_hidden, teacher_weight,
                              teacher_bias)
    tokens, width = sh.shape
    vocab = sw.shape[0]
    device = sh.device
    if labels is not None:
        valid = labels != ignore_index
        count = valid.sum().clamp(min=1).to(torch.float32)
    else:
        valid = None
        count = torch.full((), float(max(tokens, 1)), dtype=torch.float32, device=device)
    inv = count.reciprocal().reshape(1)
    soft_rows = torch.zeros(tokens, dtype=torch.float32, device=device)
    hard_rows = torch.zeros(tokens, dtype=torch.float32, device=device)
    with_grad = grad_hidden or grad_weight or grad_bias
    dx = torch.empty((tokens, width), dtype=sh.dtype, device=device) if grad_hidden else None
    dw_dtype = torch.float32 if accum_fp32 else sw.dtype
    dw = torch.empty(sw.shape, dtype=dw_dtype, device=device) if grad_weight else None  # chunk_loop writes it
    db = torch.zeros(sb.shape, dtype=torch.float32, device=device) if grad_bias else None
    hard = weight_hard_loss != 0.0
    if tokens:
        z_dtype = logits_dtype(sw.dtype, divergence)
        chunks = chunk_plan(tokens, vocab, scratch_buffers(z_dtype, hard and with_grad), chunk_tokens, device,
                            itemsize=z_dtype.itemsize)
        t_buf = torch.empty((chunks.chunk, vocab), dtype=z_dtype, device=device)
        h_buf = torch.empty((chunks.chunk, vocab), dtype=torch.float32, device=device) if hard and with_grad else None
        soft_scale = inv * weight_soft_loss
        hard_scale = inv * weight_hard_loss
        lse = torch.empty(chunks.chunk, dtype=torch.float32, device=device)
        z_rows = torch.empty(chunks.chunk, dtype=torch.float32, device=device)

        def visit(s, start, end):
            n = end - start
            t = head_logits(th[start:end], tw, tb, t_buf[:n])
            lab = labels[start:end] if labels is not None else None
            if hard:
                cross_entropy_rows(s, lab, ignore_index=ignore_index, label_smoothing=0.0, lse_square_scale=0.0,
                                   softcap=0.0, compute_lse=True, lse=lse[:n], loss=hard_rows[start:end],
                                   z=z_rows[:n], grad=h_buf[:n] if with_grad else None,
                                   scale=hard_scale.reshape(()) if with_grad else None)
            # The gradient in the weight's dtype, with no buffer of its own: written by the divergence
            # kernel over the student's logits (gradient_view: the first half of an fp32 row's bytes)
            # when it is the whole gradient, else summed over them and, from fp32 logits, copied over
            # the teacher's, dead by then.
            direct = with_grad and not hard and divergence != "cosine"
            if divergence == "cosine":
                _cosine_rows(s, t, valid[start:end] if valid is not None else None,
                             soft_scale if with_grad else torch.zeros(1, device=device), soft_rows[start:end])
            else:
                mode_beta = {"forward_kl": 0.0, "reverse_kl": 1.0}.get(divergence, beta)
                dz = gradient_view(s, sw.dtype) if direct else (s if with_grad else None)
                jsd_rows(s, t, lab, soft_scale, dz, soft_rows[start:end], mode_beta, ignore_index, temperature,
                         normalize=True)
            if not with_grad:
                return None
            if direct:
                return dz
            if hard:
                s += h_buf[:n]
            return s if s.dtype == sw.dtype else gradient_view(t, sw.dtype).copy_(s)

        chunk_loop(sh, sw, sb, chunks, visit, dx=dx, dw=dw, db=db, logits_dtype=z_dtype)
    else:
        for t in (dx, dw):
            if t is not None:
                t.zero_()
    soft = soft_rows.sum() * inv[0]
    hard_loss = hard_rows.sum() * inv[0]
    loss = weight_soft_loss * soft + weight_hard_loss * hard_loss
    empty = sh.new_empty(0)
    return (loss, soft, hard_loss, dx if dx is not None else empty, dw.to(sw.dtype) if dw is not None else empty,
            db.to(sb.dtype) if db is not None else empty)


@fused_linear_distill_forward.register_fake
def _(student_hidden, student_weight, student_bias, teacher_hidden, teacher_weight, teacher_bias, labels,
      divergence, beta, temperature, ignore_index, weight_hard_loss, weight_soft_loss, chunk_tokens,
      accum_fp32, grad_hidden, grad_weight, grad_bias):
    sh, sw, sb = student_hidden, student_weight, student_bias
    scalar = lambda: sh.new_empty((), dtype=torch.float32)
    empty = sh.new_empty(0)
    return (scalar(), scalar(), scalar(), sh.new_empty(sh.shape) if grad_hidden else empty,
            sw.new_empty(sw.shape) if grad_weight else empty, sb.new_empty(sb.shape) if grad_bias else empty)


def _setup_context(ctx, inputs, output):
    """Keeps the gradients the forward op computed, and nothing else: on the eager route they are
    rescaled in place by the incoming gradient (no head-sized copy at the backward's peak), traced
    into new tensors."""
    ctx.computed = inputs[-3:]
    loss, _soft, _hard, dx, dw, db = output
    ctx.mark_non_differentiable(_soft, _hard, dx, dw, db)
    ctx.eager = not tracing(inputs[0], loss)
    if ctx.eager:
        computed = [g if wanted else None for g, wanted in zip((dx, dw, db), ctx.computed)]
        ctx.grads = ForwardGradients(computed)
    else:
        ctx.save_for_backward(dx, dw, db)


def _backward(ctx, grad, *_):
    needs = ctx.needs_input_grad[:3]
    if ctx.eager:
        grads = ctx.grads.take(grad)
    else:
        grads = [scale_forward_gradient(g, grad, None) if computed else None
                 for g, computed in zip(ctx.saved_tensors, ctx.computed)]
    grads = [g if need else None for g, need in zip(grads, needs)]
    return (*grads,) + (None,) * 15


register_autograd(fused_linear_distill_forward, _backward, setup_context=_setup_context)


def fused_linear_distill(
    student_hidden: Tensor,
    student_weight: Tensor,
    teacher_hidden: Tensor,
    teacher_weight: Tensor,
    labels: Tensor | None = None,
    *,
    student_bias: Tensor | None = None,
    teacher_bias: Tensor | None = None,
    divergence: str = "forward_kl",
    beta: float = 0.5,
    temperature: float = 1.0,
    weight_hard_loss: float = 0.0,
    weight_soft_loss: float = 1.0,
    ignore_index: int = -100,
    chunk_tokens: int | None = None,
    accum_dtype: torch.dtype | None = None,
    return_aux: bool = False,
):
    """Distillation loss ``weight_soft_loss * mean(divergence) + weight_hard_loss * mean(CE)``
    between a student head (``student_hidden (..., Hs)``, ``student_weight (V, Hs)``, +
    ``student_bias``) and a teacher head over the same tokens, at ``temperature``, without the
    logits (see the module docstring; ``divergence`` one of ``forward_kl``, ``reverse_kl``, ``jsd``
    with ``beta``, ``cosine``). Returns the fp32 scalar loss; ``return_aux=True`` returns ``(loss,
    aux)`` with the scalar ``soft_loss`` and ``hard_loss`` (means, before their weights). Gradients
    reach the student only. Under ``torch.autocast`` the four heads' inputs are cast to the
    autocast dtype first. ``accum_dtype``: the student weight gradient's accumulator over the
    chunks (None: the weight's dtype, one rounding per chunk, as liger-kernel; ``torch.float32``:
    fp32, a head-sized buffer more)."""
    for t, name in ((student_hidden, "student_hidden"), (student_weight, "student_weight"),
                    (teacher_hidden, "teacher_hidden"), (teacher_weight, "teacher_weight")):
        check_tensor(t, name)
    check_options(ignore_index, temperature, chunk_tokens)
    check_bool(return_aux, "return_aux")
    if divergence not in DIVERGENCES:
        raise ValueError(f"divergence must be one of {DIVERGENCES}, got {divergence!r}")
    check_number(beta, "beta", minimum=0.0)
    if beta > 1.0:
        raise ValueError(f"beta must be in [0, 1], got {beta!r}")
    check_number(weight_hard_loss, "weight_hard_loss", minimum=0.0)
    check_number(weight_soft_loss, "weight_soft_loss", minimum=0.0)
    device_type = student_hidden.device.type
    tensors = (student_hidden, student_weight, student_bias, teacher_hidden, teacher_weight, teacher_bias)
    if autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        tensors = tuple(t.to(dtype) if isinstance(t, Tensor) and t.is_floating_point() else t for t in tensors)
        with torch.autocast(device_type, enabled=False):
            return _distill(*tensors, labels, divergence, beta, temperature, weight_hard_loss, weight_soft_loss,
                            ignore_index, chunk_tokens, accum_dtype, return_aux)
    return _distill(*tensors, labels, divergence, beta, temperature, weight_hard_loss, weight_soft_loss,
                    ignore_index, chunk_tokens, accum_dtype, return_aux)


def _distill(sh, sw, sb, th, tw, tb, labels, divergence, beta, temperature, weight_hard_loss, weight_soft_loss,
             ignore_index, chunk_tokens, accum_dtype, return_aux):
    lead = tuple(sh.shape[:-1])
    if labels is None:
        if weight_hard_loss:
            raise ValueError("weight_hard_loss > 0 needs labels (the hard targets)")
        dummy = torch.zeros(lead, dtype=torch.long, device=sh.device)
        validate_head(sh, sw, dummy, sb, hidden_name="student_hidden", weight_name="student_weight",
                      bias_name="student_bias")
        validate_head(th, tw, dummy, tb, hidden_name="teacher_hidden", weight_name="teacher_weight",
                      bias_name="teacher_bias")
    else:
        validate_head(sh, sw, labels, sb, hidden_name="student_hidden", weight_name="student_weight",
                      bias_name="student_bias")
        validate_head(th, tw, labels, tb, hidden_name="teacher_hidden", weight_name="teacher_weight",
                      bias_name="teacher_bias")
    if tw.shape[0] != sw.shape[0]:
        raise ValueError(f"teacher_weight has vocabulary {tw.shape[0]} but student_weight has {sw.shape[0]}; "
                         "the two heads must share one vocabulary")
    if tuple(th.shape[:-1]) != lead:
        raise ValueError(f"teacher_hidden must have the student's tokens {lead}, got shape {tuple(th.shape)}")
    check_same_device(th, "teacher_hidden", sh, "student_hidden")
    check_float(th, "teacher_hidden")
    accum_fp32 = check_accum_dtype(accum_dtype, sw.dtype)
    if small_calls.small(math.prod(lead) * sw.shape[0], sh, sw, th, tw):
        loss, soft, hard = _torch_distill(sh, sw, sb, th, tw, tb, labels, divergence, float(beta),
                                          float(temperature), ignore_index, float(weight_hard_loss),
                                          float(weight_soft_loss))
        if not return_aux:
            return loss
        hard = soft.new_zeros(()) if hard is None else hard.detach()
        return loss, {"soft_loss": soft.detach(), "hard_loss": hard}
    grad_enabled = torch.is_grad_enabled()
    rows = lambda t: t.reshape(-1, t.shape[-1]).contiguous()
    loss, soft, hard, *_ = fused_linear_distill_forward(
        rows(sh), sw.contiguous(), sb.contiguous() if sb is not None else None, rows(th).detach(),
        tw.detach().contiguous(), tb.detach().contiguous() if tb is not None else None,
        labels.reshape(-1).contiguous() if labels is not None else None, divergence, float(beta), float(temperature),
        ignore_index, float(weight_hard_loss), float(weight_soft_loss), chunk_tokens or 0, accum_fp32,
        grad_enabled and sh.requires_grad, grad_enabled and sw.requires_grad,
        grad_enabled and sb is not None and sb.requires_grad)
    if not return_aux:
        return loss
    return loss, {"soft_loss": soft, "hard_loss": hard}


def _torch_distill(sh, sw, sb, th, tw, tb, labels, divergence, beta, temperature, ignore_index,
                   weight_hard_loss, weight_soft_loss):
    """A small call's ``(loss, soft_loss, hard_loss)`` by torch's ops (:mod:`onca.ops._small_calls`):
    both heads' logits in the input dtype by one GEMM each, then in fp32 the divergence and the
    hard-label cross entropy, their gradient by autograd; the same means, ignored tokens and
    ``beta`` edges as the kernels (``jsd`` at ``beta`` 0 is the forward KL, at 1 the reverse).
    ``hard_loss`` is None where it is not mixed in. Every op skipped that does nothing at the
    call's settings: the route exists to save host time."""
    vocab = sw.shape[0]
    s = torch.nn.functional.linear(sh, sw, sb).float().reshape(-1, vocab)
    with torch.no_grad():
        t = torch.nn.functional.linear(th, tw, tb).float().reshape(-1, vocab)
    if labels is not None:
        flat = labels.reshape(-1)
        valid = flat != ignore_index
        count = valid.sum().clamp(min=1)
    else:
        valid, count = None, max(s.shape[0], 1)
    if divergence == "cosine":
        s_hat = s / s.norm(dim=-1, keepdim=True).clamp(min=1e-12)
        t_hat = t / t.norm(dim=-1, keepdim=True).clamp(min=1e-12)
        per = 1 - (s_hat * t_hat).sum(-1)
    else:
        mix = {"forward_kl": 0.0, "reverse_kl": 1.0}.get(divergence, beta)
        scaled = (s, t) if temperature == 1.0 else (s / temperature, t / temperature)
        log_q, log_p = (torch.log_softmax(z, -1) for z in scaled)
        if mix == 0.0:
            per = (log_p.exp() * (log_p - log_q)).sum(-1)
        elif mix == 1.0:
            per = (log_q.exp() * (log_q - log_p)).sum(-1)
        else:
            log_m = torch.logaddexp(log_p + math.log(mix), log_q + math.log(1 - mix))
            per = (mix * (log_p.exp() * (log_p - log_m)).sum(-1)
                   + (1 - mix) * (log_q.exp() * (log_q - log_m)).sum(-1))
    if valid is not None:
        per = torch.where(valid, per, 0.0)
    soft = per.sum() / count
    loss = soft if weight_soft_loss == 1.0 else weight_soft_loss * soft
    hard = None
    if weight_hard_loss:
        # Cross entropy's own small-call route (the ATen op, without F.cross_entropy's wrapper).
        hard = torch_cross_entropy(s, flat.long(), None, ignore_index, 0.0, "sum") / count
        loss = loss + weight_hard_loss * hard
    return loss, soft, hard
