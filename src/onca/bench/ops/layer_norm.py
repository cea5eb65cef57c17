"""LayerNorm benchmark: ``torch.nn.LayerNorm`` (weight and bias) over (tokens, hidden)."""

from __future__ import annotations

import torch

from onca.bench.spec import OpBenchmark, d1, d2, itemsize

EPS = 1e-5
TOKENS = 16384


def make_inputs(p, dtype, device):
    x = torch.randn(p["tokens"], p["hidden"], dtype=dtype, device=device, requires_grad=True)
    w = (torch.rand(p["hidden"], dtype=torch.float32, device=device) + 0.5).to(dtype).requires_grad_(True)
    b = (torch.randn(p["hidden"], dtype=torch.float32, device=device) * 0.1).to(dtype).requires_grad_(True)
    return {"x": x, "w": w, "b": b}


def onca(p, inputs):
    from onca.ops.layer_norm import layer_norm

    return lambda: layer_norm(inputs["x"], inputs["w"], inputs["b"], EPS)


def reference(p, inputs):
    shape = (p["hidden"],)
    return lambda: torch.nn.functional.layer_norm(inputs["x"], shape, inputs["w"], inputs["b"], EPS)


def liger(p, inputs):
    from liger_kernel.ops.layer_norm import LigerLayerNormFunction

    return lambda: LigerLayerNormFunction.apply(inputs["x"], inputs["w"], inputs["b"], EPS)


def bytes_moved(p, dtype, mode):
    t, h, b = p["tokens"], p["hidden"], itemsize(dtype)
    forward = 2 * t * h * b + 2 * h * b + 8 * t  # read x, w, b; write y, mean and rstd
    backward = 3 * t * h * b + 3 * h * b + 8 * t  # read x, dy, w, mean, rstd; write dx, dw, db
    return {"forward": forward, "backward": backward, "full": forward + backward}[mode]


# Peak bytes per element of x, beyond x itself (dy counted for backward modes), with one element
# of slack for the previous call's output while the next is computed.
_PER_ELEMENT = {
    # y; backward: dy and dx, and one row of fp32 partials per program for dW and dB.
    "onca": {"forward": 2, "backward": 4, "full": 4},
    "liger": {"forward": 2, "backward": 4, "full": 4},
    # aten's layer_norm is one fused kernel each way, saving x, mean and rstd like the others.
    "torch": {"forward": 2, "backward": 4, "full": 4},
    "torch_compile": {"forward": 2, "backward": 4, "full": 4},
}


def memory_estimate(p, dtype, provider, mode):
    t, h, b = p["tokens"], p["hidden"], itemsize(dtype)
    per_element = _PER_ELEMENT[provider][mode]
    # The partial-sum buffers: two fp32 rows per program (at most a few hundred programs).
    return t * h * b * (1 + per_element) + 2 * 264 * h * 4 + 16 * t


BENCHMARK = OpBenchmark(
    name="layer_norm",
    make_inputs=make_inputs,
    onca=onca,
    reference=reference,
    liger=liger,
    sweeps=(
        d1("tokens", [1024, 2048, 4096, 8192, 16384, 32768, 65536], {"hidden": 4096}, "tokens (hidden 4096)"),
        d1("hidden", [1024, 2048, 4096, 8192, 16384, 32768], {"tokens": TOKENS},
           "hidden size (16384 tokens)"),
        d2(lambda m: {"tokens": TOKENS, "hidden": m.hidden_size}),
    ),
    bytes_moved=bytes_moved,
    memory_estimate=memory_estimate,
    probe={"tokens": 256, "hidden": 1024},
    config="weight and bias, eps=1e-5",
)
