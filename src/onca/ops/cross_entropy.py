"""Cross entropy over ``(tokens, vocab)`` logits with integer targets.

Per token ``i`` with target ``y`` (tokens whose target is ``ignore_index`` contribute nothing)::

    z       = softcap * tanh(logits / softcap)          (only when ``softcap`` is given; Gemma 2)
    lse     = log(sum_j exp(z_j))
    loss_i  = (1 - eps) * (lse - z_y) + eps * (lse - mean_j z_j) + lse_square_scale * lse**2

with ``eps = label_smoothing``; this is ``torch.nn.functional.cross_entropy`` plus the PaLM z-loss
(``lse_square_scale``). ``reduction="mean"`` divides the sum by the number of non-ignored tokens,
counted on the device, as torch does: with every token ignored (or no tokens at all) the mean is
``0 / 0 = NaN`` and the gradient is zero, as in torch. ``return_z_loss=True`` also returns the
z-loss term alone (reduced the same way, for logging: it is already part of the loss and takes no
gradient of its own). A target outside ``[0, vocab)`` that is not ``ignore_index`` is never read
through: that token's loss and gradient are NaN (checked in the kernel, with no host
synchronisation), so the loss shows the bad label.

Gradient (per token, before the reduction's scale)::

    dloss/dz_j = softmax(z)_j * (1 + 2 * lse_square_scale * lse) - eps / V - (1 - eps) * [j == y]

times ``1 - (z_j / softcap)**2`` through the soft cap.

The kernel is row-tiled over the vocabulary with an online log-sum-exp: where a row does not fit
the on-chip budget (the plan splits it into column tiles), one pass computes the running max and
sum of exponentials, the next writes the gradient; where it fits, one load serves both. The target
logit is gathered with one scalar load per row, and ignored tokens load nothing.

Two ways to get the gradient, chosen by ``overwrite_logits``:

- ``False`` (default, the caller's logits are never modified): the forward pass reads the logits
  once (loss and one fp32 ``lse`` per token) and saves the logits, the targets and ``lse``; the
  backward pass reads the logits once more and writes the gradient, already scaled by the
  incoming gradient, into a new tensor.
- ``True``: the forward pass computes the gradient (liger-kernel's trick) and, on the eager route,
  writes it over the logits themselves, so no second logits-sized buffer ever exists; nothing but
  that buffer is kept for backward, which rescales it in place by the incoming gradient (a kernel
  that reads the scale on the device and touches nothing when it is 1). The caller's logits hold
  the gradient afterwards (their autograd version is bumped, so a graph that saved them fails
  loudly instead of silently using gradients as logits). Use it for logits that are a temporary
  activation, as in a causal LM's loss; logits that are not row-contiguous are copied first and
  the copy is overwritten instead. When the logits do not require grad nothing is written. Traced
  (``torch.compile``), the gradient goes into a buffer of its own: compiled graphs mutate nothing.

The loss has the logits' dtype (as torch's); per-token losses are accumulated in fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from onca.device import DeviceProfile
from onca.ops._contract import custom_op, register_autograd, tracing
from onca.ops._rows import as_rows, rows_cols
from onca.ops._validate import (
    check_bool,
    check_float,
    check_index,
    check_number,
    check_same_device,
    check_tensor,
)
from onca.tiling import RowPlan, plan_rows

__all__ = ["cross_entropy", "REDUCTIONS", "plan", "cross_entropy_rows", "validate_options", "check_target",
           "count_targets", "reduce_rows", "scale_forward_gradient", "ForwardGradients"]

REDUCTIONS = ("none", "mean", "sum")

# Live tiles of the kernel's gradient pass: the logits tile as loaded and the gradient as stored
# (input dtype); the fp32 logits, their exponentials, the gradient and the soft-cap/target terms
# (fp32). Counting fewer lets the GPU plan put 16 elements per thread in 16 warps, which caps a
# thread at 128 registers and spills (tools/sm90_compile.py shows it).
TILES = dict(live_tiles=2, fp32_tiles=4)
# The rescaling kernel: the tile as loaded and as stored, and its fp32 product.
RESCALE_TILES = dict(live_tiles=2, fp32_tiles=1)


# ----------------------------------------------------------------------------------------- kernels


@triton.jit
def _capped(x, softcap, HAS_SOFTCAP: tl.constexpr):
    """``softcap * tanh(x / softcap)`` (Gemma 2's logit soft-capping), written with ``exp`` and
    ``rsqrt`` so that every backend has it and no per-element division is needed (``1 / (1 + a)``
    as ``rsqrt(1 + a) ** 2``); ``exp(-2|u|)`` never overflows."""
    if HAS_SOFTCAP:
        u = x * (1.0 / softcap)
        a = tl.exp(-2.0 * tl.abs(u))
        r = tl.rsqrt(1.0 + a)
        t = (1.0 - a) * (r * r)
        x = softcap * tl.where(u < 0, -t, t)
    return x


@triton.jit
def _load_logits(ptrs, mask, softcap, HAS_SOFTCAP: tl.constexpr):
    """A tile of logits in fp32, soft-capped, ``-inf`` where masked (out of the row, ignored rows)."""
    x = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    return tl.where(mask, _capped(x, softcap, HAS_SOFTCAP), float("-inf"))


@triton.jit
def _gradient(p, x, cols, y, scale, z_factor, smooth_eps, target_weight, softcap,
              HAS_SOFTCAP: tl.constexpr):
    """dloss/dlogits of a tile (fp32) from its softmax ``p``, already multiplied by each row's
    ``scale``, which is 0 on ignored rows (their ``p`` is 0 too: the whole row comes out 0).
    ``x`` holds the (soft-capped) logits, ``-inf`` where masked (read for the soft cap's
    derivative only)."""
    # Row terms first, so that each element costs one fma and one select.
    pz = scale * z_factor
    off = scale * smooth_eps
    g = p * pz[:, None] - off[:, None]
    g = tl.where(cols[None, :] == y[:, None], g - (scale * target_weight)[:, None], g)
    if HAS_SOFTCAP:
        t = tl.where(x == float("-inf"), 0.0, x) * (1.0 / softcap)  # masked columns: no 0 * inf
        g = g * (1.0 - t * t)
    return g


@triton.jit
def _cross_entropy_kernel(
    x_ptr, target_ptr, grad_ptr, loss_ptr, lse_ptr, scale_ptr,
    n_rows, n_cols, x_row_stride, grad_row_stride, scale_stride,
    ignore_index, label_smoothing, lse_square_scale, softcap,
    COMPUTE_LSE: tl.constexpr,
    WRITE_GRAD: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_SMOOTHING: tl.constexpr,
    HAS_Z: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    COL_TILES: tl.constexpr,
):
    """One kernel, three uses:

    - ``COMPUTE_LSE`` and not ``WRITE_GRAD``: loss and lse per row (forward without gradient);
    - ``COMPUTE_LSE`` and ``WRITE_GRAD``: loss, lse and the gradient (forward with gradient);
    - ``WRITE_GRAD`` alone: the gradient from a saved ``lse`` (deferred backward).

    The gradient of row ``r`` is scaled by ``scale_ptr[r * scale_stride]`` when ``HAS_SCALE`` (stride
    0 for a scalar such as ``1 / n`` of a mean, 1 per token). ``grad_ptr`` may be ``x_ptr``: each
    program reads a tile before it writes that tile, and no other program touches the row.

    A target outside ``[0, n_cols)`` that is not ``ignore_index`` is never used as an offset: its
    row's loss and gradient are NaN, so that a bad label shows in the loss without a host check.
    """
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    n_row_blocks = tl.cdiv(n_rows, BLOCK_ROWS)
    col_offsets = tl.arange(0, BLOCK_COLS)
    smooth_eps = label_smoothing / n_cols
    target_weight = 1.0 - label_smoothing
    for row_block in tl.range(pid, n_row_blocks, n_programs):
        rows = row_block * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        row_mask = rows < n_rows
        y = tl.load(target_ptr + rows, mask=row_mask, other=ignore_index)
        valid = row_mask & (y != ignore_index)
        bad = valid & ((y < 0) | (y >= n_cols))
        # Class indices fit int32 (the vocabulary does): compared per element in 32 bits.
        y = tl.where(valid & ~bad, y, 0).to(tl.int32)
        rows64 = rows.to(tl.int64)
        x_rows = x_ptr + rows64[:, None] * x_row_stride

        # 1. The log-sum-exp (and the loss), or the saved log-sum-exp.
        if COMPUTE_LSE:
            if COL_TILES == 1:
                # The whole row is one tile: this load also serves the gradient below.
                col_mask = col_offsets < n_cols
                mask = valid[:, None] & col_mask[None, :]
                x = _load_logits(x_rows + col_offsets[None, :], mask, softcap, HAS_SOFTCAP)
                m = tl.where(valid, tl.max(x, axis=1), 0.0)
                e = tl.exp(x - m[:, None])
                d = tl.where(valid, tl.sum(e, axis=1), 1.0)
                if HAS_SMOOTHING:
                    x_sum = tl.sum(tl.where(mask, x, 0.0), axis=1)
            else:
                # Online log-sum-exp over the row's column tiles: running max and sum of exp.
                m = tl.full([BLOCK_ROWS], float("-inf"), dtype=tl.float32)
                d = tl.zeros([BLOCK_ROWS], dtype=tl.float32)
                x_sum = tl.zeros([BLOCK_ROWS], dtype=tl.float32)
                for tile in range(COL_TILES):
                    cols = tile * BLOCK_COLS + col_offsets
                    mask = valid[:, None] & (cols < n_cols)[None, :]
                    xt = _load_logits(x_rows + cols[None, :], mask, softcap, HAS_SOFTCAP)
                    m_new = tl.maximum(m, tl.max(xt, axis=1))
                    # Rows with nothing loaded yet (ignored rows) keep m = -inf; shift them by 0.
                    shift = tl.where(m_new == float("-inf"), 0.0, m_new)
                    d = d * tl.exp(m - shift) + tl.sum(tl.exp(xt - shift[:, None]), axis=1)
                    m = m_new
                    if HAS_SMOOTHING:
                        x_sum += tl.sum(tl.where(mask, xt, 0.0), axis=1)
                m = tl.where(valid, m, 0.0)
                d = tl.where(valid, d, 1.0)
            lse = tl.where(valid, m + tl.log(d), 0.0)
            # The target's logit: one scalar load per row, before any gradient overwrites it.
            x_y = tl.load(x_ptr + rows64 * x_row_stride + y.to(tl.int64), mask=valid & ~bad, other=0.0)
            x_y = x_y.to(tl.float32)
            x_y = _capped(x_y, softcap, HAS_SOFTCAP)
            if HAS_SMOOTHING:
                loss = lse - target_weight * x_y - smooth_eps * x_sum
            else:
                loss = lse - x_y
            if HAS_Z:
                loss += lse_square_scale * lse * lse
            loss = tl.where(bad, float("nan"), tl.where(valid, loss, 0.0))
            tl.store(loss_ptr + rows, loss, mask=row_mask)
            tl.store(lse_ptr + rows, lse, mask=row_mask)
        else:
            lse = tl.load(lse_ptr + rows, mask=valid, other=0.0)

        # 2. The gradient, scaled, written over the logits or into its own buffer.
        if WRITE_GRAD:
            if COMPUTE_LSE:
                # The gradient may overwrite the logits: every thread's read of x_y comes first.
                tl.debug_barrier()
            scale = tl.where(valid, 1.0, 0.0)
            if HAS_SCALE:
                s = tl.load(scale_ptr + rows * scale_stride, mask=valid, other=0.0)
                scale = scale * s.to(tl.float32)
            scale = tl.where(bad, float("nan"), scale)
            z_factor = tl.zeros([BLOCK_ROWS], dtype=tl.float32) + 1.0
            if HAS_Z:
                z_factor = 1.0 + 2.0 * lse_square_scale * lse
            g_rows = grad_ptr + rows64[:, None] * grad_row_stride
            if COL_TILES == 1:
                if COMPUTE_LSE:
                    p = e * (1.0 / d)[:, None]  # the exponentials are still here: no second exp
                else:
                    col_mask = col_offsets < n_cols
                    mask = valid[:, None] & col_mask[None, :]
                    x = _load_logits(x_rows + col_offsets[None, :], mask, softcap, HAS_SOFTCAP)
                    p = tl.exp(x - lse[:, None])
                g = _gradient(p, x, col_offsets, y, scale, z_factor, smooth_eps, target_weight,
                              softcap, HAS_SOFTCAP)
                tl.store(g_rows + col_offsets[None, :], g.to(grad_ptr.dtype.element_ty),
                         mask=row_mask[:, None] & col_mask[None, :])
            else:
                for tile in range(COL_TILES):
                    cols = tile * BLOCK_COLS + col_offsets
                    col_mask = cols < n_cols
                    mask = valid[:, None] & col_mask[None, :]
                    xt = _load_logits(x_rows + cols[None, :], mask, softcap, HAS_SOFTCAP)
                    g = _gradient(tl.exp(xt - lse[:, None]), xt, cols, y, scale, z_factor, smooth_eps,
                                  target_weight, softcap, HAS_SOFTCAP)
                    tl.store(g_rows + cols[None, :], g.to(grad_ptr.dtype.element_ty),
                             mask=row_mask[:, None] & col_mask[None, :])



@triton.jit
def _rescale_kernel(
    x_ptr, out_ptr, g_ptr, applied_ptr,
    n_rows, n_cols, x_row_stride, out_row_stride, g_stride,
    HAS_APPLIED: tl.constexpr,
    SKIP_UNCHANGED: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    COL_TILES: tl.constexpr,
):
    """``out = x * g / applied`` per row (``g_ptr[r * g_stride]``: stride 0 for a scalar), in fp32.

    With ``SKIP_UNCHANGED`` (``out`` is ``x``) rows whose factor is exactly 1 are neither read nor
    written: a loss's incoming gradient is usually 1, and then this costs nothing.
    """
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    n_row_blocks = tl.cdiv(n_rows, BLOCK_ROWS)
    col_offsets = tl.arange(0, BLOCK_COLS)
    for row_block in tl.range(pid, n_row_blocks, n_programs):
        rows = row_block * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        row_mask = rows < n_rows
        factor = tl.load(g_ptr + rows * g_stride, mask=row_mask, other=1.0).to(tl.float32)
        if HAS_APPLIED:
            factor = factor / tl.load(applied_ptr + rows * g_stride, mask=row_mask, other=1.0)
        if SKIP_UNCHANGED:
            row_mask = row_mask & (factor != 1.0)
        rows64 = rows.to(tl.int64)[:, None]
        for tile in range(COL_TILES):
            cols = tile * BLOCK_COLS + col_offsets
            mask = row_mask[:, None] & (cols < n_cols)[None, :]
            x = tl.load(x_ptr + rows64 * x_row_stride + cols[None, :], mask=mask, other=0.0)
            y = x.to(tl.float32) * factor[:, None]
            tl.store(out_ptr + rows64 * out_row_stride + cols[None, :], y.to(out_ptr.dtype.element_ty),
                     mask=mask)


# --------------------------------------------------------------------------------------- launchers


def plan(shape, dtype: torch.dtype, profile: DeviceProfile | None = None) -> dict[str, RowPlan]:
    """The kernel's plan for logits of ``shape`` (``(..., vocab)``). Forward (loss, and the gradient
    when it is computed there) and deferred backward launch the same kernel with the same plan."""
    rows, cols = rows_cols(shape)
    p = plan_rows(rows, cols, dtype, profile=profile, **TILES)
    return {"forward": p, "backward": p}


def cross_entropy_rows(
    x: Tensor,
    target: Tensor,
    *,
    ignore_index: int,
    label_smoothing: float,
    lse_square_scale: float,
    softcap: float,
    compute_lse: bool,
    loss: Tensor | None,
    lse: Tensor,
    grad: Tensor | None = None,
    scale: Tensor | None = None,
) -> None:
    """Launch the kernel over the rows of ``x`` (``(rows, vocab)``, unit column stride, rows >= 1).

    With ``compute_lse`` it writes the fp32 ``loss`` and ``lse`` of each row, else it reads ``lse``.
    When ``grad`` is given (it may be ``x`` itself), the gradient, scaled per row by ``scale`` (a
    0-d or ``(rows,)`` tensor on the device) when given, is written into it. ``softcap`` 0 is none.
    No validation here: the public functions validate.
    """
    rows, cols = x.shape
    p = plan_rows(rows, cols, x.dtype, **TILES)
    write_grad = grad is not None
    scale_stride = 0 if scale is None or scale.dim() == 0 else scale.stride(0)
    _cross_entropy_kernel[(p.grid,)](
        x, target, grad if write_grad else x, loss if compute_lse else lse, lse,
        scale if scale is not None else lse,
        rows, cols, x.stride(0), grad.stride(0) if write_grad else 0, scale_stride,
        ignore_index, label_smoothing, lse_square_scale, softcap if softcap else 1.0,
        COMPUTE_LSE=compute_lse, WRITE_GRAD=write_grad, HAS_SOFTCAP=softcap != 0.0,
        HAS_SMOOTHING=label_smoothing > 0, HAS_Z=lse_square_scale != 0, HAS_SCALE=scale is not None,
        BLOCK_ROWS=p.block_rows, BLOCK_COLS=p.block_cols, COL_TILES=p.col_tiles,
        num_warps=p.num_warps,
    )


def count_targets(target: Tensor, ignore_index: int) -> Tensor:
    """How many targets are not ``ignore_index``: a 0-d tensor on the device (no synchronisation)."""
    return (target != ignore_index).sum()


def reduce_rows(per_row: Tensor, reduction: str, n_valid: Tensor) -> Tensor:
    """Per-row fp32 values reduced as torch reduces a loss (a mean over ``n_valid``, NaN when 0)."""
    if reduction == "none":
        return per_row
    total = per_row.sum()
    return total / n_valid if reduction == "mean" else total


@custom_op("cross_entropy_forward")
def cross_entropy_forward(logits: Tensor, target: Tensor, ignore_index: int, label_smoothing: float,
                          lse_square_scale: float, softcap: float, reduction: str, gradient_in_forward: bool,
                          overwrite_logits: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(loss, z_loss, lse, grad)`` of the 2-D ``logits``: ``loss`` and ``z_loss`` reduced, in the
    logits' dtype; ``lse`` fp32 per row. With ``gradient_in_forward`` the gradient for a unit
    incoming gradient is computed too: into ``grad``, or (``overwrite_logits``, eager route only)
    over the logits, ``grad`` then being empty."""
    rows, vocab = logits.shape
    keep_grad = gradient_in_forward and not overwrite_logits
    grad = logits.new_empty((rows, vocab) if keep_grad else (0,))
    loss_rows = torch.empty(rows, dtype=torch.float32, device=logits.device)
    lse = torch.empty(rows, dtype=torch.float32, device=logits.device)
    n_valid = count_targets(target, ignore_index)
    if rows:
        if gradient_in_forward and overwrite_logits:
            # The logits are about to hold the gradient: a graph that saved them must fail loudly.
            torch.autograd.graph.increment_version(logits)
        into = (logits if overwrite_logits else grad) if gradient_in_forward else None
        mean_scale = reduction == "mean" and into is not None
        scale = torch.reciprocal(n_valid.to(torch.float32)) if mean_scale else None
        cross_entropy_rows(logits, target, ignore_index=ignore_index, label_smoothing=label_smoothing,
                           lse_square_scale=lse_square_scale, softcap=softcap, compute_lse=True,
                           loss=loss_rows, lse=lse, grad=into, scale=scale)
    loss = reduce_rows(loss_rows, reduction, n_valid).to(logits.dtype)
    z_loss = reduce_rows(lse_square_scale * lse * lse, reduction, n_valid).to(logits.dtype)
    return loss, z_loss, lse, grad


