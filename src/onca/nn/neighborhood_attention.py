"""``onca.nn.NeighborhoodAttention``: self-attention restricted to a 1-D window around each position."""

from __future__ import annotations

import math

import torch
from torch import nn

from onca.ops.neighborhood_attention import neighborhood_attention


class NeighborhoodAttention(nn.Module):
    """Multi-head self-attention in which each position attends only to its neighbourhood:
    ``q_proj``/``k_proj``/``v_proj`` projections, :func:`onca.ops.neighborhood_attention.
    neighborhood_attention` over ``kernel_size`` positions (spaced ``dilation`` apart, clipped at
    the sequence's ends), optional dropout, then ``out_proj``. Parameter names and options as
    liger-kernel's ``LigerFusedNeighborhoodAttention``, so its state dicts load unchanged.

    ``forward(hidden_states, attention_mask=None)``: ``(batch, seq_len, hidden_size)`` in and out;
    an attention mask is not supported (``NotImplementedError``), as in liger-kernel.
    """

    def __init__(self, hidden_size: int, num_heads: int, kernel_size: int = 7, dilation: int = 1,
                 bias: bool = True, dropout: float = 0.0, scale: float | None = None):
        super().__init__()
        if hidden_size % num_heads != 0:
            raise ValueError(f"hidden_size ({hidden_size}) must be divisible by num_heads ({num_heads})")
        if kernel_size <= 0 or kernel_size % 2 == 0:
            raise ValueError(f"kernel_size must be a positive odd number, got {kernel_size}")
        if dilation < 1:
            raise ValueError(f"dilation must be >= 1, got {dilation}")
        self.hidden_size = hidden_size
        self.num_heads = num_heads
        self.head_dim = hidden_size // num_heads
        self.kernel_size = kernel_size
        self.dilation = dilation
        self.scale = scale if scale is not None else 1.0 / math.sqrt(self.head_dim)
        self.dropout_p = dropout
        self.q_proj = nn.Linear(hidden_size, hidden_size, bias=bias)
        self.k_proj = nn.Linear(hidden_size, hidden_size, bias=bias)
        self.v_proj = nn.Linear(hidden_size, hidden_size, bias=bias)
        self.out_proj = nn.Linear(hidden_size, hidden_size, bias=bias)
        self.dropout = nn.Dropout(dropout) if dropout > 0.0 else None

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        if attention_mask is not None:
            raise NotImplementedError("NeighborhoodAttention does not take an attention_mask")
        batch, seq_len, _ = hidden_states.shape
        shape = (batch, seq_len, self.num_heads, self.head_dim)
        # (B, L, H, D) viewed as (B, H, L, D): the kernels read these strides in place.
        q, k, v = (proj(hidden_states).view(shape).transpose(1, 2)
                   for proj in (self.q_proj, self.k_proj, self.v_proj))
        out = neighborhood_attention(q, k, v, self.kernel_size, self.dilation, self.scale)
        out = out.transpose(1, 2).reshape(batch, seq_len, self.hidden_size)
        if self.dropout is not None:
            out = self.dropout(out)
        return self.out_proj(out)

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, num_heads={self.num_heads}, head_dim={self.head_dim}, "
                f"kernel_size={self.kernel_size}, dilation={self.dilation}, scale={self.scale}, "
                f"dropout={self.dropout_p}")
