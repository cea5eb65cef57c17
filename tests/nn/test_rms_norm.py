"""``onca.nn.RMSNorm`` is a drop-in for the Hugging Face RMSNorm modules: same state dict, same math."""

from __future__ import annotations

import pytest
import torch

import onca
from tests.helpers import SCALE, assert_close, randn

transformers = pytest.importorskip("transformers")
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm  # noqa: E402
from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm  # noqa: E402
from transformers.models.llama.modeling_llama import LlamaRMSNorm  # noqa: E402
from transformers.models.mistral.modeling_mistral import MistralRMSNorm  # noqa: E402
from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm  # noqa: E402
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm  # noqa: E402

HIDDEN = {"cpu": 96, "gpu": 4096}[SCALE]
SHAPE = {"cpu": (2, 5, HIDDEN), "gpu": (4, 2048, HIDDEN)}[SCALE]

LLAMA_STYLE = [LlamaRMSNorm, MistralRMSNorm, Qwen2RMSNorm, Qwen3RMSNorm]
GEMMA_STYLE = [GemmaRMSNorm, Gemma3RMSNorm]


def _pair(hf_cls, dtype, device):
    hf = hf_cls(HIDDEN, eps=1e-6).to(device=device, dtype=dtype)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(HIDDEN) * 0.3 + (1.0 if hf_cls in LLAMA_STYLE else 0.0))
    if hf_cls in LLAMA_STYLE:
        ours = onca.nn.RMSNorm(HIDDEN, eps=1e-6)
    else:
        ours = onca.nn.RMSNorm(HIDDEN, eps=1e-6, offset=1.0, casting_mode="gemma", init_fn="zeros")
    ours = ours.to(device=device, dtype=dtype)
    missing = ours.load_state_dict(hf.state_dict())
    assert not missing.missing_keys and not missing.unexpected_keys
    return hf, ours


@pytest.mark.parametrize("hf_cls", LLAMA_STYLE + GEMMA_STYLE, ids=lambda c: c.__name__)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_matches_hugging_face_module(device, hf_cls, dtype):
    hf, ours = _pair(hf_cls, dtype, device)
    x = randn(*SHAPE, dtype=dtype, device=device)
    x_hf, x_ours = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_hf, y_ours = hf(x_hf), ours(x_ours)
    assert y_ours.dtype == y_hf.dtype
    assert_close(y_ours, y_hf, dtype, "y")
    dy = randn(*SHAPE, dtype=dtype, device=device)
    y_hf.backward(dy)
    y_ours.backward(dy)
    # Hugging Face's bf16 backward rounds its intermediate gradients to bf16; ours stays in fp32.
    # The two are compared at bf16's tolerance; each is checked against float64 in tests/ops.
    assert_close(x_ours.grad, x_hf.grad, dtype, "dx")
    assert_close(ours.weight.grad, hf.weight.grad, dtype, "dw")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_without_weight_matches_torch_module(device, dtype):
    """``elementwise_affine=False``: no parameter, torch.nn.RMSNorm's function and input gradient."""
    ref = torch.nn.RMSNorm(HIDDEN, eps=1e-6, elementwise_affine=False)
    ours = onca.nn.RMSNorm(HIDDEN, eps=1e-6, elementwise_affine=False)
    assert ours.weight is None and list(ours.parameters()) == [] and list(ours.state_dict()) == []
    assert "elementwise_affine=False" in repr(ours)
    x = randn(*SHAPE, dtype=dtype, device=device)
    x_ref, x_ours = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_ref, y_ours = ref(x_ref), ours(x_ours)
    assert y_ours.dtype == y_ref.dtype
    assert_close(y_ours, y_ref, dtype, "y")
    dy = randn(*SHAPE, dtype=dtype, device=device)
    y_ref.backward(dy)
    y_ours.backward(dy)
    assert_close(x_ours.grad, x_ref.grad, dtype, "dx")


def test_module_defaults_and_repr():
    m = onca.nn.RMSNorm(64)
    assert torch.equal(m.weight.detach(), torch.ones(64))
    assert m.variance_epsilon == m.eps == 1e-6
    g = onca.nn.RMSNorm(64, offset=1.0, casting_mode="gemma", init_fn="zeros")
    assert torch.equal(g.weight.detach(), torch.zeros(64))
    assert "casting_mode='gemma'" in repr(g)
    assert list(m.state_dict()) == ["weight"]


def test_module_bad_arguments():
    with pytest.raises(ValueError, match="casting_mode"):
        onca.nn.RMSNorm(64, casting_mode="bf16")
    with pytest.raises(ValueError, match="init_fn"):
        onca.nn.RMSNorm(64, init_fn="normal")
    with pytest.raises(ValueError, match="hidden_size"):
        onca.nn.RMSNorm(0)
    with pytest.raises(TypeError, match="elementwise_affine"):
        onca.nn.RMSNorm(64, elementwise_affine="no")