@cross_entropy_forward.register_fake
def _(logits, target, ignore_index, label_smoothing, lse_square_scale, softcap, reduction,
      gradient_in_forward, overwrite_logits):
    rows, vocab = logits.shape
    loss_shape = (rows,) if reduction == "none" else ()
    keep_grad = gradient_in_forward and not overwrite_logits
    lse = logits.new_empty(rows, dtype=torch.float32)
    grad = logits.new_empty((rows, vocab) if keep_grad else (0,))
    return logits.new_empty(loss_shape), logits.new_empty(loss_shape), lse, grad


@custom_op("cross_entropy_backward")
def cross_entropy_backward(grad_loss: Tensor, logits: Tensor, target: Tensor, lse: Tensor,
                           ignore_index: int, label_smoothing: float, lse_square_scale: float,
                           softcap: float, reduction: str) -> Tensor:
    """The logits' gradient from the saved logits and ``lse``, scaled by the loss's incoming gradient
    (and, for a mean, divided by the count of non-ignored targets, on the device)."""
    rows, vocab = logits.shape
    grad = torch.empty((rows, vocab), dtype=logits.dtype, device=logits.device)
    if rows == 0:
        return grad
    scale = grad_loss.to(torch.float32)
    if reduction == "mean":
        scale = scale / count_targets(target, ignore_index)
    cross_entropy_rows(logits, target, ignore_index=ignore_index, label_smoothing=label_smoothing,
                       lse_square_scale=lse_square_scale, softcap=softcap, compute_lse=False, loss=None,
                       lse=lse, grad=grad, scale=scale.reshape(-1) if reduction == "none" else scale)
    return grad


