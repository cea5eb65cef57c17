"""``onca.nn.ReLUSquared``: the squared ReLU activation module (liger-kernel's ``LigerReLUSquared``,
transformers' ``ReLUSquaredActivation``, which ``ACT2FN["relu2"]`` gives Nemotron's MLP)."""

from __future__ import annotations

import torch

from onca.ops.relu_squared import relu_squared


class ReLUSquared(torch.nn.Module):
    """``relu(x) ** 2`` elementwise, computed by Onca's kernel. No parameters: it replaces an MLP's
    ``act_fn`` without touching its state dict."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return relu_squared(input)
