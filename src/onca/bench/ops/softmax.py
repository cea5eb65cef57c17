"""Softmax benchmark: ``softmax(x, dim=-1)`` over ``(tokens, cols)``.

liger-kernel benchmarks its softmax over hidden-size rows; the D2 sweep here takes a model's
vocabulary instead (the softmax of a step's logits, where a model actually has one this wide), and
the D1 sweeps cover both narrow and wide rows.
"""

from __future__ import annotations

import torch

from onca.bench.spec import OpBenchmark, d1, d2, itemsize

TOKENS = 4096
COLS = 4096


def make_inputs(p, dtype, device):
    x = torch.randn(p["tokens"], p["cols"], dtype=dtype, device=device) * 4
    return {"x": x.requires_grad_(True)}


def onca(p, inputs):
    from onca.ops.softmax import softmax

    return lambda: softmax(inputs["x"])


def reference(p, inputs):
    return lambda: torch.softmax(inputs["x"], dim=-1)


def liger(p, inputs):
    from liger_kernel.ops.softmax import LigerSoftmaxFunction

    return lambda: LigerSoftmaxFunction.apply(inputs["x"])


def bytes_moved(p, dtype, mode):
    n = p["tokens"] * p["cols"] * itemsize(dtype)
    forward = 2 * n  # read x, write y
    backward = 3 * n  # read dy and y, write dx
    return {"forward": forward, "backward": backward, "full": forward + backward}[mode]


# Peak (tokens x cols) tensors of the input dtype alive, the input included: every provider keeps
# y for the backward pass, which reads dy and writes dx.
_TENSORS = {
    "onca": {"forward": 2, "backward": 4, "full": 4},
    "liger": {"forward": 2, "backward": 4, "full": 4},
    "torch": {"forward": 2, "backward": 4, "full": 4},
    "torch_compile": {"forward": 2, "backward": 4, "full": 4},
}


def memory_estimate(p, dtype, provider, mode):
    return _TENSORS[provider][mode] * p["tokens"] * p["cols"] * itemsize(dtype)


BENCHMARK = OpBenchmark(
    name="softmax",
    make_inputs=make_inputs,
    onca=onca,
    reference=reference,
    liger=liger,
    sweeps=(
        d1("tokens", [1024, 4096, 16384, 65536], {"cols": COLS}, f"rows (width {COLS})"),
        d1("cols", [1024, 4096, 16384, 65536, 151936, 262144], {"tokens": TOKENS},
           f"row width ({TOKENS} rows)"),
        d2(lambda m: {"tokens": TOKENS, "cols": m.vocab_size}),
    ),
    bytes_moved=bytes_moved,
    memory_estimate=memory_estimate,
    probe={"tokens": 256, "cols": 1024},
    config="dim=-1; D2: softmax over the model's vocabulary",
)
