"""Embedding lookup: ``y[t] = weight[indices[t]]``, and its weight gradient.

Forward is a gather over 2-D tiles (a block of tokens x a block of the embedding dimension): every
tile row is a contiguous stretch of one weight row, read once and written once, so both the reads
and the writes are coalesced (a naive per-element gather is not).

Backward scatters the output gradient into a dense weight gradient of the weight's shape and dtype,
accumulating in fp32, by one of two kernels:

- **atomic** (``deterministic=False``, fp32 weights): the gradient starts at zero and each tile of
  output-gradient rows is added into its weight rows with fp32 atomic adds. Fast and exact to fp32
  rounding, but the order of the additions, hence the last bits, may vary from run to run.
- **sorted** (``deterministic=True``, and always for bf16/fp16 weights, ``scale_grad_by_freq``, or
  under ``torch.use_deterministic_algorithms(True)``): the flat indices are sorted on the device
  (a stable ``torch.sort``; every size is known from the shapes, so no host synchronisation), which
  groups each index's tokens into one run of sorted positions, in token order. The gradient starts
  at zero; one kernel takes the sorted positions in chunks of ``RUN_CHUNK``, each program walking
  its chunk and summing each run's output-gradient rows in token order in fp32, and stores every run
  that starts and ends in the chunk into its weight row, each row by exactly one program. The pieces
  of runs that cross a chunk boundary go to an fp32 scratch of two rows per chunk, and a second
  kernel adds each such run's pieces in chunk order (``JOIN`` at a time) and stores the row. No
  atomics, so the result is bitwise reproducible; and no program walks a long run alone, so a
  frequent index (a padding token filling half a batch, Zipf-distributed text) costs what uniform
  indices cost. Atomics into a bf16/fp16 gradient would accumulate in 16 bits (frequent tokens lose
  precision) and an fp32 scratch of the table's size would triple the memory traffic, so 16-bit
  weights always take this path. Up to ``FEW_TOKENS`` tokens one kernel replaces the sort and both
  run kernels: the program of an index's first token sums that index's tokens in token order into
  the zeroed gradient.

Every path zeroes the table-sized gradient first, the backward's largest write, with Onca's own fill
(:func:`onca.ops._fill.zeros`, about 1.27x torch's on an H200). On CUDA the sorted path's sort runs
on a side stream beside that fill (:func:`_sort_beside_fill`): the sort is a chain of small,
latency-bound launches, the fill a bandwidth-bound write, and neither needs the other.

``padding_idx``: that row is gathered as usual but receives no gradient (as ``torch.nn.Embedding``).

Out-of-range indices never read or write outside the table: every kernel masks them (a zero
output row, no gradient). On CUDA the forward kernel also asserts ``0 <= index < num_embeddings`` on
the device, as PyTorch's CUDA embedding does: an out-of-range index stops the kernel with a
device-side assertion, with no host synchronisation (the CUDA context is unusable afterwards, as
after PyTorch's). The interpreter and other backends mask only. ``check_bounds=True`` adds a check
on the host that raises ``IndexOutOfRangeError``: one min/max reduction and one host-device
synchronisation per forward (skipped while a CUDA graph is being captured).

No tokens (or an empty table) gives what PyTorch gives: an empty output and a zero weight gradient.

Saved for backward: the forward's int32 copy of the flat indices, with -1 for those outside the
table (the gradient does not depend on the weight).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch
import triton
import triton.language as tl

from onca.device import DeviceProfile, get_profile
from torch import Tensor

from onca.ops import _small_calls as small_calls
from onca.ops._contract import custom_op, register_autograd
from onca.ops._fill import zeros
from onca.ops._launch import fast_launch
from onca.ops._validate import check_bool, check_float, check_index, check_same_device
from onca.tiling import RowPlan, cdiv, next_power_of_2, plan_rows

__all__ = ["embedding", "IndexOutOfRangeError", "plan"]

# Live tiles of each kernel, counted as the planner expects (tiles in the weight dtype, fp32 tiles).
# Each kernel also materialises int64 address tiles for its gathered loads and its stores or
# atomics; an int64 tile is counted as two fp32 tiles.
FORWARD_TILES = dict(live_tiles=1, fp32_tiles=4)  # the gathered rows; load and store addresses
ATOMIC_TILES = dict(live_tiles=1, fp32_tiles=5)  # dy rows, their fp32 values; dy and dW addresses
FEW_TOKENS_TILES = dict(live_tiles=1, fp32_tiles=2)  # one dy row, its fp32 sum

# Up to this many tokens the deterministic backward skips the sort: each token's program compares
# its index with the others' (a few registers), so a zero fill and one launch replace the sort,
# the search and their launches, which cost more than the work at host-bound sizes.
FEW_TOKENS = 64

# Sorted positions per program of the sorted backward (measured on an H100, bf16, 16384 tokens:
# 32 beat 64 and 128, most where few programs share a narrow table). A run longer than this is
# summed in pieces, joined by a second kernel JOIN pieces at a time, so that no program walks a
# long run (a padding token that fills half a batch) alone.
RUN_CHUNK = 32
JOIN = 8

# The sorted backward's programs: the walk holds one dy row tile, its fp32 sum and scaled sum, and
# the int64 addresses of the row and of the stores (two fp32 tiles each); the join, JOIN fp32 rows of
# pieces and their int64 addresses (3 * JOIN fp32 tiles), the larger. One chunk per program (block
# rows 1); at most 1024 columns, which the planner halves for wider rows: 512-column tiles were
# measured faster than 1024 and 4096 on an H100 (bf16, hidden 4096: more programs walk their
# chunks side by side).
RUNS_TILES = dict(live_tiles=1, fp32_tiles=3 * JOIN, max_block_rows=1, max_block_cols=1024)


class IndexOutOfRangeError(IndexError, ValueError):
    """An index outside ``[0, num_embeddings)``: an ``IndexError`` as in PyTorch, and a ``ValueError``
    as every other bad input to an Onca op."""


# ----------------------------------------------------------------------------------------- kernels


@fast_launch
@triton.jit
def _embedding_forward_kernel(
    idx_ptr, w_ptr, y_ptr, keys_ptr,
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
        # The index assertions are compiled in only where the launch passes debug=True
        # (_device_asserts): no-ops elsewhere. Never read outside the table either way.
        if BLOCK_ROWS == 1:
            # One token, with scalar addresses: triton-ascend cannot lower a one-row tensor gather
            # (its pointer analysis fails: "tt.addptr has multiple users"). Every tile's row exists.
            idx = tl.load(idx_ptr + row_block).to(tl.int64)
            in_table = (idx >= 0) & (idx < n_embeddings)
            tl.device_assert(in_table, "embedding: an index is outside [0, num_embeddings)")
            # tl.where: Triton's interpreter cannot load with a mask made by ``scalar & tensor``.
            w = tl.load(w_ptr + idx * w_row_stride + cols, mask=tl.where(in_table, col_mask, False),
                        other=0.0)
            tl.store(y_ptr + row_block.to(tl.int64) * y_row_stride + cols, w, mask=col_mask)
            if tile % COL_TILES == 0:
                tl.store(keys_ptr + row_block, tl.where(in_table, idx, -1).to(tl.int32))
        else:
            rows = row_block * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
            row_mask = rows < n_tokens
            idx = tl.load(idx_ptr + rows, mask=row_mask, other=0).to(tl.int64)
            in_table = (idx >= 0) & (idx < n_embeddings)
            # ``| ~row_mask`` rather than ``mask=``, which triton-ascend's Triton 3.2 lacks.
            tl.device_assert(in_table | ~row_mask, "embedding: an index is outside [0, num_embeddings)")
            w = tl.load(w_ptr + idx[:, None] * w_row_stride + cols[None, :],
                        mask=(row_mask & in_table)[:, None] & col_mask[None, :], other=0.0)
            tl.store(y_ptr + rows.to(tl.int64)[:, None] * y_row_stride + cols[None, :], w,
                     mask=row_mask[:, None] & col_mask[None, :])
            if tile % COL_TILES == 0:
                tl.store(keys_ptr + rows, tl.where(in_table, idx, -1).to(tl.int32), mask=row_mask)


@fast_launch
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
        if BLOCK_ROWS == 1:
            # One token, with scalar addresses: triton-ascend cannot lower a one-row tensor scatter
            # (its pointer analysis fails: "tt.addptr has multiple users"). Every tile's row exists.
            idx = tl.load(idx_ptr + row_block).to(tl.int64)
            valid = (idx >= 0) & (idx < n_embeddings) & (idx != padding_idx)
            mask = tl.where(valid, col_mask, False)  # not ``&``: as in the forward
            dy = tl.load(dy_ptr + row_block.to(tl.int64) * dy_row_stride + cols, mask=mask, other=0.0)
            tl.atomic_add(dw_ptr + idx * dw_row_stride + cols, dy.to(tl.float32), mask=mask, sem="relaxed")
        else:
            rows = row_block * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
            row_mask = rows < n_tokens
            idx = tl.load(idx_ptr + rows, mask=row_mask, other=0).to(tl.int64)
            valid = row_mask & (idx >= 0) & (idx < n_embeddings) & (idx != padding_idx)
            mask = valid[:, None] & col_mask[None, :]
            dy = tl.load(dy_ptr + rows.to(tl.int64)[:, None] * dy_row_stride + cols[None, :],
                         mask=mask, other=0.0)
            tl.atomic_add(dw_ptr + idx[:, None] * dw_row_stride + cols[None, :], dy.to(tl.float32),
                          mask=mask, sem="relaxed")


@fast_launch
@triton.jit
def _embedding_backward_runs_kernel(
    sorted_ptr, perm_ptr, dy_ptr, dw_ptr, part_ptr, tail_start_ptr,
    n_tokens, n_cols, n_embeddings, dy_row_stride, dw_row_stride, padding_idx,
    SCALE_BY_FREQ: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    COL_TILES: tl.constexpr,
):
    """Program ``(chunk, column tile)`` walks ``CHUNK`` sorted positions and sums each run of equal
    indices among them in token order, in fp32. A run that starts and ends in the chunk is stored
    into its weight row; the piece of a run that began in an earlier chunk (the chunk's head) goes
    to ``part[chunk, 0]``, and the piece of a run that starts here and goes on (its tail) to
    ``part[chunk, 1]``, with the run's first sorted position in ``tail_start[chunk]``."""
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    n_chunks = tl.cdiv(n_tokens, CHUNK)
    for tile in tl.range(pid, n_chunks * COL_TILES, n_programs):
        chunk = tile // COL_TILES
        cols = (tile % COL_TILES) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
        col_mask = cols < n_cols
        first = chunk * CHUNK
        last = tl.minimum(first + CHUNK, n_tokens) - 1
        current = tl.load(sorted_ptr + first).to(tl.int64)
        before = tl.load(sorted_ptr + tl.maximum(first - 1, 0)).to(tl.int64)
        in_head = (first > 0) & (before == current)
        run_start = first
        acc = tl.zeros([BLOCK_COLS], dtype=tl.float32)
        for p in range(first, last + 1):
            token = tl.load(perm_ptr + p).to(tl.int64)
            acc += tl.load(dy_ptr + token * dy_row_stride + cols, mask=col_mask, other=0.0).to(tl.float32)
            following = tl.load(sorted_ptr + tl.minimum(p + 1, n_tokens - 1)).to(tl.int64)
            run_ends = (p + 1 >= n_tokens) | (following != current)
            piece_ends = run_ends | (p == last)
            valid = (current >= 0) & (current < n_embeddings) & (current != padding_idx)
            total = acc
            if SCALE_BY_FREQ:
                total = acc / (p + 1 - run_start).to(tl.float32)
            # Masks as tl.where(scalar, tensor, False): the interpreter refuses ``scalar & tensor``.
            tl.store(dw_ptr + current * dw_row_stride + cols, total.to(dw_ptr.dtype.element_ty),
                     mask=tl.where(run_ends & ~in_head & valid, col_mask, False))
            tl.store(part_ptr + (2 * chunk) * n_cols + cols, acc,
                     mask=tl.where(piece_ends & in_head, col_mask, False))
            tail = piece_ends & ~run_ends & ~in_head
            tl.store(part_ptr + (2 * chunk + 1) * n_cols + cols, acc, mask=tl.where(tail, col_mask, False))
            tl.store(tail_start_ptr + chunk, run_start, mask=tail)
            acc = tl.where(piece_ends, 0.0, acc)
            in_head = in_head & ~run_ends
            run_start = tl.where(run_ends, p + 1, run_start)
            current = tl.where(run_ends, following, current)


@fast_launch
@triton.jit
def _embedding_backward_run_tails_kernel(
    sorted_ptr, run_end_ptr, part_ptr, tail_start_ptr, dw_ptr,
    n_tokens, n_cols, n_embeddings, dw_row_stride, padding_idx,
    SCALE_BY_FREQ: tl.constexpr,
    CHUNK: tl.constexpr,
    JOIN: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    COL_TILES: tl.constexpr,
):
    """Program ``(chunk, column tile)`` finishes the run that leaves ``chunk`` (if one does): its tail
    piece plus the head pieces of the following chunks up to the run's end, ``JOIN`` pieces at a
    time, always in the same order, into the weight row."""
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    n_chunks = tl.cdiv(n_tokens, CHUNK)
    j = tl.arange(0, JOIN)
    for tile in tl.range(pid, (n_chunks - 1) * COL_TILES, n_programs):  # the last chunk has no tail
        chunk = tile // COL_TILES
        cols = (tile % COL_TILES) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
        col_mask = cols < n_cols
        first = chunk * CHUNK
        last = first + CHUNK - 1  # every chunk but the last is full
        index = tl.load(sorted_ptr + last).to(tl.int64)
        following = tl.load(sorted_ptr + last + 1).to(tl.int64)
        # A chunk that lies wholly inside a run begun earlier has a head piece and no tail.
        whole = (first > 0) & (tl.load(sorted_ptr + tl.maximum(first - 1, 0)).to(tl.int64) == index)
        valid = (index >= 0) & (index < n_embeddings) & (index != padding_idx)
        if (following == index) & ~whole & valid:
            acc = tl.load(part_ptr + (2 * chunk + 1) * n_cols + cols, mask=col_mask, other=0.0)
            end = tl.load(run_end_ptr + last)  # one past the run's last sorted position
            last_chunk = (end - 1) // CHUNK
            for c0 in range(chunk + 1, last_chunk + 1, JOIN):
                later = c0 + j
                heads = tl.load(part_ptr + (2 * later)[:, None] * n_cols + cols[None, :],
                                mask=(later <= last_chunk)[:, None] & col_mask[None, :], other=0.0)
                acc += tl.sum(heads, axis=0)
            if SCALE_BY_FREQ:
                acc = acc / (end - tl.load(tail_start_ptr + chunk)).to(tl.float32)
            tl.store(dw_ptr + index * dw_row_stride + cols, acc.to(dw_ptr.dtype.element_ty), mask=col_mask)


@fast_launch
@triton.jit
def _embedding_backward_few_tokens_kernel(
    idx_ptr, dy_ptr, dw_ptr,
    n_tokens, n_cols, n_embeddings, dy_row_stride, dw_row_stride, padding_idx,
    SCALE_BY_FREQ: tl.constexpr,
    BLOCK_TOKENS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    COL_TILES: tl.constexpr,
):
    """The segment kernel's result without the sort, for a few tokens: program ``(t, column tile)``
    writes row ``indices[t]`` if ``t`` is that index's first token, summing the index's tokens in
    token order (the order the stable sort gives), in fp32; other programs write nothing."""
    t = tl.program_id(0) // COL_TILES
    cols = (tl.program_id(0) % COL_TILES) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    col_mask = cols < n_cols
    positions = tl.arange(0, BLOCK_TOKENS)
    all_idx = tl.load(idx_ptr + positions, mask=positions < n_tokens, other=-1).to(tl.int64)
    idx = tl.load(idx_ptr + t).to(tl.int64)
    earlier = tl.sum(((all_idx == idx) & (positions < t)).to(tl.int32), axis=0)
    if (earlier == 0) & (idx >= 0) & (idx < n_embeddings) & (idx != padding_idx):
        acc = tl.zeros([BLOCK_COLS], dtype=tl.float32)
        count = 0
        for s in range(t, n_tokens):
            if tl.sum(tl.where(positions == s, all_idx, 0), axis=0) == idx:
                acc += tl.load(dy_ptr + tl.cast(s, tl.int64) * dy_row_stride + cols, mask=col_mask,
                               other=0.0).to(tl.float32)
                count += 1
        if SCALE_BY_FREQ:
            acc = acc / count
        tl.store(dw_ptr + idx * dw_row_stride + cols, acc.to(dw_ptr.dtype.element_ty), mask=col_mask)


# --------------------------------------------------------------------------------------- launchers


def _tile_plan(rows: int, cols: int, dtype: torch.dtype, tiles: dict,
               profile: DeviceProfile | None) -> RowPlan:
    """``plan_rows`` for a kernel whose programs loop over (row block, column tile) pairs: column
    tiles are independent here (no per-row state), so the grid covers both."""
    return _cached_tile_plan(rows, cols, dtype, tuple(sorted(tiles.items())), profile or get_profile())


@functools.lru_cache(maxsize=1024)
def _cached_tile_plan(rows: int, cols: int, dtype: torch.dtype, tiles: tuple, profile: DeviceProfile) -> RowPlan:
    # Cached: the launchers ask on every call, and a plan with its grid replaced is a new object.
    p = plan_rows(rows, cols, dtype, profile=profile, **dict(tiles))
    n_tiles = p.row_blocks * p.col_tiles
    grid = min(n_tiles, profile.compute_units) if p.persistent else n_tiles
    return dataclasses.replace(p, grid=grid)


def _runs_plan(tokens: int, cols: int, dtype: torch.dtype, profile: DeviceProfile | None) -> RowPlan:
    """The sorted backward's plan: its rows are the chunks of ``RUN_CHUNK`` sorted tokens, one per
    program and column tile."""
    return _tile_plan(cdiv(tokens, RUN_CHUNK), cols, dtype, RUNS_TILES, profile)


def plan(shape, dtype: torch.dtype, profile: DeviceProfile | None = None) -> dict[str, RowPlan]:
    """Plans for indices of shape ``shape[:-2]`` into a ``(num_embeddings, embedding_dim)`` table
    ``shape[-2:]`` of ``dtype``: the forward gather, the atomic backward (over tokens) and the
    sorted backward (over chunks of ``RUN_CHUNK`` sorted tokens; its second kernel, which joins the
    runs that cross chunks, has at most as many programs)."""
    shape = tuple(int(s) for s in shape)
    if len(shape) < 3:
        raise ValueError(f"embedding plans take (*index_shape, num_embeddings, embedding_dim), got {shape}")
    tokens = math.prod(shape[:-2])
    n_embeddings, dim = shape[-2:]
    return {
        "forward": _tile_plan(tokens, dim, dtype, FORWARD_TILES, profile),
        "bwd_atomic": _tile_plan(tokens, dim, torch.float32, ATOMIC_TILES, profile),
        "bwd_sorted": _runs_plan(max(1, tokens), dim, dtype, profile),
    }


def _device_asserts(device: torch.device) -> dict:
    """Launch options that compile the forward kernel's index assertion in: on CUDA (and ROCm) only,
    where a device-side assertion costs one compare per tile row; Triton's integer-overflow checks,
    which the same debug mode would add to every address computation, stay off."""
    return {"debug": True, "sanitize_overflow": False} if device.type == "cuda" else {}


def _capturing(t: torch.Tensor) -> bool:
    return t.device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _raise_if_out_of_range(indices: torch.Tensor, n_embeddings: int) -> None:
    """``IndexOutOfRangeError`` if an index is outside ``[0, n_embeddings)``: one min/max reduction
    on the device and one host synchronisation, to read its two numbers (``check_bounds=True``)."""
    lo, hi = (int(v) for v in torch.stack(torch.aminmax(indices)).tolist())
    if lo < 0 or hi >= n_embeddings:
        bad = lo if lo < 0 else hi
        raise IndexOutOfRangeError(
            f"indices holds {bad}, outside the table's range [0, {n_embeddings}) (min {lo}, max {hi})"
        )


def _sorted_path(weight_dtype: torch.dtype, deterministic: bool, scale_grad_by_freq: bool) -> bool:
    return (deterministic or scale_grad_by_freq or weight_dtype != torch.float32
            or torch.are_deterministic_algorithms_enabled())


@custom_op("embedding_forward")
def embedding_forward(indices: Tensor, weight: Tensor, padding_idx: int, deterministic: bool,
                      scale_grad_by_freq: bool, check_bounds: bool) -> tuple[Tensor, Tensor]:
    """The gathered rows ``(tokens, embedding_dim)`` for the flat, contiguous ``indices``, and the
    backward's keys: the indices as int32, -1 for those outside the table (the sort of int32 keys
    takes about 0.6x the time of int64 ones: 58 against 93 us for 16384 tokens on an H100).
    ``padding_idx`` (-1: none), ``deterministic`` and ``scale_grad_by_freq`` are the backward's."""
    n_tokens = indices.shape[0]
    n_embeddings, dim = weight.shape
    y = torch.empty((n_tokens, dim), dtype=weight.dtype, device=weight.device)
    keys = torch.empty((n_tokens,), dtype=torch.int32, device=weight.device)
    if n_tokens == 0 or dim == 0:
        return y, keys  # the backward needs no keys: its gradient is all zeros
    if check_bounds and not _capturing(indices):
        _raise_if_out_of_range(indices, n_embeddings)
    p = _tile_plan(n_tokens, dim, weight.dtype, FORWARD_TILES, None)
    _embedding_forward_kernel[(p.grid,)](
        indices, weight, y, keys,
        n_tokens, dim, n_embeddings, weight.stride(0), y.stride(0),
        BLOCK_ROWS=p.block_rows, BLOCK_COLS=p.block_cols, COL_TILES=p.col_tiles, num_warps=p.num_warps,
        **_device_asserts(y.device),
    )
    return y, keys


@embedding_forward.register_fake
def _(indices, weight, padding_idx, deterministic, scale_grad_by_freq, check_bounds):
    return (weight.new_empty((indices.shape[0], weight.shape[1])),
            indices.new_empty((indices.shape[0],), dtype=torch.int32))


def _backward_atomic(indices, dy, dw, padding_idx: int) -> None:
    """Add ``dy``'s rows into the zeroed fp32 ``dw`` with atomic adds (fp32 weights only)."""
    n_tokens, dim = dy.shape
    p = _tile_plan(n_tokens, dim, torch.float32, ATOMIC_TILES, None)
    _embedding_backward_atomic_kernel[(p.grid,)](
        indices, dy, dw,
        n_tokens, dim, dw.shape[0], dy.stride(0), dw.stride(0), padding_idx,
        BLOCK_ROWS=p.block_rows, BLOCK_COLS=p.block_cols, COL_TILES=p.col_tiles, num_warps=p.num_warps,
    )


def _backward_few_tokens(indices, dy, dw, padding_idx: int, scale_grad_by_freq: bool) -> None:
    """The segment path's sums into the zeroed ``dw`` without the sort, search and their launches."""
    n_tokens, dim = dy.shape
    p = plan_rows(1, dim, dw.dtype, **FEW_TOKENS_TILES)
    _embedding_backward_few_tokens_kernel[(n_tokens * p.col_tiles,)](
        indices, dy, dw,
        n_tokens, dim, dw.shape[0], dy.stride(0), dw.stride(0), padding_idx,
        SCALE_BY_FREQ=scale_grad_by_freq, BLOCK_TOKENS=next_power_of_2(n_tokens),
        BLOCK_COLS=p.block_cols, COL_TILES=p.col_tiles, num_warps=p.num_warps,
    )


# One high-priority side stream per CUDA device, for the sorted backward's sort (see _sort_beside_fill).
_SIDE_STREAMS: dict[int, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream | None:
    """The side stream of a CUDA ``device``; None elsewhere (one stream: the work runs in order)."""
    if device.type != "cuda":
        return None
    index = torch.cuda.current_device() if device.index is None else device.index
    stream = _SIDE_STREAMS.get(index)
    if stream is None:
        stream = _SIDE_STREAMS[index] = torch.cuda.Stream(index, priority=-1)
    return stream


def _sort_keys(keys: Tensor, sorted_keys: Tensor, perm: Tensor, run_end: Tensor | None) -> None:
    """Sort ``keys`` stably into ``sorted_keys``/``perm`` and, with ``run_end``, write one past the
    last sorted position of each position's run (the run-joining kernel reads it)."""
    # A stable sort keeps equal indices in token order, so each run sums in a fixed order.
    torch.sort(keys, stable=True, out=(sorted_keys, perm))
    if run_end is not None:
        torch.searchsorted(sorted_keys, sorted_keys, right=True, out=run_end)


def _sort_beside_fill(keys: Tensor, n_chunks: int, dw_shape: tuple[int, int],
                      dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor | None, Tensor]:
    """``(sorted_keys, perm, run_end, dw)``: the sort of :func:`_sort_keys` beside the zero fill of
    the weight gradient ``dw`` (``dw_shape``, ``dtype``).

    Neither needs the other, and they are opposite kinds of work: the fill writes the whole table
    (bandwidth-bound, every SM), the sort of a few thousand keys is a chain of small launches
    (latency-bound, a few SMs each). On CUDA the sort therefore runs on a high-priority side stream
    while the fill runs on the caller's, which then waits for it: the sort's time hides under the
    fill's (H200, bf16, 16384 int32 keys and Qwen3-0.6B's 151936 x 1024 table, CUDA-graph replays:
    the sort and search 59 us and the fill 76 us one after the other, 100 us side by side; with
    torch's fill, whose blocks take every SM, side by side saved nothing). Every buffer is
    allocated on the caller's stream before the fork (the side stream only writes them), so none can
    be reused before the join; the fork and join are stream waits, which CUDA graphs capture."""
    sorted_keys, perm = torch.empty_like(keys), torch.empty(keys.shape, dtype=torch.int64, device=keys.device)
    run_end = torch.empty(keys.shape, dtype=torch.int64, device=keys.device) if n_chunks > 1 else None
    side = _side_stream(keys.device)
    if side is None:
        _sort_keys(keys, sorted_keys, perm, run_end)
        return sorted_keys, perm, run_end, zeros(dw_shape, dtype, keys.device)
    caller = torch.cuda.current_stream(keys.device)
    side.wait_stream(caller)  # the keys, and the buffers above, are ready
    with torch.cuda.stream(side):
        _sort_keys(keys, sorted_keys, perm, run_end)
    dw = zeros(dw_shape, dtype, keys.device)
    caller.wait_stream(side)
    return sorted_keys, perm, run_end, dw


def _backward_sorted(keys, dy, n_embeddings: int, dtype: torch.dtype, padding_idx: int,
                     scale_grad_by_freq: bool) -> Tensor:
    """The weight gradient (``n_embeddings`` rows of ``dtype``): every run of equal sorted keys
    summed in token order into the zeroed table, without atomics: sort, sum the runs chunk by
    chunk, then join the runs that cross chunks."""
    n_tokens, dim = dy.shape
    p = _runs_plan(n_tokens, dim, dtype, None)
    n_chunks = p.rows
    sorted_indices, perm, run_end, dw = _sort_beside_fill(keys, n_chunks, (n_embeddings, dim), dtype)
    part = torch.empty((n_chunks, 2, dim), dtype=torch.float32, device=dy.device)
    tail_start = torch.empty((n_chunks,), dtype=torch.int64, device=dy.device)
    options = dict(SCALE_BY_FREQ=scale_grad_by_freq, CHUNK=RUN_CHUNK, BLOCK_COLS=p.block_cols,
                   COL_TILES=p.col_tiles, num_warps=p.num_warps)
    _embedding_backward_runs_kernel[(p.grid,)](
        sorted_indices, perm, dy, dw, part, tail_start,
        n_tokens, dim, dw.shape[0], dy.stride(0), dw.stride(0), padding_idx, **options,
    )
    if n_chunks == 1:
        return dw
    tails = p.col_tiles * (n_chunks - 1)
    _embedding_backward_run_tails_kernel[(min(tails, p.grid),)](
        sorted_indices, run_end, part, tail_start, dw,
        n_tokens, dim, dw.shape[0], dw.stride(0), padding_idx, JOIN=JOIN, **options,
    )
    return dw


@custom_op("embedding_backward")
def embedding_backward(dy: Tensor, keys: Tensor, n_embeddings: int, padding_idx: int,
                       deterministic: bool, scale_grad_by_freq: bool, weight_dtype: torch.dtype) -> Tensor:
    """The dense weight gradient ``(n_embeddings, embedding_dim)`` of ``weight_dtype`` for ``dy``
    ``(tokens, embedding_dim)`` (unit column stride) and the forward's int32 ``keys`` (-1: outside
    the table); the kernel is chosen by ``_sorted_path``."""
    n_tokens, dim = dy.shape
    if n_tokens == 0 or n_embeddings == 0 or dim == 0:
        return torch.zeros((n_embeddings, dim), dtype=weight_dtype, device=dy.device)
    if _sorted_path(weight_dtype, deterministic, scale_grad_by_freq) and n_tokens > FEW_TOKENS:
        return _backward_sorted(keys, dy, n_embeddings, weight_dtype, padding_idx, scale_grad_by_freq)
    dw = zeros((n_embeddings, dim), weight_dtype, dy.device)
    if _sorted_path(weight_dtype, deterministic, scale_grad_by_freq):
        _backward_few_tokens(keys, dy, dw, padding_idx, scale_grad_by_freq)
    else:  # fp32 weights: the atomics accumulate into the gradient itself
        _backward_atomic(keys, dy, dw, padding_idx)
    return dw


@embedding_backward.register_fake
def _(dy, keys, n_embeddings, padding_idx, deterministic, scale_grad_by_freq, weight_dtype):
    return dy.new_empty((n_embeddings, dy.shape[1]), dtype=weight_dtype)


# ---------------------------------------------------------------------------------------- autograd


def _setup_context(ctx, inputs, output):
    _indices, weight, padding_idx, deterministic, scale_grad_by_freq, _check_bounds = inputs
    ctx.save_for_backward(output[1])
    ctx.n_embeddings, ctx.weight_dtype = weight.shape[0], weight.dtype
    ctx.padding_idx, ctx.deterministic = padding_idx, deterministic
    ctx.scale_grad_by_freq = scale_grad_by_freq


def _backward(ctx, dy, _keys_grad):
    (keys,) = ctx.saved_tensors
    dy = dy if dy.stride(-1) == 1 else dy.contiguous()
    dw = embedding_backward(dy, keys, ctx.n_embeddings, ctx.padding_idx, ctx.deterministic,
                            ctx.scale_grad_by_freq, ctx.weight_dtype)
    return None, dw, None, None, None, None


register_autograd(embedding_forward, _backward, setup_context=_setup_context)


# ------------------------------------------------------------------------------------------ public


# The most indices torch's CUDA embedding backward sums without sorting them (its per-feature
# kernel; more, or scale_grad_by_freq, take its sorting path).
TORCH_ATOMIC_BACKWARD_INDICES = 3072


def normalize_padding_idx(padding_idx, n_embeddings: int) -> int | None:
    """``padding_idx`` in ``[0, n_embeddings)`` (negative values count from the end, as in torch)."""
    if padding_idx is None:
        return None
    if isinstance(padding_idx, bool) or not isinstance(padding_idx, int):
        raise TypeError(f"padding_idx must be an int or None, got {type(padding_idx).__name__}")
    if not -n_embeddings <= padding_idx < n_embeddings:
        raise ValueError(f"padding_idx must be within [{-n_embeddings}, {n_embeddings}), got {padding_idx}")
    return padding_idx + n_embeddings if padding_idx < 0 else padding_idx


def _validate(indices, weight, padding_idx, scale_grad_by_freq, deterministic, check_bounds) -> int:
    """The checks of :func:`embedding`; returns ``padding_idx`` in ``[0, num_embeddings)``, or -1."""
    check_index(indices, "indices")
    check_float(weight, "weight")
    if weight.dim() != 2:
        raise ValueError("weight must be 2-D (num_embeddings, embedding_dim), "
                         f"got shape {tuple(weight.shape)}")
    check_same_device(indices, "indices", weight, "weight")
    check_bool(scale_grad_by_freq, "scale_grad_by_freq")
    check_bool(deterministic, "deterministic")
    check_bool(check_bounds, "check_bounds")
    padding_idx = normalize_padding_idx(padding_idx, weight.shape[0])
    return -1 if padding_idx is None else padding_idx


def embedding(
    indices: Tensor,
    weight: Tensor,
    padding_idx: int | None = None,
    *,
    scale_grad_by_freq: bool = False,
    deterministic: bool = False,
    check_bounds: bool = False,
) -> Tensor:
    """Embedding lookup ``weight[indices]``: ``(*indices.shape, embedding_dim)`` in the weight's dtype.

    The arguments shared with ``torch.nn.functional.embedding`` come in its order; the rest are
    keyword-only (a positional ``max_norm`` meant for torch is refused, not misread).
    ``indices``: int32 or int64, any shape (no tokens: an empty result, a zero weight gradient).
    ``padding_idx``: that row gets no gradient (negative values count from the end).
    ``scale_grad_by_freq``: each row's gradient is divided by the number of its index's occurrences.
    The weight gradient accumulates in fp32; ``deterministic=True`` makes it bitwise reproducible
    (sorted segment reduction; bf16/fp16 weights and ``scale_grad_by_freq`` always use it),
    otherwise fp32 weights use atomic adds.

    Out-of-range indices never read or write outside the table: they give zero rows and no
    gradient, and on CUDA the forward kernel asserts on the device (a device-side assertion, as
    PyTorch's CUDA embedding; no host synchronisation). ``check_bounds=True`` raises
    ``IndexOutOfRangeError`` (an ``IndexError`` and a ``ValueError``) naming ``indices`` instead, at
    the cost of one host-device synchronisation per forward (skipped during CUDA graph capture).
    """
    padding_idx = _validate(indices, weight, padding_idx, scale_grad_by_freq, deterministic, check_bounds)
    # Bounds checked on the host and bitwise reproducibility asked for stay Onca's, and so do the
    # calls torch's CUDA backward computes by sorting (more than 3072 indices, or counts for
    # scale_grad_by_freq): older torch versions read a count on the host there, and Onca's ops
    # never synchronise; the per-feature path below it launches a fill and one kernel.
    # The largest tensor is the output, or, where the weight takes a gradient, the table-sized
    # gradient the backward zero-fills: with a large table the fill is the call's GPU time (a 128256
    # x 4096 bf16 table: 0.31 ms by torch's fill, 0.24 by Onca's), not its host path.
    elements = indices.numel() * weight.shape[1]
    if weight.requires_grad and torch.is_grad_enabled():
        elements = max(elements, weight.numel())
    sync_free = not scale_grad_by_freq and indices.numel() <= TORCH_ATOMIC_BACKWARD_INDICES
    if sync_free and not (check_bounds or deterministic) and small_calls.small(elements, weight, indices):
        # torch.nn.functional's op without its Python wrapper (padding_idx is already normalised,
        # -1 for none, as ATen takes it): the same ATen call, about 2 us less host time a call.
        return torch.embedding(weight, indices, padding_idx, scale_grad_by_freq)
    flat = indices.reshape(-1).contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    y, _keys = embedding_forward(flat, weight, padding_idx, deterministic, scale_grad_by_freq, check_bounds)
    return y.view(*indices.shape, weight.shape[1])
