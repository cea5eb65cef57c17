"""Drop-in ``torch.nn.Module`` replacements backed by Onca's kernels."""

from onca.nn.rms_norm import RMSNorm

__all__ = ["RMSNorm"]
from onca.nn.cross_entropy import CrossEntropyLoss  # noqa: E402
from onca.nn.fused_linear_cross_entropy import FusedLinearCrossEntropyLoss  # noqa: E402

__all__ += ["CrossEntropyLoss", "FusedLinearCrossEntropyLoss"]
