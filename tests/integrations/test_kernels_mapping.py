"""onca.integrations.kernels: Onca's layers through the kernels package's ``kernelize``, against
the unpatched model (loss and gradients), and the coverage walk over transformers' marked models.

``ONCA_KERNELS_COVERAGE=all`` walks every marked causal-LM class (minutes); CI walks a sample.
"""

from __future__ import annotations

import copy
import glob
import inspect
import os
import re
from pathlib import Path

import pytest
import torch

import onca.integrations.kernels as onca_kernels
from onca.integrations.transformers import forwards
from onca.integrations.transformers.presets import tiny_config
from tests.helpers import assert_close, tolerance

transformers = pytest.importorskip("transformers")
kernels = pytest.importorskip("kernels")
Mode = kernels.Mode

MODES = (Mode.TRAINING, Mode.INFERENCE, Mode.TRAINING | Mode.TORCH_COMPILE,
         Mode.INFERENCE | Mode.TORCH_COMPILE)
COVERAGE_SAMPLE = ("llama", "olmo3", "nanochat", "phimoe", "seed_oss", "glm4")


@pytest.fixture
def restore_marks():
    """Undo what marking changes process-wide (module-level functions replaced by the kernels
    package's function modules, class markers), so other tests see transformers as it was."""
    yield
    onca_kernels.unmark_transformers_layers()


def _kernelize(model, mode=Mode.TRAINING, device="cpu", **mapping_options):
    onca_kernels.mark_transformers_layers(model)
    with kernels.use_kernel_mapping(onca_kernels.mapping(**mapping_options), inherit_mapping=False):
        kernels.kernelize(model, mode=mode, device=device)
    return model


def _onca_layers(model) -> dict[str, int]:
    """How many layers (and kernelized functions, one per layer that calls it) run an Onca
    forward, per kind. transformers 5.25 and later give each calling layer its own function module;
    where Onca marks the layers, the calling layers share one."""
    counts: dict[str, int] = {}
    modules = list(model.modules())
    funcs = [f for m in modules for f in m.__dict__.get("_kernel_funcs", {}).values()]
    for module in [*modules, *funcs]:
        forward = module.__dict__.get("forward")
        kind = getattr(forward, "__onca__", None)
        # The layers that pick their arithmetic from the class count only where they found one.
        if getattr(forward, "__func__", None) is forwards.RMSNormLayer.forward:
            kind = kind if forwards.rms_norm_arithmetic(type(module)) else None
        if kind == "rope":
            kind = kind if forwards.rope_variant(type(module)) else None
        if kind:
            counts[kind] = counts.get(kind, 0) + 1
    return counts


def _loss_and_grads(model, tokens):
    torch.manual_seed(0)  # the same dropout and router noise in every run
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=tokens, labels=tokens).loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def _check_against_unpatched(ref, tokens, dtype, mode=Mode.TRAINING):
    """Loss and gradients of ``ref`` unpatched, then of a kernelized copy: they must match.

    In bf16 a whole model's gradient passes through many layers that each round where the eager
    model rounds differently (Onca keeps fp32 inside a kernel), so the two bf16 runs are compared
    with the same model in fp32: Onca's error must be about eager bf16's, within two norm tolerances
    (Triton's interpreter truncates to bf16, so on the CPU each rounding can be a whole ulp off)."""
    model = copy.deepcopy(ref)
    truth = copy.deepcopy(ref).float() if dtype != torch.float32 else None
    ref_loss, ref_grads = _loss_and_grads(ref, tokens)
    _kernelize(model, mode)
    served = _onca_layers(model)
    loss, grads = _loss_and_grads(model, tokens)
    assert_close(loss, ref_loss, dtype, name="loss")
    assert grads.keys() == ref_grads.keys()
    if truth is None:
        for name, grad in grads.items():
            assert_close(grad, ref_grads[name], dtype, name=f"grad of {name}")
        return served
    _, true_grads = _loss_and_grads(truth, tokens)
    for name, grad in grads.items():
        onca_error, eager_error = (_relative_error(g, true_grads[name]) for g in (grad, ref_grads[name]))
        assert onca_error <= 1.5 * eager_error + 2 * tolerance(dtype)[2], (
            f"grad of {name}: relative error {onca_error:.3g}, eager bf16's {eager_error:.3g}")
    return served


