"""Fused LM head benchmark: per-token log-probabilities (and the statistics TRL's trainers ask for)
from hidden states and the head's weight, without the logits. Providers: onca
(``fused_linear_logprobs``), reference (the logits, an fp32 log-softmax, a gather; timed eager
and compiled) and the peer ``trl`` (TRL 1.16's ``ChunkedLogProbFunction``, what its trainers run,
with the vocabulary tile its ``add_fused_lm_head`` passes).

Inputs in TRL's compact layout: only the scored positions, ``tokens`` of them (every label valid).
``outputs`` names the per-token statistics beside the log-probs, as each trainer requests them:
``sft`` (entropy, top-1: SFTTrainer's ``entropy`` and ``mean_token_accuracy``), ``grpo``
(entropy), ``dpo`` (entropy, mean logits, top-1), ``none``. The log-probs take a gradient; the
statistics are returned detached (the trainers log them), so backward is the log-probs' alone.

The ``trl`` provider imports ``trl.kernels.chunked_logprob`` (the ``trl`` wheel alone, installed
with ``--no-deps``, on top of torch, triton and transformers). Its backward imports
``trl.trainer.utils`` for the ZeRO-3 gather, which needs accelerate and datasets; where those are
missing, the factory registers a stand-in ``trl.trainer.utils`` holding only that gather as a null
context, which is what TRL's own returns without DeepSpeed ZeRO-3.
"""

from __future__ import annotations

import contextlib
import sys
import types

import torch

from onca.bench.ops._gemm_limit import head_gemm_bytes, head_gemm_limit
from onca.bench.spec import OpBenchmark, d1, d2, itemsize

TOKENS = 16384
QWEN3_06B = {"hidden": 1024, "vocab": 151936}
LLAMA3_HEAD = {"hidden": 4096, "vocab": 128256}
# Onca's two backward modes: the logits recomputed (the default) or kept from the forward
# (keep_logits=True: three head matmuls, tokens x vocab more memory). The other providers ignore it.
LOGITS = ("recomputed", "kept")
OUTPUTS = {
    "none": (),
    "sft": ("entropy", "is_top1"),
    "grpo": ("entropy",),
    "dpo": ("entropy", "mean_logits", "is_top1"),
}
# TRL 1.16: trl.trainer.utils._CHUNKED_LOGPROB_CHUNK_SIZE (the vocabulary tile add_fused_lm_head passes),
# and trl.kernels.chunked_logprob.TOKEN_CHUNK_SIZE (its token tile).
TRL_VOCAB_TILE = 32768
TRL_TOKEN_TILE = 4096


def make_inputs(p, dtype, device):
    t, h, v = p["tokens"], p["hidden"], p["vocab"]
    return {
        "hidden": torch.randn(t, h, dtype=dtype, device=device, requires_grad=True),
        "weight": (torch.randn(v, h, dtype=dtype, device=device) * h ** -0.5).requires_grad_(True),
        "labels": torch.randint(0, v, (t,), device=device),
    }


def _wanted(p) -> tuple[str, ...]:
    return OUTPUTS[p.get("outputs", "sft")]


def _detached(log_probs, *stats):
    return (log_probs, *(s.detach() for s in stats if s is not None))


def onca(p, inputs):
    from onca.ops.fused_linear_logprobs import fused_linear_logprobs

    i, wanted, keep = inputs, _wanted(p), p.get("logits") == "kept"
    return lambda: _detached(*fused_linear_logprobs(i["hidden"], i["weight"], i["labels"], outputs=wanted,
                                                    keep_logits=keep))


def reference(p, inputs):
    wanted = _wanted(p)

    def eager(hidden, weight, labels):
        logits = (hidden @ weight.T).float()
        logsm = torch.log_softmax(logits, -1)
        logp = logsm.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
        stats = []
        with torch.no_grad():
            if "entropy" in wanted:
                stats.append(-(logsm.exp() * logsm).sum(-1))
            if "mean_logits" in wanted:
                stats.append(logits.mean(-1))
            if "is_top1" in wanted:
                stats.append(logits.argmax(-1) == labels)
        return (logp, *stats)

    i = inputs
    return lambda: eager(i["hidden"], i["weight"], i["labels"])


