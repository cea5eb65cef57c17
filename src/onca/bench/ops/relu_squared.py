"""Squared ReLU benchmark: ``relu(x) ** 2`` over ``(tokens, intermediate)``.

The activation of a ReLU**2 MLP (Nemotron, Primer): it runs on the up projection's output, so
the D2 sweep takes each model's intermediate size (as if its MLP used ``relu2``). liger-kernel's
own benchmark uses the hidden size.
"""

from __future__ import annotations

import torch

from onca.bench.spec import OpBenchmark, d1, d2, itemsize

TOKENS = 16384
INTERMEDIATE = 14336


def make_inputs(p, dtype, device):
    x = torch.randn(p["tokens"], p["intermediate"], dtype=dtype, device=device, requires_grad=True)
    return {"x": x}


def onca(p, inputs):
    from onca.ops.relu_squared import relu_squared

    return lambda: relu_squared(inputs["x"])


def reference(p, inputs):
    def relu2(x):  # transformers' ReLUSquaredActivation
        return torch.square(torch.nn.functional.relu(x))

    return lambda: relu2(inputs["x"])


def liger(p, inputs):
    from liger_kernel.ops.relu_squared import LigerReLUSquaredFunction

    return lambda: LigerReLUSquaredFunction.apply(inputs["x"])


def bytes_moved(p, dtype, mode):
    n = p["tokens"] * p["intermediate"] * itemsize(dtype)
    forward = 2 * n  # read x, write y
    backward = 3 * n  # read x and dy, write dx
    return {"forward": forward, "backward": backward, "full": forward + backward}[mode]


# Peak (tokens x intermediate) tensors alive, the input included.
_TENSORS = {
    # y; x is saved; the backward reads dy and writes dx.
    "onca": {"forward": 2, "backward": 4, "full": 4},
    "liger": {"forward": 2, "backward": 4, "full": 4},
    # relu(x) is saved for the square's backward; the backward also makes 2 * relu(x), its
    # product with dy, and relu's gradient.
    "torch": {"forward": 3, "backward": 7, "full": 7},
    "torch_compile": {"forward": 2, "backward": 4, "full": 4},
}


def memory_estimate(p, dtype, provider, mode):
    return _TENSORS[provider][mode] * p["tokens"] * p["intermediate"] * itemsize(dtype)


BENCHMARK = OpBenchmark(
    name="relu_squared",
    make_inputs=make_inputs,
    onca=onca,
    reference=reference,
    liger=liger,
    sweeps=(
        d1("tokens", [2048, 8192, 16384, 32768], {"intermediate": INTERMEDIATE},
           f"tokens (intermediate {INTERMEDIATE})"),
        d2(lambda m: {"tokens": TOKENS, "intermediate": m.intermediate_size}),
    ),
    bytes_moved=bytes_moved,
    memory_estimate=memory_estimate,
    probe={"tokens": 256, "intermediate": 1024},
    config="y = relu(x)**2 (transformers' relu2); D2: each model's intermediate size",
)
