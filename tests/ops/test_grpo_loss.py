"""GRPO loss over given logits against a float64 PyTorch reference (TRL's / liger-kernel's formulas)."""

from __future__ import annotations

import pytest
import torch

import onca
from tests.contract import assert_op_contract
from tests.helpers import SCALE, assert_close, leaf

grpo_loss = onca.functional.grpo_loss

# (batch, completion length, vocab). GPU: Qwen's and Llama 3's vocabularies at 4096 rows, sized so
# that the float64 reference and its comparison (about 10 copies of the logits) fit an 80 GB H100.
SHAPES = {
    "cpu": [(2, 5, 96), (1, 1, 33), (3, 4, 300)],
    "gpu": [(4, 1024, 151936), (2, 2048, 128256), (1, 1, 32000)],
}[SCALE]


def make(shape, dtype, device, seed_mask=True):
    b, seq, v = shape
    logits = (torch.randn(b, seq + 1, v, device=device) * 2).to(dtype)
    ids = torch.randint(0, v, (b, seq), device=device)
    # old/ref log-probs near the policy's, so ratios land on both sides of the clip range.
    with torch.no_grad():
        logp = (logits[:, :-1].float() / 0.9).log_softmax(-1).gather(-1, ids[..., None]).squeeze(-1)
    old = logp + 0.3 * torch.randn(b, seq, device=device)
    ref = logp + 0.3 * torch.randn(b, seq, device=device)
    adv = torch.randn(b, device=device)
    mask = (torch.rand(b, seq, device=device) > 0.25).to(torch.int64) if seed_mask else None
    return logits, old, ref, ids, adv, mask


def reference(logits, old_logp, ref_logp, ids, adv, mask, temperature=0.9, beta=0.04, eps_low=0.2, eps_high=0.4,
              loss_type="dapo", max_completion_length=None, reduce=False, sapo_temperature_pos=1.0,
              sapo_temperature_neg=1.05, vllm_is_ratio=None, delta=None, use_bias_correction_kl=False,
              num_items_in_batch=None):
    """The formulas in float64, written as TRL's GRPOTrainer and liger-kernel write them."""
    x64 = logits.detach().to(torch.float64).requires_grad_(True)
    logp = (x64[:, :-1] / temperature).log_softmax(-1).gather(-1, ids[..., None]).squeeze(-1)
    old = old_logp.double() if old_logp is not None else logp.detach()
    r = torch.exp(logp - old)
    a = adv.double()[:, None]
    if loss_type == "cispo":
        loss = -torch.clamp(r, max=eps_high).detach() * a * logp
        clipped = (r > eps_high) & (a > 0)
    elif loss_type == "sapo":
        tau = torch.where(a > 0, sapo_temperature_pos, sapo_temperature_neg)
        loss = -torch.sigmoid(tau * (r - 1)) * 4 / tau * a
        clipped = torch.zeros_like(r, dtype=torch.bool)
    else:
        r2 = torch.clamp(r, 1 - eps_low, 1 + eps_high)
        r1 = torch.clamp(r, max=delta) if delta is not None else r
        loss = -torch.min(r1 * a, r2 * a)
        clipped = ((r < 1 - eps_low) & (a < 0)) | ((r > 1 + eps_high) & (a > 0))
    if vllm_is_ratio is not None:
        ratio = vllm_is_ratio.double()
        loss = loss * (ratio[:, None] if ratio.dim() == 1 else ratio)
    kl = None
    if beta != 0:
        ref = ref_logp.double()
        kl = torch.exp(ref - logp) - (ref - logp) - 1
        if use_bias_correction_kl:
            kl = kl * r
        loss = loss + beta * kl
    m = mask.double() if mask is not None else torch.ones_like(loss)
    if not reduce:
        return (loss * m, kl * m if kl is not None else None, clipped.double() * m), x64
    b, seq = loss.shape
    if loss_type in ("grpo", "sapo"):
        red = ((loss * m).sum(-1) / m.sum(-1).clamp(min=1)).mean()
    elif loss_type == "bnpo":
        red = (loss * m).sum() / m.sum().clamp(min=1)
    elif loss_type == "dr_grpo":
        red = (loss * m).sum() / (b * (max_completion_length or seq))
    elif loss_type in ("dapo", "cispo"):
        n = float(num_items_in_batch) if num_items_in_batch is not None else m.sum()
        red = (loss * m).sum() / max(n, 1.0) if num_items_in_batch is not None else (loss * m).sum() / n.clamp(min=1)
    else:
        red = (loss * m * m.sum(-1, keepdim=True)).mean()  # masked tokens: 0 per-token loss
    count = m.sum().clamp(min=1)
    metrics = ([(kl * m).sum() / count] if kl is not None else []) + [(clipped.double() * m).sum() / count]
    return (red, metrics), x64


