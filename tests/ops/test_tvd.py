"""Total variation distance forward and backward against a float64 PyTorch reference with
liger-kernel's semantics (its test's ``TorchTVDLoss``, generalised to any leading shape)."""

from __future__ import annotations

import pytest
import torch

from onca.ops import tvd as op
from onca.ops.tvd import tvd
from tests.contract import assert_op_contract
from tests.helpers import SCALE, assert_close, leaf, non_contiguous, randn

IGNORE = -100
REDUCTIONS = ("none", "sum", "mean", "batchmean")
SHAPES = {
    "cpu": [(1, 1000), (2, 3, 1519), (37, 300), (1519,)],
    "gpu": [(1, 32000), (4096, 32000), (2, 512, 151936), (64, 262144)],
}[SCALE]
BASE_SHAPE = {"cpu": (9, 1519), "gpu": (2048, 151936)}[SCALE]
TILED_VOCAB = {"cpu": 1519, "gpu": 151936}[SCALE]


def make_inputs(shape, dtype, device):
    p = torch.softmax(randn(*shape, device=device) * 2, dim=-1).to(dtype)
    q = torch.softmax(randn(*shape, device=device) * 2, dim=-1).to(dtype)
    return p, q


def make_labels(shape, device, ignored=0.3):
    tokens = shape[:-1]
    labels = torch.randint(0, 50, tokens, device=device)
    return torch.where(torch.rand(tokens, device=device) < ignored, IGNORE, labels)


def reference(p, q, labels=None, reduction="batchmean", ignore_index=IGNORE):
    """float64: ``0.5 * |p - q|``, ignored tokens zeroed, divided as liger-kernel divides."""
    per = 0.5 * (p - q).abs()
    count = per[..., 0].numel()
    if labels is not None:
        keep = (labels.reshape(per.shape[:-1]) != ignore_index)[..., None]
        per = torch.where(keep, per, 0.0)
        count = max(int(keep.sum()), 1)
    if reduction == "none":
        return per
    if reduction == "sum":
        return per.sum()
    if reduction == "mean":
        return per.sum() / (count * per.shape[-1])
    return per.sum() / count


def check(p, q, labels=None, reduction="batchmean", target_grad=False, grad_scale=None, ignore_index=IGNORE):
    pk, qk = leaf(p), q.detach().clone().requires_grad_(target_grad)
    loss = tvd(pk, qk, labels, reduction, ignore_index)
    p64 = p.detach().to(torch.float64).requires_grad_(True)
    q64 = q.detach().to(torch.float64).requires_grad_(target_grad)
    ref = reference(p64, q64, labels, reduction, ignore_index)
    assert loss.dtype == torch.float32 and loss.shape == ref.shape
    assert_close(loss, ref, torch.float32 if p.dtype == torch.float32 else p.dtype, "loss")
    if reduction == "none":
        dy = randn(*ref.shape, device=p.device)
    else:
        dy = torch.tensor(1.0 if grad_scale is None else grad_scale, device=p.device)
    loss.backward(dy)
    ref.backward(dy.to(torch.float64))
    assert_close(pk.grad, p64.grad, p.dtype, "dinput")
    assert pk.grad.dtype == p.dtype
    if target_grad:
        assert_close(qk.grad, q64.grad, q.dtype, "dtarget")
    else:
        assert qk.grad is None


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("with_labels", [False, True])
def test_matches_reference(profile, device, reduction, with_labels):
    p, q = make_inputs(BASE_SHAPE, torch.float32, device)
    check(p, q, make_labels(BASE_SHAPE, device) if with_labels else None, reduction)


