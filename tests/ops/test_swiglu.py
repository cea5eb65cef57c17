"""SwiGLU ``silu(a) * b`` (and the shared gated-activation machinery of ``onca.ops._glu``) forward
and backward against a float64 PyTorch reference that rounds where the Hugging Face MLP rounds."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from onca.ops import _glu
from onca.ops import swiglu as op
from onca.ops._rows import as_rows
from onca.ops.geglu import geglu_forward, geglu_linear_forward
from onca.ops.swiglu import swiglu, swiglu_forward, swiglu_linear, swiglu_linear_forward
from tests.contract import assert_op_contract
from tests.helpers import DTYPES, SCALE, assert_close, leaf, non_contiguous, randn, rounded

SHAPES = {
    "cpu": [(1, 64), (1, 1), (37, 1000), (2, 3, 96), (5, 4100)],
    "gpu": [(16384, 14336), (4, 2048, 11008), (3, 53248), (1, 4096), (4097, 3072)],
}[SCALE]
BASE_SHAPE = {"cpu": (2, 7, 300), "gpu": (8, 1024, 14336)}[SCALE]
HIDDEN = {"cpu": 48, "gpu": 4096}[SCALE]

ACTS = {
    "silu": F.silu,
    "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"),
    "gelu": F.gelu,
}


# The forward op of each activation: the gated product and the MLP tail.
GATED_OPS = {"silu": swiglu_forward, "gelu_tanh": geglu_forward, "gelu": geglu_forward}
LINEAR_OPS = {"silu": swiglu_linear_forward, "gelu_tanh": geglu_linear_forward, "gelu": geglu_linear_forward}


def _round(t, dtype):
    """``t`` rounded to ``dtype`` in value, the rounding transparent to the gradient."""
    return t + (rounded(t, dtype) - t).detach()


def reference(a, b, activation="silu", gate_multiplier=1.0, down_multiplier=1.0):
    """``act(a * gate_multiplier) * b * down_multiplier`` in float64, with the scaled gate and
    ``act(...)`` rounded to the input dtype as the model stores them (the rounding is transparent to
    the gradient: the kernel differentiates the activation)."""
    a64 = a.detach().to(torch.float64).requires_grad_(True)
    b64 = b.detach().to(torch.float64).requires_grad_(True)
    h = _round(ACTS[activation](_round(a64 * gate_multiplier, a.dtype)), a.dtype)
    return h * b64 * down_multiplier, a64, b64


def layout_leaf(t):
    """A grad-requiring copy of ``t`` in ``t``'s own layout (``tests.helpers.leaf`` clones, and a
    clone of a view with gaps between its rows is contiguous: the strided path would go untested)."""
    out = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
    with torch.no_grad():
        out.copy_(t)
    return out.requires_grad_(True)


def run_op(a, b, activation, overwrite_inputs=False, gate_multiplier=1.0, down_multiplier=1.0):
    return _glu.gated(GATED_OPS[activation], a, b, activation, gate_multiplier, down_multiplier,
                      overwrite_inputs)


def check(a, b, activation="silu", overwrite_inputs=False, gate_multiplier=1.0, down_multiplier=1.0):
    """Kernel vs reference, forward and backward (``dc`` random); returns the kernel's grads."""
    ak, bk = layout_leaf(a), layout_leaf(b)
    assert ak.stride() == a.stride() and bk.stride() == b.stride()
    c = run_op(ak, bk, activation, overwrite_inputs, gate_multiplier, down_multiplier)
    assert c.dtype == a.dtype and c.shape == a.shape
    ref, a64, b64 = reference(a, b, activation, gate_multiplier, down_multiplier)
    assert_close(c, ref, a.dtype, "c")
    dc = randn(*a.shape, dtype=a.dtype, device=a.device)
    c.backward(dc)
    ref.backward(dc.to(torch.float64))
    assert_close(ak.grad, a64.grad, a.dtype, "da")
    assert_close(bk.grad, b64.grad, a.dtype, "db")
    return ak.grad, bk.grad


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_matches_reference(profile, device, dtype):
    a = randn(*BASE_SHAPE, dtype=dtype, device=device, std=2.0)
    b = randn(*BASE_SHAPE, dtype=dtype, device=device)
    check(a, b)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_shapes(device, shape, dtype):
    check(randn(*shape, dtype=dtype, device=device, std=2.0), randn(*shape, dtype=dtype, device=device))