def _relative_error(actual, expected) -> float:
    expected = expected.double()
    return ((actual.double() - expected).norm() / expected.norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernelize_runs_onca_with_the_unpatched_loss_and_gradients(dtype, profile, restore_marks):
    ref = transformers.AutoModelForCausalLM.from_config(tiny_config("qwen3")).to(dtype)
    tokens = torch.randint(0, 256, (2, 7))
    served = _check_against_unpatched(ref, tokens, dtype)
    # 2 layers x (2 decoder norms + q/k norms) + the final norm; RoPE in each layer's attention.
    assert served == {"rms_norm": 9, "rope": 2}


@pytest.mark.parametrize("mode", MODES, ids=str)
@pytest.mark.parametrize("eager_only", ["default", "none"])
def test_every_mode_and_device_loads_onca(mode, eager_only, restore_marks):
    """Every layer in every mode on every device, except that by default (as ``onca.apply``) the
    norms and the MLP keep the model's own forward in the torch.compile modes."""
    options = {} if eager_only == "default" else {"eager_only": ()}
    # Qwen3: transformers 5.25 no longer marks OLMo 2's layers (its classes carry no decorator).
    ref = transformers.AutoModelForCausalLM.from_config(tiny_config("qwen3"))
    model = _kernelize(copy.deepcopy(ref), mode, **options)
    compiled = Mode.TORCH_COMPILE in mode
    norms = {} if compiled and eager_only == "default" else {"rms_norm": 2 * 4 + 1}
    assert _onca_layers(model) == {**norms, "rope": 2}
    tokens = torch.randint(0, 256, (1, 5))
    assert_close(model(input_ids=tokens).logits, ref(input_ids=tokens).logits, torch.float32)
    for layer, devices in onca_kernels.mapping(**options).items():
        assert set(devices) == set(onca_kernels.DEVICES)
        eager_layer = eager_only == "default" and onca_kernels.SWITCHES[layer] in ("rms_norm", "mlp")
        for repos in devices.values():
            assert set(repos) == ({Mode.TRAINING, Mode.INFERENCE} if eager_layer else set(MODES))
            assert all(repo.load() is onca_kernels.LAYERS[layer] for repo in repos.values())


def test_eager_only_names_switches():
    with pytest.raises(ValueError, match="eager_only names unknown switch"):
        onca_kernels.mapping(eager_only={"rmsnorm"})


def _global_mapping():
    """The kernels package's process-wide mapping (a private ContextVar; kernels 0.19 moved it)."""
    import importlib

    for name in ("kernels._internals.layer.globals", "kernels.layer.globals"):
        try:
            return importlib.import_module(name)._KERNEL_MAPPING
        except (ImportError, AttributeError):
            continue
    pytest.skip("the installed kernels package keeps its global mapping elsewhere")


def test_register_makes_plain_kernelize_use_onca(restore_marks):
    global_mapping = _global_mapping()
    saved = global_mapping.get()
    token = global_mapping.set({})
    try:
        onca_kernels.register()
        model = transformers.AutoModelForCausalLM.from_config(tiny_config("llama"))
        onca_kernels.mark_transformers_layers(model)
        kernels.kernelize(model, mode=Mode.TRAINING, device="cpu")
        assert _onca_layers(model) == {"rms_norm": 5, "rope": 2}
    finally:
        global_mapping.reset(token)
    assert global_mapping.get() is saved


def test_register_overlays_transformers_default_mapping(monkeypatch):
    hub_kernels = pytest.importorskip("transformers.integrations.hub_kernels")
    liger = object()
    default = {"RMSNorm": {"cuda": {Mode.TRAINING: liger}, "rocm": {Mode.TRAINING: liger}}}
    monkeypatch.setattr(hub_kernels, "get_kernel_mapping_transformers", lambda: default, raising=False)
    monkeypatch.setattr(kernels, "register_kernel_mapping", lambda mapping: None)
    onca_kernels.register()
    assert default["RMSNorm"]["rocm"] == {Mode.TRAINING: liger}  # devices Onca does not serve stay
    assert default["RMSNorm"]["cuda"][Mode.TRAINING].load() is forwards.RMSNormLayer
    assert default["rotary_pos_emb"]["cpu"][Mode.INFERENCE].load() is forwards.RotaryPosEmbLayer


def test_rms_norm_arithmetic_is_read_from_the_class():
    from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNorm

    class ScaledNorm(torch.nn.Module):  # an arithmetic Onca does not know: keeps its own forward
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.full((8,), 2.0))

        def forward(self, hidden_states):
            return hidden_states * self.weight

    assert forwards.rms_norm_arithmetic(Qwen3RMSNorm) == "llama"
    assert forwards.rms_norm_arithmetic(Olmo2RMSNorm) == "olmo2"
    assert forwards.rms_norm_arithmetic(Qwen3_5RMSNorm) == "gemma"
    assert forwards.rms_norm_arithmetic(ScaledNorm) == ""
    norm = ScaledNorm()
    norm.forward = forwards.RMSNormLayer.forward.__get__(norm)
    x = torch.randn(3, 8)
    assert torch.equal(norm(x), x * 2.0)


