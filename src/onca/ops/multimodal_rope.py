"""Multimodal rotary position embedding (M-RoPE): Qwen2-VL, Qwen2.5-VL and Qwen3-VL.

A multimodal model gives each token three positions (temporal, height, width) and so three rotary
tables ``cos``/``sin`` of shape ``(3, 1 or batch, seq, rotary_dim)``, one per position stream. The
rotary dims are split into sections, ``mrope_section = (t, h, w)`` with ``t + h + w = rotary_dim
/ 2``, and each column of each half of the head reads the table of its section's stream:

- contiguous sections (Qwen2-VL, Qwen2.5-VL; transformers 4.x's
  ``apply_multimodal_rotary_pos_emb``, which splits the full width by ``mrope_section * 2``):
  columns ``[0, t)`` of each half rotate by the temporal table, ``[t, t + h)`` by the height
  table, the rest by the width table;
- interleaved sections (Qwen3-VL's ``mrope_interleaved``; transformers' Qwen3-VL rotary embedding
  lays its frequencies out this way): column ``j`` of a half reads height when ``j % 3 == 1`` and
  ``j < 3 * h``, width when ``j % 3 == 2`` and ``j < 3 * w``, temporal otherwise.

Then it is plain RoPE (``x * cos + rotate_half(x) * sin``, ``onca.ops.rope``): transformers 5
assembles the per-column table in the rotary embedding module (``recomposition_frequencies``) and
calls the usual ``apply_rotary_pos_emb``; this op does the assembly inside the rotation kernel, so
the assembled ``(batch, seq, rotary_dim)`` tables are never written. The kernel is
``onca.ops.rope``'s, with its ``MROPE`` variant: each column's cos/sin is read from its stream's
table (no copy of the tables), the rotation, layouts (``unsqueeze_dim``), GQA, partial rotary,
dtype promotion and backward (the adjoint rotation) are RoPE's.

Saved for backward: ``cos`` and ``sin`` (references, no copies); they get no gradient.
"""

from __future__ import annotations

import torch
from torch import Tensor

from onca.ops import rope as _rope
from onca.ops._contract import custom_op, register_autograd, tracing
from onca.ops._validate import check_bool, check_tensor
from onca.tiling import RowPlan

__all__ = ["multimodal_rope", "plan"]


def plan(shape, dtype: torch.dtype, profile=None) -> dict[str, RowPlan]:
    """The plans for ``shape = (batch, seq, q_heads, kv_heads, head_dim[, rotary_dim])``: RoPE's
    (the stream of each column changes where cos/sin are read, not the tile)."""
    return _rope.plan(shape, dtype, profile)


# ------------------------------------------------------------------------------------- custom ops


def _mode(interleaved: bool) -> int:
    return 2 if interleaved else 1


@custom_op("multimodal_rope_forward")
def multimodal_rope_forward(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, section_t: int,
                            section_h: int, section_w: int, interleaved: bool, heads_first: bool,
                            overwrite_grad_output: bool, overwrite_inputs: bool) -> tuple[Tensor, Tensor]:
    """``(q_embed, k_embed)`` for 4-D ``q``/``k`` and 4-D ``(3, B or 1, S, R)`` ``cos``/``sin``;
    ``overwrite_inputs`` (eager route only) as RoPE's."""
    return _rope._rotate_forward(q, k, cos, sin, _rope._promoted(q, cos, sin), _rope._promoted(k, cos, sin),
                                 heads_first, overwrite_inputs, mrope=_mode(interleaved),
                                 sections=(section_t, section_h, section_w))


@multimodal_rope_forward.register_fake
def _(q, k, cos, sin, section_t, section_h, section_w, interleaved, heads_first, overwrite_grad_output,
      overwrite_inputs):
    return _rope._output_like(q, _rope._promoted(q, cos, sin)), _rope._output_like(k, _rope._promoted(k, cos, sin))


@custom_op("multimodal_rope_backward")
def multimodal_rope_backward(dq_embed: Tensor | None, dk_embed: Tensor | None, cos: Tensor, sin: Tensor,
                             section_t: int, section_h: int, section_w: int, interleaved: bool,
                             q_dtype: torch.dtype, k_dtype: torch.dtype, heads_first: bool,
                             overwrite_grad_output: bool) -> tuple[Tensor, Tensor]:
    """``(dq, dk)``; a gradient that did not come gives an empty result (as ``rope_backward``)."""
    dq = _rope._gradient_buffer(dq_embed, q_dtype, cos, overwrite_grad_output)
    dk = _rope._gradient_buffer(dk_embed, k_dtype, cos, overwrite_grad_output)
    _rope._launch(dq_embed, dk_embed, cos, sin, dq, dk, heads_first, backward=True,
                  mrope=_mode(interleaved), sections=(section_t, section_h, section_w))
    return dq, dk


@multimodal_rope_backward.register_fake
def _(dq_embed, dk_embed, cos, sin, section_t, section_h, section_w, interleaved, q_dtype, k_dtype,
      heads_first, overwrite_grad_output):
    return (_rope._gradient_buffer(dq_embed, q_dtype, cos, False),
            _rope._gradient_buffer(dk_embed, k_dtype, cos, False))


def _setup_context(ctx, inputs, output):
    q, k, cos, sin, st, sh, sw, interleaved, heads_first, overwrite_grad_output, _ = inputs
    ctx.save_for_backward(cos, sin)
    ctx.sections, ctx.interleaved = (st, sh, sw), interleaved
    ctx.q_dtype, ctx.k_dtype = q.dtype, k.dtype
    ctx.heads_first, ctx.overwrite_grad_output = heads_first, overwrite_grad_output


