"""onca.apply / apply_to / unapply: what gets patched, switches, errors, idempotence, restoration."""

from __future__ import annotations

import copy
import functools
import types

import pytest
import torch

import onca
from onca.integrations.transformers import FAMILIES, family_of
from onca.integrations.transformers.presets import tiny_config

transformers = pytest.importorskip("transformers")


def _model(model_type="qwen3", device="cpu", **kw):
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(tiny_config(model_type, **kw)).to(device)


def _patched_forwards(model):
    return sorted({m.__dict__["forward"].__onca__ for m in model.modules()
                   if getattr(m.__dict__.get("forward"), "__onca__", None)})


def test_apply_patches_every_kernel_and_unapply_restores(device):
    model = _model("qwen3", device)
    x = torch.randint(0, 256, (2, 12), device=device)
    before = model(input_ids=x, labels=x).loss.item()
    modeling = family_of("qwen3").modeling()
    original_rope, original_mask = modeling.apply_rotary_pos_emb, modeling.create_causal_mask
    onca.apply(model)
    assert _patched_forwards(model) == ["causal_mask", "fused_linear_cross_entropy", "mlp", "qk_norm_rope",
                                        "rms_norm"]
    assert model._onca_kernels["causal_mask"] == 1 and modeling.create_causal_mask.__onca__ == "causal_mask"
    # Qwen3's attention normalises and rotates q and k in one op: its q/k norms and its RoPE
    # function are never called, and left as they are. 2 layers x 2 decoder norms + the final norm.
    assert model._onca_kernels["rms_norm"] == 2 * 2 + 1 and model._onca_kernels["qk_norm_rope"] == 2
    assert "rope" not in model._onca_kernels and modeling.apply_rotary_pos_emb is original_rope
    onca.apply(model)  # twice: harmless
    assert model._onca_kernels["rms_norm"] == 5
    onca.unapply(model)
    onca.apply(model, qk_norm_rope=False)  # apart: the q/k norms (2 x 2 more) and RoPE's function
    assert model._onca_kernels["rms_norm"] == 2 * 4 + 1
    assert modeling.apply_rotary_pos_emb.__onca__ == "rope"
    onca.unapply(model)
    assert _patched_forwards(model) == []
    assert modeling.apply_rotary_pos_emb is original_rope and modeling.create_causal_mask is original_mask
    assert model(input_ids=x, labels=x).loss.item() == pytest.approx(before, rel=1e-6)


def test_switches_turn_kernels_off():
    model = onca.apply(_model("llama"), rope=False, fused_linear_cross_entropy=False)
    assert _patched_forwards(model) == ["causal_mask", "mlp", "rms_norm"]
    onca.unapply(model)
    with pytest.raises(TypeError, match="unknown Onca kernel switch"):
        onca.apply(_model("llama"), swiglu=False)


@pytest.mark.parametrize("value", ["false", "Eager", 0, None])
def test_switches_must_be_booleans_or_eager(value):
    model = _model("llama")
    modeling = family_of("llama").modeling()
    norm_forward, rope = modeling.LlamaRMSNorm.forward, modeling.apply_rotary_pos_emb
    with pytest.raises(TypeError, match='rms_norm must be True, False or "eager"'):
        onca.apply(model, rms_norm=value)
    with pytest.raises(TypeError, match='mlp must be True, False or "eager"'):
        onca.apply_to("llama", mlp=value)
    assert _patched_forwards(model) == [] and not hasattr(model, "_onca_kernels")
    assert modeling.LlamaRMSNorm.forward is norm_forward and modeling.apply_rotary_pos_emb is rope


def test_a_refused_apply_patches_nothing():
    # A base model has no LM head for the fused loss: refused before any norm or MLP is touched.
    base = transformers.AutoModel.from_config(tiny_config("llama"))
    rope = family_of("llama").modeling().apply_rotary_pos_emb
    with pytest.raises(ValueError, match="pass fused_linear_cross_entropy=False"):
        onca.apply(base)
    assert _patched_forwards(base) == [] and not hasattr(base, "_onca_kernels")
    assert family_of("llama").modeling().apply_rotary_pos_emb is rope
    onca.apply(base, fused_linear_cross_entropy=False)
    assert _patched_forwards(base) == ["causal_mask", "mlp", "rms_norm"]
    onca.unapply(base)


