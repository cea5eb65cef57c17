"""Softmax forward and backward against torch's softmax in float64."""

from __future__ import annotations

import pytest
import torch

from onca import device as onca_device
from onca.ops import softmax as op
from onca.ops.softmax import softmax
from tests.contract import assert_op_contract
from tests.helpers import DTYPES, SCALE, assert_close, leaf, non_contiguous, randn

SHAPES = {
    "cpu": [(1, 1), (1, 77), (37, 300), (2, 3, 96), (2, 4099)],
    "gpu": [(16384, 4096), (4096, 32000), (4, 2048, 1000), (64, 151936), (1, 4096)],
}[SCALE]
BASE_SHAPE = {"cpu": (2, 7, 300), "gpu": (8, 1024, 4096)}[SCALE]
TILED_COLS = {"cpu": 300, "gpu": 65536}[SCALE]
TILED_DTYPES = {"cpu": [torch.bfloat16], "gpu": [torch.float32, torch.bfloat16]}[SCALE]
WIDE_ROWS = {"cpu": 1, "gpu": 256}[SCALE]
# Rows of one wide GPU tile (up to 32768 columns) and of several.
WIDE_COLS = {"cpu": [20000, 40000], "gpu": [32000, 151936]}[SCALE]


def check(x, dim=-1, std=1.0):
    """Kernel vs float64 reference: ``y`` and ``dx`` (a random incoming gradient)."""
    xk = leaf(x)
    y = softmax(xk, dim)
    x64 = x.detach().to(torch.float64).requires_grad_(True)
    ref = torch.softmax(x64, dim)
    assert y.dtype == x.dtype and y.shape == x.shape
    assert_close(y, ref, x.dtype, "y")
    dy = randn(*x.shape, dtype=x.dtype, device=x.device, std=std)
    y.backward(dy)
    ref.backward(dy.to(torch.float64))
    assert_close(xk.grad, x64.grad, x.dtype, "dx")
    assert xk.grad.dtype == x.dtype


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_matches_reference(profile, device, dtype):
    check(randn(*BASE_SHAPE, dtype=dtype, device=device, std=3.0))


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_shapes(profile, device, shape):
    check(randn(*shape, dtype=torch.bfloat16, device=device, std=2.0))


@pytest.mark.parametrize("dtype", TILED_DTYPES, ids=str)
def test_column_tiled_path(profile, device, onchip_bytes, dtype):
    forced = onchip_bytes(2048 if SCALE == "cpu" else 65536)
    plans = op.plan((9, TILED_COLS), dtype, forced)
    assert plans["forward"].col_tiles > 1 and plans["backward"].col_tiles > 1
    check(randn(3, 3, TILED_COLS, dtype=dtype, device=device, std=4.0))


@pytest.mark.parametrize("cols", WIDE_COLS)
@pytest.mark.parametrize("name", ["h100", "ascend910b4"])
def test_vocab_row_on_profiles(monkeypatch, device, name, cols):
    """Vocabulary-wide rows (Mistral's 32000 and Qwen's 151936 on the GPU; on the CPU rows too wide
    for one planned tile of either profile) plan and run under a GPU and an Ascend profile: on the
    GPU one wide tile of 32768 columns, or several."""
    monkeypatch.setenv("ONCA_DEVICE_PROFILE", name)
    onca_device.reset()
    try:
        plans = op.plan((WIDE_ROWS, cols), torch.bfloat16)
        if name == "h100":
            assert all(p.block_cols == 32768 and p.num_warps == 32 and p.col_tiles == -(-cols // 32768)
                       for p in plans.values())
        check(randn(WIDE_ROWS, cols, dtype=torch.bfloat16, device=device, std=3.0))
    finally:
        onca_device.reset()


def test_programs_loop_over_row_blocks(monkeypatch, device):
    """A persistent grid (Ascend's: one program per vector core) smaller than the row blocks: each
    program loops over several; the GPU's grid covers them."""
    monkeypatch.setenv("ONCA_DEVICE_PROFILE", "ascend910b4")
    onca_device.reset()
    try:
        plans = op.plan((333, 300), torch.float32)
        assert all(p.grid < p.row_blocks for p in plans.values())
        check(randn(333, 300, device=device, std=2.0))
    finally:
        onca_device.reset()
    gpu = op.plan((333, 300), torch.float32, onca_device.profile_named("h100"))
    assert all(p.grid >= p.row_blocks for p in gpu.values())


@pytest.mark.parametrize("how", ["rows", "cols"])
def test_non_contiguous(device, how):
    check(non_contiguous(randn(*BASE_SHAPE, device=device), how))


@pytest.mark.parametrize("dim", [0, 1, -2])
def test_other_dims(device, dim):
    check(randn(5, 6, 33, device=device, std=2.0), dim=dim)


def test_large_and_infinite_logits(device):
    """Large logits do not overflow (the maximum is subtracted); -inf entries get 0 and their
    gradient 0; a row of -inf is NaN, as in torch."""
    x = randn(4, 50, device=device, std=1.0) * 1e4
    x[1, ::3] = float("-inf")
    check(x)
    x[2] = float("-inf")
    y = softmax(x)
    ref = torch.softmax(x.to(torch.float64), -1)
    torch.testing.assert_close(y.to(torch.float64), ref, equal_nan=True)
    assert torch.isnan(y[2]).all() and not torch.isnan(y[:2]).any()


def test_in_float32_registers(device):
    """bf16 input: the result is the fp32 softmax rounded once (not a bf16 computation)."""
    x = randn(8, 128, dtype=torch.bfloat16, device=device, std=5.0)
    y = softmax(x)
    ref = torch.softmax(x.to(torch.float64), -1)
    assert (y.to(torch.float64) - ref).abs().max() <= ref.abs().max() * 2 ** -7



def test_does_not_modify_caller_tensors(device):
    x = randn(*BASE_SHAPE, dtype=torch.bfloat16, device=device)
    x0 = x.clone()
    dy = randn(*BASE_SHAPE, dtype=torch.bfloat16, device=device)
    dy0 = dy.clone()
    softmax(x.requires_grad_(True)).backward(dy)
    assert torch.equal(x.detach(), x0) and torch.equal(dy, dy0)


def test_bad_input(device):
    with pytest.raises(TypeError, match="x must have a floating dtype"):
        softmax(torch.ones(4, 8, dtype=torch.int64, device=device))
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        softmax([1.0, 2.0])
    with pytest.raises(ValueError, match="x must have at least one dimension"):
        softmax(torch.tensor(1.0, device=device))
    with pytest.raises(ValueError, match="dim must be in"):
        softmax(torch.ones(4, 8, device=device), dim=2)
    with pytest.raises(TypeError, match="dim must be an int"):
        softmax(torch.ones(4, 8, device=device), dim=1.0)


@pytest.mark.parametrize("shape", [(0, 64), (2, 0, 64), (3, 0)], ids=lambda s: "x".join(map(str, s)))
def test_empty_input(device, shape):
    x = leaf(torch.empty(shape, device=device))
    y = softmax(x)
    assert y.shape == x.shape
    y.sum().backward()
    assert x.grad.shape == x.shape


@pytest.mark.parametrize("dim", [-1, 0])
def test_op_contract(device, dim):
    """Custom ops (opcheck), fullgraph compile equal to eager, no host synchronisation."""
    x = randn(2, 3, 19, device=device, requires_grad=True)
    assert_op_contract(lambda x: softmax(x, dim), (x,), expect_ops={"softmax_forward", "softmax_backward"})