@cross_entropy_backward.register_fake
def _(grad_loss, logits, target, lse, ignore_index, label_smoothing, lse_square_scale, softcap, reduction):
    return torch.empty_like(logits)


@custom_op("scale_forward_gradient")
def scale_forward_gradient(grad: Tensor, grad_output: Tensor, applied: Tensor | None,
                           in_place: bool) -> Tensor:
    """A gradient the forward pass computed for a unit incoming gradient, times the loss's incoming
    gradient ``grad_output`` (0-d, or one per row of ``grad``), divided by ``applied`` (the incoming
    gradient already folded in by an earlier backward; None: 1). ``in_place`` (eager route only)
    rescales ``grad`` itself and skips the rows whose factor is 1."""
    out = grad if in_place else torch.empty_like(grad)
    if grad.numel() == 0:
        return out
    x2d = grad.view(-1, grad.shape[-1]) if grad.dim() > 1 else grad.view(1, -1)
    o2d = out.view(x2d.shape)
    g = grad_output.reshape(-1).contiguous()  # an expanded gradient (stride 0) read like ``applied``
    rows, cols = x2d.shape
    p = plan_rows(rows, cols, grad.dtype, **RESCALE_TILES)
    _rescale_kernel[(p.grid,)](
        x2d, o2d, g, applied if applied is not None else g,
        rows, cols, x2d.stride(0), o2d.stride(0), 0 if grad_output.dim() == 0 else 1,
        HAS_APPLIED=applied is not None, SKIP_UNCHANGED=in_place,
        BLOCK_ROWS=p.block_rows, BLOCK_COLS=p.block_cols, COL_TILES=p.col_tiles, num_warps=p.num_warps,
    )
    return out


