"""Neighborhood attention (1-D, with dilation), liger-kernel's ``fused_neighborhood_attention``:
each query attends only to the keys of a window around its own position.

For ``query``, ``key``, ``value`` of shape ``(B, H, L, D)``, ``kernel_size`` ``K`` (``half = K // 2``)
and ``dilation`` ``d``, query ``i`` sees the keys ``j = i + (t - half) * d`` for ``t = 0 .. 2 * half``
that lie inside ``[0, L)``. The window is clipped at the sequence's ends, not shifted (liger-kernel's
mask: ``max(0, i - half*d) <= j < min(L, i + half*d + 1)`` and ``(j - i) % d == 0``), so a query near
an end sees fewer keys; it always sees itself. Then ``out = softmax(scale * q k^T over the window) v``
with ``scale = 1/sqrt(D)`` by default.

liger-kernel computes the full ``(B, H, L, L)`` score matrix, masks it, runs a softmax over it and
multiplies it by ``V`` (O(L^2) memory and work). Onca never forms it: one program per block of
query rows walks the ``2 * half + 1`` window positions with an online softmax (flash-attention
style), gathering each position's key and value rows (neighbouring rows of one sequence: mostly
cache hits), so the work and memory are O(L * K * D). The dot products are elementwise products
reduced over ``D`` in registers (the window is a few positions: no matmul tile to feed).

Saved for backward: ``q``, ``k``, ``v`` and one fp32 log-sum-exp per query. Backward recomputes the
window's probabilities ``p`` from them, in two per-row kernels (no atomics, deterministic):

- per query ``i``: ``dp_t = do_i . v_j``, ``delta_i = sum_t p_t dp_t`` and
  ``dq_i = scale * (sum_t p_t dp_t k_j - delta_i sum_t p_t k_j)`` in one pass; ``delta`` is stored;
- per key ``j``: the queries that see ``j`` are ``i = j + (t - half) * d`` (the relation is
  symmetric), so ``dv_j = sum p do_i`` and ``dk_j = scale * sum p (dp - delta_i) q_i``.

The whole head dimension is one tile (``D`` up to a few hundred): a budget too small for that is a
``TilingError``. Outputs and gradients have the inputs' dtype; arithmetic is fp32.

A small eager call on CUDA (a ``(B, H, L, L)`` score matrix of at most
:func:`onca.ops._small_calls.limit` elements) is torch's ``scaled_dot_product_attention`` with the
window as a boolean mask (made once per length, window and device): one C++ call each way, where
the host path decides the speed.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from onca.device import DeviceProfile, get_profile
from onca.ops import _small_calls as small_calls
from onca.ops._contract import custom_op, register_autograd
from onca.ops._launch import fast_launch, launch_config, prepared_key
from onca.ops._validate import check_float, check_number, check_same_device
from onca.tiling import RowPlan, TilingError, next_power_of_2, plan_rows

__all__ = ["neighborhood_attention", "plan"]

# Live tiles (input dtype, fp32) of each kernel over a (query rows, head dim) tile.
FORWARD_TILES = dict(live_tiles=4, fp32_tiles=5)  # q, k, v, out; q, k, v, acc, a product
DQ_TILES = dict(live_tiles=5, fp32_tiles=7)  # q, do, k, v, dq; q, do, k, v, two sums, a product
DKV_TILES = dict(live_tiles=6, fp32_tiles=7)  # k, v, q, do, dk, dv; k, v, q, do, dk, dv, a product


# ----------------------------------------------------------------------------------------- kernels


@triton.jit
def _row_bases(rows, seq_len, n_heads, batch_stride, head_stride):
    """The int64 offset of each row's (batch, head) and its position in the sequence."""
    pos = rows % seq_len
    bh = rows // seq_len
    base = (bh // n_heads).to(tl.int64) * batch_stride + (bh % n_heads).to(tl.int64) * head_stride
    return base, pos


@fast_launch
@triton.jit
def _neighborhood_forward_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr,
    n_rows, seq_len, n_heads, head_dim, half, dilation, scale,
    q_sb, q_sh, q_ss, k_sb, k_sh, k_ss, v_sb, v_sh, v_ss,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0)
    n_row_blocks = tl.cdiv(n_rows, BLOCK_ROWS)
    d = tl.arange(0, BLOCK_D)
    d_mask = d < head_dim
    for row_block in tl.range(pid, n_row_blocks, tl.num_programs(0)):
        rows = row_block * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        row_mask = rows < n_rows
        q_base, pos = _row_bases(rows, seq_len, n_heads, q_sb, q_sh)
        k_base, _ = _row_bases(rows, seq_len, n_heads, k_sb, k_sh)
        v_base, _ = _row_bases(rows, seq_len, n_heads, v_sb, v_sh)
        mask = row_mask[:, None] & d_mask[None, :]
        q = tl.load(q_ptr + (q_base + pos.to(tl.int64) * q_ss)[:, None] + d[None, :], mask=mask, other=0.0)
        q = q.to(tl.float32) * scale
        m = tl.full([BLOCK_ROWS], float("-inf"), dtype=tl.float32)
        den = tl.zeros([BLOCK_ROWS], dtype=tl.float32)
        acc = tl.zeros([BLOCK_ROWS, BLOCK_D], dtype=tl.float32)
        for t in range(2 * half + 1):
            j = pos + (t - half) * dilation
            valid = row_mask & (j >= 0) & (j < seq_len)
            j64 = tl.where(valid, j, 0).to(tl.int64)
            kv_mask = valid[:, None] & d_mask[None, :]
            k = tl.load(k_ptr + (k_base + j64 * k_ss)[:, None] + d[None, :], mask=kv_mask, other=0.0)
            s = tl.sum(q * k.to(tl.float32), axis=1)
            s = tl.where(valid, s, float("-inf"))
            m_new = tl.maximum(m, s)
            # Rows with no key seen yet keep m = -inf: shift them by 0 (no -inf - -inf).
            shift = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m - shift)
            p = tl.exp(s - shift)
            v = tl.load(v_ptr + (v_base + j64 * v_ss)[:, None] + d[None, :], mask=kv_mask, other=0.0)
            den = den * alpha + p
            acc = acc * alpha[:, None] + p[:, None] * v.to(tl.float32)
            m = m_new
        # Every query sees itself: den >= 1 on real rows; padding rows are never stored.
        den = tl.where(row_mask, den, 1.0)
        out = acc / den[:, None]
        rows64 = rows.to(tl.int64)
        tl.store(o_ptr + rows64[:, None] * head_dim + d[None, :], out.to(o_ptr.dtype.element_ty), mask=mask)
        tl.store(lse_ptr + rows, tl.where(row_mask, m, 0.0) + tl.log(den), mask=row_mask)


