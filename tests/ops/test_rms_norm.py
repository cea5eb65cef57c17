"""RMSNorm forward and backward against a float64 PyTorch reference that rounds where the model does."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from onca import device as onca_device
from onca.ops import rms_norm as op
from onca.ops.rms_norm import rms_norm
from tests.contract import assert_op_contract
from tests.helpers import DTYPES, SCALE, assert_close, leaf, non_contiguous, randn, rounded

CASTINGS = ("llama", "gemma", "none")

SHAPES = {
    "cpu": [(1, 64), (1, 1), (37, 1000), (2, 3, 96), (5, 4096)],
    "gpu": [(16384, 4096), (16384, 8192), (4, 2048, 5120), (3, 65536), (1, 4096)],
}[SCALE]
BASE_SHAPE = {"cpu": (2, 7, 300), "gpu": (8, 1024, 4096)}[SCALE]
WIDE_ROWS = {"cpu": 2, "gpu": 512}[SCALE]


def reference(x, w, eps=1e-6, offset=0.0, casting="llama"):
    """The Hugging Face modules' arithmetic in float64, rounding to x's dtype where they cast."""
    x64 = x.detach().to(torch.float64).requires_grad_(True)
    w64 = w.detach().to(torch.float64).requires_grad_(True)
    n = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps)
    if casting == "llama":
        y = rounded(n, x.dtype) * (offset + w64)
    elif casting == "gemma":
        y = n * (offset + w64)
    else:
        y = rounded(n, x.dtype) * rounded(offset + w64, x.dtype)
    return y, x64, w64


def check(x, w, eps=1e-6, offset=0.0, casting="llama", overwrite_grad_output=False):
    """Run the kernel and the reference forward and backward and compare y, dx and dw."""
    xk, wk = leaf(x), leaf(w)
    y = rms_norm(xk, wk, eps, offset, casting, overwrite_grad_output)
    assert y.dtype == x.dtype and y.shape == x.shape
    ref, x64, w64 = reference(x, w, eps, offset, casting)
    assert_close(y, ref, x.dtype, "y")
    dy = randn(*x.shape, dtype=x.dtype, device=x.device)
    y.backward(dy)
    ref.backward(dy.to(torch.float64))
    assert_close(xk.grad, x64.grad, x.dtype, "dx")
    assert_close(wk.grad, w64.grad, x.dtype, "dw")
    assert wk.grad.dtype == w.dtype


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("casting", CASTINGS)
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_matches_reference(profile, device, dtype, casting, offset):
    x = randn(*BASE_SHAPE, dtype=dtype, device=device)
    w = randn(BASE_SHAPE[-1], dtype=dtype, device=device, std=0.5) + (0.0 if offset else 1.0)
    check(x, w, eps=1e-5, offset=offset, casting=casting)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_shapes(profile, device, shape, dtype):
    x = randn(*shape, dtype=dtype, device=device)
    w = randn(shape[-1], dtype=dtype, device=device) + 1.0
    check(x, w)


@pytest.mark.parametrize("how", ["rows", "cols"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_non_contiguous_input(profile, device, how, dtype):
    x = non_contiguous(randn(*BASE_SHAPE, dtype=dtype, device=device), how)
    w = randn(BASE_SHAPE[-1], dtype=dtype, device=device) + 1.0
    check(x, w, casting="gemma", offset=1.0)


@pytest.mark.parametrize("casting", CASTINGS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_column_tiled_path(profile, device, onchip_bytes, casting, dtype):
    # An 8 KiB budget cannot hold a 1000-wide row: both kernels must split it into column tiles.
    forced = onchip_bytes(8192)
    cols = 1000 if SCALE == "cpu" else 8192
    plans = op.plan((9, cols), dtype, forced)
    assert plans["forward"].col_tiles > 1 and plans["backward"].col_tiles > 1
    # More rows than any profile has compute units, so every program accumulates several rows.
    x = randn(5, 9, cols, dtype=dtype, device=device)
    w = randn(cols, dtype=dtype, device=device) + 1.0
    check(x, w, casting=casting, offset=0.5)


@pytest.mark.parametrize("name", sorted(onca_device.PROFILES))
def test_wide_rows_on_every_profile(monkeypatch, device, name):
    """Hidden size 65536 plans and runs correctly under every built-in profile."""
    monkeypatch.setenv("ONCA_DEVICE_PROFILE", name)
    onca_device.reset()
    try:
        x = randn(WIDE_ROWS, 65536, dtype=torch.bfloat16, device=device)
        w = randn(65536, dtype=torch.bfloat16, device=device) + 1.0
        check(x, w)
    finally:
        onca_device.reset()


def test_gpu_one_pass_backward_of_a_16384_column_row(gpu_profile, device):
    """The H200 plan's one-pass backward tile of 16384 columns, which reloads the weight per row
    block instead of holding it across the loop (as beside the residual gradient)."""
    backward = op.plan((3, 16384), torch.bfloat16)["backward"]
    assert backward.col_tiles == 1 and backward.block_cols >= 16384, backward
    x = randn(3, 16384, dtype=torch.bfloat16, device=device)
    check(x, randn(16384, dtype=torch.bfloat16, device=device) + 1.0, casting="gemma", offset=0.5)


@pytest.mark.parametrize("casting", CASTINGS)
@pytest.mark.parametrize("tiled", [False, True], ids=["single-pass", "column-tiled"])
def test_without_weight_matches_torch(device, onchip_bytes, casting, tiled):
    """``weight=None`` (elementwise_affine=False): torch's rms_norm without a weight, in every mode
    (there is no scale to round); the offset does not apply."""
    cols = 1000 if tiled else BASE_SHAPE[-1]
    if tiled:
        assert op.plan((6, cols), torch.bfloat16, onchip_bytes(8192))["backward"].col_tiles > 1
    x = randn(2, 3, cols, dtype=torch.bfloat16, device=device)
    xk = leaf(x)
    y = rms_norm(xk, None, 1e-5, 1.0, casting)
    x64 = x.detach().to(torch.float64).requires_grad_(True)
    ref = F.rms_norm(x64, (cols,), None, 1e-5)
    assert y.dtype == x.dtype
    assert_close(y, ref, x.dtype, "y")
    dy = randn(*x.shape, dtype=x.dtype, device=device)
    y.backward(dy)
    ref.backward(dy.to(torch.float64))
    assert_close(xk.grad, x64.grad, x.dtype, "dx")


def test_fp32_weight_with_bf16_input(device):
    """Mixed precision: fp32 master weight, bf16 activations (autocast training)."""
    x = randn(*BASE_SHAPE, dtype=torch.bfloat16, device=device)
    w = randn(BASE_SHAPE[-1], dtype=torch.float32, device=device) + 1.0
    check(x, w, casting="gemma")


def test_overwrite_grad_output_reuses_dy(device):
    x = randn(*BASE_SHAPE, dtype=torch.bfloat16, device=device)
    w = randn(BASE_SHAPE[-1], dtype=torch.bfloat16, device=device)
    dy = randn(*BASE_SHAPE, dtype=torch.bfloat16, device=device)
    x1, w1 = leaf(x), leaf(w)
    dx_expected, dw_expected = torch.autograd.grad(rms_norm(x1, w1), (x1, w1), dy.clone())
    x2, w2 = leaf(x), leaf(w)
    dy_buffer = dy.clone()
    dx, dw = torch.autograd.grad(rms_norm(x2, w2, overwrite_grad_output=True), (x2, w2), dy_buffer)
    assert dx.data_ptr() == dy_buffer.data_ptr(), "overwrite_grad_output=True must write dx into dy's storage"
    assert torch.equal(dx, dx_expected) and torch.equal(dw, dw_expected)


def test_backward_op_asked_to_overwrite_a_strided_or_other_dtype_dy_allocates(device):
    """The registered backward op, called directly with overwrite_grad_output=True, still gives the
    right dx where dy cannot take it: a strided dy (its rows would be a copy the kernel writes to)
    or one of another dtype."""
    x = randn(6, 40, dtype=torch.bfloat16, device=device)
    w = randn(40, dtype=torch.bfloat16, device=device)
    _, rstd = op.rms_norm_forward(x, w, 1e-6, 0.0, 0, False)
    dy = randn(6, 80, dtype=torch.bfloat16, device=device)[:, ::2]
    expected, _ = op.rms_norm_backward(dy.contiguous(), x, w, rstd, 0.0, 0, False)
    for grad in (dy, dy.float().contiguous()):
        dx, _ = op.rms_norm_backward(grad, x, w, rstd, 0.0, 0, True)
        assert dx.dtype == x.dtype and torch.equal(dx, expected)


def test_does_not_modify_caller_tensors(device):
    x = randn(*BASE_SHAPE, dtype=torch.bfloat16, device=device)
    w = randn(BASE_SHAPE[-1], dtype=torch.bfloat16, device=device)
    dy = randn(*BASE_SHAPE, dtype=torch.bfloat16, device=device)
    x0, w0, dy0 = x.clone(), w.clone(), dy.clone()
    xk, wk = leaf(x), leaf(w)
    rms_norm(xk, wk).backward(dy)
    assert torch.equal(x, x0) and torch.equal(w, w0) and torch.equal(dy, dy0)


def test_weight_gradient_is_deterministic(device):
    x = randn(*BASE_SHAPE, dtype=torch.bfloat16, device=device)
    w = randn(BASE_SHAPE[-1], dtype=torch.bfloat16, device=device)
    dy = randn(*BASE_SHAPE, dtype=torch.bfloat16, device=device)
    grads = []
    for _ in range(2):
        wk = leaf(w)
        rms_norm(leaf(x), wk).backward(dy)
        grads.append(wk.grad)
    assert torch.equal(grads[0], grads[1])


def test_bad_input(device):
    x = randn(4, 64, device=device)
    w = randn(64, device=device)
    with pytest.raises(ValueError, match="x must have last dimension 64"):
        rms_norm(randn(4, 32, device=device), w)
    with pytest.raises(TypeError, match="x must have a floating dtype"):
        rms_norm(torch.ones(4, 64, dtype=torch.int32, device=device), w)
    with pytest.raises(TypeError, match="weight must have a floating dtype"):
        rms_norm(x, torch.ones(64, dtype=torch.int64, device=device))
    with pytest.raises(ValueError, match="weight is on meta"):
        rms_norm(x, torch.empty(64, device="meta"))
    with pytest.raises(ValueError, match="casting_mode"):
        rms_norm(x, w, casting_mode="fp8")
    with pytest.raises(ValueError, match="weight must be 1-D"):
        rms_norm(x, randn(1, 64, device=device))
    with pytest.raises(ValueError, match="eps"):
        rms_norm(x, w, eps=float("nan"))
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        rms_norm([1.0, 2.0], w)
    with pytest.raises(TypeError, match="eps must be a number"):
        rms_norm(x, w, eps="1e-6")
    with pytest.raises(TypeError, match="overwrite_grad_output must be a bool"):
        rms_norm(x, w, overwrite_grad_output="yes")
    with pytest.raises(TypeError, match="offset must be a number"):
        rms_norm(x, w, offset=None)
    with pytest.raises(ValueError, match="x must have a non-empty last dimension"):
        rms_norm(randn(4, 0, device=device), None)


@pytest.mark.parametrize("shape", [(0, 64), (2, 0, 64)])
@pytest.mark.parametrize("affine", [True, False], ids=["weight", "no-weight"])
def test_empty_input_as_torch(device, shape, affine):
    """No rows (an MoE expert without tokens): torch's results, an empty output and gradient and a
    zero weight gradient (a sum over no rows)."""
    x = randn(*shape, device=device)
    w = randn(64, device=device) if affine else None
    xk, wk = leaf(x), None if w is None else leaf(w)
    x64, w64 = leaf(x.double()), None if w is None else leaf(w.double())
    y, ref = rms_norm(xk, wk), F.rms_norm(x64, (64,), w64, 1e-6)
    assert y.shape == ref.shape and y.dtype == x.dtype
    y.sum().backward()
    ref.sum().backward()
    assert xk.grad.shape == x64.grad.shape
    if affine:
        assert torch.equal(wk.grad, w64.grad.float()) and torch.equal(wk.grad, torch.zeros_like(w))


@pytest.mark.parametrize("overwrite, affine", [(False, True), (True, True), (False, False)],
                         ids=["weight", "overwrite-grad-output", "no-weight"])
def test_op_contract(device, overwrite, affine):
    """Custom ops (opcheck), fullgraph compile equal to eager, no host synchronisation."""
    x = randn(3, 5, 48, dtype=torch.bfloat16, device=device).requires_grad_()
    w = randn(48, dtype=torch.bfloat16, device=device).requires_grad_(affine)
    fn = lambda x, w: rms_norm(x, w if affine else None, 1e-6, 1.0, "gemma", overwrite)  # noqa: E731
    assert_op_contract(fn, (x, w), expect_ops={"rms_norm_forward", "rms_norm_backward"})


def test_backward_plan_is_persistent(profile):
    """dW partial sums need a bounded grid: one buffer row per program, at most one per unit."""
    plans = op.plan(BASE_SHAPE, torch.bfloat16, profile)
    backward = plans["backward"]
    assert backward.persistent
    per_unit = max(1, profile.warps_per_unit // backward.num_warps) if profile.warps_per_unit else 1
    assert backward.grid <= profile.compute_units * per_unit
