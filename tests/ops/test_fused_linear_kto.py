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
from tests.contract import assert_op_contract


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


@pytest.mark.parametrize("sequence_chunks", [True, False])
def test_op_contract(monkeypatch, device, sequence_chunks):
    """On chunks of whole sequences (the op opchecked here), and on the chunk driver."""
    from onca.ops import fused_linear_kto as module

    monkeypatch.setattr(module, "use_token_chunks", lambda *a: sequence_chunks)
    h, w, _, labels = make_inputs((2, 5, 8, 24), torch.float32, device, prompt=1)
    rh = randn(2, 5, 8, device=device)
    flags = torch.tensor([True, False], device=device)
    fn = lambda h, w, labels, rh: fused_linear_kto(h, w, labels, flags, rh, w.detach(), kl_hidden=rh,
                                                   ref_kl_hidden=h.detach(), kl_labels=labels, chunk_tokens=4)
    inputs = (h.requires_grad_(), w.requires_grad_(), labels, rh)
    if sequence_chunks:
        assert_op_contract(fn, inputs, expect_ops={"token_loss_forward", "chunked_logprob_forward"})
    else:
        assert_loss_contract(fn, inputs)


@pytest.mark.parametrize("loss_type", ["kto", "apo_zero_unpaired"])
def test_sequence_chunks_match_the_chunk_driver(monkeypatch, device, loss_type, poisoned_empty,
                                                head_matmuls):
    """The gradient-in-forward chunks of whole sequences give the chunk driver's loss, aux and
    gradients (autograd through the same losses), one logits matmul per chunk and none in the
    backward; no buffer is read before it is written (``poisoned_empty``)."""
    from onca.ops import fused_linear_kto as module

    h, w, b, labels = make_inputs(BASE, torch.float32, device, bias=True, empty_row=1)
    desirable = torch.tensor([True, False, False, True], device=device)
    ref = torch.randn(4, device=device) - 20
    results = []
    for sequence_chunks in (True, False):
        monkeypatch.setattr(module, "use_token_chunks", lambda *a, on=sequence_chunks: on)
        head_matmuls.clear()
        hk, wk, bk = (t.detach().clone().requires_grad_() for t in (h, w, b))
        loss, aux = fused_linear_kto(hk, wk, labels, desirable, ref_logps=ref, bias=bk, kl=torch.tensor(0.3),
                                     beta=0.5, desirable_weight=1.2, undesirable_weight=0.7,
                                     loss_type=loss_type, chunk_tokens=CHUNK, return_aux=True)
        loss.backward()
        results.append((loss, aux["logps"], hk.grad, wk.grad, bk.grad, len(head_matmuls)))
    (*token, token_mm), (*driver, driver_mm) = results
    for name, a, b_ in zip(("loss", "logps", "dhidden", "dweight", "dbias"), token, driver):
        torch.testing.assert_close(a, b_, rtol=1e-4, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")
    n, t = labels.shape
    per_chunk = max(1, CHUNK // t)
    assert (token_mm, driver_mm) == (-(-n // per_chunk), 2 * -(-n * t // CHUNK))


def test_sequences_too_long_for_one_chunk_keep_the_chunk_driver(monkeypatch, device):
    from onca.ops import _token_head

    h, w, _, labels = make_inputs(BASE, torch.float32, device)
    h.requires_grad_()
    row_bytes = w.shape[0] * h.element_size()
    assert _token_head.use_token_chunks(h, w, None, labels.shape[1])
    monkeypatch.setattr(_token_head, "MAX_PAIR_SCRATCH_BYTES", labels.shape[1] * row_bytes - 1)
    assert not _token_head.use_token_chunks(h, w, None, labels.shape[1])
    assert _token_head.use_token_chunks(h, w, None)  # token chunks: any length
