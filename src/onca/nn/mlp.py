"""``onca.nn.SwiGLUMLP`` and ``onca.nn.GeGLUMLP``: drop-ins for the gated MLPs of Hugging Face models.

- :class:`SwiGLUMLP`: Llama, Mistral, Qwen2/3 (``gate_proj``, ``up_proj``, ``down_proj``, with
  ``config.mlp_bias`` where the config has it) and Phi-3 (one fused ``gate_up_proj`` and
  ``down_proj``; chosen by ``config.model_type == "phi3"`` or ``fused_gate_up=True``).
- :class:`GeGLUMLP`: Gemma 1/2/3 (``config.hidden_activation`` or ``config.hidden_act``:
  ``gelu_pytorch_tanh`` and its aliases use the tanh approximation, ``gelu`` the exact erf form).

Parameter names are Hugging Face's, so their ``state_dict``s load unchanged.

Memory design (``recompute=True``, the default). The MLP tail ``down_proj(act(gate) * up)`` runs as
one custom op (``swiglu_linear``/``geglu_linear``, :mod:`onca.ops._glu`) that does not keep the
``(tokens, intermediate)`` product for ``down_proj``'s weight gradient: between forward and
backward only ``gate`` and ``up`` are kept (two ``T x I`` tensors, against three for liger-kernel's
``LigerSwiGLUMLP``, whose ``nn.Linear`` also saves the product, and four for eager PyTorch). In the
backward, ``dc = dout @ W_down`` is computed first; one kernel then reads ``gate``, ``up`` and
``dc`` and writes ``d_gate`` over ``gate``, ``d_up`` over ``up`` and the recomputed product over
``dc`` (each element read before it is written), and ``dW_down = dout^T @ product`` follows. The
backward's peak is three ``T x I`` tensors where liger's is four, and the only extra work is the
product's recomputation inside a kernel that streams the same tensors anyway. Writing gradients
over ``gate``/``up`` (``overwrite_inputs=True``, the modules' default) is safe because the module
owns them (the projections' outputs are saved by nobody else), with one consequence: a second
backward through the same graph (``retain_graph=True``) is refused with an error; build the module
with ``overwrite_inputs=False`` for that. Compiled graphs never overwrite (they manage their own
buffers). For Phi-3, the fused ``gate_up_proj`` output is used as is (its halves are strided views,
no copy), and its gradient is that same buffer: no ``torch.cat`` of the two halves' gradients.

``recompute=False``, or a ``down_proj`` that is not a plain ``nn.Linear`` (LoRA, quantised layers)
or has hooks, takes the plain path ``down_proj(act(gate) * up)`` with Onca's activation kernel
(still writing gradients over ``gate``/``up`` with ``overwrite_inputs``).

``SwiGLUMLP``'s ``gate_multiplier`` and ``down_multiplier`` are Falcon-H1's ``mlp_multipliers``
(muP): ``down_proj(silu(gate_proj(x) * gate_multiplier) * up_proj(x)) * down_multiplier``.
"""

from __future__ import annotations

import torch
from torch import nn

from onca.ops import _glu
from onca.ops._validate import check_bool, check_number
from onca.ops.geglu import geglu_forward, geglu_linear_forward
from onca.ops.swiglu import swiglu_forward, swiglu_linear_forward

__all__ = ["SwiGLUMLP", "GeGLUMLP", "SILU_ACTIVATIONS", "GELU_ACTIVATIONS", "gated_mlp_tail"]

SILU_ACTIVATIONS = ("silu", "swish")
# Hugging Face activation names -> the kernels' activation.
GELU_ACTIVATIONS = {
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_python_tanh": "gelu_tanh",
    "gelu_new": "gelu_tanh",
    "gelu_fast": "gelu_tanh",
    "gelu": "gelu",
    "gelu_python": "gelu",
}
_APPROXIMATE = {"tanh": "gelu_tanh", "none": "gelu"}


# The kernels' activation -> the (gated, gated linear) forward ops that run it.
_FORWARD_OPS = {
    "silu": (swiglu_forward, swiglu_linear_forward),
    "gelu_tanh": (geglu_forward, geglu_linear_forward),
    "gelu": (geglu_forward, geglu_linear_forward),
}


def gated_mlp_tail(gate: torch.Tensor, up: torch.Tensor | None, down_proj: nn.Module, activation: str, *,
                   recompute: bool = True, overwrite_inputs: bool = False, gate_multiplier: float = 1.0,
                   down_multiplier: float = 1.0) -> torch.Tensor:
    """``down_proj(act(gate * gate_multiplier) * up) * down_multiplier`` (``up=None``: ``gate`` is
    the fused ``[gate | up]`` output).

    With ``recompute`` and a plain ``nn.Linear`` ``down_proj`` (no hooks), the product is not stored
    for the weight gradient but recomputed in the backward (see the module docstring); otherwise the
    plain path with Onca's activation kernel. ``overwrite_inputs``: write the gradients over
    ``gate``/``up`` (for callers that own them, as the modules here and ``onca.apply``'s forwards).
    """
    if activation not in _FORWARD_OPS:
        raise ValueError(f"activation must be one of {sorted(_FORWARD_OPS)}, got {activation!r}")
    gated_op, linear_op = _FORWARD_OPS[activation]
    plain = (recompute and type(down_proj) is nn.Linear
             and not down_proj._forward_hooks and not down_proj._forward_pre_hooks)
    if plain:
        return _glu.gated_linear(linear_op, gate, up, down_proj.weight, down_proj.bias, activation,
                                 gate_multiplier, down_multiplier, overwrite_inputs)
    out = down_proj(_glu.gated(gated_op, gate, up, activation, gate_multiplier, 1.0, overwrite_inputs))
    return out if down_multiplier == 1.0 else out * down_multiplier


