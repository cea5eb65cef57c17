"""Vocabulary-parallel cross entropy: the loss of logits (or of a head) sharded over the vocabulary.

Under tensor parallelism the LM head ``(V, H)`` is split by rows over the ranks of a process group
(a DTensor ``Shard(0)`` weight, Megatron's vocabulary-parallel head): rank ``r`` holds the classes
``[start_r, start_r + V_r)`` and every rank holds the same hidden states and targets. Gathering the
``(tokens, V)`` logits on every rank to take an ordinary cross entropy would undo the sharding;
here each rank only ever has its own ``(tokens, V_r)`` slice. Per token::

    lse_r   = log(sum_{j in shard r} exp(z_j))             (local, Onca's cross-entropy kernel)
    M       = max_r lse_r                                    (all-reduce MAX, one fp32 per token)
    lse     = M + log(sum_r exp(lse_r - M))                  (all-reduce SUM, with the target logit)
    z_y     = the target's logit, read on the rank that holds it, 0 elsewhere   (all-reduce SUM)
    loss    = lse - z_y + lse_square_scale * lse**2

so the ranks exchange three fp32 numbers per token, never logits. The gradient is local::

    dloss/dz_j = softmax(z)_j * (s + s * 2 * lse_square_scale * lse) - s * [j == y]   (j in the shard)

with ``s`` the reduction's scale: each rank writes the gradient of its own slice from the global
``lse`` with the same kernel (a target on another rank's shard simply has no target term here).

Two public functions:

- :func:`vocab_parallel_cross_entropy` takes the local logits ``(..., V_r)`` (or a DTensor sharded
  on its last dimension). Forward reads them once and saves them with the global fp32 ``lse``;
  backward reads them once more and writes their gradient; no communication in backward.
- :func:`vocab_parallel_fused_linear_cross_entropy` takes the hidden states and the local head rows
  ``(V_r, H)`` (or a DTensor ``Shard(0)`` weight; :func:`onca.ops.fused_linear_cross_entropy.
  fused_linear_cross_entropy` routes such a weight here): the chunked fused linear cross entropy of
  ``onca.ops.fused_linear_cross_entropy`` over the local vocabulary, with one exchange per chunk of
  tokens (``3 * chunk`` fp32 numbers) between the kernel's log-sum-exp pass and its gradient pass.
  The gradients are computed in the forward pass: the local head's ``dW_r`` and ``db_r``, and the
  hidden states' gradient, a sum over the shards, all-reduced once at the end (what a
  column-parallel layer's backward does with its replicated input). Saved for backward: the three
  gradients.

The loss is the same on every rank, fp32 for both functions (as cross entropy's).
Both take ``ignore_index``, ``reduction`` (``"mean"``, ``"sum"``; ``"none"`` for the logits
function) and the z-loss ``lse_square_scale``. Label smoothing, class weights and soft-capping are
not offered on sharded logits. A target outside ``[0, V)`` that is not ``ignore_index`` gives NaN.
The collectives run on the process group named by the op (``group.group_name``), so the ops are
custom ops like every other and trace under ``torch.compile`` as opaque calls. A one-rank group
holding the whole vocabulary (tensor parallelism of size 1) shards nothing: both functions are then
Onca's cross entropy and fused linear cross entropy, called with the same options (their kernels,
and torch's ops for a small call). A one-rank shard that is not the whole vocabulary runs the
sharded passes with the all-reduces skipped (each would return its input).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import triton
import triton.language as tl
from torch import Tensor

from onca.device import DeviceProfile, get_profile
from onca.ops._contract import PLAIN_TYPES, custom_op, register_autograd, tracing
from onca.ops._launch import fast_launch
from onca.ops._rows import as_rows
from onca.ops._validate import check_bool, check_float, check_number, check_same_device, check_tensor
from onca.ops.cross_entropy import (
    REDUCTIONS,
    TILES as CE_TILES,
    ForwardGradients,
    SCALE,
    check_target,
    checked_cross_entropy,
    cross_entropy_rows,
    reduce_losses,
    scale_forward_gradient,
    target_stats,
)
from onca.ops._matmul import accumulate_dw
from onca.ops.fused_linear_cross_entropy import _grad_buffers, _plan_for, fused_linear_cross_entropy
from onca.tiling import RowPlan, cdiv, plan_rows

__all__ = ["vocab_parallel_cross_entropy", "vocab_parallel_fused_linear_cross_entropy", "plan",
           "shard_of"]


# ------------------------------------------------------------------------------------------ plans


def plan(shape, dtype: torch.dtype, profile: DeviceProfile | None = None) -> dict[str, RowPlan]:
    """The cross-entropy kernel's plan over local logits of ``shape`` (``(tokens, local vocab)``):
    the log-sum-exp pass (forward) and the gradient pass (backward) use the same one."""
    rows = 1
    for s in tuple(shape)[:-1]:
        rows *= int(s)
    p = plan_rows(rows, int(shape[-1]), dtype, profile=profile, **CE_TILES)
    return {"forward": p, "backward": p}


# ----------------------------------------------------------------------------------- the shards


def _group(group_name: str):
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(group_name)


# The per-token bookkeeping around the cross-entropy passes runs in two small Triton kernels (rows
# in blocks of ROW_BLOCK, at most one program per compute unit). Composed of torch ops it took 57
# kernel launches per forward + backward of the logits function: 1.87 ms of host time at 16 tokens
# on an H200's host, 0.86 ms since (2026-11-29; one all-reduce there: 16-28 us).
ROW_BLOCK = 1024

# What _shard_rows_kernel writes for each row's gradient scale (SCALE_MODE).
NO_SCALE, UNIT_SCALE, SHARED_SCALE, ROW_SCALE = range(4)


@triton.jit
def _target_kinds(y, ignore_index, vocab_start, vocab_local, vocab_total):
    """``(valid, bad, in_shard, local)`` of targets ``y``: not ignored; not ignored but outside the
    whole vocabulary (NaN rows); this shard's class; the class's index in this shard."""
    valid = y != ignore_index
    bad = valid & ((y < 0) | (y >= vocab_total))
    local = y - vocab_start
    in_shard = valid & (local >= 0) & (local < vocab_local)
    return valid, bad, in_shard, local


@fast_launch
@triton.jit
def _shard_rows_kernel(
    target_ptr, local_ptr, logits_ptr, z_y_ptr, scale_ptr, row_scale_ptr,
    n_rows, logits_row_stride, scale_stride, vocab_start, vocab_local, vocab_total, ignore_index, outside,
    WRITE_LOCAL: tl.constexpr, WRITE_Z: tl.constexpr, SCALE_MODE: tl.constexpr, BLOCK: tl.constexpr,
):
    """Per row: the target shifted to this shard (``WRITE_LOCAL``; another shard's class becomes
    ``outside``, never the ignore index), the fp32 target logit read from ``logits`` (``WRITE_Z``;
    0 where the class is elsewhere), and the gradient scale (``SCALE_MODE``: 1, the scalar at
    ``scale_ptr`` or ``scale_ptr[row * scale_stride]``, any float dtype; NaN on a row whose target
    is outside the vocabulary)."""
    offsets = tl.arange(0, BLOCK)
    for start in tl.range(tl.program_id(0) * BLOCK, n_rows, tl.num_programs(0) * BLOCK):
        rows = start + offsets
        mask = rows < n_rows
        y = tl.load(target_ptr + rows, mask=mask, other=ignore_index)
        valid, bad, in_shard, local = _target_kinds(y, ignore_index, vocab_start, vocab_local, vocab_total)
        if WRITE_LOCAL:
            shifted = tl.where(in_shard, local, tl.where(valid, outside, ignore_index))
            tl.store(local_ptr + rows, shifted.to(local_ptr.dtype.element_ty), mask=mask)
        if WRITE_Z:
            at = logits_ptr + rows.to(tl.int64) * logits_row_stride + tl.where(in_shard, local, 0)
            z_y = tl.load(at, mask=mask & in_shard, other=0.0).to(tl.float32)
            tl.store(z_y_ptr + rows, z_y, mask=mask)
        if SCALE_MODE != 0:
            if SCALE_MODE == 1:
                s = tl.full([BLOCK], 1.0, tl.float32)
            elif SCALE_MODE == 2:
                s = tl.zeros([BLOCK], dtype=tl.float32) + tl.load(scale_ptr).to(tl.float32)
            else:
                s = tl.load(scale_ptr + rows * scale_stride, mask=mask, other=0.0).to(tl.float32)
            tl.store(row_scale_ptr + rows, tl.where(bad, float("nan"), s), mask=mask)


@fast_launch
@triton.jit
def _global_rows_kernel(
    target_ptr, m_ptr, both_ptr, lse_ptr, ce_ptr, z_ptr,
    n_rows, vocab_total, ignore_index, lse_square_scale,
    BLOCK: tl.constexpr,
):
    """Per row, from the exchanged statistics (``m``: the shards' largest log-sum-exp; ``both``:
    the sums over the shards of ``exp(lse_r - m)`` and of the target logit): the global fp32
    log-sum-exp and the loss's two parts, 0 on ignored rows and NaN where the target is outside the
    vocabulary."""
    offsets = tl.arange(0, BLOCK)
    for start in tl.range(tl.program_id(0) * BLOCK, n_rows, tl.num_programs(0) * BLOCK):
        rows = start + offsets
        mask = rows < n_rows
        y = tl.load(target_ptr + rows, mask=mask, other=ignore_index)
        valid, bad, _, _ = _target_kinds(y, ignore_index, 0, 0, vocab_total)
        m = tl.load(m_ptr + rows, mask=mask, other=0.0)
        sum_exp = tl.load(both_ptr + rows, mask=mask & valid, other=1.0)
        z_y = tl.load(both_ptr + n_rows + rows, mask=mask, other=0.0)
        lse = tl.where(valid, m + tl.log(sum_exp), 0.0)
        tl.store(lse_ptr + rows, lse, mask=mask)
        ce = tl.where(bad, float("nan"), tl.where(valid, lse - z_y, 0.0))
        tl.store(ce_ptr + rows, ce, mask=mask)
        tl.store(z_ptr + rows, tl.where(valid, lse_square_scale * lse * lse, 0.0), mask=mask)


def _row_grid(rows: int) -> tuple[int]:
    return (max(1, min(cdiv(rows, ROW_BLOCK), get_profile().compute_units)),)


def _outside(ignore_index: int, vocab_local: int) -> int:
    """Where another shard's class goes in this shard's targets: outside ``[0, vocab_local)`` (the
    kernel's foreign targets) and never the ignore index."""
    return -1 if ignore_index != -1 else vocab_local


def _shard_rows(target: Tensor, vocab_start: int, vocab_local: int, vocab_total: int, ignore_index: int, *,
                local: bool = True, logits: Tensor | None = None, z_y: Tensor | None = None,
                scale: Tensor | None = None, scale_mode: int = NO_SCALE) -> tuple:
    """``(local targets, row scales)`` of ``target``, each None where not asked for: ``local``;
    ``scale_mode`` (with ``scale`` for ``SHARED_SCALE`` / ``ROW_SCALE``) for the fp32 scales. With
    ``logits`` (the rows' logits on this shard) the fp32 target logits are written into ``z_y``.
    ``target`` is 1-D and contiguous."""
    rows = target.shape[0]
    shifted = torch.empty(rows, dtype=target.dtype, device=target.device) if local else None
    row_scale = torch.empty(rows, dtype=torch.float32, device=target.device) if scale_mode else None
    if rows:
        some = target  # a pointer for the outputs not written
        _shard_rows_kernel[_row_grid(rows)](
            target, some if shifted is None else shifted, some if logits is None else logits,
            some if logits is None else z_y, some if scale is None else scale,
            some if row_scale is None else row_scale,
            rows, 0 if logits is None else logits.stride(0),
            scale.stride(0) if scale_mode == ROW_SCALE else 0, vocab_start, vocab_local, vocab_total,
            ignore_index, _outside(ignore_index, vocab_local),
            WRITE_LOCAL=local, WRITE_Z=logits is not None, SCALE_MODE=scale_mode, BLOCK=ROW_BLOCK,
        )
    return shifted, row_scale


def _statistics(rows: int, device) -> Tensor:
    """The ``(2, rows)`` fp32 buffer the shards exchange: ``exp(lse_r - m)`` and the target logit."""
    return torch.empty((2, rows), dtype=torch.float32, device=device)


def _exchange(lse_local: Tensor, both: Tensor, group) -> Tensor:
    """``m``, the largest local log-sum-exp of every row over the shards, and ``both`` (its second
    row this shard's target logits) summed over them with ``exp(lse_r - m)`` in its first: two
    all-reduces, of ``rows`` and ``2 * rows`` fp32 numbers. A one-rank group's all-reduces would
    return their inputs: skipped (their host path was most of a small call's time)."""
    if group.size() == 1:
        both[0].fill_(1.0)
        return lse_local
    m = lse_local.clone()
    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    torch.sub(lse_local, m, out=both[0]).exp_()
    dist.all_reduce(both, op=dist.ReduceOp.SUM, group=group)
    return m


def _global_rows(target: Tensor, m: Tensor, both: Tensor, vocab_total: int, ignore_index: int,
                 lse_square_scale: float, lse: Tensor, ce: Tensor, z: Tensor) -> None:
    """The global log-sum-exp and the loss's parts per row, into ``lse``, ``ce`` and ``z``."""
    rows = target.shape[0]
    if rows:
        _global_rows_kernel[_row_grid(rows)](target, m, both, lse, ce, z, rows, vocab_total, ignore_index,
                                             lse_square_scale, BLOCK=ROW_BLOCK)


def _local_lse(logits: Tensor, local: Tensor, ignore_index: int, lse: Tensor) -> None:
    """This shard's log-sum-exp of each row into ``lse`` (0 on ignored rows): the kernel's first pass."""
    junk = torch.empty_like(lse)
    cross_entropy_rows(logits, local, ignore_index=ignore_index, label_smoothing=0.0, lse_square_scale=0.0,
                       softcap=0.0, compute_lse=True, lse=lse, loss=junk, z=junk, foreign_targets=True)


# ------------------------------------------------------------------------------ logits (sharded)


@custom_op("vocab_parallel_cross_entropy_forward")
def vocab_parallel_cross_entropy_forward(
    logits: Tensor, target: Tensor, group_name: str, vocab_start: int, vocab_total: int, ignore_index: int,
    lse_square_scale: float, reduction: str,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(loss, z_loss, lse)`` of the local logits ``(rows, V_r)``: the losses reduced (fp32), the
    global fp32 log-sum-exp per row (0 on ignored rows)."""
    rows, vocab_local = logits.shape
    target = target.contiguous()
    both = _statistics(rows, logits.device)
    local, _ = _shard_rows(target, vocab_start, vocab_local, vocab_total, ignore_index, logits=logits,
                           z_y=both[1])
    lse_local = torch.empty(rows, dtype=torch.float32, device=logits.device)
    if rows:
        _local_lse(logits, local, ignore_index, lse_local)
    m = _exchange(lse_local, both, _group(group_name))
    lse, ce_rows, z_rows = (torch.empty_like(lse_local) for _ in range(3))
    _global_rows(target, m, both, vocab_total, ignore_index, lse_square_scale, lse, ce_rows, z_rows)
    stats = target_stats(target, ignore_index, None, reduction)
    loss, z_loss, _ = reduce_losses(ce_rows, z_rows, stats, reduction, weighted=False)
    return loss, z_loss, lse


@vocab_parallel_cross_entropy_forward.register_fake
def _(logits, target, group_name, vocab_start, vocab_total, ignore_index, lse_square_scale, reduction):
    rows = logits.shape[0]
    shape = (rows,) if reduction == "none" else ()
    f32 = dict(dtype=torch.float32)
    return logits.new_empty(shape, **f32), logits.new_empty(shape, **f32), logits.new_empty(rows, **f32)


@custom_op("vocab_parallel_cross_entropy_backward")
def vocab_parallel_cross_entropy_backward(
    grad_loss: Tensor, logits: Tensor, target: Tensor, lse: Tensor, vocab_start: int, vocab_total: int,
    ignore_index: int, lse_square_scale: float, reduction: str,
) -> Tensor:
    """The local logits' gradient from the global ``lse``, scaled by the incoming gradient: local,
    no communication."""
    rows, vocab_local = logits.shape
    grad = torch.empty((rows, vocab_local), dtype=logits.dtype, device=logits.device)
    if rows == 0:
        return grad
    target = target.contiguous()
    if reduction == "none":
        scale, mode = grad_loss.reshape(-1), ROW_SCALE
    else:
        scale, mode = target_stats(target, ignore_index, None, reduction, grad_loss)[SCALE], SHARED_SCALE
    local, row_scale = _shard_rows(target, vocab_start, vocab_local, vocab_total, ignore_index, scale=scale,
                                   scale_mode=mode)
    cross_entropy_rows(logits, local, ignore_index=ignore_index, label_smoothing=0.0,
                       lse_square_scale=lse_square_scale, softcap=0.0, compute_lse=False, lse=lse, grad=grad,
                       scale=row_scale, foreign_targets=True)
    return grad


@vocab_parallel_cross_entropy_backward.register_fake
def _(grad_loss, logits, target, lse, vocab_start, vocab_total, ignore_index, lse_square_scale, reduction):
    return torch.empty_like(logits)


def _ce_setup_context(ctx, inputs, output):
    logits, target, _, vocab_start, vocab_total, ignore_index, lse_square_scale, reduction = inputs
    _, z_loss, lse = output
    ctx.mark_non_differentiable(z_loss, lse)
    ctx.options = (vocab_start, vocab_total, ignore_index, lse_square_scale, reduction)
    ctx.save_for_backward(logits, target, lse)


def _ce_backward(ctx, grad_loss, *_):
    logits, target, lse = ctx.saved_tensors
    grad = vocab_parallel_cross_entropy_backward(grad_loss, logits, target, lse, *ctx.options)
    return (grad,) + (None,) * 7


register_autograd(vocab_parallel_cross_entropy_forward, _ce_backward, setup_context=_ce_setup_context)


# --------------------------------------------------------------------------- head (sharded rows)


@custom_op("vocab_parallel_fused_linear_cross_entropy_forward")
def vocab_parallel_fused_linear_cross_entropy_forward(
    hidden: Tensor, weight: Tensor, target: Tensor, bias: Tensor | None, group_name: str, vocab_start: int,
    vocab_total: int, ignore_index: int, lse_square_scale: float, reduction: str, accum_fp32: bool,
    chunk_tokens: int, grad_hidden: bool, grad_weight: bool, grad_bias: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(loss, z_loss, lse, dhidden, dweight, dbias)`` for the 2-D ``hidden`` and this rank's head
    rows ``weight`` ``(V_r, H)``: fp32 losses reduced over the whole vocabulary, the global fp32
    log-sum-exp per token, and the gradients asked for (``grad_*``, for a unit incoming gradient;
    ``dhidden`` summed over the ranks; empty tensors otherwise)."""
    tokens = hidden.shape[0]
    vocab_local = weight.shape[0]
    group = _group(group_name)
    needs = (grad_hidden, grad_weight, grad_bias)
    dx, dw, db = _grad_buffers(hidden, weight, bias, needs, accum_fp32) if any(needs) else (None,) * 3
    target = target.contiguous()
    stats = target_stats(target, ignore_index, None, reduction)
    local, scale = _shard_rows(target, vocab_start, vocab_local, vocab_total, ignore_index,
                               scale=stats[SCALE] if reduction == "mean" else None,
                               scale_mode=SHARED_SCALE if reduction == "mean" else UNIT_SCALE)
    lse_local, lse, ce_rows, z_rows = (torch.empty(tokens, dtype=torch.float32, device=hidden.device)
                                       for _ in range(4))
    if tokens:
        chunks = _plan_for(hidden, vocab_local, dw, chunk_tokens)
        scratch = torch.empty((chunks.chunk, vocab_local), dtype=hidden.dtype, device=hidden.device)
        for index in range(chunks.n_chunks):
            start, end = chunks.bounds(index)
            h = hidden[start:end]
            logits = scratch[: end - start]
            if bias is None:
                torch.mm(h, weight.t(), out=logits)
            else:
                torch.addmm(bias, h, weight.t(), out=logits)
            # 1. This shard's log-sum-exp and target logit; 2. the global ones (3 numbers a token)
            # and the loss's parts.
            rows = slice(start, end)
            _local_lse(logits, local[rows], ignore_index, lse_local[rows])
            both = _statistics(end - start, hidden.device)
            _shard_rows(target[rows], vocab_start, vocab_local, vocab_total, ignore_index, local=False,
                        logits=logits, z_y=both[1])
            m = _exchange(lse_local[rows], both, group)
            _global_rows(target[rows], m, both, vocab_total, ignore_index, lse_square_scale, lse[rows],
                         ce_rows[rows], z_rows[rows])
            if not any(needs):
                continue
            # 3. The local slice's gradient from the global log-sum-exp, over the logits.
            cross_entropy_rows(logits, local[start:end], ignore_index=ignore_index, label_smoothing=0.0,
                               lse_square_scale=lse_square_scale, softcap=0.0, compute_lse=False,
                               lse=lse[start:end], grad=logits, scale=scale[start:end], foreign_targets=True)
            if dx is not None:
                torch.mm(logits, weight, out=dx[start:end])
            if dw is not None:
                accumulate_dw(dw, logits, h, first=index == 0)
            if db is not None:
                db += logits.sum(dim=0, dtype=torch.float32)
    else:
        # Every rank takes part in the same collectives, even with no tokens.
        _exchange(lse_local, _statistics(0, hidden.device), group)
    if dx is not None and group.size() > 1:
        dist.all_reduce(dx, op=dist.ReduceOp.SUM, group=group)  # dhidden sums over the shards
    loss, z_loss, _ = reduce_losses(ce_rows, z_rows, stats, reduction, weighted=False)
    empty = hidden.new_empty(0)
    return (loss, z_loss, lse, dx if dx is not None else empty,
            dw.to(weight.dtype) if dw is not None else empty,
            db.to(bias.dtype) if db is not None else empty)


@vocab_parallel_fused_linear_cross_entropy_forward.register_fake
def _(hidden, weight, target, bias, group_name, vocab_start, vocab_total, ignore_index, lse_square_scale,
      reduction, accum_fp32, chunk_tokens, grad_hidden, grad_weight, grad_bias):
    tokens = hidden.shape[0]
    loss, z_loss = hidden.new_empty((), dtype=torch.float32), hidden.new_empty((), dtype=torch.float32)
    lse = hidden.new_empty(tokens, dtype=torch.float32)
    return (loss, z_loss, lse,
            hidden.new_empty(hidden.shape) if grad_hidden else hidden.new_empty(0),
            weight.new_empty(weight.shape) if grad_weight else hidden.new_empty(0),
            bias.new_empty(bias.shape) if grad_bias else hidden.new_empty(0))


def _flce_setup_context(ctx, inputs, output):
    hidden = inputs[0]
    ctx.needs = tuple(inputs[-3:])
    loss, z_loss, lse, dx, dw, db = output
    ctx.mark_non_differentiable(z_loss, lse, dx, dw, db)
    ctx.eager = not tracing(hidden, loss)
    if ctx.eager:
        ctx.grads = ForwardGradients([t if need else None for t, need in zip((dx, dw, db), ctx.needs)])
    else:
        ctx.save_for_backward(dx, dw, db)


def _flce_backward(ctx, grad_loss, *_):
    if ctx.eager:
        grads = ctx.grads.take(grad_loss)
    else:
        grads = [scale_forward_gradient(t, grad_loss, None) if need else None
                 for t, need in zip(ctx.saved_tensors, ctx.needs)]
    dx, dw, db = (g if need else None for g, need in zip(grads, ctx.needs))
    return (dx, dw, None, db) + (None,) * 11


register_autograd(vocab_parallel_fused_linear_cross_entropy_forward, _flce_backward,
                  setup_context=_flce_setup_context)


# ------------------------------------------------------------------------------------------ public


def _is_dtensor(t) -> bool:
    if type(t) in PLAIN_TYPES:  # first: no import on a plain tensor's call
        return False
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without DTensor
        return False
    return isinstance(t, DTensor)


def shard_of(t, dim: int, name: str):
    """``(local tensor, process group, start, total)`` of a DTensor sharded on ``dim`` over one mesh
    dimension (replicated over any other), or None for a DTensor with no ``Shard(dim)`` placement.
    The local tensor keeps the autograd link to the DTensor. Uneven shards are allowed (the start
    is the DTensor's own offset of this rank's piece)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    dim = dim % t.dim()
    placements = tuple(t.placements)
    sharded = [i for i, p in enumerate(placements) if isinstance(p, Shard) and p.dim == dim]
    if not sharded:
        return None
    others = [p for i, p in enumerate(placements) if i != sharded[0]]
    if len(sharded) > 1 or not all(isinstance(p, Replicate) for p in others):
        raise ValueError(f"{name} must be sharded over one mesh dimension (Shard({dim})) and replicated "
                         f"over the others, got placements {placements}")
    mesh = t.device_mesh
    _, offset = compute_local_shape_and_global_offset(t.shape, mesh, placements)
    return t.to_local(), mesh.get_group(sharded[0]), int(offset[dim]), int(t.shape[dim])


def _replicated_local(t, name: str):
    """A plain tensor as it is; a DTensor replicated on every mesh dimension as its local tensor."""
    if not _is_dtensor(t):
        return t
    from torch.distributed.tensor import Replicate

    if not all(isinstance(p, Replicate) for p in t.placements):
        raise ValueError(f"{name} must be replicated over the vocabulary's process group (the same on every "
                         f"rank), got a DTensor with placements {tuple(t.placements)}")
    return t.to_local()


def _resolve(group, vocab_local: int, vocab_start, vocab_size, name: str) -> tuple[str, int, int, int]:
    """``(group name, this rank's vocabulary start, total vocabulary, ranks)`` for plain local shards:
    even shards (``start = rank * V_r``) unless ``vocab_start`` is given; then the total is
    ``vocab_size``, or, without it, the sum of the shards' sizes gathered on the host (a collective
    and a synchronisation on every call)."""
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError(f"a vocabulary-parallel {name} needs torch.distributed initialised (the process group "
                         "the vocabulary is sharded over)")
    if group is None:
        group = dist.group.WORLD
    elif hasattr(group, "get_group"):  # a 1-D DeviceMesh
        group = group.get_group()
    world = dist.get_world_size(group)
    if vocab_size is not None and (isinstance(vocab_size, bool) or not isinstance(vocab_size, int)
                                   or vocab_size < vocab_local):
        raise ValueError(f"vocab_size must be None or an int >= this rank's shard ({vocab_local}), "
                         f"got {vocab_size!r}")
    if vocab_start is None:
        if vocab_size is not None and vocab_size != world * vocab_local:
            raise ValueError(f"vocab_size {vocab_size} is not {world} even shards of {vocab_local}: "
                             "pass vocab_start for uneven shards")
        start = dist.get_rank(group) * vocab_local if world > 1 else 0
        return group.group_name, start, world * vocab_local, world
    if isinstance(vocab_start, bool) or not isinstance(vocab_start, int) or vocab_start < 0:
        raise ValueError(f"vocab_start must be None or an int >= 0, got {vocab_start!r}")
    if vocab_size is not None:
        if vocab_start + vocab_local > vocab_size:
            raise ValueError(f"vocab_start + this rank's shard ({vocab_start} + {vocab_local}) exceeds "
                             f"vocab_size {vocab_size}")
        return group.group_name, vocab_start, vocab_size, world
    sizes = [None] * world
    dist.all_gather_object(sizes, vocab_local, group=group)
    return group.group_name, vocab_start, sum(sizes), world


def _whole_vocabulary(ranks: int, start: int, total: int, local: int) -> bool:
    """Whether this rank's shard is the whole vocabulary (a one-rank group: tensor parallelism of
    size 1). Nothing is sharded then, and the loss is plain (fused linear) cross entropy: Onca's
    op, whose kernels and small-call route serve it better than the sharded passes with nothing
    to exchange."""
    return ranks == 1 and start == 0 and total == local


def _check_common(ignore_index, reduction, lse_square_scale, return_z_loss, allowed=REDUCTIONS):
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"ignore_index must be an int, got {ignore_index!r}")
    if reduction not in allowed:
        raise ValueError(f"reduction must be one of {allowed}, got {reduction!r}")
    check_number(lse_square_scale, "lse_square_scale", minimum=0.0)
    if lse_square_scale == float("inf"):
        raise ValueError(f"lse_square_scale must be a finite number >= 0, got {lse_square_scale!r}")
    check_bool(return_z_loss, "return_z_loss")


def vocab_parallel_cross_entropy(
    logits: Tensor,
    target: Tensor,
    group=None,
    *,
    vocab_start: int | None = None,
    vocab_size: int | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    lse_square_scale: float = 0.0,
    return_z_loss: bool = False,
):
    """Cross entropy of logits sharded over the vocabulary across the ranks of ``group``, without
    gathering them: ``cross_entropy(cat(logits of every rank, dim=-1), target)``.

    ``logits`` ``(..., V_r)``: this rank's slice of the vocabulary (classes ``[vocab_start,
    vocab_start + V_r)``), or a DTensor sharded on its last dimension (``Shard(-1)``, e.g. the
    output of a column-parallel head kept as a DTensor; its mesh gives the group and the offsets).
    ``target`` ``(...)``: the global class indices, the same on every rank (a replicated DTensor
    is taken as its local tensor). ``group``: a process group or 1-D ``DeviceMesh`` (default the
    whole world) for plain tensors. ``vocab_start`` None means even shards (``rank * V_r``);
    given, the shards may be uneven: pass the whole vocabulary as ``vocab_size`` too, or every
    call gathers the shards' sizes on the host (a synchronisation). Options as
    :func:`onca.ops.cross_entropy.cross_entropy`: ``ignore_index``, ``reduction`` (``"mean"``,
    ``"sum"``, ``"none"``), ``lse_square_scale`` (z-loss) and ``return_z_loss``. Every rank
    returns the same loss (a plain fp32 tensor); the logits' gradient is this
    rank's slice. Two all-reduces of per-token fp32 numbers in forward, none in backward. Every
    rank of the group must call it with the same targets. See the module docstring.
    """
    _check_common(ignore_index, reduction, lse_square_scale, return_z_loss)
    check_tensor(logits, "logits")
    group_name = None
    if _is_dtensor(logits):
        shard = shard_of(logits, -1, "logits")
        if shard is None:
            raise ValueError("logits is a DTensor not sharded on its last dimension: use "
                             "onca.functional.cross_entropy on its local tensor (nothing is sharded)")
        logits, pg, start, total = shard
        group_name, ranks = pg.group_name, pg.size()
    target = _replicated_local(target, "target")
    check_float(logits, "logits")
    if logits.dim() < 2 or logits.shape[-1] == 0:
        raise ValueError(f"logits must be (tokens, vocab shard) or (..., vocab shard) with a non-empty shard, "
                         f"got shape {tuple(logits.shape)}")
    target1d = check_target(target, "target", logits.shape[:-1], "the logits' shape without the vocab")
    check_same_device(target, "target", logits, "logits")
    if group_name is None:
        group_name, start, total, ranks = _resolve(group, logits.shape[-1], vocab_start, vocab_size,
                                                   "cross entropy")
    if _whole_vocabulary(ranks, start, total, logits.shape[-1]):
        return checked_cross_entropy(logits, target, target1d, None, ignore_index, 0.0, reduction,
                                     lse_square_scale, None, return_z_loss, False, False, False)
    loss, z_loss, _ = vocab_parallel_cross_entropy_forward(
        as_rows(logits), target1d, group_name, start, total, ignore_index, float(lse_square_scale), reduction)
    if reduction == "none":
        loss, z_loss = loss.view(target.shape), z_loss.view(target.shape)
    return (loss, z_loss) if return_z_loss else loss


def vocab_parallel_fused_linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    target: Tensor,
    bias: Tensor | None = None,
    group=None,
    *,
    vocab_start: int | None = None,
    vocab_size: int | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    lse_square_scale: float = 0.0,
    return_z_loss: bool = False,
    accum_dtype: torch.dtype | None = None,
    chunk_tokens: int | None = None,
):
    """``cross_entropy(hidden @ W.T + b, target)`` for a head ``W`` ``(V, H)`` sharded by rows over
    the ranks of ``group`` (tensor / vocabulary parallelism), without the logits and without
    gathering anything vocabulary-sized.

    ``weight``: this rank's rows ``(V_r, H)`` (classes ``[vocab_start, vocab_start + V_r)``), or a
    DTensor ``Shard(0)`` (its mesh gives the group and offsets; the gradient reaches it as a
    DTensor); ``bias`` ``(V_r,)`` likewise (or None). ``hidden`` ``(..., H)`` and ``target``
    ``(...)`` are the same on every rank (replicated DTensors are taken as their local tensors).
    ``group``, ``vocab_start``, ``vocab_size`` as :func:`vocab_parallel_cross_entropy`; ``ignore_index``,
    ``reduction`` (``"mean"`` or ``"sum"``), ``lse_square_scale``, ``return_z_loss``,
    ``accum_dtype``, ``chunk_tokens`` as :func:`onca.ops.fused_linear_cross_entropy.
    fused_linear_cross_entropy`. The loss (fp32) is the same on every rank; ``hidden``'s gradient
    is the full one (all-reduced over the group), the head's is this rank's rows. One exchange of
    ``3 * chunk`` fp32 numbers per chunk of tokens and one all-reduce of ``dhidden``, all in the
    forward pass. Every rank of the group must call it with the same hidden states and targets.
    """
    _check_common(ignore_index, reduction, lse_square_scale, return_z_loss, allowed=("mean", "sum"))
    check_tensor(hidden, "hidden")
    check_tensor(weight, "weight")
    group_name = None
    if _is_dtensor(weight):
        shard = shard_of(weight, 0, "weight")
        if shard is None:
            raise ValueError("weight is a replicated DTensor: use onca.functional.fused_linear_cross_entropy "
                             "on its local tensor (nothing is sharded)")
        weight, pg, start, total = shard
        group_name, ranks = pg.group_name, pg.size()
        if bias is not None:
            bias_shard = shard_of(bias, 0, "bias") if _is_dtensor(bias) else None
            if bias_shard is None:
                raise ValueError("bias must be sharded like weight (a DTensor Shard(0) on the same mesh) when "
                                 "weight is a DTensor")
            bias = bias_shard[0]
    hidden = _replicated_local(hidden, "hidden")
    target = _replicated_local(target, "target")
    check_float(hidden, "hidden")
    check_float(weight, "weight")
    if hidden.dim() < 2:
        raise ValueError(f"hidden must be (tokens, hidden) or (..., hidden), got shape {tuple(hidden.shape)}")
    h = hidden.shape[-1]
    if weight.dim() != 2 or weight.shape[1] != h or weight.shape[0] == 0 or h == 0:
        raise ValueError(f"weight must be this rank's head rows (V_r, hidden) = (V_r, {h}) with V_r, hidden "
                         f">= 1, got shape {tuple(weight.shape)}")
    if weight.dtype != hidden.dtype:
        raise TypeError(f"weight must have hidden's dtype {hidden.dtype}, got {weight.dtype}")
    check_same_device(weight, "weight", hidden, "hidden")
    if bias is not None:
        check_tensor(bias, "bias")
        if bias.dtype != hidden.dtype or tuple(bias.shape) != (weight.shape[0],):
            raise ValueError(f"bias must be ({weight.shape[0]},) in {hidden.dtype}, got {tuple(bias.shape)} "
                             f"in {bias.dtype}")
    target1d = check_target(target, "target", hidden.shape[:-1], "the hidden states' shape without hidden")
    check_same_device(target, "target", hidden, "hidden")
    if accum_dtype is not None and accum_dtype not in (torch.float32, weight.dtype):
        raise ValueError(f"accum_dtype must be None, torch.float32 or the weight's dtype, got {accum_dtype!r}")
    if chunk_tokens is not None and (isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int)
                                     or chunk_tokens < 1):
        raise ValueError(f"chunk_tokens must be None or a positive int, got {chunk_tokens!r}")
    if group_name is None:
        group_name, start, total, ranks = _resolve(group, weight.shape[0], vocab_start, vocab_size,
                                                   "fused linear cross entropy")
    if _whole_vocabulary(ranks, start, total, weight.shape[0]):
        return fused_linear_cross_entropy(hidden, weight, target, bias, ignore_index=ignore_index,
                                          reduction=reduction, lse_square_scale=lse_square_scale,
                                          return_z_loss=return_z_loss, accum_dtype=accum_dtype,
                                          chunk_tokens=chunk_tokens)
    grad = torch.is_grad_enabled()
    loss, z_loss, *_ = vocab_parallel_fused_linear_cross_entropy_forward(
        as_rows(hidden), weight, target1d, bias, group_name, start, total, ignore_index,
        float(lse_square_scale), reduction, accum_dtype == torch.float32, chunk_tokens or 0,
        grad and hidden.requires_grad, grad and weight.requires_grad,
        grad and bias is not None and bias.requires_grad)
    return (loss, z_loss) if return_z_loss else loss