@scale_forward_gradient.register_fake
def _(grad, grad_output, applied, in_place):
    return torch.empty_like(grad)


# ---------------------------------------------------------------------------------------- autograd


class ForwardGradients:
    """Gradients computed in the forward pass on the eager route, handed to autograd by backward.

    Each backward rescales them in place by its incoming gradient over the one already folded in
    (``applied``, kept on the device: no host check of its value; nothing is touched where the
    factor is 1, the usual case). A second backward through the same graph (``retain_graph=True``,
    a benchmark timing backward) gets them again, rescaled, as long as nobody has modified them
    since (autograd may have made them a leaf's ``.grad``; their version counters tell, on the
    host); otherwise it is refused with an error rather than answered wrongly. After an incoming
    gradient of exactly 0, a later one gives NaN (the gradients were zeroed).
    """

    def __init__(self, tensors, grad_output: Tensor):
        self.tensors = tuple(tensors)
        self.applied = torch.ones(grad_output.shape, dtype=torch.float32, device=grad_output.device)
        self.versions: list | None = None

    def take(self, grad_output: Tensor) -> tuple:
        if self.versions is not None and any(
            t is not None and t._version != v for t, v in zip(self.tensors, self.versions)
        ):
            raise RuntimeError(
                "the gradients this op computed in the forward pass were modified after the first "
                "backward (e.g. accumulated into a .grad); backward through the same graph again is "
                "not supported"
            )
        for t in self.tensors:
            if t is not None:
                scale_forward_gradient(t, grad_output, self.applied, True)
        self.applied.copy_(grad_output.reshape(self.applied.shape))
        self.versions = [t._version if t is not None else None for t in self.tensors]
        # Fresh views: autograd can make them a leaf's .grad without a copy (it copies a tensor
        # that something else still references), and they share the version counters checked above.
        return tuple(t.view(t.shape) if t is not None else None for t in self.tensors)


