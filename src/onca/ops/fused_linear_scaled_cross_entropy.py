"""Fused linear scaled cross entropy: per-token NLL (and entropy) of temperature-scaled logits
``z = (hidden @ weight.T + bias) / temperature`` without the ``(tokens, vocab)`` logits existing in
full. The per-token form RL trainers use (verl's ``FusedLinearForPPO``, liger-kernel's
``LigerFusedLinearScaledCrossEntropyFunction``): each token's ``-log_softmax(z)[target]`` and,
optionally, the entropy of ``softmax(z)``, both differentiable.

This op has no kernels of its own: it is the chunk driver's per-token statistics
(:func:`onca.ops._chunked_head.chunked_logprobs`, custom ops ``onca::chunked_logprob_forward`` /
``onca::chunked_logprob_backward``) with the sign and dtype liger-kernel gives them. Forward: one
head matmul per token chunk into a reused scratch and one Triton kernel (online log-sum-exp over
column tiles, the target's logit, the entropy); saved: the inputs and one fp32 ``lse`` (and entropy)
per token. Backward: each chunk's logits recomputed, their gradient
``(g_nll * (p - onehot(y)) - g_ent * p * (z - zbar)) / temperature`` (``zbar = sum_j p_j z_j``)
written over them by one kernel, then ``dHidden = g @ W`` and ``dW += g.T @ h`` (fp32 for bf16/fp16
heads).
"""

from __future__ import annotations

import torch
from torch import Tensor

from onca.ops._chunked_head import check_options, chunked_logprobs, head_inputs, plan, validate_head
from onca.ops._validate import check_bool, check_tensor

__all__ = ["fused_linear_scaled_cross_entropy", "plan"]


def fused_linear_scaled_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    target: Tensor,
    temperature: float = 1.0,
    ignore_index: int = -100,
    *,
    return_entropy: bool = False,
    bias: Tensor | None = None,
    chunk_tokens: int | None = None,
    accum_dtype: torch.dtype | None = None,
    keep_logits: bool = False,
):
    """Per-token ``-log_softmax((hidden @ weight.T + bias) / temperature)[target]`` without
    materialising the logits; with ``return_entropy=True`` also each token's entropy of that softmax.

    ``hidden`` ``(..., H)``, ``weight`` ``(V, H)`` (the LM head, ``hidden``'s dtype), ``target``
    ``(...)`` int32/int64 class indices (aligned with ``hidden``: token ``t`` is scored against
    ``target[t]``), ``bias`` ``(V,)`` or None (liger-kernel has none). Returns the NLL, fp32, shaped
    like ``target`` (0 where ``target == ignore_index``), or ``(nll, entropy)`` with the entropy in
    ``hidden``'s dtype (0 where ignored), as liger-kernel's ``LigerFusedLinearScaledCrossEntropyFunction``
    (its ``m_tiles_per_cluster`` is a Hopper tiling knob with no counterpart here; its
    ``selected_token_ids`` output is not provided). Both outputs are differentiable w.r.t. ``hidden``,
    ``weight`` and ``bias``. A target outside ``[0, V)`` that is not ``ignore_index`` gives a NaN
    NLL (checked on the device, without a host synchronisation); a small call on CUDA (torch's ops,
    :mod:`onca.ops._small_calls`) stops with torch's device-side assertion instead. ``temperature``
    must be a finite number > 0; ``chunk_tokens`` overrides the tokens per chunk (planned from the
    free device memory by default); ``accum_dtype`` the weight gradient's accumulator over the
    chunks (None: the weight's dtype, one rounding per chunk; ``torch.float32``: fp32, a head-sized
    buffer more); ``keep_logits=True`` keeps the whole ``(tokens, vocab)`` logits in ``hidden``'s
    dtype from the forward to the backward (``tokens * vocab * itemsize`` bytes) so that the
    backward reads them instead of recomputing them (three head matmuls instead of four, the same
    result to rounding).
    Under ``torch.autocast`` the head's inputs are cast to the autocast dtype first, as
    ``F.linear`` would.
    """
    check_tensor(hidden, "hidden")
    check_bool(return_entropy, "return_entropy")
    check_options(ignore_index, temperature, chunk_tokens)
    # Checked here too so that errors name this function's arguments (``target``, not ``labels``);
    # under autocast, on the inputs as the head will see them.
    (head_hidden, head_weight, head_bias), _ = head_inputs(hidden, weight, bias)
    validate_head(head_hidden, head_weight, target, head_bias, labels_name="target")
    logp, entropy = chunked_logprobs(head_hidden, head_weight, target, head_bias, ignore_index=ignore_index,
                                     temperature=temperature, entropy=return_entropy,
                                     chunk_tokens=chunk_tokens, accum_dtype=accum_dtype,
                                     keep_logits=keep_logits)
    nll = logp.neg()
    if not return_entropy:
        return nll
    # liger-kernel returns the entropy in the logits' dtype.
    return nll, entropy.to(head_hidden.dtype)
