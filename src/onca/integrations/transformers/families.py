"""What Onca replaces in each supported Hugging Face model family, and how.

Each family names the classes of its modelling module whose ``forward`` Onca replaces (found by
name, so a family works across transformers versions as long as the names hold), the RMSNorm
arithmetic it uses, its MLP kind, and its causal-LM details (logit soft-capping, logit scaling,
mixture-of-experts auxiliary loss).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    model_type: str
    module: str  # the modelling module, under transformers.models
    prefix: str  # class-name prefix in that module, e.g. "Llama"
    # RMSNorm: "llama" (normalise, cast, scale), "olmo2" (scale in fp32, then cast), "gemma" (1 + w)
    norm: str = "llama"
    # MLP: "swiglu" (gate/up/down), "phi3" (fused gate_up), "geglu" (GELU-tanh gate/up/down)
    mlp: str = "swiglu"
    experts: bool = False  # MoE experts stored as 3-D gate_up/down weights
    # The config attribute holding Gemma-2/3's final logit soft-cap, and Granite's logit divisor.
    softcap_attr: str | None = None
    logits_scaling_attr: str | None = None
    # OLMo-2's RoPE computes in cos/sin's fp32 and casts back to q/k's dtype; the others return the
    # promoted dtype (their cos/sin already have the activations' dtype).
    rope_casts_back: bool = False

    def modeling(self):
        return importlib.import_module(f"transformers.models.{self.module}")

    @property
    def norm_class(self) -> str:
        return f"{self.prefix}RMSNorm"

    @property
    def mlp_class(self) -> str:
        return f"{self.prefix}MLP"

    @property
    def experts_class(self) -> str:
        return f"{self.prefix}Experts"

    @property
    def causal_lm_class(self) -> str:
        return f"{self.prefix}ForCausalLM"


FAMILIES: dict[str, Family] = {
    f.model_type: f
    for f in (
        Family("llama", "llama.modeling_llama", "Llama"),
        Family("mistral", "mistral.modeling_mistral", "Mistral"),
        Family("mixtral", "mixtral.modeling_mixtral", "Mixtral", experts=True),
        Family("qwen2", "qwen2.modeling_qwen2", "Qwen2"),
        Family("qwen3", "qwen3.modeling_qwen3", "Qwen3"),
        Family("qwen3_moe", "qwen3_moe.modeling_qwen3_moe", "Qwen3Moe", experts=True),
        Family("gemma", "gemma.modeling_gemma", "Gemma", norm="gemma", mlp="geglu"),
        Family("gemma2", "gemma2.modeling_gemma2", "Gemma2", norm="gemma", mlp="geglu",
               softcap_attr="final_logit_softcapping"),
        Family("gemma3_text", "gemma3.modeling_gemma3", "Gemma3", norm="gemma", mlp="geglu",
               softcap_attr="final_logit_softcapping"),
        Family("phi3", "phi3.modeling_phi3", "Phi3", mlp="phi3"),
        Family("olmo2", "olmo2.modeling_olmo2", "Olmo2", norm="olmo2", rope_casts_back=True),
        Family("granite", "granite.modeling_granite", "Granite", logits_scaling_attr="logits_scaling"),
    )
}


def family_of(model_type: str) -> Family:
    try:
        return FAMILIES[model_type]
    except KeyError:
        supported = ", ".join(sorted(FAMILIES))
        raise ValueError(
            f"Onca does not support model type {model_type!r}; supported model types: {supported}"
        ) from None
