"""``onca.nn.TiledSwiGLUMLP`` and ``onca.nn.TiledGeGLUMLP``: the gated MLPs computed in token shards
(:func:`onca.functional.tiled_mlp`), drop-ins for liger-kernel's ``LigerTiledSwiGLUMLP`` /
``LigerTiledGEGLUMLP`` with Hugging Face's parameter names (``gate_proj``, ``up_proj``,
``down_proj``, no biases), so the MLPs' ``state_dict``s load unchanged."""

from __future__ import annotations

from torch import nn

from onca.nn.mlp import GELU_ACTIVATIONS
from onca.ops.tiled_mlp import tiled_mlp

__all__ = ["TiledSwiGLUMLP", "TiledGeGLUMLP"]


class _TiledGatedMLP(nn.Module):
    activation = "silu"

    def __init__(self, config, num_shards: int | None = None):
        super().__init__()
        self.config = config
        self.hidden_size = config.hidden_size
        self.intermediate_size = config.intermediate_size
        self.num_shards = num_shards
        self.gate_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=False)
        self.up_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=False)
        self.down_proj = nn.Linear(self.intermediate_size, self.hidden_size, bias=False)

    def forward(self, x):
        return tiled_mlp(x, self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight,
                         self.activation, self.num_shards)


class TiledSwiGLUMLP(_TiledGatedMLP):
    """``down_proj(silu(gate_proj(x)) * up_proj(x))`` in ``num_shards`` token shards (default
    ``ceil(seq / hidden_size)``), recomputed in the backward."""

    activation = "silu"


class TiledGeGLUMLP(_TiledGatedMLP):
    """``down_proj(gelu(gate_proj(x)) * up_proj(x))`` in token shards; the GELU form follows
    ``config.hidden_activation`` or ``config.hidden_act`` (tanh approximation by default, Gemma's)."""

    def __init__(self, config, num_shards: int | None = None):
        super().__init__(config, num_shards)
        act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None) or "gelu_pytorch_tanh"
        if act not in GELU_ACTIVATIONS:
            raise ValueError(f"config's activation must be one of {', '.join(GELU_ACTIVATIONS)}, got {act!r}")
        self.activation = GELU_ACTIVATIONS[act]
