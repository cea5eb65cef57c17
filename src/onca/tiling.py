"""The tiling planner: the only place that knows on-chip budgets.

A kernel that works on a ``(rows, cols)`` matrix, row by row, declares how many tiles of its block
are alive at once: ``live_tiles`` tiles in the input dtype (loads and stores) and ``fp32_tiles``
tiles in fp32 (upcasts and accumulators). The planner picks

- ``block_cols``: the largest power-of-two width whose live tiles fit the profile's on-chip budget,
  no wider than the row needs and never narrower than the profile's alignment unit;
- ``col_tiles``: how many column tiles a row is split into (1: single pass; more: the kernel makes
  one pass to reduce and one to apply, with half the budget per tile);
- ``block_rows``: how many rows one tile holds when a row is narrow (a 2-D tile);
- ``grid``: one program per row block, or, on a persistent profile, at most one per compute unit,
  each program looping over row blocks ``program, program + grid, ...``.

Plans are plain frozen data, cached per request, and printable (``onca plan OP --shape ...``).

Ops that never hold a whole intermediate (the fused linear losses) split their tokens into chunks
with ``plan_token_chunks``: the largest chunk whose scratch fits a byte budget, which the op derives
from the free device memory (``onca.device.free_memory``).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from onca.device import DeviceProfile, get_profile

__all__ = [
    "RowPlan", "ChunkPlan", "TilingError", "plan_rows", "plan_token_chunks", "next_power_of_2", "cdiv",
    "MAX_TILE_ELEMENTS", "MatmulPlan", "plan_matmul",
]

# Triton refuses tensors with more elements than this in one block.
MAX_TILE_ELEMENTS = 1 << 20
# The most warps a CUDA program can have (1024 threads).
_GPU_PROGRAM_WARPS = 32


class TilingError(ValueError):
    """The request cannot be planned on this profile (it would not fit the on-chip budget)."""


# Host-side integer helpers: Triton's own (triton.cdiv, triton.next_power_of_2) are constexpr
# functions in recent Triton, whose host call unwraps its arguments first (3 us a call on the CI
# host against 0.1 us), and the ops call these on every launch.
def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` of integers, ``b > 0``."""
    return -(-a // b)


def _floor_power_of_2(n: int) -> int:
    return 1 << (n.bit_length() - 1) if n >= 1 else 0


@dataclass(frozen=True)
class RowPlan:
    """How a row-wise kernel covers a ``(rows, cols)`` matrix on one profile."""

    rows: int
    cols: int
    block_rows: int
    block_cols: int
    col_tiles: int
    row_blocks: int
    grid: int
    num_warps: int
    tile_bytes: int
    onchip_bytes: int
    persistent: bool
    profile: str
    # Whether a row split into column tiles carries state across them (a row statistic: the kernel
    # reads the row twice); without, each column tile is finished in one pass.
    row_state: bool = True
    # Whether the kernel's programs take (row block, column tile) jobs (an elementwise map): the
    # grid then counts jobs, not row blocks.
    elementwise: bool = False

    @property
    def jobs(self) -> int:
        """The units of work the grid covers: row blocks, or (row block, column tile) pairs."""
        return self.row_blocks * self.col_tiles if self.elementwise else self.row_blocks

    @property
    def single_pass(self) -> bool:
        return self.col_tiles == 1

    @property
    def row_blocks_per_program(self) -> int:
        return math.ceil(self.row_blocks / self.grid)

    @property
    def rows_per_program(self) -> int:
        return self.row_blocks_per_program * self.block_rows

    def row_blocks_of(self, program: int) -> range:
        """The row blocks that ``program`` handles, in the order the kernels loop over them."""
        return range(program, self.row_blocks, self.grid)

    def rows_of(self, row_block: int) -> range:
        start = row_block * self.block_rows
        return range(start, min(start + self.block_rows, self.rows))

    def cols_of(self, col_tile: int) -> range:
        start = col_tile * self.block_cols
        return range(start, min(start + self.block_cols, self.cols))

    def describe(self) -> str:
        passes = "two passes" if self.row_state else "one pass"
        path = "single pass" if self.single_pass else f"{self.col_tiles} column tiles ({passes})"
        return (
            f"{self.rows} x {self.cols} on {self.profile}: tile {self.block_rows} x {self.block_cols} "
            f"({self.tile_bytes} of {self.onchip_bytes} on-chip bytes), {path}, "
            f"{self.row_blocks} row blocks over a grid of {self.grid}"
            f"{' (persistent)' if self.persistent else ''}, "
            f"{self.rows_per_program} rows per program, {self.num_warps} warps"
        )


def plan_rows(
    rows: int,
    cols: int,
    dtype: torch.dtype,
    live_tiles: int,
    profile: DeviceProfile | None = None,
    *,
    fp32_tiles: int = 0,
    column_fp32: int = 0,
    persistent: bool | None = None,
    max_block_rows: int | None = None,
    max_block_cols: int | None = None,
    max_programs: int | None = None,
    row_state: bool = True,
    min_gpu_rows: int | None = None,
    max_gpu_rows: int | None = None,
    gpu_whole_two_pass: bool = False,
    gpu_streaming: bool = False,
    elementwise: bool = False,
) -> RowPlan:
    """Plan a row-wise kernel over a ``(rows, cols)`` matrix of ``dtype``.

    ``live_tiles`` and ``fp32_tiles`` count the block-sized tiles alive at once (in ``dtype`` and in
    fp32); ``column_fp32`` counts fp32 vectors of one value per column of the block, whatever its
    rows (a column sum carried across row blocks, such as a weight gradient's accumulator).

    ``persistent`` forces (or forbids) a grid capped at the compute units; by default the profile
    decides. Kernels that reduce across rows into per-program partial sums pass ``True`` so that
    the partial buffer stays small. ``max_block_rows`` / ``max_block_cols`` let a kernel cap its
    tile where its own structure needs it (e.g. a rotary half width). ``max_programs`` caps the
    grid (the kernels loop over row blocks, so any grid covers every row): a reduction over all
    rows done by one program can store its result instead of adding partial sums.

    ``row_state=False`` declares a kernel whose column tiles are independent (no per-row state
    carried across them, as an elementwise map with column sums): a row too wide for one tile is
    still covered in one pass, so its tiles get the whole budget and may hold several rows.
    ``min_gpu_rows`` / ``max_gpu_rows`` bound the rows the GPU's rows-per-tile rule
    (``_gpu_block_rows``) gives, where a kernel measured other rows faster; the budget, the largest
    tile and the spread over compute units still cap them, and other devices ignore them.
    ``gpu_whole_two_pass`` gives a GPU's two-pass tile the whole budget instead of half: fewer,
    larger programs, so that the rows in flight, which the second pass reads again, stay in the
    GPU's L2 cache (where a kernel measured it faster); other devices ignore it.
    ``gpu_streaming`` declares a pass that only reads its rows (a log-sum-exp, a row statistic) and
    stores a few values per row: on a GPU its tile holds at most ``tile_elements`` (2048) and its
    program is one warp, so that many programs share an SM and keep many loads in flight. Measured
    on an H200 (bf16, GRPO loss's log-sum-exp pass over 8192 rows): 0.543 ms at 128256 columns
    against 0.732 in the two-pass tile (8192 columns, 16 warps), 0.149 against 0.214 at 32000, 1.102
    against 1.416 at 262144; two warps or 4096 columns were 3-6% slower. Other devices ignore it.
    ``elementwise`` declares a map with no per-row state (it implies ``row_state=False``) whose
    programs take (row block, column tile) jobs: ``grid`` counts jobs, one program per job unless
    the plan is persistent (then each program loops over its share), and on a GPU a tile holds at
    most ``tile_elements`` (2048) at 8 elements a thread. Measured on an H200 (SwiGLU's forward and
    backward kernels, bf16, 16384 x 14336, ``do_bench``): 0.875 ms in one program per 2048-column
    tile, as ``torch.compile``'s 0.874, against 0.898-0.919 when each program looped over its row's
    tiles (1024 to 4096 columns, 4 or 8 warps); the same ordering at 8192 x 14336, 16384 x 18944
    and 16384 x 8192.
    """
    return _plan_rows(
        int(rows), int(cols), dtype, int(live_tiles), profile or get_profile(), int(fp32_tiles),
        int(column_fp32), persistent, max_block_rows, max_block_cols, max_programs, bool(row_state),
        min_gpu_rows, max_gpu_rows, bool(gpu_whole_two_pass), bool(gpu_streaming), bool(elementwise),
    )


@functools.lru_cache(maxsize=4096)
def _plan_rows(rows, cols, dtype, live_tiles, profile, fp32_tiles, column_fp32, persistent, max_block_rows,
               max_block_cols, max_programs, row_state, min_gpu_rows, max_gpu_rows,
               gpu_whole_two_pass, gpu_streaming, elementwise) -> RowPlan:
    row_state = row_state and not elementwise
    if rows < 1 or cols < 1:
        raise TilingError(f"cannot plan an empty matrix ({rows} x {cols})")
    if max_programs is not None and max_programs < 1:
        raise TilingError(f"max_programs must be at least 1, got {max_programs}")
    for name, value in (("min_gpu_rows", min_gpu_rows), ("max_gpu_rows", max_gpu_rows)):
        if value is not None and (not isinstance(value, int) or value < 1):
            raise TilingError(f"{name} must be a positive int or None, got {value!r}")
    units = profile.compute_units if max_programs is None else min(profile.compute_units, max_programs)
    if live_tiles < 0 or fp32_tiles < 0 or live_tiles + fp32_tiles < 1:
        raise TilingError(f"a kernel needs at least one live tile (live={live_tiles}, fp32={fp32_tiles})")
    itemsize = dtype.itemsize
    bytes_per_col = live_tiles * itemsize + fp32_tiles * 4  # per row of the block
    column_bytes = column_fp32 * 4  # once per block, however many rows it has
    # The narrowest block whose every tile is a whole number of alignment units.
    min_block = max(1, next_power_of_2(math.ceil(profile.align_bytes / itemsize)))
    max_elements = _max_tile_elements(profile)
    widest = _floor_power_of_2(min(profile.onchip_bytes // (bytes_per_col + column_bytes), max_elements))
    if max_block_cols is not None:
        widest = min(widest, _floor_power_of_2(max_block_cols))
    if widest < min_block:
        per_column = f" (+ {column_fp32} fp32 per column)" if column_fp32 else ""
        raise TilingError(
            f"{live_tiles} {dtype} + {fp32_tiles} fp32 live tiles{per_column} of the narrowest aligned block "
            f"({min_block} columns, {min_block * (bytes_per_col + column_bytes)} bytes) do not fit the "
            f"{profile.onchip_bytes}-byte on-chip budget of profile {profile.name!r}"
        )
    whole = gpu_whole_two_pass and profile.kind == "cuda" and row_state and next_power_of_2(cols) > widest
    if next_power_of_2(cols) > widest and row_state and not whole:
        # Two passes: the kernel carries per-row state across tiles and reloads each tile, so it
        # gets half the budget (room for that state, and for the next tile's loads in flight).
        widest = max(min_block, widest // 2)
    gpu_tiles = profile.kind == "cuda" and profile.tile_elements > 0
    streaming = gpu_streaming and gpu_tiles
    if streaming or (elementwise and gpu_tiles):
        widest = min(widest, max(min_block, profile.tile_elements))
    block_cols = max(min_block, min(next_power_of_2(cols), widest))
    col_tiles = math.ceil(cols / block_cols)
    is_persistent = profile.persistent if persistent is None else persistent

    block_rows = 1
    if col_tiles == 1 or not row_state:
        fit = _floor_power_of_2(
            min((profile.onchip_bytes - column_bytes * block_cols) // (bytes_per_col * block_cols),
                max_elements // block_cols)
        )
        # Keep at least one row block per compute unit, so that tall tiles never starve the device.
        spread = _floor_power_of_2(max(1, rows // units))
        block_rows = min(fit, spread, next_power_of_2(rows))
        if profile.tile_elements:
            gpu_rows = _gpu_block_rows(profile, block_cols, is_persistent)
            gpu_rows = max(gpu_rows, min_gpu_rows or 1)
            block_rows = min(block_rows, gpu_rows if max_gpu_rows is None else min(gpu_rows, max_gpu_rows))
        if max_block_rows is not None:
            block_rows = min(block_rows, _floor_power_of_2(max_block_rows))
        block_rows = max(1, block_rows)
    row_blocks = math.ceil(rows / block_rows)
    tile_elements = block_rows * block_cols
    # A whole-budget two-pass tile spreads over the largest program a GPU runs, at the same
    # elements per thread as a half-budget tile in half the warps.
    max_warps = _GPU_PROGRAM_WARPS if whole else profile.max_warps
    if streaming:
        num_warps = 1
    else:
        per_thread = _ELEMENTWISE_PER_THREAD if elementwise else None
        num_warps = _num_warps(profile, tile_elements, is_persistent, max_warps, per_thread)
    per_unit = max(1, profile.warps_per_unit // num_warps) if profile.warps_per_unit else 1
    jobs = row_blocks * col_tiles if elementwise else row_blocks
    grid = min(jobs, profile.compute_units * per_unit) if is_persistent else jobs
    if max_programs is not None:
        grid = min(grid, max_programs)
    return RowPlan(
        rows=rows,
        cols=cols,
        block_rows=block_rows,
        block_cols=block_cols,
        col_tiles=col_tiles,
        row_blocks=row_blocks,
        grid=grid,
        num_warps=num_warps,
        tile_bytes=tile_elements * bytes_per_col + block_cols * column_bytes,
        onchip_bytes=profile.onchip_bytes,
        persistent=is_persistent,
        profile=profile.name,
        row_state=row_state,
        elementwise=elementwise,
    )


def _max_tile_elements(profile: DeviceProfile) -> int:
    """Triton's limit on a block, and on a GPU what the threads can hold in registers: 32 elements
    per thread of the largest program (more spills; measured in tools/sm90_compile.py)."""
    if profile.kind == "cuda":
        return min(MAX_TILE_ELEMENTS, profile.max_warps * 32 * 32)
    return MAX_TILE_ELEMENTS


def _gpu_block_rows(profile: DeviceProfile, block_cols: int, persistent: bool) -> int:
    """Rows per tile on a GPU, where registers (not a byte budget) bound a tile and occupancy
    matters. Measured on an H200 (RMSNorm, bf16): one-pass kernels are fastest with tiles of about
    ``tile_elements`` (2048) elements; persistent kernels, which loop and reduce across rows, want
    tiles four times larger and at least two rows, so that each program keeps loads in flight."""
    if persistent:
        return max(2, 4 * profile.tile_elements // block_cols)
    return max(1, profile.tile_elements // block_cols)


# Elements of a tile per thread of an elementwise map's GPU program (see ``plan_rows``).
_ELEMENTWISE_PER_THREAD = 8


def _num_warps(profile: DeviceProfile, tile_elements: int, persistent: bool, max_warps: int,
               per_thread: int | None = None) -> int:
    """About 16 elements of each tile per thread for one-pass kernels and 32 for persistent ones
    (their loop overlaps one row block's reduction with the next one's loads), or ``per_thread``,
    32 threads a warp, at most ``max_warps``."""
    per_thread = per_thread or (32 if persistent else 16)
    floor = 4 if profile.kind == "cuda" else 1
    return max(floor, min(max_warps, _floor_power_of_2(max(1, tile_elements // (32 * per_thread)))))


@dataclass(frozen=True)
class ChunkPlan:
    """How a token-chunked op (fused linear losses) splits ``tokens`` to bound its scratch memory."""

    tokens: int
    chunk: int
    n_chunks: int
    bytes_per_chunk: int
    budget_bytes: int

    def bounds(self, index: int) -> tuple[int, int]:
        start = index * self.chunk
        return start, min(start + self.chunk, self.tokens)

    def describe(self) -> str:
        return (
            f"{self.tokens} tokens in {self.n_chunks} chunks of {self.chunk} "
            f"({self.bytes_per_chunk} scratch bytes each, budget {self.budget_bytes})"
        )


def plan_token_chunks(tokens: int, bytes_per_token: int, budget_bytes: int, *,
                      multiple: int = 16) -> ChunkPlan:
    """The largest chunk of tokens, a multiple of ``multiple`` (or all tokens), whose scratch
    (``bytes_per_token`` each: e.g. a row of logits and its gradient) fits ``budget_bytes``.

    At least one chunk of ``multiple`` tokens is always planned; a budget smaller than that is not
    an error here (the caller decided the budget), the plan simply reports what it will use.
    """
    tokens, bytes_per_token, budget_bytes = int(tokens), int(bytes_per_token), int(budget_bytes)
    if tokens < 1:
        raise TilingError(f"cannot chunk {tokens} tokens")
    if bytes_per_token < 1:
        raise TilingError(f"bytes_per_token must be positive, got {bytes_per_token}")
    fit = max(1, budget_bytes // bytes_per_token)
    chunk = tokens if fit >= tokens else max(multiple, fit // multiple * multiple)
    chunk = min(chunk, tokens)
    n_chunks = math.ceil(tokens / chunk)
    return ChunkPlan(tokens, chunk, n_chunks, chunk * bytes_per_token, budget_bytes)


@dataclass(frozen=True)
class MatmulPlan:
    """How a tiled matmul kernel (``tl.dot`` over ``block_m x block_k`` and ``block_k x block_n``
    tiles, fp32 accumulators) covers an ``(m, n, k)`` product on one profile."""

    m: int
    n: int
    k: int
    block_m: int
    block_n: int
    block_k: int
    accumulators: int
    num_warps: int
    num_stages: int
    tile_bytes: int
    onchip_bytes: int
    profile: str

    def describe(self) -> str:
        return (
            f"{self.m} x {self.n} x {self.k} on {self.profile}: tiles {self.block_m} x {self.block_n} "
            f"(k step {self.block_k}, {self.accumulators} fp32 accumulator(s)), "
            f"{self.tile_bytes} of {self.onchip_bytes} on-chip bytes, {self.num_stages} stage(s), "
            f"{self.num_warps} warps"
        )


# tl.dot needs every tile dimension to be at least 16.
_MIN_DOT = 16
# The largest tile sides tried first; the budget and the problem's own size shrink them.
_MAX_DOT_M, _MAX_DOT_N, _MAX_DOT_K = 128, 128, 64
# Registers bound a GPU program's accumulators: at most this many fp32 accumulator elements
# (128 x 128, 64 registers a thread over 8 warps) before they spill.
_GPU_ACC_ELEMENTS = 128 * 128
# The software pipeline's depth on a GPU: operand tiles of this many k steps in flight.
_GPU_STAGES = 3


def plan_matmul(
    m: int,
    n: int,
    k: int,
    dtype: torch.dtype,
    profile: DeviceProfile | None = None,
    *,
    accumulators: int = 1,
    epilogue_tiles: int = 0,
    block_m: int | None = None,
    max_block_n: int = _MAX_DOT_N,
    max_block_k: int = _MAX_DOT_K,
    num_warps: int | None = None,
    max_acc_elements: int = _GPU_ACC_ELEMENTS,
    num_stages: int = _GPU_STAGES,
) -> MatmulPlan:
    """Plan a tiled matmul ``(m, k) @ (k, n)`` in ``dtype`` with ``accumulators`` fp32 output tiles
    (two for a gated product computed in one pass) and ``epilogue_tiles`` more fp32 output-sized
    tiles alive in the epilogue. ``block_m`` fixes the row tile (kernels that share a row tiling).

    Each side starts at the largest tile (128 x 128, k step 64, or the caller's ``max_block_n`` /
    ``max_block_k`` where its kernel measured faster so), no larger than the problem needs (and
    never below 16, ``tl.dot``'s minimum); the largest side is halved until the operand tiles (times
    the pipeline's stages) and the fp32 tiles fit the profile's on-chip budget (and, on a GPU, the
    pipelined operand tiles its shared memory), and at the smallest tiles the pipeline loses
    stages. ``num_warps`` overrides the GPU's warp count (measured best for a kernel); other
    profiles keep theirs. ``max_acc_elements`` (one program's fp32 accumulator
    elements, all accumulators together) and ``num_stages`` (the pipeline's depth) are the GPU's
    register and pipelining limits, raised by a kernel whose larger tiles measured faster; the
    other profiles, bounded by their on-chip budget alone, ignore them.
    """
    profile = profile or get_profile()
    return _plan_matmul(int(m), int(n), int(k), dtype, profile, int(accumulators), int(epilogue_tiles),
                        None if block_m is None else int(block_m), int(max_block_n), int(max_block_k),
                        None if num_warps is None else int(num_warps), int(max_acc_elements),
                        int(num_stages))


@functools.lru_cache(maxsize=4096)
def _plan_matmul(m, n, k, dtype, profile, accumulators, epilogue_tiles, block_m, max_block_n, max_block_k,
                 num_warps, max_acc_elements, num_stages) -> MatmulPlan:
    if accumulators < 1:
        raise TilingError(f"a matmul needs at least one accumulator, got {accumulators}")
    for name, side in (("max_block_n", max_block_n), ("max_block_k", max_block_k)):
        if side < _MIN_DOT or side & (side - 1):
            raise TilingError(f"{name} must be a power of two of at least {_MIN_DOT}, got {side}")
    itemsize = dtype.itemsize
    side = lambda size, largest: max(_MIN_DOT, min(largest, next_power_of_2(max(1, size))))  # noqa: E731
    bm = block_m if block_m is not None else side(m, _MAX_DOT_M)
    bn, bk = side(n, max_block_n), side(k, max_block_k)
    if max_acc_elements < _MIN_DOT * _MIN_DOT:
        raise TilingError(f"max_acc_elements must be at least {_MIN_DOT * _MIN_DOT}, got {max_acc_elements}")
    if num_stages < 1:
        raise TilingError(f"num_stages must be at least 1, got {num_stages}")
    stages = num_stages if profile.kind == "cuda" else 1
    fp32_tiles = accumulators + epilogue_tiles

    def cost(bm, bn, bk):
        return (bm * bk + accumulators * bn * bk) * itemsize * stages + fp32_tiles * bm * bn * 4

    def acc_ok(bm, bn):
        return profile.kind != "cuda" or accumulators * bm * bn <= max_acc_elements

    def shared_ok(bm, bn, bk, stages):
        # Triton's pipeline keeps stages - 1 operand tiles of each side in shared memory (an H200
        # asked 294912 bytes for four stages of 98304: the launch refuses more than the device has).
        if profile.kind != "cuda" or not profile.shared_bytes:
            return True
        return (bm * bk + accumulators * bn * bk) * itemsize * max(1, stages - 1) <= profile.shared_bytes

    # The accumulators first: their size does not depend on the k step, so only the output tile
    # shrinks for them.
    while not acc_ok(bm, bn):
        if bn > _MIN_DOT and (block_m is not None or bn >= bm):
            bn //= 2
        elif block_m is None and bm > _MIN_DOT:
            bm //= 2
        else:
            raise TilingError(f"{accumulators} fp32 accumulator(s) of {bm} x {bn} exceed max_acc_elements "
                              f"({max_acc_elements})")
    while cost(bm, bn, bk) > profile.onchip_bytes or not shared_ok(bm, bn, bk, stages):
        if bk > _MIN_DOT and bk >= max(bn, bm if block_m is None else 0) // 2:
            bk //= 2
        elif bn > _MIN_DOT and (block_m is not None or bn >= bm):
            bn //= 2
        elif block_m is None and bm > _MIN_DOT:
            bm //= 2
        elif bk > _MIN_DOT:
            bk //= 2
        elif stages > 1:
            stages -= 1
        else:
            raise TilingError(
                f"the smallest matmul tiles ({bm} x {bn}, k step {bk}, {accumulators} accumulator(s)) "
                f"need {cost(bm, bn, bk)} bytes, more than the {profile.onchip_bytes}-byte on-chip "
                f"budget of profile {profile.name!r}"
                + ("" if shared_ok(bm, bn, bk, stages)
                   else f" (or its {profile.shared_bytes} bytes of shared memory)")
            )
    warps = 8 if profile.kind == "cuda" and accumulators * bm * bn >= 128 * 128 else 4
    if profile.kind == "cuda" and num_warps is not None:
        warps = num_warps
    if profile.kind != "cuda":
        warps = 1 if profile.kind == "cpu" else 4
    return MatmulPlan(m, n, k, bm, bn, bk, accumulators, warps, stages, cost(bm, bn, bk),
                      profile.onchip_bytes, profile.name)
