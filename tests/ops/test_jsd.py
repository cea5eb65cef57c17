"""Generalised JSD forward and backward against a float64 PyTorch reference (and, at beta 0 and 1,
against torch's kl_div)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from onca import device as onca_device
from onca.ops import jsd as op
from onca.ops.jsd import jsd
from tests.contract import assert_op_contract
from tests.helpers import SCALE, assert_close, assert_within_rounding, leaf, non_contiguous, randn

IGNORE = -100
SHAPES = {
    "cpu": [(1, 1000), (2, 3, 1519), (37, 2621)],
    "gpu": [(1, 32000), (4096, 32000), (2, 512, 151936), (64, 262144)],
}[SCALE]
BASE_SHAPE = {"cpu": (9, 1519), "gpu": (2048, 151936)}[SCALE]
TILED_VOCAB = {"cpu": 2621, "gpu": 151936}[SCALE]
WIDE_ROWS = {"cpu": 1, "gpu": 256}[SCALE]


def _kl_terms(log_a, log_b):
    """``a * (log a - log b)`` elementwise, 0 where ``a`` is 0 (torch's kl_div gives NaN there)."""
    a = log_a.exp()
    return torch.where(a > 0, a * (log_a - log_b), 0.0)


def divergence_per_token(log_q, log_p, beta):
    """The generalised JSD per token from float64 student / teacher log-probabilities."""
    if beta == 0.0:
        per = _kl_terms(log_p, log_q)
    elif beta == 1.0:
        per = _kl_terms(log_q, log_p)
    else:
        log_mix = torch.logsumexp(torch.stack([log_p + math.log(beta), log_q + math.log(1.0 - beta)]), dim=0)
        per = beta * _kl_terms(log_p, log_mix) + (1.0 - beta) * _kl_terms(log_q, log_mix)
    return per.sum(-1)


def reduce_tokens(per_token, labels, reduction, ignore_index=IGNORE):
    if labels is not None:
        per_token = torch.where(labels.reshape(per_token.shape) != ignore_index, per_token, 0.0)
    if reduction == "none":
        return per_token
    if reduction == "sum":
        return per_token.sum()
    count = per_token.numel() if labels is None else max(int((labels != ignore_index).sum()), 1)
    return per_token.sum() / count


def reference(x, y, labels=None, beta=0.5, temperature=1.0, reduction="mean", from_logits=False):
    x64 = x.detach().to(torch.float64).requires_grad_(True)
    y64 = y.detach().to(torch.float64)
    log_q, log_p = x64, y64
    if from_logits or temperature != 1.0:
        log_q, log_p = torch.log_softmax(x64 / temperature, -1), torch.log_softmax(y64 / temperature, -1)
    return reduce_tokens(divergence_per_token(log_q, log_p, beta), labels, reduction), x64


def make_inputs(shape, dtype, device, logits=False, ignore_every=0):
    """Student and teacher log-probabilities (or logits), and labels with every n-th token ignored."""
    x = randn(*shape, device=device, std=2.0)
    y = x * 0.5 + randn(*shape, device=device, std=1.5)  # related, as a student and its teacher are
    if not logits:
        x, y = torch.log_softmax(x, -1), torch.log_softmax(y, -1)
    labels = torch.randint(0, shape[-1], shape[:-1], device=device)
    if ignore_every:
        labels.view(-1)[::ignore_every] = IGNORE
    return x.to(dtype), y.to(dtype), labels


def check(x, y, labels=None, beta=0.5, temperature=1.0, reduction="mean", from_logits=False, grad=None):
    xk = leaf(x)
    loss = jsd(xk, y, labels, beta, IGNORE, temperature, reduction, from_logits)
    ref, x64 = reference(x, y, labels, beta, temperature, reduction, from_logits)
    assert loss.dtype == x.dtype and loss.shape == ref.shape
    assert_close(loss, ref, x.dtype, "loss")
    if grad is None:
        scalar = reduction != "none"
        grad = torch.ones((), device=x.device) if scalar else torch.randn(ref.shape, device=x.device)
    loss.backward(grad.to(loss.dtype))
    ref.backward(grad.to(torch.float64))
    assert_close(xk.grad, x64.grad, x.dtype, "dinput")
    assert xk.grad.dtype == x.dtype
    return loss, xk.grad


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_matches_reference(profile, device, beta, dtype):
    x, y, labels = make_inputs(BASE_SHAPE, dtype, device, ignore_every=4)
    check(x, y, labels, beta)


@pytest.mark.parametrize("beta", [0.0, 1.0])
def test_limits_are_torch_kl_div(device, beta):
    """beta = 0 is KL(teacher || student), beta = 1 is KL(student || teacher): torch's kl_div with
    log_target, batchmean over tokens, gradients included."""
    x, y, _ = make_inputs(BASE_SHAPE, torch.float32, device)
    xk, xt = leaf(x), leaf(x)
    loss = jsd(xk, y, beta=beta)
    if beta == 0.0:
        expected = F.kl_div(xt, y, reduction="batchmean", log_target=True)
    else:
        expected = F.kl_div(y, xt, reduction="batchmean", log_target=True)
    assert_close(loss, expected, torch.float32, "loss")
    loss.backward()
    expected.backward()
    assert_close(xk.grad, xt.grad, torch.float32, "dinput")


@pytest.mark.parametrize("beta", [0.0, 0.3, 1.0])
@pytest.mark.parametrize("reduction", ["none", "sum"])
def test_reductions(device, beta, reduction):
    x, y, labels = make_inputs(BASE_SHAPE, torch.float32, device, ignore_every=3)
    check(x, y, labels, beta, reduction=reduction)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_temperature(device, beta, dtype):
    """T != 1: softmax(input / T) against softmax(target / T); log-probabilities and logits agree."""
    x, y, labels = make_inputs(BASE_SHAPE, dtype, device, logits=True, ignore_every=5)
    from_logits, _ = check(x, y, labels, beta, temperature=2.0)
    lx, ly = torch.log_softmax(x.float(), -1).to(dtype), torch.log_softmax(y.float(), -1).to(dtype)
    from_log_probs, _ = check(lx, ly, labels, beta, temperature=2.0)
    assert_close(from_log_probs, from_logits.detach(), dtype, "same loss")


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_from_logits(profile, device, beta):
    x, y, _ = make_inputs(BASE_SHAPE, torch.float32, device, logits=True)
    check(x, y, beta=beta, from_logits=True)
    check(x, y, beta=beta, temperature=0.7, reduction="none")


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_shapes(profile, device, shape):
    x, y, labels = make_inputs(shape, torch.bfloat16, device, ignore_every=2)
    check(x, y, labels if len(shape) > 2 else None, beta=0.4)


@pytest.mark.parametrize("normalize", [False, True], ids=["log_probs", "temperature"])
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_column_tiled_path(profile, device, onchip_bytes, normalize, beta):
    forced = onchip_bytes(32768)
    plans = op.plan((5, TILED_VOCAB), torch.float32, forced)
    assert plans["log_probs"].col_tiles > 1 and plans["normalizing"].col_tiles > 1
    x, y, labels = make_inputs((5, TILED_VOCAB), torch.float32, device, logits=normalize, ignore_every=3)
    check(x, y, labels, beta, temperature=1.5 if normalize else 1.0,
          reduction="mean" if beta != 0.5 else "none")


@pytest.mark.parametrize("name", sorted(onca_device.PROFILES))
def test_vocab_262144_on_every_profile(monkeypatch, device, name):
    monkeypatch.setenv("ONCA_DEVICE_PROFILE", name)
    onca_device.reset()
    try:
        x, y, _ = make_inputs((WIDE_ROWS, 262144), torch.bfloat16, device)
        check(x, y, beta=0.5)
        if name == "h100":  # the three-pass (normalising) path once at this width
            check(x, y, beta=0.5, temperature=2.0)
    finally:
        onca_device.reset()


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_every_token_ignored(device, reduction, temperature):
    """No token counts: a zero loss and zero gradients, never NaN."""
    x, y, labels = make_inputs(BASE_SHAPE, torch.float32, device)
    labels.fill_(IGNORE)
    loss, grad = check(x, y, labels, temperature=temperature, reduction=reduction)
    assert torch.count_nonzero(loss) == 0 and torch.count_nonzero(grad) == 0


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_one_token(device, beta):
    x, y, labels = make_inputs((1, 1519), torch.bfloat16, device)
    check(x, y, labels, beta)
    check(x, y, labels, beta, temperature=3.0)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's NumPy on -inf - -inf
def test_zero_probabilities(device):
    """-inf log-probabilities (a masked vocabulary) contribute 0, not NaN."""
    x, y, _ = make_inputs((4, 300), torch.float32, device, logits=True)
    x[:, 250:] = float("-inf")
    y[:, 200:] = float("-inf")
    x, y = torch.log_softmax(x, -1), torch.log_softmax(y, -1)
    # The teacher's support lies inside the student's: forward KL and the mixture are finite, the
    # reverse KL is infinite (the student has mass where the teacher has none).
    for beta in (0.0, 0.5, 1.0):
        loss = jsd(leaf(x), y, beta=beta)
        ref, _ = reference(x, y, beta=beta)
        assert not torch.isnan(loss) and bool(torch.isfinite(ref)) == (beta != 1.0)
        assert_close(loss, ref, torch.float32, "loss")


@pytest.mark.parametrize("how", ["rows", "cols"])
def test_non_contiguous(device, how):
    x, y, labels = make_inputs(BASE_SHAPE, torch.float32, device, ignore_every=3)
    check(non_contiguous(x, how), non_contiguous(y, "rows"), labels, 0.5, temperature=1.3)


def test_labels_shapes_and_dtypes(device):
    """Labels as (batch, seq) or flat, int64 or int32."""
    x, y, labels = make_inputs((2, 3, 1000), torch.float32, device, ignore_every=2)
    a = jsd(x, y, labels)
    b = jsd(x.view(6, 1000), y.view(6, 1000), labels.view(6).to(torch.int32))
    c = jsd(x, y, labels.view(6))
    assert torch.equal(a, b) and torch.equal(a, c)


def test_scaled_and_repeated_backward(device):
    x, y, labels = make_inputs(BASE_SHAPE, torch.float32, device, ignore_every=3)
    check(x, y, labels, grad=torch.tensor(-1.75, device=device))
    xk = leaf(x)
    loss = jsd(xk, y, labels)
    (g1,) = torch.autograd.grad(loss * 4.0, xk, retain_graph=True)
    (g2,) = torch.autograd.grad(loss, xk)
    assert torch.equal(g1, g2 * 4.0)


def test_no_grad_and_teacher_gets_none(device):
    x, y, labels = make_inputs(BASE_SHAPE, torch.float32, device)
    with torch.no_grad():
        loss = jsd(leaf(x), y, labels)
    assert_close(loss, reference(x, y, labels)[0], torch.float32, "loss")
    xk, yk = leaf(x), leaf(y)
    jsd(xk, yk).backward()
    assert xk.grad is not None and yk.grad is None


def test_does_not_modify_caller_tensors(device):
    x, y, labels = make_inputs(BASE_SHAPE, torch.bfloat16, device, ignore_every=3)
    x0, y0, l0 = x.clone(), y.clone(), labels.clone()
    xk = x.requires_grad_(True)
    jsd(xk, y, labels, temperature=2.0).backward()
    jsd(xk, y, labels, reduction="none").sum().backward()
    assert torch.equal(x.detach(), x0) and torch.equal(y, y0) and torch.equal(labels, l0)


def test_bad_input(device):
    x, y, labels = make_inputs((4, 64), torch.float32, device)
    with pytest.raises(ValueError, match="target must have the input's shape"):
        jsd(x, y[:, :63])  # mismatched student / teacher vocabulary
    with pytest.raises(ValueError, match="target must have the input's shape"):
        jsd(x, y[:3])
    with pytest.raises(TypeError, match="input must have a floating dtype"):
        jsd(x.to(torch.int64), y)
    with pytest.raises(TypeError, match="target must have a floating dtype"):
        jsd(x, y.to(torch.int32))
    for beta in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match="beta"):
            jsd(x, y, beta=beta)
    with pytest.raises(TypeError, match="beta must be a number"):
        jsd(x, y, beta="0.5")
    for temperature in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="temperature"):
            jsd(x, y, temperature=temperature)
    with pytest.raises(TypeError, match="temperature must be a number"):
        jsd(x, y, temperature=torch.tensor(2.0))
    with pytest.raises(TypeError, match="from_logits must be a bool"):
        jsd(x, y, from_logits="yes")
    with pytest.raises(ValueError, match="reduction"):
        jsd(x, y, reduction="batchmean")
    with pytest.raises(ValueError, match="labels must have shape"):
        jsd(x, y, labels[:3])
    with pytest.raises(TypeError, match="labels must be an int32 or int64"):
        jsd(x, y, labels.float())
    with pytest.raises(TypeError, match="ignore_index"):
        jsd(x, y, labels, ignore_index=-100.0)
    with pytest.raises(ValueError, match="target is on meta"):
        jsd(x, torch.empty(4, 64, device="meta"))
    with pytest.raises(TypeError, match="input must be a torch.Tensor"):
        jsd(None, y)


