"""``onca.nn.RMSNorm``: a drop-in for the RMSNorm modules of Llama, Qwen2/3, Mistral and Gemma."""

from __future__ import annotations

import torch
from torch import nn

from onca.ops.rms_norm import CASTING_MODES, rms_norm

_INIT_FNS = {"ones": nn.init.ones_, "zeros": nn.init.zeros_}


class RMSNorm(nn.Module):
    """RMSNorm over the last dimension with a learned ``weight`` of shape ``(hidden_size,)``.

    Llama/Qwen/Mistral: the defaults (``casting_mode="llama"``, ``offset=0``, weight of ones).
    Gemma: ``offset=1.0, casting_mode="gemma", init_fn="zeros"`` (the weight is stored as ``w`` and
    used as ``1 + w``). The state dict holds ``weight`` alone, as in Hugging Face's modules.
    ``elementwise_affine=False``: no weight (``self.weight`` is None, the state dict is empty) and no
    scale, as ``torch.nn.RMSNorm(elementwise_affine=False)``.
    """

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-6,
        offset: float = 0.0,
        casting_mode: str = "llama",
        init_fn: str = "ones",
        overwrite_grad_output: bool = False,
        elementwise_affine: bool = True,
        device=None,
        dtype=None,
    ):
        super().__init__()
        if casting_mode not in CASTING_MODES:
            raise ValueError(f"casting_mode must be one of {sorted(CASTING_MODES)}, got {casting_mode!r}")
        if init_fn not in _INIT_FNS:
            raise ValueError(f"init_fn must be one of {sorted(_INIT_FNS)}, got {init_fn!r}")
        if not isinstance(hidden_size, int) or hidden_size <= 0:
            raise ValueError(f"hidden_size must be a positive int, got {hidden_size!r}")
        if not isinstance(elementwise_affine, bool):
            raise TypeError(f"elementwise_affine must be a bool, got {elementwise_affine!r}")
        self.hidden_size = hidden_size
        self.eps = eps
        self.offset = offset
        self.casting_mode = casting_mode
        self.init_fn = init_fn
        self.overwrite_grad_output = overwrite_grad_output
        self.elementwise_affine = elementwise_affine
        if elementwise_affine:
            self.weight = nn.Parameter(torch.empty(hidden_size, device=device, dtype=dtype))
        else:
            self.register_parameter("weight", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.weight is not None:
            _INIT_FNS[self.init_fn](self.weight)

    # Hugging Face's Llama-family modules call it ``variance_epsilon``; keep both names working.
    @property
    def variance_epsilon(self) -> float:
        return self.eps

    @variance_epsilon.setter
    def variance_epsilon(self, value: float) -> None:
        self.eps = value

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return rms_norm(hidden_states, self.weight, self.eps, self.offset, self.casting_mode,
                        self.overwrite_grad_output)

    def extra_repr(self) -> str:
        return (
            f"{self.hidden_size}, eps={self.eps}, offset={self.offset}, "
            f"casting_mode={self.casting_mode!r}, overwrite_grad_output={self.overwrite_grad_output}, "
            f"elementwise_affine={self.elementwise_affine}"
        )