def test_unsupported_model_is_a_clear_error():
    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)
    with pytest.raises(ValueError, match="does not support model type 'gpt2'"):
        onca.apply(transformers.AutoModelForCausalLM.from_config(config))
    with pytest.raises(ValueError, match="does not support model type 'bert'"):
        onca.apply_to("bert")


def test_logits_when_asked_and_hf_output_types(device):
    model = onca.apply(_model("llama", device))
    x = torch.randint(0, 256, (2, 10), device=device)
    model.train()
    out = model(input_ids=x, labels=x)
    assert type(out).__name__ == "CausalLMOutputWithPast" and out.logits is None and out.loss is not None
    out = model(input_ids=x, labels=x, skip_logits=False)
    assert out.logits is not None and out.logits.shape == (2, 10, 256)
    model.eval()
    assert model(input_ids=x).logits.shape == (2, 10, 256)
    tup = model.train()(input_ids=x, labels=x, return_dict=False)
    assert isinstance(tup, tuple) and torch.is_tensor(tup[0])
    onca.unapply(model)


def test_num_items_in_batch_sums_then_divides(device):
    ref = _model("llama", device)
    model = onca.apply(copy.deepcopy(ref))
    x = torch.randint(0, 256, (2, 10), device=device)
    labels = x.clone()
    labels[0, :4] = -100
    n = (labels[:, 1:] != -100).sum()
    for m in (ref, model):
        m.train()
    expected = ref(input_ids=x, labels=labels, num_items_in_batch=n * 2).loss
    got = model(input_ids=x, labels=labels, num_items_in_batch=n * 2).loss
    assert got.item() == pytest.approx(expected.item(), rel=1e-4)
    onca.unapply(model)


def test_fully_masked_batch_gives_zero_loss_not_nan(device):
    """Every label ignored (a prompt-only micro-batch): the unpatched model's mean is NaN; the patched
    loss is 0 with zero gradients, so a training run goes on."""
    model = onca.apply(_model("qwen3", device)).train()
    x = torch.randint(0, 256, (2, 10), device=device)
    loss = model(input_ids=x, labels=torch.full_like(x, -100)).loss
    assert loss.item() == 0.0
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.equal(g, torch.zeros_like(g)) for g in grads)
    onca.unapply(model)


def test_apply_to_patches_classes_before_construction(device):
    family = family_of("mistral")
    modeling = family.modeling()
    norm_forward = modeling.MistralRMSNorm.forward
    try:
        onca.apply_to("mistral")
        model = _model("mistral", device)
        assert modeling.MistralRMSNorm.forward.__onca__ == "rms_norm"
        x = torch.randint(0, 256, (2, 8), device=device)
        model.train()
        assert model(input_ids=x, labels=x).logits is None
    finally:
        onca.unapply_to("mistral")
    assert modeling.MistralRMSNorm.forward is norm_forward


def test_auto_model_loader_returns_a_patched_model(tmp_path):
    model = onca.AutoModelForCausalLM.from_config(tiny_config("qwen2"), rope=False)
    assert "rms_norm" in model._onca_kernels and "rope" not in model._onca_kernels
    model.save_pretrained(tmp_path)
    loaded = onca.AutoModelForCausalLM.from_pretrained(str(tmp_path))
    assert loaded._onca_kernels["rms_norm"] > 0
    onca.unapply(loaded)
    onca.unapply(model)


