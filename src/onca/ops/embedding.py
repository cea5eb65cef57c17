"""Embedding lookup: ``y[t] = weight[indices[t]]``, and its weight gradient.

Forward is a gather over 2-D tiles (a block of tokens x a block of the embedding dimension): every
tile row is a contiguous stretch of one weight row, read once and written once, so both the reads
and the writes are coalesced (a naive per-element gather is not).

Backward scatters the output gradient into a dense weight gradient of the weight's shape and dtype,
accumulating in fp32, by one of two kernels:

- **atomic** (``deterministic=False``, fp32 weights): the gradient starts at zero and each tile of
  output-gradient rows is added into its weight rows with fp32 atomic adds. Fast and exact to fp32
  rounding, but the order of the additions, hence the last bits, may vary from run to run.
- **segment** (``deterministic=True``, and always for bf16/fp16 weights, ``scale_grad_by_freq``, or
  under ``torch.use_deterministic_algorithms(True)``): the flat indices are sorted on the device
  (a stable ``torch.sort``; no host synchronisation) and ``torch.searchsorted`` gives each weight
  row its segment of equal indices. One kernel then walks the weight gradient in 2-D tiles (a block
  of weight rows x a block of columns): each program owns whole segments, sums its rows' gradients
  in fp32 in token order, and writes every element of its tile exactly once (zeros for rows no
  token used), so no two programs write the same element, no zero fill is needed, and the result is
  bitwise reproducible. Atomics into a bf16/fp16 gradient would accumulate in 16 bits (frequent
  tokens lose precision) and an fp32 scratch would triple the memory traffic, so 16-bit weights
  always take this path; it writes each gradient element once and is as fast.

``padding_idx``: that row is gathered as usual but receives no gradient (as ``torch.nn.Embedding``).

Out-of-range indices: by default the op checks ``0 <= index < num_embeddings`` with one min/max
reduction on the device, which **synchronises the host with the device** once per forward
(skipped while a CUDA graph is being captured). ``check_bounds=False`` drops the check; the
kernels still mask every index to the table, so an out-of-range index never reads or writes out of
bounds: its output row is zeros and it contributes no gradient.

Saved for backward: the flat indices only (the gradient does not depend on the weight).
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from onca.device import DeviceProfile, get_profile
from onca.ops._validate import check_float, check_index, check_same_device, check_tensor
from onca.tiling import RowPlan, plan_rows

__all__ = ["embedding", "EmbeddingFunction", "IndexOutOfRangeError", "plan"]

# Live tiles of each kernel, counted as the planner expects (tiles in the weight dtype, fp32 tiles).
# Each kernel also materialises int64 address tiles for its gathered loads and its stores or
# atomics; an int64 tile is counted as two fp32 tiles.
FORWARD_TILES = dict(live_tiles=1, fp32_tiles=4)  # the gathered rows; load and store addresses
ATOMIC_TILES = dict(live_tiles=1, fp32_tiles=5)  # dy rows, their fp32 values; dy and dW addresses
SEGMENT_TILES = dict(live_tiles=2, fp32_tiles=5)  # dy rows, dW tile; fp32 sum; dy and dW addresses


class IndexOutOfRangeError(IndexError, ValueError):
    """An index outside ``[0, num_embeddings)``: an ``IndexError`` as in PyTorch, and a ``ValueError``
    as every other bad input to an Onca op."""


# ----------------------------------------------------------------------------------------- kernels


@triton.jit
def _embedding_forward_kernel(
    idx_ptr, w_ptr, y_ptr,
    n_tokens, n_cols, n_embeddings, w_row_stride, y_row_stride,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    COL_TILES: tl.constexpr,
):
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    n_tiles = tl.cdiv(n_tokens, BLOCK_ROWS) * COL_TILES
    for tile in tl.range(pid, n_tiles, n_programs):
        row_block = tile // COL_TILES
        cols = (tile % COL_TILES) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
        col_mask = cols < n_cols
        rows = row_block * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        row_mask = rows < n_tokens
        idx = tl.load(idx_ptr + rows, mask=row_mask, other=0).to(tl.int64)
        # Never read outside the table, even if the caller turned the bounds check off.
        valid = row_mask & (idx >= 0) & (idx < n_embeddings)
        w = tl.load(w_ptr + idx[:, None] * w_row_stride + cols[None, :],
                    mask=valid[:, None] & col_mask[None, :], other=0.0)
        tl.store(y_ptr + rows.to(tl.int64)[:, None] * y_row_stride + cols[None, :], w,
                 mask=row_mask[:, None] & col_mask[None, :])


@triton.jit
def _embedding_backward_atomic_kernel(
    idx_ptr, dy_ptr, dw_ptr,
    n_tokens, n_cols, n_embeddings, dy_row_stride, dw_row_stride, padding_idx,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    COL_TILES: tl.constexpr,
):
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    n_tiles = tl.cdiv(n_tokens, BLOCK_ROWS) * COL_TILES
    for tile in tl.range(pid, n_tiles, n_programs):
        row_block = tile // COL_TILES
        cols = (tile % COL_TILES) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
        col_mask = cols < n_cols
        rows = row_block * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        row_mask = rows < n_tokens
        idx = tl.load(idx_ptr + rows, mask=row_mask, other=0).to(tl.int64)
        valid = row_mask & (idx >= 0) & (idx < n_embeddings) & (idx != padding_idx)
        mask = valid[:, None] & col_mask[None, :]
        dy = tl.load(dy_ptr + rows.to(tl.int64)[:, None] * dy_row_stride + cols[None, :], mask=mask, other=0.0)
        tl.atomic_add(dw_ptr + idx[:, None] * dw_row_stride + cols[None, :], dy.to(tl.float32), mask=mask,
                      sem="relaxed")


@triton.jit
def _embedding_backward_segment_kernel(
    perm_ptr, offsets_ptr, dy_ptr, dw_ptr,
    n_embeddings, n_cols, dy_row_stride, dw_row_stride, padding_idx,
    SCALE_BY_FREQ: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    COL_TILES: tl.constexpr,
):
    """Tiles of the weight gradient: rows ``r`` sum ``dy[perm[offsets[r]:offsets[r + 1]]]``."""
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    n_tiles = tl.cdiv(n_embeddings, BLOCK_ROWS) * COL_TILES
    for tile in tl.range(pid, n_tiles, n_programs):
        row_block = tile // COL_TILES
        cols = (tile % COL_TILES) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
        col_mask = cols < n_cols
        rows = row_block * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        row_mask = rows < n_embeddings
        start = tl.load(offsets_ptr + rows, mask=row_mask, other=0)
        count = tl.load(offsets_ptr + rows + 1, mask=row_mask, other=0) - start
        count = tl.where(rows == padding_idx, 0, count)
        acc = tl.zeros([BLOCK_ROWS, BLOCK_COLS], dtype=tl.float32)
        # Each row of the tile walks its own segment; the tile runs as long as its longest one.
        for k in range(0, tl.max(count, axis=0)):
            active = k < count
            token = tl.load(perm_ptr + start + k, mask=active, other=0)
            acc += tl.load(dy_ptr + token[:, None] * dy_row_stride + cols[None, :],
                           mask=active[:, None] & col_mask[None, :], other=0.0).to(tl.float32)
        if SCALE_BY_FREQ:
            acc = acc / tl.maximum(count, 1).to(tl.float32)[:, None]
        tl.store(dw_ptr + rows.to(tl.int64)[:, None] * dw_row_stride + cols[None, :],
                 acc.to(dw_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


# --------------------------------------------------------------------------------------- launchers


def _tile_plan(rows: int, cols: int, dtype: torch.dtype, tiles: dict, profile: DeviceProfile | None) -> RowPlan:
    """``plan_rows`` for a kernel whose programs loop over (row block, column tile) pairs: column
    tiles are independent here (no per-row state), so the grid covers both."""
    profile = profile or get_profile()
    p = plan_rows(rows, cols, dtype, profile=profile, **tiles)
    n_tiles = p.row_blocks * p.col_tiles
    grid = min(n_tiles, profile.compute_units) if p.persistent else n_tiles
    return dataclasses.replace(p, grid=grid)


def plan(shape, dtype: torch.dtype, profile: DeviceProfile | None = None) -> dict[str, RowPlan]:
    """Plans for indices of shape ``shape[:-2]`` into a ``(num_embeddings, embedding_dim)`` table
    ``shape[-2:]`` of ``dtype``: the forward gather, the atomic backward (over tokens) and the
    segment backward (over weight rows)."""
    shape = tuple(int(s) for s in shape)
    if len(shape) < 3:
        raise ValueError(f"embedding plans take (*index_shape, num_embeddings, embedding_dim), got {shape}")
    tokens = 1
    for s in shape[:-2]:
        tokens *= s
    n_embeddings, dim = shape[-2:]
    return {
        "forward": _tile_plan(tokens, dim, dtype, FORWARD_TILES, profile),
        "bwd_atomic": _tile_plan(tokens, dim, torch.float32, ATOMIC_TILES, profile),
        "bwd_sorted": _tile_plan(n_embeddings, dim, dtype, SEGMENT_TILES, profile),
    }


def embedding_forward(idx: torch.Tensor, weight: torch.Tensor, out_shape) -> torch.Tensor:
    """The gathered rows, allocated in ``out_shape`` (not a view: callers may modify it in place)."""
    n_tokens = idx.numel()
    n_embeddings, dim = weight.shape
    p = _tile_plan(n_tokens, dim, weight.dtype, FORWARD_TILES, None)
    y = torch.empty(out_shape, dtype=weight.dtype, device=weight.device)
    y2d = y.view(n_tokens, dim)
    _embedding_forward_kernel[(p.grid,)](
        idx, weight, y2d,
        n_tokens, dim, n_embeddings, weight.stride(0), y2d.stride(0),
        BLOCK_ROWS=p.block_rows, BLOCK_COLS=p.block_cols, COL_TILES=p.col_tiles, num_warps=p.num_warps,
    )
    return y


def embedding_backward_atomic(idx, dy2d, n_embeddings: int, padding_idx: int) -> torch.Tensor:
    """fp32 weight gradient by atomic adds (fp32 weights only: the result is the gradient)."""
    n_tokens, dim = dy2d.shape
    p = _tile_plan(n_tokens, dim, torch.float32, ATOMIC_TILES, None)
    dw = torch.zeros((n_embeddings, dim), dtype=torch.float32, device=dy2d.device)
    _embedding_backward_atomic_kernel[(p.grid,)](
        idx, dy2d, dw,
        n_tokens, dim, n_embeddings, dy2d.stride(0), dw.stride(0), padding_idx,
        BLOCK_ROWS=p.block_rows, BLOCK_COLS=p.block_cols, COL_TILES=p.col_tiles, num_warps=p.num_warps,
    )
    return dw


def embedding_backward_segment(idx, dy2d, n_embeddings: int, padding_idx: int, dtype: torch.dtype,
                               scale_grad_by_freq: bool = False) -> torch.Tensor:
    """Deterministic weight gradient of ``dtype``: sort, find each row's segment, sum segments."""
    n_tokens, dim = dy2d.shape
    # A stable sort keeps equal indices in token order, so each segment sums in a fixed order.
    sorted_idx, perm = torch.sort(idx, stable=True)
    bounds = torch.arange(n_embeddings + 1, dtype=sorted_idx.dtype, device=idx.device)
    # offsets[r] = the first sorted position holding an index >= r; indices outside the table (if the
    # bounds check was off) fall before offsets[0] or after offsets[n_embeddings] and are ignored.
    offsets = torch.searchsorted(sorted_idx, bounds)
    p = _tile_plan(n_embeddings, dim, dtype, SEGMENT_TILES, None)
    dw = torch.empty((n_embeddings, dim), dtype=dtype, device=dy2d.device)
    _embedding_backward_segment_kernel[(p.grid,)](
        perm, offsets, dy2d, dw,
        n_embeddings, dim, dy2d.stride(0), dw.stride(0), padding_idx,
        SCALE_BY_FREQ=bool(scale_grad_by_freq),
        BLOCK_ROWS=p.block_rows, BLOCK_COLS=p.block_cols, COL_TILES=p.col_tiles, num_warps=p.num_warps,
    )
    return dw


