"""Fused linear KTO forward and backward against TRL 1.16's KTO formulas on float64 full logits."""

from __future__ import annotations

import pytest
import torch

from onca.ops.fused_linear_kto import fused_linear_kto
from tests.helpers import randn
from tests.ops.posttrain_reference import (
    BASE,
    CHUNK,
    assert_loss_contract,
    check_against,
    logps64,
    make_inputs,
)


def reference_kto(pi, ref, desirable, kl, loss_type, beta, dw=1.0, uw=1.0):
    """TRL's way: chosen and rejected selected by index, losses concatenated, then the mean."""
    lr = pi.sum(-1) - ref.sum(-1)
    c, r = lr[desirable], lr[~desirable]
    if loss_type == "kto":
        lc, lrj = 1 - torch.sigmoid(beta * (c - kl)), 1 - torch.sigmoid(beta * (kl - r))
    else:
        lc, lrj = 1 - torch.sigmoid(beta * c), torch.sigmoid(beta * r)
    return torch.cat((dw * lc, uw * lrj)).mean()


def run(dtype, device, loss_type="kto", kl_mode="hidden", bias=False, shape=BASE, chunk_tokens=CHUNK, flags=None):
    h, w, b, labels = make_inputs(shape, dtype, device, bias=bias, empty_row=0)
    n = shape[0]
    desirable = torch.tensor(flags if flags is not None else [i % 2 == 0 for i in range(n)], device=device)
    rh = h + 0.3 * randn(*h.shape, dtype=dtype, device=device)
    rw = w.clone()
    _, _, _, kl_labels = make_inputs(shape, dtype, device)
    kh, rkh = randn(*h.shape, dtype=dtype, device=device), randn(*h.shape, dtype=dtype, device=device)
    ref = logps64(rh.double(), rw.double(), None, labels, dtype)
    if kl_mode == "hidden":
        kw = dict(kl_hidden=kh, ref_kl_hidden=rkh, kl_labels=kl_labels)
        with torch.no_grad():
            kl = (logps64(kh.double(), w.double(), b.double() if b is not None else None, kl_labels, dtype).sum(-1)
                  - logps64(rkh.double(), rw.double(), None, kl_labels, dtype).sum(-1)).mean().clamp(min=0)
    else:
        kw, kl = dict(kl=0.4), torch.tensor(0.4, dtype=torch.float64)
    fn = lambda h_, w_, b_: fused_linear_kto(h_, w_, labels, desirable, rh, rw, bias=b_, beta=0.3,
                                             desirable_weight=1.0, undesirable_weight=1.5, loss_type=loss_type,
                                             chunk_tokens=chunk_tokens, **kw)
    reference = lambda h64, w64, b64: reference_kto(logps64(h64, w64, b64, labels, dtype), ref,
                                                    desirable, kl, loss_type, 0.3, 1.0, 1.5)
    return check_against(fn, reference, h, w, b, labels, name=loss_type)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_kto(profile, device, dtype):
    run(dtype, device, bias=True)


def test_apo_zero_unpaired_given_kl_one_sequence(device):
    run(torch.float32, device, loss_type="apo_zero_unpaired", kl_mode="number", shape=(1, 6, 8, 61),
        chunk_tokens=None, flags=[False])


def test_precomputed_reference_and_aux(device):
    h, w, _, labels = make_inputs(BASE, torch.float32, device)
    desirable = torch.tensor([True, False, False, True], device=device)
    ref = torch.randn(4, device=device) - 20
    loss, aux = fused_linear_kto(h, w, labels, desirable, ref_logps=ref, kl=torch.tensor(-1.0), return_aux=True)
    pi = logps64(h.double(), w.double(), None, labels, torch.float32).sum(-1)
    expected = reference_kto(logps64(h.double(), w.double(), None, labels, torch.float32), ref.double()[:, None],
                             desirable, 0.0, "kto", 0.1)
    torch.testing.assert_close(loss.double(), expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(aux["rewards"].double(), 0.1 * (pi - ref.double()), rtol=1e-4, atol=1e-4)
    assert aux["kl"].item() == 0.0  # clamped at 0


@pytest.mark.parametrize("kl", [-0.5, 0.0, 0.25])
def test_a_kl_given_as_a_number_is_the_same_as_a_tensor(device, kl):
    # A number is subtracted as a scalar (and 0 not at all); the loss and the aux's KL are the tensor's.
    h, w, _, labels = make_inputs(BASE, torch.float32, device)
    desirable = torch.tensor([True, False, False, True], device=device)
    ref = torch.randn(4, device=device) - 20
    loss, aux = fused_linear_kto(h, w, labels, desirable, ref_logps=ref, kl=kl, desirable_weight=1.5,
                                 return_aux=True)
    want, want_aux = fused_linear_kto(h, w, labels, desirable, ref_logps=ref, kl=torch.tensor(kl),
                                      desirable_weight=1.5, return_aux=True)
    assert torch.equal(loss, want)
    assert aux["kl"].dtype == torch.float32 and aux["kl"].device == h.device
    assert torch.equal(aux["kl"], want_aux["kl"])


def test_bad_input(device):
    h, w, _, labels = make_inputs(BASE, torch.float32, device)
    flags = torch.ones(4, dtype=torch.bool, device=device)
    with pytest.raises(TypeError, match="desirable"):
        fused_linear_kto(h, w, labels, flags.float(), h, w)
    with pytest.raises(ValueError, match="desirable"):
        fused_linear_kto(h, w, labels, flags[:3], h, w)
    with pytest.raises(ValueError, match="reference"):
        fused_linear_kto(h, w, labels, flags)
    with pytest.raises(ValueError, match="kl_hidden"):
        fused_linear_kto(h, w, labels, flags, h, w, kl_hidden=h)
    with pytest.raises(ValueError, match="loss_type"):
        fused_linear_kto(h, w, labels, flags, h, w, loss_type="sigmoid")


def test_op_contract(device):
    h, w, _, labels = make_inputs((2, 5, 8, 24), torch.float32, device, prompt=1)
    rh = randn(2, 5, 8, device=device)
    flags = torch.tensor([True, False], device=device)
    fn = lambda h, w, labels, rh: fused_linear_kto(h, w, labels, flags, rh, w.detach(), kl_hidden=rh,
                                                   ref_kl_hidden=h.detach(), kl_labels=labels, chunk_tokens=4)
    assert_loss_contract(fn, (h.requires_grad_(), w.requires_grad_(), labels, rh))
