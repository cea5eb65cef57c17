"""Drop-in ``torch.nn.Module`` replacements backed by Onca's kernels."""

from onca.nn.rms_norm import RMSNorm

__all__ = ["RMSNorm"]
from onca.nn.layer_norm import LayerNorm  # noqa: E402
from onca.nn.fused_add_rms_norm import FusedAddRMSNorm  # noqa: E402

__all__ += ["LayerNorm", "FusedAddRMSNorm"]
from onca.nn.mlp import GeGLUMLP, SwiGLUMLP  # noqa: E402

__all__ += ["SwiGLUMLP", "GeGLUMLP"]
from onca.nn.kl_div import KLDivLoss  # noqa: E402
from onca.nn.jsd import JSD  # noqa: E402
from onca.nn.fused_linear_jsd import FusedLinearJSD  # noqa: E402

__all__ += ["KLDivLoss", "JSD", "FusedLinearJSD"]
from onca.nn.cross_entropy import CrossEntropyLoss  # noqa: E402
from onca.nn.fused_linear_cross_entropy import FusedLinearCrossEntropyLoss  # noqa: E402

__all__ += ["CrossEntropyLoss", "FusedLinearCrossEntropyLoss"]
from onca.nn.embedding import Embedding  # noqa: E402

__all__ += ["Embedding"]
from onca.nn.attn_res import AttnRes  # noqa: E402

__all__ += ["AttnRes"]
