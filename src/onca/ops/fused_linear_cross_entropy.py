"""Fused linear cross entropy: ``cross_entropy(hidden @ weight.T + bias, target)`` without the logits.

A causal LM's head and loss hold the largest tensors of a training step: for 8192 tokens and a
128256-token vocabulary the fp32 logits alone are 4 GiB. Here the full ``(tokens, vocab)`` logits
never exist. The tokens are processed in chunks; for each chunk

1. its logits are computed by one matmul (cuBLAS: the op is matmul-bound) into a scratch buffer
   ``(chunk, vocab)`` in the input dtype, reused by every chunk;
2. the cross-entropy kernel of ``onca.ops.cross_entropy`` reads them, writes the loss and the
   per-token log-sum-exp, and overwrites them with their gradient (already divided by the
   number of non-ignored tokens for a mean);
3. ``dHidden[chunk] = dLogits @ W`` and ``dW += dLogits.T @ hidden[chunk]`` (and
   ``dB += dLogits.sum(0)``, in fp32) by matmuls,

all in the forward pass, so the backward pass only scales the stored gradients by the incoming
gradient (skipped when it is exactly 1). Tokens whose target is ``ignore_index`` are dropped
before the matmuls (gathered per chunk, never copied whole): a half-masked SFT batch costs half
the matmuls; their hidden-state gradient is zero.

``reduction="none"``: the per-token incoming gradient must weight each token's logits gradient
before it is summed into ``dW``, and it is unknown in the forward pass. The forward pass then
computes the loss alone (one matmul per chunk, no gradient) and saves the hidden states, the
head, the targets and one fp32 log-sum-exp per token; the backward pass recomputes each chunk's
logits and writes their scaled gradient in one pass (4 matmuls in all instead of 3).

Chunk size: the scratch holds ``chunk * vocab`` elements. Larger chunks make the weight-gradient
update ``dW += ...`` cheaper (it reads and writes all of ``dW`` once per chunk, so with few tokens
per chunk it is bound by memory, not by the matmul), smaller ones use less memory. The default
aims at ``CHUNK_TOKENS`` tokens per chunk (twice that when ``dW`` accumulates in fp32) and never
takes more than ``FREE_FRACTION`` of the device's free memory, nor more tokens than there are;
``chunk_tokens=`` overrides it. For a Llama-3 head (vocab 128256) in bf16 the default scratch is
131 MB, next to the 1.05 GB of ``dW`` itself. liger-kernel 0.8.5 sizes its chunk from the token
count instead (about ``tokens * hidden`` scratch elements: 256 tokens of 8192 at hidden 4096), so
its scratch is half of ours at 8192 tokens (63 MiB less peak), equal at 16384 and larger beyond;
the benchmark's ``chunk_tokens`` sweep shows what the chunk size costs in time and memory.

``dW`` accumulates in the weight's dtype (one rounding per chunk, as liger-kernel) unless
``accum_dtype=torch.float32`` (then in an fp32 buffer, cast once at the end). The loss is fp32,
as Hugging Face's loss on upcast logits. A weight tied to the input embedding needs nothing
special: its gradient from this op reaches the shared parameter through autograd and adds to the
embedding's. Saved for backward: the three gradients (or, for ``reduction="none"``, the inputs
and the per-token log-sum-exp).
"""

from __future__ import annotations


import torch

from onca.device import DeviceProfile, accelerator, free_memory
from onca.ops._matmul import has_fp32_out_dtype
from onca.ops._validate import check_float, check_nonempty, check_same_device, check_tensor
from onca.ops.cross_entropy import (
    TILES as CE_TILES,
    ForwardGradients,
    check_target,
    count_targets,
    cross_entropy_rows,
    reduce_rows,
    validate_options,
)
from onca.tiling import ChunkPlan, plan_rows, plan_token_chunks

__all__ = ["fused_linear_cross_entropy", "FusedLinearCrossEntropyFunction", "plan", "chunk_plan",
           "CHUNK_TOKENS", "FREE_FRACTION"]

# Tokens per chunk the default plan aims at: with a bf16 dW, the per-chunk update reads and writes
# 4 bytes per element of dW for 2 * chunk flops, so about 512 tokens make it compute-bound on an
# H100/H200 (fp32 accumulation moves twice the bytes: twice the tokens).
CHUNK_TOKENS = 512
# The scratch never takes more than this share of the device memory free when the op starts.
FREE_FRACTION = 0.25


# ------------------------------------------------------------------------------------------ plans


