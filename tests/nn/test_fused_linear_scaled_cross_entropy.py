"""``onca.nn.FusedLinearScaledCrossEntropy`` against the unfused computation on full logits."""

from __future__ import annotations

import pytest
import torch

import onca
from tests.helpers import assert_close, leaf, randn


@pytest.mark.parametrize("keep_logits", [False, True], ids=["recomputed", "kept"])
@pytest.mark.parametrize("entropy", [False, True], ids=["nll", "nll+entropy"])
def test_module_matches_unfused(device, entropy, keep_logits):
    hidden = randn(2, 5, 16, device=device)
    weight = randn(41, 16, device=device, std=0.5)
    bias = randn(41, device=device, std=0.1)
    target = torch.randint(0, 41, (2, 5), device=device)
    target[1, :3] = -1
    module = onca.nn.FusedLinearScaledCrossEntropy(temperature=0.6, ignore_index=-1, return_entropy=entropy,
                                                   keep_logits=keep_logits)
    assert "temperature=0.6" in repr(module) and ("keep_logits=True" in repr(module)) == keep_logits
    h1, w1, b1, h2, w2, b2 = (leaf(t) for t in (hidden, weight, bias, hidden, weight, bias))
    out = module(h1, w1, target, b1)
    logits = (h2 @ w2.T + b2) / 0.6
    logsm = logits.log_softmax(-1)
    valid = target != -1
    nll = torch.where(valid, -logsm.gather(-1, target.clamp(min=0)[..., None])[..., 0], 0.0)
    if entropy:
        ent = torch.where(valid, -(logsm.exp() * logsm).sum(-1), 0.0)
        assert_close(out[1], ent, torch.float32, "entropy")
        (out[0].sum() + 0.5 * out[1].sum()).backward()
        (nll.sum() + 0.5 * ent.sum()).backward()
    else:
        assert_close(out, nll, torch.float32, "nll")
        out.sum().backward()
        nll.sum().backward()
    for a, e, name in ((h1, h2, "dhidden"), (w1, w2, "dweight"), (b1, b2, "dbias")):
        assert_close(a.grad, e.grad, torch.float32, name)


def test_module_rejects_bad_options():
    with pytest.raises(ValueError, match="temperature"):
        onca.nn.FusedLinearScaledCrossEntropy(temperature=-1.0)
    with pytest.raises(TypeError, match="return_entropy must be a bool"):
        onca.nn.FusedLinearScaledCrossEntropy(return_entropy="yes")
    with pytest.raises(TypeError, match="keep_logits must be a bool"):
        onca.nn.FusedLinearScaledCrossEntropy(keep_logits=1)
