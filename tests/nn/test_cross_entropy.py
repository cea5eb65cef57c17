"""``onca.nn.CrossEntropyLoss`` is a drop-in for ``torch.nn.CrossEntropyLoss`` on (N, C) logits."""

from __future__ import annotations

import pytest
import torch

import onca
from tests.helpers import SCALE, assert_close, leaf, randn

N, C = {"cpu": (29, 777), "gpu": (8192, 128256)}[SCALE]


def _target(device, ignore_index=-100):
    t = torch.randint(0, C, (N,), device=device)
    t[::5] = ignore_index
    return t


@pytest.mark.parametrize("kwargs", [
    {}, {"reduction": "sum"}, {"reduction": "none"}, {"label_smoothing": 0.1},
    {"ignore_index": 3, "reduction": "sum", "label_smoothing": 0.3},
], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_matches_torch_module(device, kwargs, dtype):
    ref_mod, ours = torch.nn.CrossEntropyLoss(**kwargs), onca.nn.CrossEntropyLoss(**kwargs)
    assert ours.state_dict().keys() == ref_mod.state_dict().keys()
    x = randn(N, C, dtype=dtype, device=device, std=2.0)
    t = _target(device, kwargs.get("ignore_index", -100))
    xr, xo = leaf(x.float()), leaf(x)
    y_ref, y = ref_mod(xr, t), ours(xo, t)
    assert y.dtype == torch.float32  # Onca's loss is fp32 whatever the logits' dtype (torch's: theirs)
    assert_close(y, y_ref, dtype, "loss")
    dy = randn(*y_ref.shape, device=device) if y_ref.dim() else torch.tensor(1.0, device=device)
    y_ref.backward(dy)
    y.backward(dy.to(dtype))
    assert_close(xo.grad, xr.grad, dtype, "dlogits")


@pytest.mark.parametrize("kwargs", [{}, {"reduction": "none"}, {"reduction": "sum", "label_smoothing": 0.2}],
                         ids=str)
def test_class_weights_match_torch_module(device, kwargs):
    weight = torch.rand(C, device=device) + 0.5
    ref_mod = torch.nn.CrossEntropyLoss(weight=weight.double(), **kwargs)
    ours = onca.nn.CrossEntropyLoss(weight=weight, **kwargs)
    assert ours.state_dict().keys() == ref_mod.state_dict().keys() == {"weight"}
    x = randn(N, C, device=device, std=2.0)
    t = _target(device)
    xr, xo = leaf(x.double()), leaf(x)
    y_ref, y = ref_mod(xr, t), ours(xo, t)
    assert_close(y, y_ref, torch.float32, "loss")
    y_ref.sum().backward()
    y.sum().backward()
    assert_close(xo.grad, xr.grad, torch.float32, "dlogits")


def test_token_metrics(device):
    x = randn(N, C, device=device, std=2.0)
    t = _target(device)
    t[1::2] = x[1::2].argmax(-1)
    m = onca.nn.CrossEntropyLoss(return_token_accuracy=True, return_predicted_tokens=True)
    out = m(x, t)
    expected = onca.functional.cross_entropy(x, t, return_token_accuracy=True, return_predicted_tokens=True)
    assert isinstance(out, onca.functional.CrossEntropyOutput)
    for a, b in zip(out, expected):
        assert (a is None and b is None) or torch.equal(a, b)
    assert out.token_accuracy > 0.4


def test_extras_and_overwrite_logits(device):
    x = randn(N, C, device=device, std=2.0)
    t = _target(device)
    m = onca.nn.CrossEntropyLoss(lse_square_scale=1e-3, softcap=20.0, return_z_loss=True, overwrite_logits=True)
    base = leaf(x)
    loss, z = m(base.clone(), t)
    expected, z_expected = onca.functional.cross_entropy(x, t, lse_square_scale=1e-3, softcap=20.0,
                                                         return_z_loss=True)
    # The forward that writes the gradient sums each row in another tile than the log-sum-exp
    # pass alone (the streaming tile on a GPU): equal up to fp32 rounding.
    torch.testing.assert_close(loss, expected, rtol=2e-6, atol=0)
    torch.testing.assert_close(z, z_expected, rtol=2e-6, atol=0)
    loss.backward()
    assert base.grad is not None and torch.isfinite(base.grad).all()
    assert "softcap=20.0" in repr(m) and "overwrite_logits=True" in repr(m)


def test_legacy_reduction_arguments():
    with pytest.warns(UserWarning):
        assert onca.nn.CrossEntropyLoss(size_average=False).reduction == "sum"
    with pytest.warns(UserWarning):
        assert onca.nn.CrossEntropyLoss(reduce=False).reduction == "none"


def test_bad_arguments():
    with pytest.raises(TypeError, match="weight must have a floating dtype"):
        onca.nn.CrossEntropyLoss(weight=torch.ones(C, dtype=torch.int64))
    with pytest.raises(ValueError, match="reduction"):
        onca.nn.CrossEntropyLoss(reduction="avg")
    with pytest.raises(ValueError, match="label_smoothing"):
        onca.nn.CrossEntropyLoss(label_smoothing=-0.1)
    with pytest.raises(ValueError, match="softcap"):
        onca.nn.CrossEntropyLoss(softcap=-1.0)
