"""DyT benchmark: dynamic tanh (scalar alpha, weight and bias) over (tokens, hidden)."""

from __future__ import annotations

import torch

from onca.bench.spec import OpBenchmark, d1, d2, itemsize

TOKENS = 16384


def make_inputs(p, dtype, device):
    x = torch.randn(p["tokens"], p["hidden"], dtype=dtype, device=device, requires_grad=True)
    alpha = torch.full((1,), 0.5, dtype=dtype, device=device, requires_grad=True)
    w = (torch.rand(p["hidden"], dtype=torch.float32, device=device) + 0.5).to(dtype).requires_grad_(True)
    b = (torch.randn(p["hidden"], dtype=torch.float32, device=device) * 0.1).to(dtype).requires_grad_(True)
    return {"x": x, "alpha": alpha, "w": w, "b": b}


def onca(p, inputs):
    from onca.ops.dyt import dyt

    return lambda: dyt(inputs["x"], inputs["alpha"], inputs["w"], inputs["b"])


def reference(p, inputs):
    def dynamic_tanh(x, alpha, w, b):  # the DyT paper's DynamicTanh.forward (channels last)
        return torch.tanh(alpha * x) * w + b

    return lambda: dynamic_tanh(inputs["x"], inputs["alpha"], inputs["w"], inputs["b"])


def liger(p, inputs):
    from liger_kernel.ops.dyt import LigerDyTFunction

    return lambda: LigerDyTFunction.apply(inputs["x"], inputs["alpha"], inputs["w"], inputs["b"])


def bytes_moved(p, dtype, mode):
    t, h, b = p["tokens"], p["hidden"], itemsize(dtype)
    forward = 2 * t * h * b + 2 * h * b  # read x, w, b; write y
    backward = 3 * t * h * b + 3 * h * b  # read x, dy, w; write dx, dalpha, dw, db
    return {"forward": forward, "backward": backward, "full": forward + backward}[mode]


# Peak bytes per element of x, beyond x itself (dy counted for backward modes).
_PER_ELEMENT = {
    "onca": {"forward": 1, "backward": 2, "full": 3},
    "liger": {"forward": 1, "backward": 2, "full": 3},
    # eager: alpha * x, its tanh (saved), the product, y.
    "torch": {"forward": 4, "backward": 7, "full": 7},
    "torch_compile": {"forward": 1, "backward": 3, "full": 3},
}


def memory_estimate(p, dtype, provider, mode):
    t, h, b = p["tokens"], p["hidden"], itemsize(dtype)
    # The partial-sum buffers: three fp32 rows per program (at most a few hundred programs).
    return t * h * b * (1 + _PER_ELEMENT[provider][mode]) + 3 * 264 * h * 4


BENCHMARK = OpBenchmark(
    name="dyt",
    make_inputs=make_inputs,
    onca=onca,
    reference=reference,
    liger=liger,
    sweeps=(
        d1("tokens", [1024, 2048, 4096, 8192, 16384, 32768, 65536], {"hidden": 4096}, "tokens (hidden 4096)"),
        d1("hidden", [1024, 2048, 4096, 8192, 16384, 32768], {"tokens": TOKENS}, "hidden size (16384 tokens)"),
        d2(lambda m: {"tokens": TOKENS, "hidden": m.hidden_size}),
    ),
    bytes_moved=bytes_moved,
    memory_estimate=memory_estimate,
    probe={"tokens": 256, "hidden": 1024},
    config="scalar alpha (0.5), weight and bias",
)
