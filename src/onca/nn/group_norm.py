"""``onca.nn.GroupNorm``: a drop-in for ``torch.nn.GroupNorm``."""

from __future__ import annotations

import torch
from torch import nn

from onca.ops.group_norm import group_norm


class GroupNorm(nn.GroupNorm):
    """``torch.nn.GroupNorm`` backed by Onca's kernels: same constructor (``num_groups``,
    ``num_channels``, ``eps``, ``affine``), parameters (``weight``, ``bias``), initialisation and
    state dict, and an instance of it. liger-kernel's ``LigerGroupNorm(num_channels, num_groups,
    eps=1e-6, bias=False, init_fn="ones")`` takes its arguments in the other order."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return group_norm(input, self.num_groups, self.weight, self.bias, self.eps)