class _GatedMLP(nn.Module):
    """The shared body: projections, the fused or separate gate/up layout, the two paths."""

    def __init__(self, config, intermediate_size, activation, fused_gate_up, recompute, overwrite_inputs,
                 gate_multiplier=1.0, down_multiplier=1.0):
        super().__init__()
        check_bool(recompute, "recompute")
        check_bool(overwrite_inputs, "overwrite_inputs")
        check_number(gate_multiplier, "gate_multiplier")
        check_number(down_multiplier, "down_multiplier")
        self.config = config
        self.hidden_size = int(config.hidden_size)
        self.intermediate_size = int(intermediate_size if intermediate_size is not None
                                     else config.intermediate_size)
        if self.hidden_size <= 0 or self.intermediate_size <= 0:
            raise ValueError(
                f"hidden_size and intermediate_size must be positive, got {self.hidden_size} and "
                f"{self.intermediate_size}"
            )
        bias = bool(getattr(config, "mlp_bias", False) or False)
        self.activation = activation
        self.fused_gate_up = fused_gate_up
        self.recompute = recompute
        self.overwrite_inputs = overwrite_inputs
        self.gate_multiplier = float(gate_multiplier)
        self.down_multiplier = float(down_multiplier)
        h, i = self.hidden_size, self.intermediate_size
        if fused_gate_up:
            self.gate_up_proj = nn.Linear(h, 2 * i, bias=bias)
        else:
            self.gate_proj = nn.Linear(h, i, bias=bias)
            self.up_proj = nn.Linear(h, i, bias=bias)
        self.down_proj = nn.Linear(i, h, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused_gate_up:
            gate, up = self.gate_up_proj(x), None
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return gated_mlp_tail(gate, up, self.down_proj, self.activation, recompute=self.recompute,
                              overwrite_inputs=self.overwrite_inputs, gate_multiplier=self.gate_multiplier,
                              down_multiplier=self.down_multiplier)

    def extra_repr(self) -> str:
        multipliers = ""
        if (self.gate_multiplier, self.down_multiplier) != (1.0, 1.0):
            multipliers = f", gate_multiplier={self.gate_multiplier}, down_multiplier={self.down_multiplier}"
        return (
            f"hidden_size={self.hidden_size}, intermediate_size={self.intermediate_size}, "
            f"activation={self.activation!r}, fused_gate_up={self.fused_gate_up}, "
            f"recompute={self.recompute}, overwrite_inputs={self.overwrite_inputs}{multipliers}"
        )


class SwiGLUMLP(_GatedMLP):
    """``down_proj(silu(gate_proj(x)) * up_proj(x))``: Llama, Mistral, Qwen2/3, Phi-3 MLPs.

    ``fused_gate_up``: one ``gate_up_proj`` of ``2 * intermediate_size`` outputs (gate first, as
    Phi-3); by default ``config.model_type == "phi3"``. ``recompute``/``overwrite_inputs``: see the
    module docstring (both on by default; ``overwrite_inputs=False`` allows ``retain_graph`` double
    backward). ``gate_multiplier``/``down_multiplier``: Falcon-H1's ``config.mlp_multipliers``,
    ``down_proj(silu(gate_proj(x) * gate_multiplier) * up_proj(x)) * down_multiplier``.
    """

    def __init__(self, config, intermediate_size=None, *, fused_gate_up=None, recompute=True,
                 overwrite_inputs=True, gate_multiplier=1.0, down_multiplier=1.0):
        act = getattr(config, "hidden_act", "silu")
        if act not in SILU_ACTIVATIONS:
            raise ValueError(
                f"SwiGLUMLP needs hidden_act in {SILU_ACTIVATIONS}, got config.hidden_act={act!r}"
            )
        if fused_gate_up is None:
            fused_gate_up = getattr(config, "model_type", None) == "phi3"
        super().__init__(config, intermediate_size, "silu", bool(fused_gate_up), recompute, overwrite_inputs,
                         gate_multiplier, down_multiplier)


class GeGLUMLP(_GatedMLP):
    """``down_proj(gelu(gate_proj(x)) * up_proj(x))``: Gemma 1/2/3 MLPs.

    The GELU form comes from ``config.hidden_activation`` (Gemma 2/3) or ``config.hidden_act``
    (Gemma 1): ``gelu_pytorch_tanh`` (and ``gelu_new``, ``gelu_fast``, ``gelu_python_tanh``) use the
    tanh approximation, ``gelu``/``gelu_python`` the exact erf form; ``approximate="tanh"`` or
    ``"none"`` overrides it. ``recompute``/``overwrite_inputs``: see the module docstring.
    """

    def __init__(self, config, intermediate_size=None, *, approximate=None, recompute=True,
                 overwrite_inputs=True):
        if approximate is not None:
            if approximate not in _APPROXIMATE:
                raise ValueError(f"approximate must be one of {sorted(_APPROXIMATE)}, got {approximate!r}")
            activation = _APPROXIMATE[approximate]
        else:
            act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)
            if act not in GELU_ACTIVATIONS:
                raise ValueError(
                    f"GeGLUMLP needs a GELU activation ({', '.join(GELU_ACTIVATIONS)}) in "
                    f"config.hidden_activation or config.hidden_act, got {act!r}"
                )
            activation = GELU_ACTIVATIONS[act]
        super().__init__(config, intermediate_size, activation, False, recompute, overwrite_inputs)

    @property
    def approximate(self) -> str:
        return "tanh" if self.activation == "gelu_tanh" else "none"
