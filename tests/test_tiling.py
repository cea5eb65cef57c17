"""The planner's invariants, over every built-in profile and a spread of shapes and dtypes."""

from __future__ import annotations

import itertools

import pytest
import torch

from onca.device import PROFILES, DeviceProfile
from onca.tiling import MAX_TILE_ELEMENTS, TilingError, plan_matmul, plan_rows

SHAPES = [(1, 1), (1, 64), (37, 1000), (16384, 4096), (3, 65536), (7, 131072), (100000, 128), (5, 3)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
TILES = [dict(live_tiles=3, fp32_tiles=2), dict(live_tiles=4, fp32_tiles=4), dict(live_tiles=1),
         dict(live_tiles=4, fp32_tiles=4, column_fp32=3),
         dict(live_tiles=4, fp32_tiles=4, column_fp32=3, row_state=False, min_gpu_rows=4, max_gpu_rows=4),
         dict(live_tiles=2, fp32_tiles=4, gpu_whole_two_pass=True),
         dict(live_tiles=2, fp32_tiles=3, gpu_streaming=True),
         dict(live_tiles=5, fp32_tiles=6, elementwise=True)]


def _bytes_per_col(dtype, tiles):
    return tiles.get("live_tiles", 0) * torch.empty((), dtype=dtype).element_size() + tiles.get("fp32_tiles", 0) * 4


@pytest.mark.parametrize("name", sorted(PROFILES))
def test_plan_invariants(name):
    for shape, dtype, tiles, persistent in itertools.product(SHAPES, DTYPES, TILES, [None, True]):
        _check_plan(PROFILES[name], shape, dtype, tiles, persistent)


def _check_plan(profile, shape, dtype, tiles, persistent):
    rows, cols = shape
    p = plan_rows(rows, cols, dtype, profile=profile, persistent=persistent, **tiles)
    itemsize = torch.empty((), dtype=dtype).element_size()
    # Fits the budget, and says so truthfully.
    assert p.tile_bytes == (p.block_rows * p.block_cols * _bytes_per_col(dtype, tiles)
                            + p.block_cols * 4 * tiles.get("column_fp32", 0))
    assert p.tile_bytes <= profile.onchip_bytes
    assert p.block_rows * p.block_cols <= MAX_TILE_ELEMENTS
    # Powers of two, aligned to the profile's unit (32 bytes on Ascend).
    for block in (p.block_rows, p.block_cols):
        assert block & (block - 1) == 0
    assert (p.block_cols * itemsize) % profile.align_bytes == 0
    if profile.kind == "npu":
        assert (p.block_cols * itemsize) % 32 == 0
    # Persistent profiles (Ascend, the interpreter) never launch more programs than compute units.
    # A GPU's persistent grid keeps `warps_per_unit` warps resident per SM, as several programs.
    if p.persistent:
        per_unit = max(1, profile.warps_per_unit // p.num_warps) if profile.warps_per_unit else 1
        assert p.grid <= profile.compute_units * per_unit
        if profile.persistent:
            assert p.grid <= profile.compute_units
    assert p.persistent == (profile.persistent if persistent is None else persistent)
    # A grid that is not persistent has one program per unit of work (row block, or job).
    if not p.persistent:
        assert p.grid == p.jobs
    # A row wider than one block is split into column tiles; otherwise one pass.
    assert p.col_tiles == -(-cols // p.block_cols)
    assert p.single_pass == (cols <= p.block_cols)


@pytest.mark.parametrize("name", sorted(PROFILES))
@pytest.mark.parametrize("shape", [(1, 1), (37, 1000), (1000, 300), (5, 70000), (300, 33)])
def test_plan_covers_every_row_and_column_once(name, shape):
    rows, cols = shape
    p = plan_rows(rows, cols, torch.bfloat16, live_tiles=3, fp32_tiles=2, profile=PROFILES[name],
                  persistent=True)
    seen_rows = [r for prog in range(p.grid) for rb in p.row_blocks_of(prog) for r in p.rows_of(rb)]
    assert sorted(seen_rows) == list(range(rows))
    seen_cols = [c for t in range(p.col_tiles) for c in p.cols_of(t)]
    assert seen_cols == list(range(cols))
    # Every program has work: none of the grid is wasted.
    assert all(len(p.row_blocks_of(prog)) > 0 for prog in range(p.grid))


def test_wide_rows_plan_on_every_profile():
    for profile in PROFILES.values():
        for dtype in DTYPES:
            p = plan_rows(8, 65536, dtype, live_tiles=4, fp32_tiles=4, profile=profile, persistent=True)
            assert p.col_tiles * p.block_cols >= 65536


def test_column_values_count_once_per_block():
    """A column accumulator is one row of values however many rows the block has: counted so, it
    leaves room for two-row tiles that counting it as a full tile would not (DyT's backward)."""
    h100 = PROFILES["h100"]
    shape = dict(rows=16384, cols=8192, dtype=torch.bfloat16, live_tiles=4, profile=h100, persistent=True)
    as_tiles = plan_rows(**shape, fp32_tiles=7)
    as_columns = plan_rows(**shape, fp32_tiles=4, column_fp32=3)
    assert as_tiles.block_rows == 1 and as_columns.block_rows == 2
    assert as_columns.tile_bytes == 2 * 8192 * (4 * 2 + 4 * 4) + 8192 * 3 * 4 <= h100.onchip_bytes
    # One row per block: the same bytes either way, so the same plan.
    wide = dict(rows=16384, cols=16384, dtype=torch.bfloat16, live_tiles=4, profile=h100, persistent=True)
    assert plan_rows(**wide, fp32_tiles=7) == plan_rows(**wide, fp32_tiles=4, column_fp32=3)


def test_independent_column_tiles_take_the_whole_budget_and_several_rows():
    """A kernel without per-row state (DyT's backward) covers a row too wide for one tile in one
    pass: its tiles are not halved as a two-pass kernel's are, may hold several rows, and the plan
    says "one pass"; ``min_gpu_rows``/``max_gpu_rows`` bound the rows of a GPU tile, under the
    budget's cap."""
    h100 = PROFILES["h100"]
    wide = dict(rows=16384, cols=16384, dtype=torch.bfloat16, live_tiles=4, fp32_tiles=4, column_fp32=3,
                profile=h100, persistent=True)
    two_pass, one_pass = plan_rows(**wide), plan_rows(**wide, row_state=False, min_gpu_rows=4)
    assert (two_pass.block_rows, two_pass.block_cols) == (1, 4096) and "(two passes)" in two_pass.describe()
    assert (one_pass.block_rows, one_pass.block_cols) == (2, 8192)  # 4 rows asked, 2 fit the budget
    assert "2 column tiles (one pass)" in one_pass.describe() and one_pass.tile_bytes <= h100.onchip_bytes
    narrow = dict(rows=16384, cols=1024, dtype=torch.bfloat16, live_tiles=4, fp32_tiles=4, profile=h100,
                  persistent=True)
    assert plan_rows(**narrow).block_rows == 8  # the GPU rule for persistent kernels
    assert plan_rows(**narrow, max_gpu_rows=4).block_rows == 4
    assert plan_rows(**narrow, min_gpu_rows=4).block_rows == 8  # a floor under the rule's 8
    assert plan_rows(**{**narrow, "cols": 4096}).block_rows == 2
    assert plan_rows(**{**narrow, "cols": 4096}, min_gpu_rows=4).block_rows == 4
    with pytest.raises(TilingError, match="max_gpu_rows must be a positive int or None, got 0"):
        plan_rows(**narrow, max_gpu_rows=0)
    # Not a GPU: the budget alone decides, whatever the GPU rows.
    ascend = PROFILES["ascend910b2"]
    assert (plan_rows(**{**narrow, "profile": ascend}, min_gpu_rows=4, max_gpu_rows=4)
            == plan_rows(**{**narrow, "profile": ascend}))


def test_gpu_whole_two_pass():
    """A GPU's two-pass tile takes the whole budget, in twice the warps (the same elements per
    thread), with ``gpu_whole_two_pass``; a row that fits one tile, a one-pass kernel and other
    devices plan as without it."""
    h100 = PROFILES["h100"]
    vocab = dict(rows=8192, cols=128256, dtype=torch.bfloat16, live_tiles=2, fp32_tiles=4, profile=h100)
    half, whole = plan_rows(**vocab), plan_rows(**vocab, gpu_whole_two_pass=True)
    assert (half.block_cols, half.col_tiles, half.num_warps) == (8192, 16, 16)
    assert (whole.block_cols, whole.col_tiles, whole.num_warps) == (16384, 8, 32)
    assert whole.tile_bytes <= h100.onchip_bytes and "(two passes)" in whole.describe()
    fits = {**vocab, "cols": 4096}
    assert plan_rows(**fits, gpu_whole_two_pass=True) == plan_rows(**fits)
    assert plan_rows(**vocab, row_state=False, gpu_whole_two_pass=True) == plan_rows(**vocab, row_state=False)
    for name in ("ascend910b2", "cpu-interpreter"):
        other = {**vocab, "profile": PROFILES[name]}
        assert plan_rows(**other, gpu_whole_two_pass=True) == plan_rows(**other)


def test_gpu_streaming():
    """A GPU's reading pass gets one-warp programs of at most ``tile_elements`` (2048) elements with
    ``gpu_streaming``, narrow rows several to a tile; other devices plan as without it."""
    h200 = PROFILES["h200"]
    vocab = dict(rows=8192, cols=128256, dtype=torch.bfloat16, live_tiles=2, fp32_tiles=3, profile=h200)
    p = plan_rows(**vocab, gpu_streaming=True)
    assert (p.block_rows, p.block_cols, p.col_tiles, p.num_warps) == (1, 2048, 63, 1)
    narrow = plan_rows(**{**vocab, "cols": 1000}, gpu_streaming=True)
    assert (narrow.block_rows, narrow.block_cols, narrow.num_warps) == (2, 1024, 1)
    for name in ("ascend910b2", "cpu-interpreter"):
        other = {**vocab, "profile": PROFILES[name]}
        assert plan_rows(**other, gpu_streaming=True) == plan_rows(**other)


def test_elementwise():
    """An elementwise map plans (row block, column tile) jobs: on a GPU one program per job of at
    most ``tile_elements`` (2048) elements at 8 a thread; a persistent profile keeps its capped grid
    and its budget's tiles, as a map without row state."""
    mlp = dict(rows=16384, cols=14336, dtype=torch.bfloat16, live_tiles=5, fp32_tiles=6)
    p = plan_rows(**mlp, profile=PROFILES["h200"], elementwise=True)
    assert (p.block_rows, p.block_cols, p.col_tiles, p.num_warps) == (1, 2048, 7, 8)
    assert p.grid == p.jobs == 16384 * 7 and not p.row_state
    narrow = plan_rows(**{**mlp, "cols": 520}, profile=PROFILES["h200"], elementwise=True)
    assert (narrow.block_rows, narrow.block_cols, narrow.grid) == (2, 1024, 8192)
    for name in ("ascend910b2", "cpu-interpreter"):
        other = plan_rows(**mlp, profile=PROFILES[name], elementwise=True)
        stateless = plan_rows(**mlp, profile=PROFILES[name], row_state=False)
        assert (other.block_rows, other.block_cols, other.col_tiles) == (
            stateless.block_rows, stateless.block_cols, stateless.col_tiles)
        assert other.jobs == other.row_blocks * other.col_tiles and other.grid <= PROFILES[name].compute_units


def test_narrow_rows_share_a_tile():
    p = plan_rows(16384, 128, torch.bfloat16, live_tiles=3, fp32_tiles=2, profile=PROFILES["h100"])
    assert p.block_rows > 1 and p.row_blocks * p.block_rows >= 16384


def test_impossible_request_is_a_clear_error():
    tiny = DeviceProfile("npu", "tiny", 4, 64, True, 0.0, align_bytes=32)
    with pytest.raises(TilingError, match="do not fit the 64-byte on-chip budget of profile 'tiny'"):
        plan_rows(4, 4096, torch.bfloat16, live_tiles=8, fp32_tiles=8, profile=tiny)
    with pytest.raises(TilingError, match="empty"):
        plan_rows(0, 4096, torch.bfloat16, live_tiles=1, profile=PROFILES["h100"])
    with pytest.raises(TilingError, match="at least one live tile"):
        plan_rows(4, 4096, torch.bfloat16, live_tiles=0, profile=PROFILES["h100"])


MATMULS = [(1, 1, 1), (4096, 4096, 4096), (8192, 32, 16384), (17, 300, 5), (8192, 16384, 32)]


@pytest.mark.parametrize("name", sorted(PROFILES))
def test_matmul_plans_fit_every_profile(name):
    """Every side a power of two of at least 16 (``tl.dot``), at most the problem's own size
    rounded up and the largest side asked for; the tiles within the budget."""
    profile = PROFILES[name]
    for (m, n, k), dtype, largest in itertools.product(MATMULS, DTYPES, [(128, 64), (256, 128)]):
        p = plan_matmul(m, n, k, dtype, profile, epilogue_tiles=2, max_block_n=largest[0], max_block_k=largest[1])
        for side, size, cap in ((p.block_m, m, 128), (p.block_n, n, largest[0]), (p.block_k, k, largest[1])):
            assert side >= 16 and side & (side - 1) == 0 and side <= max(16, min(cap, 2 * size))
        assert p.tile_bytes <= profile.onchip_bytes and p.num_stages >= 1


def test_matmul_plan_overrides_and_tight_budgets():
    h100 = PROFILES["h100"]
    wide = plan_matmul(16, 16384, 32, torch.bfloat16, h100, block_m=16, max_block_n=256, num_warps=8)
    assert (wide.block_m, wide.block_n, wide.num_warps) == (16, 256, 8)
    assert plan_matmul(16, 16384, 32, torch.bfloat16, PROFILES["ascend910b4"], num_warps=8).num_warps == 4
    # A budget too small for three pipelined stages of the smallest tiles: fewer stages, not an error.
    tight = DeviceProfile("cuda", "tight", 4, 6144, False, 0.0)
    p = plan_matmul(4096, 4096, 4096, torch.float32, tight)
    assert (p.block_m, p.block_n, p.block_k) == (16, 16, 16) and p.num_stages < 3 and p.tile_bytes <= 6144
    with pytest.raises(TilingError, match="more than the 1024-byte on-chip budget of profile 'tiny'"):
        plan_matmul(64, 64, 64, torch.float32, DeviceProfile("cuda", "tiny", 4, 1024, False, 0.0))
    with pytest.raises(TilingError, match="max_block_k must be a power of two"):
        plan_matmul(64, 64, 64, torch.float32, h100, max_block_k=48)


@pytest.mark.parametrize("name", sorted(n for n, p in PROFILES.items() if p.kind == "cuda"))
def test_matmul_plans_fit_the_gpu_shared_memory(name):
    """Triton keeps ``stages - 1`` operand tiles of each side in shared memory and refuses a launch
    asking more than the device has: every plan fits, wide tiles and deep pipelines included (four
    stages of fp32 128 x 256 tiles asked 294912 bytes of an H200's 232448)."""
    profile = PROFILES[name]
    wide = dict(max_block_n=256, max_acc_elements=128 * 256, num_stages=4)
    for (m, n, k), dtype, accumulators in itertools.product(MATMULS, DTYPES, (1, 2)):
        for limits in ({}, wide):
            p = plan_matmul(m, n, k, dtype, profile, accumulators=accumulators, **limits)
            itemsize = torch.empty((), dtype=dtype).element_size()
            operands = (p.block_m * p.block_k + accumulators * p.block_n * p.block_k) * itemsize
            assert operands * max(1, p.num_stages - 1) <= profile.shared_bytes, p.describe()
    h200 = plan_matmul(4096, 4096, 4096, torch.bfloat16, PROFILES["h200"], **wide)
    assert (h200.block_n, h200.block_k, h200.num_stages) == (256, 64, 4)  # 147456 bytes: fits
    fp32 = plan_matmul(4096, 4096, 4096, torch.float32, PROFILES["h200"], **wide)
    assert (fp32.block_n, fp32.block_k, fp32.num_stages) == (128, 64, 4)  # 128 x 256 would ask 294912


def test_matmul_accumulator_limit_shrinks_the_output_tile_not_the_k_step():
    """Two 128 x 128 accumulators pass the GPU's default 128 x 128 limit: the column tile halves and
    the k step stays (their size does not depend on it); a raised limit and deeper pipeline are
    taken on a GPU and ignored where the on-chip budget alone bounds the tiles."""
    h200, ascend = PROFILES["h200"], PROFILES["ascend910b4"]
    gated = plan_matmul(2048, 14336, 4096, torch.bfloat16, h200, accumulators=2)
    assert (gated.block_m, gated.block_n, gated.block_k, gated.num_stages) == (128, 64, 64, 3)
    wide = plan_matmul(2048, 14336, 4096, torch.bfloat16, h200, max_block_n=256,
                       max_acc_elements=128 * 256, num_stages=4)
    assert (wide.block_m, wide.block_n, wide.block_k, wide.num_stages, wide.num_warps) == (128, 256, 64, 4, 8)
    default = plan_matmul(2048, 14336, 4096, torch.bfloat16, ascend, max_block_n=256)
    assert plan_matmul(2048, 14336, 4096, torch.bfloat16, ascend, max_block_n=256,
                       max_acc_elements=256, num_stages=4) == default
    with pytest.raises(TilingError, match="num_stages must be at least 1, got 0"):
        plan_matmul(64, 64, 64, torch.bfloat16, h200, num_stages=0)
    with pytest.raises(TilingError, match="max_acc_elements must be at least 256, got 8"):
        plan_matmul(64, 64, 64, torch.bfloat16, h200, max_acc_elements=8)
    too_many = r"2 fp32 accumulator\(s\) of 16 x 16 exceed max_acc_elements \(256\)"
    with pytest.raises(TilingError, match=too_many):
        plan_matmul(64, 64, 64, torch.bfloat16, h200, accumulators=2, max_acc_elements=256)


def test_plans_are_cached_and_printable():
    a = plan_rows(16384, 4096, torch.bfloat16, 3, PROFILES["ascend910b4"], fp32_tiles=2)
    b = plan_rows(16384, 4096, torch.bfloat16, 3, PROFILES["ascend910b4"], fp32_tiles=2)
    assert a is b
    text = a.describe()
    assert "16384 x 4096 on ascend910b4" in text and "persistent" in text


def test_token_chunks_fit_budget_and_cover_tokens():
    from onca.tiling import plan_token_chunks

    for tokens, per_token, budget in [(8192, 128256 * 4, 1 << 30), (5, 1000, 10**9), (1000, 4096, 4096 * 37),
                                      (1, 10, 1), (12345, 262144 * 6, 256 << 20)]:
        c = plan_token_chunks(tokens, per_token, budget)
        covered = [t for i in range(c.n_chunks) for t in range(*c.bounds(i))]
        assert covered == list(range(tokens))
        assert c.chunk == tokens or c.chunk % 16 == 0
        if c.chunk > 16:
            assert c.bytes_per_chunk <= budget
    with pytest.raises(TilingError):
        plan_token_chunks(0, 10, 10)


def test_free_memory_is_positive():
    from onca.device import free_memory

    assert free_memory() > 0