def _trl_function():
    """TRL's ``ChunkedLogProbFunction``; its backward's import of ``trl.trainer.utils`` made to work
    without accelerate and datasets (see the module docstring)."""
    from trl.kernels.chunked_logprob import ChunkedLogProbFunction

    try:
        import trl.trainer.utils  # noqa: F401
    except ImportError:
        stand_in = types.ModuleType("trl.trainer.utils")
        stand_in.maybe_gather_lm_head_ctx = lambda *params: contextlib.nullcontext()
        sys.modules["trl.trainer.utils"] = stand_in
    return ChunkedLogProbFunction


def trl(p, inputs):
    function = _trl_function()
    i, wanted = inputs, ("log_probs", *_wanted(p))
    order = ("entropy", "log_sum_sq_probs", "mean_logits", "is_top1")

    def run():
        logp, *stats = function.apply(i["hidden"], i["weight"], None, i["labels"], 1.0, TRL_VOCAB_TILE, None, 1.0,
                                      wanted)
        return _detached(logp, *(s for s, name in zip(stats, order) if name in wanted))

    return run


def flops(p, mode):
    head = 2 * p["tokens"] * p["hidden"] * p["vocab"]
    return {"forward": head, "backward": 2 * head, "full": 3 * head}[mode]


def memory(p, dtype, provider, mode):
    t, h, v = p["tokens"], p["hidden"], p["vocab"]
    b = itemsize(dtype)
    inputs = (t * h + v * h) * b + 8 * t
    grads = (t * h + v * h) * b if mode != "forward" else 0
    stats = 8 * 4 * t
    if provider == "onca":
        forward = min(t, 512) * v * b
        backward = min(t, 1024) * v * b + 4 * v * h
        extra = forward if mode == "forward" else max(forward, backward)
        extra += t * v * b if p.get("logits") == "kept" else 0
    elif provider == "trl":
        tile = min(t, TRL_TOKEN_TILE) * min(v, TRL_VOCAB_TILE) * b
        extra = tile + (0 if mode == "forward" else 4 * (t * h + v * h))
    elif provider == "gemm_limit":
        extra = head_gemm_bytes(t, v, b)
    else:  # the logits in the dtype, an fp32 copy, the log-softmax, and their gradients
        extra = t * v * (b + 2 * 4) * (1 if mode == "forward" else 2)
    return inputs + grads + stats + extra


BENCHMARK = OpBenchmark(
    name="fused_linear_logprobs",
    make_inputs=make_inputs,
    onca=onca,
    reference=reference,
    # TRL's kernel as a peer; the head's three matmuls alone as the limit row.
    peers={"trl": trl, "gemm_limit": head_gemm_limit(("hidden", "weight"))},
    sweeps=(
        d1("tokens", [2048, 4096, 8192, 16384, 32768], {**QWEN3_06B, "outputs": "sft"},
           "scored tokens (Qwen3-0.6B's head, 1024 x 151936; SFT's outputs)"),
        d1("outputs", list(OUTPUTS), {**QWEN3_06B, "tokens": TOKENS},
           f"per-token outputs ({TOKENS} tokens, Qwen3-0.6B's head)"),
        d2(lambda m: {"tokens": TOKENS, "hidden": m.hidden_size, "vocab": m.vocab_size, "outputs": "grpo"}),
        d1("logits", list(LOGITS), {**LLAMA3_HEAD, "tokens": TOKENS, "outputs": "grpo"},
           f"Onca's logits {' or '.join(LOGITS)} "
           f"(keep_logits; {TOKENS} tokens, Llama-3's head, GRPO's outputs)"),
    ),
    flops=flops,
    memory_estimate=memory,
    probe={"tokens": 64, "hidden": 64, "vocab": 512, "outputs": "sft"},
    config="log-probs take the gradient, the statistics are detached; temperature 1, no bias, no soft-capping",
)
