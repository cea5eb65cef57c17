"""Fused linear JSD for distillation: ``jsd(student_hidden @ Ws.T, teacher_hidden @ Wt.T)`` without
either model's logits ever existing in full.

Arguments follow liger-kernel's ``LigerFusedLinearJSDFunction``: student hidden states ``(..., H)``
and head ``Ws (V, H)``, teacher hidden states ``(..., H')`` and head ``Wt (V, H')`` (the hidden
sizes may differ, the vocabularies may not), optional ``labels`` (one per token; tokens equal to
``ignore_index`` contribute nothing), ``beta`` and ``temperature``. The divergence is the one of
:mod:`onca.ops.jsd` between ``q = softmax(student_logits / T)`` and ``p = softmax(teacher_logits /
T)``; ``reduction="mean"`` (default, liger's) divides by the number of tokens not ignored (0 when
all are), ``"sum"`` does not.

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
3. ``dStudentHidden[chunk] = dz @ Ws`` and ``dWs += dz.T @ student_hidden[chunk]``, accumulated in
   fp32 for bf16/fp16 heads (fp32 output of the matmul where torch supports it), in chunk order:
   deterministic.

The gradients are computed in the forward pass and saved (the loss is last in the graph); the
backward pass returns them, scaled only when the incoming gradient is not exactly 1. The teacher
gets no gradient. Scratch memory: two ``(chunk, V)`` fp32 buffers, plus the fp32 ``dWs``
accumulator for a bf16/fp16 head.
"""

from __future__ import annotations

import torch

from onca.device import DeviceProfile, free_memory
from onca.ops._matmul import has_fp32_out_dtype
from onca.ops._validate import check_float, check_nonempty, check_same_device, check_tensor
from onca.ops.jsd import (
    check_beta,
    check_labels,
    check_temperature,
    jsd_rows,
    plan_divergence,
    token_scale,
)
from onca.tiling import ChunkPlan, RowPlan, plan_token_chunks

__all__ = [
    "fused_linear_jsd", "FusedLinearJSDFunction", "plan", "chunk_plan", "MIN_CHUNK_TOKENS", "REDUCTIONS",
]

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


# ------------------------------------------------------------------------------------ the matmuls

def _fp32_matmul_operands(device) -> bool:
    """Whether the fallback for a low-precision fp32-output matmul upcasts the operands (exact, as
    the fp32-output matmul: used on the CPU) rather than rounding the product first."""
    return device.type == "cpu"


def _logits(h: torch.Tensor, w: torch.Tensor, w_up: torch.Tensor | None, out: torch.Tensor) -> None:
    """``out = h @ w.T`` in fp32 (``out`` is a fp32 buffer)."""
    if h.dtype == torch.float32:
        torch.mm(h, w.t(), out=out)
        return
    if has_fp32_out_dtype(h.device.type, h.dtype):
        torch.mm(h, w.t(), out_dtype=torch.float32, out=out)
        return
    if w_up is not None:
        torch.mm(h.float(), w_up.t(), out=out)
    else:
        out.copy_(torch.mm(h, w.t()))


def _accumulate_dw(dw: torch.Tensor, dz: torch.Tensor, h: torch.Tensor) -> None:
    """``dw += dz.T @ h`` with ``dw`` in fp32 (or the weight's dtype when that is fp32)."""
    if dz.dtype == dw.dtype:
        dw.addmm_(dz.t(), h)
        return
    if has_fp32_out_dtype(dw.device.type, dz.dtype):
        torch.addmm(dw, dz.t(), h, out_dtype=torch.float32, out=dw)
        return
    if _fp32_matmul_operands(dw.device):
        dw.addmm_(dz.t().float(), h.float())
    else:
        dw.add_(torch.mm(dz.t(), h))


