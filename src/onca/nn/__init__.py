"""Drop-in ``torch.nn.Module`` replacements backed by Onca's kernels."""

from onca.nn.rms_norm import RMSNorm

__all__ = ["RMSNorm"]
from onca.nn.layer_norm import LayerNorm  # noqa: E402
from onca.nn.fused_add_rms_norm import FusedAddRMSNorm  # noqa: E402

__all__ += ["LayerNorm", "FusedAddRMSNorm"]