def _capturing(t: torch.Tensor) -> bool:
    return t.device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def check_bounds(idx: torch.Tensor, n_embeddings: int, name: str = "indices") -> None:
    """Raise ``IndexOutOfRangeError`` if any index is outside ``[0, n_embeddings)``.

    One min/max reduction on the device and one host synchronisation (to read its two numbers).
    """
    lo, hi = (int(v) for v in torch.stack(torch.aminmax(idx)).tolist())
    if lo < 0 or hi >= n_embeddings:
        bad = lo if lo < 0 else hi
        raise IndexOutOfRangeError(
            f"{name} holds {bad}, outside the table's range [0, {n_embeddings}) "
            f"(min {lo}, max {hi}); pass check_bounds=False to skip this check"
        )


# ---------------------------------------------------------------------------------------- autograd


def _segment_path(weight_dtype: torch.dtype, deterministic: bool, scale_grad_by_freq: bool) -> bool:
    return (deterministic or scale_grad_by_freq or weight_dtype != torch.float32
            or torch.are_deterministic_algorithms_enabled())


class EmbeddingFunction(torch.autograd.Function):
    """Autograd wrapper. Saves the flat indices (and the table's shape); not the weight."""

    @staticmethod
    def forward(ctx, indices, weight, padding_idx, deterministic, scale_grad_by_freq, check):
        n_embeddings, dim = weight.shape
        idx = indices.reshape(-1)
        if not idx.is_contiguous():
            idx = idx.contiguous()
        if weight.stride(1) != 1:
            weight = weight.contiguous()
        out_shape = (*indices.shape, dim)
        if idx.numel() == 0:
            y = torch.empty(out_shape, dtype=weight.dtype, device=weight.device)
        else:
            if check and not _capturing(idx):
                check_bounds(idx, n_embeddings)
            y = embedding_forward(idx, weight, out_shape)
        ctx.save_for_backward(idx)
        ctx.n_embeddings, ctx.w_dtype = n_embeddings, weight.dtype
        ctx.padding_idx, ctx.deterministic, ctx.scale = padding_idx, deterministic, scale_grad_by_freq
        return y

    @staticmethod
    def backward(ctx, dy):
        (idx,) = ctx.saved_tensors
        dim = dy.shape[-1]
        if idx.numel() == 0:
            dw = torch.zeros((ctx.n_embeddings, dim), dtype=ctx.w_dtype, device=dy.device)
            return None, dw, None, None, None, None
        dy2d = dy.reshape(-1, dim)
        if dy2d.stride(1) != 1:
            dy2d = dy2d.contiguous()
        padding_idx = -1 if ctx.padding_idx is None else ctx.padding_idx
        if _segment_path(ctx.w_dtype, ctx.deterministic, ctx.scale):
            dw = embedding_backward_segment(idx, dy2d, ctx.n_embeddings, padding_idx, ctx.w_dtype, ctx.scale)
        else:
            dw = embedding_backward_atomic(idx, dy2d, ctx.n_embeddings, padding_idx)
        return None, dw, None, None, None, None