@fast_launch
@triton.jit
def _neighborhood_dq_kernel(
    do_ptr, q_ptr, k_ptr, v_ptr, lse_ptr, delta_ptr, dq_ptr,
    n_rows, seq_len, n_heads, head_dim, half, dilation, scale,
    do_sb, do_sh, do_ss, q_sb, q_sh, q_ss, k_sb, k_sh, k_ss, v_sb, v_sh, v_ss,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Per query row: ``delta = sum_t p dp`` (stored) and ``dq = scale * (sum p dp k - delta sum p k)``."""
    pid = tl.program_id(0)
    n_row_blocks = tl.cdiv(n_rows, BLOCK_ROWS)
    d = tl.arange(0, BLOCK_D)
    d_mask = d < head_dim
    for row_block in tl.range(pid, n_row_blocks, tl.num_programs(0)):
        rows = row_block * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        row_mask = rows < n_rows
        do_base, pos = _row_bases(rows, seq_len, n_heads, do_sb, do_sh)
        q_base, _ = _row_bases(rows, seq_len, n_heads, q_sb, q_sh)
        k_base, _ = _row_bases(rows, seq_len, n_heads, k_sb, k_sh)
        v_base, _ = _row_bases(rows, seq_len, n_heads, v_sb, v_sh)
        pos64 = pos.to(tl.int64)
        mask = row_mask[:, None] & d_mask[None, :]
        q = tl.load(q_ptr + (q_base + pos64 * q_ss)[:, None] + d[None, :], mask=mask, other=0.0)
        q = q.to(tl.float32) * scale
        do = tl.load(do_ptr + (do_base + pos64 * do_ss)[:, None] + d[None, :], mask=mask, other=0.0)
        do = do.to(tl.float32)
        lse = tl.load(lse_ptr + rows, mask=row_mask, other=0.0)
        delta = tl.zeros([BLOCK_ROWS], dtype=tl.float32)
        pdpk = tl.zeros([BLOCK_ROWS, BLOCK_D], dtype=tl.float32)
        pk = tl.zeros([BLOCK_ROWS, BLOCK_D], dtype=tl.float32)
        for t in range(2 * half + 1):
            j = pos + (t - half) * dilation
            valid = row_mask & (j >= 0) & (j < seq_len)
            j64 = tl.where(valid, j, 0).to(tl.int64)
            kv_mask = valid[:, None] & d_mask[None, :]
            k = tl.load(k_ptr + (k_base + j64 * k_ss)[:, None] + d[None, :], mask=kv_mask, other=0.0)
            k = k.to(tl.float32)
            v = tl.load(v_ptr + (v_base + j64 * v_ss)[:, None] + d[None, :], mask=kv_mask, other=0.0)
            p = tl.where(valid, tl.exp(tl.sum(q * k, axis=1) - lse), 0.0)
            dp = tl.sum(do * v.to(tl.float32), axis=1)
            delta += p * dp
            pdpk += (p * dp)[:, None] * k
            pk += p[:, None] * k
        dq = (pdpk - delta[:, None] * pk) * scale
        rows64 = rows.to(tl.int64)
        tl.store(dq_ptr + rows64[:, None] * head_dim + d[None, :], dq.to(dq_ptr.dtype.element_ty), mask=mask)
        tl.store(delta_ptr + rows, delta, mask=row_mask)


@fast_launch
@triton.jit
def _neighborhood_dkv_kernel(
    do_ptr, q_ptr, k_ptr, v_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr,
    n_rows, seq_len, n_heads, head_dim, half, dilation, scale,
    do_sb, do_sh, do_ss, q_sb, q_sh, q_ss, k_sb, k_sh, k_ss, v_sb, v_sh, v_ss,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Per key row ``j``, over the queries ``i = j + (t - half) * dilation`` that see it:
    ``dv = sum p do_i`` and ``dk = scale * sum p (dp - delta_i) q_i``."""
    pid = tl.program_id(0)
    n_row_blocks = tl.cdiv(n_rows, BLOCK_ROWS)
    d = tl.arange(0, BLOCK_D)
    d_mask = d < head_dim
    for row_block in tl.range(pid, n_row_blocks, tl.num_programs(0)):
        rows = row_block * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        row_mask = rows < n_rows
        k_base, pos = _row_bases(rows, seq_len, n_heads, k_sb, k_sh)
        v_base, _ = _row_bases(rows, seq_len, n_heads, v_sb, v_sh)
        q_base, _ = _row_bases(rows, seq_len, n_heads, q_sb, q_sh)
        do_base, _ = _row_bases(rows, seq_len, n_heads, do_sb, do_sh)
        pos64 = pos.to(tl.int64)
        mask = row_mask[:, None] & d_mask[None, :]
        k = tl.load(k_ptr + (k_base + pos64 * k_ss)[:, None] + d[None, :], mask=mask, other=0.0)
        k = k.to(tl.float32) * scale
        v = tl.load(v_ptr + (v_base + pos64 * v_ss)[:, None] + d[None, :], mask=mask, other=0.0)
        v = v.to(tl.float32)
        dk = tl.zeros([BLOCK_ROWS, BLOCK_D], dtype=tl.float32)
        dv = tl.zeros([BLOCK_ROWS, BLOCK_D], dtype=tl.float32)
        # The flattened row of query i of this (batch, head) is rows + (i - j).
        for t in range(2 * half + 1):
            offset = (t - half) * dilation
            i = pos + offset
            valid = row_mask & (i >= 0) & (i < seq_len)
            i64 = tl.where(valid, i, 0).to(tl.int64)
            qi_mask = valid[:, None] & d_mask[None, :]
            q = tl.load(q_ptr + (q_base + i64 * q_ss)[:, None] + d[None, :], mask=qi_mask, other=0.0)
            q = q.to(tl.float32)
            do = tl.load(do_ptr + (do_base + i64 * do_ss)[:, None] + d[None, :], mask=qi_mask, other=0.0)
            do = do.to(tl.float32)
            q_rows = tl.where(valid, rows + offset, 0)
            lse = tl.load(lse_ptr + q_rows, mask=valid, other=0.0)
            delta = tl.load(delta_ptr + q_rows, mask=valid, other=0.0)
            p = tl.where(valid, tl.exp(tl.sum(q * k, axis=1) - lse), 0.0)
            dp = tl.sum(do * v, axis=1)
            dv += p[:, None] * do
            dk += (p * (dp - delta))[:, None] * q
        rows64 = rows.to(tl.int64)
        out = rows64[:, None] * head_dim + d[None, :]
        tl.store(dk_ptr + out, (dk * scale).to(dk_ptr.dtype.element_ty), mask=mask)
        tl.store(dv_ptr + out, dv.to(dv_ptr.dtype.element_ty), mask=mask)


# --------------------------------------------------------------------------------------- launchers


def _plan(rows: int, head_dim: int, dtype: torch.dtype, tiles: dict, profile: DeviceProfile | None = None) -> RowPlan:
    profile = profile or get_profile()
    # On a GPU registers bound the tile: these kernels hold five to seven fp32 tiles at once, so a
    # tile is kept to half the profile's one-pass size (measured with tools/sm90_compile: no spills).
    cap = max(1, profile.tile_elements // (2 * next_power_of_2(head_dim))) if profile.tile_elements else None
    p = plan_rows(rows, head_dim, dtype, profile=profile, max_block_rows=cap, **tiles)
    if p.col_tiles != 1:
        raise TilingError(
            f"neighborhood attention keeps a whole head ({head_dim} wide) in one tile; the on-chip budget "
            f"of profile {p.profile!r} ({p.onchip_bytes} bytes) fits only {p.block_cols} columns"
        )
    return p


def plan(shape, dtype: torch.dtype, profile: DeviceProfile | None = None) -> dict[str, RowPlan]:
    """The plans of the three kernels for ``query`` of ``shape`` ``(B, H, L, D)``."""
    *lead, head_dim = (int(s) for s in shape)
    rows = math.prod(lead)
    return {
        "forward": _plan(rows, head_dim, dtype, FORWARD_TILES, profile),
        "backward_dq": _plan(rows, head_dim, dtype, DQ_TILES, profile),
        "backward_dkv": _plan(rows, head_dim, dtype, DKV_TILES, profile),
    }


def _strides(t: Tensor) -> tuple[int, int, int]:
    return t.stride(0), t.stride(1), t.stride(2)


def _launch(kernel, tiles: dict, pointers: tuple, strided: tuple, half: int, dilation: int,
            scale: float) -> None:
    """``kernel`` over the query rows of ``strided[0]``'s ``(B, H, L, D)`` shape and dtype: the
    ``pointers`` (tensors), then the sizes, the options and each of ``strided``'s (batch, head, seq)
    strides. Everything but the pointers is kept per layout (:func:`onca.ops._launch.launch_config`):
    planning and keying some twenty scalar arguments again cost more host time than the launch at
    host-bound sizes."""
    first = strided[0]
    key = (kernel, get_profile(), first.dtype, first.shape, half, dilation, scale,
           *[t.stride() for t in strided])
    grid, scalars, kwargs, scalars_key = launch_config(
        key, lambda: _launch_config(tiles, strided, half, dilation, scale))
    kernel.launch_prepared(grid, pointers, scalars, kwargs, scalars_key)


def _launch_config(tiles: dict, strided: tuple, half: int, dilation: int, scale: float) -> tuple:
    """``(grid, scalar arguments, keyword constexprs, their prepared key)`` of :func:`_launch`."""
    batch, heads, seq, head_dim = strided[0].shape
    rows = batch * heads * seq
    p = _plan(rows, head_dim, strided[0].dtype, tiles)
    scalars = (rows, seq, heads, head_dim, half, dilation, scale,
               *[s for t in strided for s in _strides(t)])
    kwargs = dict(BLOCK_ROWS=p.block_rows, BLOCK_D=p.block_cols, num_warps=p.num_warps)
    return (p.grid,), scalars, kwargs, prepared_key(scalars, kwargs)


@custom_op("neighborhood_attention_forward")
def neighborhood_attention_forward(query: Tensor, key: Tensor, value: Tensor, half: int, dilation: int,
                                   scale: float) -> tuple[Tensor, Tensor]:
    """``(out, lse)`` for 4-D ``(B, H, L, D)`` inputs with unit stride over ``D``: ``out``
    contiguous in the inputs' dtype, ``lse`` fp32 per query row (``B * H * L``)."""
    rows = query.shape[0] * query.shape[1] * query.shape[2]
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    lse = torch.empty(rows, dtype=torch.float32, device=query.device)
    if rows == 0:
        return out, lse
    _launch(_neighborhood_forward_kernel, FORWARD_TILES, (query, key, value, out, lse), (query, key, value),
            half, dilation, scale)
    return out, lse


@neighborhood_attention_forward.register_fake
def _(query, key, value, half, dilation, scale):
    batch, heads, seq, _ = query.shape
    return torch.empty_like(query, memory_format=torch.contiguous_format), query.new_empty(
        batch * heads * seq, dtype=torch.float32)


@custom_op("neighborhood_attention_backward")
def neighborhood_attention_backward(grad_out: Tensor, query: Tensor, key: Tensor, value: Tensor, lse: Tensor,
                                    half: int, dilation: int, scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """``(dq, dk, dv)``, contiguous, in the inputs' dtype."""
    rows = query.shape[0] * query.shape[1] * query.shape[2]
    dq, dk, dv = (torch.empty(query.shape, dtype=query.dtype, device=query.device) for _ in range(3))
    if rows == 0:
        return dq, dk, dv
    delta = torch.empty(rows, dtype=torch.float32, device=query.device)
    strided = (grad_out, query, key, value)  # grad_out has the output's shape and dtype: query's
    inputs = (grad_out, query, key, value, lse, delta)
    _launch(_neighborhood_dq_kernel, DQ_TILES, (*inputs, dq), strided, half, dilation, scale)
    _launch(_neighborhood_dkv_kernel, DKV_TILES, (*inputs, dk, dv), strided, half, dilation, scale)
    return dq, dk, dv


@neighborhood_attention_backward.register_fake
def _(grad_out, query, key, value, lse, half, dilation, scale):
    return tuple(torch.empty_like(query, memory_format=torch.contiguous_format) for _ in range(3))


# ---------------------------------------------------------------------------------------- autograd


def _setup_context(ctx, inputs, output):
    """Saves ``q``, ``k``, ``v`` (the caller's tensors) and the fp32 ``lse`` per query."""
    query, key, value, half, dilation, scale = inputs
    _out, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(query, key, value, lse)
    ctx.options = (half, dilation, scale)


def _backward(ctx, grad_out, _grad_lse):
    query, key, value, lse = ctx.saved_tensors
    dq, dk, dv = neighborhood_attention_backward(_unit_last_stride(grad_out), query, key, value, lse,
                                                 *ctx.options)
    return dq, dk, dv, None, None, None


register_autograd(neighborhood_attention_forward, _backward, setup_context=_setup_context)


# ------------------------------------------------------------------------------------------ public


def _unit_last_stride(t: Tensor) -> Tensor:
    """``t`` with unit stride over the head dimension (any other layout is taken as it is)."""
    return t if t.stride(-1) == 1 or t.shape[-1] == 1 else t.contiguous()


def _window(length: int, half: int, dilation: int, device: torch.device) -> Tensor:
    """``(length, length)`` bool, True where query ``i`` sees key ``j``: ``|j - i| <= half *
    dilation`` and ``(j - i) % dilation == 0`` (the window clipped at the ends)."""
    offset = torch.arange(length, device=device)
    offset = offset[None, :] - offset[:, None]
    return (offset.abs() <= half * dilation) & (offset % dilation == 0)


def _torch_route(query: Tensor, key: Tensor, value: Tensor, half: int, dilation: int, scale: float) -> Tensor:
    """A small call by torch's ops (:mod:`onca.ops._small_calls`): masked scaled dot-product
    attention, autograd for the gradients; contiguous, as the kernels' output."""
    length = query.shape[-2]
    mask = small_calls.kept(("neighborhood_window", length, half, dilation, query.device),
                            lambda: _window(length, half, dilation, query.device))
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale)
    return out.contiguous()


def _check_int(value, name: str, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def neighborhood_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    kernel_size: int = 7,
    dilation: int = 1,
    scale: float | None = None,
) -> Tensor:
    """1-D neighborhood attention: ``softmax(scale * q k^T) v`` with each query ``i`` attending only
    to the keys ``j = i + (t - kernel_size // 2) * dilation``, ``t = 0 .. 2 * (kernel_size // 2)``,
    inside ``[0, L)`` (the window is clipped at the ends, as liger-kernel's
    ``fused_neighborhood_attention``; an even ``kernel_size`` gives ``kernel_size + 1`` positions,
    as there).

    ``query``, ``key``, ``value``: ``(batch, heads, seq_len, head_dim)``, one floating dtype and
    device; any strides (a ``(B, L, H, D).transpose(1, 2)`` view is read in place). ``scale``
    defaults to ``1 / sqrt(head_dim)``. Returns a contiguous ``(batch, heads, seq_len, head_dim)``
    tensor of the inputs' dtype, differentiable w.r.t. all three. Never forms the ``(L, L)`` score
    matrix: O(L * kernel_size * head_dim) work and memory (see the module docstring).
    """
    for t, name in ((query, "query"), (key, "key"), (value, "value")):
        check_float(t, name)
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D (batch, heads, seq_len, head_dim), got shape {tuple(t.shape)}")
    for t, name in ((key, "key"), (value, "value")):
        if t.shape != query.shape:
            raise ValueError(f"{name} must have query's shape {tuple(query.shape)}, got {tuple(t.shape)}")
        if t.dtype != query.dtype:
            raise TypeError(f"{name} must have query's dtype {query.dtype}, got {t.dtype}")
        check_same_device(t, name, query, "query")
    if query.shape[-1] == 0:
        raise ValueError(f"query must have a non-empty head dimension, got shape {tuple(query.shape)}")
    _check_int(kernel_size, "kernel_size", 1)
    _check_int(dilation, "dilation", 1)
    if scale is None:
        scale = 1.0 / math.sqrt(query.shape[-1])
    check_number(scale, "scale")
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale!r}")
    b, h, length, _ = query.shape
    if small_calls.small(b * h * length * length, query, key, value):
        return _torch_route(query, key, value, kernel_size // 2, dilation, float(scale))
    out, _ = neighborhood_attention_forward(_unit_last_stride(query), _unit_last_stride(key),
                                            _unit_last_stride(value), kernel_size // 2, dilation, float(scale))
    return out

