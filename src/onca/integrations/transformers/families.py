"""What Onca replaces in each supported Hugging Face model family, and how: one table entry per family.

Each family names the classes of its modelling module whose ``forward`` Onca replaces (found by
name, so a family works across transformers versions as long as the names hold) with the
arithmetic each uses, its RoPE function, and its causal-LM details (logit soft-capping, logit
scaling, mixture-of-experts auxiliary loss). Multimodal families whose language model (or vision
tower) is another family's (LLaVA, PaliGemma, InternVL, SmolVLM) name the sub-configs in ``parts``:
the family of each sub-config's ``model_type`` contributes its entries. Plain ``torch.nn.LayerNorm``
modules (vision towers) take Onca's LayerNorm in every family.

A family whose modelling module the installed transformers lacks is skipped:
``supported_model_types()`` lists the families that can be patched here.
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass

# RMSNorm arithmetics: "llama" (normalise, cast, scale), "olmo2" (scale in fp32, then cast),
# "gemma" (1 + w in fp32), "gemma4" (olmo2's, the weight optional: ``with_scale``), and the
# LayerNorm one "layernorm1p" (Nemotron: LayerNorm with 1 + w).
NORM_ARITHMETICS = ("llama", "olmo2", "gemma", "gemma4", "layernorm1p")
# MLP kinds: "swiglu" (gate/up/down, SiLU), "phi3" (fused gate_up, SiLU: Phi-3, GLM-4), "geglu"
# (GELU-tanh gate/up/down), "falcon_h1" (SwiGLU with Falcon-H1's gate and down multipliers).
# "gated" (gate/up/down with the module's own act_fn: SiLU, GELU or GELU-tanh; vision towers).
MLP_KINDS = ("swiglu", "phi3", "geglu", "falcon_h1", "gated")
# RoPE variants: "promoted" (transformers' apply_rotary_pos_emb returning the promoted dtype,
# partial rotary included), "cast_back" (OLMo-2's: computed in cos/sin's fp32, cast back to q/k's
# dtype), "llama4" (Llama 4's complex apply_rotary_emb). None: the family's RoPE stays.
ROPE_VARIANTS = ("promoted", "cast_back", "llama4")


@dataclass(frozen=True)
class Family:
    model_type: str
    module: str  # the modelling module, under transformers.models
    prefix: str  # class-name prefix in that module, e.g. "Llama"
    # Arithmetic of ``{prefix}RMSNorm`` (None: the family has no such class).
    norm: str | None = "llama"
    # Kind of ``{prefix}MLP`` (None: none Onca covers, e.g. GPT-OSS's MLP is its router + experts).
    mlp: str | None = "swiglu"
    # MoE experts stored as 3-D gate_up/down weights (Mixtral's layout), ``{prefix}Experts`` unless
    # ``experts_name`` says otherwise.
    experts: bool = False
    experts_name: str | None = None
    # "linear": per-expert F.linear over (E, 2I, H) weights (Mixtral's); "bmm": Llama 4's batched
    # (E, H, 2I) matmuls over tokens already grouped per expert.
    experts_layout: str = "linear"
    # Further classes: (class name, arithmetic) and (class name, MLP kind), e.g. a vision tower's.
    norms: tuple[tuple[str, str], ...] = ()
    mlps: tuple[tuple[str, str], ...] = ()
    # The config attribute (of the text config) holding the final logit soft-cap, the logit divisor
    # (Granite) and the logit multiplier (Falcon-H1).
    softcap_attr: str | None = None
    logits_scaling_attr: str | None = None
    logits_multiplier_attr: str | None = None
    rope: str | None = "promoted"
    # The causal-LM class whose loss Onca computes ("" = ``{prefix}ForCausalLM``; None: the family
    # has no language-model head, e.g. Pixtral's vision encoder).
    causal_lm: str | None = ""
    # The causal LM adds the MoE load-balancing loss (when it outputs router logits).
    aux_loss: bool = False
    # Sub-configs whose families' entries join this one's (a multimodal model built from others).
    parts: tuple[str, ...] = ()
    # ``{prefix}Attention`` (``attention_name`` where given) normalises each head of q and k (an
    # RMSNorm) before RoPE: Onca's attention forward fuses the two (``rms_norm_rope``).
    qk_norm: bool = False
    attention_name: str | None = None

    def modeling(self):
        return importlib.import_module(f"transformers.models.{self.module}")

    def available(self) -> bool:
        """Whether the installed transformers has this family's modelling module."""
        return _importable(self.module)

    @property
    def rope_casts_back(self) -> bool:
        return self.rope == "cast_back"

    @property
    def rope_function(self) -> str:
        """The name of the module-level RoPE function the attention layers call."""
        return "apply_rotary_emb" if self.rope == "llama4" else "apply_rotary_pos_emb"

    @property
    def norm_class(self) -> str:
        return f"{self.prefix}RMSNorm"

    @property
    def mlp_class(self) -> str:
        return f"{self.prefix}MLP"

    @property
    def attention_class(self) -> str | None:
        """The attention class whose q/k norms and RoPE Onca fuses (None: the family has none)."""
        if not self.qk_norm:
            return None
        return self.attention_name or f"{self.prefix}Attention"

    @property
    def experts_class(self) -> str:
        return self.experts_name or f"{self.prefix}Experts"

    @property
    def causal_lm_class(self) -> str | None:
        if self.causal_lm is None:
            return None
        return self.causal_lm or f"{self.prefix}ForCausalLM"

    @property
    def norm_classes(self) -> dict[str, str]:
        """Every norm class Onca replaces in this family's module: class name -> arithmetic."""
        own = {self.norm_class: self.norm} if self.norm else {}
        return {**own, **dict(self.norms)}

    @property
    def mlp_classes(self) -> dict[str, str]:
        """Every MLP class Onca replaces in this family's module: class name -> kind."""
        own = {self.mlp_class: self.mlp} if self.mlp else {}
        return {**own, **dict(self.mlps)}