@pytest.mark.parametrize("activation", list(ACTS))
def test_rounds_where_the_model_rounds(device, activation):
    """act(a) is rounded to the input dtype before the product, in the forward and for db: in fp16
    (rounded to nearest even here and on GPUs), c and db match the doubly rounded reference bit for
    bit almost everywhere (exact erf: ~1%, fp32's 1 + erf(x) cancels for x << 0, as in PyTorch's
    own fp32 gelu), where a single rounding differs on about a quarter of the elements."""
    a = randn(64, 257, dtype=torch.float16, device=device, std=2.0)
    b = randn(64, 257, dtype=torch.float16, device=device)
    dc = randn(64, 257, dtype=torch.float16, device=device)
    c = run_op(a, b, activation)
    h = rounded(ACTS[activation](a.double()), torch.float16)
    expected_c = (h * b.double()).half()
    assert (c != expected_c).float().mean() < 0.03
    bk = leaf(b)
    (db,) = torch.autograd.grad(run_op(leaf(a), bk, activation), (bk,), dc)
    assert (db != (h * dc.double()).half()).float().mean() < 0.03


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # the interpreter's sigmoid
def test_extreme_inputs_stay_finite(device):
    """Saturated sigmoid: no NaN where silu and its gradient are finite."""
    a = torch.tensor([[-1e4, -88.0, -30.0, -1e-30, 0.0, 1e-30, 30.0, 88.0, 1e4]], device=device)
    check(a, torch.ones_like(a))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_fused_gate_up_halves_without_copy(profile, device, dtype):
    """Phi-3's layout: a and b are the halves of one (T, 2I) buffer, rows not contiguous."""
    inter = BASE_SHAPE[-1]
    gate_up = randn(*BASE_SHAPE[:-1], 2 * inter, dtype=dtype, device=device, std=2.0)
    a, b = gate_up.chunk(2, dim=-1)
    a2d, b2d = as_rows(a), as_rows(b)
    assert a2d.data_ptr() == a.data_ptr() and b2d.data_ptr() == b.data_ptr(), "the views were copied"
    assert a2d.stride(0) == 2 * inter
    check(a, b)
    # b=None: the fused tensor itself; its gradient is one (..., 2I) tensor equal to the halves'.
    gk, ak, bk = leaf(gate_up), leaf(a), leaf(b)
    dc = randn(*a.shape, dtype=dtype, device=device)
    c_fused = run_op(gk, None, "silu")
    c_split = run_op(ak, bk, "silu")
    assert torch.equal(c_fused, c_split)
    c_fused.backward(dc)
    c_split.backward(dc)
    assert torch.equal(gk.grad, torch.cat([ak.grad, bk.grad], dim=-1))


