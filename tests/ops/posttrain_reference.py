"""Shared pieces of the post-training loss tests: inputs in TRL's concatenated layout and a float64
reference of the per-token log-probabilities from the full logits (rounded to the input dtype, as
the head's matmul rounds them), on which each test writes its loss from the paper's / TRL's formula."""

from __future__ import annotations

import torch

from tests.helpers import SCALE, assert_close, leaf, randn, rounded

IGNORE = -100

# (sequences, tokens, hidden, vocab): awkward vocabularies; the GPU set at real widths.
SHAPES = {
    "cpu": [(4, 9, 16, 203), (2, 7, 24, 517)],
    "gpu": [(8, 512, 4096, 128256), (4, 1024, 2048, 151936)],
}[SCALE]
# Option, metric, bad-input and contract tests: one small shape at every scale (their hand-written
# per-sequence values assume it); the real widths are in SHAPES.
BASE = (4, 9, 16, 203)
CHUNK = 16  # forces several chunks of BASE (and many of the GPU shapes)


def make_inputs(shape, dtype, device, *, bias=False, prompt=3, empty_row=None, hidden_width=None, std=2.0):
    """``hidden (n, T, H)``, ``weight (V, H)``, ``bias``, ``labels (n, T)``: the first ``prompt``
    positions of each sequence and a random tail of padding are ignored; ``empty_row`` has every
    label ignored."""
    n, t, h, v = shape
    h = hidden_width or h
    hidden = randn(n, t, h, dtype=dtype, device=device)
    weight = randn(v, h, dtype=dtype, device=device, std=h ** -0.5 * std)
    b = randn(v, dtype=dtype, device=device, std=0.5) if bias else None
    labels = torch.randint(0, v, (n, t), device=device)
    labels[:, :prompt] = IGNORE
    for i in range(n):
        pad = int(torch.randint(0, max(1, t - prompt - 1), ()).item())
        if pad:
            labels[i, t - pad:] = IGNORE
    if empty_row is not None:
        labels[empty_row] = IGNORE
    return hidden, weight, b, labels


def reference_logps(hidden, weight, bias, labels, temperature=1.0, grad=True):
    """float64 per-token log-probabilities (0 where ignored), their entropies, and the float64
    leaves ``(h, w, b)`` for the gradients."""
    h64 = hidden.detach().to(torch.float64).requires_grad_(grad)
    w64 = weight.detach().to(torch.float64).requires_grad_(grad)
    b64 = bias.detach().to(torch.float64).requires_grad_(grad) if bias is not None else None
    logits = h64 @ w64.T
    if b64 is not None:
        logits = logits + b64
    logits = rounded(logits, hidden.dtype) / temperature
    logsm = torch.log_softmax(logits, -1)
    mask = labels != IGNORE
    per = logsm.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    per = torch.where(mask, per, 0.0)
    entropy = torch.where(mask, -(logsm.exp() * logsm).sum(-1), 0.0)
    return per, entropy, mask, (h64, w64, b64)


def check_against(onca_fn, reference_fn, hidden, weight, bias, labels, *, name="loss", dtype=None):
    """``onca_fn(h, w, b)`` against ``reference_fn(h64, w64, b64)``, forward and backward."""
    dtype = dtype or hidden.dtype
    hk, wk = leaf(hidden), leaf(weight)
    bk = leaf(bias) if bias is not None else None
    loss = onca_fn(hk, wk, bk)
    h64 = hidden.detach().to(torch.float64).requires_grad_(True)
    w64 = weight.detach().to(torch.float64).requires_grad_(True)
    b64 = bias.detach().to(torch.float64).requires_grad_(True) if bias is not None else None
    ref = reference_fn(h64, w64, b64)
    assert loss.dtype == torch.float32 and loss.shape == ()
    assert_close(loss, ref, dtype, name)
    loss.backward()
    ref.backward()
    assert hk.grad.dtype == hidden.dtype and wk.grad.dtype == weight.dtype
    assert_close(hk.grad, h64.grad, dtype, f"{name}: dhidden")
    assert_close(wk.grad, w64.grad, dtype, f"{name}: dweight")
    if bias is not None:
        assert_close(bk.grad, b64.grad, dtype, f"{name}: dbias")
    return loss


def logps64(h64, w64, b64, labels, dtype, temperature=1.0):
    """Per-token float64 log-probabilities from float64 leaves (logits rounded to ``dtype``)."""
    logits = h64 @ w64.T
    if b64 is not None:
        logits = logits + b64
    logsm = torch.log_softmax(rounded(logits, dtype) / temperature, -1)
    per = logsm.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return torch.where(labels != IGNORE, per, 0.0)


def assert_loss_contract(fn, inputs, expect_ops=("chunked_logprob_forward", "chunked_logprob_backward")):
    """The op contract for a loss built on the chunk driver: it reaches the driver's custom ops
    (which ``tests/ops/test_chunked_head.py::test_op_contract`` opchecks: running opcheck again
    here would only repeat it), compiles with ``fullgraph=True`` to eager's outputs and gradients
    bit for bit, and never synchronises with the host on CUDA."""
    from tests.contract import _forward_backward, assert_compiles_like_eager, no_host_sync, recorded_calls

    device = next(t.device for t in inputs if isinstance(t, torch.Tensor))
    with no_host_sync(device):
        _forward_backward(fn, inputs)
    reached = {name for name, _, _ in recorded_calls(fn, inputs)}
    missing = set(expect_ops) - reached
    assert not missing, f"expected onca ops not reached: {sorted(missing)}"
    assert_compiles_like_eager(fn, inputs)
