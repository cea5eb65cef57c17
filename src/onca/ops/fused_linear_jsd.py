"""Fused linear JSD for distillation: ``jsd(student_hidden @ Ws.T, teacher_hidden @ Wt.T)`` without
either model's logits ever existing in full.

Arguments follow liger-kernel's ``LigerFusedLinearJSDFunction``: student hidden states ``(..., H)``
and head ``Ws (V, H)``, teacher hidden states ``(..., H')`` and head ``Wt (V, H')`` (the hidden
sizes may differ, the vocabularies may not), optional ``labels`` (one per token; tokens equal to
``ignore_index`` contribute nothing), ``beta`` and ``temperature``. The divergence is the one of
:mod:`onca.ops.jsd` between ``q = softmax(student_logits / T)`` and ``p = softmax(teacher_logits /
T)``; ``reduction="mean"`` (default, liger's) divides by the number of tokens not ignored (0 when
all are), ``"sum"`` does not. With no tokens at all the loss is 0 (NaN for ``mean`` without
labels, as :mod:`onca.ops.jsd`) and the gradients are zeros. Under ``torch.autocast`` the hidden
states and heads are cast to the autocast dtype first, as ``F.linear`` would cast them.

The tokens are processed in chunks (``onca.tiling.plan_token_chunks``; the budget is a quarter of
the free device memory, and no more than the student head's size in bf16 unless that would make
chunks shorter than ``MIN_CHUNK_TOKENS``, below which the head matmuls become bound by reading the
weights). Per chunk:

1. both chunks of logits, in fp32, into two reused ``(chunk, V)`` fp32 buffers (the matmul writes
   fp32 from bf16/fp16 operands where torch can, on CUDA; on the CPU the operands are upcast; on
   other devices the product is rounded to the input dtype first);
2. one kernel: both log-softmaxes at temperature ``T``, the loss per token, and the gradient w.r.t.
   the student logits, written over the student logits buffer (in the student's dtype: a bf16
   gradient row occupies the first half of its fp32 logits row, and each tile is read before it is
   overwritten), so no third buffer exists;
3. ``dStudentHidden[chunk] = dz @ Ws`` and ``dWs += dz.T @ student_hidden[chunk]``, in chunk order
   (deterministic): in the head's dtype, one rounding per chunk, as liger-kernel's and Onca's other
   fused heads by default (``accum_dtype=None``), or in an fp32 buffer cast once at the end
   (``accum_dtype=torch.float32``; the matmul's fp32 output where torch supports it).

The gradients are computed in the forward pass and saved (the loss is last in the graph); the
backward pass multiplies them by the incoming gradient on the device (no host read). The teacher
gets no gradient. Scratch memory: two ``(chunk, V)`` fp32 buffers, plus, with an fp32 accumulator
for a bf16/fp16 head, that accumulator (twice the head's size, beside the head-sized result of its
cast at the end: H200, 1024 tokens of hidden 4096 into 128256 columns, peak 6102 MB against
liger-kernel's 5186 before the head's dtype became the default).
"""

from __future__ import annotations

import torch
from torch import Tensor

from onca.device import DeviceProfile, free_memory
from onca.ops._contract import custom_op, register_autograd
from onca.ops._chunked_head import head_logits
from onca.ops._matmul import accumulate_dw
from onca.ops._partials import sum_scaled
from onca.ops._validate import (autocast_enabled, check_accum_dtype, check_float, check_same_device,
                                check_tensor)
from onca.ops.cross_entropy import keep_forward_gradients, take_forward_gradients
from onca.ops.jsd import (
    check_beta,
    check_ignore_index,
    check_labels,
    check_temperature,
    gradient_view,
    jsd_rows,
    plan_divergence,
    token_scale,
)
from onca.tiling import ChunkPlan, RowPlan, plan_token_chunks

__all__ = ["fused_linear_jsd", "plan", "chunk_plan", "MIN_CHUNK_TOKENS", "REDUCTIONS"]