def _backward(ctx, dq_embed, dk_embed):
    dq_embed = dq_embed if ctx.needs_input_grad[0] else None
    dk_embed = dk_embed if ctx.needs_input_grad[1] else None
    nones = (None,) * 9
    if dq_embed is None and dk_embed is None:
        return (None, None) + nones
    cos, sin = ctx.saved_tensors
    overwrite = ctx.overwrite_grad_output and not tracing(dq_embed, dk_embed)
    dq, dk = multimodal_rope_backward(dq_embed, dk_embed, cos, sin, *ctx.sections, ctx.interleaved,
                                      ctx.q_dtype, ctx.k_dtype, ctx.heads_first, overwrite)
    return (None if dq_embed is None else dq), (None if dk_embed is None else dk), *nones


register_autograd(multimodal_rope_forward, _backward, setup_context=_setup_context)


# ------------------------------------------------------------------------------------------ public


def _sections(mrope_section, rotary_dim: int) -> tuple[int, int, int]:
    if isinstance(mrope_section, torch.Tensor) or not isinstance(mrope_section, (list, tuple)):
        raise TypeError(f"mrope_section must be a list or tuple of 3 ints (temporal, height, width), "
                        f"got {type(mrope_section).__name__}")
    if len(mrope_section) != 3 or any(isinstance(s, bool) or not isinstance(s, int) or s < 0
                                      for s in mrope_section):
        raise ValueError(f"mrope_section must be 3 non-negative ints (temporal, height, width), "
                         f"got {mrope_section!r}")
    if 2 * sum(mrope_section) != rotary_dim:
        raise ValueError(f"mrope_section must sum to half the rotary dim (cos.shape[-1] / 2 = "
                         f"{rotary_dim // 2}), got {list(mrope_section)} (sum {sum(mrope_section)})")
    return tuple(mrope_section)


def multimodal_rope(
    q: Tensor,
    k: Tensor,
    cos: Tensor,
    sin: Tensor,
    mrope_section,
    unsqueeze_dim: int = 1,
    mrope_interleaved: bool = False,
    overwrite_grad_output: bool = False,
    overwrite_inputs: bool = False,
) -> tuple[Tensor, Tensor]:
    """Multimodal RoPE (M-RoPE) of ``q`` and ``k`` in one launch: a drop-in for transformers 4.x's
    ``apply_multimodal_rotary_pos_emb`` (Qwen2-VL, Qwen2.5-VL) and liger-kernel's
    ``liger_multimodal_rotary_pos_emb``, and, with ``mrope_interleaved=True``, Qwen3-VL's layout.

    ``cos``/``sin`` are ``(3, 1 or batch, seq, rotary_dim)``: one rotary table per position stream
    (temporal, height, width), as the Qwen2-VL rotary embedding computes them before assembly.
    ``mrope_section = (t, h, w)`` (``t + h + w == rotary_dim / 2``) says which stream each column
    of each half of the head takes: contiguous sections (columns ``[0, t)`` temporal, ``[t, t+h)``
    height, the rest width), or interleaved ones (``mrope_interleaved``: column ``j`` is height
    when ``j % 3 == 1 and j < 3h``, width when ``j % 3 == 2 and j < 3w``, else temporal). The
    result is ``x * C + rotate_half(x) * S`` with those assembled tables ``C``/``S``, as
    :func:`onca.functional.rotary_pos_emb` computes it: ``q``/``k`` are 4-D, ``(batch, heads, seq,
    head_dim)`` for ``unsqueeze_dim=1`` or ``(batch, seq, heads, head_dim)`` for ``2``; ``k`` may
    have fewer heads; ``rotary_dim < head_dim`` passes the rest through; the outputs are new
    tensors in the inputs' layout and promoted dtype; ``cos``/``sin`` get no gradient.
    ``overwrite_grad_output`` writes ``dq``/``dk`` over the incoming gradients and
    ``overwrite_inputs`` the rotated heads over ``q``/``k``, returning views of them (as
    liger-kernel's M-RoPE does; where the dtype or layout does not allow it, new tensors), both
    eager only, with :func:`onca.functional.rotary_pos_emb`'s conditions.
    """
    for t, name in ((cos, "cos"), (sin, "sin")):
        check_tensor(t, name)
        if t.dim() != 4 or t.shape[0] != 3:
            raise ValueError(f"{name} must be 4-D (3, 1 or batch, seq, rotary_dim): one table per "
                             f"position stream, got shape {tuple(t.shape)}")
    if isinstance(unsqueeze_dim, bool) or not isinstance(unsqueeze_dim, int) or unsqueeze_dim not in (1, 2, -3, -2):
        # cos.unsqueeze(unsqueeze_dim) of the assembled (batch, seq, rotary_dim) table
        raise ValueError(f"unsqueeze_dim must be 1 or -3 (q/k of shape (batch, heads, seq, head_dim)) "
                         f"or 2 or -2 ((batch, seq, heads, head_dim)), got {unsqueeze_dim!r}")
    heads_first = _rope._validate(q, k, cos, sin, unsqueeze_dim, streams=True)
    sections = _sections(mrope_section, cos.shape[-1])
    check_bool(mrope_interleaved, "mrope_interleaved")
    check_bool(overwrite_grad_output, "overwrite_grad_output")
    check_bool(overwrite_inputs, "overwrite_inputs")
    overwrite_inputs = overwrite_inputs and not tracing(q, k, cos, sin)
    return multimodal_rope_forward(q, k, cos, sin, *sections, mrope_interleaved, heads_first,
                                   overwrite_grad_output, overwrite_inputs)
