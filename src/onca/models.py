"""The model registry: real architectures' shapes, for the benchmarks' D2 sweeps and `onca compare`'s presets.

Figures are from each model's published ``config.json``. Benchmarks derive their parameters from
these (e.g. RMSNorm's hidden size, SwiGLU's intermediate size, cross entropy's vocabulary).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelConfig:
    name: str
    family: str  # the Hugging Face model_type
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    num_layers: int
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    final_logit_softcapping: float | None = None
    partial_rotary_factor: float = 1.0
    # Further config.json keys of the family (experts, a vision tower, ...), as (key, value) pairs.
    extra: tuple[tuple[str, object], ...] = ()

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)


MODELS: dict[str, ModelConfig] = {
    m.name: m
    for m in (
        ModelConfig("llama-3-8b", "llama", 4096, 14336, 32, 8, 128, 128256, 32),
        ModelConfig("llama-3-70b", "llama", 8192, 28672, 64, 8, 128, 128256, 80),
        ModelConfig("llama-3.1-405b", "llama", 16384, 53248, 128, 8, 128, 128256, 126),
        ModelConfig("llama-3.2-1b", "llama", 2048, 8192, 32, 8, 64, 128256, 16, tie_word_embeddings=True),
        ModelConfig("qwen3-0.6b", "qwen3", 1024, 3072, 16, 8, 128, 151936, 28, rms_norm_eps=1e-6,
                    tie_word_embeddings=True),
        ModelConfig("qwen3-8b", "qwen3", 4096, 12288, 32, 8, 128, 151936, 36, rms_norm_eps=1e-6),
        ModelConfig("qwen2.5-7b", "qwen2", 3584, 18944, 28, 4, 128, 152064, 28, rms_norm_eps=1e-6),
        ModelConfig("mistral-7b", "mistral", 4096, 14336, 32, 8, 128, 32768, 32),
        ModelConfig("gemma-2-9b", "gemma2", 3584, 14336, 16, 8, 256, 256000, 42,
                    hidden_act="gelu_pytorch_tanh", rms_norm_eps=1e-6, tie_word_embeddings=True,
                    final_logit_softcapping=30.0),
        ModelConfig("gemma-3-27b", "gemma3_text", 5376, 21504, 32, 16, 128, 262208, 62,
                    hidden_act="gelu_pytorch_tanh", rms_norm_eps=1e-6, tie_word_embeddings=True),
        ModelConfig("phi-3-mini", "phi3", 3072, 8192, 32, 32, 96, 32064, 32),
    )
}


# Shapes for `onca compare --preset` only (mixture-of-experts and multimodal models whose layers the
# per-op benchmark sweeps already cover through the models above).
PRESET_MODELS: dict[str, ModelConfig] = {
    m.name: m
    for m in (
        ModelConfig("smollm3-3b", "smollm3", 2048, 11008, 16, 4, 128, 128256, 36, rms_norm_eps=1e-6,
                    tie_word_embeddings=True, extra=(("no_rope_layer_interval", 4),)),
        ModelConfig("gpt-oss-20b", "gpt_oss", 2880, 2880, 64, 8, 64, 201088, 24,
                    extra=(("num_local_experts", 32), ("num_experts_per_tok", 4), ("sliding_window", 128))),
        ModelConfig("llama-4-scout", "llama4_text", 5120, 8192, 40, 8, 128, 202048, 48,
                    extra=(("intermediate_size_mlp", 16384), ("num_local_experts", 16),
                           ("num_experts_per_tok", 1), ("interleave_moe_layer_step", 1))),
        # Qwen3-VL-8B's language model; its vision tower keeps transformers' default (the 8B's).
        ModelConfig("qwen3-vl-8b", "qwen3_vl", 4096, 12288, 32, 8, 128, 151936, 36, rms_norm_eps=1e-6),
    )
}


def get_model(name: str) -> ModelConfig:
    try:
        return MODELS[name] if name in MODELS else PRESET_MODELS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; registry: {', '.join([*MODELS, *PRESET_MODELS])}") from None
