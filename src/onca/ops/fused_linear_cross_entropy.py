"""Fused linear cross entropy: ``cross_entropy(hidden @ weight.T + bias, target)`` without the logits.

A causal LM's head and loss hold the largest tensors of a training step: for 8192 tokens and a
128256-token vocabulary the fp32 logits alone are 4 GiB. Here the full ``(tokens, vocab)`` logits
never exist. The tokens are processed in chunks; for each chunk

1. its logits are computed by one matmul (cuBLAS: the op is matmul-bound) into a scratch buffer
   ``(chunk, vocab)`` in the input dtype, reused by every chunk;
2. the cross-entropy kernel of ``onca.ops.cross_entropy`` reads them, writes the loss, the
   per-token log-sum-exp (and, when asked for, the argmax), and overwrites them with their
   gradient (already divided by the number of non-ignored tokens, or their summed class
   weights, counted on the device, for a mean; times each token's detached probability of its
   target under ``use_token_scaling``);
3. ``dHidden[chunk] = dLogits @ W`` and ``dW += dLogits.T @ hidden[chunk]`` (and
   ``dB += dLogits.sum(0)``, in fp32) by matmuls,

all in the forward pass, so the backward pass only scales the stored gradients by the incoming
gradient (a kernel that reads it on the device and touches nothing when it is exactly 1; traced,
into new tensors). The chunks are taken by position: tokens whose target is ``ignore_index`` stay
in place and are masked in the cross-entropy kernel (zero loss, zero gradient rows, so zero
hidden-state gradient), never gathered: no data-dependent shape, no host synchronisation. A
non-ignored target outside ``[0, vocab)`` gives NaN (see ``onca.ops.cross_entropy``).
``reduction="mean"`` with every token ignored (or none at all) is NaN with zero gradients, as torch.
The token accuracy and predicted tokens come from that same pass: no logits beyond the chunk.

``reduction="none"``: the per-token incoming gradient must weight each token's logits gradient
before it is summed into ``dW``, and it is unknown in the forward pass. The forward pass then
computes the loss alone (one matmul per chunk, no gradient) and saves the hidden states, the
head, the targets and one fp32 log-sum-exp per token; the backward pass recomputes each chunk's
logits and writes their scaled gradient in one pass (4 matmuls in all instead of 3). fp16 inputs
take this deferred path for every reduction: a mean's unit-scale logits gradients (``p / tokens``)
lie below fp16's normal range, and a loss scale (GradScaler) multiplied in afterwards cannot bring
back what fp16 rounded away (at 4096 tokens under a 65536 scale, ``dhidden`` was 18x further from
the exact gradient than fp16's own rounding); deferred, the incoming gradient is folded into the
fp32 logits gradient before its one rounding. bf16 has fp32's exponent range and keeps the 3-matmul
path.

Chunk size: the scratch holds ``chunk * vocab`` elements. Larger chunks make the weight-gradient
update ``dW += ...`` cheaper (it reads and writes all of ``dW`` once per chunk, so with few tokens
per chunk it is bound by memory, not by the matmul), smaller ones use less memory. The default
aims at ``CHUNK_TOKENS`` tokens per chunk (twice that when ``dW`` accumulates in fp32) and never
takes more than ``FREE_FRACTION`` of the device's free memory, nor more tokens than there are;
``chunk_tokens=`` overrides it. For a Llama-3 head (vocab 128256) in bf16 the default scratch is
263 MB, next to the 1.05 GB of ``dW`` itself. liger-kernel 0.8.5 sizes its chunk from the token
count instead (about ``tokens * hidden`` scratch elements: 256 tokens of 8192 at hidden 4096), so
its scratch is a quarter of ours at 8192 tokens and it runs its ``dW`` update 256 tokens deep;
the benchmark's ``chunk_tokens`` sweep shows what the chunk size costs in time and memory.

``dW`` accumulates in the weight's dtype (one rounding per chunk, as liger-kernel) unless
``accum_dtype=torch.float32`` (then in an fp32 buffer, cast once at the end). The loss is fp32,
as Hugging Face's loss on upcast logits. A weight tied to the input embedding needs nothing
special: its gradient from this op reaches the shared parameter through autograd and adds to the
embedding's. Saved for backward: the three gradients (or, on the deferred path, the inputs and
the per-token log-sum-exp).
"""

