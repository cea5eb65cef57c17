"""The deterministic partial-sum reduction shared by ops with weight gradients."""

from __future__ import annotations

import pytest
import torch
import triton

from onca.ops._partials import sum_partials, sum_partials_times, sum_scaled
from tests.helpers import assert_close


@pytest.mark.parametrize("shape", [(1, 7), (3, 1000), (264, 4096), (40, 33)])
def test_sum_partials_matches_torch(profile, device, shape):
    partials = torch.randn(*shape, device=device)
    total = sum_partials(partials)
    assert_close(total, partials.double().sum(0), torch.float32, "sum")
    assert torch.equal(total, sum_partials(partials))  # the same bits every time
    assert sum_partials(partials, torch.bfloat16).dtype == torch.bfloat16


@pytest.mark.parametrize("planes", [1, 2, 3])
def test_sum_partials_sums_each_plane_into_its_own_dtype(profile, device, planes):
    partials = torch.randn(planes, 37, 300, device=device)
    dtypes = [torch.bfloat16, torch.float32, torch.float16][:planes]
    totals = sum_partials(partials, dtypes)
    assert [t.dtype for t in totals] == dtypes
    for plane, total in zip(partials, totals):
        assert_close(total, plane.double().sum(0), total.dtype, "sum")
        assert torch.equal(total, sum_partials(plane.contiguous(), total.dtype))  # as a 2-D buffer


def test_sum_partials_wants_a_dtype_per_plane(device):
    with pytest.raises(ValueError, match="3 planes but 2 dtypes"):
        sum_partials(torch.zeros(3, 4, 8, device=device), [torch.float32] * 2)


@pytest.mark.parametrize("shape", [(1, 7), (264, 4096), (40, 33)])
def test_sum_partials_times_scales_one_sum_twice(profile, device, shape):
    """One sum, two products with their own vectors and dtypes (attention residuals' two weight
    gradients): each equals the fp32 sum times its vector, rounded once; the sum is the one
    sum_partials computes, bit for bit."""
    partials = torch.randn(*shape, device=device)
    first = torch.randn(shape[1], device=device).to(torch.bfloat16)
    second = torch.randn(shape[1], device=device)
    a, b = sum_partials_times(partials, (first, second), (torch.float32, torch.bfloat16))
    assert (a.dtype, b.dtype) == (torch.float32, torch.bfloat16)
    total = sum_partials(partials)
    assert torch.equal(a, total * first.float())
    assert torch.equal(b, (total * second).to(torch.bfloat16))
    assert_close(a, partials.double().sum(0) * first.double(), torch.float32, "scaled sum")


@pytest.mark.parametrize("n", [0, 1, 1000, 1024, 3001])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_sum_scaled_matches_torch(profile, device, n, dtype):
    """A loss summed over rows, times a host scale and a device factor, in one launch: torch's
    value (a sum over nothing is 0, times a NaN scale NaN), the same bits every time."""
    values = torch.randn(n, device=device)
    factor = torch.tensor([0.25], device=device)
    got = sum_scaled(values, dtype, 3.0, factor)
    assert got.shape == () and got.dtype == dtype
    assert_close(got, values.double().sum() * 0.75, dtype, "loss")
    assert torch.equal(got, sum_scaled(values, dtype, 3.0, factor))
    assert_close(sum_scaled(values, dtype), values.double().sum(), dtype, "sum")
    assert torch.isnan(sum_scaled(values[:0], dtype, float("nan")))
@pytest.mark.parametrize("rows, cols", [(264, 4096), (528, 1024), (80, 16384), (40, 33), (1, 7)])
def test_the_sum_tile_covers_every_column_once(profile, rows, cols):
    from onca.ops._partials import _sum_plan

    p = _sum_plan(rows, cols)
    assert p.col_tiles == -(-cols // p.block_cols)
    assert p.block_cols >= min(32, triton.next_power_of_2(cols))  # whole 128-byte runs where there are
    assert p.block_rows * p.block_cols <= 2048


@pytest.mark.parametrize("rows, cols", [(264, 4096), (528, 1024), (264, 8192)])
def test_the_sum_walks_a_gpus_partial_rows_in_few_steps(gpu_profile, rows, cols):
    """A GPU's partial buffers have a row per two programs, up to a few hundred; the summing launch
    takes many of them a step (one row a step was latency-bound: 264 rows took 13 us longer than 132 on
    an H200), with a column tile per compute unit or so."""
    from onca.ops._partials import _sum_plan

    p = _sum_plan(rows, cols)
    assert -(-rows // p.block_rows) <= 16
    assert p.col_tiles >= min(gpu_profile.compute_units // 2, -(-cols // 32))
