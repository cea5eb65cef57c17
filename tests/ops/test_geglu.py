"""GeGLU ``gelu(a) * b`` (tanh approximation and exact erf) forward and backward against a float64
PyTorch reference that rounds where Gemma's MLP rounds. The layouts, in-place and MLP-tail paths
shared with SwiGLU are tested in test_swiglu.py; here each is exercised once per GELU form."""

from __future__ import annotations

import pytest
import torch

from onca.ops import geglu as op
from onca.ops.geglu import geglu, geglu_linear
from tests.contract import assert_op_contract
from tests.helpers import DTYPES, SCALE, leaf, randn
from tests.ops.test_swiglu import BASE_SHAPE, HIDDEN, check, check_linear

FORMS = {"tanh": "gelu_tanh", "none": "gelu"}
SHAPES = {
    "cpu": [(1, 1), (37, 1000), (2, 3, 96)],
    "gpu": [(16384, 14336), (2, 4096, 21504), (1, 2048)],
}[SCALE]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("approximate", FORMS)
def test_matches_reference(profile, device, dtype, approximate):
    a = randn(*BASE_SHAPE, dtype=dtype, device=device, std=2.0)
    b = randn(*BASE_SHAPE, dtype=dtype, device=device)
    check(a, b, FORMS[approximate])


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("approximate", FORMS)
def test_shapes(device, shape, approximate):
    a = randn(*shape, dtype=torch.bfloat16, device=device, std=2.0)
    check(a, randn(*shape, dtype=torch.bfloat16, device=device), FORMS[approximate])


@pytest.mark.parametrize("approximate", FORMS)
@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # the interpreter's sigmoid
def test_extreme_inputs_stay_finite(device, approximate):
    """Saturated tanh / erf: no NaN where gelu and its gradient are finite."""
    a = torch.tensor([[-1e4, -60.0, -12.0, -1e-30, 0.0, 1e-30, 12.0, 60.0, 1e4]], device=device)
    check(a, torch.ones_like(a), FORMS[approximate])


@pytest.mark.parametrize("approximate", FORMS)
def test_public_function_and_fused_layout(device, approximate):
    """geglu() on the halves of a fused (T, 2I) buffer, and on the buffer itself (b=None)."""
    gate_up = randn(*BASE_SHAPE[:-1], 2 * BASE_SHAPE[-1], dtype=torch.bfloat16, device=device, std=2.0)
    a, b = gate_up.chunk(2, dim=-1)
    check(a, b, FORMS[approximate])
    ak, bk, g1, g2 = leaf(a), leaf(b), leaf(gate_up), leaf(gate_up)
    dc = randn(*a.shape, dtype=torch.bfloat16, device=device)
    c0 = geglu(ak, bk, approximate)
    c1 = geglu(g1, None, approximate)
    c2 = geglu(g2, None, approximate, overwrite_inputs=True)
    assert torch.equal(c0, c1) and torch.equal(c1, c2)
    expected = torch.cat(torch.autograd.grad(c0, (ak, bk), dc), dim=-1)
    (d1,) = torch.autograd.grad(c1, (g1,), dc)
    (d2,) = torch.autograd.grad(c2, (g2,), dc)
    assert d2.data_ptr() == g2.data_ptr()
    assert torch.equal(d1, expected) and torch.equal(d2, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_column_tiled_path(profile, device, onchip_bytes, dtype):
    forced = onchip_bytes(8192)
    cols = 520 if SCALE == "cpu" else 14336
    plans = op.plan((9, cols), dtype, forced)
    assert all(p.col_tiles > 1 for p in plans.values()), plans
    approximate = "tanh" if dtype == torch.bfloat16 else "none"
    a = randn(5, 9, cols, dtype=dtype, device=device, std=2.0)
    b = randn(5, 9, cols, dtype=dtype, device=device)
    check(a, b, FORMS[approximate])


@pytest.mark.parametrize("approximate", FORMS)
def test_linear_matches_reference(device, approximate):
    a = randn(*BASE_SHAPE, dtype=torch.bfloat16, device=device, std=2.0)
    b = randn(*BASE_SHAPE, dtype=torch.bfloat16, device=device)
    w = randn(HIDDEN, BASE_SHAPE[-1], dtype=torch.bfloat16, device=device, std=0.05)
    bias = randn(HIDDEN, dtype=torch.bfloat16, device=device)
    check_linear(a, b, w, bias, FORMS[approximate], overwrite_inputs=True)


def test_bad_input(device):
    a, b = randn(4, 64, device=device), randn(4, 64, device=device)
    with pytest.raises(ValueError, match="approximate must be one of"):
        geglu(a, b, approximate="sigmoid")
    with pytest.raises(ValueError, match="approximate must be one of"):
        geglu_linear(a, b, randn(8, 64, device=device), approximate=None)
    with pytest.raises(TypeError, match="b must have a's dtype"):
        geglu(a, b.to(torch.float16))
    with pytest.raises(ValueError, match="b must have a's shape"):
        geglu(a, randn(4, 65, device=device))
    with pytest.raises(TypeError, match="overwrite_inputs must be a bool"):
        geglu(a, b, overwrite_inputs=None)


@pytest.mark.parametrize("shape", [(0, 64), (2, 0, 64)])
def test_empty_input_as_torch(device, shape):
    """No tokens: empty outputs and gradients; the tail's weight and bias gradients zero."""
    a, b = leaf(randn(*shape, device=device)), leaf(randn(*shape, device=device))
    c = geglu(a, b, "none")
    c.sum().backward()
    assert c.shape == shape and a.grad.shape == shape and b.grad.shape == shape
    w, bias = leaf(randn(8, 64, device=device)), leaf(randn(8, device=device))
    out = geglu_linear(a.detach(), b.detach(), w, bias)
    assert out.shape == (*shape[:-1], 8)
    out.sum().backward()
    assert torch.equal(w.grad, torch.zeros_like(w)) and torch.equal(bias.grad, torch.zeros_like(bias))


@pytest.mark.parametrize("approximate,overwrite_inputs", [("tanh", True), ("none", False)])
def test_op_contract(device, approximate, overwrite_inputs):
    """Custom ops (opcheck), fullgraph compile equal to eager, no host synchronisation."""
    gate_up = randn(2, 3, 96, dtype=torch.bfloat16, device=device, std=2.0).requires_grad_()
    w = randn(16, 48, dtype=torch.bfloat16, device=device, std=0.1).requires_grad_()
    gated = lambda g: geglu(*(g * 1).chunk(2, -1), approximate, overwrite_inputs)  # noqa: E731
    linear = lambda g, w: geglu_linear(g * 1, None, w, None, approximate, overwrite_inputs)  # noqa: E731
    assert_op_contract(gated, (gate_up,), expect_ops={"geglu_forward", "geglu_backward"})
    assert_op_contract(linear, (gate_up, w), expect_ops={"geglu_linear_forward", "geglu_linear_backward"})
