"""Total variation distance benchmark: ``tvd(p, q, reduction="batchmean")`` over (tokens, vocab),
liger-kernel's ``LigerTVDLoss`` default, without labels."""

from __future__ import annotations

import torch

from onca.bench.spec import OpBenchmark, d1, d2, itemsize

TOKENS = 8192
VOCAB = 128256
REDUCTION = "batchmean"


def make_inputs(p, dtype, device):
    shape = (p["tokens"], p["vocab"])
    # Softmaxes in the input dtype (computed in fp32 internally): no fp32 copy of the whole matrix.
    x = torch.softmax(torch.randn(shape, dtype=dtype, device=device), dim=-1).requires_grad_(True)
    t = torch.softmax(torch.randn(shape, dtype=dtype, device=device), dim=-1)
    return {"input": x, "target": t}


def onca(p, inputs):
    from onca.ops.tvd import tvd

    return lambda: tvd(inputs["input"], inputs["target"], None, REDUCTION)


def reference(p, inputs):
    def torch_tvd(p, q):  # liger-kernel's test reference, batchmean
        return torch.sum(torch.abs(p - q) / 2.0) / p.shape[0]

    return lambda: torch_tvd(inputs["input"], inputs["target"])


def liger(p, inputs):
    from liger_kernel.ops.tvd import LigerTVDLossFunction

    return lambda: LigerTVDLossFunction.apply(inputs["input"], inputs["target"], None, REDUCTION, -100)


def bytes_moved(p, dtype, mode):
    n = p["tokens"] * p["vocab"] * itemsize(dtype)
    # forward: read p and q (and write dinput, since p requires a gradient); backward: scale dinput.
    return {"forward": 2 * n, "backward": 2 * n, "full": 3 * n}[mode]


# Peak bytes beyond the two inputs, in (tokens x vocab) matrices of the input dtype.
_EXTRA = {
    # dinput is written by the forward kernel; the backward scales it into a new tensor.
    "onca": {"forward": 1, "backward": 2, "full": 2},
    "liger": {"forward": 1, "backward": 2, "full": 2},
    # p - q, its abs, the halved values; backward: sign, its product with the scaled gradient.
    "torch": {"forward": 3, "backward": 3, "full": 4},
    "torch_compile": {"forward": 1, "backward": 2, "full": 2},
}


def memory_estimate(p, dtype, provider, mode):
    n = p["tokens"] * p["vocab"] * itemsize(dtype)
    return n * (2 + _EXTRA[provider][mode]) + 8 * p["tokens"]


BENCHMARK = OpBenchmark(
    name="tvd",
    make_inputs=make_inputs,
    onca=onca,
    reference=reference,
    liger=liger,
    sweeps=(
        d1("tokens", [1024, 4096, 8192, 16384], {"vocab": VOCAB}, f"tokens (vocab {VOCAB})"),
        d1("vocab", [32000, 128256, 151936, 262144], {"tokens": TOKENS}, f"vocabulary ({TOKENS} tokens)"),
        d2(lambda m: {"tokens": TOKENS, "vocab": m.vocab_size}),
    ),
    bytes_moved=bytes_moved,
    memory_estimate=memory_estimate,
    probe={"tokens": 16, "vocab": 512},
    config=f"reduction={REDUCTION}, no labels, p and q = probabilities, gradient for p",
)
