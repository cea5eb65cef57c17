"""``onca.nn.FusedAddRMSNorm`` matches a decoder layer's residual add followed by the Hugging Face
RMSNorm module, loading that module's state dict unchanged."""

from __future__ import annotations

import pytest
import torch

import onca
from onca.device import accelerator, interpreter_active
from tests.helpers import SCALE, assert_close, randn

transformers = pytest.importorskip("transformers")
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm  # noqa: E402
from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm  # noqa: E402
from transformers.models.llama.modeling_llama import LlamaRMSNorm  # noqa: E402
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm  # noqa: E402

HIDDEN = {"cpu": 96, "gpu": 4096}[SCALE]
SHAPE = {"cpu": (2, 5, HIDDEN), "gpu": (4, 2048, HIDDEN)}[SCALE]

LLAMA_STYLE = [LlamaRMSNorm, Qwen3RMSNorm]
GEMMA_STYLE = [GemmaRMSNorm, Gemma3RMSNorm]


def _pair(hf_cls, dtype, device):
    hf = hf_cls(HIDDEN, eps=1e-6).to(device=device, dtype=dtype)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(HIDDEN) * 0.3 + (1.0 if hf_cls in LLAMA_STYLE else 0.0))
    if hf_cls in LLAMA_STYLE:
        ours = onca.nn.FusedAddRMSNorm(HIDDEN, eps=1e-6)
    else:
        ours = onca.nn.FusedAddRMSNorm(HIDDEN, eps=1e-6, offset=1.0, casting_mode="gemma", init_fn="zeros")
    ours = ours.to(device=device, dtype=dtype)
    result = ours.load_state_dict(hf.state_dict())
    assert not result.missing_keys and not result.unexpected_keys
    return hf, ours


@pytest.mark.parametrize("hf_cls", LLAMA_STYLE + GEMMA_STYLE, ids=lambda c: c.__name__)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_matches_add_then_hugging_face_norm(device, hf_cls, dtype):
    hf, ours = _pair(hf_cls, dtype, device)
    x, residual = randn(*SHAPE, dtype=dtype, device=device), randn(*SHAPE, dtype=dtype, device=device)
    leaves = [t.clone().requires_grad_() for t in (x, residual, x, residual)]
    # The decoder layer: hidden_states = residual + hidden_states; residual = hidden_states; norm.
    h_hf = leaves[1] + leaves[0]
    y_hf = hf(h_hf)
    y_ours, h_ours = ours(leaves[2], leaves[3])
    assert y_ours.dtype == y_hf.dtype and h_ours.dtype == h_hf.dtype
    assert_close(y_ours, y_hf, dtype, "y")
    dy, dh = randn(*SHAPE, dtype=dtype, device=device), randn(*SHAPE, dtype=dtype, device=device)
    torch.autograd.backward((y_hf, h_hf), (dy, dh))
    torch.autograd.backward((y_ours, h_ours), (dy, dh))
    # Hugging Face's bf16 backward rounds its intermediate gradients to bf16; ours stays in fp32.
    assert_close(leaves[2].grad, leaves[0].grad, dtype, "dx")
    assert_close(leaves[3].grad, leaves[1].grad, dtype, "dresidual")
    assert_close(ours.weight.grad, hf.weight.grad, dtype, "dw")
    if interpreter_active() and dtype == torch.bfloat16:  # the interpreter truncates fp32 -> bf16
        assert_close(h_ours, h_hf, dtype, "new residual")
    elif accelerator() != "cpu" or interpreter_active():  # (tools/sm90_compile.py runs nothing)
        assert torch.equal(h_ours, h_hf)


def test_module_defaults_and_repr():
    m = onca.nn.FusedAddRMSNorm(64)
    assert torch.equal(m.weight.detach(), torch.ones(64))
    assert m.variance_epsilon == m.eps == 1e-6
    assert list(m.state_dict()) == ["weight"]
    g = onca.nn.FusedAddRMSNorm(64, offset=1.0, casting_mode="gemma", init_fn="zeros",
                                overwrite_grad_output=True)
    assert torch.equal(g.weight.detach(), torch.zeros(64))
    assert "casting_mode='gemma'" in repr(g) and "overwrite_grad_output=True" in repr(g)


def test_module_overwrite_grad_output_backward(device):
    m = onca.nn.FusedAddRMSNorm(HIDDEN, overwrite_grad_output=True).to(device)
    x = randn(2, HIDDEN, device=device, requires_grad=True)
    residual = randn(2, HIDDEN, device=device, requires_grad=True)
    y, _ = m(x, residual)
    dy = randn(2, HIDDEN, device=device)
    dx, = torch.autograd.grad(y, (x,), dy)
    assert dx.data_ptr() == dy.data_ptr()


def test_module_bad_arguments():
    with pytest.raises(ValueError, match="casting_mode"):
        onca.nn.FusedAddRMSNorm(64, casting_mode="bf16")
    with pytest.raises(ValueError, match="init_fn"):
        onca.nn.FusedAddRMSNorm(64, init_fn="normal")
    with pytest.raises(ValueError, match="hidden_size"):
        onca.nn.FusedAddRMSNorm(0)
