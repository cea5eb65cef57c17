"""Fused residual add + RMSNorm against ``h = x + residual`` (PyTorch's add, in the input dtype)
followed by the float64 RMSNorm reference of tests/ops/test_rms_norm.py."""

from __future__ import annotations

import pytest
import torch

from onca import device as onca_device
from onca.device import accelerator, interpreter_active
from onca.ops import fused_add_rms_norm as op
from onca.ops.fused_add_rms_norm import fused_add_rms_norm
from tests.contract import assert_op_contract
from tests.helpers import DTYPES, SCALE, assert_close, leaf, non_contiguous, randn
from tests.ops.test_rms_norm import reference as rms_norm_reference

CASTINGS = ("llama", "gemma", "none")

SHAPES = {
    "cpu": [(1, 64), (1, 1), (37, 1000), (2, 3, 96), (5, 4096)],
    "gpu": [(16384, 4096), (16384, 8192), (4, 2048, 5120), (2048, 16384), (3, 65536), (1, 4096)],
}[SCALE]
BASE_SHAPE = {"cpu": (2, 7, 300), "gpu": (8, 1024, 4096)}[SCALE]
WIDE_ROWS = {"cpu": 2, "gpu": 512}[SCALE]
TILED_ROWS = {"cpu": (3, 4), "gpu": (5, 9)}[SCALE]


def check_residual_sum(h, x, residual):
    """``h`` is PyTorch's ``x + residual``: bit-exact on a device; under the interpreter, whose
    fp32 -> bf16 cast truncates instead of rounding to nearest, within bf16's tolerance."""
    expected = x + residual
    if interpreter_active() and x.dtype == torch.bfloat16:
        assert_close(h, expected, x.dtype, "h")
    else:
        assert torch.equal(h, expected), "h must equal x + residual exactly"


def check(x, r, w, eps=1e-6, offset=0.0, casting="llama", overwrite_grad_output=False, use=("y", "h")):
    """Run the kernel and the reference forward and backward; compare y, h, dx, dresidual, dw.

    ``use`` says which outputs feed the loss (the other takes no gradient)."""
    xk, rk, wk = leaf(x), leaf(r), leaf(w)
    y, h = fused_add_rms_norm(xk, rk, wk, eps, offset, casting, overwrite_grad_output)
    assert y.dtype == h.dtype == x.dtype and y.shape == h.shape == x.shape
    ref, h64, w64 = rms_norm_reference(x + r, w, eps, offset, casting)
    assert_close(y, ref, x.dtype, "y")

    dy = randn(*x.shape, dtype=x.dtype, device=x.device)
    dh = randn(*x.shape, dtype=x.dtype, device=x.device)
    outputs, grads = [], []
    if "y" in use:
        outputs.append(y)
        grads.append(dy)
        ref.backward(dy.to(torch.float64))
    if "h" in use:
        outputs.append(h)
        grads.append(dh)
    torch.autograd.backward(outputs, grads)
    expected = torch.zeros_like(h64) if h64.grad is None else h64.grad
    if "h" in use:
        expected = expected + dh.to(torch.float64)
    assert_close(xk.grad, expected, x.dtype, "dx")
    assert_close(rk.grad, expected, x.dtype, "dresidual")
    assert wk.grad.dtype == w.dtype
    assert_close(wk.grad, torch.zeros_like(w64) if w64.grad is None else w64.grad, x.dtype, "dw")
    # Exact checks last, and only where kernels really run: tools/sm90_compile.py compiles them
    # without running, and a failing check there would keep these large tensors alive.
    if accelerator() != "cpu" or interpreter_active():
        assert torch.equal(xk.grad, rk.grad)
        check_residual_sum(h, x, r)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("casting", CASTINGS)
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_matches_reference(profile, device, dtype, casting, offset):
    x = randn(*BASE_SHAPE, dtype=dtype, device=device)
    r = randn(*BASE_SHAPE, dtype=dtype, device=device, std=2.0)
    w = randn(BASE_SHAPE[-1], dtype=dtype, device=device, std=0.5) + (0.0 if offset else 1.0)
    check(x, r, w, eps=1e-5, offset=offset, casting=casting)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_shapes(profile, device, shape, dtype):
    x = randn(*shape, dtype=dtype, device=device)
    r = randn(*shape, dtype=dtype, device=device)
    w = randn(shape[-1], dtype=dtype, device=device) + 1.0
    check(x, r, w)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_non_contiguous_inputs(profile, device, dtype):
    # x with padded rows (read in place), residual with strided columns (copied first).
    x = non_contiguous(randn(*BASE_SHAPE, dtype=dtype, device=device), "rows")
    r = non_contiguous(randn(*BASE_SHAPE, dtype=dtype, device=device), "cols")
    w = randn(BASE_SHAPE[-1], dtype=dtype, device=device) + 1.0
    check(x, r, w, casting="gemma", offset=1.0)
    check(r, x, w)