def _setup_context(ctx, inputs, output):
    logits, target, ignore_index, label_smoothing, lse_square_scale, softcap, reduction = inputs[:7]
    in_forward, overwrite = inputs[7:]
    loss, z_loss, lse, grad = output
    ctx.mark_non_differentiable(z_loss, lse, grad)
    ctx.options = (ignore_index, label_smoothing, lse_square_scale, softcap, reduction)
    ctx.gradient_in_forward = in_forward
    # Eager: the forward-pass gradient is rescaled in place; traced: into a new tensor.
    ctx.eager = not tracing(logits, loss)
    if not in_forward:
        ctx.save_for_backward(logits, target, lse)
    elif ctx.eager:
        ctx.grads = ForwardGradients([logits if overwrite else grad], loss)
    else:
        ctx.save_for_backward(grad)


def _backward(ctx, grad_loss, _grad_z_loss, _grad_lse, _grad_grad):
    if not ctx.gradient_in_forward:
        logits, target, lse = ctx.saved_tensors
        grad = cross_entropy_backward(grad_loss, logits, target, lse, *ctx.options)
    elif ctx.eager:
        grad, = ctx.grads.take(grad_loss)
    else:
        grad = scale_forward_gradient(ctx.saved_tensors[0], grad_loss, None, False)
    return grad, None, None, None, None, None, None, None, None


