"""``onca.nn.ModulatedRMSNorm``: an RMSNorm followed by a diffusion transformer's modulation."""

from __future__ import annotations

import torch

from onca.nn.rms_norm import RMSNorm
from onca.ops.modulated_rms_norm import modulated_rms_norm


class ModulatedRMSNorm(RMSNorm):
    """``rms_norm(x, weight) * (1 + scale) + shift`` (adaptive RMSNorm, AdaLN with an RMSNorm).

    Same constructor, attributes and state dict (``weight`` alone, or nothing with
    ``elementwise_affine=False``) as ``onca.nn.RMSNorm``, so it loads the RMSNorm it fuses with the
    modulation that follows it (e.g. VibeVoice's diffusion head: ``norm(x) * (1 + scale) + shift``).
    ``forward(hidden_states, scale, shift=None)`` as liger-kernel's ``LigerModulatedRMSNorm``;
    ``scale``/``shift`` broadcast as ``onca.functional.modulated_rms_norm`` documents.
    """

    def forward(self, hidden_states: torch.Tensor, scale: torch.Tensor,
                shift: torch.Tensor | None = None) -> torch.Tensor:
        return modulated_rms_norm(hidden_states, self.weight, scale, shift, self.eps, self.offset, self.casting_mode,
                                  self.overwrite_grad_output)
