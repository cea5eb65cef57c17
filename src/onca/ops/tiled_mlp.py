"""Tiled gated MLP: ``down(act(x W_gate^T) * (x W_up^T))`` computed in token shards, recomputed in
the backward, so that long sequences never hold the ``(tokens, intermediate)`` activations of more
than one shard (liger-kernel's ``LigerTiledSwiGLUMLP`` / ``LigerTiledGEGLUMLP``, after DeepSpeed's
TiledMLP).

Forward: for each shard of ``ceil(tokens / num_shards)`` tokens, ``gate = x_s W_gate^T``,
``up = x_s W_up^T``, ``h = act(gate) * up`` (Onca's SwiGLU/GeGLU kernel, rounding as the Hugging
Face MLPs do), ``out_s = h W_down^T``. Only ``x`` (a reference) is saved. Backward, per shard: the
projections again, ``dh = dout_s W_down``, then Onca's gated-activation backward kernel writes
``d_gate`` over ``gate``, ``d_up`` over ``up`` and the recomputed ``h`` over ``dh``;
``dW_down += dout_s^T h``, ``dW_gate += d_gate^T x_s``, ``dW_up += d_up^T x_s`` (accumulated in
place, in the weights' dtype) and ``dx_s = d_gate W_gate + d_up W_up``. Peak activation memory is
about three ``(shard, intermediate)`` tensors instead of the whole sequence's, at the cost of the
projections computed twice (the forward runs once more in the backward, as in liger-kernel).

``num_shards`` defaults to liger-kernel's ``ceil(seq / hidden)`` (``seq = x.shape[-2]``), at least 1.
The shard boundaries are derived from shapes only: no host synchronisation, and the two custom ops
``tiled_mlp_forward``/``tiled_mlp_backward`` are single opaque nodes for ``torch.compile``.

A small eager call on CUDA (its largest tensor, a weight or the ``(tokens, intermediate)``
activation, of at most :func:`onca.ops._small_calls.limit` elements) is the plain MLP by torch's
ops, autograd for the gradient: there the activations are a few MB at most, nothing is worth
tiling, and the host path decides the speed.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from onca.ops import _glu
from onca.ops import _small_calls as small_calls
from onca.ops._contract import custom_op, register_autograd
from onca.ops._validate import check_float, check_same_device, check_tensor
from onca.tiling import RowPlan

__all__ = ["tiled_mlp", "plan", "default_num_shards"]

_ACTIVATIONS = {"silu": "silu", "swiglu": "silu", "gelu_tanh": "gelu_tanh", "geglu": "gelu_tanh", "gelu": "gelu"}


def default_num_shards(x_shape, hidden: int) -> int:
    """liger-kernel's default: ``ceil(seq / hidden)`` for ``x`` of shape ``(..., seq, hidden)``."""
    seq = x_shape[-2] if len(x_shape) >= 2 else x_shape[0]
    return max(1, math.ceil(seq / hidden))


def _shards(rows: Tensor, num_shards: int) -> tuple[Tensor, ...]:
    """``rows`` in at most ``num_shards`` consecutive pieces, as ``torch.chunk`` splits them (views,
    made in one call); none where there are no rows."""
    return rows.chunk(num_shards) if rows.shape[0] else ()


def plan(shape, dtype: torch.dtype, profile=None) -> dict[str, RowPlan]:
    """The activation kernel's plans for one shard: ``shape = (shard_tokens, intermediate)``."""
    return _glu.plan(shape, dtype, profile)


@custom_op("tiled_mlp_forward")
def tiled_mlp_forward(x: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor, activation: int,
                      num_shards: int) -> Tensor:
    """``(tokens, hidden)`` output for ``(tokens, hidden)`` ``x``, shard by shard."""
    out = x.new_empty((x.shape[0], w_down.shape[0]))
    gate_t, up_t, down_t = w_gate.t(), w_up.t(), w_down.t()  # once, not per shard: host time
    for xs, out_s in zip(_shards(x, num_shards), _shards(out, num_shards)):
        h = _glu._product(xs @ gate_t, xs @ up_t, activation, 1.0, 1.0)
        torch.mm(h, down_t, out=out_s)
    return out


@tiled_mlp_forward.register_fake
def _(x, w_gate, w_up, w_down, activation, num_shards):
    return x.new_empty((x.shape[0], w_down.shape[0]))


