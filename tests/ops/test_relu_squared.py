"""Squared ReLU forward and backward against a float64 reference (and transformers' relu2)."""

from __future__ import annotations

import pytest
import torch

from onca.ops import relu_squared as op
from onca.ops.relu_squared import relu_squared
from tests.contract import assert_op_contract
from tests.helpers import DTYPES, SCALE, assert_close, leaf, non_contiguous, randn

SHAPES = {
    "cpu": [(1, 1), (1, 77), (37, 300), (2, 3, 96), (2, 4099), (7,)],
    "gpu": [(16384, 14336), (4096, 28672), (4, 2048, 18944), (1, 4096), (3, 65537)],
}[SCALE]
BASE_SHAPE = {"cpu": (2, 7, 300), "gpu": (8, 1024, 14336)}[SCALE]
TILED_COLS = {"cpu": 300, "gpu": 65536}[SCALE]


def check(x):
    xk = leaf(x)
    y = relu_squared(xk)
    x64 = x.detach().to(torch.float64).requires_grad_(True)
    ref = torch.relu(x64).square()
    assert y.dtype == x.dtype and y.shape == x.shape
    assert_close(y, ref, x.dtype, "y")
    dy = randn(*x.shape, dtype=x.dtype, device=x.device)
    y.backward(dy)
    ref.backward(dy.to(torch.float64))
    assert_close(xk.grad, x64.grad, x.dtype, "dx")
    assert xk.grad.dtype == x.dtype


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_matches_reference(profile, device, dtype):
    check(randn(*BASE_SHAPE, dtype=dtype, device=device, std=2.0))


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_shapes(profile, device, shape):
    check(randn(*shape, dtype=torch.bfloat16, device=device))


def test_gpu_plan_one_program_per_tile(gpu_profile, device):
    """A GPU plan runs one (row block, column tile) job a program: three 2048-column tiles a row,
    the last one partial."""
    plans = op.plan((9, 4100), torch.bfloat16)
    assert all(p.col_tiles == 3 and p.grid == p.jobs == 27 for p in plans.values()), plans
    check(randn(9, 4100, dtype=torch.bfloat16, device=device, std=2.0))


def test_column_tiled_path(profile, device, onchip_bytes):
    forced = onchip_bytes(2048 if SCALE == "cpu" else 65536)
    plans = op.plan((9, TILED_COLS), torch.bfloat16, forced)
    assert plans["forward"].col_tiles > 1 and plans["backward"].col_tiles > 1
    check(randn(3, 3, TILED_COLS, dtype=torch.bfloat16, device=device))


@pytest.mark.parametrize("how", ["rows", "cols"])
def test_non_contiguous(device, how):
    check(non_contiguous(randn(*BASE_SHAPE, device=device), how))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_bitwise_as_transformers_relu2(device, dtype):
    """The output rounds as transformers' ``ReLUSquaredActivation`` (``ACT2FN["relu2"]``:
    ``torch.square(relu(x))`` in eager; relu is exact, the square rounds once): equal bit for bit,
    with the GPU's rounding."""
    x = randn(64, 96, dtype=dtype, device=device, std=3.0)
    y = relu_squared(x)
    assert torch.equal(y, torch.square(torch.nn.functional.relu(x)))


def test_special_values(device):
    """Zero and negatives give 0 and a zero gradient; NaN stays NaN; inf squares to inf."""
    x = torch.tensor([[0.0, -0.0, -3.0, 2.0, float("nan"), float("inf"), float("-inf")]], device=device)
    xk = leaf(x)
    y = relu_squared(xk)
    torch.testing.assert_close(y, torch.relu(x).square(), equal_nan=True)
    y.backward(torch.ones_like(y))
    expected = torch.tensor([[0.0, 0.0, 0.0, 4.0, float("nan"), float("inf"), 0.0]], device=device)
    torch.testing.assert_close(xk.grad, expected, equal_nan=True)


def test_zero_dim_and_empty(device):
    x = leaf(torch.tensor(-1.5, device=device))
    y = relu_squared(x)
    assert y.shape == () and y.item() == 0.0
    x = leaf(torch.tensor(1.5, device=device))
    relu_squared(x).backward()
    assert x.grad.item() == 3.0
    for shape in [(0, 64), (2, 0, 64), (3, 0)]:
        e = leaf(torch.empty(shape, device=device))
        out = relu_squared(e)
        assert out.shape == e.shape
        out.sum().backward()
        assert e.grad.shape == e.shape



def test_does_not_modify_caller_tensors(device):
    x = randn(*BASE_SHAPE, dtype=torch.bfloat16, device=device)
    x0 = x.clone()
    dy = randn(*BASE_SHAPE, dtype=torch.bfloat16, device=device)
    dy0 = dy.clone()
    relu_squared(x.requires_grad_(True)).backward(dy)
    assert torch.equal(x.detach(), x0) and torch.equal(dy, dy0)


def test_bad_input(device):
    with pytest.raises(TypeError, match="x must have a floating dtype"):
        relu_squared(torch.ones(4, 8, dtype=torch.int64, device=device))
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        relu_squared(3.0)


def test_op_contract(device):
    """Custom ops (opcheck), fullgraph compile equal to eager, no host synchronisation."""
    x = randn(2, 3, 19, device=device, requires_grad=True)
    assert_op_contract(relu_squared, (x,), expect_ops={"relu_squared_forward", "relu_squared_backward"})
