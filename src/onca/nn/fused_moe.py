"""``onca.nn.MoEExperts``: a drop-in for the expert collections of Hugging Face MoE models
(``MixtralExperts``, ``Qwen3MoeExperts`` and their kin, ``GptOssExperts``), backed by
:func:`onca.ops.fused_moe.fused_moe`.

Parameter names and shapes are the models' (``gate_up_proj``, ``down_proj`` and, for GPT-OSS,
``gate_up_proj_bias`` and ``down_proj_bias``), so their ``state_dict``s load unchanged, and
``forward(hidden_states, top_k_index, top_k_weights)`` takes what the models' routers return.
"""

from __future__ import annotations

import torch
from torch import nn

from onca.ops.fused_moe import ACTIVATIONS, LAYOUTS, fused_moe

__all__ = ["MoEExperts"]


# GPT-OSS's clamped SwiGLU: the sigmoid's scale and the clamp, as its released configs set them.
GPT_OSS_ALPHA, GPT_OSS_LIMIT = 1.702, 7.0


class MoEExperts(nn.Module):
    """``num_experts`` gated MLP experts of ``hidden_size -> intermediate_size -> hidden_size``.

    ``layout="mixtral"``: ``gate_up_proj (E, 2I, H)`` ([gate | up] rows), ``down_proj (E, H, I)``,
    SwiGLU; ``layout="gpt_oss"``: ``gate_up_proj (E, H, 2I)`` (interleaved gate/up columns),
    ``down_proj (E, I, H)``, biases, and GPT-OSS's clamped SwiGLU (``alpha``, ``limit``).
    ``bias`` defaults to the layout's (GPT-OSS has biases, Mixtral not). Parameters are created
    uninitialised, as the models' (load a state dict, or initialise them).
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, layout: str = "mixtral",
                 activation: str | None = None, bias: bool | None = None, alpha: float = GPT_OSS_ALPHA,
                 limit: float = GPT_OSS_LIMIT, device=None, dtype=None):
        super().__init__()
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
        if activation is not None and activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {', '.join(ACTIVATIONS)}, got {activation!r}")
        for name, value in (("num_experts", num_experts), ("hidden_size", hidden_size),
                            ("intermediate_size", intermediate_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        kw = dict(device=device, dtype=dtype)
        e, h, i = num_experts, hidden_size, intermediate_size
        self.num_experts, self.hidden_dim, self.intermediate_dim = e, h, i
        self.layout, self.activation, self.alpha, self.limit = layout, activation, alpha, limit
        if layout == "mixtral":
            self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h, **kw))
            self.down_proj = nn.Parameter(torch.empty(e, h, i, **kw))
        else:
            self.gate_up_proj = nn.Parameter(torch.empty(e, h, 2 * i, **kw))
            self.down_proj = nn.Parameter(torch.empty(e, i, h, **kw))
        bias = (layout == "gpt_oss") if bias is None else bias
        if bias:
            self.gate_up_proj_bias = nn.Parameter(torch.empty(e, 2 * i, **kw))
            self.down_proj_bias = nn.Parameter(torch.empty(e, h, **kw))
        else:
            self.register_parameter("gate_up_proj_bias", None)
            self.register_parameter("down_proj_bias", None)

    @classmethod
    def from_config(cls, config, **kw) -> "MoEExperts":
        """The experts of a Hugging Face MoE config (Mixtral, Qwen2/3-MoE, GPT-OSS)."""
        gpt_oss = getattr(config, "model_type", "") == "gpt_oss"
        num_experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts")
        inter = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
        # transformers before 5.2x has no swiglu_alpha in the config: its experts hard-code 1.702.
        extra = dict(alpha=getattr(config, "swiglu_alpha", GPT_OSS_ALPHA),
                     limit=getattr(config, "swiglu_limit", GPT_OSS_LIMIT)) if gpt_oss else {}
        return cls(num_experts, config.hidden_size, inter, layout="gpt_oss" if gpt_oss else "mixtral",
                   **extra, **kw)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        return fused_moe(hidden_states, self.gate_up_proj, self.down_proj, top_k_index, top_k_weights,
                         gate_up_proj_bias=self.gate_up_proj_bias, down_proj_bias=self.down_proj_bias,
                         layout=self.layout, activation=self.activation, alpha=self.alpha, limit=self.limit)

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, hidden={self.hidden_dim}, intermediate={self.intermediate_dim}, "
                f"layout={self.layout}")
