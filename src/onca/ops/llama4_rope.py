"""Llama 4's rotary position embedding: the interleaved, complex-number form.

Llama 4 (transformers' ``models/llama4`` ``apply_rotary_emb``) treats each head of width ``D`` as
``D / 2`` complex numbers ``x[2j] + i x[2j+1]`` and multiplies them by the complex table
``freqs_cis`` (``Llama4TextRotaryEmbedding``'s output: ``polar(1, pos * inv_freq)`` times the
attention scaling), of shape ``(1 or batch, seq, D / 2)``::

    y[2j]   = x[2j] * re(f[j]) - x[2j+1] * im(f[j])
    y[2j+1] = x[2j] * im(f[j]) + x[2j+1] * re(f[j])

in fp32 (the model casts ``x`` to fp32 first), rounded once to ``x``'s dtype (``type_as``).
``q``/``k`` are ``(batch, seq, heads, head_dim)``, the projection's view before the transpose.

This is the RoPE rotation with other pairs, so it runs on ``onca.ops.rope``'s kernel, in its
``INTERLEAVED`` variant: pairs ``(2j, 2j+1)`` instead of ``(j, j + D/2)``, and one cos/sin value
per pair read straight from the complex table's real and imaginary parts (``view_as_real``: no
copy, column stride 2). Backward is the rotation by the conjugate, one launch for ``dq`` and ``dk``.
Saved for backward: ``freqs_cis`` (a reference); it gets no gradient (the model computes it under
``no_grad``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from onca.ops import rope as _rope
from onca.ops._contract import custom_op, register_autograd, tracing
from onca.ops._validate import check_bool, check_float, check_same_device, check_tensor
from onca.tiling import RowPlan

__all__ = ["llama4_rope", "plan"]

_COMPLEX = (torch.complex64, torch.complex128)


def plan(shape, dtype: torch.dtype, profile=None) -> dict[str, RowPlan]:
    """The plans for ``shape = (batch, seq, q_heads, kv_heads, head_dim)``: RoPE's tile (the pairs
    are adjacent instead of half a head apart; the tile is RoPE's interleaved one)."""
    return _rope.plan(shape, dtype, profile, interleaved=True)


def _tables(freqs_cis: Tensor) -> tuple[Tensor, Tensor]:
    """cos/sin views ``(1 or batch, seq, D / 2)`` of the complex table (column stride 2)."""
    real = torch.view_as_real(freqs_cis)
    return real[..., 0], real[..., 1]


@custom_op("llama4_rope_forward")
def llama4_rope_forward(q: Tensor, k: Tensor, freqs_cis: Tensor, overwrite_grad_output: bool,
                        overwrite_inputs: bool) -> tuple[Tensor, Tensor]:
    """``(q_embed, k_embed)`` for ``(B, S, H, D)`` ``q``/``k`` and a complex ``(B or 1, S, D/2)``
    table; ``overwrite_inputs`` (eager route only) as RoPE's."""
    cos, sin = _tables(freqs_cis)
    return _rope._rotate_forward(q, k, cos, sin, q.dtype, k.dtype, False, overwrite_inputs, interleaved=True)


@llama4_rope_forward.register_fake
def _(q, k, freqs_cis, overwrite_grad_output, overwrite_inputs):
    return _rope._output_like(q, q.dtype), _rope._output_like(k, k.dtype)


@custom_op("llama4_rope_backward")
def llama4_rope_backward(dq_embed: Tensor | None, dk_embed: Tensor | None, freqs_cis: Tensor,
                         q_dtype: torch.dtype, k_dtype: torch.dtype,
                         overwrite_grad_output: bool) -> tuple[Tensor, Tensor]:
    """``(dq, dk)``: the incoming gradients rotated by the conjugate table; a gradient that did not
    come gives an empty result. ``overwrite_grad_output`` (eager only) writes over them."""
    cos, sin = _tables(freqs_cis)
    dq = _rope._gradient_buffer(dq_embed, q_dtype, cos, overwrite_grad_output)
    dk = _rope._gradient_buffer(dk_embed, k_dtype, cos, overwrite_grad_output)
    _rope._launch(dq_embed, dk_embed, cos, sin, dq, dk, heads_first=False, backward=True, interleaved=True)
    return dq, dk


@llama4_rope_backward.register_fake
def _(dq_embed, dk_embed, freqs_cis, q_dtype, k_dtype, overwrite_grad_output):
    like = freqs_cis.new_empty(0, dtype=torch.float32)
    return (_rope._gradient_buffer(dq_embed, q_dtype, like, False),
            _rope._gradient_buffer(dk_embed, k_dtype, like, False))


