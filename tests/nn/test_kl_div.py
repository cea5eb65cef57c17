"""``onca.nn.KLDivLoss`` is a drop-in for ``torch.nn.KLDivLoss``."""

from __future__ import annotations

import warnings

import pytest
import torch

import onca
from tests.helpers import SCALE, assert_close, randn

SHAPE = {"cpu": (2, 3, 1000), "gpu": (4, 1024, 32000)}[SCALE]


@pytest.mark.parametrize("reduction", ["none", "sum", "mean", "batchmean"])
@pytest.mark.parametrize("log_target", [False, True])
def test_matches_torch_module(device, reduction, log_target):
    x = torch.log_softmax(randn(*SHAPE, device=device), -1)
    t = torch.softmax(randn(*SHAPE, device=device), -1)
    t = t.log() if log_target else t
    ours = onca.nn.KLDivLoss(reduction, log_target)
    theirs = torch.nn.KLDivLoss(reduction=reduction, log_target=log_target)
    assert isinstance(ours, torch.nn.KLDivLoss)
    x_ours, x_torch = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_ours = ours(x_ours, t)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch: "mean" is not "batchmean"
        y_torch = theirs(x_torch, t)
    assert_close(y_ours, y_torch, torch.float32, "loss")
    dy = torch.randn(y_torch.shape, device=device)
    y_ours.backward(dy)
    y_torch.backward(dy)
    assert_close(x_ours.grad, x_torch.grad, torch.float32, "dinput")


def test_module_defaults_and_bad_arguments():
    m = onca.nn.KLDivLoss()
    assert m.reduction == "mean" and m.log_target is False
    assert list(m.state_dict()) == []
    with pytest.raises(ValueError, match="reduction"):
        onca.nn.KLDivLoss("elementwise")
