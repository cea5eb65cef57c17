"""``onca.nn.AttnRes``: attention residuals (softmax attention over the outputs of earlier layers)."""

from __future__ import annotations

import torch
from torch import nn

from onca.ops.attn_res import attn_res


class AttnRes(nn.Module):
    """``h = sum_n softmax_n(<w_query, rms_norm(V[n]) * w_norm>) * V[n]`` for ``V`` of shape
    ``(N, ..., hidden_size)``; returns ``(..., hidden_size)``.

    Parameters: ``w_query`` (the pseudo-query) and ``w_norm`` (the keys' RMSNorm weight), both of
    shape ``(hidden_size,)``. Initialisation: ``w_query`` zeros, so that every layer starts with the
    same weight ``1/N`` (``h`` starts as the plain mean of the sources: a neutral, stable start; set
    ``w_query`` yourself, e.g. ``normal_(std=0.02)``, for a random one), and ``w_norm`` ones (an
    identity RMSNorm scale). With ``w_query = 0`` the gradient of ``w_norm`` is zero until
    ``w_query`` moves, which it does from the first step.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, device=None, dtype=None):
        super().__init__()
        if isinstance(hidden_size, bool) or not isinstance(hidden_size, int) or hidden_size <= 0:
            raise ValueError(f"hidden_size must be a positive int, got {hidden_size!r}")
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0:
            raise ValueError(f"eps must be a non-negative number, got {eps!r}")
        self.hidden_size = hidden_size
        self.eps = eps
        self.w_query = nn.Parameter(torch.empty(hidden_size, device=device, dtype=dtype))
        self.w_norm = nn.Parameter(torch.empty(hidden_size, device=device, dtype=dtype))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.w_query)
        nn.init.ones_(self.w_norm)

    def forward(self, V: torch.Tensor) -> torch.Tensor:
        return attn_res(V, self.w_query, self.w_norm, self.eps)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}"
