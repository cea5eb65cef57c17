"""KL divergence forward and backward against torch's kl_div in float64."""

from __future__ import annotations

import warnings

import pytest
import torch

from onca import device as onca_device
from onca.ops import kl_div as op
from onca.ops.kl_div import kl_div
from tests.contract import assert_op_contract
from tests.helpers import SCALE, assert_close, assert_within_rounding, leaf, non_contiguous, randn

REDUCTIONS = ("none", "sum", "mean", "batchmean")

# (tokens, vocab): awkward vocabularies, scaled down on the CPU (32000 -> 1000, 151936 -> 1519,
# 262144 -> 2621).
SHAPES = {
    "cpu": [(1, 1000), (2, 3, 1519), (37, 2621), (1519,)],
    "gpu": [(1, 32000), (4096, 32000), (2, 1024, 151936), (64, 262144)],
}[SCALE]
BASE_SHAPE = {"cpu": (3, 5, 1519), "gpu": (4, 1024, 32000)}[SCALE]
TILED_VOCAB = {"cpu": 2621, "gpu": 151936}[SCALE]
WIDE_ROWS = {"cpu": 1, "gpu": 256}[SCALE]


def make_inputs(shape, dtype, device, log_target):
    """Student log-probabilities and a teacher distribution (probabilities or log-probabilities)."""
    x = torch.log_softmax(randn(*shape, device=device) * 2, dim=-1).to(dtype)
    t = torch.softmax(randn(*shape, device=device) * 2, dim=-1)
    t = (t.log() if log_target else t).to(dtype)
    return x, t


def reference(x, t, reduction, log_target, target_grad=False):
    x64 = x.detach().to(torch.float64).requires_grad_(True)
    t64 = t.detach().to(torch.float64).requires_grad_(target_grad)
    with warnings.catch_warnings():  # torch warns that "mean" is not "batchmean"
        warnings.simplefilter("ignore", UserWarning)
        loss = torch.nn.functional.kl_div(x64, t64, reduction=reduction, log_target=log_target)
    return loss, x64, t64


def check(x, t, reduction="batchmean", log_target=False, target_grad=False, grad_scale=None):
    """Kernel vs reference: the loss, dinput and (when asked) dtarget."""
    xk, tk = leaf(x), t.detach().clone().requires_grad_(target_grad)
    loss = kl_div(xk, tk, reduction, log_target)
    ref, x64, t64 = reference(x, t, reduction, log_target, target_grad)
    out_dtype = torch.promote_types(x.dtype, t.dtype)
    assert loss.dtype == out_dtype and loss.shape == ref.shape
    assert_close(loss, ref, out_dtype, "loss")
    if reduction == "none":
        dy = randn(*ref.shape, device=x.device)
    else:
        dy = torch.tensor(1.0 if grad_scale is None else grad_scale, device=x.device)
    loss.backward(dy.to(loss.dtype))
    ref.backward(dy.to(torch.float64))
    assert_close(xk.grad, x64.grad, x.dtype, "dinput")
    assert xk.grad.dtype == x.dtype
    if target_grad:
        assert_close(tk.grad, t64.grad, t.dtype, "dtarget")
    else:
        assert tk.grad is None


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("log_target", [False, True])
def test_matches_torch(profile, device, reduction, log_target):
    check(*make_inputs(BASE_SHAPE, torch.float32, device, log_target), reduction, log_target)


