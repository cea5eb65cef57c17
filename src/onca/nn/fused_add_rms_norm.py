"""``onca.nn.FusedAddRMSNorm``: a decoder layer's residual add and the RMSNorm after it, fused."""

from __future__ import annotations

import torch
from torch import nn

from onca.ops.fused_add_rms_norm import CASTING_MODES, fused_add_rms_norm

_INIT_FNS = {"ones": nn.init.ones_, "zeros": nn.init.zeros_}


class FusedAddRMSNorm(nn.Module):
    """``forward(x, residual) -> (normed, new_residual)`` with ``new_residual = x + residual`` and
    ``normed = RMSNorm(new_residual)``, the pair a pre-norm decoder layer computes as::

        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)

    The options are ``onca.nn.RMSNorm``'s. Llama/Qwen/Mistral: the defaults. Gemma:
    ``offset=1.0, casting_mode="gemma", init_fn="zeros"``. The state dict holds ``weight`` alone,
    so a Hugging Face RMSNorm's state dict loads unchanged. ``overwrite_grad_output=True`` lets the
    backward pass write its gradient into the storage of the incoming gradient of ``normed``.
    """

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-6,
        offset: float = 0.0,
        casting_mode: str = "llama",
        init_fn: str = "ones",
        overwrite_grad_output: bool = False,
        device=None,
        dtype=None,
    ):
        super().__init__()
        if casting_mode not in CASTING_MODES:
            raise ValueError(f"casting_mode must be one of {sorted(CASTING_MODES)}, got {casting_mode!r}")
        if init_fn not in _INIT_FNS:
            raise ValueError(f"init_fn must be one of {sorted(_INIT_FNS)}, got {init_fn!r}")
        if not isinstance(hidden_size, int) or isinstance(hidden_size, bool) or hidden_size <= 0:
            raise ValueError(f"hidden_size must be a positive int, got {hidden_size!r}")
        self.hidden_size = hidden_size
        self.eps = eps
        self.offset = offset
        self.casting_mode = casting_mode
        self.init_fn = init_fn
        self.overwrite_grad_output = overwrite_grad_output
        self.weight = nn.Parameter(torch.empty(hidden_size, device=device, dtype=dtype))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        _INIT_FNS[self.init_fn](self.weight)

    # Hugging Face's Llama-family norms call it ``variance_epsilon``; keep both names working.
    @property
    def variance_epsilon(self) -> float:
        return self.eps

    @variance_epsilon.setter
    def variance_epsilon(self, value: float) -> None:
        self.eps = value

    def forward(
        self, hidden_states: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return fused_add_rms_norm(
            hidden_states, residual, self.weight, self.eps, self.offset, self.casting_mode,
            self.overwrite_grad_output,
        )

    def extra_repr(self) -> str:
        return (
            f"{self.hidden_size}, eps={self.eps}, offset={self.offset}, "
            f"casting_mode={self.casting_mode!r}, overwrite_grad_output={self.overwrite_grad_output}"
        )