@pytest.mark.parametrize("how", ["rows", "cols"])
def test_non_contiguous_input(device, how):
    a = non_contiguous(randn(*BASE_SHAPE, device=device, std=2.0), how)
    # b: rows 3x as far apart as they are wide, so a's and b's row strides always differ
    b = torch.empty(*BASE_SHAPE[:-1], 3 * BASE_SHAPE[-1], device=device)[..., 5:5 + BASE_SHAPE[-1]]
    b.copy_(randn(*BASE_SHAPE, device=device))
    assert as_rows(a).stride(0) != as_rows(b).stride(0)
    check(a, b)
    check(a.transpose(0, 1), b.transpose(0, 1))  # leading dims that do not merge: copied
    check_linear(a, b, randn(HIDDEN, BASE_SHAPE[-1], device=device, std=0.05), None, "silu",
                 overwrite_inputs=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_column_tiled_path(profile, device, onchip_bytes, dtype):
    # An 8 KiB budget cannot hold a 520-wide row: every kernel loops over column tiles.
    forced = onchip_bytes(8192)
    cols = 520 if SCALE == "cpu" else 14336
    plans = op.plan((9, cols), dtype, forced)
    assert all(p.col_tiles > 1 for p in plans.values()), plans
    # More rows than any profile has compute units: every program loops over several row blocks.
    a = randn(5, 9, cols, dtype=dtype, device=device, std=2.0)
    b = randn(5, 9, cols, dtype=dtype, device=device)
    check(a, b)
    if dtype == torch.bfloat16:
        w = randn(HIDDEN, cols, dtype=dtype, device=device, std=0.05)
        check_linear(a, b, w, None, "silu", overwrite_inputs=True)


def test_gpu_plan_one_program_per_tile(gpu_profile, device):
    """A GPU plan runs one (row block, column tile) job a program: rows of three 2048-column tiles,
    the last one partial, as separate tensors and as the strided halves of ``[gate | up]``."""
    cols = 4100
    plans = op.plan((9, cols), torch.bfloat16)
    assert all(p.col_tiles == 3 and p.grid == p.jobs == 27 for p in plans.values()), plans
    gate_up = randn(9, 2 * cols, dtype=torch.bfloat16, device=device, std=2.0)
    check(*gate_up.chunk(2, dim=-1))
    check(gate_up[:, :cols], gate_up[:, cols:], "gelu_tanh", gate_multiplier=0.5, down_multiplier=2.0)
    a, b = gate_up.chunk(2, dim=-1)
    check_linear(a, b, randn(HIDDEN, cols, dtype=torch.bfloat16, device=device, std=0.05), None, "silu",
                 overwrite_inputs=True)


def test_overwrite_inputs_writes_the_gradients_over_a_and_b(device):
    a = randn(*BASE_SHAPE, dtype=torch.bfloat16, device=device, std=2.0)
    b = randn(*BASE_SHAPE, dtype=torch.bfloat16, device=device)
    dc = randn(*BASE_SHAPE, dtype=torch.bfloat16, device=device)
    a1, b1 = leaf(a), leaf(b)
    expected = torch.autograd.grad(swiglu(a1, b1), (a1, b1), dc)
    a2, b2 = leaf(a), leaf(b)
    out = swiglu(a2, b2, overwrite_inputs=True)
    da, db = torch.autograd.grad(out, (a2, b2), dc, retain_graph=True)
    assert da.data_ptr() == a2.data_ptr() and db.data_ptr() == b2.data_ptr()
    assert torch.equal(da, expected[0]) and torch.equal(db, expected[1])
    # A second backward would read the gradients as the saved inputs: refused, not wrong.
    with pytest.raises(RuntimeError, match=r"retain_graph=True\), use overwrite_inputs=False"):
        torch.autograd.grad(out, (a2, b2), dc)
    # Through .backward(), the leaves' .grad are their own storage: handed over, not copied.
    a3, b3 = leaf(a), leaf(b)
    swiglu(a3, b3, overwrite_inputs=True).backward(dc)
    assert a3.grad.data_ptr() == a3.data_ptr() and b3.grad.data_ptr() == b3.data_ptr()
    assert torch.equal(a3.grad, expected[0]) and torch.equal(b3.grad, expected[1])
    # Fused: the gradient is the fused buffer itself.
    g = leaf(torch.cat([a, b], dim=-1))
    (dg,) = torch.autograd.grad(swiglu(g, None, overwrite_inputs=True), (g,), dc)
    assert dg.data_ptr() == g.data_ptr()
    assert torch.equal(dg, torch.cat(expected, dim=-1))


def test_expanded_incoming_gradient(device):
    """``c.sum().backward()`` hands the backward a stride-0 gradient."""
    a = layout_leaf(randn(*BASE_SHAPE, device=device, std=2.0))
    b = layout_leaf(randn(*BASE_SHAPE, device=device))
    swiglu(a, b).sum().backward()
    ref, a64, b64 = reference(a, b)
    ref.sum().backward()
    assert_close(a.grad, a64.grad, torch.float32, "da")
    assert_close(b.grad, b64.grad, torch.float32, "db")


def test_does_not_modify_caller_tensors(device):
    a = randn(*BASE_SHAPE, dtype=torch.bfloat16, device=device)
    b = randn(*BASE_SHAPE, dtype=torch.bfloat16, device=device)
    w = randn(HIDDEN, BASE_SHAPE[-1], dtype=torch.bfloat16, device=device)
    dc = randn(*BASE_SHAPE, dtype=torch.bfloat16, device=device)
    dout = randn(*BASE_SHAPE[:-1], HIDDEN, dtype=torch.bfloat16, device=device)
    saved = [t.clone() for t in (a, b, w, dc, dout)]
    swiglu(leaf(a), leaf(b)).backward(dc)
    swiglu_linear(leaf(a), leaf(b), leaf(w)).backward(dout)
    assert all(torch.equal(t, s) for t, s in zip((a, b, w, dc, dout), saved))


# ------------------------------------------------------------------------------- the MLP tail


def linear_reference(a, b, w, bias, activation, gate_multiplier=1.0, down_multiplier=1.0):
    """Falcon-H1's ``down_proj(act(gate * m_gate) * up) * m_down`` in float64."""
    c, a64, b64 = reference(a, b, activation, gate_multiplier)
    w64 = w.detach().to(torch.float64).requires_grad_(True)
    bias64 = bias.detach().to(torch.float64).requires_grad_(True) if bias is not None else None
    # The product is rounded to the input dtype before the matmul, as nn.Linear receives it.
    return F.linear(_round(c, a.dtype), w64, bias64) * down_multiplier, a64, b64, w64, bias64


def check_linear(a, b, w, bias, activation, overwrite_inputs=False, fused=False, gate_multiplier=1.0,
                 down_multiplier=1.0):
    ak, bk = layout_leaf(a), layout_leaf(b)
    wk = leaf(w)
    biask = leaf(bias) if bias is not None else None
    options = (activation, gate_multiplier, down_multiplier, overwrite_inputs)
    if fused:
        gk = leaf(torch.cat([a, b], dim=-1))
        out = _glu.gated_linear(LINEAR_OPS[activation], gk, None, wk, biask, *options)
    else:
        out = _glu.gated_linear(LINEAR_OPS[activation], ak, bk, wk, biask, *options)
    ref, a64, b64, w64, bias64 = linear_reference(a, b, w, bias, activation, gate_multiplier,
                                                  down_multiplier)
    assert out.dtype == a.dtype and out.shape == ref.shape
    assert_close(out, ref, a.dtype, "out")
    dout = randn(*ref.shape, dtype=a.dtype, device=a.device)
    out.backward(dout)
    ref.backward(dout.to(torch.float64))
    if fused:
        assert_close(gk.grad, torch.cat([a64.grad, b64.grad], dim=-1), a.dtype, "d_gate_up")
    else:
        assert_close(ak.grad, a64.grad, a.dtype, "da")
        assert_close(bk.grad, b64.grad, a.dtype, "db")
    assert_close(wk.grad, w64.grad, a.dtype, "dweight")
    if bias is not None:
        assert_close(biask.grad, bias64.grad, a.dtype, "dbias")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("overwrite_inputs,fused,bias", [
    (True, False, False), (False, True, True), (True, True, True), (False, False, True),
])
def test_linear_matches_reference(device, dtype, overwrite_inputs, fused, bias):
    a = randn(*BASE_SHAPE, dtype=dtype, device=device, std=2.0)
    b = randn(*BASE_SHAPE, dtype=dtype, device=device)
    w = randn(HIDDEN, BASE_SHAPE[-1], dtype=dtype, device=device, std=0.05)
    bias_t = randn(HIDDEN, dtype=dtype, device=device) if bias else None
    check_linear(a, b, w, bias_t, "silu", overwrite_inputs, fused)


def test_linear_keeps_no_product(device):
    """Saved for backward: a, b and the weight; no (T, intermediate) product."""
    a = leaf(randn(*BASE_SHAPE, device=device))
    b = leaf(randn(*BASE_SHAPE, device=device))
    w = leaf(randn(HIDDEN, BASE_SHAPE[-1], device=device))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        swiglu_linear(a, b, w)
    expected = [a.data_ptr(), b.data_ptr(), w.data_ptr()]
    assert [t.data_ptr() for t in saved] == expected, [t.shape for t in saved]


def test_linear_overwrite_inputs_refuses_second_backward(device):
    a, b = leaf(randn(3, 40, device=device)), leaf(randn(3, 40, device=device))
    w = leaf(randn(8, 40, device=device))
    out = swiglu_linear(a, b, w, overwrite_inputs=True)
    out.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="overwrite_inputs=False"):
        out.sum().backward()
    out = swiglu_linear(leaf(a), leaf(b), w, overwrite_inputs=False)
    out.sum().backward(retain_graph=True)
    out.sum().backward()


