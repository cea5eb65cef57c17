"""LayerNorm forward and backward against PyTorch's layer_norm computed in float64."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from onca import device as onca_device
from onca.ops import layer_norm as op
from onca.ops.layer_norm import layer_norm
from tests.contract import assert_op_contract
from tests.helpers import DTYPES, SCALE, assert_close, leaf, non_contiguous, randn

SHAPES = {
    "cpu": [(1, 64), (1, 1), (37, 1000), (2, 3, 96), (5, 4096)],
    "gpu": [(16384, 4096), (16384, 8192), (4, 2048, 5120), (2048, 16384), (3, 65536), (1, 4096)],
}[SCALE]
BASE_SHAPE = {"cpu": (2, 7, 300), "gpu": (8, 1024, 4096)}[SCALE]
WIDE_ROWS = {"cpu": 2, "gpu": 512}[SCALE]
TILED_ROWS = {"cpu": (3, 4), "gpu": (5, 9)}[SCALE]
# weight and bias present (the default nn.LayerNorm), weight only (bias=False), neither
# (elementwise_affine=False).
AFFINE = ("weight+bias", "weight", "none")


def params(hidden, affine, dtype, device):
    w = randn(hidden, dtype=dtype, device=device, std=0.5) + 1.0 if affine != "none" else None
    b = randn(hidden, dtype=dtype, device=device, std=0.5) if affine == "weight+bias" else None
    return w, b


def reference(x, w, b, eps):
    """torch's layer_norm in float64: one rounding of the output, none inside."""
    x64 = x.detach().to(torch.float64).requires_grad_(True)
    w64 = None if w is None else w.detach().to(torch.float64).requires_grad_(True)
    b64 = None if b is None else b.detach().to(torch.float64).requires_grad_(True)
    return F.layer_norm(x64, (x.shape[-1],), w64, b64, eps), x64, w64, b64


def check(x, w, b, eps=1e-5):
    """Run the kernel and the reference forward and backward and compare y, dx, dw and db."""
    xk = leaf(x)
    wk = None if w is None else leaf(w)
    bk = None if b is None else leaf(b)
    y = layer_norm(xk, wk, bk, eps)
    assert y.dtype == x.dtype and y.shape == x.shape
    ref, x64, w64, b64 = reference(x, w, b, eps)
    assert_close(y, ref, x.dtype, "y")
    dy = randn(*x.shape, dtype=x.dtype, device=x.device)
    y.backward(dy)
    ref.backward(dy.to(torch.float64))
    assert_close(xk.grad, x64.grad, x.dtype, "dx")
    if w is not None:
        assert wk.grad.dtype == w.dtype
        assert_close(wk.grad, w64.grad, x.dtype, "dw")
    if b is not None:
        assert bk.grad.dtype == b.dtype
        assert_close(bk.grad, b64.grad, x.dtype, "db")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("affine", AFFINE)
def test_matches_reference(profile, device, dtype, affine):
    x = randn(*BASE_SHAPE, dtype=dtype, device=device, std=2.0) + 0.5
    w, b = params(BASE_SHAPE[-1], affine, dtype, device)
    check(x, w, b)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_shapes(profile, device, shape, dtype):
    x = randn(*shape, dtype=dtype, device=device)
    w, b = params(shape[-1], "weight+bias", dtype, device)
    check(x, w, b)


