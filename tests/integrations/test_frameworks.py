"""The framework recipes of docs/frameworks.md, each by the code path it reaches: an Accelerate
training loop end to end (the Hugging Face Trainer's is in test_patching.py), instance patching
after ``from_pretrained`` with the logits kept (verl, VeOmni), and class patching before the model
is built with the fused loss off (LLaMA-Factory's logit-needing stages, ms-swift). The frameworks
themselves are not installed here."""

from __future__ import annotations

import copy

import pytest
import torch

import onca
from onca.integrations.transformers import family_of
from onca.integrations.transformers.presets import tiny_config
from tests.helpers import assert_close

transformers = pytest.importorskip("transformers")


def _batches(device, steps=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        ids = torch.randint(0, 256, (2, 12), generator=g)
        labels = ids.clone()
        labels[:, :3] = -100  # a prompt the loss ignores
        yield {"input_ids": ids.to(device), "labels": labels.to(device)}


def _model(model_type, device):
    return transformers.AutoModelForCausalLM.from_config(tiny_config(model_type)).to(device)


def test_accelerate_loop_trains_like_the_unpatched_model(device):
    accelerate = pytest.importorskip("accelerate")

    def train(model):
        accelerator = accelerate.Accelerator(cpu=device == "cpu")
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model, optimizer = accelerator.prepare(model, optimizer)
        losses = []
        for batch in _batches(accelerator.device):
            loss = model(**batch).loss
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        return losses

    # The reference trains first: patching a model patches its family's RoPE process-wide.
    torch.manual_seed(0)
    expected = train(_model("llama", device))
    torch.manual_seed(0)
    model = onca.apply(_model("llama", device))
    assert model._onca_kernels["fused_linear_cross_entropy"] > 0
    try:
        got = train(model)
    finally:
        onca.unapply(model)
    assert len(got) == 3 and got == pytest.approx(expected, rel=1e-4)


def _token_log_probs(logits, ids):
    """What an RL framework computes from the logits: each next token's log-probability."""
    log_probs = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    return log_probs.gather(-1, ids[:, 1:, None]).squeeze(-1)


def test_instance_patch_after_loading_keeps_the_logits(device):
    torch.manual_seed(0)
    reference = _model("qwen3", device)
    model = copy.deepcopy(reference)
    ids = next(_batches(device))["input_ids"]
    expected = _token_log_probs(reference(input_ids=ids).logits, ids)
    expected.sum().backward()
    onca.apply(model, fused_linear_cross_entropy=False)  # verl's and VeOmni's place for it
    assert model._onca_kernels["rms_norm"] > 0 and "fused_linear_cross_entropy" not in model._onca_kernels
    try:
        got = _token_log_probs(model(input_ids=ids).logits, ids)
        got.sum().backward()
    finally:
        onca.unapply(model)
    assert_close(got, expected, name="log-probs")
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert_close(p.grad, q.grad, name=name)


def test_class_patch_before_loading_with_the_logits_kept(device):
    torch.manual_seed(0)
    reference = _model("qwen3", device)
    batch = next(_batches(device))
    expected = reference(**batch)
    norm_class = family_of("qwen3").modeling().Qwen3RMSNorm
    try:
        onca.apply_to("qwen3", fused_linear_cross_entropy=False)  # before the framework builds it
        model = _model("qwen3", device)
        model.load_state_dict(reference.state_dict())
        assert norm_class.forward.__onca__ == "rms_norm"
        got = model(**batch)
    finally:
        onca.unapply_to("qwen3")
    assert got.logits is not None
    assert_close(got.logits, expected.logits, name="logits")
    assert_close(got.loss, expected.loss, name="loss")