register_autograd(cross_entropy_forward, _backward, setup_context=_setup_context)


# ------------------------------------------------------------------------------------------ public


def validate_options(ignore_index, label_smoothing, reduction, lse_square_scale, softcap) -> None:
    """The scalar options shared by cross entropy and fused linear cross entropy."""
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"ignore_index must be an int, got {ignore_index!r}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    check_number(label_smoothing, "label_smoothing", minimum=0.0)
    if label_smoothing > 1.0:
        raise ValueError(f"label_smoothing must be a number in [0, 1], got {label_smoothing!r}")
    check_number(lse_square_scale, "lse_square_scale", minimum=0.0)
    if lse_square_scale == float("inf"):
        raise ValueError(f"lse_square_scale must be a finite number >= 0, got {lse_square_scale!r}")
    if softcap is not None:
        check_number(softcap, "softcap")
        if not 0.0 < softcap < float("inf"):
            raise ValueError(f"softcap must be None or a finite number > 0, got {softcap!r}")


def check_target(target, name: str, shape: tuple[int, ...], what: str) -> Tensor:
    """``target`` as a 1-D index tensor, after checking its dtype and shape."""
    check_tensor(target, name)
    if target.dtype.is_floating_point:
        raise TypeError(
            f"{name} must be an int32 or int64 tensor of class indices, got {target.dtype} "
            "(class-probability targets are not supported)"
        )
    check_index(target, name)
    if tuple(target.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)} ({what}), got {tuple(target.shape)}")
    return target.reshape(-1)