def check(inputs, dtype, **kw):
    logits, old, ref, ids, adv, mask = inputs
    x = leaf(logits)
    ours = grpo_loss(x, old, ref, ids, adv, mask, **kw)
    theirs, x64 = reference(logits, old, ref, ids, adv, mask, **kw)
    if kw.get("reduce"):
        (loss, metrics), (rloss, rmetrics) = ours, theirs
        assert loss.dim() == 0
        assert_close(loss, rloss, torch.float32, "loss")
        assert len(metrics) == len(rmetrics)
        for a, e in zip(metrics, rmetrics):
            assert_close(a, e, torch.float32, "metric")
        loss.backward()
        rloss.backward()
    else:
        for a, e, name in zip(ours, theirs, ("per_token_loss", "per_token_kl", "is_clipped")):
            assert (a is None) == (e is None), name
            if a is not None:
                assert a.dtype == torch.float32
                assert_close(a, e, torch.float32, name)
        g = torch.randn_like(ours[0])
        ours[0].backward(g)
        theirs[0].backward(g.double())
    # The gradient is in the logits' dtype: judge it at that dtype's tolerance.
    assert x.grad.dtype == dtype
    assert_close(x.grad, x64.grad, dtype, "dlogits")


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_shapes(profile, device, shape, dtype):
    check(make(shape, dtype, device), dtype)


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "bnpo", "dr_grpo", "luspo", "cispo", "sapo"])
def test_loss_types_reduced(device, loss_type):
    shape = SHAPES[0]
    kw = dict(loss_type=loss_type, reduce=True)
    if loss_type == "cispo":
        kw["eps_high"] = 1.1  # CISPO's raw upper bound
    if loss_type == "dr_grpo":
        kw["max_completion_length"] = 8
    check(make(shape, torch.float32, device), torch.float32, **kw)


@pytest.mark.parametrize("case", ["no_old_no_kl", "delta", "bias_kl", "vllm_token", "vllm_seq", "no_mask",
                                  "num_items", "temperature"])
def test_options(device, case):
    shape = SHAPES[0]
    inputs = list(make(shape, torch.float32, device, seed_mask=case != "no_mask"))
    b, seq, _ = shape
    kw = {}
    if case == "no_old_no_kl":
        inputs[1], inputs[2], kw["beta"] = None, None, 0.0
    elif case == "delta":
        kw["delta"] = 1.05
    elif case == "bias_kl":
        kw["use_bias_correction_kl"] = True
    elif case == "vllm_token":
        kw["vllm_is_ratio"] = torch.rand(b, seq, device=device) + 0.5
    elif case == "vllm_seq":
        kw["vllm_is_ratio"] = torch.rand(b, device=device) + 0.5
    elif case == "num_items":
        kw.update(reduce=True, num_items_in_batch=23)
    elif case == "temperature":
        kw["temperature"] = 0.5
    check(inputs, torch.float32, **kw)


def test_column_tiled_path(profile, device, onchip_bytes):
    from onca.ops import grpo_loss as op

    forced = onchip_bytes(2048)
    shape = (2, 3, 1000)
    assert op.plan((6, 1000), torch.float32, forced)["forward"].col_tiles > 1
    check(make(shape, torch.float32, device), torch.float32, loss_type="grpo", reduce=True)


