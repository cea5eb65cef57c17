"""Drop-in ``torch.nn.Module`` replacements backed by Onca's kernels."""

from onca.nn.attn_res import AttnRes
from onca.nn.cross_entropy import CrossEntropyLoss
from onca.nn.embedding import Embedding
from onca.nn.fused_add_rms_norm import FusedAddRMSNorm
from onca.nn.fused_linear_cross_entropy import FusedLinearCrossEntropyLoss
from onca.nn.fused_linear_jsd import FusedLinearJSD
from onca.nn.jsd import JSD
from onca.nn.kl_div import KLDivLoss
from onca.nn.layer_norm import LayerNorm
from onca.nn.mlp import GeGLUMLP, SwiGLUMLP
from onca.nn.relu_squared import ReLUSquared
from onca.nn.rms_norm import RMSNorm
from onca.nn.softmax import Softmax
from onca.nn.sparsemax import Sparsemax
from onca.nn.tvd import TVDLoss

__all__ = [
    "RMSNorm",
    "LayerNorm",
    "FusedAddRMSNorm",
    "SwiGLUMLP",
    "GeGLUMLP",
    "Embedding",
    "AttnRes",
    "CrossEntropyLoss",
    "FusedLinearCrossEntropyLoss",
    "KLDivLoss",
    "JSD",
    "FusedLinearJSD",
    "ReLUSquared",
    "Softmax",
    "Sparsemax",
    "TVDLoss",
]
