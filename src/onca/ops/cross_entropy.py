"""Cross entropy over ``(tokens, vocab)`` logits with integer targets.

Per token ``i`` with target ``y`` (tokens whose target is ``ignore_index`` contribute nothing)::

    z       = softcap * tanh(logits / softcap)          (only when ``softcap`` is given; Gemma 2)
    lse     = log(sum_j exp(z_j))
    loss_i  = (1 - eps) * (lse - z_y) + eps * (lse - mean_j z_j) + lse_square_scale * lse**2

with ``eps = label_smoothing``; this is ``torch.nn.functional.cross_entropy`` plus the PaLM z-loss
(``lse_square_scale``). ``reduction="mean"`` divides the sum by the number of non-ignored tokens,
as torch does. When every token is ignored, torch's mean is ``0 / 0 = NaN``; Onca returns ``0.0``
instead (the gradient is zero in both), so that a fully masked micro-batch cannot poison a training
run with a NaN loss. ``return_z_loss=True`` also returns the z-loss term alone (reduced the same
way, for logging: it is already part of the loss and takes no gradient of its own).

Gradient (per token, before the reduction's scale)::

    dloss/dz_j = softmax(z)_j * (1 + 2 * lse_square_scale * lse) - eps / V - (1 - eps) * [j == y]

times ``1 - (z_j / softcap)**2`` through the soft cap.

The kernel is row-tiled over the vocabulary with an online log-sum-exp: where a row does not fit
the on-chip budget (the plan splits it into column tiles), one pass computes the running max and
sum of exponentials, the next writes the gradient; where it fits, one load serves both. The target
logit is gathered with one scalar load per row, and ignored tokens load nothing.

Two ways to get the gradient, chosen by ``in_place_backward``:

- ``False`` (default, the caller's logits are never modified): the forward pass reads the logits
  once (loss and one fp32 ``lse`` per token) and saves the logits, the targets and ``lse``; the
  backward pass reads the logits once more and writes the gradient, already scaled by the
  incoming gradient, into a new tensor.
- ``True``: the forward pass writes the gradient over the logits themselves (liger-kernel's
  trick), so no second logits-sized buffer ever exists; nothing but that buffer is kept for
  backward, which only rescales it when the incoming gradient is not 1. The caller's logits hold
  the gradient afterwards (their autograd version is bumped, so a graph that saved them fails
  loudly instead of silently using gradients as logits). Use it for logits that are a temporary
  activation, as in a causal LM's loss; logits that are not row-contiguous are copied first and
  the copy is overwritten instead. When the logits do not require grad nothing is written.

The loss has the logits' dtype (as torch's); per-token losses are accumulated in fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from onca.device import DeviceProfile
from onca.ops._validate import check_float, check_index, check_nonempty, check_same_device, check_tensor
from onca.tiling import RowPlan, plan_rows

__all__ = ["cross_entropy", "CrossEntropyFunction", "REDUCTIONS", "plan", "cross_entropy_rows",
           "validate_options", "count_targets", "ForwardGradients"]

REDUCTIONS = ("none", "mean", "sum")

# Live tiles of the kernel's gradient pass: the logits tile as loaded and the gradient as stored
# (input dtype); the fp32 logits, their exponentials, the gradient and the soft-cap/target terms
# (fp32). Counting fewer lets the GPU plan put 16 elements per thread in 16 warps, which caps a
# thread at 128 registers and spills (tools/sm90_compile.py shows it).
TILES = dict(live_tiles=2, fp32_tiles=4)


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
    ignore_index, label_smoothing, lse_square_scale, softcap, grad_scale,
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

    The gradient of row ``r`` is scaled by ``grad_scale`` (e.g. ``1 / n`` for a mean) times
    ``scale_ptr[r * scale_stride]`` when ``HAS_SCALE`` (the incoming gradient: stride 0 for a
    scalar, 1 per token). ``grad_ptr`` may be ``x_ptr``: each program reads a tile before it
    writes that tile, and no other program touches the row.
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
        # Class indices fit int32 (the vocabulary does): compared per element in 32 bits.
        y = tl.where(valid, y, 0).to(tl.int32)
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
            x_y = tl.load(x_ptr + rows64 * x_row_stride + y.to(tl.int64), mask=valid, other=0.0).to(tl.float32)
            x_y = _capped(x_y, softcap, HAS_SOFTCAP)
            if HAS_SMOOTHING:
                loss = lse - target_weight * x_y - smooth_eps * x_sum
            else:
                loss = lse - x_y
            if HAS_Z:
                loss += lse_square_scale * lse * lse
            tl.store(loss_ptr + rows, tl.where(valid, loss, 0.0), mask=row_mask)
            tl.store(lse_ptr + rows, lse, mask=row_mask)
        else:
            lse = tl.load(lse_ptr + rows, mask=valid, other=0.0)

        # 2. The gradient, scaled, written over the logits or into its own buffer.
        if WRITE_GRAD:
            if COMPUTE_LSE:
                # The gradient may overwrite the logits: every thread's read of x_y comes first.
                tl.debug_barrier()
            scale = tl.where(valid, grad_scale, 0.0)
            if HAS_SCALE:
                s = tl.load(scale_ptr + rows * scale_stride, mask=valid, other=0.0)
                scale = scale * s.to(tl.float32)
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


# --------------------------------------------------------------------------------------- launchers


def plan(shape, dtype: torch.dtype, profile: DeviceProfile | None = None) -> dict[str, RowPlan]:
    """The kernel's plan for logits of ``shape`` (``(..., vocab)``). Forward (loss, and the gradient
    when it is written in place) and deferred backward launch the same kernel with the same plan."""
    shape = tuple(int(s) for s in shape)
    rows = 1
    for s in shape[:-1]:
        rows *= s
    p = plan_rows(rows, shape[-1], dtype, profile=profile, **TILES)
    return {"forward": p, "backward": p}


def cross_entropy_rows(
    x: torch.Tensor,
    target: torch.Tensor,
    *,
    ignore_index: int,
    label_smoothing: float = 0.0,
    lse_square_scale: float = 0.0,
    softcap: float | None = None,
    compute_lse: bool = True,
    grad: torch.Tensor | None = None,
    grad_scale: float = 1.0,
    scale: torch.Tensor | None = None,
    loss: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
):
    """Launch the kernel over the rows of ``x`` (``(rows, vocab)``, unit column stride).

    Returns ``(loss, lse)`` per row in fp32 (``loss`` is ``None`` when ``compute_lse`` is off and
    ``lse`` is then read, not written). When ``grad`` is given (it may be ``x`` itself), the
    gradient scaled by ``grad_scale`` and, per row, by ``scale`` (a 0-d or ``(rows,)`` tensor) is
    written into it. No validation here: callers validate at their Function boundary.
    """
    rows, cols = x.shape
    p = plan_rows(rows, cols, x.dtype, **TILES)
    if compute_lse:
        loss = torch.empty(rows, dtype=torch.float32, device=x.device) if loss is None else loss
        lse = torch.empty(rows, dtype=torch.float32, device=x.device) if lse is None else lse
    elif lse is None:
        raise ValueError("cross_entropy_rows: lse is required when compute_lse is False")
    write_grad = grad is not None
    scale_stride = 0 if scale is None or scale.dim() == 0 else scale.stride(0)
    _cross_entropy_kernel[(p.grid,)](
        x, target, grad if write_grad else x, loss if compute_lse else lse, lse,
        scale if scale is not None else lse,
        rows, cols, x.stride(0), grad.stride(0) if write_grad else 0, scale_stride,
        int(ignore_index), float(label_smoothing), float(lse_square_scale),
        float(softcap) if softcap is not None else 1.0, float(grad_scale),
        COMPUTE_LSE=compute_lse, WRITE_GRAD=write_grad, HAS_SOFTCAP=softcap is not None,
        HAS_SMOOTHING=label_smoothing > 0, HAS_Z=lse_square_scale != 0, HAS_SCALE=scale is not None,
        BLOCK_ROWS=p.block_rows, BLOCK_COLS=p.block_cols, COL_TILES=p.col_tiles,
        num_warps=p.num_warps,
    )
    return (loss if compute_lse else None), lse


def count_targets(target: torch.Tensor, n_classes: int, ignore_index: int, name: str = "target") -> int:
    """How many targets are not ``ignore_index``; raises ``ValueError`` (naming ``name``) if any other
    target is outside ``[0, n_classes)``. One host synchronisation for both answers."""
    valid = target != ignore_index
    bad = valid & ((target < 0) | (target >= n_classes))
    n_valid, n_bad = torch.stack([valid.sum(), bad.sum()]).tolist()
    if n_bad:
        first = target[bad][0].item()
        raise ValueError(
            f"{name} has {n_bad} class indices outside [0, {n_classes}) (e.g. {first}) that are not "
            f"ignore_index={ignore_index}"
        )
    return int(n_valid)


def reduce_rows(per_row: torch.Tensor, reduction: str, n_valid: int) -> torch.Tensor:
    """Per-row fp32 values reduced as torch reduces a loss (mean over the non-ignored rows)."""
    if reduction == "none":
        return per_row
    total = per_row.sum()
    if reduction == "mean":
        # All ignored: torch gives 0/0 = NaN; Onca gives 0 (see the module docstring).
        total = total / max(n_valid, 1)
    return total


# ---------------------------------------------------------------------------------------- autograd


def _bump_version(t: torch.Tensor) -> None:
    bump = getattr(torch.autograd.graph, "increment_version", None)
    if bump is not None:
        bump(t)


class ForwardGradients:
    """Gradients computed in the forward pass, handed to autograd by the backward pass.

    Each backward scales them in place by the incoming gradient (nothing to do when it is 1). A
    second backward through the same graph (``retain_graph=True``, or a benchmark timing backward)
    gets them again, rescaled from the last incoming gradient to the new one, as long as nobody has
    modified them since (autograd may have made them a leaf's ``.grad``; their version counters
    tell); otherwise it is refused with an error rather than answered wrongly.
    """

    def __init__(self, tensors, per_row: bool = False):
        self.tensors = tuple(tensors)
        self.per_row = per_row
        self.applied: torch.Tensor | None = None  # the incoming gradient now folded in; None: 1
        self.versions: list | None = None

    def take(self, grad_output: torch.Tensor) -> tuple:
        g = grad_output.detach().to(torch.float32)
        g = g.reshape(-1) if self.per_row else g.reshape(())
        if self.versions is not None and any(
            t is not None and t._version != v for t, v in zip(self.tensors, self.versions)
        ):
            raise RuntimeError(
                "the gradients this op computed in the forward pass were modified after the first "
                "backward (e.g. accumulated into a .grad); backward through the same graph again is "
                "not supported"
            )
        prev = self.applied
        if prev is None:
            if self.per_row:
                self._scale(g[:, None])
            elif float(g) != 1.0:
                self._scale(g)
        elif torch.equal(prev, g):
            pass
        elif not self.per_row and float(prev) != 0.0:
            self._scale(g / prev)
        else:
            raise RuntimeError(
                "a second backward with a different per-token or zero incoming gradient cannot reuse "
                "the gradients computed in the forward pass; recompute the loss instead"
            )
        self.applied = g.clone()
        self.versions = [t._version if t is not None else None for t in self.tensors]
        # Fresh views: autograd can make them a leaf's .grad without a copy (it copies a tensor
        # that something else still references), and they share the version counters checked above.
        return tuple(t.view(t.shape) if t is not None else None for t in self.tensors)

    def _scale(self, factor: torch.Tensor) -> None:
        for t in self.tensors:
            if t is not None:
                t.mul_(factor)


class CrossEntropyFunction(torch.autograd.Function):
    """Autograd wrapper.

    Saved for backward: with ``in_place_backward`` only the gradient (held in the logits' storage);
    otherwise the 2-D logits, the targets and one fp32 ``lse`` per token, from which the backward
    kernel writes the gradient in one pass.
    """

    @staticmethod
    def forward(ctx, logits, target, ignore_index, label_smoothing, reduction, lse_square_scale,
                softcap, return_z_loss, in_place_backward, grad_enabled=True):
        validate_options(ignore_index, label_smoothing, reduction, lse_square_scale, softcap)
        x2d, target1d = _validate_inputs(logits, target)
        n_valid = count_targets(target1d, x2d.shape[1], ignore_index)
        # needs_input_grad does not see torch.no_grad(): the caller tells whether grad mode was on.
        needs_grad = ctx.needs_input_grad[0] and grad_enabled
        in_place = bool(in_place_backward) and needs_grad
        if in_place and x2d.untyped_storage().data_ptr() == logits.untyped_storage().data_ptr():
            _bump_version(logits)  # the caller's storage is about to hold the gradient
        grad_scale = 1.0 / max(n_valid, 1) if reduction == "mean" else 1.0
        loss_rows, lse = cross_entropy_rows(
            x2d, target1d, ignore_index=ignore_index, label_smoothing=label_smoothing,
            lse_square_scale=lse_square_scale, softcap=softcap,
            grad=x2d if in_place else None, grad_scale=grad_scale,
        )
        ctx.set_materialize_grads(False)
        ctx.in_place, ctx.reduction, ctx.logits_shape = in_place, reduction, logits.shape
        ctx.options = dict(ignore_index=ignore_index, label_smoothing=label_smoothing,
                           lse_square_scale=lse_square_scale, softcap=softcap)
        ctx.grad_scale = grad_scale
        if in_place:
            ctx.grad = ForwardGradients([x2d], per_row=reduction == "none")
        elif needs_grad:
            ctx.save_for_backward(x2d, target1d, lse)
        shape = logits.shape[:-1]
        loss = reduce_rows(loss_rows, reduction, n_valid).to(logits.dtype)
        if reduction == "none":
            loss = loss.view(shape)
        if not return_z_loss:
            return loss
        valid = (target1d != ignore_index).to(torch.float32)
        z = reduce_rows(lse_square_scale * lse * lse * valid, reduction, n_valid).to(logits.dtype)
        if reduction == "none":
            z = z.view(shape)
        ctx.mark_non_differentiable(z)
        return loss, z

    @staticmethod
    def backward(ctx, grad_loss, *_):
        if grad_loss is None:
            return (None,) * 10
        per_row = ctx.reduction == "none"
        g = grad_loss.reshape(-1) if per_row else grad_loss.reshape(())
        if ctx.in_place:
            grad, = ctx.grad.take(g)
        else:
            x2d, target1d, lse = ctx.saved_tensors
            grad = torch.empty(x2d.shape, dtype=x2d.dtype, device=x2d.device)
            cross_entropy_rows(
                x2d, target1d, **ctx.options, compute_lse=False, lse=lse, grad=grad,
                grad_scale=ctx.grad_scale, scale=g if per_row else g.reshape(()),
            )
        return grad.view(ctx.logits_shape), None, None, None, None, None, None, None, None, None


def validate_options(ignore_index, label_smoothing, reduction, lse_square_scale, softcap) -> None:
    """The scalar options shared by cross entropy and fused linear cross entropy."""
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"ignore_index must be an int, got {ignore_index!r}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if not isinstance(label_smoothing, (int, float)) or not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be a number in [0, 1], got {label_smoothing!r}")
    if not isinstance(lse_square_scale, (int, float)) or not 0.0 <= lse_square_scale < float("inf"):
        raise ValueError(f"lse_square_scale must be a finite number >= 0, got {lse_square_scale!r}")
    if softcap is not None and (not isinstance(softcap, (int, float)) or not 0.0 < softcap < float("inf")):
        raise ValueError(f"softcap must be None or a finite number > 0, got {softcap!r}")


def check_target(target, name: str, shape: tuple[int, ...], what: str) -> torch.Tensor:
    """``target`` as a contiguous 1-D index tensor, after checking its dtype and shape."""
    check_tensor(target, name)
    if target.dtype.is_floating_point:
        raise TypeError(
            f"{name} must be an int32 or int64 tensor of class indices, got {target.dtype} "
            "(class-probability targets are not supported)"
        )
    check_index(target, name)
    if tuple(target.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)} ({what}), got {tuple(target.shape)}")
    return target.reshape(-1).contiguous()


def _validate_inputs(logits, target):
    check_float(logits, "logits")
    if logits.dim() < 2:
        raise ValueError(f"logits must be (tokens, vocab) or (..., vocab), got shape {tuple(logits.shape)}")
    check_nonempty(logits, "logits")
    target1d = check_target(target, "target", logits.shape[:-1], "the logits' shape without the vocab")
    check_same_device(target, "target", logits, "logits")
    x2d = logits
    if x2d.stride(-1) != 1:
        x2d = x2d.contiguous()
    x2d = x2d.reshape(-1, x2d.shape[-1])
    if x2d.stride(1) != 1 or (x2d.shape[0] > 1 and x2d.stride(0) < x2d.shape[1]):
        x2d = x2d.contiguous()
    return x2d, target1d


def cross_entropy(logits, target, ignore_index=-100, label_smoothing=0.0, reduction="mean",
                  lse_square_scale=0.0, softcap=None, return_z_loss=False, in_place_backward=False):
    """Cross entropy of ``logits`` (``(..., vocab)``) against integer ``target`` (``(...)``).
    See the module docstring. Returns the loss, or ``(loss, z_loss)`` with ``return_z_loss``."""
    return CrossEntropyFunction.apply(logits, target, ignore_index, label_smoothing, reduction,
                                      lse_square_scale, softcap, return_z_loss, in_place_backward,
                                      torch.is_grad_enabled())