@pytest.mark.parametrize("how", ["rows", "cols"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_non_contiguous_input(profile, device, how, dtype):
    x = non_contiguous(randn(*BASE_SHAPE, dtype=dtype, device=device), how)
    w, b = params(BASE_SHAPE[-1], "weight+bias", dtype, device)
    check(x, w, b)


def _ramped(shape, dtype, device):
    """Rows whose columns drift (so column tiles have very different means) around an offset."""
    ramp = torch.linspace(-3.0, 3.0, shape[-1], device=device)
    return (torch.randn(*shape, device=device) + ramp + 2.0).to(dtype)


@pytest.mark.parametrize(
    "affine, dtype",
    [("weight+bias", torch.float32), ("weight+bias", torch.bfloat16), ("weight", torch.bfloat16),
     ("none", torch.float32)],
    ids=str,
)
def test_column_tiled_path(profile, device, onchip_bytes, monkeypatch, affine, dtype):
    # An 8 KiB budget cannot hold a 1000-wide row: both kernels must split it into column tiles.
    # One compute unit (GPU profiles still run several programs on it): a few rows are then enough
    # for every program to accumulate several.
    monkeypatch.setenv("ONCA_COMPUTE_UNITS", "1")
    forced = onchip_bytes(8192)
    cols = 1000 if SCALE == "cpu" else 8192
    plans = op.plan((*TILED_ROWS, cols), dtype, forced)
    assert plans["forward"].col_tiles > 1 and plans["backward"].col_tiles > 1
    assert plans["backward"].rows_per_program > 1
    x = _ramped((*TILED_ROWS, cols), dtype, device)
    w, b = params(cols, affine, dtype, device)
    check(x, w, b)


@pytest.mark.parametrize("block_rows", [1, 2], ids=["contiguous-walk", "strided-walk"])
def test_every_row_is_walked_once(profile, device, monkeypatch, block_rows):
    """The backward's persistent programs walk a contiguous range of row blocks (one row per block)
    or every grid-th block (more rows per block): with a row count that no grid divides, each row's
    dx, and its share of dW and dB, is computed once either way."""
    monkeypatch.setenv("ONCA_COMPUTE_UNITS", "3")
    onca_device.reset()  # the profile fixture read the profile before this override (and resets after)
    monkeypatch.setattr(op, "BACKWARD_TILES", {**op.BACKWARD_TILES, "max_block_rows": block_rows})
    rows, cols = (229, 300) if SCALE == "cpu" else (16411, 2048)  # past the one-program size
    plan = op.plan((rows, cols), torch.float32)["backward"]
    assert plan.single_pass and plan.block_rows == block_rows and plan.grid > 1
    assert rows % (plan.grid * block_rows) != 0
    x = randn(rows, cols, device=device)
    w, b = params(cols, "weight+bias", torch.float32, device)
    check(x, w, b)


@pytest.mark.parametrize("tiled", [False, True], ids=["single-pass", "column-tiled"])
def test_statistics_are_numerically_sound(device, onchip_bytes, tiled):
    """A large mean over a small spread: E[x^2] - E[x]^2 in fp32 would lose the variance entirely
    (1e6 * 2**-24 ~ 0.06 > var = 0.01); centred sums (and Chan's merge across tiles) keep it."""
    cols = 1000
    if tiled:
        assert op.plan((8, cols), torch.float32, onchip_bytes(8192))["forward"].col_tiles > 1
    x = (torch.randn(8, cols, device=device) * 0.1 + torch.linspace(-0.2, 0.2, cols, device=device)
         + 1000.0)
    _, mean, rstd = op.layer_norm_forward(x, None, None, 1e-5)
    x64 = x.to(torch.float64)
    var64 = x64.var(-1, unbiased=False)
    assert_close(rstd, torch.rsqrt(var64 + 1e-5), torch.float32, "rstd", scale_atol=False)
    assert_close(mean, x64.mean(-1), torch.float32, "mean")


# One profile of each distinct on-chip budget and alignment (the others differ in core count only).
@pytest.mark.parametrize("name", ["h100", "ascend910b4", "ascend950", "cpu-interpreter"])
def test_wide_rows_on_every_profile(monkeypatch, device, name):
    """Hidden size 65536 plans and runs correctly under every kind of built-in profile."""
    monkeypatch.setenv("ONCA_DEVICE_PROFILE", name)
    onca_device.reset()
    try:
        x = randn(WIDE_ROWS, 65536, dtype=torch.bfloat16, device=device)
        w, b = params(65536, "weight+bias", torch.bfloat16, device)
        check(x, w, b)
    finally:
        onca_device.reset()


def test_fp32_params_with_bf16_input(device):
    """Mixed precision: fp32 master weight and bias, bf16 activations."""
    x = randn(*BASE_SHAPE, dtype=torch.bfloat16, device=device)
    w, b = params(BASE_SHAPE[-1], "weight+bias", torch.float32, device)
    check(x, w, b)


def test_frozen_weight(device):
    """Only the gradients asked for are computed: a frozen weight gets none, the bias still does."""
    x = randn(*BASE_SHAPE, device=device)
    w, b = params(BASE_SHAPE[-1], "weight+bias", torch.float32, device)
    xk, bk = leaf(x), leaf(b)
    y = layer_norm(xk, w, bk)
    ref, x64, _, b64 = reference(x, w, b, 1e-5)
    dy = randn(*x.shape, device=device)
    y.backward(dy)
    ref.backward(dy.to(torch.float64))
    assert w.grad is None
    assert_close(xk.grad, x64.grad, torch.float32, "dx")
    assert_close(bk.grad, b64.grad, torch.float32, "db")


def test_does_not_modify_caller_tensors(device):
    x = randn(*BASE_SHAPE, dtype=torch.bfloat16, device=device)
    w, b = params(BASE_SHAPE[-1], "weight+bias", torch.bfloat16, device)
    dy = randn(*BASE_SHAPE, dtype=torch.bfloat16, device=device)
    x0, w0, b0, dy0 = x.clone(), w.clone(), b.clone(), dy.clone()
    layer_norm(leaf(x), leaf(w), leaf(b)).backward(dy)
    assert torch.equal(x, x0) and torch.equal(w, w0) and torch.equal(b, b0) and torch.equal(dy, dy0)


def test_parameter_gradients_are_deterministic(device):
    x = randn(*BASE_SHAPE, dtype=torch.bfloat16, device=device)
    w, b = params(BASE_SHAPE[-1], "weight+bias", torch.bfloat16, device)
    dy = randn(*BASE_SHAPE, dtype=torch.bfloat16, device=device)
    grads = []
    for _ in range(2):
        wk, bk = leaf(w), leaf(b)
        layer_norm(leaf(x), wk, bk).backward(dy)
        grads.append((wk.grad, bk.grad))
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])