def _setup_context(ctx, inputs, output):
    q, k, freqs_cis, overwrite_grad_output, _ = inputs
    ctx.save_for_backward(freqs_cis)
    ctx.q_dtype, ctx.k_dtype, ctx.overwrite_grad_output = q.dtype, k.dtype, overwrite_grad_output


def _backward(ctx, dq_embed, dk_embed):
    dq_embed = dq_embed if ctx.needs_input_grad[0] else None
    dk_embed = dk_embed if ctx.needs_input_grad[1] else None
    if dq_embed is None and dk_embed is None:
        return None, None, None, None, None
    (freqs_cis,) = ctx.saved_tensors
    overwrite = ctx.overwrite_grad_output and not tracing(dq_embed, dk_embed)
    dq, dk = llama4_rope_backward(dq_embed, dk_embed, freqs_cis, ctx.q_dtype, ctx.k_dtype, overwrite)
    return (None if dq_embed is None else dq), (None if dk_embed is None else dk), None, None, None


register_autograd(llama4_rope_forward, _backward, setup_context=_setup_context)


def llama4_rope(q: Tensor, k: Tensor, freqs_cis: Tensor, overwrite_grad_output: bool = False,
                overwrite_inputs: bool = False) -> tuple[Tensor, Tensor]:
    """Llama 4's rotary embedding of ``q`` and ``k`` in one launch: a drop-in for transformers'
    ``models.llama4.modeling_llama4.apply_rotary_emb(xq, xk, freqs_cis)`` and liger-kernel's
    ``liger_llama4_text_rotary_pos_emb``.

    ``q``/``k`` are ``(batch, seq, heads, head_dim)`` (``k`` may have fewer heads; strided views
    with a unit last-dim stride are read in place) and each head is ``head_dim / 2`` complex numbers
    ``(x[2j], x[2j+1])``, multiplied by ``freqs_cis`` (complex64 or complex128, shape ``(1 or
    batch, seq, head_dim / 2)``, or ``(seq, head_dim / 2)`` for every sequence) in fp32. The results
    are new tensors of ``q``'s and ``k``'s dtypes and layouts; ``freqs_cis`` gets no gradient.
    ``overwrite_grad_output`` writes ``dq``/``dk`` over the incoming gradients and
    ``overwrite_inputs`` the rotated heads over ``q``/``k``, returning views of them (as
    liger-kernel's Llama 4 RoPE does; where the layout does not allow it, new tensors), both eager
    only, with :func:`onca.functional.rotary_pos_emb`'s conditions.
    """
    check_float(q, "q")
    check_float(k, "k")
    check_tensor(freqs_cis, "freqs_cis")
    if freqs_cis.dtype not in _COMPLEX:
        raise TypeError(f"freqs_cis must be a complex tensor (complex64 or complex128), got {freqs_cis.dtype}")
    for t, name in ((q, "q"), (k, "k")):
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D (batch, seq, heads, head_dim), got shape {tuple(t.shape)}")
    check_same_device(k, "k", q, "q")
    check_same_device(freqs_cis, "freqs_cis", q, "q")
    b, s, _, d = q.shape
    if (k.shape[0], k.shape[1], k.shape[3]) != (b, s, d):
        raise ValueError(f"k must match q's batch, seq and head_dim: q {tuple(q.shape)}, k {tuple(k.shape)}")
    if d % 2:
        raise ValueError(f"q's head_dim must be even (pairs of real and imaginary parts), got {d}")
    if freqs_cis.dim() == 2:
        freqs_cis = freqs_cis.unsqueeze(0)
    if (freqs_cis.dim() != 3 or freqs_cis.shape[0] not in (1, b) or freqs_cis.shape[1] not in (1, s)
            or freqs_cis.shape[2] != d // 2):
        raise ValueError(f"freqs_cis must have shape (1 or batch={b}, seq={s}, head_dim / 2={d // 2}) or "
                         f"(seq, head_dim / 2) for q {tuple(q.shape)}, got {tuple(freqs_cis.shape)}")
    check_bool(overwrite_grad_output, "overwrite_grad_output")
    check_bool(overwrite_inputs, "overwrite_inputs")
    overwrite_inputs = overwrite_inputs and not tracing(q, k, freqs_cis)
    return llama4_rope_forward(q, k, freqs_cis, overwrite_grad_output, overwrite_inputs)
