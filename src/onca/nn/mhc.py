"""``onca.nn.MHC``: a layer wrapped in manifold-constrained hyper-connections (liger-kernel's
``LigerMHC``), backed by :mod:`onca.ops.mhc`."""

from __future__ import annotations

import torch
from torch import nn

from onca.ops.mhc import mhc

__all__ = ["MHC"]


class MHC(nn.Module):
    """Wraps ``layer`` (``(..., C) -> (..., C)``) for a widened residual stream ``x (..., hc, c)``:
    learned ``phi (hc*c, hc*hc + 2*hc)`` (initialised ``N(0, 0.02)``, in ``phi_dtype``), ``b``
    (zeros) and the scalars ``alpha_pre``, ``alpha_post``, ``alpha_res`` (ones), all named as in
    liger-kernel's ``LigerMHC``. ``forward(x)`` returns the next stream ``(..., hc, c)``."""

    def __init__(self, layer: nn.Module, *, hc: int, c: int, tmax: int = 20, rms_eps: float = 1e-6,
                 pre_eps: float = 0.0, sinkhorn_eps: float = 1e-6, post_mult: float = 2.0,
                 phi_dtype: torch.dtype = torch.float32, device=None):
        super().__init__()
        for name, value in (("hc", hc), ("c", c), ("tmax", tmax)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        self.layer = layer
        self.hc, self.c = hc, c
        self.tmax, self.rms_eps, self.pre_eps = tmax, float(rms_eps), float(pre_eps)
        self.sinkhorn_eps, self.post_mult = float(sinkhorn_eps), float(post_mult)
        m = hc * hc + 2 * hc
        self.phi = nn.Parameter(torch.randn(hc * c, m, device=device).mul_(0.02).to(phi_dtype))
        self.b = nn.Parameter(torch.zeros(m, device=device))
        self.alpha_pre = nn.Parameter(torch.ones((), device=device))
        self.alpha_post = nn.Parameter(torch.ones((), device=device))
        self.alpha_res = nn.Parameter(torch.ones((), device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() < 3 or tuple(x.shape[-2:]) != (self.hc, self.c):
            raise ValueError(f"x must be (..., {self.hc}, {self.c}), got shape {tuple(x.shape)}")
        return mhc(x, self.layer, self.phi, self.b, self.alpha_pre, self.alpha_post, self.alpha_res,
                   tmax=self.tmax, rms_eps=self.rms_eps, pre_eps=self.pre_eps, sinkhorn_eps=self.sinkhorn_eps,
                   post_mult=self.post_mult)

    def extra_repr(self) -> str:
        return f"hc={self.hc}, c={self.c}, tmax={self.tmax}"
