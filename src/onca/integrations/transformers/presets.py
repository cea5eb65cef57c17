"""Model configurations to build with random weights: a tiny one for every family (tests, CPU
demos) and real architectures' shapes from the model registry (GPU comparisons)."""

from __future__ import annotations

from onca.models import MODELS, PRESET_MODELS, ModelConfig
from onca.integrations.transformers.families import FAMILIES, family_of

# transformers config class per model type (the others: ``AutoConfig.for_model``)
CONFIG_CLASSES = {
    "llama": "LlamaConfig", "mistral": "MistralConfig", "mixtral": "MixtralConfig", "qwen2": "Qwen2Config",
    "qwen3": "Qwen3Config", "qwen3_moe": "Qwen3MoeConfig", "gemma": "GemmaConfig", "gemma2": "Gemma2Config",
    "gemma3_text": "Gemma3TextConfig", "phi3": "Phi3Config", "olmo2": "Olmo2Config", "granite": "GraniteConfig",
}
# Short names accepted by `onca compare --model`.
ALIASES = {"gemma3": "gemma3_text", "qwen3-moe": "qwen3_moe", "qwen3moe": "qwen3_moe", "gpt-oss": "gpt_oss", "llama-4": "llama4_text",
           "qwen3.5": "qwen3_5_text", "qwen3-vl": "qwen3_vl", "smollm": "smollm3"}

_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, output_router_logits=True)
# Family-specific extras that make a tiny model exercise the family's own details.
_TINY_EXTRAS = {
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, decoder_sparse_step=1,
                      mlp_only_layers=[], output_router_logits=True),
    "gemma2": dict(final_logit_softcapping=30.0, attn_logit_softcapping=50.0, query_pre_attn_scalar=16,
                   sliding_window=32),
    "gemma3_text": dict(final_logit_softcapping=30.0, query_pre_attn_scalar=16, sliding_window=32),
    "phi3": dict(partial_rotary_factor=0.5),
    "granite": dict(logits_scaling=4.0, embedding_multiplier=2.0, residual_multiplier=0.5,
                    attention_multiplier=0.25),
    "smollm3": dict(no_rope_layer_interval=2),
    "ministral": dict(sliding_window=32),
    "nemotron": dict(partial_rotary_factor=0.5),
    "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=32, output_router_logits=True,
                    rope_parameters=dict(rope_type="yarn", factor=4.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
                                         original_max_position_embeddings=128, rope_theta=150000.0),
                    layer_types=["sliding_attention", "full_attention"]),
    "olmo3": dict(sliding_window=32),
    "glm4": dict(partial_rotary_factor=0.5),
    "falcon_h1": dict(mamba_d_ssm=32, mamba_n_heads=4, mamba_d_head=8, mamba_d_state=8, mamba_chunk_size=16,
                      mamba_expand=1, lm_head_multiplier=0.5, mlp_multipliers=[0.5, 2.0]),
    "qwen3_next": dict(_MOE, shared_expert_intermediate_size=32, linear_key_head_dim=16, linear_value_head_dim=16,
                       linear_num_key_heads=2, linear_num_value_heads=4, partial_rotary_factor=0.5,
                       layer_types=["linear_attention", "full_attention"]),
    "qwen3_5_text": dict(linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
                         linear_num_value_heads=4, partial_rotary_factor=0.5,
                         layer_types=["linear_attention", "full_attention"]),
    "qwen3_5_moe_text": dict(_MOE, shared_expert_intermediate_size=32, linear_key_head_dim=16,
                             linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                             partial_rotary_factor=0.5, layer_types=["linear_attention", "full_attention"]),
    "hunyuan_v1_moe": dict(num_experts=4, moe_topk=2),
    "qwen3_vl_moe_text": dict(_MOE, decoder_sparse_step=1, mlp_only_layers=[]),
    "exaone4": dict(sliding_window=32, sliding_window_pattern=2),
    "deepseek_v4": dict(moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                        q_lora_rank=32, qk_rope_head_dim=8, index_n_heads=2, index_head_dim=16, index_topk=8,
                        sliding_window=16),  # its router logits are not captured in 5.23: no aux loss
    "gemma4_text": dict(final_logit_softcapping=30.0, sliding_window=32, vocab_size_per_layer_input=256,
                        hidden_size_per_layer_input=16, layer_types=["sliding_attention", "full_attention"],
                        global_head_dim=16),
    "llama4_text": dict(intermediate_size_mlp=128, num_local_experts=4, num_experts_per_tok=1,
                        interleave_moe_layer_step=2, no_rope_layer_interval=2),
}
# Families whose tiny model ties the LM head to the embedding, as their real models do.
_TIED = {"gemma", "gemma2", "gemma3_text", "qwen3", "smollm3", "gemma4_text"}

