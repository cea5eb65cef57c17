"""Drop-in ``torch.nn.Module`` replacements backed by Onca's kernels."""

from onca.nn.rms_norm import RMSNorm

__all__ = ["RMSNorm"]
from onca.nn.embedding import Embedding  # noqa: E402

__all__ += ["Embedding"]
from onca.nn.attn_res import AttnRes  # noqa: E402

__all__ += ["AttnRes"]