@pytest.mark.parametrize(
    "casting, dtype",
    [("llama", torch.float32), ("llama", torch.bfloat16), ("gemma", torch.bfloat16),
     ("none", torch.bfloat16)],
    ids=str,
)
def test_column_tiled_path(profile, device, onchip_bytes, monkeypatch, casting, dtype):
    # An 8 KiB budget cannot hold a 1000-wide row: both kernels must split it into column tiles.
    # One compute unit (GPU profiles still run several programs on it): a few rows are then enough
    # for every program to accumulate several.
    monkeypatch.setenv("ONCA_COMPUTE_UNITS", "1")
    forced = onchip_bytes(8192)
    cols = 1000 if SCALE == "cpu" else 8192
    plans = op.plan((*TILED_ROWS, cols), dtype, forced)
    assert plans["forward"].col_tiles > 1 and plans["backward"].col_tiles > 1
    assert plans["backward"].rows_per_program > 1
    x = randn(*TILED_ROWS, cols, dtype=dtype, device=device)
    r = randn(*TILED_ROWS, cols, dtype=dtype, device=device)
    w = randn(cols, dtype=dtype, device=device) + 1.0
    check(x, r, w, casting=casting, offset=0.5)


@pytest.mark.parametrize("use", [("y",), ("h",)], ids=["normed-only", "residual-only"])
@pytest.mark.parametrize("tiled", [False, True], ids=["single-pass", "column-tiled"])
def test_one_output_without_gradient(device, onchip_bytes, use, tiled):
    """A missing output gradient is skipped, not materialised as zeros, and still gives the right answer."""
    cols = 1000 if tiled else BASE_SHAPE[-1]
    if tiled:
        assert op.plan((6, cols), torch.float32, onchip_bytes(8192))["backward"].col_tiles > 1
    x, r = randn(2, 3, cols, device=device), randn(2, 3, cols, device=device)
    w = randn(cols, device=device) + 1.0
    check(x, r, w, use=use)


# One profile of each distinct on-chip budget and alignment (the others differ in core count only).
@pytest.mark.parametrize("name", ["h100", "ascend910b4", "ascend950", "cpu-interpreter"])
def test_wide_rows_on_every_profile(monkeypatch, device, name):
    """Hidden size 65536 plans and runs correctly under every kind of built-in profile."""
    monkeypatch.setenv("ONCA_DEVICE_PROFILE", name)
    onca_device.reset()
    try:
        x = randn(WIDE_ROWS, 65536, dtype=torch.bfloat16, device=device)
        r = randn(WIDE_ROWS, 65536, dtype=torch.bfloat16, device=device)
        w = randn(65536, dtype=torch.bfloat16, device=device) + 1.0
        check(x, r, w)
    finally:
        onca_device.reset()


def test_fp32_weight_with_bf16_input(device):
    """Mixed precision: fp32 master weight, bf16 activations (autocast training)."""
    x = randn(*BASE_SHAPE, dtype=torch.bfloat16, device=device)
    r = randn(*BASE_SHAPE, dtype=torch.bfloat16, device=device)
    w = randn(BASE_SHAPE[-1], dtype=torch.float32, device=device) + 1.0
    check(x, r, w, casting="gemma")