def _validate_inputs(logits, target) -> tuple[Tensor, Tensor]:
    check_float(logits, "logits")
    if logits.dim() < 2 or logits.shape[-1] == 0:
        raise ValueError(f"logits must be (tokens, vocab) or (..., vocab) with vocab >= 1, "
                         f"got shape {tuple(logits.shape)}")
    target1d = check_target(target, "target", logits.shape[:-1], "the logits' shape without the vocab")
    check_same_device(target, "target", logits, "logits")
    return as_rows(logits), target1d


def cross_entropy(
    logits: Tensor,
    target: Tensor,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
    lse_square_scale: float = 0.0,
    softcap: float | None = None,
    return_z_loss: bool = False,
    overwrite_logits: bool = False,
):
    """Cross entropy of ``logits`` ``(..., vocab)`` against class indices ``target`` ``(...)``.

    As ``torch.nn.functional.cross_entropy`` (``ignore_index``, ``label_smoothing``, ``reduction``
    ``"none"``/``"mean"``/``"sum"``, mean over the non-ignored tokens, NaN when there are none; no
    class weights), plus the z-loss ``lse_square_scale * logsumexp(logits)**2`` per token and
    Gemma 2's logit soft-capping ``softcap * tanh(logits / softcap)``. A non-ignored target outside
    ``[0, vocab)`` makes its token's loss and gradient NaN (never an out-of-bounds read).
    ``return_z_loss=True`` returns ``(loss, z_loss)`` (the z-loss part, for logging).
    ``overwrite_logits=True`` computes the gradient in the forward pass and writes it over the
    logits (no second logits-sized buffer; the logits are destroyed; eager only, compiled graphs
    manage their own buffers). See the module docstring.
    """
    validate_options(ignore_index, label_smoothing, reduction, lse_square_scale, softcap)
    check_bool(return_z_loss, "return_z_loss")
    check_bool(overwrite_logits, "overwrite_logits")
    x2d, target1d = _validate_inputs(logits, target)
    gradient_in_forward = overwrite_logits and logits.requires_grad and torch.is_grad_enabled()
    overwrite = gradient_in_forward and not tracing(logits, target)
    loss, z_loss, _, _ = cross_entropy_forward(
        x2d, target1d, ignore_index, float(label_smoothing), float(lse_square_scale),
        float(softcap) if softcap is not None else 0.0, reduction, gradient_in_forward, overwrite,
    )
    if reduction == "none":
        loss, z_loss = loss.view(logits.shape[:-1]), z_loss.view(logits.shape[:-1])
    return (loss, z_loss) if return_z_loss else loss
