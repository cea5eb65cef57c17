"""KL divergence benchmark: ``kl_div(log q, p, reduction="batchmean")`` over (tokens, vocab)."""

from __future__ import annotations

import torch

from onca.bench.spec import OpBenchmark, d1, d2, itemsize

TOKENS = 8192
VOCAB = 128256
REDUCTION = "batchmean"
LOG_TARGET = False


def make_inputs(p, dtype, device):
    shape = (p["tokens"], p["vocab"])
    # Softmaxes in the input dtype (computed in fp32 internally): no fp32 copy of the whole matrix.
    x = torch.log_softmax(torch.randn(shape, dtype=dtype, device=device), dim=-1).requires_grad_(True)
    t = torch.softmax(torch.randn(shape, dtype=dtype, device=device), dim=-1)
    return {"input": x, "target": t}


def onca(p, inputs):
    from onca.ops.kl_div import kl_div

    return lambda: kl_div(inputs["input"], inputs["target"], REDUCTION, LOG_TARGET)


def reference(p, inputs):
    import torch.nn.functional as F

    return lambda: F.kl_div(inputs["input"], inputs["target"], reduction=REDUCTION, log_target=LOG_TARGET)


def liger(p, inputs):
    from liger_kernel.ops.kl_div import LigerKLDivLossFunction

    x, t = inputs["input"], inputs["target"]
    return lambda: LigerKLDivLossFunction.apply(x, t, REDUCTION, LOG_TARGET, 1e-10)


def bytes_moved(p, dtype, mode):
    n = p["tokens"] * p["vocab"] * itemsize(dtype)
    # forward: read input and target; backward: read target, write dinput; full: each once.
    return {"forward": 2 * n, "backward": 2 * n, "full": 3 * n}[mode]


# Peak bytes beyond the two inputs, in (tokens x vocab) matrices of the input dtype.
_EXTRA = {
    # dinput is written by the forward kernel (the input requires a gradient); backward scales it.
    "onca": {"forward": 1, "backward": 2, "full": 2},
    # forward keeps nothing large; backward writes the gradient (and a scaled copy if not 1).
    "liger": {"forward": 0, "backward": 2, "full": 2},
    # eager: xlogy(t, t), t * input and their difference; backward: the gradient and its temporaries.
    "torch": {"forward": 3, "backward": 3, "full": 4},
    "torch_compile": {"forward": 1, "backward": 2, "full": 2},
}


def memory_estimate(p, dtype, provider, mode):
    n = p["tokens"] * p["vocab"] * itemsize(dtype)
    return n * (2 + _EXTRA[provider][mode]) + 8 * p["tokens"]


BENCHMARK = OpBenchmark(
    name="kl_div",
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
    config=f"reduction={REDUCTION}, log_target={LOG_TARGET}, target = probabilities",
)