def test_overwrite_grad_output_reuses_dy(device):
    x = randn(*BASE_SHAPE, dtype=torch.bfloat16, device=device)
    r = randn(*BASE_SHAPE, dtype=torch.bfloat16, device=device)
    w = randn(BASE_SHAPE[-1], dtype=torch.bfloat16, device=device)
    dy = randn(*BASE_SHAPE, dtype=torch.bfloat16, device=device)
    dh = randn(*BASE_SHAPE, dtype=torch.bfloat16, device=device)

    def grads(overwrite, dy_buffer):
        xk, rk, wk = leaf(x), leaf(r), leaf(w)
        y, h = fused_add_rms_norm(xk, rk, wk, overwrite_grad_output=overwrite)
        return torch.autograd.grad((y, h), (xk, rk, wk), (dy_buffer, dh.clone()))

    expected = grads(False, dy.clone())
    dy_buffer = dy.clone()
    got = grads(True, dy_buffer)
    assert got[0].data_ptr() == dy_buffer.data_ptr(), (
        "overwrite_grad_output=True must write dx into dy's storage"
    )
    for g, e in zip(got, expected):
        assert torch.equal(g, e)


def test_does_not_modify_caller_tensors(device):
    x = randn(*BASE_SHAPE, dtype=torch.bfloat16, device=device)
    r = randn(*BASE_SHAPE, dtype=torch.bfloat16, device=device)
    w = randn(BASE_SHAPE[-1], dtype=torch.bfloat16, device=device)
    dy = randn(*BASE_SHAPE, dtype=torch.bfloat16, device=device)
    dh = randn(*BASE_SHAPE, dtype=torch.bfloat16, device=device)
    before = [t.clone() for t in (x, r, w, dy, dh)]
    y, h = fused_add_rms_norm(leaf(x), leaf(r), leaf(w))
    torch.autograd.backward((y, h), (dy, dh))
    assert all(torch.equal(a, b) for a, b in zip((x, r, w, dy, dh), before))


def test_weight_gradient_is_deterministic(device):
    x = randn(*BASE_SHAPE, dtype=torch.bfloat16, device=device)
    r = randn(*BASE_SHAPE, dtype=torch.bfloat16, device=device)
    w = randn(BASE_SHAPE[-1], dtype=torch.bfloat16, device=device)
    dy = randn(*BASE_SHAPE, dtype=torch.bfloat16, device=device)
    grads = []
    for _ in range(2):
        wk = leaf(w)
        fused_add_rms_norm(leaf(x), leaf(r), wk)[0].backward(dy)
        grads.append(wk.grad)
    assert torch.equal(grads[0], grads[1])


def test_bad_input(device):
    x = randn(4, 64, device=device)
    r = randn(4, 64, device=device)
    w = randn(64, device=device)
    with pytest.raises(ValueError, match="x must have last dimension 64"):
        fused_add_rms_norm(randn(4, 32, device=device), randn(4, 32, device=device), w)
    with pytest.raises(ValueError, match="residual must have x's shape"):
        fused_add_rms_norm(x, randn(2, 64, device=device), w)
    with pytest.raises(TypeError, match="residual must have x's dtype"):
        fused_add_rms_norm(x, r.to(torch.bfloat16), w)
    with pytest.raises(TypeError, match="residual must have a floating dtype"):
        fused_add_rms_norm(x, torch.ones(4, 64, dtype=torch.int32, device=device), w)
    with pytest.raises(TypeError, match="x must have a floating dtype"):
        fused_add_rms_norm(torch.ones(4, 64, dtype=torch.int32, device=device), r, w)
    with pytest.raises(TypeError, match="weight must have a floating dtype"):
        fused_add_rms_norm(x, r, torch.ones(64, dtype=torch.int64, device=device))
    with pytest.raises(ValueError, match="weight is on meta"):
        fused_add_rms_norm(x, r, torch.empty(64, device="meta"))
    with pytest.raises(ValueError, match="residual is on meta"):
        fused_add_rms_norm(x, torch.empty(4, 64, device="meta"), w)
    with pytest.raises(ValueError, match="casting_mode"):
        fused_add_rms_norm(x, r, w, casting_mode="fp8")
    with pytest.raises(ValueError, match="weight must be 1-D"):
        fused_add_rms_norm(x, r, randn(1, 64, device=device))
    with pytest.raises(ValueError, match="eps"):
        fused_add_rms_norm(x, r, w, eps=float("nan"))
    with pytest.raises(TypeError, match="residual must be a torch.Tensor"):
        fused_add_rms_norm(x, [1.0, 2.0], w)
    with pytest.raises(TypeError, match="eps must be a number"):
        fused_add_rms_norm(x, r, w, eps="1e-6")
    with pytest.raises(TypeError, match="overwrite_grad_output must be a bool"):
        fused_add_rms_norm(x, r, w, overwrite_grad_output=1)


