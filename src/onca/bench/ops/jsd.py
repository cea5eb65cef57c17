"""Generalised JSD benchmark: student and teacher log-probabilities over (tokens, vocab), beta 0.5,
no labels, temperature 1 (liger-kernel's ``LigerJSD`` setting)."""

from __future__ import annotations

import math

import torch

from onca.bench.spec import OpBenchmark, d1, d2, itemsize

TOKENS = 8192
VOCAB = 128256
BETA = 0.5


def make_inputs(p, dtype, device):
    shape = (p["tokens"], p["vocab"])
    student = torch.log_softmax(torch.randn(shape, dtype=dtype, device=device), dim=-1).requires_grad_(True)
    teacher = torch.log_softmax(torch.randn(shape, dtype=dtype, device=device), dim=-1)
    return {"student": student, "teacher": teacher}


def onca(p, inputs):
    from onca.ops.jsd import jsd

    return lambda: jsd(inputs["student"], inputs["teacher"], None, BETA)


def torch_jsd(log_q, log_p, beta=BETA):
    """The plain PyTorch generalised JSD (as in liger-kernel's and TRL's references), batchmean over
    tokens, computed in fp32."""
    dtype = log_q.dtype
    log_q, log_p = log_q.float(), log_p.float()
    if beta == 0.0:
        per_token = torch.nn.functional.kl_div(log_q, log_p, reduction="none", log_target=True)
    elif beta == 1.0:
        per_token = torch.nn.functional.kl_div(log_p, log_q, reduction="none", log_target=True)
    else:
        kl = torch.nn.functional.kl_div
        log_mix = torch.logsumexp(torch.stack([log_p + math.log(beta), log_q + math.log(1 - beta)]), dim=0)
        per_token = (beta * kl(log_mix, log_p, reduction="none", log_target=True)
                     + (1 - beta) * kl(log_mix, log_q, reduction="none", log_target=True))
    return (per_token.sum() / log_q.shape[0]).to(dtype)


def reference(p, inputs):
    return lambda: torch_jsd(inputs["student"], inputs["teacher"])


def liger(p, inputs):
    from liger_kernel.ops.jsd import LigerJSDFunction

    return lambda: LigerJSDFunction.apply(inputs["student"], inputs["teacher"], None, BETA, -100)


def bytes_moved(p, dtype, mode):
    n = p["tokens"] * p["vocab"] * itemsize(dtype)
    # forward: read both; backward (and full): read both, write dinput.
    return {"forward": 2 * n, "backward": 3 * n, "full": 3 * n}[mode]


def memory_estimate(p, dtype, provider, mode):
    elements = p["tokens"] * p["vocab"]
    n = elements * itemsize(dtype)
    inputs = 2 * n
    if provider == "onca":  # dinput written by the forward kernel, scaled by backward into a new one
        extra = {"forward": n, "backward": 2 * n, "full": 2 * n}[mode]
    elif provider == "liger":  # a clone of the input that becomes dX, and a fp32 loss per element
        extra = n + 4 * elements + (n if mode != "forward" else 0)
    elif provider == "torch":  # fp32 upcasts, the stacked pair, the mixture, two KL terms, and grads
        extra = {"forward": 10, "backward": 14, "full": 14}[mode] * 4 * elements
    else:
        extra = {"forward": 2, "backward": 4, "full": 4}[mode] * 4 * elements
    return inputs + extra + 8 * p["tokens"]


BENCHMARK = OpBenchmark(
    name="jsd",
    make_inputs=make_inputs,
    onca=onca,
    reference=reference,
    liger=liger,
    sweeps=(
        d1("tokens", [1024, 4096, 8192, 16384], {"vocab": VOCAB}, f"tokens (vocab {VOCAB})"),
        d1("vocab", [32000, 128256, 151936, 262144], {"tokens": TOKENS},
           f"vocabulary ({TOKENS} tokens)"),
        d2(lambda m: {"tokens": TOKENS, "vocab": m.vocab_size}),
    ),
    bytes_moved=bytes_moved,
    memory_estimate=memory_estimate,
    probe={"tokens": 16, "vocab": 512},
    config=f"beta={BETA}, no labels, temperature=1, inputs are log-probabilities",
)