# `--preset` names mapped to registry models, per family (the first is the default).
PRESETS = {
    "qwen3": {"0.6b": "qwen3-0.6b", "8b": "qwen3-8b"},
    "llama": {"8b": "llama-3-8b", "70b": "llama-3-70b", "1b": "llama-3.2-1b"},
    "qwen2": {"7b": "qwen2.5-7b"},
    "mistral": {"7b": "mistral-7b"},
    "gemma2": {"9b": "gemma-2-9b"},
    "gemma3_text": {"27b": "gemma-3-27b"},
    "phi3": {"mini": "phi-3-mini"},
    "smollm3": {"3b": "smollm3-3b"},
    "gpt_oss": {"20b": "gpt-oss-20b"},
    "llama4_text": {"scout": "llama-4-scout"},
    "qwen3_vl": {"8b": "qwen3-vl-8b"},
}


def resolve_model_type(name: str) -> str:
    """The model type ``name`` (a model type or a short name of ``onca compare``) stands for."""
    model_type = ALIASES.get(name, name)
    family_of(model_type)  # a clear error for an unknown name
    return model_type


def _config_class(model_type: str):
    import transformers

    if model_type in CONFIG_CLASSES:
        return getattr(transformers, CONFIG_CLASSES[model_type])
    return lambda **kwargs: transformers.AutoConfig.for_model(model_type, **kwargs)


def _text_kwargs(model_type: str, hidden_size: int, layers: int, vocab_size: int, heads: int, kv_heads: int,
                 max_positions: int) -> dict:
    kwargs = dict(hidden_size=hidden_size, intermediate_size=2 * hidden_size, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=vocab_size,
                  max_position_embeddings=max_positions, tie_word_embeddings=model_type in _TIED,
                  head_dim=hidden_size // heads, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    kwargs.update(_TINY_EXTRAS.get(model_type, {}))
    return kwargs


def tiny_config(model_type: str, *, hidden_size: int = 64, layers: int = 2, vocab_size: int = 256,
                heads: int = 4, kv_heads: int = 2, max_positions: int = 512):
    """A small config of ``model_type`` that still exercises the family's own details (a multimodal
    family: a tiny language model and a tiny vision tower; see ``multimodal_inputs``)."""
    model_type = model_type if model_type in FAMILIES else resolve_model_type(model_type)
    family_of(model_type)
    if model_type in _MULTIMODAL:
        from onca.integrations.transformers import multimodal

        return multimodal.tiny_config(model_type, hidden_size=hidden_size, layers=layers, vocab_size=vocab_size,
                                      heads=heads, kv_heads=kv_heads)
    kwargs = _text_kwargs(model_type, hidden_size, layers, vocab_size, heads, kv_heads, max_positions)
    return _config_class(model_type)(**kwargs)


_MULTIMODAL = {"llava", "mllama", "pixtral", "gemma3", "gemma4", "paligemma", "qwen2_vl", "qwen2_5_vl", "qwen3_vl",
               "qwen3_vl_moe", "glm4v", "glm4v_moe", "internvl", "smolvlm", "qwen3_5", "qwen3_5_moe", "llama4"}


def registry_config(model_type: str, preset: str, layers: int | None = None):
    """The config of a real architecture from the registry (random weights), optionally shallower."""
    model_type = resolve_model_type(model_type)
    presets = PRESETS.get(model_type, {})
    if preset not in presets:
        known = ", ".join(["tiny", *presets]) if presets else "tiny"
        raise ValueError(f"no preset {preset!r} for {model_type}; presets: {known}")
    name = presets[preset]
    m: ModelConfig = MODELS[name] if name in MODELS else PRESET_MODELS[name]
    kwargs = dict(hidden_size=m.hidden_size, intermediate_size=m.intermediate_size,
                  num_hidden_layers=layers or m.num_layers, num_attention_heads=m.num_heads,
                  num_key_value_heads=m.num_kv_heads, head_dim=m.head_dim, vocab_size=m.vocab_size,
                  rms_norm_eps=m.rms_norm_eps, tie_word_embeddings=m.tie_word_embeddings,
                  max_position_embeddings=32768, **dict(m.extra))
    if m.final_logit_softcapping is not None:
        kwargs["final_logit_softcapping"] = m.final_logit_softcapping
    if model_type in _MULTIMODAL:  # the language model's shape; the vision tower's default
        import transformers

        return transformers.AutoConfig.for_model(model_type, text_config=kwargs)
    return _config_class(model_type)(**kwargs)