def test_bad_input(device):
    x = randn(4, 64, device=device)
    w = randn(64, device=device)
    with pytest.raises(ValueError, match="weight must be 1-D of x's last dimension"):
        layer_norm(randn(4, 32, device=device), w)
    with pytest.raises(ValueError, match="bias must be 1-D of x's last dimension"):
        layer_norm(x, w, randn(32, device=device))
    with pytest.raises(ValueError, match="weight must be 1-D"):
        layer_norm(x, randn(1, 64, device=device))
    with pytest.raises(TypeError, match="x must have a floating dtype"):
        layer_norm(torch.ones(4, 64, dtype=torch.int32, device=device), w)
    with pytest.raises(TypeError, match="weight must have a floating dtype"):
        layer_norm(x, torch.ones(64, dtype=torch.int64, device=device))
    with pytest.raises(TypeError, match="bias must have a floating dtype"):
        layer_norm(x, w, torch.ones(64, dtype=torch.int64, device=device))
    with pytest.raises(ValueError, match="weight is on meta"):
        layer_norm(x, torch.empty(64, device="meta"))
    with pytest.raises(ValueError, match="x must have a non-empty last dimension"):
        layer_norm(torch.tensor(1.0, device=device), None)
    with pytest.raises(ValueError, match="x must have a non-empty last dimension"):
        layer_norm(randn(4, 0, device=device), None)
    with pytest.raises(TypeError, match="eps must be a number"):
        layer_norm(x, w, eps="1e-5")
    with pytest.raises(ValueError, match="eps"):
        layer_norm(x, w, eps=float("nan"))
    with pytest.raises(ValueError, match="eps"):
        layer_norm(x, w, eps=-1.0)
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        layer_norm([1.0, 2.0], w)


@pytest.mark.parametrize("shape", [(0, 64), (2, 0, 64)])
@pytest.mark.parametrize("affine", AFFINE)
def test_empty_input_as_torch(device, shape, affine):
    """No rows: torch's results, an empty output and input gradient and zero parameter gradients
    (sums over no rows)."""
    x = randn(*shape, device=device)
    w, b = params(64, affine, torch.float32, device)
    xk, wk, bk = (None if t is None else leaf(t) for t in (x, w, b))
    y = layer_norm(xk, wk, bk)
    ref, x64, w64, b64 = reference(x, w, b, 1e-5)
    assert y.shape == ref.shape and y.dtype == x.dtype
    y.sum().backward()
    ref.sum().backward()
    assert xk.grad.shape == x64.grad.shape
    for got, expected in ((wk, w64), (bk, b64)):
        if got is not None:
            assert torch.equal(got.grad, expected.grad.float()) and not got.grad.any()


@pytest.mark.parametrize("affine", AFFINE + ("bias",))
def test_op_contract(device, affine):
    """Custom ops (opcheck), fullgraph compile equal to eager, no host synchronisation; with and
    without weight and bias."""
    x = randn(3, 5, 48, dtype=torch.bfloat16, device=device).requires_grad_()
    w, b = params(48, "weight+bias", torch.bfloat16, device)
    use_w, use_b = affine in ("weight+bias", "weight"), affine in ("weight+bias", "bias")

    def fn(x, w, b):
        return layer_norm(x, w if use_w else None, b if use_b else None, 1e-5)

    inputs = (x, w.requires_grad_(use_w), b.requires_grad_(use_b))
    assert_op_contract(fn, inputs, expect_ops={"layer_norm_forward", "layer_norm_backward"})


def test_backward_plan_is_persistent(profile):
    """dW/dB partial sums need a bounded grid: one buffer row per program, at most one per unit."""
    plans = op.plan(BASE_SHAPE, torch.bfloat16, profile)
    backward = plans["backward"]
    assert backward.persistent
    per_unit = max(1, profile.warps_per_unit // backward.num_warps) if profile.warps_per_unit else 1
    assert backward.grid <= profile.compute_units * per_unit


def test_functional_api(device):
    import onca

    x = randn(3, 64, device=device)
    w, b = params(64, "weight+bias", torch.float32, device)
    assert torch.equal(onca.functional.layer_norm(x, w, b, 1e-5), layer_norm(x, w, b, 1e-5))
    assert torch.equal(onca.functional.layer_norm(x, None), layer_norm(x))
