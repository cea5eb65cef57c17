"""The public functional API: every op's one public function, re-exported from its op file.

Each function's signature and docstring live in ``onca/ops/<op>.py`` (one place); this module only
gathers them, grouped by kind.
"""

from __future__ import annotations

# Normalisation
from onca.ops.fused_add_rms_norm import fused_add_rms_norm
from onca.ops.layer_norm import layer_norm
from onca.ops.rms_norm import rms_norm
from onca.ops.dyt import dyt
from onca.ops.poly_norm import poly_norm
from onca.ops.modulated_rms_norm import modulated_rms_norm
from onca.ops.group_norm import group_norm

# MLP activations
from onca.ops.geglu import geglu, geglu_linear
from onca.ops.relu_squared import relu_squared
from onca.ops.swiglu import swiglu, swiglu_linear
from onca.ops.tiled_mlp import tiled_mlp

# Mixture of experts
from onca.ops.fused_moe import fused_moe

# Hyper-connections
from onca.ops.mhc import mhc, mhc_coeffs, mhc_post_res, mhc_pre

# Activations over a row
from onca.ops.softmax import softmax
from onca.ops.sparsemax import sparsemax
# Attention-side
from onca.ops.multi_token_attention import multi_token_attention
from onca.ops.neighborhood_attention import neighborhood_attention

# Position and embedding
from onca.ops.attn_res import attn_res
from onca.ops.embedding import embedding
from onca.ops.rope import rotary_pos_emb
from onca.ops.multimodal_rope import multimodal_rope
from onca.ops.llama4_rope import llama4_rope
from onca.ops.rms_norm_rope import rms_norm_rope

# Losses
from onca.ops.cross_entropy import CrossEntropyOutput, cross_entropy
from onca.ops.fused_linear_cross_entropy import fused_linear_cross_entropy
from onca.ops.fused_linear_jsd import fused_linear_jsd
from onca.ops.jsd import jsd
from onca.ops.kl_div import kl_div
from onca.ops.grpo_loss import grpo_loss
from onca.ops.tvd import tvd
from onca.ops.fused_linear_scaled_cross_entropy import fused_linear_scaled_cross_entropy

# Post-training losses (preference tuning, RL, distillation) without the logits
from onca.ops._chunked_head import chunked_logprobs
from onca.ops.fused_linear_logprobs import LogProbOutput, fused_linear_logprobs
from onca.ops.fused_linear_cpo import fused_linear_cpo
from onca.ops.fused_linear_distill import fused_linear_distill
from onca.ops.fused_linear_dpo import fused_linear_dpo
from onca.ops.fused_linear_grpo import fused_linear_grpo
from onca.ops.fused_linear_kto import fused_linear_kto
from onca.ops.fused_linear_orpo import fused_linear_orpo
from onca.ops.fused_linear_simpo import fused_linear_simpo

from onca.ops.vocab_parallel_cross_entropy import (
    vocab_parallel_cross_entropy,
    vocab_parallel_fused_linear_cross_entropy,
)

__all__ = [
    "rms_norm",
    "layer_norm",
    "fused_add_rms_norm",
    "swiglu",
    "geglu",
    "swiglu_linear",
    "geglu_linear",
    "tiled_mlp",
    "rotary_pos_emb",
    "multimodal_rope",
    "llama4_rope",
    "rms_norm_rope",
    "embedding",
    "attn_res",
    "cross_entropy",
    "CrossEntropyOutput",
    "fused_linear_cross_entropy",
    "kl_div",
    "jsd",
    "fused_linear_jsd",
    "dyt",
    "poly_norm",
    "modulated_rms_norm",
    "group_norm",
    "grpo_loss",
    "fused_moe",
    "mhc",
    "mhc_coeffs",
    "mhc_pre",
    "mhc_post_res",
    "chunked_logprobs",
    "fused_linear_logprobs",
    "LogProbOutput",
    "fused_linear_dpo",
    "fused_linear_simpo",
    "fused_linear_orpo",
    "fused_linear_cpo",
    "fused_linear_kto",
    "fused_linear_grpo",
    "fused_linear_distill",
    "relu_squared",
    "softmax",
    "sparsemax",
    "tvd",
    "vocab_parallel_cross_entropy",
    "vocab_parallel_fused_linear_cross_entropy",
    "fused_linear_scaled_cross_entropy",
    "neighborhood_attention",
    "multi_token_attention",
]
