"""Fused linear scaled cross entropy benchmark: an RL trainer's per-token NLL and entropy of an LM
head's logits at a temperature, ``hidden (T, H) -> (nll (T,), entropy (T,))``.

Reference: the unfused computation (verl's / liger-kernel's fallback formulas): logits
``(h @ W.T) / temperature`` in the input dtype, upcast, log-softmax, the target's NLL and the
entropy, timed eager as ``torch`` and compiled as ``torch_compile``. liger-kernel:
``LigerFusedLinearScaledCrossEntropyFunction`` (a CuTe DSL kernel on sm_90, its chunked torch
fallback elsewhere). Matmul-bound: ``flops`` counts the head's matmuls each provider must do at
least (forward 1, backward 2); Onca's backward recomputes the logits (one more) unless the ``logits``
sweep's point keeps them (``keep_logits=True``).
"""

from __future__ import annotations

import torch

from onca.bench.ops._gemm_limit import head_gemm_bytes, head_gemm_limit
from onca.bench.spec import OpBenchmark, d1, d2, itemsize

TOKENS = 8192
HIDDEN = 4096
VOCAB = 128256
TEMPERATURE = 0.7
# Onca's two backward modes: the logits recomputed (the default) or kept from the forward
# (keep_logits=True: three head matmuls, tokens x vocab more memory). The other providers ignore it.
LOGITS = ("recomputed", "kept")


def make_inputs(p, dtype, device):
    t, h, v = p["tokens"], p["hidden"], p["vocab"]
    hidden = torch.randn(t, h, dtype=torch.float32, device=device).to(dtype).requires_grad_(True)
    weight = (torch.randn(v, h, dtype=torch.float32, device=device) * h ** -0.5).to(dtype).requires_grad_(True)
    target = torch.randint(0, v, (t,), device=device)
    target[: t // 8] = -100  # a prompt
    return {"hidden": hidden, "weight": weight, "target": target}


def onca(p, inputs):
    from onca.ops.fused_linear_scaled_cross_entropy import fused_linear_scaled_cross_entropy

    keep = p.get("logits") == "kept"
    return lambda: fused_linear_scaled_cross_entropy(inputs["hidden"], inputs["weight"], inputs["target"],
                                                     TEMPERATURE, return_entropy=True, keep_logits=keep)


def reference(p, inputs):
    def unfused(hidden, weight, target):
        logits = ((hidden @ weight.T) / TEMPERATURE).float()
        logsm = torch.log_softmax(logits, -1)
        valid = target != -100
        nll = -logsm.gather(-1, target.clamp(min=0)[:, None])[:, 0]
        entropy = -(logsm.exp() * logsm).sum(-1)
        return torch.where(valid, nll, 0.0), torch.where(valid, entropy, 0.0).to(hidden.dtype)

    return lambda: unfused(inputs["hidden"], inputs["weight"], inputs["target"])


def liger(p, inputs):
    from liger_kernel.ops.fused_linear_scaled_cross_entropy import LigerFusedLinearScaledCrossEntropyFunction

    # (input, weight, target, temperature, ignore_index, m_tiles_per_cluster, return_entropy)
    return lambda: LigerFusedLinearScaledCrossEntropyFunction.apply(
        inputs["hidden"], inputs["weight"], inputs["target"], TEMPERATURE, -100, 1, True)


def flops(p, mode):
    one = 2.0 * p["tokens"] * p["hidden"] * p["vocab"]
    return {"forward": one, "backward": 2 * one, "full": 3 * one}[mode]


def memory_estimate(p, dtype, provider, mode):
    t, h, v, b = p["tokens"], p["hidden"], p["vocab"], itemsize(dtype)
    inputs = (t * h + v * h) * b + 8 * t
    grads = 0 if mode == "forward" else (t * h + v * h) * b
    if provider == "onca":
        from onca.ops._chunked_head import FORWARD_CHUNK_TOKENS

        # one chunk of logits; the fp32 dW accumulator for bf16/fp16 heads
        accumulator = 0 if mode == "forward" or b == 4 else v * h * 4
        kept = t * v * b if p.get("logits") == "kept" else 0
        extra = min(t, 2 * FORWARD_CHUNK_TOKENS) * v * b + kept + accumulator + 16 * t
    elif provider == "liger":
        # its fallback: 512-token chunks of fp32 logits, probabilities and log-probabilities
        extra = min(t, 512) * v * 16 + 16 * t
    elif provider == "gemm_limit":
        extra = head_gemm_bytes(t, v, b)
    elif provider == "torch":
        # logits, their scaled copy and fp32 upcast, log-softmax and its exponential; backward: fp32
        # gradients of those and the logits' gradient in the input dtype
        extra = t * v * (2 * b + 12) if mode == "forward" else t * v * (3 * b + 24)
    else:  # torch_compile: the logits, one fp32 intermediate and their gradient
        extra = t * v * (b + 4) if mode == "forward" else t * v * (2 * b + 8)
    return inputs + grads + extra + (1 << 20)


BENCHMARK = OpBenchmark(
    name="fused_linear_scaled_cross_entropy",
    make_inputs=make_inputs,
    onca=onca,
    reference=reference,
    liger=liger,
    peers={"gemm_limit": head_gemm_limit(("hidden", "weight"))},  # the head's three matmuls alone
    sweeps=(
        d1("tokens", [2048, 4096, 8192, 16384], {"hidden": HIDDEN, "vocab": VOCAB},
           "tokens (hidden 4096, vocab 128256)"),
        d1("vocab", [32000, 128256, 151936, 262144], {"tokens": TOKENS, "hidden": HIDDEN},
           "vocabulary (8192 tokens, hidden 4096)"),
        d2(lambda m: {"tokens": TOKENS, "hidden": m.hidden_size, "vocab": m.vocab_size}),
        d1("logits", list(LOGITS), {"tokens": TOKENS, "hidden": HIDDEN, "vocab": VOCAB},
           f"Onca's logits {' or '.join(LOGITS)} "
           f"(keep_logits; {TOKENS} tokens, hidden {HIDDEN}, vocab {VOCAB})"),
    ),
    flops=flops,
    memory_estimate=memory_estimate,
    probe={"tokens": 256, "hidden": 256, "vocab": 4096},
    config=f"temperature {TEMPERATURE}, return_entropy, 1/8 of the targets ignored, no bias",
)
