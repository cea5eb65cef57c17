"""PolyNorm forward and backward against a float64 PyTorch reference (PolyCom's PolyNorm)."""

from __future__ import annotations

import pytest
import torch

from onca.ops import poly_norm as op
from onca.ops.poly_norm import poly_norm
from tests.contract import assert_op_contract
from tests.helpers import DTYPES, SCALE, assert_close, leaf, non_contiguous, randn

SHAPES = {
    "cpu": [(1, 64), (1, 1), (37, 300), (2, 3, 96)],
    "gpu": [(16384, 4096), (4, 2048, 5120), (3, 65536), (1, 4096)],
}[SCALE]
BASE_SHAPE = {"cpu": (2, 7, 200), "gpu": (8, 1024, 4096)}[SCALE]


def params(dtype, device, bias_shape=()):
    w = torch.tensor([0.3, -0.5, 0.8], device=device).to(dtype)
    b = torch.full(bias_shape, 0.25, device=device).to(dtype)
    return w, b


def reference(x, w, b, eps):
    """PolyCom's PolyNorm.forward in float64."""
    x64, w64, b64 = (t.detach().to(torch.float64).requires_grad_(True) for t in (x, w, b))

    def norm(u):
        return u * torch.rsqrt(u.pow(2).mean(-1, keepdim=True) + eps)

    y = w64[0] * norm(x64 ** 3) + w64[1] * norm(x64 ** 2) + w64[2] * norm(x64) + b64
    return y, (x64, w64, b64)


def check(x, w, b, eps=1e-6, overwrite_grad_output=False):
    ks = [leaf(t) for t in (x, w, b)]
    y = poly_norm(*ks, eps, overwrite_grad_output)
    assert y.dtype == x.dtype and y.shape == x.shape
    ref, t64 = reference(x, w, b, eps)
    assert_close(y, ref, x.dtype, "y")
    dy = randn(*x.shape, dtype=x.dtype, device=x.device)
    y.backward(dy.clone())
    ref.backward(dy.to(torch.float64))
    for name, k, r, t in zip(("dx", "dweight", "dbias"), ks, t64, (x, w, b)):
        assert k.grad.dtype == t.dtype and k.grad.shape == t.shape, name
        assert_close(k.grad, r.grad, x.dtype, name)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_matches_reference(profile, device, dtype):
    x = randn(*BASE_SHAPE, dtype=dtype, device=device)
    check(x, *params(dtype, device))


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_shapes(device, shape):
    x = randn(*shape, dtype=torch.bfloat16, device=device)
    check(x, *params(torch.bfloat16, device, bias_shape=(1,)))


@pytest.mark.parametrize("how", ["rows", "cols"])
def test_non_contiguous_input(profile, device, how):
    x = non_contiguous(randn(*BASE_SHAPE, device=device), how)
    check(x, *params(torch.float32, device))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_column_tiled_path(profile, device, onchip_bytes, dtype):
    forced = onchip_bytes(16384)
    cols = 600 if SCALE == "cpu" else 8192
    rows = (2, 3) if SCALE == "cpu" else (5, 9)
    plans = op.plan((*rows, cols), dtype, forced)
    assert plans["forward"].col_tiles > 1 and plans["backward"].col_tiles > 1
    check(randn(*rows, cols, dtype=dtype, device=device), *params(dtype, device))


def test_fp32_params_with_bf16_input(device):
    check(randn(*BASE_SHAPE, dtype=torch.bfloat16, device=device), *params(torch.float32, device))


def test_overwrite_grad_output_reuses_dy(device):
    x = randn(*BASE_SHAPE, dtype=torch.bfloat16, device=device)
    w, b = params(torch.bfloat16, device)
    dy = randn(*BASE_SHAPE, dtype=torch.bfloat16, device=device)
    x1 = leaf(x)
    expected = torch.autograd.grad(poly_norm(x1, w, b), x1, dy.clone())[0]
    x2, dy_buffer = leaf(x), dy.clone()
    (dx,) = torch.autograd.grad(poly_norm(x2, w, b, overwrite_grad_output=True), x2, dy_buffer)
    assert dx.data_ptr() == dy_buffer.data_ptr()
    assert torch.equal(dx, expected)


def test_parameter_gradients_are_deterministic(device):
    x = randn(*BASE_SHAPE, dtype=torch.bfloat16, device=device)
    grads = []
    for _ in range(2):
        w, b = (leaf(t) for t in params(torch.bfloat16, device))
        poly_norm(x, w, b).sum().backward()
        grads.append((w.grad, b.grad))
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])


def test_bad_input(device):
    x = randn(4, 64, device=device)
    w, b = params(torch.float32, device)
    with pytest.raises(TypeError, match="x must have a floating dtype"):
        poly_norm(x.int(), w, b)
    with pytest.raises(ValueError, match=r"weight must have shape \(3,\)"):
        poly_norm(x, randn(4, device=device), b)
    with pytest.raises(ValueError, match="bias must have one element"):
        poly_norm(x, w, randn(2, device=device))
    with pytest.raises(TypeError, match="bias must be a torch.Tensor"):
        poly_norm(x, w, 1.0)
    with pytest.raises(ValueError, match="weight is on meta"):
        poly_norm(x, torch.empty(3, device="meta"), b)
    with pytest.raises(ValueError, match="eps"):
        poly_norm(x, w, b, eps=-1.0)
    with pytest.raises(TypeError, match="overwrite_grad_output must be a bool"):
        poly_norm(x, w, b, overwrite_grad_output=1)
    with pytest.raises(ValueError, match="x must have a non-empty last dimension"):
        poly_norm(randn(4, 0, device=device), w, b)


@pytest.mark.parametrize("shape", [(0, 64), (2, 0, 64)])
def test_empty_input(device, shape):
    xk = leaf(randn(*shape, device=device))
    w, b = (leaf(t) for t in params(torch.float32, device))
    y = poly_norm(xk, w, b)
    assert y.shape == shape
    y.sum().backward()
    assert xk.grad.shape == shape
    assert torch.equal(w.grad, torch.zeros_like(w)) and torch.equal(b.grad, torch.zeros_like(b))


def test_op_contract(device):
    """Custom ops (opcheck), fullgraph compile equal to eager, no host synchronisation."""
    x = randn(3, 5, 48, dtype=torch.bfloat16, device=device).requires_grad_()
    w, b = (t.requires_grad_() for t in params(torch.bfloat16, device))
    assert_op_contract(poly_norm, (x, w, b), expect_ops={"poly_norm_forward", "poly_norm_backward"})