def test_overwrite_logits(device):
    inputs = make(SHAPES[0], torch.bfloat16, device)
    x1, x2 = leaf(inputs[0]), leaf(inputs[0])
    grpo_loss(x1, *inputs[1:], reduce=True)[0].backward()
    buf = inputs[0].clone()
    with torch.no_grad():
        x2.copy_(buf)
    x3 = buf.requires_grad_(True)
    loss = grpo_loss(x3, *inputs[1:], reduce=True, overwrite_logits=True)[0]
    (g,) = torch.autograd.grad(loss, x3)
    assert g.data_ptr() == x3.data_ptr()
    assert torch.equal(g, x1.grad)


def test_fp16_logits(device):
    check(make(SHAPES[0], torch.float16, device), torch.float16, loss_type="bnpo", reduce=True)


def test_empty_completion(device):
    logits = torch.randn(2, 1, 16, device=device, requires_grad=True)
    ids = torch.zeros(2, 0, dtype=torch.int64, device=device)
    empty = torch.zeros(2, 0, device=device)
    loss, kl, clipped = grpo_loss(logits, empty, empty, ids, torch.randn(2, device=device))
    assert loss.shape == kl.shape == clipped.shape == (2, 0)
    loss.sum().backward()
    assert torch.equal(logits.grad, torch.zeros_like(logits))


def test_bad_input(device):
    logits, old, ref, ids, adv, mask = make(SHAPES[0], torch.float32, device)
    with pytest.raises(ValueError, match="logits must be 3-D"):
        grpo_loss(logits[0], old, ref, ids, adv, mask)
    with pytest.raises(TypeError, match="completion_ids must be an int32 or int64"):
        grpo_loss(logits, old, ref, ids.float(), adv, mask)
    with pytest.raises(ValueError, match="completion_ids must have shape"):
        grpo_loss(logits, old, ref, ids[:1], adv, mask)
    with pytest.raises(ValueError, match="advantages must have shape"):
        grpo_loss(logits, old, ref, ids, adv[:1], mask)
    with pytest.raises(ValueError, match="old_logp must have shape"):
        grpo_loss(logits, old[:, :-1], ref, ids, adv, mask)
    with pytest.raises(ValueError, match="completion_mask must have shape"):
        grpo_loss(logits, old, ref, ids, adv, mask[:, :-1])
    with pytest.raises(ValueError, match="loss_type must be one of"):
        grpo_loss(logits, old, ref, ids, adv, mask, loss_type="vespo")
    with pytest.raises(ValueError, match="ref_logp is required"):
        grpo_loss(logits, old, None, ids, adv, mask)
    with pytest.raises(ValueError, match="temperature must be positive"):
        grpo_loss(logits, old, ref, ids, adv, mask, temperature=0.0)
    with pytest.raises(ValueError, match="delta"):
        grpo_loss(logits, old, ref, ids, adv, mask, loss_type="cispo", delta=2.0)
    with pytest.raises(ValueError, match="vllm_is_ratio must have shape"):
        grpo_loss(logits, old, ref, ids, adv, mask, vllm_is_ratio=torch.ones(3, device=device))
    with pytest.raises(TypeError, match="reduce must be a bool"):
        grpo_loss(logits, old, ref, ids, adv, mask, reduce=1)
    with pytest.raises(TypeError, match="beta must be a number"):
        grpo_loss(logits, old, ref, ids, adv, mask, beta="0.1")


@pytest.mark.parametrize("reduce", [False, True])
def test_op_contract(device, reduce):
    logits, old, ref, ids, adv, mask = make((2, 3, 40), torch.bfloat16, device)

    def fn(x, old, ref, ids, adv, mask):
        out = grpo_loss(x, old, ref, ids, adv, mask, loss_type="grpo", reduce=reduce)
        return (out[0], *out[1]) if reduce else out

    assert_op_contract(fn, (logits.requires_grad_(), old, ref, ids, adv, mask),
                       expect_ops={"grpo_loss_forward", "grpo_loss_backward"})
