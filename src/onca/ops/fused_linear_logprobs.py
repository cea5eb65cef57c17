"""Per-token log-probabilities of a language-model head without the logits: TRL's fused-LM-head
contract (``trl.kernels.ChunkedLogProbFunction``), on Onca's chunk driver.

Given the last hidden states, the head's ``weight`` (and ``bias``) and the next-token ``labels``,
:func:`fused_linear_logprobs` returns, per token, ``log_softmax(z)[label]`` where ::

    z = tanh(logit_scale * (hidden @ weight.T + bias) / softcap) * softcap / temperature   (softcap given)
    z = logit_scale * (hidden @ weight.T + bias) / temperature                             (softcap None)

(the order TRL's kernel and the Hugging Face models apply them in: Cohere's ``logit_scale``,
Gemma's ``final_logit_softcapping``, the sampling temperature) and, each only when named in
``outputs``: the entropy of ``softmax(z)``, ``log sum_v p_v^2``, the mean of ``z`` over the
vocabulary and whether the label is the first argmax of ``z``. The log-probabilities and the
entropy are differentiable (w.r.t. ``hidden``, ``weight``, ``bias``); the other three are not.

It is the same pair of custom ops as every post-training loss of Onca
(``onca::chunked_logprob_forward`` / ``onca::chunked_logprob_backward``, in
``onca/ops/_chunked_head.py``): the forward runs token chunks of the whole vocabulary (one head
matmul into a reused scratch, then one statistics kernel; one fp32 ``lse`` and entropy per token
kept), the backward recomputes the logits in tiles of up to 4096 tokens by a share of the
vocabulary (the same scratch), writes their gradient over them with one kernel and runs the
gradient matmuls (``dweight``/``dbias`` accumulated in fp32, ``dhidden`` in fp32 over the
vocabulary's tiles). An output
whose gradient is None (the entropy, when only logged) costs nothing in backward. With
``keep_logits=True`` the forward keeps its logits (``tokens x vocab`` elements in the input dtype,
written by chunks of up to 4096 tokens) and the backward reads them instead of recomputing them: three head
matmuls instead of four.

``onca.integrations.trl.enable()`` makes TRL's trainers (SFT, DPO, GRPO, KTO, RLOO: every one that
calls ``add_fused_lm_head``) compute their per-token log-probabilities here.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from onca.device import DeviceProfile, accelerator
from onca.ops._chunked_head import (
    WIDE_TILES,
    check_options,
    chunk_plan,
    chunked_logprob_forward,
    grad_tiles,
    head_inputs,
    small_head,
    torch_logprobs,
    validate_head,
)
from onca.ops._rows import as_rows
from onca.ops._validate import check_accum_dtype, check_bool, check_number, check_tensor
from onca.tiling import ChunkPlan, RowPlan, plan_rows

__all__ = ["OPTIONAL_OUTPUTS", "LogProbOutput", "fused_linear_logprobs", "plan"]

# The per-token outputs besides the log-probabilities (TRL's names), each computed only when asked.
OPTIONAL_OUTPUTS = ("entropy", "log_sum_sq_probs", "mean_logits", "is_top1")


class LogProbOutput(NamedTuple):
    """:func:`fused_linear_logprobs`'s result; every field shaped like ``labels``, None unless
    asked for (``log_probs`` always is)."""

    log_probs: Tensor
    entropy: Tensor | None = None
    log_sum_sq_probs: Tensor | None = None
    mean_logits: Tensor | None = None
    is_top1: Tensor | None = None


def plan(shape, dtype: torch.dtype, profile: DeviceProfile | None = None) -> dict[str, ChunkPlan | RowPlan]:
    """Plans for ``shape = (tokens, hidden, vocab)`` with every optional output: the token chunks
    (from this machine's free accelerator memory) and both kernels' tiling of one chunk."""
    shape = tuple(int(s) for s in shape)
    if len(shape) != 3:
        raise ValueError(f"fused_linear_logprobs plans take shape (tokens, hidden, vocab), got {shape}")
    tokens, hidden, vocab = shape
    forward = chunk_plan(tokens, hidden, vocab, dtype, device=accelerator())
    backward, width = grad_tiles(tokens, hidden, vocab, dtype, device=accelerator())
    return {"chunks": forward, "backward_chunks": backward,
            "logprob": plan_rows(forward.chunk, vocab, dtype, profile=profile, **WIDE_TILES),
            "logprob_grad": plan_rows(backward.chunk, width, dtype, profile=profile, **WIDE_TILES)}


def _check_outputs(outputs) -> tuple[str, ...]:
    if isinstance(outputs, str) or not isinstance(outputs, (tuple, list, set, frozenset)):
        raise TypeError(f"outputs must be a tuple of names among {OPTIONAL_OUTPUTS}, got {outputs!r}")
    unknown = [o for o in outputs if o not in OPTIONAL_OUTPUTS and o != "log_probs"]
    if unknown:
        raise ValueError(f"outputs must name only {('log_probs',) + OPTIONAL_OUTPUTS}, got {unknown}")
    return tuple(outputs)


def fused_linear_logprobs(hidden: Tensor, weight: Tensor, labels: Tensor, bias: Tensor | None = None, *,
                          temperature: float = 1.0, softcap: float | None = None, logit_scale: float = 1.0,
                          outputs=("entropy",), ignore_index: int = -100,
                          chunk_tokens: int | None = None,
                          accum_dtype: torch.dtype | None = torch.float32,
                          keep_logits: bool = False) -> LogProbOutput:
    """Per-token log-probabilities of ``labels`` under the head ``hidden @ weight.T + bias``, and the
    optional statistics named in ``outputs``, without materialising the logits.

    Args:
        hidden: ``(..., H)`` float (fp32, bf16, fp16), the positions already aligned with ``labels``
            (position ``t`` is scored against ``labels[t]``: shift first).
        weight: ``(V, H)``, ``hidden``'s dtype and device. bias: ``(V,)`` or None.
        labels: ``(...)`` integer, ``hidden``'s shape without ``H``; ``ignore_index`` marks positions
            that are not scored (every output 0 / False there, no gradient).
        temperature: ``> 0``, divides the logits. softcap: None, or ``> 0``: ``softcap *
            tanh(logits / softcap)`` (after ``logit_scale``, before the temperature).
        logit_scale: multiplies the head's output first (Cohere's ``logit_scale``, Granite's
            ``1 / logits_scaling``).
        outputs: any of ``"entropy"``, ``"log_sum_sq_probs"``, ``"mean_logits"``, ``"is_top1"``
            (``"log_probs"`` is accepted and always computed).
        chunk_tokens: tokens per chunk (default: planned from the free device memory).
        accum_dtype: the weight gradient's accumulator over the chunks: fp32 by default, as TRL's
            kernel; None (the weight's dtype, one rounding per chunk) saves a head-sized fp32
            buffer and its cast at the backward's peak.
        keep_logits: keep the whole ``(tokens, vocab)`` logits in the input dtype from the forward
            to the backward (``tokens * vocab * itemsize`` bytes: 4.2 GB for 16384 tokens of a
            bf16 Llama-3 head) so that the backward reads them instead of recomputing them: three
            head matmuls instead of four, the same result to rounding.

    Returns:
        :class:`LogProbOutput` ``(log_probs, entropy, log_sum_sq_probs, mean_logits, is_top1)``:
        fp32 tensors shaped like ``labels`` (``is_top1`` bool), None for the statistics not asked
        for. ``log_probs`` is NaN where a label is outside ``[0, V)`` (a small call on CUDA, torch's
        ops, stops with torch's device-side assertion instead: :mod:`onca.ops._small_calls`).
        ``log_probs`` and ``entropy`` take gradients.

    Under ``torch.autocast`` the floating inputs are cast to the autocast dtype first, as
    ``F.linear`` would. See the module docstring for the formulas and the cost.
    """
    check_tensor(hidden, "hidden")
    outputs = _check_outputs(outputs)
    check_bool(keep_logits, "keep_logits")
    check_options(ignore_index, temperature, chunk_tokens)
    check_number(logit_scale, "logit_scale")
    if not abs(logit_scale) < float("inf"):
        raise ValueError(f"logit_scale must be finite, got {logit_scale!r}")
    if softcap is not None:
        check_number(softcap, "softcap")
        if not 0.0 < softcap < float("inf"):
            raise ValueError(f"softcap must be None or a finite number > 0, got {softcap!r}")
    (hidden, weight, bias), cast = head_inputs(hidden, weight, bias)
    validate_head(hidden, weight, labels, bias)
    args = (hidden, weight, labels, bias, ignore_index, float(temperature), float(softcap or 0.0),
            float(logit_scale), outputs, chunk_tokens, check_accum_dtype(accum_dtype, weight.dtype),
            keep_logits)
    if small_head(hidden, weight, labels):
        return LogProbOutput(*torch_logprobs(hidden, weight, bias, labels, ignore_index, float(temperature),
                                             float(softcap or 0.0), float(logit_scale),
                                             *(name in outputs for name in OPTIONAL_OUTPUTS)))
    if cast:
        with torch.autocast(hidden.device.type, enabled=False):
            return _fused_linear_logprobs(*args)
    return _fused_linear_logprobs(*args)


def _fused_linear_logprobs(hidden, weight, labels, bias, ignore_index, temperature, softcap, logit_scale, outputs,
                           chunk_tokens, accum_fp32, keep_logits) -> LogProbOutput:
    wanted = [name in outputs for name in OPTIONAL_OUTPUTS]
    results = chunked_logprob_forward(
        as_rows(hidden), weight.contiguous(), bias.contiguous() if bias is not None else None,
        labels.reshape(-1).contiguous(), ignore_index, temperature, softcap, logit_scale, *wanted,
        chunk_tokens or 0, accum_fp32, keep_logits)
    logp, _lse, *extras, _kept = results
    shape = labels.shape
    return LogProbOutput(logp.view(shape), *(t.view(shape) if want else None for t, want in zip(extras, wanted)))
