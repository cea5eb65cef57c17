"""The ``causal_mask`` switch: a decoder call with no mask, positions or cache attends through SDPA's
``is_causal`` (no materialised mask, no k/v copies to the query heads), eager and compiled; every
other call keeps transformers' mask, and the model computes its own loss either way."""

from __future__ import annotations

import copy

import pytest
import torch

import onca
from onca.integrations.transformers import causal_mask, family_of
from onca.integrations.transformers.presets import tiny_config

transformers = pytest.importorskip("transformers")

# Every switch but the mask's off: the model's own arithmetic, so losses agree to rounding.
MASK_ONLY = dict(rms_norm=False, layer_norm=False, mlp=False, rope=False, qk_norm_rope=False,
                 fused_linear_cross_entropy=False)


def _models(model_type, attn_implementation="sdpa", **switches):
    torch.manual_seed(0)
    # No cache, as in training with gradient checkpointing: transformers then looks for packed
    # sequences in the positions (with a cache it does not).
    config = tiny_config(model_type)
    config.use_cache, config._attn_implementation = False, attn_implementation
    reference = transformers.AutoModelForCausalLM.from_config(config).train()
    return reference, onca.apply(copy.deepcopy(reference), **{**MASK_ONLY, **switches})


def _tokens(vocab_size, batch=2, seq=12):
    return torch.randint(0, vocab_size, (batch, seq), generator=torch.Generator().manual_seed(1))


class _AttentionRecorder:
    """A Dynamo backend that runs the graph as is and keeps each SDPA call's mask and causal flag."""

    def __init__(self):
        self.calls = []

    def __call__(self, gm, example_inputs):
        for node in gm.graph.nodes:
            if node.target is torch.nn.functional.scaled_dot_product_attention:
                self.calls.append((node.kwargs.get("attn_mask") is None, node.kwargs.get("is_causal")))
        return gm.forward


def _eager_masks(monkeypatch):
    """Whether each eager SDPA call got a mask."""
    masked = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(*args, **kwargs):
        masked.append(kwargs.get("attn_mask") is not None)
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    return masked


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_a_provably_causal_call_compiles_to_sdpa_is_causal(model_type):
    reference, model = _models(model_type)
    assert model._onca_kernels == {"causal_mask": 1}
    ids = _tokens(model.config.vocab_size)
    expected = reference(input_ids=ids, labels=ids)
    expected.loss.backward()
    torch._dynamo.reset()
    recorder = _AttentionRecorder()
    compiled = torch.compile(lambda i: model(input_ids=i, labels=i), backend=recorder, fullgraph=True)
    out = compiled(ids)
    out.loss.backward()
    # Both layers' SDPA: no mask, causal (transformers alone builds the mask while tracing).
    assert recorder.calls == [(True, True)] * model.config.num_hidden_layers
    torch.testing.assert_close(out.loss, expected.loss, rtol=1e-6, atol=1e-6)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6,
                                   msg=lambda m, name=name: f"{name}: {m}")
    assert getattr(causal_mask._call, "causal", False) is False  # unmarked after the call


def _padded(ids):
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # left padding in the second row
    return {"attention_mask": mask}


def _packed(ids):
    # Two sequences packed in each row: positions restart at 5.
    positions = torch.cat([torch.arange(5), torch.arange(ids.shape[1] - 5)]).expand_as(ids)
    return {"position_ids": positions}


@pytest.mark.parametrize("extra", [_padded, _packed], ids=["padded", "packed"])
@pytest.mark.parametrize("compiled", [False, True])
def test_a_call_with_a_mask_or_positions_keeps_the_models_mask(extra, compiled, monkeypatch):
    reference, model = _models("qwen3")
    ids = _tokens(model.config.vocab_size)
    kwargs = extra(ids)
    expected = reference(input_ids=ids, labels=ids, **kwargs).loss  # eager: reads the positions
    torch._dynamo.reset()
    masked = _eager_masks(monkeypatch)
    forward = torch.compile(model, backend="eager", fullgraph=True) if compiled else model
    loss = forward(input_ids=ids, labels=ids, **kwargs).loss
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-6)
    if not compiled:
        assert masked == [True] * model.config.num_hidden_layers