def test_linear_under_autocast(device):
    """fp32 master weights, bf16 activations: the weight is cast as nn.Linear's would be."""
    a = randn(*BASE_SHAPE, dtype=torch.bfloat16, device=device, std=2.0)
    b = randn(*BASE_SHAPE, dtype=torch.bfloat16, device=device)
    w = randn(HIDDEN, BASE_SHAPE[-1], device=device, std=0.05)
    bias = randn(HIDDEN, device=device)
    wk, biask, wr, biasr = leaf(w), leaf(bias), leaf(w), leaf(bias)
    dout = randn(*BASE_SHAPE[:-1], HIDDEN, dtype=torch.bfloat16, device=device)
    with torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16):
        out = swiglu_linear(leaf(a), leaf(b), wk, biask)
        ref = F.linear(F.silu(a) * b, wr, biasr)
    assert out.dtype == ref.dtype == torch.bfloat16
    assert_close(out, ref, torch.bfloat16, "out")
    out.backward(dout)
    ref.backward(dout)
    assert wk.grad.dtype == torch.float32 and biask.grad.dtype == torch.float32
    assert_close(wk.grad, wr.grad, torch.bfloat16, "dweight")
    assert_close(biask.grad, biasr.grad, torch.bfloat16, "dbias")


# ------------------------------------------------------------------------------------- errors