from __future__ import annotations

import torch
from torch import Tensor

from onca.device import DeviceProfile, accelerator, free_memory
from onca.ops import _small_calls as small_calls
from onca.ops._contract import custom_op, register_autograd, tracing
from onca.ops._matmul import accumulate_dw
from onca.ops._rows import as_rows
from onca.ops._validate import autocast_enabled, check_bool, check_float, check_same_device, check_tensor
from onca.ops.cross_entropy import (
    SCALE,
    TILES as CE_TILES,
    WEIGHT_TOTAL,
    Z_SCALE,
    ForwardGradients,
    check_class_weight,
    check_target,
    cross_entropy_rows,
    fake_predictions,
    loss_outputs,
    reduce_losses,
    scale_forward_gradient,
    target_stats,
    torch_computes,
    torch_cross_entropy,
    validate_options,
)
from onca.tiling import ChunkPlan, plan_rows, plan_token_chunks

__all__ = ["fused_linear_cross_entropy", "plan", "chunk_plan", "CHUNK_TOKENS", "FREE_FRACTION"]

# Tokens per chunk the default plan aims at. Timed on an H100 (bf16, 8192 tokens, forward +
# backward, against the three cuBLAS GEMMs alone): 512 tokens ran at 67-79% of the GEMMs' speed
# (hidden 1024 to 4096), 1024 at 75-89% (Llama-3 head: 41.9 ms against 47.2 for 512 and 37.4 for
# the GEMMs) for one more scratch of 512 tokens of logits (131 MB there); 2048 gained up to 5% more
# for twice that again. fp32 accumulation moves twice the bytes: twice the tokens.
CHUNK_TOKENS = 1024
# The scratch never takes more than this share of the device memory free when the op starts.
FREE_FRACTION = 0.25


# ------------------------------------------------------------------------------------------ plans


