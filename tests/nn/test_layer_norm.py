"""``onca.nn.LayerNorm`` is a drop-in for ``torch.nn.LayerNorm`` over the last dimension."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import onca
from tests.helpers import SCALE, assert_close, randn

HIDDEN = {"cpu": 96, "gpu": 4096}[SCALE]
SHAPE = {"cpu": (2, 5, HIDDEN), "gpu": (4, 2048, HIDDEN)}[SCALE]

CONFIGS = {
    "affine": dict(),
    "no-bias": dict(bias=False),
    "no-affine": dict(elementwise_affine=False),
}


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_matches_torch_module(device, config, dtype):
    kwargs = CONFIGS[config]
    ref = nn.LayerNorm(HIDDEN, eps=1e-5, **kwargs).to(device=device, dtype=dtype)
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(torch.randn(HIDDEN) * 0.3 + (1.0 if p is ref.weight else 0.0))
    ours = onca.nn.LayerNorm(HIDDEN, eps=1e-5, **kwargs).to(device=device, dtype=dtype)
    result = ours.load_state_dict(ref.state_dict())
    assert not result.missing_keys and not result.unexpected_keys
    assert list(ours.state_dict()) == list(ref.state_dict())

    x = randn(*SHAPE, dtype=dtype, device=device, std=2.0) + 1.0
    x_ref, x_ours = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_ref, y_ours = ref(x_ref), ours(x_ours)
    assert y_ours.dtype == y_ref.dtype
    assert_close(y_ours, y_ref, dtype, "y")
    dy = randn(*SHAPE, dtype=dtype, device=device)
    y_ref.backward(dy)
    y_ours.backward(dy)
    assert_close(x_ours.grad, x_ref.grad, dtype, "dx")
    for (name, p_ours), p_ref in zip(ours.named_parameters(), ref.parameters()):
        assert p_ours.grad.dtype == p_ref.grad.dtype
        assert_close(p_ours.grad, p_ref.grad, dtype, f"d{name}")


def test_is_a_torch_layer_norm():
    m = onca.nn.LayerNorm(64)
    assert isinstance(m, nn.LayerNorm)
    assert m.normalized_shape == (64,) and m.eps == 1e-5 and m.elementwise_affine
    assert torch.equal(m.weight.detach(), torch.ones(64)) and torch.equal(m.bias.detach(), torch.zeros(64))
    assert repr(m) == repr(nn.LayerNorm(64))
    assert onca.nn.LayerNorm(64, bias=False).bias is None
    bare = onca.nn.LayerNorm(64, elementwise_affine=False)
    assert bare.weight is None and bare.bias is None and list(bare.state_dict()) == []
    half = onca.nn.LayerNorm(64, dtype=torch.bfloat16)
    assert half.weight.dtype == torch.bfloat16


@pytest.mark.parametrize("shape", [64, (64,), [64], torch.Size([64])], ids=repr)
def test_normalized_shape_forms(shape):
    assert onca.nn.LayerNorm(shape).normalized_shape == (64,)


def test_module_bad_arguments():
    with pytest.raises(ValueError, match="normalized_shape must be an int or a 1-element shape"):
        onca.nn.LayerNorm((4, 64))
    with pytest.raises(ValueError, match="normalized_shape must be an int or a 1-element shape"):
        onca.nn.LayerNorm(())
    with pytest.raises(TypeError, match="normalized_shape"):
        onca.nn.LayerNorm("64")
    with pytest.raises(ValueError, match="normalized_shape must be positive"):
        onca.nn.LayerNorm(0)
    with pytest.raises(ValueError, match="input must have last dimension 64"):
        onca.nn.LayerNorm(64, elementwise_affine=False)(torch.randn(2, 32))
    with pytest.raises(TypeError, match="input must be a torch.Tensor"):
        onca.nn.LayerNorm(64)([1.0])