def chunk_plan(tokens: int, hidden: int, vocab: int, dtype: torch.dtype, *, accum_bytes: int | None = None,
               gathered: bool = False, free_bytes: int | None = None, chunk_tokens: int | None = None,
               device=None) -> ChunkPlan:
    """How ``tokens`` (non-ignored) tokens are split into chunks.

    Scratch per token: one row of logits (overwritten by its gradient) in ``dtype``, plus, when the
    tokens are ``gathered`` (some targets ignored), its gathered hidden state and its ``dHidden``.
    """
    itemsize = torch.empty((), dtype=dtype).element_size()
    bytes_per_token = vocab * itemsize + (2 * hidden * itemsize if gathered else 0)
    if chunk_tokens is not None:
        return plan_token_chunks(tokens, bytes_per_token, int(chunk_tokens) * bytes_per_token, multiple=1)
    accum_bytes = accum_bytes or itemsize
    target = CHUNK_TOKENS * max(1, accum_bytes // 2)
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


def _accumulate_dw(dw: torch.Tensor, dlogits: torch.Tensor, h: torch.Tensor, first: bool) -> None:
    """``dw (+)= dlogits.T @ h``: overwrite on the first chunk, accumulate after."""
    if dw.dtype == dlogits.dtype:
        if first:
            torch.mm(dlogits.t(), h, out=dw)
        else:
            dw.addmm_(dlogits.t(), h)
    elif has_fp32_out_dtype(dw.device.type, dlogits.dtype):
        torch.addmm(dw, dlogits.t(), h, out_dtype=dw.dtype, out=dw)
    else:
        # fp32 accumulation of low-precision operands without out_dtype: slices of the vocabulary,
        # each product no larger than the chunk's logits.
        vocab, hidden = dw.shape
        step = max(1, dlogits.numel() * dlogits.element_size() // (hidden * (dlogits.element_size() + 4)))
        for v0 in range(0, vocab, step):
            dw[v0:v0 + step].add_(torch.mm(dlogits[:, v0:v0 + step].t(), h))


def _chunk_loop(h2d, weight, bias, target, rows, chunks: ChunkPlan, options: dict, *, compute_lse: bool,
                loss, lse, write_grad: bool, grad_scale: float = 1.0, scale=None, dx=None, dw=None,
                db=None) -> None:
    """Run the chunks: logits by matmul, the cross-entropy kernel, then the gradient matmuls.

    ``rows`` are the indices of the non-ignored tokens (``None``: all of them); ``loss``, ``lse``
    and ``scale`` are indexed like ``rows`` (compacted).
    """
    vocab = weight.shape[0]
    scratch = torch.empty((chunks.chunk, vocab), dtype=h2d.dtype, device=h2d.device)
    for index in range(chunks.n_chunks):
        start, end = chunks.bounds(index)
        if rows is None:
            h, t = h2d[start:end], target[start:end]
        else:
            r = rows[start:end]
            h, t = h2d.index_select(0, r), target.index_select(0, r)
        logits = scratch[: end - start]
        if bias is None:
            torch.mm(h, weight.t(), out=logits)
        else:
            torch.addmm(bias, h, weight.t(), out=logits)
        cross_entropy_rows(
            logits, t, **options, compute_lse=compute_lse,
            loss=loss[start:end] if compute_lse else None, lse=lse[start:end],
            grad=logits if write_grad else None, grad_scale=grad_scale,
            scale=scale[start:end] if scale is not None else None,
        )
        if not write_grad:
            continue
        # From here ``logits`` holds dLoss/dLogits for the chunk.
        if dx is not None:
            if rows is None:
                torch.mm(logits, weight, out=dx[start:end])
            else:
                dx.index_copy_(0, r, torch.mm(logits, weight))
        if dw is not None:
            _accumulate_dw(dw, logits, h, first=index == 0)
        if db is not None:
            db += logits.sum(dim=0, dtype=torch.float32)


def _grad_buffers(h2d, weight, bias, needs, accum_dtype, n_valid):
    need_dx, need_dw, need_db = needs
    t, hidden = h2d.shape
    device = h2d.device
    dx = dw = db = None
    if need_dx:
        # Ignored tokens' rows are never written: zero them unless every token counts.
        alloc = torch.empty if n_valid == t else torch.zeros
        dx = alloc((t, hidden), dtype=h2d.dtype, device=device)
    if need_dw:
        dtype = accum_dtype or weight.dtype
        # The first chunk overwrites a same-dtype dW; other paths (and no chunks at all) add to it.
        alloc = torch.empty if dtype == h2d.dtype and n_valid > 0 else torch.zeros
        dw = alloc(weight.shape, dtype=dtype, device=device)
    if need_db:
        db = torch.zeros(bias.shape, dtype=torch.float32, device=device)
    return dx, dw, db


# ---------------------------------------------------------------------------------------- autograd


class FusedLinearCrossEntropyFunction(torch.autograd.Function):
    """Autograd wrapper. Saved for backward: ``dHidden``, ``dW`` and ``dB`` computed in the forward pass
    (``reduction="none"``: the 2-D hidden states, the head, the bias, the targets, the indices of
    the non-ignored tokens and their fp32 log-sum-exp; see the module docstring)."""

    @staticmethod
    def forward(ctx, hidden, weight, target, bias, ignore_index, label_smoothing, reduction,
                lse_square_scale, softcap, return_z_loss, accum_dtype, chunk_tokens, grad_enabled=True):
        validate_options(ignore_index, label_smoothing, reduction, lse_square_scale, softcap)
        h2d, target1d = _validate(hidden, weight, target, bias, accum_dtype, chunk_tokens)
        tokens = h2d.shape[0]
        vocab = weight.shape[0]
        n_valid = count_targets(target1d, vocab, ignore_index)
        rows = None if n_valid == tokens else (target1d != ignore_index).nonzero().squeeze(1)
        # needs_input_grad does not see torch.no_grad(): the caller tells whether grad mode was on.
        needs = tuple(bool(grad_enabled and n) for n in (
            ctx.needs_input_grad[0], ctx.needs_input_grad[1], bias is not None and ctx.needs_input_grad[3]))
        deferred = reduction == "none" and any(needs)
        write_grad = any(needs) and not deferred
        options = dict(ignore_index=ignore_index, label_smoothing=label_smoothing,
                       lse_square_scale=lse_square_scale, softcap=softcap)

        dx, dw, db = _grad_buffers(h2d, weight, bias, needs, accum_dtype, n_valid) if write_grad else (None,) * 3
        loss_valid = torch.zeros(n_valid, dtype=torch.float32, device=h2d.device)
        lse_valid = torch.zeros(n_valid, dtype=torch.float32, device=h2d.device)
        if n_valid:
            chunks = _plan_for(h2d, n_valid, vocab, rows is not None, dw, chunk_tokens)
            _chunk_loop(h2d, weight, bias, target1d, rows, chunks, options, compute_lse=True,
                        loss=loss_valid, lse=lse_valid, write_grad=write_grad,
                        grad_scale=1.0 / n_valid if reduction == "mean" else 1.0, dx=dx, dw=dw, db=db)

        ctx.set_materialize_grads(False)
        ctx.deferred, ctx.reduction, ctx.needs = deferred, reduction, needs
        ctx.hidden_shape, ctx.tokens = hidden.shape, tokens
        if deferred:
            ctx.options, ctx.chunk_tokens, ctx.accum_dtype, ctx.n_valid = options, chunk_tokens, accum_dtype, n_valid
            ctx.has_bias, ctx.has_rows = bias is not None, rows is not None
            saved = [h2d, weight, target1d, lse_valid]
            saved += [bias] if bias is not None else []
            saved += [rows] if rows is not None else []
            ctx.save_for_backward(*saved)
        elif write_grad:
            # Held as attributes, not saved tensors: backward scales them in place.
            if dw is not None and dw.dtype != weight.dtype:
                dw = dw.to(weight.dtype)
            if db is not None:
                db = db.to(bias.dtype)
            ctx.grads = ForwardGradients([dx, dw, db])

        shape = target.shape
        loss = _expand(loss_valid, reduction, n_valid, rows, tokens, shape)
        if not return_z_loss:
            return loss
        z = _expand(lse_square_scale * lse_valid * lse_valid, reduction, n_valid, rows, tokens, shape)
        ctx.mark_non_differentiable(z)
        return loss, z

    @staticmethod
    def backward(ctx, grad_loss, *_):
        if grad_loss is None or not any(ctx.needs):
            return (None,) * 13
        if ctx.deferred:
            dx, dw, db = _deferred_backward(ctx, grad_loss)
        else:
            dx, dw, db = ctx.grads.take(grad_loss)
        dx = dx.view(ctx.hidden_shape) if dx is not None else None
        return dx, dw, None, db, None, None, None, None, None, None, None, None, None


def _deferred_backward(ctx, grad_loss):
    """``reduction="none"``: recompute each chunk's logits and write their gradient scaled per token."""
    h2d, weight, target1d, lse_valid, *rest = ctx.saved_tensors
    bias = rest.pop(0) if ctx.has_bias else None
    rows = rest.pop(0) if ctx.has_rows else None
    g = grad_loss.reshape(-1)
    g = (g if rows is None else g.index_select(0, rows)).to(torch.float32)
    dx, dw, db = _grad_buffers(h2d, weight, bias, ctx.needs, ctx.accum_dtype, ctx.n_valid)
    if ctx.n_valid:
        chunks = _plan_for(h2d, ctx.n_valid, weight.shape[0], rows is not None, dw, ctx.chunk_tokens)
        _chunk_loop(h2d, weight, bias, target1d, rows, chunks, ctx.options, compute_lse=False,
                    loss=None, lse=lse_valid, write_grad=True, scale=g, dx=dx, dw=dw, db=db)
    if dw is not None and dw.dtype != weight.dtype:
        dw = dw.to(weight.dtype)
    if db is not None:
        db = db.to(bias.dtype)
    return dx, dw, db


def _plan_for(h2d, n_valid, vocab, gathered, dw, chunk_tokens) -> ChunkPlan:
    accum_bytes = dw.element_size() if dw is not None else None
    return chunk_plan(n_valid, h2d.shape[1], vocab, h2d.dtype, accum_bytes=accum_bytes, gathered=gathered,
                      chunk_tokens=chunk_tokens, device=h2d.device)


def _expand(per_valid, reduction, n_valid, rows, tokens, shape):
    """Per-token values of the non-ignored tokens, reduced, or scattered back to every token."""
    if reduction != "none":
        return reduce_rows(per_valid, reduction, n_valid)
    if rows is None:
        return per_valid.view(shape)
    full = torch.zeros(tokens, dtype=per_valid.dtype, device=per_valid.device)
    full[rows] = per_valid
    return full.view(shape)


def _validate(hidden, weight, target, bias, accum_dtype, chunk_tokens):
    check_float(hidden, "hidden")
    check_float(weight, "weight")
    if hidden.dim() < 2:
        raise ValueError(f"hidden must be (tokens, hidden) or (..., hidden), got shape {tuple(hidden.shape)}")
    check_nonempty(hidden, "hidden")
    h = hidden.shape[-1]
    if weight.dim() != 2 or weight.shape[1] != h:
        raise ValueError(f"weight must be (vocab, hidden) = (V, {h}), got shape {tuple(weight.shape)}")
    check_nonempty(weight, "weight")
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
            raise ValueError(f"bias must have shape ({weight.shape[0]},) (the vocab), got {tuple(bias.shape)}")
        check_same_device(bias, "bias", hidden, "hidden")
    target1d = check_target(target, "target", hidden.shape[:-1], "the hidden states' shape without hidden")
    check_same_device(target, "target", hidden, "hidden")
    if accum_dtype is not None and accum_dtype not in (torch.float32, weight.dtype):
        raise ValueError(f"accum_dtype must be None, torch.float32 or the weight's dtype, got {accum_dtype!r}")
    if chunk_tokens is not None and (isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int)
                                     or chunk_tokens < 1):
        raise ValueError(f"chunk_tokens must be None or a positive int, got {chunk_tokens!r}")
    h2d = hidden if hidden.stride(-1) == 1 else hidden.contiguous()
    h2d = h2d.reshape(-1, h)
    return h2d, target1d


def fused_linear_cross_entropy(hidden, weight, target, bias=None, ignore_index=-100, label_smoothing=0.0,
                               reduction="mean", lse_square_scale=0.0, softcap=None, return_z_loss=False,
                               accum_dtype=None, chunk_tokens=None):
    """``cross_entropy(hidden @ weight.T + bias, target)`` without the logits; see the module docstring.

    ``hidden`` is ``(..., H)``, ``weight`` ``(V, H)``, ``bias`` ``(V,)`` or None, ``target`` ``(...)``.
    Under ``torch.autocast`` the three are cast to the autocast dtype first, as ``F.linear`` would.
    Returns the fp32 loss, or ``(loss, z_loss)`` with ``return_z_loss``.
    """
    device_type = hidden.device.type if isinstance(hidden, torch.Tensor) else "cpu"
    if isinstance(hidden, torch.Tensor) and torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        cast = lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t  # noqa: E731
        with torch.autocast(device_type, enabled=False):
            return FusedLinearCrossEntropyFunction.apply(
                cast(hidden), cast(weight), target, cast(bias), ignore_index, label_smoothing, reduction,
                lse_square_scale, softcap, return_z_loss, accum_dtype, chunk_tokens, torch.is_grad_enabled())
    return FusedLinearCrossEntropyFunction.apply(
        hidden, weight, target, bias, ignore_index, label_smoothing, reduction, lse_square_scale,
        softcap, return_z_loss, accum_dtype, chunk_tokens, torch.is_grad_enabled())
