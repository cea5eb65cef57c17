"""Model configurations to build with random weights: a tiny one for every family (tests, CPU
demos) and real architectures' shapes from the benchmark model registry (GPU comparisons)."""

from __future__ import annotations

from onca.models import MODELS, ModelConfig
from onca.integrations.transformers.families import family_of

# transformers config class per model type
CONFIG_CLASSES = {
    "llama": "LlamaConfig", "mistral": "MistralConfig", "mixtral": "MixtralConfig", "qwen2": "Qwen2Config",
    "qwen3": "Qwen3Config", "qwen3_moe": "Qwen3MoeConfig", "gemma": "GemmaConfig", "gemma2": "Gemma2Config",
    "gemma3_text": "Gemma3TextConfig", "phi3": "Phi3Config", "olmo2": "Olmo2Config", "granite": "GraniteConfig",
}
# Short names accepted by `onca compare --model`.
ALIASES = {"gemma3": "gemma3_text", "qwen3-moe": "qwen3_moe", "qwen3moe": "qwen3_moe"}

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
}
# Families whose tiny model ties the LM head to the embedding, as their real models do.
_TIED = {"gemma", "gemma2", "gemma3_text", "qwen3"}

# `--preset` names mapped to registry models, per family (the first is the default).
PRESETS = {
    "qwen3": {"0.6b": "qwen3-0.6b", "8b": "qwen3-8b"},
    "llama": {"8b": "llama-3-8b", "70b": "llama-3-70b", "1b": "llama-3.2-1b"},
    "qwen2": {"7b": "qwen2.5-7b"},
    "mistral": {"7b": "mistral-7b"},
    "gemma2": {"9b": "gemma-2-9b"},
    "gemma3_text": {"27b": "gemma-3-27b"},
    "phi3": {"mini": "phi-3-mini"},
}


def resolve_model_type(name: str) -> str:
    model_type = ALIASES.get(name, name)
    family_of(model_type)  # a clear error for an unknown name
    return model_type


def tiny_config(model_type: str, *, hidden_size: int = 64, layers: int = 2, vocab_size: int = 256,
                heads: int = 4, kv_heads: int = 2, max_positions: int = 512):
    """A small config of ``model_type`` that still exercises the family's own details."""
    import transformers

    model_type = resolve_model_type(model_type)
    cls = getattr(transformers, CONFIG_CLASSES[model_type])
    kwargs = dict(hidden_size=hidden_size, intermediate_size=2 * hidden_size, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=vocab_size,
                  max_position_embeddings=max_positions, tie_word_embeddings=model_type in _TIED,
                  head_dim=hidden_size // heads, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    kwargs.update(_TINY_EXTRAS.get(model_type, {}))
    return _build(cls, kwargs)


def registry_config(model_type: str, preset: str, layers: int | None = None):
    """The config of a real architecture from the registry (random weights), optionally shallower."""
    import transformers

    model_type = resolve_model_type(model_type)
    presets = PRESETS.get(model_type, {})
    if preset not in presets:
        known = ", ".join(["tiny", *presets]) if presets else "tiny"
        raise ValueError(f"no preset {preset!r} for {model_type}; presets: {known}")
    m: ModelConfig = MODELS[presets[preset]]
    cls = getattr(transformers, CONFIG_CLASSES[model_type])
    kwargs = dict(hidden_size=m.hidden_size, intermediate_size=m.intermediate_size,
                  num_hidden_layers=layers or m.num_layers, num_attention_heads=m.num_heads,
                  num_key_value_heads=m.num_kv_heads, head_dim=m.head_dim, vocab_size=m.vocab_size,
                  rms_norm_eps=m.rms_norm_eps, tie_word_embeddings=m.tie_word_embeddings,
                  max_position_embeddings=32768)
    if m.final_logit_softcapping is not None:
        kwargs["final_logit_softcapping"] = m.final_logit_softcapping
    return _build(cls, kwargs)


def _build(cls, kwargs):
    return cls(**kwargs)