def test_rope_variant_is_read_from_the_function(restore_marks):
    def func_module(modeling):
        func = modeling.apply_rotary_pos_emb
        if isinstance(func, torch.nn.Module):  # transformers 5.25 and later marked it at import
            return type(func)
        return type(kernels.use_kernel_forward_from_hub("rotary_pos_emb")(func))

    from transformers.models.gpt_oss import modeling_gpt_oss
    from transformers.models.nanochat import modeling_nanochat
    from transformers.models.olmo2 import modeling_olmo2
    from transformers.models.qwen3 import modeling_qwen3

    assert forwards.rope_variant(func_module(modeling_qwen3)) == "promoted"
    assert forwards.rope_variant(func_module(modeling_olmo2)) == "cast_back"
    assert forwards.rope_variant(func_module(modeling_gpt_oss)) == ""  # half-width cos/sin: its own
    assert forwards.rope_variant(func_module(modeling_nanochat)) == ""  # rotate_half flips signs


def test_kernelized_layers_compile_fullgraph(restore_marks):
    model = _kernelize(transformers.AutoModelForCausalLM.from_config(tiny_config("qwen3")),
                       Mode.TRAINING | Mode.TORCH_COMPILE, eager_only=())
    assert _onca_layers(model) == {"rms_norm": 9, "rope": 2}
    tokens = torch.randint(0, 256, (1, 6))
    eager = model(input_ids=tokens).logits
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(input_ids=tokens).logits, eager)


# --------------------------------------------------------------------------------- coverage walk

_TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, vocab_size=256, max_position_embeddings=256,
             moe_intermediate_size=32, num_experts=4, num_local_experts=4, n_routed_experts=4,
             num_experts_per_tok=2, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def marked_causal_lm_classes() -> list[tuple[str, str]]:
    """(model type, class name) of every causal-LM class whose modelling file carries the markers."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    root = os.path.dirname(transformers.models.__file__)
    marked_dirs = {os.path.basename(os.path.dirname(path))
                   for path in glob.glob(os.path.join(root, "*", "modeling_*.py"))
                   if re.search(r"use_kernel_(forward|func)_from_hub\(", Path(path).read_text())}
    return sorted((model_type, name) for model_type, name in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items()
                  if isinstance(name, str) and _module_dir(model_type) in marked_dirs)


def _module_dir(model_type: str) -> str:
    from transformers.models.auto.configuration_auto import model_type_to_module_name

    return model_type_to_module_name(model_type)


def tiny_model(model_type: str, class_name: str):
    """A tiny model of the class from its config's defaults with small sizes, or None where the
    config cannot be built that way or the unpatched model does not run on it (multimodal
    configs, required sub-configs, layer layouts that two layers cannot hold)."""
    config_class = transformers.AutoConfig.for_model(model_type).__class__
    accepted = inspect.signature(config_class.__init__).parameters
    try:
        config = config_class(**{k: v for k, v in _TINY.items() if k in accepted})
        model = getattr(transformers, class_name)(config).float().train()
        if sum(p.numel() for p in model.parameters()) > 5_000_000:
            return None  # a size this walk did not reach (e.g. a vocabulary it cannot shrink)
        with torch.no_grad():
            model(input_ids=torch.full((1, 2), 3))
    except Exception:  # noqa: BLE001  (any failure means: not buildable generically)
        return None
    return model


def _walk():
    classes = marked_causal_lm_classes()
    if os.environ.get("ONCA_KERNELS_COVERAGE") != "all":
        classes = [c for c in classes if c[0] in COVERAGE_SAMPLE]
    return classes


@pytest.mark.parametrize("model_type,class_name", _walk())
def test_coverage_walk(model_type, class_name, restore_marks):
    torch.manual_seed(0)
    ref = tiny_model(model_type, class_name)
    if ref is None:
        pytest.skip(f"no generic tiny config for {class_name}")
    tokens = torch.randint(3, ref.config.get_text_config().vocab_size, (2, 6))
    served = _check_against_unpatched(ref, tokens, torch.float32)
    if not served:
        pytest.skip(f"{class_name}: its marked layers are none Onca serves")