@pytest.mark.parametrize("reduction", ["none", "batchmean"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_low_precision(device, reduction, dtype):
    check(*make_inputs(BASE_SHAPE, dtype, device, True), reduction, True)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_shapes(profile, device, shape):
    # A 1-D input is one row; batchmean still divides by shape[0] (its length), as torch does.
    check(*make_inputs(shape, torch.bfloat16, device, False), "batchmean")


@pytest.mark.parametrize("reduction", ["none", "mean"])
@pytest.mark.parametrize("log_target", [False, True])
def test_target_gradient(device, reduction, log_target):
    x, t = make_inputs(BASE_SHAPE, torch.float32, device, log_target)
    check(x, t, reduction, log_target, target_grad=True)


def test_mixed_dtypes(device):
    """bf16 student, fp32 target: the loss takes the promoted dtype, as torch's does."""
    x, _ = make_inputs(BASE_SHAPE, torch.bfloat16, device, False)
    _, t = make_inputs(BASE_SHAPE, torch.float32, device, False)
    check(x, t, "sum")


@pytest.mark.parametrize("how", ["rows", "cols"])
def test_non_contiguous(device, how):
    x, t = make_inputs(BASE_SHAPE, torch.float32, device, True)
    check(non_contiguous(x, how), non_contiguous(t, "rows"), "mean", True)


@pytest.mark.parametrize("reduction", ["none", "batchmean"])
def test_column_tiled_path(profile, device, onchip_bytes, reduction):
    forced = onchip_bytes(32768)
    plans = op.plan((5, TILED_VOCAB), torch.bfloat16, forced)
    assert plans["forward"].col_tiles > 1 and plans["backward"].col_tiles > 1
    check(*make_inputs((5, TILED_VOCAB), torch.bfloat16, device, False), reduction, target_grad=False)
    check(*make_inputs((5, TILED_VOCAB), torch.float32, device, True), reduction, True, target_grad=True)


@pytest.mark.parametrize("name", sorted(onca_device.PROFILES))
def test_vocab_262144_on_every_profile(monkeypatch, device, name):
    monkeypatch.setenv("ONCA_DEVICE_PROFILE", name)
    onca_device.reset()
    try:
        check(*make_inputs((WIDE_ROWS, 262144), torch.bfloat16, device, True), "batchmean", True)
    finally:
        onca_device.reset()


def test_scaled_and_repeated_backward(device):
    """An incoming gradient other than 1, and a second backward through a retained graph."""
    x, t = make_inputs(BASE_SHAPE, torch.float32, device, False)
    check(x, t, "batchmean", grad_scale=-2.5)
    xk = leaf(x)
    loss = kl_div(xk, t, "sum")
    (g1,) = torch.autograd.grad(loss * 3.0, xk, retain_graph=True)
    (g2,) = torch.autograd.grad(loss, xk)
    assert_close(g1, -3.0 * t, torch.float32, "first")
    assert_close(g2, -t, torch.float32, "second")


def test_no_grad_forward(device):
    x, t = make_inputs(BASE_SHAPE, torch.float32, device, False)
    with torch.no_grad():
        loss = kl_div(leaf(x), t, "batchmean")
    assert_close(loss, reference(x, t, "batchmean", False)[0], torch.float32, "loss")


def test_zero_target_matches_torch(device):
    """xlogy(0, 0) = 0: a target with exact zeros gives a finite loss, as in torch."""
    x, t = make_inputs((4, 64), torch.float32, device, False)
    t[:, ::3] = 0.0
    check(x, t, "none")
    check(x, t, "sum")


def test_does_not_modify_caller_tensors(device):
    x, t = make_inputs(BASE_SHAPE, torch.bfloat16, device, False)
    x0, t0 = x.clone(), t.clone()
    xk = x.requires_grad_(True)
    kl_div(xk, t, "none").sum().backward()
    kl_div(xk, t, "batchmean").backward()
    assert torch.equal(x.detach(), x0) and torch.equal(t, t0)


def test_bad_input(device):
    x, t = make_inputs((4, 64), torch.float32, device, False)
    with pytest.raises(ValueError, match="target must have the input's shape"):
        kl_div(x, t[:, :32])
    with pytest.raises(ValueError, match="target must have the input's shape"):
        kl_div(x, t[:1])
    with pytest.raises(TypeError, match="input must have a floating dtype"):
        kl_div(torch.ones(4, 64, dtype=torch.int64, device=device), t)
    with pytest.raises(TypeError, match="target must have a floating dtype"):
        kl_div(x, torch.ones(4, 64, dtype=torch.int64, device=device))
    with pytest.raises(ValueError, match="reduction"):
        kl_div(x, t, "elementwise_mean")
    with pytest.raises(ValueError, match="input must have at least one dimension"):
        kl_div(torch.tensor(0.5, device=device), torch.tensor(0.5, device=device))
    with pytest.raises(ValueError, match="target is on meta"):
        kl_div(x, torch.empty(4, 64, device="meta"))
    with pytest.raises(TypeError, match="target must be a torch.Tensor"):
        kl_div(x, [0.5] * 64)
    with pytest.raises(TypeError, match="log_target must be a bool"):
        kl_div(x, t, log_target=1)


@pytest.mark.parametrize("shape", [(0, 64), (2, 0, 64)], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("target_grad", [False, True])
def test_empty_input_as_torch(device, shape, reduction, target_grad):
    """No rows: torch's results (a sum of 0, a NaN mean; batchmean is NaN only for shape[0] == 0)."""
    x, t = make_inputs(shape, torch.float32, device, False)
    xk, tk = leaf(x), t.clone().requires_grad_(target_grad)
    loss = kl_div(xk, tk, reduction)
    ref, _, _ = reference(x, t, reduction, False, target_grad)
    assert loss.shape == ref.shape
    torch.testing.assert_close(loss, ref.to(loss.dtype), equal_nan=True)
    loss.sum().backward()
    ref.sum().backward()
    assert xk.grad.shape == x.shape
    if target_grad:
        assert tk.grad.shape == t.shape


@pytest.mark.parametrize("reduction, target_grad", [("batchmean", False), ("none", False), ("mean", True)])
def test_op_contract(device, reduction, target_grad):
    """Custom ops (opcheck), fullgraph compile equal to eager, no host synchronisation: the input
    gradient from the forward kernel (batchmean), and the backward kernel (none; a target gradient)."""
    x, t = make_inputs((2, 3, 16), torch.float32, device, False)
    x, t = x.requires_grad_(), t.requires_grad_(target_grad)
    fn = lambda x, t: kl_div(x, t, reduction)  # noqa: E731
    backward_kernel = reduction == "none" or target_grad  # else the forward kernel writes dinput
    expect = {"kl_div_forward"} | ({"kl_div_backward"} if backward_kernel else set())
    assert_op_contract(fn, (x, t), expect_ops=expect)


def test_fp16_batchmean_under_a_loss_scale(device):
    """fp16 under a GradScaler-style loss scale (2**15): the gradient ``-target / tokens`` carries the
    scale from the start. Computed at unit scale in the forward pass (mostly below fp16's smallest
    subnormal at 512 tokens over a 32768 vocabulary) and rescaled afterwards, it was mostly zeros."""
    x, t = make_inputs((512, 32768), torch.float16, device, log_target=False)
    xk = leaf(x)
    loss = kl_div(xk, t, "batchmean", False)
    ref, x64, _ = reference(x, t, "batchmean", False)
    loss.backward(torch.tensor(32768.0, device=device, dtype=loss.dtype))
    ref.backward(torch.tensor(32768.0, device=device, dtype=torch.float64))
    assert_within_rounding(xk.grad, x64.grad, "dinput")
