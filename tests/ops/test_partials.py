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


def _norm_calls(device):
    """Each op whose backward reduces through partial rows: (name, module holding its partial
    buffer, a forward taking its inputs, the inputs for an ``(rows, cols)`` shape)."""
    import onca.functional as F
    from onca.ops import _row_norm, modulated_rms_norm, poly_norm

    def leaf(*shape):
        return torch.randn(*shape, device=device, requires_grad=True)

    def heads(rows, cols):  # q's rows of 64-wide heads, k's half of them, weights, tables
        tokens = max(1, rows // 32)
        q, k = leaf(1, tokens, 8, 64), leaf(1, tokens, 4, 64)
        angles = torch.randn(1, tokens, 64, device=device)
        return q, k, leaf(64), leaf(64), angles.cos(), angles.sin()

    return {
        "layer_norm": (_row_norm, F.layer_norm, lambda r, c: (leaf(r, c), leaf(c), leaf(c))),
        "rms_norm": (_row_norm, F.rms_norm, lambda r, c: (leaf(r, c), leaf(c))),
        "fused_add_rms_norm": (_row_norm, F.fused_add_rms_norm, lambda r, c: (leaf(r, c), leaf(r, c), leaf(c))),
        "dyt": (_row_norm, F.dyt, lambda r, c: (leaf(r, c), leaf(1), leaf(c), leaf(c))),
        "rms_norm_rope": (_row_norm, F.rms_norm_rope, heads),
        "poly_norm": (poly_norm, F.poly_norm, lambda r, c: (leaf(r, c), leaf(3), leaf(1))),
        "modulated_rms_norm": (modulated_rms_norm, F.modulated_rms_norm,
                               lambda r, c: (leaf(r, c), leaf(c), leaf(r // 8, c))),
    }


@pytest.mark.parametrize("op", ["layer_norm", "rms_norm", "fused_add_rms_norm", "dyt", "rms_norm_rope",
                                "poly_norm", "modulated_rms_norm"])
@pytest.mark.parametrize("shape, onchip", [((1096, 16), 8192), ((24, 128), None), ((8, 1024), 8192)],
                         ids=["more-row-blocks-than-programs", "fewer", "column-tiled"])
def test_every_partial_row_is_stored(gpu_profile, monkeypatch, device, onchip_bytes, op, shape, onchip):
    """The partial buffers are not zeroed: each program stores its row whole. Filled with NaN
    before the kernel runs, they give the same gradients, bit for bit, as fresh ones (a row, or a
    column tile of one, left unstored would sum as NaN). The row norms' one-program route is off,
    so that these small shapes (a GPU profile's plans, a small on-chip budget for narrow tiles)
    take the partial buffers."""
    from onca.ops import _partials, _row_norm

    monkeypatch.setattr(_row_norm, "DIRECT_MAX_ELEMENTS", 0)
    if onchip is not None:
        onchip_bytes(onchip)
    module, fn, make = _norm_calls(device)[op]

    def gradients():
        torch.manual_seed(1)
        inputs = make(*shape)
        outputs = fn(*inputs)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        torch.autograd.backward(outputs, [torch.ones_like(o) for o in outputs])
        return [t.grad for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]

    fresh = gradients()
    stored = []

    def poisoned(*args, **kwargs):
        buffer = _partials.partial_buffer(*args, **kwargs).fill_(float("nan"))
        stored.append(buffer)
        return buffer

    monkeypatch.setattr(module, "partial_buffer", poisoned)
    for got, want in zip(gradients(), fresh):
        assert torch.equal(got, want)
    assert stored and stored[0].shape[-2] > 1  # the route under test: several programs' rows


@pytest.mark.parametrize("rows, cols", [(264, 4096), (528, 1024), (80, 16384), (40, 33), (1, 7)])
def test_the_sum_tile_covers_every_column_once(profile, rows, cols):
    from onca.ops._partials import _sum_plan

    p = _sum_plan(rows, cols)
    assert p.col_tiles == -(-cols // p.block_cols)
    assert p.block_cols >= min(32, triton.next_power_of_2(cols))  # whole 128-byte runs where there are
    assert p.block_rows * p.block_cols <= 2048


@pytest.mark.parametrize("rows, cols", [(264, 4096), (528, 1024), (264, 8192)])
def test_the_sum_walks_a_gpus_partial_rows_in_few_steps(gpu_profile, rows, cols):
    """A GPU's partial buffers have a row per program, a few hundred; the summing launch takes
    many of them a step (one row a step was latency-bound: 264 rows took 13 us longer than 132 on
    an H200), with a column tile per compute unit or so."""
    from onca.ops._partials import _sum_plan

    p = _sum_plan(rows, cols)
    assert -(-rows // p.block_rows) <= 16
    assert p.col_tiles >= min(gpu_profile.compute_units // 2, -(-cols // 32))