def _validate(indices, weight, padding_idx) -> int | None:
    check_index(indices, "indices")
    check_float(weight, "weight")
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D (num_embeddings, embedding_dim), got shape {tuple(weight.shape)}")
    if weight.numel() == 0:
        raise ValueError(f"weight is empty (shape {tuple(weight.shape)}); Onca kernels need at least one element")
    check_same_device(indices, "indices", weight, "weight")
    return normalize_padding_idx(padding_idx, weight.shape[0])


def normalize_padding_idx(padding_idx, n_embeddings: int) -> int | None:
    """``padding_idx`` in ``[0, n_embeddings)`` (negative values count from the end, as in torch)."""
    if padding_idx is None:
        return None
    if isinstance(padding_idx, bool) or not isinstance(padding_idx, int):
        raise TypeError(f"padding_idx must be an int or None, got {type(padding_idx).__name__}")
    if not -n_embeddings <= padding_idx < n_embeddings:
        raise ValueError(f"padding_idx must be within [{-n_embeddings}, {n_embeddings}), got {padding_idx}")
    return padding_idx + n_embeddings if padding_idx < 0 else padding_idx


def embedding(indices, weight, padding_idx=None, deterministic=False, scale_grad_by_freq=False,
              check_bounds=True):
    """Look up rows of ``weight`` (``(num_embeddings, embedding_dim)``) for integer ``indices`` of any
    shape; returns ``(*indices.shape, embedding_dim)`` in the weight's dtype. See the module
    docstring for the two backward kernels and the bounds check."""
    check_tensor(weight, "weight")
    padding_idx = _validate(indices, weight, padding_idx)
    return EmbeddingFunction.apply(indices, weight, padding_idx, bool(deterministic), bool(scale_grad_by_freq),
                                   bool(check_bounds))
