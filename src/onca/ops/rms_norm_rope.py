"""Per-head RMSNorm, then RoPE, of q and k in one pass: ``rope(rms_norm(x) * (offset + w), cos, sin)``.

This is the q/k path of attention layers that normalise each head before rotating it (Qwen3,
Qwen3-MoE, Qwen3-VL's language model, Gemma 3: ``apply_rotary_pos_emb(q_norm(q).transpose(1, 2), ...)``). Apart, the norm
writes its output and RoPE reads it back, and in the backward RoPE's gradient is written and read
back by the norm's backward: one round trip of the heads' bytes per pass, which this op saves. Under
``torch.compile`` the two are an inductor kernel and an opaque op that inductor cannot fuse.

``q`` and ``k`` are ``(batch, seq, heads, head_dim)`` (the projections' ``view`` before the
transpose to ``(batch, heads, seq, head_dim)``; k may have fewer heads), read in place in any layout
with a unit last-dim stride, each normalised by its own weight; ``cos``/``sin`` are ``(1 or batch,
seq, head_dim)`` or ``(seq, head_dim)`` tables in the ``rotate_half`` convention of
``onca.ops.rope`` (both halves read: no duplicated rows needed), over the whole head (partial rotary
is not this op). The results have ``q``'s and ``k``'s shapes, contiguous.

Arithmetic, as the two ops apart: the norm as ``onca.ops.rms_norm`` (``casting_mode`` ``llama``,
``gemma`` or ``none``, ``offset`` for ``1 + w``), its output rounded to the input's dtype; the
rotation in fp32 from that, rounded once to the dtype PyTorch promotes the input, ``cos`` and ``sin``
to. The backward rounds the rotation's adjoint to the input's dtype before the norm's backward, as the unfused
RoPE backward stores it.

Rows are heads of ``head_dim`` columns (one head of one token), a tile of rows at a time; each half
of a head is one load. One launch covers q's rows and then k's, forward and backward (the backward's
two weight gradients are two planes of one partial-sum buffer: one fill, one summing launch), where
two launches per direction and two sums cost host time at the sizes where the host is the cost.
Saved for backward: ``q``, ``k``, the weights and the tables (references, no copies); each row's
``rstd`` is recomputed in the backward, which loads the row anyway. The weights' gradients are
reduced deterministically through per-program partial rows (``onca.ops._partials``); ``cos``/``sin``
get none (fixed positions and frequencies). ``overwrite_grad_output=True`` (opt-in, eager route
only) writes ``dq``/``dk`` over the incoming gradients, as liger-kernel's in-place backward does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from onca.device import DeviceProfile
from onca.ops._contract import custom_op, register_autograd, tracing
from onca.ops._launch import fast_launch
from onca.ops._partials import accumulate_partial, partial_row
from onca.ops._row_norm import launch_backward, launch_forward, plans
from onca.ops._validate import check_float, check_same_device
from onca.ops.rms_norm import _normalized, _scale, _weight, grad_output_buffer, validate_options

__all__ = ["MAX_HEAD_DIM", "plan", "rms_norm_rope"]

# Live tiles, as the planner counts them over a (heads x head_dim) tile: x, w, cos, sin, y as
# loaded or stored; x, n, cos, sin, y in fp32.
FORWARD_TILES = dict(live_tiles=5, fp32_tiles=5)
# dy, x, w, cos, sin, dx; dy, g, x, n, dn, cos, sin, dx in fp32.
BACKWARD_TILES = dict(live_tiles=6, fp32_tiles=8)

# A head is one tile (the norm's sum and the rotation's pairs are both within it).
MAX_HEAD_DIM = 1024


# ----------------------------------------------------------------------------------------- kernels


@triton.jit
def _row_offsets(rows, heads, seq_len, sb, ss, sh):
    """Each row's (one head of one token) offset in a tensor of (batch, seq, head) strides
    ``sb, ss, sh`` (a table: ``sh = 0``)."""
    rows64 = rows.to(tl.int64)
    tok = rows64 // heads
    b = tok // seq_len
    return b * sb + (tok - b * seq_len) * ss + (rows64 - tok * heads) * sh


@triton.jit
def _halves(ptr, row_offsets, j, mask, HALF: tl.constexpr):
    """A tile's two halves (columns ``j`` and ``j + HALF`` of each row) as fp32."""
    at = ptr + row_offsets[:, None] + j[None, :]
    first = tl.load(at, mask=mask, other=0.0).to(tl.float32)
    second = tl.load(at + HALF, mask=mask, other=0.0).to(tl.float32)
    return first, second