def chunk_plan(tokens: int, hidden: int, vocab: int, dtype: torch.dtype, *, accum_bytes: int | None = None,
               free_bytes: int | None = None, chunk_tokens: int | None = None, device=None,
               target_tokens: int | None = None) -> ChunkPlan:
    """How ``tokens`` tokens are split into chunks of consecutive positions. Scratch per token: one
    row of logits (overwritten by its gradient) in ``dtype``. ``hidden`` is part of the shape the
    plan describes; the scratch does not depend on it. ``target_tokens``: the tokens per chunk
    aimed at for a ``dtype``-sized accumulator (default ``CHUNK_TOKENS``)."""
    itemsize = dtype.itemsize
    bytes_per_token = vocab * itemsize
    if chunk_tokens is not None:
        return plan_token_chunks(tokens, bytes_per_token, int(chunk_tokens) * bytes_per_token, multiple=1)
    accum_bytes = accum_bytes or itemsize
    target = (target_tokens or CHUNK_TOKENS) * max(1, accum_bytes // 2)
    free_bytes = free_memory(device) if free_bytes is None else free_bytes
    budget = min(int(free_bytes * FREE_FRACTION), target * bytes_per_token)
    return plan_token_chunks(tokens, bytes_per_token, budget)


def plan(shape, dtype: torch.dtype, profile: DeviceProfile | None = None) -> dict:
    """Plans for ``shape = (tokens, hidden, vocab)``: the token chunks (from the free memory of this
    machine's accelerator) and the cross-entropy kernel's plan over one chunk of logits."""
    shape = tuple(int(s) for s in shape)
    if len(shape) != 3:
        raise ValueError(f"fused_linear_cross_entropy plans take --shape TOKENSxHIDDENxVOCAB, got {shape}")
    tokens, hidden, vocab = shape
    chunks = chunk_plan(tokens, hidden, vocab, dtype, device=accelerator())
    return {
        "chunks": chunks,
        "cross_entropy": plan_rows(chunks.chunk, vocab, dtype, profile=profile, **CE_TILES),
    }


# --------------------------------------------------------------------------------------- launchers


def _chunk_loop(h2d, weight, bias, target, chunks: ChunkPlan, options: dict, *, compute_lse: bool,
                lse, write_grad: bool, loss=None, z=None, predicted=None, scale=None, z_scale=None,
                dx=None, dw=None, db=None) -> None:
    """Run the chunks of consecutive tokens: logits by matmul, the cross-entropy kernel (ignored
    tokens masked there), then the gradient matmuls. ``scale``, ``z_scale``: 0-d, or one per
    token (see :func:`onca.ops.cross_entropy.cross_entropy_rows`)."""
    vocab = weight.shape[0]
    scratch = torch.empty((chunks.chunk, vocab), dtype=h2d.dtype, device=h2d.device)

    def rows_of(per_token, start, end):
        """A per-token tensor's slice for the chunk; 0-d scales and absent outputs as they are."""
        return per_token[start:end] if per_token is not None and per_token.dim() == 1 else per_token

    for index in range(chunks.n_chunks):
        start, end = chunks.bounds(index)
        h = h2d[start:end]
        logits = scratch[: end - start]
        if bias is None:
            torch.mm(h, weight.t(), out=logits)
        else:
            torch.addmm(bias, h, weight.t(), out=logits)
        cross_entropy_rows(
            logits, target[start:end], **options, compute_lse=compute_lse, lse=lse[start:end],
            loss=rows_of(loss, start, end), z=rows_of(z, start, end),
            predicted=rows_of(predicted, start, end), grad=logits if write_grad else None,
            scale=rows_of(scale, start, end), z_scale=rows_of(z_scale, start, end),
        )
        if not write_grad:
            continue
        # From here ``logits`` holds dLoss/dLogits for the chunk (zero rows for ignored tokens).
        if dx is not None:
            torch.mm(logits, weight, out=dx[start:end])
        if dw is not None:
            accumulate_dw(dw, logits, h, first=index == 0)
        if db is not None:
            db += logits.sum(dim=0, dtype=torch.float32)


def _grad_buffers(h2d, weight, bias, needs, accum_fp32: bool):
    """``(dx, dw, db)`` to accumulate into, None where not needed; ``dw``/``db`` may be fp32."""
    need_dx, need_dw, need_db = needs
    tokens = h2d.shape[0]
    dx = torch.empty(h2d.shape, dtype=h2d.dtype, device=h2d.device) if need_dx else None
    dw = db = None
    if need_dw:
        dtype = torch.float32 if accum_fp32 else weight.dtype
        # The first chunk writes dW (accumulate_dw's first); with no chunks at all it stays zero.
        alloc = torch.empty if tokens > 0 else torch.zeros
        dw = alloc(weight.shape, dtype=dtype, device=h2d.device)
    if need_db:
        db = torch.zeros(bias.shape, dtype=torch.float32, device=h2d.device)
    return dx, dw, db


def _plan_for(h2d, vocab, dw, chunk_tokens: int) -> ChunkPlan:
    accum_bytes = dw.element_size() if dw is not None else None
    return chunk_plan(h2d.shape[0], h2d.shape[1], vocab, h2d.dtype, accum_bytes=accum_bytes,
                      chunk_tokens=chunk_tokens or None, device=h2d.device)


def _as_outputs(h2d, weight, bias, dx, dw, db) -> tuple[Tensor, Tensor, Tensor]:
    """The gradients in their inputs' dtypes; an empty tensor for each one not computed."""
    return (dx if dx is not None else h2d.new_empty(0),
            dw.to(weight.dtype) if dw is not None else h2d.new_empty(0),
            db.to(bias.dtype) if db is not None else h2d.new_empty(0))


def grads_in_forward(reduction: str, dtype: torch.dtype) -> bool:
    """Whether the forward pass computes the gradients (for a unit incoming gradient). Not for
    ``reduction="none"`` (the per-token incoming gradient weights ``dW``'s sum), nor for fp16: a
    mean's unit-scale logits gradients (``p / tokens``) fall below fp16's normal range, and a loss
    scale (GradScaler) applied later would rescale what fp16 already rounded away; the deferred
    backward computes them with the incoming gradient folded in, rounding once."""
    return reduction != "none" and dtype != torch.float16


@custom_op("fused_linear_cross_entropy_forward")
def fused_linear_cross_entropy_forward(
    hidden: Tensor, weight: Tensor, target: Tensor, bias: Tensor | None, ce_weight: Tensor | None,
    ignore_index: int, label_smoothing: float, lse_square_scale: float, softcap: float, token_scaling: bool,
    reduction: str, accum_fp32: bool, chunk_tokens: int, predictions: bool, grad_hidden: bool,
    grad_weight: bool, grad_bias: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(loss, z_loss, lse, dhidden, dweight, dbias, token_accuracy, predicted)`` for the 2-D
    ``hidden``: the fp32 losses reduced, the fp32 per-token log-sum-exp and, where
    :func:`grads_in_forward`, the gradients asked for (``grad_*``) for a unit incoming gradient
    (empty tensors otherwise); with ``predictions`` the argmax per token (int64, -1 where ignored) and the
    token accuracy reduced like the loss. ``chunk_tokens`` 0: planned from the free memory."""
    tokens = hidden.shape[0]
    in_forward = grads_in_forward(reduction, hidden.dtype)
    needs = (grad_hidden and in_forward, grad_weight and in_forward, grad_bias and in_forward)
    write_grad = any(needs)
    dx, dw, db = _grad_buffers(hidden, weight, bias, needs, accum_fp32) if write_grad else (None,) * 3
    ce_rows, z_rows, lse = (torch.empty(tokens, dtype=torch.float32, device=hidden.device) for _ in range(3))
    predicted = torch.empty(tokens if predictions else 0, dtype=torch.int64, device=hidden.device)
    stats = target_stats(target, ignore_index, ce_weight, reduction)
    if tokens:
        mean = write_grad and reduction == "mean"
        scale, z_scale = (stats[SCALE], stats[Z_SCALE]) if mean else (None, None)
        options = _options(ignore_index, label_smoothing, lse_square_scale, softcap, ce_weight,
                           stats[WEIGHT_TOTAL] if ce_weight is not None else None, token_scaling)
        chunks = _plan_for(hidden, weight.shape[0], dw, chunk_tokens)
        _chunk_loop(hidden, weight, bias, target, chunks, options, compute_lse=True, lse=lse,
                    write_grad=write_grad, loss=ce_rows, z=z_rows,
                    predicted=predicted if predictions else None, scale=scale, z_scale=z_scale,
                    dx=dx, dw=dw, db=db)
    loss, z_loss, accuracy = reduce_losses(ce_rows, z_rows, stats, reduction,
                                           weighted=ce_weight is not None,
                                           predicted=predicted if predictions else None, target=target,
                                           ignore_index=ignore_index)
    if accuracy is None:
        accuracy = hidden.new_empty(0, dtype=torch.float32)
    return (loss, z_loss, lse) + _as_outputs(hidden, weight, bias, dx, dw, db) + (accuracy, predicted)


def _fake_gradients(hidden, weight, bias, needs):
    need_dx, need_dw, need_db = needs
    return (hidden.new_empty(hidden.shape) if need_dx else hidden.new_empty(0),
            weight.new_empty(weight.shape) if need_dw else hidden.new_empty(0),
            bias.new_empty(bias.shape) if need_db else hidden.new_empty(0))


@fused_linear_cross_entropy_forward.register_fake
def _(hidden, weight, target, bias, ce_weight, ignore_index, label_smoothing, lse_square_scale, softcap,
      token_scaling, reduction, accum_fp32, chunk_tokens, predictions, grad_hidden, grad_weight, grad_bias):
    tokens = hidden.shape[0]
    in_forward = grads_in_forward(reduction, hidden.dtype)
    loss_shape = () if reduction != "none" else (tokens,)
    shapes = (loss_shape, loss_shape, (tokens,))
    losses = tuple(hidden.new_empty(shape, dtype=torch.float32) for shape in shapes)
    needs = (grad_hidden and in_forward, grad_weight and in_forward, grad_bias and in_forward)
    return (losses + _fake_gradients(hidden, weight, bias, needs)
            + fake_predictions(hidden, tokens, reduction, predictions))


@custom_op("fused_linear_cross_entropy_backward")
def fused_linear_cross_entropy_backward(
    grad_loss: Tensor, hidden: Tensor, weight: Tensor, target: Tensor, bias: Tensor | None, lse: Tensor,
    ce_weight: Tensor | None, ignore_index: int, label_smoothing: float, lse_square_scale: float,
    softcap: float, token_scaling: bool, reduction: str, accum_fp32: bool, chunk_tokens: int,
    grad_hidden: bool, grad_weight: bool, grad_bias: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """The deferred backward (where not :func:`grads_in_forward`): recompute each chunk's logits and
    write their gradient scaled by the incoming gradient (per token for ``reduction="none"``; for a
    scalar loss, times the reduction's factor, on the device); ``(dhidden, dweight, dbias)``, empty
    where not asked for."""
    needs = (grad_hidden, grad_weight, grad_bias)
    dx, dw, db = _grad_buffers(hidden, weight, bias, needs, accum_fp32)
    if hidden.shape[0]:
        if reduction == "none":
            scale = z_scale = grad_loss.reshape(-1).to(torch.float32)
            stats = target_stats(target, ignore_index, ce_weight, "none") if ce_weight is not None else None
        else:
            stats = target_stats(target, ignore_index, ce_weight, reduction, grad_loss.to(torch.float32))
            scale, z_scale = stats[SCALE], stats[Z_SCALE]
        options = _options(ignore_index, label_smoothing, lse_square_scale, softcap, ce_weight,
                           stats[WEIGHT_TOTAL] if ce_weight is not None else None, token_scaling)
        chunks = _plan_for(hidden, weight.shape[0], dw, chunk_tokens)
        _chunk_loop(hidden, weight, bias, target, chunks, options, compute_lse=False, lse=lse,
                    write_grad=True, scale=scale, z_scale=z_scale, dx=dx, dw=dw, db=db)
    return _as_outputs(hidden, weight, bias, dx, dw, db)


@fused_linear_cross_entropy_backward.register_fake
def _(grad_loss, hidden, weight, target, bias, lse, ce_weight, ignore_index, label_smoothing,
      lse_square_scale, softcap, token_scaling, reduction, accum_fp32, chunk_tokens, grad_hidden, grad_weight,
      grad_bias):
    return _fake_gradients(hidden, weight, bias, (grad_hidden, grad_weight, grad_bias))


def _options(ignore_index, label_smoothing, lse_square_scale, softcap, ce_weight, weight_total,
             token_scaling) -> dict:
    """The cross-entropy kernel's options, the same for every chunk."""
    return {"ignore_index": ignore_index, "label_smoothing": label_smoothing,
            "lse_square_scale": lse_square_scale, "softcap": softcap, "weight": ce_weight,
            "weight_total": weight_total, "token_scaling": token_scaling}


# ---------------------------------------------------------------------------------------- autograd


def _setup_context(ctx, inputs, output):
    hidden, weight, target, bias, ce_weight, *options = inputs
    ignore_index, label_smoothing, lse_square_scale, softcap, token_scaling, reduction = options[:6]
    accum_fp32, chunk_tokens = options[6:8]
    ctx.needs = tuple(options[9:])
    loss, z_loss, lse, dx, dw, db, accuracy, predicted = output
    ctx.mark_non_differentiable(z_loss, lse, dx, dw, db, accuracy, predicted)
    ctx.deferred = not grads_in_forward(reduction, hidden.dtype)
    # Eager: the forward-pass gradients are rescaled in place; traced: into new tensors.
    ctx.eager = not tracing(hidden, loss)
    if ctx.deferred:
        ctx.options = (ignore_index, label_smoothing, lse_square_scale, softcap, token_scaling, reduction,
                       accum_fp32, chunk_tokens)
        ctx.save_for_backward(hidden, weight, target, bias, lse, ce_weight)
    elif ctx.eager:
        needed = [t if need else None for t, need in zip((dx, dw, db), ctx.needs)]
        ctx.grads = ForwardGradients(needed)
    else:
        ctx.save_for_backward(dx, dw, db)


def _backward(ctx, grad_loss, *_):
    if ctx.deferred:
        hidden, weight, target, bias, lse, ce_weight = ctx.saved_tensors
        grads = fused_linear_cross_entropy_backward(grad_loss, hidden, weight, target, bias, lse, ce_weight,
                                                    *ctx.options, *ctx.needs)
    elif ctx.eager:
        grads = ctx.grads.take(grad_loss)
    else:
        grads = [scale_forward_gradient(t, grad_loss, None) if need else None
                 for t, need in zip(ctx.saved_tensors, ctx.needs)]
    dx, dw, db = (g if need else None for g, need in zip(grads, ctx.needs))
    return (dx, dw, None, db) + (None,) * 13


register_autograd(fused_linear_cross_entropy_forward, _backward, setup_context=_setup_context)


# ------------------------------------------------------------------------------------------ public


def _validate(hidden, weight, target, bias, accum_dtype, chunk_tokens) -> tuple[Tensor, Tensor]:
    check_float(hidden, "hidden")
    check_float(weight, "weight")
    if hidden.dim() < 2:
        raise ValueError(f"hidden must be (tokens, hidden) or (..., hidden), got shape {tuple(hidden.shape)}")
    h = hidden.shape[-1]
    if weight.dim() != 2 or weight.shape[1] != h or weight.shape[0] == 0 or h == 0:
        raise ValueError(f"weight must be (vocab, hidden) = (V, {h}) with V, hidden >= 1, "
                         f"got shape {tuple(weight.shape)}")
    if weight.dtype != hidden.dtype:
        raise TypeError(
            f"weight must have hidden's dtype {hidden.dtype}, got {weight.dtype} "
            "(under torch.autocast the functional API casts both for you)"
        )
    check_same_device(weight, "weight", hidden, "hidden")
    if bias is not None:
        check_tensor(bias, "bias")
        if bias.dtype != hidden.dtype:
            raise TypeError(f"bias must have hidden's dtype {hidden.dtype}, got {bias.dtype}")
        if tuple(bias.shape) != (weight.shape[0],):
            raise ValueError(
                f"bias must have shape ({weight.shape[0]},) (the vocab), got {tuple(bias.shape)}")
        check_same_device(bias, "bias", hidden, "hidden")
    target1d = check_target(target, "target", hidden.shape[:-1], "the hidden states' shape without hidden")
    check_same_device(target, "target", hidden, "hidden")
    if accum_dtype is not None and accum_dtype not in (torch.float32, weight.dtype):
        raise ValueError(
            f"accum_dtype must be None, torch.float32 or the weight's dtype, got {accum_dtype!r}")
    if chunk_tokens is not None and (isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int)
                                     or chunk_tokens < 1):
        raise ValueError(f"chunk_tokens must be None or a positive int, got {chunk_tokens!r}")
    return as_rows(hidden), target1d


def _fused_linear_cross_entropy(hidden, weight, target, bias, ignore_index, label_smoothing, reduction,
                                lse_square_scale, softcap, return_z_loss, accum_dtype, chunk_tokens, *,
                                ce_weight, use_token_scaling, return_token_accuracy, return_predicted_tokens):
    h2d, target1d = _validate(hidden, weight, target, bias, accum_dtype, chunk_tokens)
    ce_weight = check_class_weight(ce_weight, "ce_weight", weight.shape[0], hidden, "hidden")
    # One GEMM of a few tokens' logits: accum_dtype and chunk_tokens have nothing to act on.
    returns = (return_z_loss, return_token_accuracy, return_predicted_tokens, use_token_scaling)
    if (torch_computes(lse_square_scale, softcap, label_smoothing, ce_weight, *returns)
            and small_calls.small(h2d.shape[0] * weight.shape[0], hidden, weight, target)):
        # 2-D hidden states and 1-D targets as they are: a view is one more autograd node, each way.
        needs_rows = hidden.dim() > 2
        logits = torch.nn.functional.linear(h2d if needs_rows else hidden, weight, bias)
        loss = torch_cross_entropy(logits, target1d if needs_rows else target, ce_weight, ignore_index,
                                   label_smoothing, reduction)
        return loss.view(target.shape) if needs_rows and reduction == "none" else loss
    grad_enabled = torch.is_grad_enabled()
    loss, z_loss, _, _, _, _, accuracy, predicted = fused_linear_cross_entropy_forward(
        h2d, weight, target1d, bias, ce_weight, ignore_index, float(label_smoothing), float(lse_square_scale),
        float(softcap) if softcap is not None else 0.0, use_token_scaling, reduction,
        accum_dtype == torch.float32, chunk_tokens or 0, return_token_accuracy or return_predicted_tokens,
        grad_enabled and hidden.requires_grad, grad_enabled and weight.requires_grad,
        grad_enabled and bias is not None and bias.requires_grad,
    )
    return loss_outputs(target.shape, reduction, loss, z_loss, accuracy, predicted,
                        return_z_loss=return_z_loss, return_token_accuracy=return_token_accuracy,
                        return_predicted_tokens=return_predicted_tokens)


def fused_linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    target: Tensor,
    bias: Tensor | None = None,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
    lse_square_scale: float = 0.0,
    softcap: float | None = None,
    return_z_loss: bool = False,
    accum_dtype: torch.dtype | None = None,
    chunk_tokens: int | None = None,
    *,
    ce_weight: Tensor | None = None,
    use_token_scaling: bool = False,
    return_token_accuracy: bool = False,
    return_predicted_tokens: bool = False,
):
    """``cross_entropy(hidden @ weight.T + bias, target)`` without materialising the logits.

    ``hidden`` ``(..., H)`` (e.g. a causal LM's final hidden states ``(B, S, H)``), ``weight``
    ``(V, H)`` (the LM head, possibly tied to the embedding), ``target`` ``(...)`` class indices.
    The options are :func:`onca.ops.cross_entropy.cross_entropy`'s, the per-class weights being
    ``ce_weight`` ``(V,)`` (liger-kernel's name: ``weight`` is the head), and the token accuracy and
    predicted tokens come from the same pass over each chunk's logits; ``accum_dtype=torch.float32``
    accumulates the weight gradient in fp32 for bf16/fp16 weights; ``chunk_tokens`` overrides the
    planned tokens per chunk. ``use_token_scaling=True`` multiplies each token's loss (z-loss
    included) by its predicted probability of the target, ``softmax(logits)[target]``, taken as a
    constant (no gradient through it), as liger-kernel; a mean still divides by the count (or the
    summed class weights). Under ``torch.autocast`` the head's inputs are cast to the autocast
    dtype first, as ``F.linear`` would (``ce_weight`` is not). The loss is fp32. With
    ``reduction="sum"`` divide by ``num_items_in_batch`` yourself (Hugging Face's gradient
    accumulation); ``reduction="none"`` returns per-token losses (its backward recomputes the
    logits chunk by chunk). A DTensor ``weight`` sharded by rows (``Shard(0)``: a tensor-parallel,
    vocabulary-sharded head; ``bias`` sharded likewise) is computed by
    :func:`onca.ops.vocab_parallel_cross_entropy.vocab_parallel_fused_linear_cross_entropy` (no
    logits gathered; ``hidden`` and ``target`` the same on every rank), a replicated one on its
    local tensor. See the module docstring.
    """
    validate_options(ignore_index, label_smoothing, reduction, lse_square_scale, softcap)
    check_bool(return_z_loss, "return_z_loss")
    check_bool(use_token_scaling, "use_token_scaling")
    check_bool(return_token_accuracy, "return_token_accuracy")
    check_bool(return_predicted_tokens, "return_predicted_tokens")
    check_tensor(hidden, "hidden")
    args = (ignore_index, label_smoothing, reduction, lse_square_scale, softcap, return_z_loss, accum_dtype,
            chunk_tokens)
    extras = {"ce_weight": ce_weight, "use_token_scaling": use_token_scaling,
              "return_token_accuracy": return_token_accuracy,
              "return_predicted_tokens": return_predicted_tokens}
    if type(weight) not in (Tensor, torch.nn.Parameter):  # a DTensor head
        sharded = _sharded_head(hidden, weight, target, bias, *args, extras)
        if sharded is not None:
            return sharded
    device_type = hidden.device.type
    # A device type without autocast (``meta``, as in ``onca audit``) has nothing to cast.
    if not autocast_enabled(device_type):
        return _fused_linear_cross_entropy(hidden, weight, target, bias, *args, **extras)
    dtype = torch.get_autocast_dtype(device_type)
    cast = lambda t: t.to(dtype) if isinstance(t, Tensor) and t.is_floating_point() else t  # noqa: E731
    with torch.autocast(device_type, enabled=False):
        return _fused_linear_cross_entropy(cast(hidden), cast(weight), target, cast(bias), *args, **extras)


def _sharded_head(hidden, weight, target, bias, ignore_index, label_smoothing, reduction, lse_square_scale,
                  softcap, return_z_loss, accum_dtype, chunk_tokens, extras):
    """A DTensor head: rows sharded over a mesh dimension (``Shard(0)``, tensor parallelism) go to
    :func:`onca.ops.vocab_parallel_cross_entropy.vocab_parallel_fused_linear_cross_entropy`; a
    replicated one is taken as its local tensor. None: not a DTensor head."""
    from onca.ops.vocab_parallel_cross_entropy import _is_dtensor, shard_of, vocab_parallel_fused_linear_cross_entropy

    if not _is_dtensor(weight):
        return None
    if shard_of(weight, 0, "weight") is None:
        local = lambda t: t.to_local() if _is_dtensor(t) else t  # noqa: E731
        return fused_linear_cross_entropy(local(hidden), local(weight), local(target), local(bias), ignore_index,
                                          label_smoothing, reduction, lse_square_scale, softcap, return_z_loss,
                                          accum_dtype, chunk_tokens, **extras)
    unsupported = {"label_smoothing": label_smoothing != 0.0, "softcap": softcap is not None,
                   "ce_weight": extras["ce_weight"] is not None, "use_token_scaling": extras["use_token_scaling"],
                   "return_token_accuracy": extras["return_token_accuracy"],
                   "return_predicted_tokens": extras["return_predicted_tokens"], "reduction": reduction == "none"}
    for name, used in unsupported.items():
        if used:
            raise ValueError(f"{name} is not supported with a vocabulary-sharded head (weight is a DTensor with "
                             f"placements {tuple(weight.placements)})")
    return vocab_parallel_fused_linear_cross_entropy(
        hidden, weight, target, bias, ignore_index=ignore_index, reduction=reduction,
        lse_square_scale=lse_square_scale, return_z_loss=return_z_loss, accum_dtype=accum_dtype,
        chunk_tokens=chunk_tokens)