def test_every_family_is_listed():
    assert set(FAMILIES) == {
        "llama", "mistral", "mixtral", "qwen2", "qwen3", "qwen3_moe", "gemma", "gemma2", "gemma3_text", "phi3",
        "olmo2", "granite",
        # issue 17: text
        "smollm3", "ministral", "nemotron", "gpt_oss", "olmo3", "glm4", "falcon_h1", "qwen3_next", "qwen3_5_text",
        "qwen3_5_moe_text", "hunyuan_v1_dense", "hunyuan_v1_moe", "exaone4", "deepseek_v4", "gemma4_text",
        "llama4_text",
        # issue 17: multimodal
        "llava", "mllama", "pixtral", "gemma3", "gemma4", "paligemma", "qwen2_vl", "qwen2_5_vl", "qwen3_vl",
        "qwen3_vl_moe", "glm4v", "glm4v_moe", "internvl", "smolvlm", "qwen3_5", "qwen3_5_moe", "llama4",
    }


def test_trainer_trains_a_patched_model_with_gradient_accumulation(tmp_path, device):
    """transformers' Trainer, unchanged, on a model from onca's loader: its loss (the fused linear
    cross entropy, with num_items_in_batch across 2 accumulated micro-batches) matches the
    unpatched model's under the same Trainer."""
    pytest.importorskip("accelerate")
    g = torch.Generator().manual_seed(0)
    rows = [{"input_ids": torch.randint(0, 256, (12,), generator=g)} for _ in range(8)]
    for i, r in enumerate(rows):
        r["labels"] = r["input_ids"].clone()
        r["labels"][: 1 + 3 * (i % 3)] = -100  # uneven valid-token counts: sum, then divide by all

    def train(model):
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=2, gradient_accumulation_steps=2,
            learning_rate=1e-3, logging_steps=1, save_strategy="no", report_to=[], seed=0,
            use_cpu=device == "cpu", dataloader_num_workers=0,
        )
        trainer = transformers.Trainer(model=model, args=args, train_dataset=rows)
        trainer.train()
        return [h["loss"] for h in trainer.state.log_history if "loss" in h]

    # The reference trains first: building a patched model patches the family's RoPE process-wide.
    torch.manual_seed(0)
    expected = train(transformers.AutoModelForCausalLM.from_config(tiny_config("llama")).to(device))
    torch.manual_seed(0)
    patched = onca.AutoModelForCausalLM.from_config(tiny_config("llama")).to(device)
    assert patched._onca_kernels["fused_linear_cross_entropy"] > 0
    try:
        got = train(patched)
    finally:
        onca.unapply(patched)
    assert len(got) == 2 and got == pytest.approx(expected, rel=1e-4)


def _wrap_forward(model, seen):
    """A wrapper on the instance like TRL's fused LM head: ``functools.wraps`` of the class's
    forward (copying its attributes, Onca's marker included), with a keyword of its own."""
    inner = model.forward

    @functools.wraps(type(model).forward)
    def wrapper(self, *args, extra_head=False, **kwargs):
        seen.append(extra_head)
        if extra_head:
            return "extra head"
        return inner(*args, **kwargs)

    model.forward = types.MethodType(wrapper, model)
    return model.forward


def test_apply_wraps_the_instance_forward_and_unapply_restores_it(device):
    seen = []
    model = _model("llama", device).train()
    wrapper = _wrap_forward(model, seen)
    onca.apply(model)
    assert model.forward is not wrapper and model._onca_kernels["fused_linear_cross_entropy"] == 1
    x = torch.randint(0, 256, (2, 8), device=device)
    # A keyword Onca does not own goes to the wrapper, labels and all.
    assert model(input_ids=x, labels=x, extra_head=True) == "extra head" and seen == [True]
    out = model(input_ids=x, labels=x)  # Onca's loss path: the wrapper is not called
    assert out.logits is None and seen == [True]
    model.eval()
    assert model(input_ids=x).logits.shape == (2, 8, 256) and seen == [True, False]
    onca.unapply(model)
    assert model.forward is wrapper


