"""The limit row of the fused LM heads (not itself a benchmark: the leading underscore keeps it out
of ``onca bench``'s list): the cuBLAS matmuls any implementation of such a head must do, timed
alone in the same run as the head (``gemm_limit``; :mod:`onca.bench.report` reports Onca's speed as
a share of it and never counts it as a peer)."""

from __future__ import annotations

import torch


class HeadGemms(torch.autograd.Function):
    """A trained head's logits and any frozen heads' logits (forward: a reference model's or a
    teacher's, discarded), then the trained head's ``dHidden`` and ``dWeight`` from a logits-sized
    gradient (backward: the logits themselves stand in for it). A speed limit, not an
    implementation: it keeps the trained head's whole logits, and computes no loss."""

    @staticmethod
    def forward(ctx, hidden, weight, *frozen):
        rows = hidden.reshape(-1, hidden.shape[-1])
        logits = rows @ weight.t()
        for frozen_hidden, frozen_weight in zip(frozen[::2], frozen[1::2]):
            frozen_hidden.reshape(-1, frozen_hidden.shape[-1]) @ frozen_weight.t()
        ctx.save_for_backward(rows, weight, logits)
        ctx.hidden_shape, ctx.frozen = hidden.shape, len(frozen)
        return hidden.new_zeros(())

    @staticmethod
    def backward(ctx, grad):
        rows, weight, logits = ctx.saved_tensors
        return ((logits @ weight).reshape(ctx.hidden_shape), logits.t() @ rows, *([None] * ctx.frozen))


def head_gemm_limit(trained: tuple[str, str], frozen: tuple[str, ...] = ()):
    """The ``gemm_limit`` provider of a head whose inputs name the trained ``(hidden, weight)`` and
    the frozen heads' hidden and weight inputs, in pairs."""

    def factory(p, inputs):
        args = [inputs[name] for name in (*trained, *frozen)]
        return lambda: HeadGemms.apply(*args)

    return factory


def head_gemm_bytes(tokens: int, vocab: int, itemsize: int, frozen_heads: int = 0) -> int:
    """The limit row's memory beyond its inputs and gradients: the trained head's logits, saved for
    the backward, and one frozen head's logits at a time, discarded."""
    return tokens * vocab * itemsize * (1 + min(frozen_heads, 1))