def test_bad_input(device):
    a, b = randn(4, 64, device=device), randn(4, 64, device=device)
    w = randn(16, 64, device=device)
    with pytest.raises(TypeError, match="a must have a floating dtype"):
        swiglu(torch.ones(4, 64, dtype=torch.int32, device=device), b)
    with pytest.raises(TypeError, match="a must be a torch.Tensor"):
        swiglu([1.0], b)
    with pytest.raises(TypeError, match="b must be a torch.Tensor"):
        swiglu(a, 2.0)
    with pytest.raises(TypeError, match="b must have a's dtype"):
        swiglu(a, b.to(torch.bfloat16))
    with pytest.raises(ValueError, match="b must have a's shape"):
        swiglu(a, randn(4, 32, device=device))
    with pytest.raises(ValueError, match="b is on meta"):
        swiglu(a, torch.empty(4, 64, device="meta"))
    with pytest.raises(ValueError, match="even last dimension"):
        swiglu(randn(4, 63, device=device))
    with pytest.raises(ValueError, match="a and b in separate memory"):
        swiglu(a, a, overwrite_inputs=True)
    with pytest.raises(TypeError, match="overwrite_inputs must be a bool"):
        swiglu(a, b, overwrite_inputs="yes")
    with pytest.raises(TypeError, match="overwrite_inputs must be a bool"):
        swiglu_linear(a, b, w, overwrite_inputs=1)
    with pytest.raises(TypeError, match="gate_multiplier must be a number"):
        swiglu(a, b, gate_multiplier="2")
    with pytest.raises(TypeError, match="gate_multiplier must be a number"):
        swiglu_linear(a, b, w, gate_multiplier=torch.tensor(2.0))
    with pytest.raises(ValueError, match="down_multiplier must be a number"):
        swiglu(a, b, down_multiplier=float("nan"))
    with pytest.raises(ValueError, match="activation must be one of"):
        _glu.gated(swiglu_forward, a, b, "relu", 1.0, 1.0, False)
    with pytest.raises(ValueError, match=r"weight must be 2-D \(out_features, 64\)"):
        swiglu_linear(a, b, randn(16, 32, device=device))
    with pytest.raises(ValueError, match="bias must have shape"):
        swiglu_linear(a, b, w, randn(8, device=device))
    with pytest.raises(TypeError, match="weight must have the activations' dtype"):
        swiglu_linear(a, b, w.to(torch.bfloat16))
    with pytest.raises(TypeError, match="bias must have a floating dtype"):
        swiglu_linear(a, b, w, torch.ones(16, dtype=torch.int64, device=device))


def test_plan_keys_and_gpu_tiles():
    from onca.device import PROFILES

    plans = op.plan((16384, 14336), torch.bfloat16, PROFILES["h100"])
    assert set(plans) == {"forward", "backward", "product_backward"}
    for p in plans.values():
        assert p.block_cols * p.col_tiles >= 14336 and p.tile_bytes <= p.onchip_bytes


