"""``onca.nn.FusedLinearCrossEntropyLoss`` against Hugging Face's causal-LM loss on the materialised logits
(``transformers.loss.loss_utils.ForCausalLMLoss``: logits upcast to fp32, shifted labels, mean or
sum / num_items_in_batch), called the way the model integration will call it."""

from __future__ import annotations

import pytest
import torch

import onca
from tests.helpers import SCALE, assert_close, leaf, randn

transformers = pytest.importorskip("transformers")
from transformers.loss.loss_utils import ForCausalLMLoss  # noqa: E402

B, S, H, V = {"cpu": (2, 13, 32, 1519), "gpu": (2, 2048, 4096, 128256)}[SCALE]


@pytest.mark.parametrize("num_items", [None, 17])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_matches_hugging_face_causal_lm_loss(device, dtype, num_items):
    hidden = randn(B, S, H, dtype=dtype, device=device)
    weight = randn(V, H, dtype=dtype, device=device, std=H ** -0.5 * 2)
    labels = torch.randint(0, V, (B, S), device=device)
    labels[0, :4] = -100  # a masked prompt
    h_hf, w_hf, h_o, w_o = leaf(hidden), leaf(weight), leaf(hidden), leaf(weight)

    loss_hf = ForCausalLMLoss(h_hf @ w_hf.T, labels, V, num_items_in_batch=num_items)
    shift_labels = torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:]
    module = onca.nn.FusedLinearCrossEntropyLoss(reduction="mean" if num_items is None else "sum",
                                                 chunk_tokens=8 if SCALE == "cpu" else None)
    loss = module(h_o, w_o, shift_labels)
    if num_items is not None:
        loss = loss / num_items
    assert loss.dtype == loss_hf.dtype == torch.float32
    assert_close(loss, loss_hf, dtype, "loss")
    loss_hf.backward()
    loss.backward()
    # HF's bf16 head rounds the logits' gradient to bf16 before its two matmuls, as ours does.
    assert_close(h_o.grad, h_hf.grad, dtype, "dhidden")
    assert_close(w_o.grad, w_hf.grad, dtype, "dweight")


def test_module_matches_functional_and_repr(device):
    hidden = randn(B * S, H, device=device)
    weight = randn(V, H, device=device, std=0.2)
    bias = randn(V, device=device, std=0.2)
    target = torch.randint(0, V, (B * S,), device=device)
    m = onca.nn.FusedLinearCrossEntropyLoss(label_smoothing=0.1, lse_square_scale=1e-4, softcap=30.0,
                                            return_z_loss=True, accum_dtype=torch.float32)
    loss, z = m(hidden, weight, target, bias)
    expected, z_expected = onca.functional.fused_linear_cross_entropy(
        hidden, weight, target, bias, label_smoothing=0.1, lse_square_scale=1e-4, softcap=30.0,
        return_z_loss=True, accum_dtype=torch.float32)
    assert torch.equal(loss, expected) and torch.equal(z, z_expected)
    assert "softcap=30.0" in repr(m) and list(m.parameters()) == []


def test_extended_options_match_functional_and_move_with_the_module(device):
    hidden = randn(B * S, H, device=device)
    weight = randn(V, H, device=device, std=0.2)
    target = torch.randint(0, V, (B * S,), device=device)
    target[::3] = -100
    ce_weight = torch.rand(V, device=device) + 0.5
    options = {"ce_weight": ce_weight, "use_token_scaling": True, "return_token_accuracy": True,
               "return_predicted_tokens": True}
    m = onca.nn.FusedLinearCrossEntropyLoss(label_smoothing=0.1, **options)
    assert list(m.state_dict()) == ["ce_weight"] and list(m.parameters()) == []
    out = m(hidden, weight, target)
    expected = onca.functional.fused_linear_cross_entropy(hidden, weight, target, label_smoothing=0.1,
                                                          **options)
    for a, b in zip(out, expected):
        assert (a is None and b is None) or torch.equal(a, b)
    assert out.z_loss is None and "use_token_scaling=True" in repr(m)
    assert m.to(torch.float64).ce_weight.dtype == torch.float64  # a buffer: follows the module


def test_bad_arguments():
    with pytest.raises(ValueError, match="reduction"):
        onca.nn.FusedLinearCrossEntropyLoss(reduction="batchmean")
    with pytest.raises(ValueError, match="accum_dtype"):
        onca.nn.FusedLinearCrossEntropyLoss(accum_dtype="fp32")
    with pytest.raises(ValueError, match="chunk_tokens"):
        onca.nn.FusedLinearCrossEntropyLoss(chunk_tokens=-1)
    with pytest.raises(ValueError, match="label_smoothing"):
        onca.nn.FusedLinearCrossEntropyLoss(label_smoothing=2.0)
    with pytest.raises(TypeError, match="ce_weight must be a torch.Tensor"):
        onca.nn.FusedLinearCrossEntropyLoss(ce_weight=[1.0, 2.0])
