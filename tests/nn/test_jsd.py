"""``onca.nn.JSD`` and ``onca.nn.FusedLinearJSD``: the modules call the ops with their settings."""

from __future__ import annotations

import pytest
import torch

import onca
from tests.helpers import assert_close
from tests.ops.test_fused_linear_jsd import make_inputs as fused_inputs
from tests.ops.test_fused_linear_jsd import reference as fused_reference
from tests.ops.test_jsd import make_inputs
from tests.ops.test_jsd import reference as jsd_reference


@pytest.mark.parametrize("beta, temperature", [(0.0, 1.0), (0.25, 2.0), (1.0, 1.0)])
def test_jsd_module(device, beta, temperature):
    x, y, labels = make_inputs((2, 5, 300), torch.float32, device, ignore_every=3)
    module = onca.nn.JSD(beta=beta, ignore_index=-100, temperature=temperature)
    xk = x.clone().requires_grad_()
    loss = module(xk, y, labels)
    ref, x64 = jsd_reference(x, y, labels, beta, temperature)
    assert_close(loss, ref, torch.float32, "loss")
    loss.backward()
    ref.backward()
    assert_close(xk.grad, x64.grad, torch.float32, "dinput")
    no_labels = onca.nn.JSD(beta, temperature=temperature)(x, y)
    assert_close(no_labels, jsd_reference(x, y, None, beta, temperature)[0], torch.float32, "no labels")


def test_jsd_module_options_and_repr(device):
    x, y, _ = make_inputs((4, 100), torch.float32, device, logits=True)
    m = onca.nn.JSD(reduction="none", from_logits=True)
    assert m(x, y).shape == (4,)
    assert "from_logits=True" in repr(m) and "beta=0.5" in repr(m)
    assert list(m.state_dict()) == []


def test_fused_linear_jsd_module(device):
    sh, sw, th, tw, labels = fused_inputs(24, 16, 20, 500, torch.float32, device, ignore_every=4)
    head = torch.nn.Linear(16, 500, bias=False, device=device)
    with torch.no_grad():
        head.weight.copy_(sw)
    shk = sh.clone().requires_grad_()
    module = onca.nn.FusedLinearJSD(beta=0.7, temperature=1.5)
    loss = module(shk, head.weight, th, tw, labels)
    ref, sh64, sw64 = fused_reference(sh, sw, th, tw, labels, 0.7, 1.5)
    assert_close(loss, ref, torch.float32, "loss")
    loss.backward()
    ref.backward()
    assert_close(shk.grad, sh64.grad, torch.float32, "dstudent_hidden")
    assert_close(head.weight.grad, sw64.grad, torch.float32, "dstudent_weight")
    assert "temperature=1.5" in repr(module) and "accum_dtype" not in repr(module)
    fp32 = onca.nn.FusedLinearJSD(beta=0.7, temperature=1.5, accum_dtype=torch.float32)
    assert "accum_dtype=torch.float32" in repr(fp32)
    assert_close(fp32(sh, head.weight, th, tw, labels), ref, torch.float32, "loss (fp32 accumulation)")
    with pytest.raises(ValueError, match="accum_dtype must be None or a floating torch.dtype"):
        onca.nn.FusedLinearJSD(accum_dtype="fp32")


@pytest.mark.parametrize("cls", [onca.nn.JSD, onca.nn.FusedLinearJSD])
def test_module_bad_arguments(cls):
    with pytest.raises(ValueError, match="beta"):
        cls(beta=-0.5)
    with pytest.raises(ValueError, match="temperature"):
        cls(temperature=0)
    with pytest.raises(ValueError, match="reduction"):
        cls(reduction="batchmean")
