"""The public functional API: every op's one public function, re-exported from its op file.

Each function's signature and docstring live in ``onca/ops/<op>.py`` (one place); this module only
gathers them, grouped by kind.
"""

from __future__ import annotations

# Normalisation
from onca.ops.fused_add_rms_norm import fused_add_rms_norm
from onca.ops.layer_norm import layer_norm
from onca.ops.rms_norm import rms_norm

# MLP activations
from onca.ops.geglu import geglu, geglu_linear
from onca.ops.swiglu import swiglu, swiglu_linear

# Position and embedding
from onca.ops.attn_res import attn_res
from onca.ops.embedding import embedding
from onca.ops.rope import rotary_pos_emb

# Losses
from onca.ops.cross_entropy import CrossEntropyOutput, cross_entropy
from onca.ops.fused_linear_cross_entropy import fused_linear_cross_entropy
from onca.ops.fused_linear_jsd import fused_linear_jsd
from onca.ops.jsd import jsd
from onca.ops.kl_div import kl_div
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
    "rotary_pos_emb",
    "embedding",
    "attn_res",
    "cross_entropy",
    "CrossEntropyOutput",
    "fused_linear_cross_entropy",
    "kl_div",
    "jsd",
    "fused_linear_jsd",
    "vocab_parallel_cross_entropy",
    "vocab_parallel_fused_linear_cross_entropy",
]