@triton.jit
def _norm_halves(x1, x2, w1, w2, rstd, offset, HAS_WEIGHT: tl.constexpr, CASTING: tl.constexpr,
                 X_DTYPE: tl.constexpr):
    """The normalised halves ``n1, n2`` (as the casting mode rounds them) and the norm's output
    halves ``y1, y2`` rounded to the input dtype, in fp32."""
    n1 = _normalized(x1, rstd, CASTING, X_DTYPE)
    n2 = _normalized(x2, rstd, CASTING, X_DTYPE)
    y1 = _scale(n1, w1, offset, HAS_WEIGHT, CASTING, X_DTYPE).to(X_DTYPE).to(tl.float32)
    y2 = _scale(n2, w2, offset, HAS_WEIGHT, CASTING, X_DTYPE).to(X_DTYPE).to(tl.float32)
    return n1, n2, y1, y2


@triton.jit
def _rstd(x1, x2, eps, HALF: tl.constexpr):
    return tl.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * HALF) + eps)


@triton.jit
def _forward_side(x_ptr, w_ptr, y_ptr, cos_ptr, sin_ptr, n_rows, heads, seq_len, x_sb, x_ss, x_sh,
                  cos_sb, cos_ss, sin_sb, sin_ss, eps, offset,
                  HALF: tl.constexpr, HAS_WEIGHT: tl.constexpr, CASTING: tl.constexpr,
                  BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr):
    """Normalise and rotate this program's row blocks of one tensor (q or k)."""
    X_DTYPE: tl.constexpr = x_ptr.dtype.element_ty
    j = tl.arange(0, BLOCK_COLS // 2)
    j_mask = j < HALF
    w1 = _weight(w_ptr, j, j_mask, HAS_WEIGHT)
    w2 = _weight(w_ptr + HALF, j, j_mask, HAS_WEIGHT)
    for row_block in tl.range(tl.program_id(0), tl.cdiv(n_rows, BLOCK_ROWS), tl.num_programs(0)):
        rows = row_block * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        mask = (rows < n_rows)[:, None] & j_mask[None, :]
        x1, x2 = _halves(x_ptr, _row_offsets(rows, heads, seq_len, x_sb, x_ss, x_sh), j, mask, HALF)
        _n1, _n2, y1, y2 = _norm_halves(x1, x2, w1, w2, _rstd(x1, x2, eps, HALF), offset, HAS_WEIGHT, CASTING,
                                        X_DTYPE)
        c1, c2 = _halves(cos_ptr, _row_offsets(rows, heads, seq_len, cos_sb, cos_ss, 0), j, mask, HALF)
        s1, s2 = _halves(sin_ptr, _row_offsets(rows, heads, seq_len, sin_sb, sin_ss, 0), j, mask, HALF)
        y_at = y_ptr + rows.to(tl.int64)[:, None] * (2 * HALF) + j[None, :]
        tl.store(y_at, (y1 * c1 - y2 * s1).to(y_ptr.dtype.element_ty), mask=mask)
        tl.store(y_at + HALF, (y2 * c2 + y1 * s2).to(y_ptr.dtype.element_ty), mask=mask)


@fast_launch
@triton.jit
def _rms_norm_rope_forward_kernel(
    q_ptr, k_ptr, wq_ptr, wk_ptr, yq_ptr, yk_ptr, cos_ptr, sin_ptr,
    q_rows, k_rows, q_heads, k_heads, seq_len, q_sb, q_ss, q_sh, k_sb, k_ss, k_sh,
    cos_sb, cos_ss, sin_sb, sin_ss, eps, offset,
    HALF: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    CASTING: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    COL_TILES: tl.constexpr,
):
    """q's heads, then k's: the programs of one grid take the row blocks of each in turn."""
    tl.static_assert(COL_TILES == 1, "a head is one tile")
    _forward_side(q_ptr, wq_ptr, yq_ptr, cos_ptr, sin_ptr, q_rows, q_heads, seq_len, q_sb, q_ss, q_sh,
                  cos_sb, cos_ss, sin_sb, sin_ss, eps, offset,
                  HALF, HAS_WEIGHT, CASTING, BLOCK_ROWS, BLOCK_COLS)
    _forward_side(k_ptr, wk_ptr, yk_ptr, cos_ptr, sin_ptr, k_rows, k_heads, seq_len, k_sb, k_ss, k_sh,
                  cos_sb, cos_ss, sin_sb, sin_ss, eps, offset,
                  HALF, HAS_WEIGHT, CASTING, BLOCK_ROWS, BLOCK_COLS)


@triton.jit
def _backward_side(dy_ptr, x_ptr, w_ptr, dx_ptr, dw_partial_ptr, cos_ptr, sin_ptr, n_rows, heads, seq_len,
                   dy_sb, dy_ss, dy_sh, x_sb, x_ss, x_sh, cos_sb, cos_ss, sin_sb, sin_ss, eps, offset,
                   HALF: tl.constexpr, HAS_WEIGHT: tl.constexpr, CASTING: tl.constexpr,
                   BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr, DIRECT_PARTIALS: tl.constexpr):
    """The rotation's adjoint ``g1 = dy1 * c1 + dy2 * s2``, ``g2 = dy2 * c2 - dy1 * s1`` (rounded to
    the input dtype), then RMSNorm's backward of ``g`` with ``rstd`` recomputed from ``x``, over
    this program's row blocks of one tensor; its weight's column sums go to its partial row. ``dx``
    may be ``dy`` itself: each element is loaded before it is stored, by the same program."""
    X_DTYPE: tl.constexpr = x_ptr.dtype.element_ty
    j = tl.arange(0, BLOCK_COLS // 2)
    j_mask = j < HALF
    w1 = _weight(w_ptr, j, j_mask, HAS_WEIGHT)
    w2 = _weight(w_ptr + HALF, j, j_mask, HAS_WEIGHT)
    dw1 = tl.zeros([BLOCK_COLS // 2], dtype=tl.float32)
    dw2 = tl.zeros([BLOCK_COLS // 2], dtype=tl.float32)
    for row_block in tl.range(tl.program_id(0), tl.cdiv(n_rows, BLOCK_ROWS), tl.num_programs(0)):
        rows = row_block * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        mask = (rows < n_rows)[:, None] & j_mask[None, :]
        dy1, dy2 = _halves(dy_ptr, _row_offsets(rows, heads, seq_len, dy_sb, dy_ss, dy_sh), j, mask, HALF)
        c1, c2 = _halves(cos_ptr, _row_offsets(rows, heads, seq_len, cos_sb, cos_ss, 0), j, mask, HALF)
        s1, s2 = _halves(sin_ptr, _row_offsets(rows, heads, seq_len, sin_sb, sin_ss, 0), j, mask, HALF)
        g1 = (dy1 * c1 + dy2 * s2).to(X_DTYPE).to(tl.float32)
        g2 = (dy2 * c2 - dy1 * s1).to(X_DTYPE).to(tl.float32)
        x1, x2 = _halves(x_ptr, _row_offsets(rows, heads, seq_len, x_sb, x_ss, x_sh), j, mask, HALF)
        rstd = _rstd(x1, x2, eps, HALF)
        n1 = _normalized(x1, rstd, CASTING, X_DTYPE)
        n2 = _normalized(x2, rstd, CASTING, X_DTYPE)
        if HAS_WEIGHT:
            dw1 += tl.sum(g1 * n1, axis=0)
            dw2 += tl.sum(g2 * n2, axis=0)
        dn1 = _scale(g1, w1, offset, HAS_WEIGHT, CASTING, X_DTYPE)
        dn2 = _scale(g2, w2, offset, HAS_WEIGHT, CASTING, X_DTYPE)
        c = (tl.sum(dn1 * n1, axis=1) + tl.sum(dn2 * n2, axis=1)) / (2 * HALF)
        dx_at = dx_ptr + rows.to(tl.int64)[:, None] * (2 * HALF) + j[None, :]
        dx_dtype = dx_ptr.dtype.element_ty
        tl.store(dx_at, ((dn1 - n1 * c[:, None]) * rstd[:, None]).to(dx_dtype), mask=mask)
        tl.store(dx_at + HALF, ((dn2 - n2 * c[:, None]) * rstd[:, None]).to(dx_dtype), mask=mask)
    if HAS_WEIGHT:
        dw_row = partial_row(dw_partial_ptr, 2 * HALF)
        accumulate_partial(dw_row, j, dw1, j_mask, DIRECT_PARTIALS)
        accumulate_partial(dw_row + HALF, j, dw2, j_mask, DIRECT_PARTIALS)


@fast_launch
@triton.jit
def _rms_norm_rope_backward_kernel(
    dyq_ptr, dyk_ptr, q_ptr, k_ptr, wq_ptr, wk_ptr, dq_ptr, dk_ptr, cos_ptr, sin_ptr,
    q_rows, k_rows, q_heads, k_heads, seq_len,
    dyq_sb, dyq_ss, dyq_sh, dyk_sb, dyk_ss, dyk_sh, q_sb, q_ss, q_sh, k_sb, k_ss, k_sh,
    cos_sb, cos_ss, sin_sb, sin_ss, eps, offset,
    dwq_partial_ptr, dwk_partial_ptr, _scratch_ptr,
    HALF: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    CASTING: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    COL_TILES: tl.constexpr,
    DIRECT_PARTIALS: tl.constexpr,
):
    tl.static_assert(COL_TILES == 1, "a head is one tile")
    _backward_side(dyq_ptr, q_ptr, wq_ptr, dq_ptr, dwq_partial_ptr, cos_ptr, sin_ptr, q_rows, q_heads,
                   seq_len, dyq_sb, dyq_ss, dyq_sh, q_sb, q_ss, q_sh, cos_sb, cos_ss, sin_sb, sin_ss,
                   eps, offset,
                   HALF, HAS_WEIGHT, CASTING, BLOCK_ROWS, BLOCK_COLS, DIRECT_PARTIALS)
    _backward_side(dyk_ptr, k_ptr, wk_ptr, dk_ptr, dwk_partial_ptr, cos_ptr, sin_ptr, k_rows, k_heads,
                   seq_len, dyk_sb, dyk_ss, dyk_sh, k_sb, k_ss, k_sh, cos_sb, cos_ss, sin_sb, sin_ss,
                   eps, offset,
                   HALF, HAS_WEIGHT, CASTING, BLOCK_ROWS, BLOCK_COLS, DIRECT_PARTIALS)


# --------------------------------------------------------------------------------------- launchers


def plan(shape, dtype: torch.dtype, profile: DeviceProfile | None = None) -> dict:
    """The forward and backward plans for ``shape = (batch, seq, q_heads, kv_heads, head_dim)``
    (or ``(batch, seq, heads, head_dim)``: as many kv heads as q heads). Rows are the heads of q
    and of k, a head one tile."""
    shape = tuple(int(n) for n in shape)
    if len(shape) == 4:
        shape = (*shape[:3], shape[2], shape[3])
    if len(shape) != 5:
        raise ValueError(f"rms_norm_rope plan shape must be (batch, seq, q_heads, kv_heads, head_dim) "
                         f"or (batch, seq, heads, head_dim), got {shape}")
    batch, seq, hq, hk, head_dim = shape
    return plans((batch * seq * (hq + hk), head_dim), dtype, FORWARD_TILES, BACKWARD_TILES, profile)


def _heads(t: Tensor) -> tuple[Tensor, tuple[int, int, int]]:
    """``t`` (4-D) with a unit last-dim stride, and its (batch, seq, head) strides: any layout of the
    heads is read in place (a transposed gradient, a view of a fused projection)."""
    t = t if t.stride(-1) == 1 else t.contiguous()
    return t, t.stride()[:3]


def _table(t: Tensor) -> tuple[Tensor, tuple[int, int]]:
    """A ``(1 or batch, seq, head_dim)`` or ``(seq, head_dim)`` table with a unit last-dim stride, and
    its (batch, seq) strides (a broadcast batch reads with stride 0)."""
    t = t if t.stride(-1) == 1 else t.contiguous()
    if t.dim() == 2:
        return t, (0, t.stride(0))
    return t, ((t.stride(0) if t.shape[0] > 1 else 0), t.stride(1))


def _output_dtype(x: Tensor, cos: Tensor, sin: Tensor) -> torch.dtype:
    return torch.promote_types(torch.promote_types(x.dtype, cos.dtype), sin.dtype)


def _sizes(q: Tensor, k: Tensor) -> tuple[int, int, int, int, int]:
    """``(q rows, k rows, q heads, k heads, seq)``: a row is one head of one token."""
    batch, seq, hq, _ = q.shape
    hk = k.shape[2]
    return batch * seq * hq, batch * seq * hk, hq, hk, seq


@custom_op("rms_norm_rope_forward")
def rms_norm_rope_forward(q: Tensor, k: Tensor, q_weight: Tensor | None, k_weight: Tensor | None, cos: Tensor,
                          sin: Tensor, eps: float, offset: float, casting: int,
                          overwrite_grad_output: bool) -> tuple[Tensor, Tensor]:
    """The rotated, normalised heads of 4-D ``q`` and ``k`` ``(batch, seq, heads, head_dim)``, new
    contiguous tensors. ``overwrite_grad_output`` is the backward's (see ``rms_norm_rope``)."""
    yq = torch.empty(q.shape, dtype=_output_dtype(q, cos, sin), device=q.device)
    yk = torch.empty(k.shape, dtype=_output_dtype(k, cos, sin), device=k.device)
    q_rows, k_rows, hq, hk, seq = _sizes(q, k)
    if q_rows + k_rows == 0:
        return yq, yk
    (q, q_strides), (k, k_strides) = _heads(q), _heads(k)
    (cos, cos_strides), (sin, sin_strides) = _table(cos), _table(sin)
    launch_forward(
        _rms_norm_rope_forward_kernel,
        (q, k, q if q_weight is None else q_weight, k if k_weight is None else k_weight, yq, yk, cos, sin,
         q_rows, k_rows, hq, hk, seq, *q_strides, *k_strides, *cos_strides, *sin_strides, eps, offset),
        q_rows + k_rows, q.shape[-1], q.dtype, FORWARD_TILES,
        HALF=q.shape[-1] // 2, HAS_WEIGHT=q_weight is not None, CASTING=casting,
    )
    return yq, yk


@rms_norm_rope_forward.register_fake
def _(q, k, q_weight, k_weight, cos, sin, eps, offset, casting, overwrite_grad_output):
    return (q.new_empty(q.shape, dtype=_output_dtype(q, cos, sin)),
            k.new_empty(k.shape, dtype=_output_dtype(k, cos, sin)))


@custom_op("rms_norm_rope_backward")
def rms_norm_rope_backward(dyq: Tensor, dyk: Tensor, q: Tensor, k: Tensor, q_weight: Tensor | None,
                           k_weight: Tensor | None, cos: Tensor, sin: Tensor, eps: float, offset: float,
                           casting: int, overwrite_grad_output: bool
                           ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(dq, dk, dq_weight, dk_weight)`` (the weights' empty without weights); ``dq``/``dk``
    contiguous in ``q``/``k``'s dtype, written into ``dyq``/``dyk``'s storage with
    ``overwrite_grad_output`` (eager route only) where their layout and dtype allow."""
    dq = grad_output_buffer(dyq, q, overwrite_grad_output)
    dk = grad_output_buffer(dyk, k, overwrite_grad_output)
    q_rows, k_rows, hq, hk, seq = _sizes(q, k)
    if q_rows + k_rows == 0:
        return dq, dk, *_weight_grads_of_nothing(q, q_weight, k_weight)
    (dyq, dyq_strides), (dyk, dyk_strides) = _heads(dyq), _heads(dyk)
    (q, q_strides), (k, k_strides) = _heads(q), _heads(k)
    (cos, cos_strides), (sin, sin_strides) = _table(cos), _table(sin)
    has_weight = q_weight is not None
    dw = launch_backward(
        _rms_norm_rope_backward_kernel,
        (dyq, dyk, q, k, q_weight if has_weight else q, k_weight if has_weight else k, dq, dk, cos, sin,
         q_rows, k_rows, hq, hk, seq, *dyq_strides, *dyk_strides, *q_strides, *k_strides, *cos_strides,
         *sin_strides, eps, offset),
        q_rows + k_rows, q.shape[-1], q.dtype, BACKWARD_TILES,
        grad_dtypes=(q_weight.dtype, k_weight.dtype) if has_weight else (None, None), row_stats=0,
        stand_in=q.new_empty(0, dtype=torch.float32), cap_registers=q.element_size() == 2,
        HALF=q.shape[-1] // 2, HAS_WEIGHT=has_weight, CASTING=casting,
    )
    return (dq, dk, *dw) if has_weight else (dq, dk, *_weight_grads_of_nothing(q, None, None))


def _weight_grads_of_nothing(q, q_weight, k_weight) -> tuple[Tensor, Tensor]:
    """The weights' gradients where no row contributes (zeros), or empty placeholders without weights."""
    if q_weight is None:
        return q.new_empty(0), q.new_empty(0)
    return torch.zeros_like(q_weight), torch.zeros_like(k_weight)


@rms_norm_rope_backward.register_fake
def _(dyq, dyk, q, k, q_weight, k_weight, cos, sin, eps, offset, casting, overwrite_grad_output):
    if q_weight is None:
        dwq, dwk = q.new_empty(0), q.new_empty(0)
    else:
        dwq, dwk = torch.empty_like(q_weight), torch.empty_like(k_weight)
    return q.new_empty(q.shape), k.new_empty(k.shape), dwq, dwk


# ---------------------------------------------------------------------------------------- autograd


def _setup_context(ctx, inputs, output):
    q, k, q_weight, k_weight, cos, sin, eps, offset, casting, overwrite_grad_output = inputs
    ctx.save_for_backward(q, k, q_weight, k_weight, cos, sin)
    ctx.eps, ctx.offset, ctx.casting, ctx.overwrite_grad_output = eps, offset, casting, overwrite_grad_output


def _backward(ctx, dyq, dyk):
    q, k, q_weight, k_weight, cos, sin = ctx.saved_tensors
    if dyq is None and dyk is None:
        return (None,) * 10
    # An output nothing used gets zeros: its weight's gradient is then zero, as autograd's would be.
    dyq = torch.zeros(q.shape, dtype=_output_dtype(q, cos, sin), device=q.device) if dyq is None else dyq
    dyk = torch.zeros(k.shape, dtype=_output_dtype(k, cos, sin), device=k.device) if dyk is None else dyk
    overwrite = ctx.overwrite_grad_output and not tracing(dyq, dyk)
    dq, dk, dwq, dwk = rms_norm_rope_backward(dyq, dyk, q, k, q_weight, k_weight, cos, sin, ctx.eps,
                                              ctx.offset, ctx.casting, overwrite)
    weights = (None, None) if q_weight is None else (dwq, dwk)
    return dq, dk, *weights, None, None, None, None, None, None


register_autograd(rms_norm_rope_forward, _backward, setup_context=_setup_context)


# ------------------------------------------------------------------------------------------ public


def _validate(q, k, q_weight, k_weight, cos, sin) -> None:
    for name, x in (("q", q), ("k", k)):
        check_float(x, name)
        if x.dim() != 4:
            raise ValueError(f"{name} must be 4-D (batch, seq, heads, head_dim), got shape {tuple(x.shape)}")
    batch, seq, _, head_dim = q.shape
    if head_dim % 2 or not 2 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"q's head_dim (last dimension) must be even and in [2, {MAX_HEAD_DIM}], "
                         f"got {head_dim}")
    if (k.shape[0], k.shape[1], k.shape[3]) != (batch, seq, head_dim) or k.dtype != q.dtype:
        raise ValueError(f"k must be (batch={batch}, seq={seq}, kv_heads, head_dim={head_dim}) of q's dtype "
                         f"{q.dtype}, got shape {tuple(k.shape)} and {k.dtype}")
    check_same_device(k, "k", q, "q")
    if (q_weight is None) != (k_weight is None):
        raise ValueError("q_weight and k_weight must both be tensors or both be None")
    for name, w in (("q_weight", q_weight), ("k_weight", k_weight)):
        if w is not None:
            check_float(w, name)
            if tuple(w.shape) != (head_dim,):
                raise ValueError(f"{name} must be 1-D (head_dim={head_dim},), got shape {tuple(w.shape)}")
            check_same_device(w, name, q, "q")
    for name, t in (("cos", cos), ("sin", sin)):
        check_float(t, name)
        check_same_device(t, name, q, "q")
        table = t if t.dim() == 3 else (t.unsqueeze(0) if t.dim() == 2 else None)
        if table is None or table.shape[0] not in (1, batch) or tuple(table.shape[1:]) != (seq, head_dim):
            raise ValueError(
                f"{name} must be (1 or batch={batch}, seq={seq}, head_dim={head_dim}) or (seq, head_dim) "
                f"(full rotary, rotate_half halves), got shape {tuple(t.shape)}")


def rms_norm_rope(
    q: Tensor,
    k: Tensor,
    q_weight: Tensor | None,
    k_weight: Tensor | None,
    cos: Tensor,
    sin: Tensor,
    eps: float = 1e-6,
    offset: float = 0.0,
    casting_mode: str = "llama",
    overwrite_grad_output: bool = False,
) -> tuple[Tensor, Tensor]:
    """RMSNorm over each head of ``q`` and of ``k`` (``(batch, seq, heads, head_dim)``, k with as
    many or fewer heads), each with its own weight, then RoPE on both: ``(q_embed, k_embed)``.

    Equals ``rotary(rms_norm(x, weight, eps, offset, casting_mode), cos, sin)`` for each, the
    rotation ``y = n * cos + rotate_half(n) * sin`` broadcast over heads (``cos``/``sin``: ``(1 or
    batch, seq, head_dim)`` or ``(seq, head_dim)``, full rotary), in one launch and one pass over
    memory each way. The norm's options are ``onca.ops.rms_norm.rms_norm``'s (weights None: no
    scale). The results are ``(batch, seq, heads, head_dim)``, contiguous, in the dtype PyTorch
    promotes ``q``, ``cos`` and ``sin`` to: ``.transpose(1, 2)`` gives attention's ``(batch, heads,
    seq, head_dim)``. Gradients flow to ``q``, ``k`` and the weights; ``cos``/``sin`` get none.
    ``overwrite_grad_output=True`` lets the backward pass write ``dq``/``dk`` into the storage of
    the gradients that arrive for the outputs (eager only; compiled graphs manage their own buffers).
    """
    _validate(q, k, q_weight, k_weight, cos, sin)
    casting = validate_options(q, eps, offset, casting_mode, overwrite_grad_output)
    q_weight = None if q_weight is None else q_weight.contiguous()
    k_weight = None if k_weight is None else k_weight.contiguous()
    return rms_norm_rope_forward(q, k, q_weight, k_weight, cos, sin, float(eps), float(offset), casting,
                                 overwrite_grad_output)