@pytest.mark.parametrize("shape", [(0, 64), (2, 0, 64)], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
@pytest.mark.parametrize("with_labels", [False, True])
def test_empty_input(device, shape, reduction, with_labels):
    """No tokens: the reference's results (a sum of 0; a mean of 0 with labels, as when every token
    is ignored, and torch's NaN without), forward and backward."""
    x, y, labels = make_inputs(shape, torch.float32, device)
    labels = labels if with_labels else None
    for temperature in (1.0, 2.0):
        xk = leaf(x)
        loss = jsd(xk, y, labels, 0.5, IGNORE, temperature, reduction)
        ref, _ = reference(x, y, labels, 0.5, temperature, reduction)
        assert loss.shape == ref.shape
        torch.testing.assert_close(loss, ref.to(loss.dtype), equal_nan=True)
        loss.sum().backward()
        assert xk.grad.shape == x.shape


@pytest.mark.parametrize("reduction, temperature", [("mean", 1.0), ("none", 2.0), ("sum", 1.5)])
def test_op_contract(device, reduction, temperature):
    """Custom ops (opcheck), fullgraph compile equal to eager, no host synchronisation: the gradient
    from the forward kernel (mean, sum), and the backward kernel (none); one-pass and normalising."""
    x, y, labels = make_inputs((2, 3, 16), torch.float32, device, ignore_every=4)
    fn = lambda x, y, labels: jsd(x, y, labels, 0.3, IGNORE, temperature, reduction)  # noqa: E731
    expect = {"jsd_forward"} | ({"jsd_backward"} if reduction == "none" else set())
    assert_op_contract(fn, (x.requires_grad_(), y, labels), expect_ops=expect)


def test_fp16_mean_under_a_loss_scale(device):
    """fp16 under a GradScaler-style loss scale (2**15: fp16's loss holds it): the gradient carries
    the scale from the start, so it is as close to the exact one as fp16 can hold. Computed at unit
    scale in the forward pass (about 1 / (vocab x tokens) = 6e-11 here, below fp16's smallest
    subnormal) and rescaled afterwards, it was all zeros."""
    x, y, _ = make_inputs((512, 32768), torch.float16, device)
    xk = leaf(x)
    loss = jsd(xk, y, None, 0.5, IGNORE, 1.0, "mean", False)
    ref, x64 = reference(x, y, None, 0.5, 1.0, "mean")
    loss.backward(torch.tensor(32768.0, device=device, dtype=loss.dtype))
    ref.backward(torch.tensor(32768.0, device=device, dtype=torch.float64))
    assert_within_rounding(xk.grad, x64.grad, "dinput")
