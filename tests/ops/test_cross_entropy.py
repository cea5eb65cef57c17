"""Cross entropy forward and backward against a float64 PyTorch reference (torch's own cross entropy,
plus the z-loss and soft-capping terms written out)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from onca import device as onca_device
from onca.ops import cross_entropy as op
from onca.ops.cross_entropy import cross_entropy
from tests.contract import assert_op_contract
from tests.helpers import SCALE, assert_close, leaf, non_contiguous, randn, zero_fills_during

IGNORE = -100

# Vocabularies of real models (32000, 151936, 262144) scaled down on the CPU: non-powers of two.
VOCABS = {"cpu": [1000, 1519, 2621], "gpu": [32000, 128256, 151936, 262144]}[SCALE]
TOKENS = {"cpu": 37, "gpu": 4096}[SCALE]
VOCAB = {"cpu": 1000, "gpu": 128256}[SCALE]
WIDE_ROWS = {"cpu": 3, "gpu": 1024}[SCALE]

OPTIONS = {
    "smoothing": dict(label_smoothing=0.1),
    "z_loss": dict(lse_square_scale=1e-3),
    "softcap": dict(softcap=5.0),
    "all": dict(label_smoothing=0.2, lse_square_scale=1e-2, softcap=3.0),
}


def reference_terms(z64, target, ignore_index=IGNORE, label_smoothing=0.0, lse_square_scale=0.0, softcap=None):
    """Per-token float64 loss and z-loss of logits ``z64`` ``(N, V)`` (already float64)."""
    if softcap is not None:
        z64 = softcap * torch.tanh(z64 / softcap)
    per = F.cross_entropy(z64, target.long(), ignore_index=ignore_index, reduction="none",
                          label_smoothing=label_smoothing)
    valid = (target != ignore_index).to(torch.float64)
    z = lse_square_scale * torch.logsumexp(z64, dim=-1) ** 2 * valid
    return per + z, z, valid


def reduce_reference(per, valid, reduction):
    if reduction == "none":
        return per
    if reduction == "sum":
        return per.sum()
    return per.sum() / valid.sum()  # NaN when every token is ignored, as torch


def make_target(n, vocab, device, ignore_every=4):
    t = torch.randint(0, vocab, (n,), device=device)
    if ignore_every:
        t[::ignore_every] = IGNORE
    return t


def make_logits(shape, dtype, device, std=2.0):
    return randn(*shape, dtype=dtype, device=device, std=std)


def check(logits, target, reduction="mean", in_place=False, grad_scale=None, **options):
    """Our loss and gradient against the float64 reference, for logits of any leading shape."""
    dtype, vocab = logits.dtype, logits.shape[-1]
    base = leaf(logits)
    # A non-leaf activation, as in a model: in-place mode may overwrite it.
    x = base.clone() if in_place else base
    loss = cross_entropy(x, target, reduction=reduction, overwrite_logits=in_place, **options)
    x64 = logits.detach().to(torch.float64).requires_grad_(True)
    per, _, valid = reference_terms(x64.reshape(-1, vocab), target.reshape(-1), **options)
    ref = reduce_reference(per, valid, reduction)
    if reduction == "none":
        ref = ref.view(target.shape)
    assert loss.dtype == torch.float32 and loss.shape == ref.shape  # fp32 whatever the logits' dtype
    assert_close(loss, ref, dtype, "loss")
    if grad_scale is None:
        dy = randn(*ref.shape, dtype=torch.float32, device=logits.device) if ref.dim() else torch.tensor(0.75)
    else:
        dy = torch.tensor(float(grad_scale))
    dy = dy.to(logits.device)
    loss.backward(dy.to(dtype))
    ref.backward(dy.to(dtype).to(torch.float64))
    assert_close(base.grad, x64.grad, dtype, "dlogits")
    return loss


@pytest.mark.parametrize("in_place", [False, True], ids=["saved", "in_place"])
@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_reductions(profile, device, dtype, reduction, in_place):
    logits = make_logits((TOKENS, VOCAB), dtype, device)
    check(logits, make_target(TOKENS, VOCAB, device), reduction, in_place)


@pytest.mark.parametrize("name", sorted(OPTIONS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_options(device, name, dtype):
    logits = make_logits((TOKENS, VOCAB), dtype, device)
    target = make_target(TOKENS, VOCAB, device)
    check(logits, target, "mean", False, **OPTIONS[name])
    check(logits, target, "none", True, **OPTIONS[name])


def test_fp16(device):
    logits = make_logits((TOKENS, VOCAB), torch.float16, device)
    check(logits, make_target(TOKENS, VOCAB, device), "mean", True, **OPTIONS["all"])


@pytest.mark.parametrize("vocab", VOCABS)
def test_vocab_sizes(profile, device, vocab):
    logits = make_logits((TOKENS, vocab), torch.bfloat16, device)
    check(logits, make_target(TOKENS, vocab, device), "mean", True, label_smoothing=0.05)


@pytest.mark.parametrize("in_place", [False, True], ids=["saved", "in_place"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_column_tiled_path(profile, device, onchip_bytes, dtype, in_place):
    # A 16 KiB budget cannot hold a row of 1519 logits: the kernel runs the online log-sum-exp
    # over column tiles, then a second pass for the gradient.
    forced = onchip_bytes(16384)
    vocab, rows = VOCABS[1], {"cpu": 9, "gpu": TOKENS}[SCALE]
    assert op.plan((rows, vocab), dtype, forced)["forward"].col_tiles > 1
    logits = make_logits((rows, vocab), dtype, device)
    check(logits, make_target(rows, vocab, device), "mean", in_place, **OPTIONS["all"])
    check(logits, make_target(rows, vocab, device, ignore_every=0), "none", in_place)


@pytest.mark.parametrize("name", sorted(onca_device.PROFILES))
def test_vocab_262144_on_every_profile(monkeypatch, device, name):
    """Gemma 3's vocabulary (262144) plans and runs under every built-in profile (Ascend's UB too)."""
    monkeypatch.setenv("ONCA_DEVICE_PROFILE", name)
    onca_device.reset()
    try:
        vocab = 262144
        p = op.plan((WIDE_ROWS, vocab), torch.bfloat16)["forward"]
        assert p.tile_bytes <= p.onchip_bytes
        logits = make_logits((WIDE_ROWS, vocab), torch.bfloat16, device)
        # First, last and ignored classes, whatever WIDE_ROWS is (1024 at GPU scale: not a multiple of 3).
        target = torch.tensor([5, vocab - 1, IGNORE], device=device).repeat(WIDE_ROWS // 3 + 1)[:WIDE_ROWS]
        check(logits, target, "mean", True, softcap=30.0)
    finally:
        onca_device.reset()


@pytest.mark.parametrize("in_place", [False, True], ids=["saved", "in_place"])
def test_every_token_ignored_as_torch(device, in_place):
    """As torch: the mean is 0/0 = NaN, the sum 0, per token 0; every gradient is zero."""
    logits = make_logits((5, VOCAB), torch.float32, device)
    target = torch.full((5,), IGNORE, device=device)
    for reduction in ("mean", "sum", "none"):
        base = leaf(logits)
        x = base.clone() if in_place else base
        loss, z = cross_entropy(x, target, reduction=reduction, overwrite_logits=in_place,
                                lse_square_scale=1e-3, return_z_loss=True)
        expected = F.cross_entropy(logits, target, reduction=reduction)
        torch.testing.assert_close(loss, expected, equal_nan=True)
        torch.testing.assert_close(z, torch.zeros_like(z) if reduction != "mean" else expected, equal_nan=True)
        loss.sum().backward()
        assert torch.equal(base.grad, torch.zeros_like(logits))


@pytest.mark.parametrize("in_place", [False, True], ids=["saved", "in_place"])
@pytest.mark.parametrize("shape", [(0, 16), (2, 0, 16)])
def test_empty_input_as_torch(device, shape, in_place):
    """No tokens: the results and (empty) gradients torch gives; the mean is NaN, the sum 0."""
    logits = make_logits(shape, torch.float32, device)
    target = torch.zeros(shape[:-1], dtype=torch.int64, device=device)
    for reduction in ("mean", "sum", "none"):
        base, ref_x = leaf(logits), leaf(logits)
        x = base.clone() if in_place else base
        loss = cross_entropy(x, target, reduction=reduction, overwrite_logits=in_place)
        expected = F.cross_entropy(ref_x.reshape(-1, shape[-1]), target.reshape(-1), reduction=reduction)
        if reduction == "none":
            expected = expected.view(shape[:-1])
        assert loss.shape == expected.shape
        torch.testing.assert_close(loss, expected, equal_nan=True)
        loss.sum().backward()
        expected.sum().backward()
        assert torch.equal(base.grad, ref_x.grad)


def test_out_of_range_target_is_nan_not_a_bad_read(device):
    """A non-ignored target outside [0, vocab) is never used as an offset: its loss and gradient
    are NaN (so the loss shows it), the other tokens are unaffected."""
    logits = make_logits((4, 10), torch.float32, device)
    target = torch.tensor([1, 10, -1, IGNORE], device=device)
    for in_place in (False, True):
        base = leaf(logits)
        x = base.clone() if in_place else base
        loss = cross_entropy(x, target, reduction="none", overwrite_logits=in_place)
        assert torch.isnan(loss[1:3]).all() and torch.isfinite(loss[[0, 3]]).all()
        assert torch.isnan(cross_entropy(logits, target))
        loss.sum().backward()
        assert torch.isnan(base.grad[1:3]).all() and torch.isfinite(base.grad[[0, 3]]).all()


@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
def test_one_token(device, reduction):
    logits = make_logits((1, VOCAB), torch.bfloat16, device)
    check(logits, torch.tensor([VOCAB - 1], device=device), reduction, True, **OPTIONS["all"])
    check(logits, torch.tensor([0], device=device), reduction, False)


def test_3d_and_non_contiguous(device):
    logits = make_logits((2, 7, VOCAB), torch.bfloat16, device)
    target = make_target(14, VOCAB, device).view(2, 7)
    check(logits, target, "none")
    for how in ("rows", "cols"):
        check(non_contiguous(logits, how), target, "mean", **OPTIONS["all"])
        check(non_contiguous(logits, how), target, "sum", True)


@pytest.mark.parametrize("in_place", [False, True], ids=["saved", "in_place"])
def test_strided_targets(device, in_place):
    """Targets the kernels cannot read at unit stride: a strided 1-D run (``labels[::2]``) and a
    2-D view whose rows flatten into one strided run (``wide[:, ::2]``: no copy made by reshape)."""
    logits = make_logits((2, 9, VOCAB), torch.float32, device)
    wide = make_target(36, VOCAB, device, ignore_every=3)
    check(logits.reshape(18, VOCAB), wide[::2], "none", in_place)
    check(logits, wide.view(2, 18)[:, ::2], "mean", in_place, lse_square_scale=1e-2)


def test_int32_target(device):
    logits = make_logits((TOKENS, VOCAB), torch.float32, device)
    check(logits, make_target(TOKENS, VOCAB, device).to(torch.int32), "mean")


def test_custom_ignore_index(device):
    logits = make_logits((TOKENS, VOCAB), torch.float32, device)
    target = make_target(TOKENS, VOCAB, device, ignore_every=0)
    target[::3] = 7  # a real class used as the ignore index
    per, _, valid = reference_terms(logits.double(), target, ignore_index=7)
    loss = cross_entropy(logits, target, ignore_index=7)
    assert_close(loss, reduce_reference(per, valid, "mean"), torch.float32, "loss")


@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
def test_return_z_loss(device, reduction):
    logits = make_logits((TOKENS, VOCAB), torch.float32, device)
    target = make_target(TOKENS, VOCAB, device)
    x = leaf(logits)
    loss, z = cross_entropy(x, target, reduction=reduction, lse_square_scale=1e-2, return_z_loss=True)
    per, z_ref, valid = reference_terms(logits.double(), target, lse_square_scale=1e-2)
    assert_close(loss, reduce_reference(per, valid, reduction), torch.float32, "loss")
    assert_close(z, reduce_reference(z_ref, valid, reduction), torch.float32, "z_loss")
    assert not z.requires_grad  # for logging: the z-loss is already part of the loss


@pytest.mark.parametrize("scale", [1.0, 2.5])
def test_incoming_gradient(device, scale):
    """A scalar incoming gradient (HF's loss / num_items_in_batch): skipped when 1, applied otherwise."""
    logits = make_logits((TOKENS, VOCAB), torch.bfloat16, device)
    target = make_target(TOKENS, VOCAB, device)
    for in_place in (False, True):
        check(logits, target, "sum", in_place, grad_scale=scale)


def test_overwrite_logits_writes_the_gradient_over_the_logits(device):
    logits = make_logits((TOKENS, VOCAB), torch.bfloat16, device)
    target = make_target(TOKENS, VOCAB, device)
    base = leaf(logits)
    x = base.clone()
    version = x._version
    loss = cross_entropy(x, target, overwrite_logits=True)
    assert x._version > version, "the overwritten logits must look modified to autograd"
    grad, = torch.autograd.grad(loss, x)
    assert grad.data_ptr() == x.data_ptr(), "the gradient must live in the logits' storage"
    fresh = leaf(logits)
    expected, = torch.autograd.grad(cross_entropy(fresh, target), fresh)
    assert_close(grad, expected, torch.bfloat16, "dlogits")


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_overwrite_logits_twice(device, reduction):
    """retain_graph=True: the gradient kept in the logits is handed over again, rescaled."""
    logits = make_logits((TOKENS, VOCAB), torch.float32, device)
    target = make_target(TOKENS, VOCAB, device)
    ref = leaf(logits)
    (cross_entropy(ref, target, reduction=reduction) * 1.0).sum().backward()
    base = leaf(logits)
    loss = cross_entropy(base.clone(), target, reduction=reduction, overwrite_logits=True)
    g = torch.ones_like(loss)
    for _ in range(2):
        base.grad = None
        loss.backward(g, retain_graph=True)
        assert_close(base.grad, ref.grad, torch.float32, "dlogits")
    if reduction == "mean":
        base.grad = None
        loss.backward(torch.tensor(3.0), retain_graph=True)
        assert_close(base.grad, 3 * ref.grad, torch.float32, "dlogits x3")
    else:
        per_token = torch.rand_like(loss) + 0.5
        base.grad = None
        loss.backward(per_token, retain_graph=True)
        assert_close(base.grad, per_token[:, None] * ref.grad, torch.float32, "dlogits per token")
        base.grad = None
        loss.sum().backward(retain_graph=True)  # an expanded (stride 0) per-token gradient
        assert_close(base.grad, ref.grad, torch.float32, "dlogits x1")


def test_overwrite_logits_catches_saved_logits(device):
    """Logits that another op saved for its backward cannot be overwritten silently."""
    base = leaf(make_logits((TOKENS, VOCAB), torch.float32, device))
    x = torch.tanh(base)  # tanh saves its output for backward
    loss = cross_entropy(x, make_target(TOKENS, VOCAB, device), overwrite_logits=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_does_not_modify_caller_tensors(device):
    logits = make_logits((TOKENS, VOCAB), torch.bfloat16, device)
    target = make_target(TOKENS, VOCAB, device)
    l0, t0 = logits.clone(), target.clone()
    x = leaf(logits)
    cross_entropy(x, target, **OPTIONS["all"]).backward()
    assert torch.equal(x.detach(), l0) and torch.equal(target, t0)
    # overwrite_logits writes nothing when no gradient is wanted
    cross_entropy(logits, target, overwrite_logits=True)
    assert torch.equal(logits, l0)
    wants_grad = logits.clone().requires_grad_(True)
    with torch.no_grad():
        cross_entropy(wants_grad, target, overwrite_logits=True)
    assert torch.equal(wants_grad.detach(), l0)


def test_deterministic(device):
    logits = make_logits((TOKENS, VOCAB), torch.bfloat16, device)
    target = make_target(TOKENS, VOCAB, device)
    grads = []
    for _ in range(2):
        x = leaf(logits)
        cross_entropy(x, target, **OPTIONS["all"]).backward()
        grads.append(x.grad)
    assert torch.equal(grads[0], grads[1])


@pytest.mark.parametrize("in_place", [False, True], ids=["saved", "in_place"])
def test_backward_fills_no_zeros_for_outputs_taking_no_gradient(device, in_place):
    """lse, z_loss and the gradient buffer are outputs that take no gradient: autograd must not
    fill a zero tensor for each in backward (a fill launch per output; the gradient buffer is
    logits-sized on the traced route)."""
    base = leaf(make_logits((16, VOCAB), torch.float32, device))
    x = base.clone() if in_place else base
    target = torch.randint(0, VOCAB, (16,), device=device)
    loss = cross_entropy(x, target, overwrite_logits=in_place)
    assert zero_fills_during(loss.backward, 16 * 4) == []


def test_bad_input(device):
    x = randn(4, 10, device=device)
    t = torch.tensor([1, 2, 3, IGNORE], device=device)
    with pytest.raises(TypeError, match="target must be an int32 or int64 tensor"):
        cross_entropy(x, t.to(torch.float32))
    with pytest.raises(TypeError, match="target must be an int32 or int64"):
        cross_entropy(x, t.to(torch.int16))
    with pytest.raises(ValueError, match=r"target must have shape \(4,\)"):
        cross_entropy(x, t[:3])
    with pytest.raises(ValueError, match=r"target must have shape \(4,\)"):
        cross_entropy(x, t.view(2, 2))
    with pytest.raises(ValueError, match="logits must be"):
        cross_entropy(randn(10, device=device), torch.tensor(1, device=device))
    with pytest.raises(TypeError, match="logits must have a floating dtype"):
        cross_entropy(torch.ones(4, 10, dtype=torch.int64, device=device), t)
    with pytest.raises(ValueError, match="logits must be"):
        cross_entropy(randn(4, 0, device=device), t)
    with pytest.raises(ValueError, match="target is on meta"):
        cross_entropy(x, torch.empty(4, dtype=torch.int64, device="meta"))
    with pytest.raises(TypeError, match="target must be a torch.Tensor"):
        cross_entropy(x, [1, 2, 3, 4])
    with pytest.raises(ValueError, match="reduction"):
        cross_entropy(x, t, reduction="batchmean")
    with pytest.raises(ValueError, match="label_smoothing"):
        cross_entropy(x, t, label_smoothing=1.5)
    with pytest.raises(ValueError, match="lse_square_scale"):
        cross_entropy(x, t, lse_square_scale=-1.0)
    with pytest.raises(ValueError, match="softcap"):
        cross_entropy(x, t, softcap=0.0)
    with pytest.raises(TypeError, match="ignore_index"):
        cross_entropy(x, t, ignore_index=-100.0)
    with pytest.raises(TypeError, match="label_smoothing must be a number"):
        cross_entropy(x, t, label_smoothing="0.1")
    with pytest.raises(ValueError, match="lse_square_scale"):
        cross_entropy(x, t, lse_square_scale=float("nan"))
    with pytest.raises(TypeError, match="softcap must be a number"):
        cross_entropy(x, t, softcap=torch.tensor(30.0))
    with pytest.raises(TypeError, match="overwrite_logits must be a bool"):
        cross_entropy(x, t, overwrite_logits=1)
    with pytest.raises(TypeError, match="return_z_loss must be a bool"):
        cross_entropy(x, t, return_z_loss="yes")


@pytest.mark.parametrize("reduction,overwrite", [("mean", False), ("mean", True), ("none", True)])
def test_op_contract(device, reduction, overwrite):
    """Custom ops (opcheck), fullgraph compile equal to eager, no host synchronisation."""
    logits = make_logits((2, 3, 40), torch.bfloat16, device).requires_grad_()
    target = make_target(6, 40, device).view(2, 3)

    def fn(logits, target):
        # A temporary activation, as in a model: overwrite_logits may write over it.
        return cross_entropy(logits * 1, target, reduction=reduction, lse_square_scale=1e-3,
                             label_smoothing=0.1, overwrite_logits=overwrite)

    backward = "scale_forward_gradient" if overwrite else "cross_entropy_backward"
    assert_op_contract(fn, (logits, target), expect_ops={"cross_entropy_forward", backward})


# ------------------------------------------------------------- class weights, token metrics (issue 20)


def loss_reference(z64, target, reduction, weight=None, ignore_index=IGNORE, label_smoothing=0.0,
                   lse_square_scale=0.0, softcap=None, token_scaling=False):
    """float64 loss of logits ``z64`` ``(N, V)``: torch's cross entropy (class weights, its weighted
    mean) plus the z-loss (never class-weighted; a mean over the non-ignored count, as liger-kernel);
    with ``token_scaling`` each token's terms times its detached probability of the target."""
    if softcap is not None:
        z64 = softcap * torch.tanh(z64 / softcap)
    t = target.long()
    w64 = weight.to(torch.float64) if weight is not None else None
    valid = t != ignore_index
    z = lse_square_scale * torch.logsumexp(z64, dim=-1) ** 2 * valid
    ce_options = {"weight": w64, "ignore_index": ignore_index, "label_smoothing": label_smoothing}
    if not token_scaling:  # torch itself reduces the cross-entropy part: its weighted mean
        ce = F.cross_entropy(z64, t, reduction=reduction, **ce_options)
        return ce + reduce_reference(z, valid.to(torch.float64), reduction)
    safe = torch.where(valid, t, 0)
    p_target = torch.softmax(z64.detach(), dim=-1).gather(1, safe[:, None])[:, 0] * valid
    ce = F.cross_entropy(z64, t, reduction="none", **ce_options) * p_target
    z = z * p_target
    if reduction == "none":
        return ce + z
    if reduction == "sum":
        return ce.sum() + z.sum()
    denominator = valid.sum() if w64 is None else (w64[safe] * valid).sum()
    return ce.sum() / denominator + z.sum() / valid.sum()


def class_weights(vocab, device, dtype=torch.float32):
    """Positive weights spread over a decade, so that a wrong class's weight shows."""
    return (torch.rand(vocab, device=device) * 1.9 + 0.1).to(dtype)


def check_weighted(logits, target, weight, reduction="mean", in_place=False, **options):
    """Loss and gradient with class weights against torch's float64 cross entropy with them."""
    dtype, vocab = logits.dtype, logits.shape[-1]
    base = leaf(logits)
    x = base.clone() if in_place else base
    loss = cross_entropy(x, target, reduction=reduction, overwrite_logits=in_place, weight=weight, **options)
    x64 = logits.detach().to(torch.float64).requires_grad_(True)
    ref = loss_reference(x64.reshape(-1, vocab), target.reshape(-1), reduction, weight, **options)
    ref = ref.view(target.shape) if reduction == "none" else ref
    assert loss.dtype == torch.float32 and loss.shape == ref.shape
    assert_close(loss, ref, dtype, "loss")
    dy = randn(*ref.shape, device=logits.device) if ref.dim() else torch.tensor(0.75, device=logits.device)
    loss.backward(dy.to(dtype))
    ref.backward(dy.to(dtype).to(torch.float64))
    assert_close(base.grad, x64.grad, dtype, "dlogits")


@pytest.mark.parametrize("in_place", [False, True], ids=["saved", "in_place"])
@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_class_weights(profile, device, dtype, reduction, in_place):
    logits = make_logits((TOKENS, VOCAB), dtype, device)
    target = make_target(TOKENS, VOCAB, device)
    weight = class_weights(VOCAB, device)
    check_weighted(logits, target, weight, reduction, in_place)
    # torch weighs the smoothing term by every class's weight too
    check_weighted(logits, target, weight, reduction, in_place, label_smoothing=0.1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_class_weights_with_every_option(device, dtype):
    logits = make_logits((TOKENS, VOCAB), dtype, device)
    target = make_target(TOKENS, VOCAB, device)
    weight = class_weights(VOCAB, device, torch.bfloat16)  # any float dtype, read in fp32
    check_weighted(logits, target, weight, "mean", False, **OPTIONS["all"])
    check_weighted(logits, target, weight, "none", True, **OPTIONS["all"])


def test_tiles_follow_the_options(device, monkeypatch):
    """Plain rows take the GPU planner's half-budget two-pass tile, the token metrics and class
    weights the whole budget (measured per option: see ``TILES``), and each launch plans with the
    declaration of the options it carries."""
    h100 = onca_device.PROFILES["h100"]
    plans = op.plan((8192, 128256), torch.bfloat16, h100)
    assert (plans["forward"].block_cols, plans["forward"].num_warps) == (8192, 16)
    assert (plans["options"].block_cols, plans["options"].num_warps) == (16384, 32)
    assert plans["weighted_smoothing"].col_tiles > 1 and plans["weighted_smoothing"].num_warps == 32
    launched = []
    real = op.plan_rows
    monkeypatch.setattr(op, "plan_rows", lambda *a, **k: launched.append(k) or real(*a, **k))
    logits = make_logits((5, VOCAB), torch.float32, device)
    target = torch.randint(0, VOCAB, (5,), device=device)
    weight = class_weights(VOCAB, device, torch.float32)
    calls = {"plain": {}, "metrics": dict(return_token_accuracy=True), "weights": dict(weight=weight),
             "weights and smoothing": dict(weight=weight, label_smoothing=0.1)}
    for options in calls.values():
        out = cross_entropy(leaf(logits), target, **options)
        (out if isinstance(out, torch.Tensor) else out.loss).backward()
    # forward and backward each: the forward, a log-sum-exp pass alone, in the streaming tile; the
    # metrics' backward carries no argmax, so plain rows' tile
    assert plans["lse_only"].num_warps == 1 and plans["lse_only"].block_cols == 2048
    streaming = lambda tiles: dict(tiles, gpu_streaming=True)  # noqa: E731
    assert launched == [streaming(op.TILES), op.TILES, streaming(op.OPTION_TILES), op.TILES,
                        streaming(op.OPTION_TILES), op.OPTION_TILES,
                        streaming(op.WEIGHTED_SMOOTHING_TILES), op.WEIGHTED_SMOOTHING_TILES]


@pytest.mark.parametrize("in_place", [False, True], ids=["saved", "in_place"])
def test_class_weights_column_tiled(profile, device, onchip_bytes, in_place):
    forced = onchip_bytes(16384)
    vocab, rows = VOCABS[1], {"cpu": 9, "gpu": TOKENS}[SCALE]
    assert op.plan((rows, vocab), torch.bfloat16, forced)["weighted_smoothing"].col_tiles > 1
    logits = make_logits((rows, vocab), torch.bfloat16, device)
    weight = class_weights(vocab, device)
    check_weighted(logits, make_target(rows, vocab, device), weight, "mean", in_place, **OPTIONS["all"])
    check_weighted(logits, make_target(rows, vocab, device, ignore_every=0), weight, "none", in_place)


def test_class_weights_every_token_ignored_and_empty(device):
    """As torch: the weighted mean over no target is 0/0 = NaN, the sum 0; gradients zero."""
    weight = class_weights(VOCAB, device)
    for n in (5, 0):
        logits = make_logits((n, VOCAB), torch.float32, device)
        target = torch.full((n,), IGNORE, device=device)
        for reduction in ("mean", "sum", "none"):
            for in_place in (False, True):
                base, ref_x = leaf(logits), leaf(logits)
                x = base.clone() if in_place else base
                loss = cross_entropy(x, target, reduction=reduction, weight=weight, overwrite_logits=in_place)
                expected = F.cross_entropy(ref_x, target, weight=weight, reduction=reduction)
                torch.testing.assert_close(loss, expected, equal_nan=True)
                loss.sum().backward()
                expected.sum().backward()
                assert torch.equal(base.grad, ref_x.grad)


def targets_half_predicted(logits, ignore_every=4):
    """Targets of which about half are each token's argmax (so that the accuracy is neither 0 nor 1)
    and every ``ignore_every``-th ignored."""
    n, vocab = logits.shape
    target = torch.randint(0, vocab, (n,), device=logits.device)
    target[::2] = logits[::2].float().argmax(dim=-1)
    target[::ignore_every] = IGNORE
    return target


def expected_metrics(logits64, target, reduction, ignore_index=IGNORE):
    """liger-kernel's metrics from torch: argmax per token (-1 where ignored) and the accuracy (per
    token, or the fraction of non-ignored tokens)."""
    valid = target != ignore_index
    predicted = torch.where(valid, logits64.argmax(dim=-1), -1)
    correct = ((predicted == target) & valid).to(torch.float32)
    return predicted, correct if reduction == "none" else correct.sum() / valid.sum()


@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_token_accuracy_and_predicted_tokens(profile, device, dtype, reduction):
    logits = make_logits((TOKENS, VOCAB), dtype, device)
    target = targets_half_predicted(logits)
    x = leaf(logits)
    out = cross_entropy(x, target, reduction=reduction, return_token_accuracy=True,
                        return_predicted_tokens=True)
    assert isinstance(out, op.CrossEntropyOutput) and out.z_loss is None
    predicted, accuracy = expected_metrics(logits.double(), target, reduction)
    assert out.predicted_tokens.dtype == torch.int64 and torch.equal(out.predicted_tokens, predicted)
    assert out.token_accuracy.dtype == torch.float32
    torch.testing.assert_close(out.token_accuracy, accuracy, rtol=0, atol=1e-6)
    assert 0 < accuracy.sum() and not out.token_accuracy.requires_grad
    # The loss is the one without the metrics, to the rounding of the wider column tile a launch
    # carrying them takes on a GPU (OPTION_TILES: another fp32 summation order).
    loss = cross_entropy(leaf(logits), target, reduction=reduction)
    torch.testing.assert_close(out.loss, loss)
    out.loss.sum().backward()
    assert torch.isfinite(x.grad).all()


@pytest.mark.parametrize("in_place", [False, True], ids=["saved", "in_place"])
def test_metrics_column_tiled_soft_capped_3d(device, onchip_bytes, in_place):
    """The argmax across column tiles (the first maximal class, also when a later tile ties it),
    of the soft-capped logits, for (B, S, V) logits: outputs shaped like the target."""
    forced = onchip_bytes(16384)
    vocab = VOCABS[1]
    assert op.plan((10, vocab), torch.float32, forced)["forward"].col_tiles > 1
    logits = make_logits((2, 5, vocab), torch.float32, device)
    target = targets_half_predicted(logits.view(10, vocab)).view(2, 5)
    logits[0, 1, vocab - 3] = logits[0, 1, 7] = logits[0, 1].max() + 1.0  # a tie across tiles
    base = leaf(logits)
    x = base.clone() if in_place else base
    out = cross_entropy(x, target, reduction="none", softcap=30.0, overwrite_logits=in_place,
                        return_token_accuracy=True, return_predicted_tokens=True, return_z_loss=True)
    capped = 30.0 * torch.tanh(logits.double() / 30.0)
    predicted, accuracy = expected_metrics(capped.view(10, vocab), target.view(10), "none")
    assert out.predicted_tokens.shape == target.shape and out.token_accuracy.shape == target.shape
    assert out.predicted_tokens[0, 1] == 7
    assert torch.equal(out.predicted_tokens.view(10), predicted)
    assert torch.equal(out.token_accuracy.view(10), accuracy)
    assert out.z_loss.shape == target.shape


def test_metrics_every_token_ignored_and_empty(device):
    """Nothing to predict: predicted tokens -1 (none for no tokens), accuracy 0 per token and NaN
    as a fraction (0/0), as liger-kernel."""
    for n in (5, 0):
        logits = make_logits((n, VOCAB), torch.float32, device)
        target = torch.full((n,), IGNORE, device=device)
        for reduction in ("mean", "sum", "none"):
            out = cross_entropy(logits, target, reduction=reduction, return_token_accuracy=True,
                                return_predicted_tokens=True)
            assert torch.equal(out.predicted_tokens, torch.full((n,), -1, device=device))
            expected = torch.zeros(n) if reduction == "none" else torch.tensor(float("nan"))
            torch.testing.assert_close(out.token_accuracy.cpu(), expected, equal_nan=True)


def test_return_values(device):
    """The loss alone; (loss, z_loss) for return_z_loss alone; else a CrossEntropyOutput with None
    where a field was not asked for."""
    logits = make_logits((6, 50), torch.float32, device)
    target = make_target(6, 50, device)
    loss = cross_entropy(logits, target)
    assert isinstance(loss, torch.Tensor)
    pair = cross_entropy(logits, target, return_z_loss=True)
    assert type(pair) is tuple and len(pair) == 2
    out = cross_entropy(logits, target, return_predicted_tokens=True)
    assert out.z_loss is None and out.token_accuracy is None and out.predicted_tokens is not None
    out = cross_entropy(logits, target, return_token_accuracy=True, return_z_loss=True)
    assert out.z_loss is not None and out.token_accuracy is not None and out.predicted_tokens is None
    loss, z_loss, _, _ = out
    assert torch.equal(loss, pair[0]) and torch.equal(z_loss, pair[1])


def test_bad_class_weights_and_switches(device):
    x = randn(4, 10, device=device)
    t = torch.tensor([1, 2, 3, IGNORE], device=device)
    with pytest.raises(ValueError, match=r"weight must have shape \(10,\)"):
        cross_entropy(x, t, weight=torch.ones(9, device=device))
    with pytest.raises(TypeError, match="weight must have a floating dtype"):
        cross_entropy(x, t, weight=torch.ones(10, dtype=torch.int64, device=device))
    with pytest.raises(TypeError, match="weight must be a torch.Tensor"):
        cross_entropy(x, t, weight=[1.0] * 10)
    with pytest.raises(ValueError, match="weight is on meta"):
        cross_entropy(x, t, weight=torch.ones(10, device="meta"))
    with pytest.raises(ValueError, match="weight takes no gradient"):
        cross_entropy(x, t, weight=torch.ones(10, device=device, requires_grad=True))
    with pytest.raises(TypeError, match="return_token_accuracy must be a bool"):
        cross_entropy(x, t, return_token_accuracy=1)
    with pytest.raises(TypeError, match="return_predicted_tokens must be a bool"):
        cross_entropy(x, t, return_predicted_tokens="yes")


@pytest.mark.parametrize("reduction,overwrite", [("mean", False), ("mean", True), ("none", False)])
def test_op_contract_with_class_weights_and_metrics(device, reduction, overwrite):
    logits = make_logits((2, 3, 40), torch.bfloat16, device).requires_grad_()
    target = make_target(6, 40, device).view(2, 3)
    weight = class_weights(40, device)

    def fn(logits, target, weight):
        return cross_entropy(logits * 1, target, reduction=reduction, lse_square_scale=1e-3,
                             label_smoothing=0.1, overwrite_logits=overwrite, weight=weight,
                             return_z_loss=True, return_token_accuracy=True, return_predicted_tokens=True)

    backward = "scale_forward_gradient" if overwrite else "cross_entropy_backward"
    assert_op_contract(fn, (logits, target, weight), expect_ops={"cross_entropy_forward", backward})


def test_second_backward_leaves_the_first_result_alone(device):
    """retain_graph=True: a second backward hands over new tensors; the first one's result (which
    autograd.grad returns without a copy) keeps its values."""
    logits = make_logits((TOKENS, VOCAB), torch.float32, device)
    target = make_target(TOKENS, VOCAB, device)
    ref = leaf(logits)
    cross_entropy(ref, target).backward()
    base = leaf(logits)
    loss = cross_entropy(base.clone(), target, overwrite_logits=True)
    (first,) = torch.autograd.grad(loss * 3.0, base, retain_graph=True)
    (second,) = torch.autograd.grad(loss, base)
    assert_close(first, 3 * ref.grad, torch.float32, "first")
    assert_close(second, ref.grad, torch.float32, "second")


def test_overwrite_logits_rows_with_unit_gradient(device):
    """The in-place rescale skips the rows whose incoming gradient is exactly 1 and scales the rest."""
    logits = make_logits((TOKENS, VOCAB), torch.float32, device)
    target = make_target(TOKENS, VOCAB, device)
    ref = leaf(logits)
    cross_entropy(ref, target, reduction="none").sum().backward()
    base = leaf(logits)
    loss = cross_entropy(base.clone(), target, reduction="none", overwrite_logits=True)
    g = torch.ones(TOKENS, device=device)
    g[::3] = 2.5
    loss.backward(g)
    assert_close(base.grad, g[:, None] * ref.grad, torch.float32, "dlogits")


def test_registered_rescale_never_changes_its_input(device):
    """The registered ``scale_forward_gradient`` (the traced routes' rescale) declares no mutation
    and makes none, whatever the factor; the eager route's in-place rescale is a plain launch
    (``rescale_in_place``) that leaves rows with factor 1 as they are."""
    from onca.ops.cross_entropy import rescale_in_place, scale_forward_gradient

    assert not torch.ops.onca.scale_forward_gradient.default._schema.is_mutable
    grad = torch.randn(5, 7, device=device)
    before = grad.clone()
    three, two = torch.full((5,), 3.0, device=device), torch.full((5,), 2.0, device=device)
    out = scale_forward_gradient(grad, three, two)
    torch.testing.assert_close(out, before * 1.5)
    assert torch.equal(grad, before)
    rescale_in_place(grad, torch.tensor([1.0, 2.0, 1.0, 0.5, 1.0], device=device))
    torch.testing.assert_close(grad, before * torch.tensor([1.0, 2.0, 1.0, 0.5, 1.0], device=device)[:, None])