def test_copied_markers_do_not_fool_apply_or_unapply():
    seen = []
    onca.apply_to("llama")
    try:
        model = _model("llama")
        wrapper = _wrap_forward(model, seen)
        assert wrapper.__onca__ == "fused_linear_cross_entropy"  # copied by functools.wraps
        onca.apply(model, rope=False)
        assert model.forward is not wrapper  # not mistaken for Onca's: wrapped
        onca.unapply(model)
        assert model.forward is wrapper  # not mistaken for Onca's: kept
    finally:
        onca.unapply_to("llama")


def test_router_loss_is_added_when_the_original_adds_it():
    """The load-balancing loss follows the model class's own rule, which transformers' versions
    change: from the call only (Qwen3-VL-MoE in 5.17), else from the top-level config (Qwen3.5-MoE
    in 5.17), else from the text config (most)."""
    from types import SimpleNamespace

    from onca.integrations.transformers.forwards import _router_loss_switch

    def call_only(self, labels=None, **kwargs):
        if kwargs.get("output_router_logits", False):
            return "aux"

    def top_config(self, output_router_logits=None, **kwargs):
        output_router_logits = (
            output_router_logits if output_router_logits is not None else self.config.output_router_logits
        )

    def text_config(self, output_router_logits=None, **kwargs):
        output_router_logits = (
            output_router_logits if output_router_logits is not None
            else self.config.text_config.output_router_logits
        )

    top, text = SimpleNamespace(output_router_logits=False), SimpleNamespace(output_router_logits=True)
    for forward, unset in ((call_only, False), (top_config, False), (text_config, True)):
        switch = _router_loss_switch(forward)
        assert switch(top, text, None) is unset, forward.__name__
        assert switch(top, text, True) is True and switch(top, text, False) is False, forward.__name__


@pytest.mark.parametrize("route", ["apply", "apply_to"])
def test_eager_setting_runs_the_models_own_code_while_compiling(route, device, monkeypatch):
    """``"eager"`` (the norms' and MLP's default): Onca's kernel outside torch.compile, the class's
    own forward while Dynamo traces, for the class-level patch too; True keeps Onca's kernel."""
    from onca.ops._contract import Op

    modeling = family_of("llama").modeling()
    original = modeling.LlamaRMSNorm.forward
    model = _model("llama", device)
    norm = model.model.norm
    torch.nn.init.uniform_(norm.weight)
    x = torch.randn(3, 64, device=device)
    expected = original(norm, x)
    ran = []
    monkeypatch.setattr(Op, "__call__", functools.partialmethod(
        lambda op, call, *args: ran.append(op.name) or call(op, *args), Op.__call__))
    if route == "apply":
        onca.apply(model)
    else:
        onca.apply_to("llama")
        norm = modeling.LlamaRMSNorm(64, eps=norm.variance_epsilon).to(device)
        norm.weight.data.copy_(model.model.norm.weight)
    try:
        norm(x)
        assert ran == ["rms_norm_forward"]
        with monkeypatch.context() as compiling:
            compiling.setattr(torch.compiler, "is_compiling", lambda: True)
            assert torch.equal(norm(x), expected)  # the class's own forward, bit for bit
            assert ran == ["rms_norm_forward"]
            if route == "apply":  # another setting: unapply first (a second apply leaves a patch as it is)
                onca.apply(onca.unapply(model), rms_norm=True)
                norm(x)
                assert ran == ["rms_norm_forward"] * 2
    finally:
        onca.unapply(model) if route == "apply" else onca.unapply_to("llama")
    assert modeling.LlamaRMSNorm.forward is original


