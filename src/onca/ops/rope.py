"""Rotary position embedding (RoPE) in the Hugging Face ``rotate_half`` convention.

For a head ``x`` of width ``head_dim`` and ``cos``/``sin`` rows of width ``rotary_dim`` (``R``,
even, at most ``head_dim``), with ``h = R / 2``::

    y[:h]  = x[:h] * cos[:h] - x[h:R] * sin[:h]
    y[h:R] = x[h:R] * cos[h:] + x[:h] * sin[h:]
    y[R:]  = x[R:]                                      (partial rotary: passed through)

which is ``x * cos + rotate_half(x) * sin`` on the first ``R`` dims, as in transformers'
``apply_rotary_pos_emb`` (Llama, Qwen, Mistral: ``R == head_dim``; Phi-3 style partial rotary:
``R < head_dim``). The interleaved convention (GLM's ``x[0::2]``/``x[1::2]`` pairs) is not this op.

One launch rotates ``q`` (``Hq`` heads) and ``k`` (``Hk`` heads, ``Hk`` may differ: GQA/MQA). A
program takes a block of tokens, loads their ``cos``/``sin`` rows once (both halves, so cos/sin need
not be duplicated ``cat(freqs, freqs)`` rows), and applies them to every head of ``q`` and ``k`` of
those tokens, a tile of (tokens x heads x half-width) at a time: each half is one wide load.

Layouts: ``unsqueeze_dim=1`` takes ``(batch, heads, seq, head_dim)`` tensors, ``unsqueeze_dim=2``
``(batch, seq, heads, head_dim)``; ``cos``/``sin`` are ``(1 or batch, seq, rotary_dim)``. Any strides
with a unit last-dim stride are read in place (e.g. ``q_proj(x).view(B, S, H, D).transpose(1, 2)``);
the outputs take the input's memory layout (``torch.empty_like``), as PyTorch's elementwise ops do.

The output dtype follows PyTorch's promotion of ``q`` (``k``), ``cos`` and ``sin``, as the Hugging
Face expression does; the kernels compute in fp32 and round once.

Backward is the adjoint of the rotation (with duplicated cos/sin rows: the rotation by ``-sin``),
one launch for ``dq`` and ``dk``. Saved for backward: ``cos`` and ``sin`` only (references to the
caller's tensors, no copies). ``cos``/``sin`` get no gradient (``None``): they are derived from
fixed frequencies and positions and are never trained. ``in_place_backward=True`` (opt-in) writes
``dq``/``dk`` over the incoming gradients instead of new buffers.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from onca.device import DeviceProfile, get_profile
from onca.ops._validate import check_float, check_nonempty, check_same_device
from onca.tiling import RowPlan, next_power_of_2, plan_rows

__all__ = ["RopeTiles", "RotaryPosEmbFunction", "plan", "rotary_pos_emb", "tiles"]

# Live tiles of the kernel per element of a (tokens x heads x half-width) tile, as the planner
# counts them: x1, x2 as loaded and y1, y2 as stored (input / output dtype); x1, x2, y1, y2 in fp32;
# and the per-token cos/sin halves (c1, c2, s1, s2) as loaded (at most 4 bytes) and in fp32. The
# cos/sin tiles are (tokens x half-width), a head block's fraction of a full tile; they are counted
# as full tiles so the budget holds even for a one-head block. The pass-through copy of a partial
# rotary head uses at most two tiles of twice the half-width (in and out), within this count.
TILES = dict(live_tiles=4, fp32_tiles=4 + 8)


# ----------------------------------------------------------------------------------------- kernels


@triton.jit
def _rotate_heads(
    x_ptr, y_ptr, x_tok, y_tok, row_mask, n_heads, x_sh, y_sh,
    j, j_mask, c1, c2, a, b,
    HALF: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """Rotate every head of the tokens ``x_tok`` (row offsets) in blocks of ``BLOCK_H`` heads."""
    h_range = tl.arange(0, BLOCK_H)
    for h0 in tl.range(0, n_heads, BLOCK_H):
        heads = h0 + h_range
        h64 = heads.to(tl.int64)
        mask = row_mask[:, None, None] & (heads < n_heads)[None, :, None] & j_mask[None, None, :]
        x_off = x_tok[:, None, None] + (h64 * x_sh)[None, :, None] + j[None, None, :]
        y_off = y_tok[:, None, None] + (h64 * y_sh)[None, :, None] + j[None, None, :]
        x1 = tl.load(x_ptr + x_off, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(x_ptr + x_off + HALF, mask=mask, other=0.0).to(tl.float32)
        y1 = x1 * c1 + x2 * a
        y2 = x2 * c2 + x1 * b
        tl.store(y_ptr + y_off, y1.to(y_ptr.dtype.element_ty), mask=mask)
        tl.store(y_ptr + y_off + HALF, y2.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _copy_heads(
    x_ptr, y_ptr, x_tok, y_tok, row_mask, n_heads, x_sh, y_sh, p, p_mask, BLOCK_H: tl.constexpr,
):
    """Copy (and cast) the columns ``p`` of every head: the pass-through part of partial rotary."""
    h_range = tl.arange(0, BLOCK_H)
    for h0 in tl.range(0, n_heads, BLOCK_H):
        heads = h0 + h_range
        h64 = heads.to(tl.int64)
        mask = row_mask[:, None, None] & (heads < n_heads)[None, :, None] & p_mask[None, None, :]
        x = tl.load(x_ptr + x_tok[:, None, None] + (h64 * x_sh)[None, :, None] + p[None, None, :],
                    mask=mask, other=0.0)
        tl.store(y_ptr + y_tok[:, None, None] + (h64 * y_sh)[None, :, None] + p[None, None, :],
                 x.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kernel(
    xq_ptr, xk_ptr, yq_ptr, yk_ptr, cos_ptr, sin_ptr,
    n_rows, seq_len, n_q_heads, n_kv_heads,
    xq_sb, xq_ss, xq_sh, yq_sb, yq_ss, yq_sh,
    xk_sb, xk_ss, xk_sh, yk_sb, yk_ss, yk_sh,
    cos_sb, cos_ss, sin_sb, sin_ss,
    HALF: tl.constexpr,
    PASS: tl.constexpr,
    BACKWARD: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    BLOCK_J: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    """Rows are tokens (``batch * seq``); row ``r`` is batch ``r // seq_len``, position ``r % seq_len``.

    Forward ``y = x * cos + rotate_half(x) * sin``; backward its adjoint
    ``dx[:h] = dy[:h] * c1 + dy[h:] * s2``, ``dx[h:] = dy[h:] * c2 - dy[:h] * s1``. Both are
    ``y1 = x1 * c1 + x2 * a`` and ``y2 = x2 * c2 + x1 * b`` with ``(a, b)`` = ``(-s1, s2)`` or
    ``(s2, -s1)``.
    """
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    n_row_blocks = tl.cdiv(n_rows, BLOCK_T)
    t_range = tl.arange(0, BLOCK_T)
    for row_block in tl.range(pid, n_row_blocks, n_programs):
        rows = row_block * BLOCK_T + t_range
        row_mask = rows < n_rows
        rows64 = rows.to(tl.int64)
        bi = rows64 // seq_len
        si = rows64 - bi * seq_len
        xq_tok = bi * xq_sb + si * xq_ss
        yq_tok = bi * yq_sb + si * yq_ss
        xk_tok = bi * xk_sb + si * xk_ss
        yk_tok = bi * yk_sb + si * yk_ss
        cos_tok = bi * cos_sb + si * cos_ss
        sin_tok = bi * sin_sb + si * sin_ss
        for j0 in tl.static_range(0, HALF, BLOCK_J):
            j = j0 + tl.arange(0, BLOCK_J)
            j_mask = j < HALF
            cs_mask = row_mask[:, None] & j_mask[None, :]
            # One load of each cos/sin half per token, shared by all heads of q and k.
            cos_at = cos_ptr + cos_tok[:, None] + j[None, :]
            sin_at = sin_ptr + sin_tok[:, None] + j[None, :]
            c1 = tl.load(cos_at, mask=cs_mask, other=0.0).to(tl.float32)
            c2 = tl.load(cos_at + HALF, mask=cs_mask, other=0.0).to(tl.float32)
            s1 = tl.load(sin_at, mask=cs_mask, other=0.0).to(tl.float32)
            s2 = tl.load(sin_at + HALF, mask=cs_mask, other=0.0).to(tl.float32)
            if BACKWARD:
                a = s2
                b = -s1
            else:
                a = -s1
                b = s2
            c1 = c1[:, None, :]
            c2 = c2[:, None, :]
            a = a[:, None, :]
            b = b[:, None, :]
            _rotate_heads(xq_ptr, yq_ptr, xq_tok, yq_tok, row_mask, n_q_heads, xq_sh, yq_sh,
                          j, j_mask, c1, c2, a, b, HALF, BLOCK_HQ)
            _rotate_heads(xk_ptr, yk_ptr, xk_tok, yk_tok, row_mask, n_kv_heads, xk_sh, yk_sh,
                          j, j_mask, c1, c2, a, b, HALF, BLOCK_HK)
        if PASS > 0:
            for p0 in tl.static_range(0, PASS, BLOCK_P):
                p = 2 * HALF + p0 + tl.arange(0, BLOCK_P)
                p_mask = p < 2 * HALF + PASS
                _copy_heads(xq_ptr, yq_ptr, xq_tok, yq_tok, row_mask, n_q_heads, xq_sh, yq_sh,
                            p, p_mask, BLOCK_HQ)
                _copy_heads(xk_ptr, yk_ptr, xk_tok, yk_tok, row_mask, n_kv_heads, xk_sh, yk_sh,
                            p, p_mask, BLOCK_HK)


# ------------------------------------------------------------------------------------------ plans


@dataclass(frozen=True)
class RopeTiles:
    """The kernel's tile, derived from a ``RowPlan`` over rows = tokens and cols = heads x half.

    A tile is ``block_t`` tokens x ``block_hq`` (``block_hk``) heads x ``block_j`` columns of each
    rotary half; ``block_p`` columns of a partial-rotary head's pass-through part are copied at a
    time. ``plan.grid`` programs loop over the ``plan.row_blocks`` token blocks (a persistent grid
    on Ascend: at most one program per vector core). The plan's cols are ``max(Hq, Hk)`` times the
    half width rounded up to a power of two; when they do not fit one tile (``plan.col_tiles > 1``)
    the kernel loops over head blocks and half-width tiles with the token's cos/sin held, still in
    one pass over memory (the planner's generic "two passes" wording does not apply here).
    """

    plan: RowPlan
    half: int
    pass_cols: int
    block_t: int
    block_hq: int
    block_hk: int
    block_j: int
    block_p: int

    @property
    def j_tiles(self) -> int:
        return -(-self.half // self.block_j)

    def working_set_bytes(self, itemsize: int, cos_itemsize: int = 4) -> int:
        """Bytes the kernel holds at once: the rotation tiles of the wider head block, and the
        tokens' cos/sin tiles (the pass-through copy holds less)."""
        tile = self.block_t * max(self.block_hq, self.block_hk) * self.block_j
        cs = self.block_t * self.block_j
        return tile * (4 * itemsize + 4 * 4) + cs * 4 * (cos_itemsize + 4)


def _widest(*dtypes: torch.dtype) -> torch.dtype:
    return max(dtypes, key=lambda d: d.itemsize)


def tiles(tokens: int, n_q_heads: int, n_kv_heads: int, head_dim: int, rotary_dim: int,
          dtype: torch.dtype, profile: DeviceProfile | None = None) -> RopeTiles:
    """The tile the kernel uses for these sizes on ``profile`` (default: the detected one).

    ``dtype`` is the widest of the tensors the kernel reads and writes (q, k and their outputs).
    """
    return _tiles(int(tokens), int(n_q_heads), int(n_kv_heads), int(head_dim), int(rotary_dim), dtype,
                  profile or get_profile())


@functools.lru_cache(maxsize=1024)
def _tiles(tokens, n_q_heads, n_kv_heads, head_dim, rotary_dim, dtype, profile) -> RopeTiles:
    half = rotary_dim // 2
    half_pad = next_power_of_2(half)
    heads = max(n_q_heads, n_kv_heads)
    p = plan_rows(tokens, heads * half_pad, dtype, profile=profile, **TILES)
    block_j = min(half_pad, p.block_cols)
    block_h = p.block_cols // block_j
    pass_cols = head_dim - rotary_dim
    itemsize = dtype.itemsize
    min_block = next_power_of_2(-(-profile.align_bytes // itemsize))
    # Pass-through columns are copied this many at a time (1: no pass-through part, no variant).
    block_p = min(max(next_power_of_2(pass_cols), min_block), 2 * block_j) if pass_cols else 1
    return RopeTiles(
        plan=p, half=half, pass_cols=pass_cols, block_t=p.block_rows,
        block_hq=min(block_h, next_power_of_2(n_q_heads)), block_hk=min(block_h, next_power_of_2(n_kv_heads)),
        block_j=block_j, block_p=block_p,
    )


def plan(shape, dtype: torch.dtype, profile: DeviceProfile | None = None) -> dict[str, RowPlan]:
    """The plans for ``shape = (batch, seq, q_heads, kv_heads, head_dim[, rotary_dim])``.

    ``(batch, seq, heads, head_dim)`` means as many kv heads as q heads. Forward and backward use
    the same tile (the backward kernel is the forward one with the adjoint coefficients).
    """
    shape = tuple(int(s) for s in shape)
    if len(shape) == 4:
        batch, seq, hq, d = shape
        hk, r = hq, d
    elif len(shape) in (5, 6):
        batch, seq, hq, hk, d = shape[:5]
        r = shape[5] if len(shape) == 6 else d
    else:
        raise ValueError(
            "rope plan shape must be (batch, seq, q_heads, kv_heads, head_dim[, rotary_dim]) "
            f"or (batch, seq, heads, head_dim), got {shape}"
        )
    if r % 2 or not 2 <= r <= d:
        raise ValueError(f"rotary_dim must be even and in [2, head_dim={d}], got {r}")
    t = tiles(batch * seq, hq, hk, d, r, dtype, profile)
    return {"forward": t.plan, "backward": t.plan}


# --------------------------------------------------------------------------------------- launchers


def _bsh_strides(t: torch.Tensor, unsqueeze_dim: int) -> tuple[int, int, int]:
    """(batch, seq, head) strides of a q/k-shaped tensor in the given layout."""
    sb, s1, s2, _ = t.stride()
    return (sb, s2, s1) if unsqueeze_dim == 1 else (sb, s1, s2)  # (B, H, S, D) or (B, S, H, D)


def _cs_strides(t: torch.Tensor) -> tuple[int, int]:
    """(batch, seq) strides of a cos/sin tensor; broadcast (size-1) dims read with stride 0."""
    return (t.stride(0) if t.shape[0] > 1 else 0), (t.stride(1) if t.shape[1] > 1 else 0)


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    """``t`` with a unit last-dim stride (the kernels read rows of each head as vectors)."""
    return t if t.stride(-1) == 1 or t.shape[-1] == 1 else t.contiguous()


def _new_like(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A new tensor with ``t``'s shape and, where ``t`` is dense, its memory layout."""
    return torch.empty_like(t, dtype=dtype, memory_format=torch.preserve_format)


def _dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill its storage span exactly once (some permutation is contiguous)."""
    order = sorted(range(t.dim()), key=lambda i: t.stride(i), reverse=True)
    return t.permute(order).is_contiguous()


def _reusable(grad: torch.Tensor | None, dtype: torch.dtype) -> bool:
    """Whether the kernel may write its result over ``grad`` (same dtype, unit last-dim stride,
    no element stored twice)."""
    return grad is not None and grad.dtype == dtype and grad.stride(-1) == 1 and _dense(grad)


def rope_apply(xq, xk, cos, sin, yq_dtype, yk_dtype, unsqueeze_dim: int, backward: bool,
               yq=None, yk=None):
    """Launch the kernel once for ``q`` and ``k`` (or ``dq_embed`` and ``dk_embed`` when
    ``backward``); returns the results: new tensors, or ``yq``/``yk`` where given (``yq is xq``
    computes in place: every element is loaded before its own store)."""
    xq, xk, cos, sin = _unit_last(xq), _unit_last(xk), _unit_last(cos), _unit_last(sin)
    yq = _new_like(xq, yq_dtype) if yq is None else yq
    yk = _new_like(xk, yk_dtype) if yk is None else yk
    if unsqueeze_dim == 1:
        batch, hq, seq, d = xq.shape
        hk = xk.shape[1]
    else:
        batch, seq, hq, d = xq.shape
        hk = xk.shape[2]
    rotary_dim = cos.shape[-1]
    dtype = _widest(xq.dtype, xk.dtype, yq.dtype, yk.dtype)
    t = tiles(batch * seq, hq, hk, d, rotary_dim, dtype)
    _rope_kernel[(t.plan.grid,)](
        xq, xk, yq, yk, cos, sin,
        batch * seq, seq, hq, hk,
        *_bsh_strides(xq, unsqueeze_dim), *_bsh_strides(yq, unsqueeze_dim),
        *_bsh_strides(xk, unsqueeze_dim), *_bsh_strides(yk, unsqueeze_dim),
        *_cs_strides(cos), *_cs_strides(sin),
        HALF=t.half, PASS=t.pass_cols, BACKWARD=backward,
        BLOCK_T=t.block_t, BLOCK_HQ=t.block_hq, BLOCK_HK=t.block_hk, BLOCK_J=t.block_j,
        BLOCK_P=t.block_p,
        num_warps=t.plan.num_warps,
    )
    return yq, yk


# ---------------------------------------------------------------------------------------- autograd


class RotaryPosEmbFunction(torch.autograd.Function):
    """Autograd wrapper. Saves ``cos`` and ``sin`` (the caller's tensors, not copies); ``q`` and
    ``k`` are not needed by the backward pass. ``cos`` and ``sin`` get no gradient.

    ``in_place_backward=True`` writes ``dq``/``dk`` over the incoming gradients of ``q_embed``/
    ``k_embed`` where their dtype and layout allow (saves one q+k-sized buffer; liger-kernel always
    does this). Only safe when nothing else reads those gradients afterwards: not when ``q_embed``
    feeds a node (e.g. an addition) whose gradient tensor is shared with another branch.
    """

    @staticmethod
    def forward(ctx, q, k, cos, sin, unsqueeze_dim, in_place_backward=False):
        unsqueeze_dim = _validate(q, k, cos, sin, unsqueeze_dim)
        if not isinstance(in_place_backward, bool):
            raise TypeError(f"in_place_backward must be a bool, got {type(in_place_backward).__name__}")
        q_dtype = torch.promote_types(torch.promote_types(q.dtype, cos.dtype), sin.dtype)
        k_dtype = torch.promote_types(torch.promote_types(k.dtype, cos.dtype), sin.dtype)
        q_embed, k_embed = rope_apply(q, k, cos, sin, q_dtype, k_dtype, unsqueeze_dim, backward=False)
        ctx.save_for_backward(cos, sin)
        ctx.set_materialize_grads(False)
        ctx.unsqueeze_dim, ctx.q_dtype, ctx.k_dtype = unsqueeze_dim, q.dtype, k.dtype
        ctx.in_place = in_place_backward
        ctx.out_meta = ((q_embed.shape, q_dtype), (k_embed.shape, k_dtype))
        return q_embed, k_embed

    @staticmethod
    def backward(ctx, dq_embed, dk_embed):
        if dq_embed is None and dk_embed is None:
            return None, None, None, None, None, None
        cos, sin = ctx.saved_tensors
        grads = [dq_embed, dk_embed]
        for i, (shape, dtype) in enumerate(ctx.out_meta):
            if grads[i] is None:  # that output was not used: its input gets no gradient (as in eager)
                grads[i] = torch.zeros(shape, dtype=dtype, device=cos.device)
        outs = [None, None]
        if ctx.in_place:
            for i, dtype in enumerate((ctx.q_dtype, ctx.k_dtype)):
                if _reusable(grads[i], dtype):
                    outs[i] = grads[i]
        dq, dk = rope_apply(grads[0], grads[1], cos, sin, ctx.q_dtype, ctx.k_dtype, ctx.unsqueeze_dim,
                            backward=True, yq=outs[0], yk=outs[1])
        dq = dq if ctx.needs_input_grad[0] and dq_embed is not None else None
        dk = dk if ctx.needs_input_grad[1] and dk_embed is not None else None
        return dq, dk, None, None, None, None


_LAYOUTS = {1: "(batch, heads, seq, head_dim)", 2: "(batch, seq, heads, head_dim)"}


def _validate(q, k, cos, sin, unsqueeze_dim) -> int:
    for t, name in ((q, "q"), (k, "k"), (cos, "cos"), (sin, "sin")):
        check_float(t, name)
    if isinstance(unsqueeze_dim, bool) or not isinstance(unsqueeze_dim, int) or unsqueeze_dim not in (1, 2, -3, -2):
        raise ValueError(
            f"unsqueeze_dim must be 1 (q/k of shape {_LAYOUTS[1]}) or 2 ({_LAYOUTS[2]}), got {unsqueeze_dim!r}"
        )
    unsqueeze_dim = unsqueeze_dim % 4  # -3 -> 1, -2 -> 2, as cos.unsqueeze(unsqueeze_dim) on 3-D cos
    layout = _LAYOUTS[unsqueeze_dim]
    for t, name in ((q, "q"), (k, "k")):
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D {layout} for unsqueeze_dim={unsqueeze_dim}, "
                             f"got shape {tuple(t.shape)}")
        check_nonempty(t, name)
    for t, name in ((cos, "cos"), (sin, "sin")):
        if t.dim() != 3:
            raise ValueError(f"{name} must be 3-D (1 or batch, seq, rotary_dim), got shape {tuple(t.shape)}")
        check_nonempty(t, name)
    for t, name in ((k, "k"), (cos, "cos"), (sin, "sin")):
        check_same_device(t, name, q, "q")
    s_dim = 2 if unsqueeze_dim == 1 else 1
    batch, seq, head_dim = q.shape[0], q.shape[s_dim], q.shape[3]
    if k.shape[0] != batch or k.shape[s_dim] != seq or k.shape[3] != head_dim:
        raise ValueError(
            f"k must match q's batch, seq and head_dim in the {layout} layout: q {tuple(q.shape)}, "
            f"k {tuple(k.shape)}"
        )
    if sin.shape != cos.shape:
        raise ValueError(f"sin must have cos's shape {tuple(cos.shape)}, got {tuple(sin.shape)}")
    if cos.shape[0] not in (1, batch) or cos.shape[1] not in (1, seq):
        raise ValueError(
            f"cos must have shape (1 or batch={batch}, seq={seq}, rotary_dim) for q {tuple(q.shape)} "
            f"in the {layout} layout, got {tuple(cos.shape)}"
        )
    rotary_dim = cos.shape[2]
    if rotary_dim % 2 or rotary_dim > head_dim:
        raise ValueError(
            f"cos's last dimension (the rotary dim) must be even and at most head_dim={head_dim}, "
            f"got {rotary_dim}"
        )
    return unsqueeze_dim


def rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim=1, in_place_backward=False):
    """``(q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin)``: see the module docstring.

    ``position_ids`` is accepted and ignored, as in transformers' ``apply_rotary_pos_emb`` (4.x took
    it and did not use it; ``cos``/``sin`` are already gathered for the positions). Transformers 5
    dropped the argument, so its fifth positional argument is ``unsqueeze_dim``: an ``int`` passed
    here as ``position_ids`` is taken as ``unsqueeze_dim``, so calls written for either version work.
    ``in_place_backward``: see ``RotaryPosEmbFunction``.
    """
    if position_ids is not None and not isinstance(position_ids, torch.Tensor):
        if isinstance(position_ids, int) and not isinstance(position_ids, bool) and unsqueeze_dim == 1:
            unsqueeze_dim = position_ids
        else:
            raise TypeError(
                "position_ids must be a torch.Tensor or None (it is unused; cos and sin carry the "
                f"positions), got {type(position_ids).__name__}; pass unsqueeze_dim by keyword"
            )
    return RotaryPosEmbFunction.apply(q, k, cos, sin, unsqueeze_dim, in_place_backward)
