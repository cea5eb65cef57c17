"""``onca.nn.MultiTokenAttention``: the key-query convolution of multi-token attention."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn.modules.utils import _pair

from onca.ops.multi_token_attention import multi_token_attention


class MultiTokenAttention(nn.Module):
    """``mask_0(conv2d(softmax(mask_-inf(scores))))`` with a learned ``(out_channels, in_channels //
    groups, k, k)`` kernel over the attention scores ``(B, in_channels, L, L)`` (heads as channels):
    :func:`onca.ops.multi_token_attention.multi_token_attention`. Constructor, parameter names and
    initialisation as liger-kernel's ``LigerMultiTokenAttention`` (Kaiming-uniform weight, zero bias),
    so its state dicts load unchanged. ``sparse=True``: sparsemax instead of softmax.
    """

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, stride: int = 1, padding: int = 0,
                 dilation: int = 1, groups: int = 1, bias: bool = True, sparse: bool = False):
        super().__init__()
        self.in_channels = in_channels
        self.out_channels = out_channels
        self.kernel_size = _pair(kernel_size)
        self.stride = _pair(stride)
        self.padding = _pair(padding)
        self.dilation = _pair(dilation)
        self.groups = groups
        self.sparse = sparse
        self.weight = nn.Parameter(torch.empty(out_channels, in_channels // groups, *self.kernel_size))
        if bias:
            self.bias = nn.Parameter(torch.empty(out_channels))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def forward(self, scores: torch.Tensor) -> torch.Tensor:
        return multi_token_attention(scores, self.weight, self.bias, self.stride, self.padding, self.dilation,
                                     self.groups, self.sparse)

    def extra_repr(self) -> str:
        return (f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, stride={self.stride}, "
                f"padding={self.padding}, dilation={self.dilation}, groups={self.groups}, "
                f"bias={self.bias is not None}, sparse={self.sparse}")
