"""DyT forward and backward against a float64 PyTorch reference (the paper's DynamicTanh)."""

from __future__ import annotations

import pytest
import torch

from onca.ops import dyt as op
from onca.ops.dyt import dyt
from tests.contract import assert_op_contract
from tests.helpers import DTYPES, SCALE, assert_close, leaf, non_contiguous, randn

SHAPES = {
    "cpu": [(1, 64), (1, 1), (37, 300), (2, 3, 96)],
    "gpu": [(16384, 4096), (4, 2048, 5120), (3, 65536), (1, 4096)],
}[SCALE]
BASE_SHAPE = {"cpu": (2, 7, 200), "gpu": (8, 1024, 4096)}[SCALE]


def params(hidden, dtype, device, per_channel=False, bias=True):
    alpha = randn(hidden if per_channel else 1, dtype=dtype, device=device, std=0.2) + 0.5
    w = randn(hidden, dtype=dtype, device=device, std=0.5) + 1.0
    b = randn(hidden, dtype=dtype, device=device, std=0.5) if bias else None
    return alpha, w, b


def reference(x, alpha, w, b):
    """DynamicTanh in float64: ``w * tanh(alpha * x) + b``."""
    t64 = [None if t is None else t.detach().to(torch.float64).requires_grad_(True) for t in (x, alpha, w, b)]
    x64, a64, w64, b64 = t64
    y = torch.tanh(a64 * x64) * w64
    return (y if b64 is None else y + b64), t64


def check(x, alpha, w, b):
    ks = [None if t is None else leaf(t) for t in (x, alpha, w, b)]
    y = dyt(*ks)
    assert y.dtype == x.dtype and y.shape == x.shape
    ref, t64 = reference(x, alpha, w, b)
    assert_close(y, ref, x.dtype, "y")
    dy = randn(*x.shape, dtype=x.dtype, device=x.device)
    y.backward(dy)
    ref.backward(dy.to(torch.float64))
    for name, k, r, t in zip(("dx", "dalpha", "dweight", "dbias"), ks, t64, (x, alpha, w, b)):
        if t is None:
            continue
        assert k.grad.dtype == t.dtype and k.grad.shape == t.shape, name
        assert_close(k.grad, r.grad, x.dtype, name)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("per_channel, bias", [(False, True), (True, False)],
                         ids=["scalar-alpha-bias", "channel-alpha-no-bias"])
def test_matches_reference(profile, device, dtype, per_channel, bias):
    x = randn(*BASE_SHAPE, dtype=dtype, device=device, std=2.0)
    check(x, *params(BASE_SHAPE[-1], dtype, device, per_channel, bias))


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_shapes(device, shape):
    x = randn(*shape, dtype=torch.bfloat16, device=device)
    check(x, *params(shape[-1], torch.bfloat16, device))