@functools.cache
def _importable(module: str) -> bool:
    try:
        importlib.import_module(f"transformers.models.{module}")
    except ImportError:
        return False
    return True


def _vl(model_type, module, prefix, causal_lm, **kw) -> Family:
    """A multimodal family: its loss is its ``ForConditionalGeneration``'s."""
    return Family(model_type, module, prefix, causal_lm=causal_lm, **kw)


FAMILIES: dict[str, Family] = {
    f.model_type: f
    for f in (
        Family("llama", "llama.modeling_llama", "Llama"),
        Family("mistral", "mistral.modeling_mistral", "Mistral"),
        Family("mixtral", "mixtral.modeling_mixtral", "Mixtral", experts=True, aux_loss=True),
        Family("qwen2", "qwen2.modeling_qwen2", "Qwen2"),
        Family("qwen3", "qwen3.modeling_qwen3", "Qwen3", qk_norm=True),
        Family("qwen3_moe", "qwen3_moe.modeling_qwen3_moe", "Qwen3Moe", experts=True, aux_loss=True,
               qk_norm=True),
        Family("gemma", "gemma.modeling_gemma", "Gemma", norm="gemma", mlp="geglu"),
        Family("gemma2", "gemma2.modeling_gemma2", "Gemma2", norm="gemma", mlp="geglu",
               softcap_attr="final_logit_softcapping"),
        Family("gemma3_text", "gemma3.modeling_gemma3", "Gemma3", norm="gemma", mlp="geglu",
               softcap_attr="final_logit_softcapping", qk_norm=True),
        Family("phi3", "phi3.modeling_phi3", "Phi3", mlp="phi3"),
        Family("olmo2", "olmo2.modeling_olmo2", "Olmo2", norm="olmo2", rope="cast_back"),
        Family("granite", "granite.modeling_granite", "Granite", logits_scaling_attr="logits_scaling"),
        # --- text families added with issue 17
        Family("smollm3", "smollm3.modeling_smollm3", "SmolLM3"),
        Family("ministral", "ministral.modeling_ministral", "Ministral"),
        # LayerNorm1P (1 + w); its squared-ReLU MLP is not gated: Onca has no kernel for it.
        Family("nemotron", "nemotron.modeling_nemotron", "Nemotron", norm=None, mlp=None,
               norms=(("NemotronLayerNorm1P", "layernorm1p"),)),
        # GPT-OSS: clamped SwiGLU experts with an alpha-scaled sigmoid and half-width RoPE tables:
        # Onca replaces the norms and the loss (with the router's auxiliary loss).
        Family("gpt_oss", "gpt_oss.modeling_gpt_oss", "GptOss", norm="olmo2", mlp=None, rope=None,
               aux_loss=True),
        Family("olmo3", "olmo3.modeling_olmo3", "Olmo3", norm="olmo2", rope="cast_back"),
        # GLM-4: fused gate_up MLP; interleaved partial RoPE stays.
        Family("glm4", "glm4.modeling_glm4", "Glm4", mlp="phi3", rope=None),
        # Falcon-H1: the attention/MLP path (Mamba's gated norm stays); logits times lm_head_multiplier.
        Family("falcon_h1", "falcon_h1.modeling_falcon_h1", "FalconH1", mlp="falcon_h1",
               logits_multiplier_attr="lm_head_multiplier"),
        Family("qwen3_next", "qwen3_next.modeling_qwen3_next", "Qwen3Next", norm="gemma", experts=True,
               aux_loss=True),
        Family("qwen3_5_text", "qwen3_5.modeling_qwen3_5", "Qwen3_5", norm="gemma"),
        Family("qwen3_5_moe_text", "qwen3_5_moe.modeling_qwen3_5_moe", "Qwen3_5Moe", norm="gemma", experts=True,
               aux_loss=True),
        Family("hunyuan_v1_dense", "hunyuan_v1_dense.modeling_hunyuan_v1_dense", "HunYuanDenseV1"),
        Family("hunyuan_v1_moe", "hunyuan_v1_moe.modeling_hunyuan_v1_moe", "HunYuanMoEV1", experts=True),
        Family("exaone4", "exaone4.modeling_exaone4", "Exaone4"),
        # DeepSeek-V4: clamped SwiGLU experts and MLP, its own RoPE: the norms and the loss.
        Family("deepseek_v4", "deepseek_v4.modeling_deepseek_v4", "DeepseekV4", norm="olmo2", mlp=None,
               rope=None, aux_loss=True),
        # Gemma 4 rotates q and k in separate calls (one tensor each): its RoPE stays.
        Family("gemma4_text", "gemma4.modeling_gemma4", "Gemma4", norm="gemma4", mlp=None,
               mlps=(("Gemma4TextMLP", "geglu"),), softcap_attr="final_logit_softcapping", rope=None),
        Family("llama4_text", "llama4.modeling_llama4", "Llama4", norm=None, mlp=None,
               norms=(("Llama4TextRMSNorm", "llama"), ("Llama4TextL2Norm", "gemma4")),
               mlps=(("Llama4TextMLP", "swiglu"),), experts=True, experts_name="Llama4TextExperts",
               experts_layout="bmm", rope="llama4"),
        # --- multimodal families: the language model and the loss; the vision tower's LayerNorms, and
        # its RMSNorms and gated MLPs where it has them.
        _vl("llava", "llava.modeling_llava", "Llava", "LlavaForConditionalGeneration", norm=None, mlp=None,
            rope=None, parts=("text_config", "vision_config")),
        _vl("mllama", "mllama.modeling_mllama", "Mllama", "MllamaForConditionalGeneration", norm=None, mlp=None,
            norms=(("MllamaTextRMSNorm", "llama"),), mlps=(("MllamaTextMLP", "swiglu"),)),
        # Pixtral is a vision encoder (LLaVA's and Mistral 3's): RMSNorm, gated MLP, 2-D RoPE; no head.
        _vl("pixtral", "pixtral.modeling_pixtral", "Pixtral", None, mlp="gated"),
        _vl("gemma3", "gemma3.modeling_gemma3", "Gemma3", "Gemma3ForConditionalGeneration", norm="gemma",
            mlp="geglu", softcap_attr="final_logit_softcapping", qk_norm=True),
        _vl("gemma4", "gemma4.modeling_gemma4", "Gemma4", "Gemma4ForConditionalGeneration", norm="gemma4",
            mlp=None, mlps=(("Gemma4TextMLP", "geglu"),), softcap_attr="final_logit_softcapping", rope=None),
        _vl("paligemma", "paligemma.modeling_paligemma", "PaliGemma", "PaliGemmaForConditionalGeneration",
            norm=None, mlp=None, rope=None, parts=("text_config", "vision_config")),
        _vl("qwen2_vl", "qwen2_vl.modeling_qwen2_vl", "Qwen2VL", "Qwen2VLForConditionalGeneration", mlp=None,
            mlps=(("Qwen2MLP", "swiglu"),)),
        _vl("qwen2_5_vl", "qwen2_5_vl.modeling_qwen2_5_vl", "Qwen2_5_VL", "Qwen2_5_VLForConditionalGeneration",
            mlp="gated", mlps=(("Qwen2MLP", "swiglu"),)),
        _vl("qwen3_vl", "qwen3_vl.modeling_qwen3_vl", "Qwen3VL", "Qwen3VLForConditionalGeneration", norm=None,
            mlp=None, norms=(("Qwen3VLTextRMSNorm", "llama"),), mlps=(("Qwen3VLTextMLP", "swiglu"),),
            qk_norm=True, attention_name="Qwen3VLTextAttention"),
        _vl("qwen3_vl_moe", "qwen3_vl_moe.modeling_qwen3_vl_moe", "Qwen3VLMoe", "Qwen3VLMoeForConditionalGeneration",
            norm=None, mlp=None, norms=(("Qwen3VLMoeTextRMSNorm", "llama"),), mlps=(("Qwen3VLMoeTextMLP", "swiglu"),),
            experts=True, experts_name="Qwen3VLMoeTextExperts", aux_loss=True, qk_norm=True,
            attention_name="Qwen3VLMoeTextAttention"),
        _vl("glm4v", "glm4v.modeling_glm4v", "Glm4v", "Glm4vForConditionalGeneration", mlp=None,
            mlps=(("Glm4vTextMLP", "phi3"),), rope=None),
        _vl("glm4v_moe", "glm4v_moe.modeling_glm4v_moe", "Glm4vMoe", "Glm4vMoeForConditionalGeneration",
            norms=(("Glm4vMoeTextRMSNorm", "llama"),), mlp=None, mlps=(("Glm4vMoeTextMLP", "swiglu"),),
            experts=True, experts_name="Glm4vMoeTextExperts", rope=None, aux_loss=True),
        _vl("internvl", "internvl.modeling_internvl", "InternVL", "InternVLForConditionalGeneration", norm=None,
            mlp=None, norms=(("InternVLVisionRMSNorm", "llama"),), rope=None, parts=("text_config",)),
        _vl("smolvlm", "smolvlm.modeling_smolvlm", "SmolVLM", "SmolVLMForConditionalGeneration", norm=None,
            mlp=None, rope=None, parts=("text_config",)),
        _vl("qwen3_5", "qwen3_5.modeling_qwen3_5", "Qwen3_5", "Qwen3_5ForConditionalGeneration", norm="gemma"),
        _vl("qwen3_5_moe", "qwen3_5_moe.modeling_qwen3_5_moe", "Qwen3_5Moe", "Qwen3_5MoeForConditionalGeneration",
            norm="gemma", experts=True, aux_loss=True),
        # Llama 4's multimodal model computes its loss from its language model's logits: that stays.
        _vl("llama4", "llama4.modeling_llama4", "Llama4", None, norm=None, mlp=None,
            norms=(("Llama4TextRMSNorm", "llama"), ("Llama4TextL2Norm", "gemma4")),
            mlps=(("Llama4TextMLP", "swiglu"),), experts=True, experts_name="Llama4TextExperts",
            experts_layout="bmm", rope="llama4"),
    )
}


def supported_model_types() -> list[str]:
    """The Hugging Face ``model_type`` values ``onca.apply`` patches with the installed transformers,
    sorted (a family this transformers version lacks is left out)."""
    return sorted(t for t, f in FAMILIES.items() if f.available())


def family_of(model_type: str) -> Family:
    family = FAMILIES.get(model_type)
    if family is None or not family.available():
        supported = ", ".join(supported_model_types())
        why = "" if family is None else " with this transformers version (it has no such model)"
        raise ValueError(
            f"Onca does not support model type {model_type!r}{why}; supported model types: {supported}"
        )
    return family