@custom_op("tiled_mlp_backward")
def tiled_mlp_backward(dout: Tensor, x: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor, activation: int,
                       num_shards: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(dx, dW_gate, dW_up, dW_down)``, recomputing each shard's activations. The first shard
    writes the weight gradients, each allocated only when its matmul runs, and every activation is
    dropped after its last use: with one shard (``seq <= hidden``) at most four ``(shard,
    intermediate)``-or-weight-sized tensors are alive, not six."""
    dx = torch.empty_like(x)
    if x.shape[0] == 0:
        return dx, torch.zeros_like(w_gate), torch.zeros_like(w_up), torch.zeros_like(w_down)
    dwg = dwu = dwd = None
    gate_t, up_t = w_gate.t(), w_up.t()
    for xs, ds, dxs in zip(_shards(x, num_shards), _shards(dout, num_shards), _shards(dx, num_shards)):
        gate, up = xs @ gate_t, xs @ up_t
        dh = ds @ w_down
        # d_gate over gate, d_up over up, the recomputed product over dh (each read before written).
        _glu._product_backward(dh, gate, up, gate, up, activation, 1.0, 1.0, product=dh)
        dwd = _accumulate(dwd, ds.t(), dh)
        del dh
        torch.mm(gate, w_gate, out=dxs)
        dxs.addmm_(up, w_up)
        dwg = _accumulate(dwg, gate.t(), xs)
        del gate
        dwu = _accumulate(dwu, up.t(), xs)
        del up
    return dx, dwg, dwu, dwd


def _accumulate(total: Tensor | None, a: Tensor, b: Tensor) -> Tensor:
    """``a @ b`` added to ``total`` in place, or, for the first shard, a new tensor."""
    return a @ b if total is None else total.addmm_(a, b)


@tiled_mlp_backward.register_fake
def _(dout, x, w_gate, w_up, w_down, activation, num_shards):
    return torch.empty_like(x), torch.empty_like(w_gate), torch.empty_like(w_up), torch.empty_like(w_down)


def _setup_context(ctx, inputs, output):
    x, w_gate, w_up, w_down, activation, num_shards = inputs
    ctx.save_for_backward(x, w_gate, w_up, w_down)
    ctx.activation, ctx.num_shards = activation, num_shards


def _backward(ctx, dout):
    x, w_gate, w_up, w_down = ctx.saved_tensors
    dx, dwg, dwu, dwd = tiled_mlp_backward(dout.contiguous(), x, w_gate, w_up, w_down, ctx.activation,
                                           ctx.num_shards)
    need = ctx.needs_input_grad
    return (dx if need[0] else None, dwg if need[1] else None, dwu if need[2] else None,
            dwd if need[3] else None, None, None)


register_autograd(tiled_mlp_forward, _backward, setup_context=_setup_context)


def tiled_mlp(x: Tensor, gate_weight: Tensor, up_weight: Tensor, down_weight: Tensor,
              activation: str = "silu", num_shards: int | None = None) -> Tensor:
    """The gated MLP ``down_proj(act(gate_proj(x)) * up_proj(x))`` (no biases) computed in
    ``num_shards`` token shards with recomputation in the backward: the activation memory of one
    shard instead of the whole sequence (liger-kernel's tiled MLP).

    ``x`` is ``(..., seq, hidden)`` (or ``(tokens, hidden)``); the weights are ``nn.Linear``'s:
    ``gate_weight``/``up_weight`` ``(intermediate, hidden)``, ``down_weight`` ``(hidden_out,
    intermediate)``, all of ``x``'s dtype. ``activation``: ``"silu"`` (SwiGLU; alias ``"swiglu"``),
    ``"gelu_tanh"`` (GeGLU, Gemma; alias ``"geglu"``) or ``"gelu"`` (exact erf). ``num_shards``
    defaults to ``ceil(seq / hidden)``. Returns ``(..., seq, hidden_out)``; gradients for ``x``
    and the three weights.
    """
    check_float(x, "x")
    if x.dim() < 2:
        raise ValueError(f"x must be at least 2-D (..., seq, hidden), got shape {tuple(x.shape)}")
    hidden = x.shape[-1]
    for w, name in ((gate_weight, "gate_weight"), (up_weight, "up_weight"), (down_weight, "down_weight")):
        check_tensor(w, name)
        check_same_device(w, name, x, "x")
        if w.dtype != x.dtype:
            raise TypeError(f"{name} must have x's dtype {x.dtype}, got {w.dtype}")
        if w.dim() != 2:
            raise ValueError(f"{name} must be 2-D (out_features, in_features), got shape {tuple(w.shape)}")
    if gate_weight.shape[1] != hidden or up_weight.shape != gate_weight.shape:
        raise ValueError(f"gate_weight and up_weight must be (intermediate, hidden={hidden}), got "
                         f"{tuple(gate_weight.shape)} and {tuple(up_weight.shape)}")
    if down_weight.shape[1] != gate_weight.shape[0]:
        raise ValueError(f"down_weight must be (hidden_out, intermediate={gate_weight.shape[0]}), "
                         f"got {tuple(down_weight.shape)}")
    if activation not in _ACTIVATIONS:
        raise ValueError(f"activation must be one of {', '.join(_ACTIVATIONS)}, got {activation!r}")
    if num_shards is None:
        num_shards = default_num_shards(x.shape, hidden)
    if isinstance(num_shards, bool) or not isinstance(num_shards, int) or num_shards < 1:
        raise ValueError(f"num_shards must be a positive int, got {num_shards!r}")
    rows = x.reshape(-1, hidden)
    largest = max(rows.shape[0] * gate_weight.shape[0], gate_weight.numel(), down_weight.numel())
    if small_calls.small(largest, x, gate_weight, up_weight, down_weight):
        return _torch_mlp(x, gate_weight, up_weight, down_weight, _ACTIVATIONS[activation])
    if rows.stride(-1) != 1 or rows.stride(0) != hidden:
        rows = rows.contiguous()
    out = tiled_mlp_forward(rows, gate_weight, up_weight, down_weight, _glu.ACTIVATIONS[_ACTIVATIONS[activation]],
                            num_shards)
    return out.view(*x.shape[:-1], down_weight.shape[0])


def _torch_mlp(x: Tensor, gate_weight: Tensor, up_weight: Tensor, down_weight: Tensor, kind: str) -> Tensor:
    """A small call by torch's ops (:mod:`onca.ops._small_calls`): the Hugging Face MLP's
    ``down(act(gate(x)) * up(x))``, untiled, autograd for the gradients."""
    gate = F.linear(x, gate_weight)
    act = F.silu(gate) if kind == "silu" else F.gelu(gate, approximate="tanh" if kind == "gelu_tanh" else "none")
    return F.linear(act * F.linear(x, up_weight), down_weight)