@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_moe", "gemma3_text"])
@pytest.mark.parametrize("use_cache", [False, True])
def test_qk_norm_rope_attention_computes_the_models_own(model_type, use_cache, device, monkeypatch):
    """The fused q/k norm + RoPE attention gives the model's loss and gradients, with or without
    a KV cache filled as it goes (a training forward that left ``use_cache`` on), and the same
    greedy generation."""
    from onca import functional as OF

    if not FAMILIES[model_type].available():
        pytest.skip(f"the installed transformers has no {model_type}")
    reference = _model(model_type, device)
    model = copy.deepcopy(reference)
    onca.apply(model, rms_norm=False, mlp=False, rope=False, fused_linear_cross_entropy=False,
               causal_mask=False)
    assert model._onca_kernels == {"qk_norm_rope": 2}
    calls = []
    fused = OF.rms_norm_rope
    monkeypatch.setattr(OF, "rms_norm_rope", lambda *a, **k: calls.append(a[0].shape) or fused(*a, **k))
    ids = torch.randint(0, 256, (2, 12), device=device)
    losses = []
    for m in (reference, model):
        loss = m(input_ids=ids, labels=ids, use_cache=use_cache).loss
        loss.backward()
        losses.append(loss.detach())
    assert len(calls) == 2  # q and k together, in each of the two layers
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-5)
    for (name, p), q in zip(reference.named_parameters(), model.parameters()):
        if p.grad is not None:
            torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-5,
                                       msg=lambda m, name=name: f"{name}: {m}")
    prompt = ids[:, :4]
    for m in (reference, model):  # generate's router loss is transformers' own (it fails on a GPU)
        m.config.output_router_logits = False
    assert torch.equal(model.generate(prompt, max_new_tokens=3, do_sample=False),
                       reference.generate(prompt, max_new_tokens=3, do_sample=False))


def test_a_family_without_fusable_q_k_norms_is_refused_by_name(monkeypatch):
    from onca.integrations.transformers import forwards

    monkeypatch.setattr(forwards, "qk_norm_fusable", lambda module: False)
    model = _model("qwen3")
    with pytest.raises(ValueError, match="found no Qwen3Attention with q/k RMSNorms.*qk_norm_rope=False"):
        onca.apply(model)
    assert _patched_forwards(model) == []
    onca.apply(model, qk_norm_rope=False)
    onca.unapply(model)


def test_an_attention_the_fused_forward_cannot_reproduce_keeps_its_own():
    """q/k norms of different epsilons or classes, or an attention logit soft-cap, are not the fused
    op's: such a layer is not taken."""
    from onca.integrations.transformers import forwards

    model = _model("gemma3_text")
    attention = model.model.layers[0].self_attn
    assert forwards.qk_norm_fusable(attention)
    attention.attn_logit_softcapping = 50.0
    assert not forwards.qk_norm_fusable(attention)
    attention.attn_logit_softcapping = None
    attention.k_norm.eps = attention.q_norm.eps * 2
    assert not forwards.qk_norm_fusable(attention)


def test_apply_to_fuses_the_q_k_norms_and_rope_in_the_attention_class(device, monkeypatch):
    """``apply_to`` patches Qwen3's attention class (its RoPE function stays transformers': never
    called), a model built afterwards computes its own loss through the fused op, and
    ``unapply_to`` restores the class."""
    from onca import functional as OF

    modeling = family_of("qwen3").modeling()
    attention_forward, rope = modeling.Qwen3Attention.forward, modeling.apply_rotary_pos_emb
    reference = _model("qwen3", device)
    ids = torch.randint(0, 256, (2, 12), device=device)
    expected = reference(input_ids=ids, labels=ids).loss
    calls = []
    fused = OF.rms_norm_rope
    monkeypatch.setattr(OF, "rms_norm_rope", lambda *a, **k: calls.append(1) or fused(*a, **k))
    try:
        onca.apply_to("qwen3", rms_norm=False, mlp=False, fused_linear_cross_entropy=False)
        assert modeling.Qwen3Attention.forward.__onca__ == "qk_norm_rope"
        assert modeling.apply_rotary_pos_emb is rope
        model = _model("qwen3", device)
        torch.testing.assert_close(model(input_ids=ids, labels=ids).loss, expected, rtol=1e-5, atol=1e-5)
        assert len(calls) == 2  # one op per layer, q and k together
    finally:
        onca.unapply_to("qwen3")
    assert modeling.Qwen3Attention.forward is attention_forward
