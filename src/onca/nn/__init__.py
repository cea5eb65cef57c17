"""Drop-in ``torch.nn.Module`` replacements backed by Onca's kernels."""

from onca.nn.attn_res import AttnRes
from onca.nn.cross_entropy import CrossEntropyLoss
from onca.nn.dyt import DyT
from onca.nn.embedding import Embedding
from onca.nn.fused_add_rms_norm import FusedAddRMSNorm
from onca.nn.fused_linear_cross_entropy import FusedLinearCrossEntropyLoss
from onca.nn.fused_linear_jsd import FusedLinearJSD
from onca.nn.fused_linear_scaled_cross_entropy import FusedLinearScaledCrossEntropy
from onca.nn.group_norm import GroupNorm
from onca.nn.fused_moe import MoEExperts
from onca.nn.jsd import JSD
from onca.nn.kl_div import KLDivLoss
from onca.nn.layer_norm import LayerNorm
from onca.nn.mhc import MHC
from onca.nn.mlp import GeGLUMLP, SwiGLUMLP
from onca.nn.modulated_rms_norm import ModulatedRMSNorm
from onca.nn.multi_token_attention import MultiTokenAttention
from onca.nn.neighborhood_attention import NeighborhoodAttention
from onca.nn.poly_norm import PolyNorm
from onca.nn.rms_norm import RMSNorm
from onca.nn.tiled_mlp import TiledGeGLUMLP, TiledSwiGLUMLP
from onca.nn.posttrain import (
    FusedLinearCPOLoss,
    FusedLinearDistillLoss,
    FusedLinearDPOLoss,
    FusedLinearGRPOLoss,
    FusedLinearKTOLoss,
    FusedLinearORPOLoss,
    FusedLinearSimPOLoss,
)
from onca.nn.relu_squared import ReLUSquared
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
    "DyT",
    "PolyNorm",
    "ModulatedRMSNorm",
    "GroupNorm",
    "TiledSwiGLUMLP",
    "TiledGeGLUMLP",
    "MoEExperts",
    "MHC",
    "FusedLinearDPOLoss",
    "FusedLinearSimPOLoss",
    "FusedLinearORPOLoss",
    "FusedLinearCPOLoss",
    "FusedLinearKTOLoss",
    "FusedLinearGRPOLoss",
    "FusedLinearDistillLoss",
    "ReLUSquared",
    "Softmax",
    "Sparsemax",
    "TVDLoss",
    "FusedLinearScaledCrossEntropy",
    "NeighborhoodAttention",
    "MultiTokenAttention",
]