@pytest.mark.parametrize("how", ["rows", "cols"])
def test_non_contiguous_input(profile, device, how):
    x = non_contiguous(randn(*BASE_SHAPE, device=device), how)
    check(x, *params(BASE_SHAPE[-1], torch.float32, device, per_channel=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_column_tiled_path(profile, device, onchip_bytes, dtype):
    # A 16 KiB budget cannot hold a 600-wide row: both kernels split it into column tiles.
    forced = onchip_bytes(16384)
    cols = 600 if SCALE == "cpu" else 8192
    rows = (2, 3) if SCALE == "cpu" else (5, 9)
    plans = op.plan((*rows, cols), dtype, forced)
    assert plans["forward"].col_tiles > 1 and plans["backward"].col_tiles > 1
    x = randn(*rows, cols, dtype=dtype, device=device, std=2.0)
    check(x, *params(cols, dtype, device, per_channel=True))


def test_backward_tiles_of_several_rows_and_column_tiles(profile, device, onchip_bytes):
    """The backward's column tiles are independent, so its tiles may hold several rows of a row
    that takes several tiles (the plan the planner gives DyT's widest rows on a GPU); forced here
    with a budget that fits two rows of a 512-column tile of a 600-wide fp32 row."""
    forced = onchip_bytes(40000)
    rows, cols = (4, 5), 600
    p = op.plan((*rows, cols), torch.float32, forced)["backward"]
    assert p.col_tiles > 1 and p.block_rows > 1 and "(one pass)" in p.describe()
    x = randn(*rows, cols, dtype=torch.float32, device=device, std=2.0)
    check(x, *params(cols, torch.float32, device))


def test_saturates_without_overflow(device):
    x = torch.tensor([[-1e30, -50.0, 0.0, 50.0, 1e30]], device=device)
    alpha, w, b = params(5, torch.float32, device, bias=False)
    y = dyt(x, alpha.abs(), w.abs(), None)
    assert torch.equal(torch.sign(y), torch.tensor([[-1.0, -1.0, 0.0, 1.0, 1.0]], device=device))
    assert torch.isfinite(y).all()


def test_fp32_params_with_bf16_input(device):
    x = randn(*BASE_SHAPE, dtype=torch.bfloat16, device=device)
    check(x, *params(BASE_SHAPE[-1], torch.float32, device))


def test_only_requested_gradients(device):
    x = randn(4, 64, device=device)
    alpha, w, b = params(64, torch.float32, device)
    xk, ak = leaf(x), leaf(alpha)
    dx, da = torch.autograd.grad(dyt(xk, ak, w, b).sum(), (xk, ak))
    assert w.grad is None and b.grad is None
    ref, (x64, a64, _, _) = reference(x, alpha, w, b)
    dx64, da64 = torch.autograd.grad(ref.sum(), (x64, a64))
    assert_close(dx, dx64, torch.float32, "dx")
    assert_close(da, da64, torch.float32, "dalpha")


def test_weight_gradient_is_deterministic(device):
    x = randn(*BASE_SHAPE, dtype=torch.bfloat16, device=device)
    alpha, w, b = params(BASE_SHAPE[-1], torch.bfloat16, device)
    grads = []
    for _ in range(2):
        ks = [leaf(t) for t in (alpha, w, b)]
        dyt(x, *ks).sum().backward()
        grads.append([k.grad for k in ks])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_bad_input(device):
    x = randn(4, 64, device=device)
    alpha, w, b = params(64, torch.float32, device)
    with pytest.raises(TypeError, match="x must have a floating dtype"):
        dyt(x.int(), alpha, w, b)
    with pytest.raises(ValueError, match="alpha must be a scalar"):
        dyt(x, randn(3, device=device), w, b)
    with pytest.raises(ValueError, match="alpha must be a scalar"):
        dyt(x, randn(1, 64, device=device), w, b)
    with pytest.raises(TypeError, match="weight must be a torch.Tensor"):
        dyt(x, alpha, None, b)
    with pytest.raises(ValueError, match="weight must be 1-D"):
        dyt(x, alpha, randn(32, device=device), b)
    with pytest.raises(ValueError, match="bias must be 1-D"):
        dyt(x, alpha, w, randn(65, device=device))
    with pytest.raises(ValueError, match="bias is on meta"):
        dyt(x, alpha, w, torch.empty(64, device="meta"))
    with pytest.raises(TypeError, match="alpha must have a floating dtype"):
        dyt(x, torch.ones(1, dtype=torch.int64, device=device), w, b)
    with pytest.raises(ValueError, match="x must have a non-empty last dimension"):
        dyt(randn(4, 0, device=device), alpha, w[:0], None)


@pytest.mark.parametrize("shape", [(0, 64), (2, 0, 64)])
def test_empty_input(device, shape):
    x = randn(*shape, device=device)
    ks = [leaf(t) for t in params(64, torch.float32, device)]
    xk = leaf(x)
    y = dyt(xk, *ks)
    assert y.shape == x.shape
    y.sum().backward()
    assert xk.grad.shape == x.shape
    assert all(torch.equal(k.grad, torch.zeros_like(k)) for k in ks)


def test_op_contract(device):
    """Custom ops (opcheck), fullgraph compile equal to eager, no host synchronisation."""
    x = randn(3, 5, 48, dtype=torch.bfloat16, device=device).requires_grad_()
    alpha, w, b = (t.requires_grad_() for t in params(48, torch.bfloat16, device))
    assert_op_contract(dyt, (x, alpha, w, b), expect_ops={"dyt_forward", "dyt_backward"})