@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
def test_an_implementation_other_than_sdpa_keeps_its_mask(attn_implementation):
    """The model's own attention takes no ``is_causal``: without a mask it would attend to the
    future, so the loss would differ. SDPA with the switch off compiles as the unpatched model."""
    switches = {"causal_mask": attn_implementation == "eager"}
    reference, model = _models("llama", attn_implementation, **switches)
    ids = _tokens(model.config.vocab_size)
    attention, losses = [], []
    for m in (reference, model):
        torch._dynamo.reset()
        attention.append(_AttentionRecorder())
        step = torch.compile(lambda i, m=m: m(input_ids=i, labels=i).loss, backend=attention[-1],
                             fullgraph=True)
        losses.append(step(ids))
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-6, atol=1e-6)
    assert attention[1].calls == attention[0].calls


def test_the_mark_is_per_call_and_restored_after_an_error():
    reference, model = _models("llama")
    ids = _tokens(model.config.vocab_size)
    with pytest.raises(Exception):
        model(input_ids=ids, labels=ids, position_ids=torch.zeros(5, 5, 5, dtype=torch.long))
    assert getattr(causal_mask._call, "causal", False) is False
    expected = reference(input_ids=ids, labels=ids).loss
    torch.testing.assert_close(model(input_ids=ids, labels=ids).loss, expected, rtol=1e-6, atol=1e-6)


def test_unapply_restores_the_mask_function_with_the_last_model():
    modeling = family_of("llama").modeling()
    original = modeling.create_causal_mask
    _, first = _models("llama")
    _, second = _models("llama")
    assert modeling.create_causal_mask.__onca__ == "causal_mask"
    onca.unapply(first)
    assert modeling.create_causal_mask.__onca__ == "causal_mask"  # the second model still uses it
    onca.unapply(second)
    assert modeling.create_causal_mask is original


def test_apply_to_patches_the_decoder_class_and_unapply_to_restores_it():
    modeling = family_of("llama").modeling()
    decoder_forward, original = modeling.LlamaModel.forward, modeling.create_causal_mask
    reference = _models("llama", causal_mask=False)[0]
    ids = _tokens(reference.config.vocab_size)
    try:
        onca.apply_to("llama", **MASK_ONLY)
        assert modeling.LlamaModel.forward.__onca__ == "causal_mask"
        assert modeling.create_causal_mask.__onca__ == "causal_mask"
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(reference.config).train()
        model.load_state_dict(reference.state_dict())
        torch._dynamo.reset()
        recorder = _AttentionRecorder()
        step = torch.compile(lambda i: model(input_ids=i, labels=i).loss, backend=recorder, fullgraph=True)
        loss = step(ids)
        assert recorder.calls == [(True, True)] * model.config.num_hidden_layers
        torch.testing.assert_close(loss, reference(input_ids=ids, labels=ids).loss, rtol=1e-6, atol=1e-6)
    finally:
        onca.unapply_to("llama")
    assert modeling.LlamaModel.forward is decoder_forward and modeling.create_causal_mask is original


@pytest.mark.skipif(not torch.cuda.is_available(), reason="host synchronisation is a CUDA notion")
@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_a_provably_causal_training_step_never_waits_for_the_device(model_type):
    """Without a cache transformers reads the positions on the host to rule out packed sequences
    (a synchronisation); the patched model's forward and backward, every switch at its default,
    run without one."""
    torch.manual_seed(0)
    config = tiny_config(model_type)
    config.use_cache = False
    model = onca.apply(transformers.AutoModelForCausalLM.from_config(config).cuda().train())
    ids = _tokens(config.vocab_size).cuda()
    model(input_ids=ids, labels=ids).loss.backward()  # the first call compiles and plans
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        model(input_ids=ids, labels=ids).loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_the_mark_is_per_thread():
    """A provably causal call in one thread (``nn.DataParallel``'s replicas run in threads) leaves
    another thread's mask to transformers."""
    import threading
    from types import SimpleNamespace

    config = SimpleNamespace(_attn_implementation="sdpa")
    mask = causal_mask.make_mask_function(lambda **kwargs: "transformers' mask")
    inside, release = threading.Event(), threading.Event()

    def decoder_body(self, input_ids=None, **kwargs):
        inside.set()
        release.wait(timeout=10)
        return mask(config=config)

    decoder = causal_mask.make_decoder_forward(decoder_body)
    seen = {}
    model = SimpleNamespace(config=config)
    worker = threading.Thread(target=lambda: seen.setdefault("causal", decoder(model)))
    worker.start()
    assert inside.wait(timeout=10)
    seen["other"] = mask(config=config)  # this thread runs no marked call
    release.set()
    worker.join()
    assert seen == {"causal": None, "other": "transformers' mask"}