@pytest.mark.parametrize("shape", [(0, 64), (2, 0, 64)])
def test_empty_input_as_torch(device, shape):
    """No rows: torch's results (the add, then rms_norm): empty outputs and input gradients, and a
    zero weight gradient (a sum over no rows)."""
    x, r, w = randn(*shape, device=device), randn(*shape, device=device), randn(64, device=device)
    xk, rk, wk = leaf(x), leaf(r), leaf(w)
    x64, r64, w64 = leaf(x.double()), leaf(r.double()), leaf(w.double())
    y, h = fused_add_rms_norm(xk, rk, wk)
    h_ref = x64 + r64
    y_ref = torch.nn.functional.rms_norm(h_ref, (64,), w64, 1e-6)
    assert y.shape == y_ref.shape and h.shape == h_ref.shape
    (y.sum() + h.sum()).backward()
    (y_ref.sum() + h_ref.sum()).backward()
    assert xk.grad.shape == x64.grad.shape and rk.grad.shape == r64.grad.shape
    assert torch.equal(wk.grad, w64.grad.float()) and torch.equal(wk.grad, torch.zeros_like(w))


@pytest.mark.parametrize("overwrite, residual_grad", [(False, True), (True, True), (False, False)],
                         ids=["residual-grad", "overwrite-grad-output", "no-residual-grad"])
def test_op_contract(device, overwrite, residual_grad):
    """Custom ops (opcheck), fullgraph compile equal to eager, no host synchronisation; with and
    without a gradient for the residual output."""
    x, r = (randn(3, 5, 48, dtype=torch.bfloat16, device=device).requires_grad_() for _ in range(2))
    w = randn(48, dtype=torch.bfloat16, device=device).requires_grad_()

    def fn(x, r, w):
        y, h = fused_add_rms_norm(x, r, w, 1e-6, 1.0, "gemma", overwrite)
        return (y, h) if residual_grad else y

    assert_op_contract(fn, (x, r, w), expect_ops={"fused_add_rms_norm_forward", "fused_add_rms_norm_backward"})


def test_backward_plan_is_persistent(profile):
    """dW partial sums need a bounded grid: one buffer row per program, at most one per unit."""
    plans = op.plan(BASE_SHAPE, torch.bfloat16, profile)
    backward = plans["backward"]
    assert backward.persistent
    per_unit = max(1, profile.warps_per_unit // backward.num_warps) if profile.warps_per_unit else 1
    assert backward.grid <= profile.compute_units * per_unit


def test_functional_api(device):
    import onca

    x, r = randn(3, 64, device=device), randn(3, 64, device=device)
    w = randn(64, device=device) + 1.0
    got = onca.functional.fused_add_rms_norm(x, r, w, 1e-5, 1.0, "gemma")
    expected = fused_add_rms_norm(x, r, w, 1e-5, 1.0, "gemma")
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


def test_leaf_gradients_of_x_and_residual_do_not_share_storage(device):
    """x and residual receive one gradient; when both are leaves their .grad must be two tensors
    (an in-place change of one, e.g. accumulating a second backward, must not change the other)."""
    x = randn(4, 8, device=device, requires_grad=True)
    residual = randn(4, 8, device=device, requires_grad=True)
    weight = randn(8, device=device, requires_grad=True)
    for overwrite in (False, True):
        x.grad = residual.grad = None
        y, _ = fused_add_rms_norm(x, residual, weight, overwrite_grad_output=overwrite)
        y.backward(torch.randn_like(y))
        torch.testing.assert_close(x.grad, residual.grad)
        assert x.grad.data_ptr() != residual.grad.data_ptr()