def _gradient_view(logits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The ``(n, V)`` gradient in ``dtype`` that the kernel writes over the fp32 logits ``(n, V)``:
    the logits themselves for fp32, else the first half of each fp32 row's bytes."""
    if dtype == torch.float32:
        return logits
    return logits.view(dtype)[:, : logits.shape[1]]


def fused_linear_jsd_forward(sh, sw, th, tw, labels, beta, ignore_index, temperature, reduction,
                             need_dh: bool, need_dw: bool):
    """The loss, and ``dStudentHidden`` / ``dWs`` (for an incoming gradient of 1) when asked."""
    tokens, hidden = sh.shape
    vocab = sw.shape[0]
    device = sh.device
    chunks = chunk_plan(tokens, vocab, hidden, device)
    s_buf = torch.empty((chunks.chunk, vocab), dtype=torch.float32, device=device)
    t_buf = torch.empty((chunks.chunk, vocab), dtype=torch.float32, device=device)
    row_loss = torch.empty(tokens, dtype=torch.float32, device=device)
    scale = token_scale(labels, tokens, ignore_index, reduction, device)
    dh = torch.empty_like(sh) if need_dh else None
    dw = torch.zeros((vocab, hidden), dtype=torch.float32, device=device) if need_dw else None
    upcast = _fp32_matmul_operands(device)
    sw_up = sw.float() if upcast and sw.dtype != torch.float32 else None
    tw_up = tw.float() if upcast and tw.dtype != torch.float32 else None
    with_grad = need_dh or need_dw
    for index in range(chunks.n_chunks):
        start, end = chunks.bounds(index)
        s_logits, t_logits = s_buf[: end - start], t_buf[: end - start]
        _logits(sh[start:end], sw, sw_up, s_logits)
        _logits(th[start:end], tw, tw_up, t_logits)
        dz = _gradient_view(s_logits, sw.dtype) if with_grad else None
        jsd_rows(s_logits, t_logits, labels[start:end] if labels is not None else None, scale, dz,
                 row_loss[start:end], beta, ignore_index, temperature, normalize=True)
        if need_dh:
            torch.mm(dz, sw, out=dh[start:end])
        if need_dw:
            _accumulate_dw(dw, dz, sh[start:end])
    loss = (row_loss.sum() * scale[0]).to(sh.dtype)
    if dw is not None:
        dw = dw.to(sw.dtype)
    return loss, dh, dw


# ---------------------------------------------------------------------------------------- autograd


def _grad_is_one(g: torch.Tensor) -> bool:
    return g.numel() == 1 and float(g) == 1.0


class FusedLinearJSDFunction(torch.autograd.Function):
    """Autograd wrapper. Saves ``dStudentHidden`` and ``dWs`` (computed in the forward pass for an
    incoming gradient of 1) and nothing else."""

    @staticmethod
    def forward(ctx, student_hidden, student_weight, teacher_hidden, teacher_weight, labels, beta,
                ignore_index, temperature, reduction):
        labels = _validate(student_hidden, student_weight, teacher_hidden, teacher_weight, labels, beta,
                           ignore_index, temperature, reduction)
        sh = student_hidden.reshape(-1, student_hidden.shape[-1]).contiguous()
        th = teacher_hidden.reshape(-1, teacher_hidden.shape[-1]).contiguous()
        labels1d = labels.reshape(-1).contiguous() if labels is not None else None
        need_dh, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        loss, dh, dw = fused_linear_jsd_forward(
            sh, student_weight.contiguous(), th, teacher_weight.contiguous(), labels1d, float(beta),
            int(ignore_index), float(temperature), reduction, need_dh, need_dw,
        )
        ctx.shape = student_hidden.shape
        ctx.save_for_backward(dh, dw)
        return loss

    @staticmethod
    def backward(ctx, grad):
        dh, dw = ctx.saved_tensors
        if not _grad_is_one(grad):
            dh = dh * grad.to(dh.dtype) if dh is not None else None
            dw = dw * grad.to(dw.dtype) if dw is not None else None
        return (dh.view(ctx.shape) if dh is not None else None, dw, None, None, None, None, None, None, None)


def _validate(sh, sw, th, tw, labels, beta, ignore_index, temperature, reduction):
    for t, name in ((sh, "student_hidden"), (sw, "student_weight"), (th, "teacher_hidden"),
                    (tw, "teacher_weight")):
        check_float(t, name)
        check_nonempty(t, name)
    for w, name in ((sw, "student_weight"), (tw, "teacher_weight")):
        if w.dim() != 2:
            raise ValueError(f"{name} must be 2-D (vocab, hidden), got shape {tuple(w.shape)}")
    if sh.shape[-1] != sw.shape[1]:
        raise ValueError(f"student_hidden must have last dimension {sw.shape[1]} (student_weight's hidden "
                         f"size), got shape {tuple(sh.shape)}")
    if th.shape[-1] != tw.shape[1]:
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
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"ignore_index must be an int, got {type(ignore_index).__name__}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    return check_labels(labels, "labels", sh.shape[:-1], sh, "student_hidden")


def fused_linear_jsd(student_hidden, student_weight, teacher_hidden, teacher_weight, labels=None,
                     beta: float = 0.5, ignore_index: int = -100, temperature: float = 1.0,
                     reduction: str = "mean"):
    """JSD between ``softmax(student_hidden @ student_weight.T / T)`` and the teacher's, chunked over
    tokens. See the module docstring."""
    for t, name in ((student_hidden, "student_hidden"), (student_weight, "student_weight"),
                    (teacher_hidden, "teacher_hidden"), (teacher_weight, "teacher_weight")):
        check_tensor(t, name)
    return FusedLinearJSDFunction.apply(student_hidden, student_weight, teacher_hidden, teacher_weight,
                                        labels, beta, ignore_index, temperature, reduction)