@pytest.mark.parametrize("reduction", ["none", "batchmean"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_low_precision(device, reduction, dtype):
    check(*make_inputs(BASE_SHAPE, dtype, device), make_labels(BASE_SHAPE, device), reduction)


def test_fp16_mean_under_a_loss_scale(device):
    """fp16 under a GradScaler-style loss scale, a mean over 2**24 elements: the unit-gradient values
    (0.5 / (tokens x vocab) = 2**-25) are below fp16's smallest subnormal, the scaled ones are not.
    A gradient computed in the forward pass and rescaled afterwards would be all zeros."""
    p, q = make_inputs((512, 32768), torch.float16, device)
    check(p, q, None, "mean", grad_scale=65536.0)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_shapes(profile, device, shape):
    """Any leading shape: ``batchmean`` counts tokens (rows), ``mean`` tokens x vocab."""
    check(*make_inputs(shape, torch.bfloat16, device), None, "mean")


@pytest.mark.parametrize("reduction", ["none", "sum"])
def test_target_gradient(device, reduction):
    p, q = make_inputs(BASE_SHAPE, torch.float32, device)
    check(p, q, make_labels(BASE_SHAPE, device), reduction, target_grad=True)


def test_column_tiled_path(profile, device, onchip_bytes):
    forced = onchip_bytes(4096 if SCALE == "cpu" else 32768)
    plans = op.plan((5, TILED_VOCAB), torch.bfloat16, forced)
    assert plans["forward"].col_tiles > 1 and plans["backward"].col_tiles > 1
    shape = (5, TILED_VOCAB)
    check(*make_inputs(shape, torch.bfloat16, device), make_labels(shape, device), "batchmean")
    check(*make_inputs(shape, torch.float32, device), make_labels(shape, device), "none", target_grad=True)


def test_ties_have_zero_gradient(device):
    """Where ``p == q`` the gradient is 0 (torch's ``abs`` subgradient; liger-kernel gives -0.5)."""
    p, q = make_inputs((4, 64), torch.float32, device)
    q[:, ::2] = p[:, ::2]
    check(p, q, None, "sum")
    pk = leaf(p)
    tvd(pk, q, reduction="sum").backward()
    assert (pk.grad[:, ::2] == 0).all() and (pk.grad[:, 1::2].abs() == 0.5).all()


@pytest.mark.parametrize("how", ["rows", "cols"])
def test_non_contiguous(device, how):
    p, q = make_inputs(BASE_SHAPE, torch.float32, device)
    check(non_contiguous(p, how), non_contiguous(q, "rows"), make_labels(BASE_SHAPE, device), "mean")


def test_labels_shapes_and_dtypes(device):
    """``shift_labels`` may be flat or shaped like the tokens, int64 or int32, and another
    ``ignore_index``."""
    shape = (2, 3, 100)
    p, q = make_inputs(shape, torch.float32, device)
    labels = make_labels(shape, device)
    check(p, q, labels, "batchmean")
    check(p, q, labels.reshape(-1).to(torch.int32), "batchmean")
    labels7 = torch.where(labels == IGNORE, 7, labels + 8)
    check(p, q, labels7, "mean", ignore_index=7)


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_every_token_ignored(device, reduction):
    """Nothing counted: a zero loss and a zero gradient (liger-kernel divides by zero here)."""
    p, q = make_inputs((4, 64), torch.float32, device)
    labels = torch.full((4,), IGNORE, device=device)
    pk = leaf(p)
    loss = tvd(pk, q, labels, reduction)
    assert (loss == 0).all()
    loss.sum().backward()
    assert (pk.grad == 0).all()


def test_scaled_and_repeated_backward(device):
    p, q = make_inputs(BASE_SHAPE, torch.float32, device)
    check(p, q, make_labels(BASE_SHAPE, device), "batchmean", grad_scale=-2.5)
    pk = leaf(p)
    loss = tvd(pk, q, reduction="sum")
    (g1,) = torch.autograd.grad(loss * 3.0, pk, retain_graph=True)
    (g2,) = torch.autograd.grad(loss, pk)
    assert_close(g1, 1.5 * torch.sign(p - q), torch.float32, "first")
    assert_close(g2, 0.5 * torch.sign(p - q), torch.float32, "second")


def test_no_grad_forward(device):
    p, q = make_inputs(BASE_SHAPE, torch.float32, device)
    with torch.no_grad():
        loss = tvd(leaf(p), q, reduction="batchmean")
    assert_close(loss, reference(p.double(), q.double()), torch.float32, "loss")



def test_does_not_modify_caller_tensors(device):
    p, q = make_inputs(BASE_SHAPE, torch.bfloat16, device)
    p0, q0 = p.clone(), q.clone()
    pk = p.requires_grad_(True)
    tvd(pk, q, reduction="none").sum().backward()
    tvd(pk, q, reduction="batchmean").backward()
    assert torch.equal(p.detach(), p0) and torch.equal(q, q0)


def test_bad_input(device):
    p, q = make_inputs((4, 64), torch.float32, device)
    with pytest.raises(ValueError, match="target must have the input's shape"):
        tvd(p, q[:, :32])
    with pytest.raises(TypeError, match="input must have a floating dtype"):
        tvd(torch.ones(4, 64, dtype=torch.int64, device=device), q)
    with pytest.raises(TypeError, match="target must have a floating dtype"):
        tvd(p, torch.ones(4, 64, dtype=torch.int64, device=device))
    with pytest.raises(ValueError, match="reduction"):
        tvd(p, q, reduction="elementwise_mean")
    with pytest.raises(ValueError, match="input must have at least one dimension"):
        tvd(torch.tensor(0.5, device=device), torch.tensor(0.5, device=device))
    with pytest.raises(ValueError, match="target is on meta"):
        tvd(p, torch.empty(4, 64, device="meta"))
    with pytest.raises(ValueError, match="shift_labels must have shape"):
        tvd(p, q, torch.zeros(5, dtype=torch.int64, device=device))
    with pytest.raises(TypeError, match="shift_labels must be an int32 or int64"):
        tvd(p, q, torch.zeros(4, device=device))
    with pytest.raises(TypeError, match="ignore_index must be an int"):
        tvd(p, q, ignore_index=None)


@pytest.mark.parametrize("shape", [(0, 64), (2, 0, 64)], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("with_labels", [False, True])
def test_empty_input(device, shape, reduction, with_labels):
    """No tokens: ``sum`` is 0; ``mean``/``batchmean`` 0 with labels and NaN without."""
    p, q = make_inputs(shape, torch.float32, device)
    labels = torch.empty(shape[:-1], dtype=torch.int64, device=device) if with_labels else None
    pk = leaf(p)
    loss = tvd(pk, q, labels, reduction)
    if reduction == "none":
        assert loss.shape == p.shape
    elif reduction == "sum" or with_labels:
        assert loss.item() == 0.0
    else:
        assert torch.isnan(loss)
    loss.sum().backward()
    assert pk.grad.shape == p.shape


@pytest.mark.parametrize("reduction, target_grad", [("batchmean", False), ("none", True), ("mean", True)])
def test_op_contract(device, reduction, target_grad):
    """Custom ops (opcheck), fullgraph compile equal to eager, no host synchronisation: the input
    gradient from the forward kernel (scalar reductions), and the backward kernel (none)."""
    p, q = make_inputs((2, 3, 16), torch.float32, device)
    labels = torch.tensor([[0, IGNORE, 3], [1, 2, IGNORE]], device=device)
    p, q = p.requires_grad_(), q.requires_grad_(target_grad)
    fn = lambda p, q, labels: tvd(p, q, labels, reduction)  # noqa: E731
    expect = {"tvd_forward"} | ({"tvd_backward"} if reduction == "none" else set())
    assert_op_contract(fn, (p, q, labels), expect_ops=expect)