# -------------------------------------------------------------------------------- multipliers


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_multipliers_match_reference(device, dtype):
    """Falcon-H1's gate and down multipliers: ``silu(a * m_gate) * b * m_down``, and the MLP tail
    ``down_proj(silu(a * m_gate) * b) * m_down`` with its bias, fused layout included."""
    a = randn(*BASE_SHAPE, dtype=dtype, device=device, std=2.0)
    b = randn(*BASE_SHAPE, dtype=dtype, device=device)
    check(a, b, gate_multiplier=0.37, down_multiplier=2.5)
    w = randn(HIDDEN, BASE_SHAPE[-1], dtype=dtype, device=device, std=0.05)
    bias = randn(HIDDEN, dtype=dtype, device=device)
    check_linear(a, b, w, bias, "silu", gate_multiplier=0.37, down_multiplier=2.5)
    check_linear(a, b, w, bias, "silu", fused=True, overwrite_inputs=True, gate_multiplier=1.75,
                 down_multiplier=0.125)


def test_multipliers_through_the_public_functions(device):
    a, b = randn(4, 40, device=device, std=2.0), randn(4, 40, device=device)
    w, bias = randn(8, 40, device=device), randn(8, device=device)
    gate, down = 0.5, 3.0
    expected = F.silu(a * gate) * b * down
    assert_close(swiglu(a, b, gate_multiplier=gate, down_multiplier=down), expected, torch.float32)
    out = swiglu_linear(a, b, w, bias, gate_multiplier=gate, down_multiplier=down)
    assert_close(out, F.linear(F.silu(a * gate) * b, w, bias) * down, torch.float32)


# ------------------------------------------------------------------------------- empty inputs


@pytest.mark.parametrize("shape", [(0, 64), (2, 0, 64)])
def test_empty_input_as_torch(device, shape):
    """No tokens (an MoE expert without any): empty outputs and gradients, and the tail's weight
    and bias gradients zero, as torch's (a sum over no rows)."""
    a, b, g = leaf(randn(*shape, device=device)), leaf(randn(*shape, device=device)), None
    c = swiglu(a, b)
    assert c.shape == shape
    c.sum().backward()
    assert a.grad.shape == shape and b.grad.shape == shape
    g = leaf(randn(*shape[:-1], 128, device=device))
    swiglu(g, None).sum().backward()
    assert g.grad.shape == g.shape
    w, bias = leaf(randn(8, 64, device=device)), leaf(randn(8, device=device))
    w_ref, bias_ref = leaf(w.detach()), leaf(bias.detach())
    out = swiglu_linear(leaf(a.detach()), leaf(b.detach()), w, bias)
    ref = F.linear(F.silu(a.detach()) * b.detach(), w_ref, bias_ref)
    assert out.shape == ref.shape
    out.sum().backward()
    ref.sum().backward()
    assert torch.equal(w.grad, w_ref.grad) and torch.equal(bias.grad, bias_ref.grad)


def test_zero_width_as_torch(device):
    a, b = leaf(randn(3, 0, device=device)), leaf(randn(3, 0, device=device))
    c = swiglu(a, b)
    c.sum().backward()
    assert c.shape == (3, 0) and a.grad.shape == (3, 0)


# ------------------------------------------------------------------------------- the contract


@pytest.mark.parametrize("overwrite_inputs,fused", [(False, False), (True, True)])
def test_op_contract(device, overwrite_inputs, fused):
    """Custom ops (opcheck), fullgraph compile equal to eager, no host synchronisation."""
    gate_up = randn(2, 3, 96, dtype=torch.bfloat16, device=device, std=2.0)
    w = randn(16, 48, dtype=torch.bfloat16, device=device, std=0.1).requires_grad_()
    bias = randn(16, dtype=torch.bfloat16, device=device).requires_grad_()
    multipliers = dict(gate_multiplier=0.5, down_multiplier=2.0)
    if fused:
        gated = lambda g: swiglu(g * 1, None, overwrite_inputs, **multipliers)  # noqa: E731
        linear = lambda g, w, bias: swiglu_linear(g * 1, None, w, bias, overwrite_inputs,  # noqa: E731
                                                  **multipliers)
    else:
        gated = lambda g: swiglu(*(g * 1).chunk(2, -1), overwrite_inputs, **multipliers)  # noqa: E731
        linear = lambda g, w, bias: swiglu_linear(*(g * 1).chunk(2, -1), w, bias,  # noqa: E731
                                                  overwrite_inputs, **multipliers)
    gate_up.requires_grad_()
    assert_op_contract(gated, (gate_up,), expect_ops={"swiglu_forward", "swiglu_backward"})
    assert_op_contract(linear, (gate_up, w, bias),
                       expect_ops={"swiglu_linear_forward", "swiglu_linear_backward"})