REDUCTIONS = ("mean", "sum")

# The head matmuls read the whole (V, H) weight once per chunk for about 2 * chunk * V * H flops:
# about `chunk` flops per byte of a bf16 weight. An H100/H200 needs ~300 flops per byte of HBM
# traffic to stay compute-bound, so chunks are not made shorter than this while memory allows.
MIN_CHUNK_TOKENS = 512


def chunk_plan(tokens: int, vocab: int, hidden: int, device=None) -> ChunkPlan:
    """How many tokens each chunk holds: the two fp32 logits rows of a token are its scratch."""
    bytes_per_token = 2 * vocab * 4
    head_bytes = vocab * hidden * 2
    budget = min(free_memory(device) // 4, max(head_bytes, MIN_CHUNK_TOKENS * bytes_per_token))
    return plan_token_chunks(tokens, bytes_per_token, budget)


def plan(shape, dtype: torch.dtype, profile: DeviceProfile | None = None) -> dict[str, ChunkPlan | RowPlan]:
    """Plans for ``shape = (tokens, hidden, vocab)``: the token chunks (from this device's free
    memory now) and the divergence kernel's tiling of one ``(chunk, vocab)`` fp32 logits block."""
    shape = tuple(int(s) for s in shape)
    if len(shape) != 3:
        raise ValueError(f"fused_linear_jsd plans take shape (tokens, hidden, vocab), got {shape}")
    tokens, hidden, vocab = shape
    chunks = chunk_plan(tokens, vocab, hidden)
    divergence = plan_divergence(chunks.chunk, vocab, torch.float32, True, profile)
    return {"chunks": chunks, "divergence": divergence}


@custom_op("fused_linear_jsd_forward")
def fused_linear_jsd_forward(student_hidden: Tensor, student_weight: Tensor, teacher_hidden: Tensor,
                             teacher_weight: Tensor, labels: Tensor | None, beta: float, ignore_index: int,
                             temperature: float, reduction: str, need_hidden_grad: bool,
                             need_weight_grad: bool, accum_fp32: bool) -> tuple[Tensor, Tensor, Tensor]:
    """``(loss, dStudentHidden, dWs)`` for the 2-D hidden states and 1-D ``labels``; the gradients
    (for an incoming gradient of 1) are empty tensors unless asked for. ``accum_fp32``: ``dWs``
    summed over the chunks in fp32, else in the head's dtype."""
    sh, sw, th, tw = student_hidden, student_weight, teacher_hidden, teacher_weight
    tokens, hidden = sh.shape
    vocab = sw.shape[0]
    device = sh.device
    # The kernel stores every token's loss; with no vocabulary there are none to store.
    row_loss = (torch.empty if vocab else torch.zeros)(tokens, dtype=torch.float32, device=device)
    scale = token_scale(labels, tokens, ignore_index, reduction, device)
    dh = sh.new_empty((tokens, hidden) if need_hidden_grad else (0,))
    dw = None
    if need_weight_grad:
        # The first chunk writes it.
        dw = torch.empty((vocab, hidden), dtype=torch.float32 if accum_fp32 else sw.dtype, device=device)
    if tokens > 0 and vocab > 0:
        _chunked_forward(sh, sw, th, tw, labels, beta, ignore_index, temperature, scale, row_loss,
                         dh if need_hidden_grad else None, dw)
    else:  # a sum over nothing: a zero loss and zero gradients
        dh.zero_()
        if dw is not None:
            dw.zero_()
    loss = sum_scaled(row_loss, sh.dtype, factor=scale)
    # ``to`` returns ``dw`` itself when it is already in the head's dtype.
    return loss, dh, dw.to(sw.dtype) if dw is not None else sw.new_empty(0)


@fused_linear_jsd_forward.register_fake
def _(student_hidden, student_weight, teacher_hidden, teacher_weight, labels, beta, ignore_index,
      temperature, reduction, need_hidden_grad, need_weight_grad, accum_fp32):
    sh, sw = student_hidden, student_weight
    return (sh.new_empty(()), sh.new_empty(sh.shape if need_hidden_grad else (0,)),
            sw.new_empty(sw.shape if need_weight_grad else (0,)))


def _chunked_forward(sh, sw, th, tw, labels, beta, ignore_index, temperature, scale, row_loss, dh, dw):
    """The loss per token into ``row_loss`` and, where given, ``dh`` / ``dw`` (fp32 or the head's
    dtype), chunk by chunk."""
    tokens, hidden = sh.shape
    vocab = sw.shape[0]
    device = sh.device
    chunks = chunk_plan(tokens, vocab, hidden, device)
    s_buf = torch.empty((chunks.chunk, vocab), dtype=torch.float32, device=device)
    t_buf = torch.empty((chunks.chunk, vocab), dtype=torch.float32, device=device)
    with_grad = dh is not None or dw is not None
    for index in range(chunks.n_chunks):
        start, end = chunks.bounds(index)
        s_logits, t_logits = s_buf[: end - start], t_buf[: end - start]
        head_logits(sh[start:end], sw, None, s_logits)  # fp32 logits of the 16-bit heads, unrounded
        head_logits(th[start:end], tw, None, t_logits)
        dz = gradient_view(s_logits, sw.dtype) if with_grad else None
        jsd_rows(s_logits, t_logits, labels[start:end] if labels is not None else None, scale, dz,
                 row_loss[start:end], beta, ignore_index, temperature, normalize=True)
        if dh is not None:
            torch.mm(dz, sw, out=dh[start:end])
        if dw is not None:
            accumulate_dw(dw, dz, sh[start:end], first=index == 0)


# ---------------------------------------------------------------------------------------- autograd


def _setup_context(ctx, inputs, output):
    """Keeps the gradients the forward op computed (rescaled in place by the backward on the eager
    route, as fused linear cross entropy's: no second head-sized gradient at the backward's peak),
    and nothing else."""
    *_, need_hidden_grad, need_weight_grad, _accum_fp32 = inputs
    loss, dh, dw = output
    ctx.mark_non_differentiable(dh, dw)
    keep_forward_gradients(ctx, [dh if need_hidden_grad else None, dw if need_weight_grad else None], inputs[0],
                           loss)


def _backward(ctx, grad, _grad_dh, _grad_dw):
    # A gradient the forward op was not asked for is None (the teacher's always is).
    dh, dw = take_forward_gradients(ctx, grad)
    return (dh if ctx.needs_input_grad[0] else None, dw if ctx.needs_input_grad[1] else None) + (None,) * 10


register_autograd(fused_linear_jsd_forward, _backward, setup_context=_setup_context)


# ------------------------------------------------------------------------------------------ public


def _validate(sh, sw, th, tw, labels, beta, ignore_index, temperature, reduction, accum_dtype):
    """``(labels as a 1-D tensor or None, accumulate dWs in fp32)``, after checking every argument."""
    for t, name in ((sh, "student_hidden"), (sw, "student_weight"), (th, "teacher_hidden"),
                    (tw, "teacher_weight")):
        check_float(t, name)
    for w, name in ((sw, "student_weight"), (tw, "teacher_weight")):
        if w.dim() != 2:
            raise ValueError(f"{name} must be 2-D (vocab, hidden), got shape {tuple(w.shape)}")
    if sh.dim() == 0 or sh.shape[-1] != sw.shape[1]:
        raise ValueError(f"student_hidden must have last dimension {sw.shape[1]} (student_weight's hidden "
                         f"size), got shape {tuple(sh.shape)}")
    if th.dim() == 0 or th.shape[-1] != tw.shape[1]:
        raise ValueError(f"teacher_hidden must have last dimension {tw.shape[1]} (teacher_weight's hidden "
                         f"size), got shape {tuple(th.shape)}")
    if tw.shape[0] != sw.shape[0]:
        raise ValueError(f"teacher_weight has vocabulary {tw.shape[0]} but student_weight has {sw.shape[0]}; "
                         "the two heads must share one vocabulary")
    if tuple(th.shape[:-1]) != tuple(sh.shape[:-1]):
        raise ValueError(f"teacher_hidden must have the student's tokens {tuple(sh.shape[:-1])}, "
                         f"got shape {tuple(th.shape)}")
    if sh.dtype != sw.dtype:
        raise TypeError(f"student_hidden ({sh.dtype}) and student_weight ({sw.dtype}) must have one dtype")
    if th.dtype != tw.dtype:
        raise TypeError(f"teacher_hidden ({th.dtype}) and teacher_weight ({tw.dtype}) must have one dtype")
    for t, name in ((sw, "student_weight"), (th, "teacher_hidden"), (tw, "teacher_weight")):
        check_same_device(t, name, sh, "student_hidden")
    check_beta(beta)
    check_temperature(temperature)
    check_ignore_index(ignore_index)
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    labels1d = check_labels(labels, "labels", sh.shape[:-1], sh, "student_hidden")
    return labels1d, check_accum_dtype(accum_dtype, sw.dtype)


def fused_linear_jsd(
    student_hidden: Tensor,
    student_weight: Tensor,
    teacher_hidden: Tensor,
    teacher_weight: Tensor,
    labels: Tensor | None = None,
    beta: float = 0.5,
    ignore_index: int = -100,
    temperature: float = 1.0,
    reduction: str = "mean",
    accum_dtype: torch.dtype | None = None,
) -> Tensor:
    """Distillation loss ``jsd(student_hidden @ student_weight.T, teacher_hidden @ teacher_weight.T)``
    at ``temperature``, computed over chunks of tokens so that neither model's logits exist in full
    (liger-kernel's ``LigerFusedLinearJSD``). Gradients for the student's hidden states and head;
    the teacher gets none. The head's gradient is summed over the chunks in the head's dtype (as
    liger-kernel), or in fp32 and rounded once with ``accum_dtype=torch.float32`` (a head-sized fp32
    buffer more). Under ``torch.autocast`` the
    four tensors are cast to the autocast dtype first, as ``F.linear`` would."""
    tensors = (student_hidden, student_weight, teacher_hidden, teacher_weight)
    for t, name in zip(tensors, ("student_hidden", "student_weight", "teacher_hidden", "teacher_weight")):
        check_tensor(t, name)
    device_type = student_hidden.device.type
    # A device type without autocast (``meta``, as in ``onca audit``) has nothing to cast.
    if autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        tensors = tuple(t.to(dtype) if t.is_floating_point() else t for t in tensors)
        # The op computes in its own precisions (fp32 logits): autocast must not recast inside it.
        with torch.autocast(device_type, enabled=False):
            return _fused_linear_jsd(*tensors, labels, beta, ignore_index, temperature, reduction,
                                     accum_dtype)
    return _fused_linear_jsd(*tensors, labels, beta, ignore_index, temperature, reduction, accum_dtype)


def _fused_linear_jsd(sh, sw, th, tw, labels, beta, ignore_index, temperature, reduction, accum_dtype):
    labels1d, accum_fp32 = _validate(sh, sw, th, tw, labels, beta, ignore_index, temperature, reduction,
                                     accum_dtype)
    grad_enabled = torch.is_grad_enabled()
    return fused_linear_jsd_forward(
        sh.reshape(-1, sh.shape[-1]).contiguous(), sw.contiguous(), th.reshape(-1, th.shape[-1]).contiguous(),
        tw.contiguous(), labels1d, float(beta), ignore_index, float(temperature), reduction,
        grad_enabled and sh.requires_grad, grad_enabled and sw.requires_grad, accum_fp32,
    )[0]
