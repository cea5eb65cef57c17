"""PolyNorm benchmark: PolyCom's activation over (tokens, width), at MLP intermediate widths."""

from __future__ import annotations

import torch

from onca.bench.spec import OpBenchmark, d1, d2, itemsize

EPS = 1e-6
TOKENS = 8192


def make_inputs(p, dtype, device):
    x = torch.randn(p["tokens"], p["hidden"], dtype=dtype, device=device, requires_grad=True)
    w = torch.tensor([0.2, 0.3, 0.5], dtype=dtype, device=device, requires_grad=True)
    b = torch.tensor([0.1], dtype=dtype, device=device, requires_grad=True)
    return {"x": x, "w": w, "b": b}


def onca(p, inputs):
    from onca.ops.poly_norm import poly_norm

    # dx written over the incoming gradient, as liger-kernel's default (in_place) does.
    return lambda: poly_norm(inputs["x"], inputs["w"], inputs["b"], EPS, overwrite_grad_output=True)


def reference(p, inputs):
    def polycom_poly_norm(x, w, b):  # PolyCom's PolyNorm.forward
        def norm(u):
            return u * torch.rsqrt(u.pow(2).mean(-1, keepdim=True) + EPS)

        return w[0] * norm(x**3) + w[1] * norm(x**2) + w[2] * norm(x) + b

    return lambda: polycom_poly_norm(inputs["x"], inputs["w"], inputs["b"])


def liger(p, inputs):
    from liger_kernel.ops.poly_norm import LigerPolyNormFunction

    return lambda: LigerPolyNormFunction.apply(inputs["x"], inputs["w"], inputs["b"], EPS, True)


def bytes_moved(p, dtype, mode):
    t, h, b = p["tokens"], p["hidden"], itemsize(dtype)
    forward = 2 * t * h * b + 12 * t  # read x, write y and three rstd per row
    backward = 3 * t * h * b + 12 * t  # read x, dy, rstd; write dx
    return {"forward": forward, "backward": backward, "full": forward + backward}[mode]


# Peak bytes per element of x, beyond x itself (dy counted for backward modes).
_PER_ELEMENT = {
    "onca": {"forward": 1, "backward": 2, "full": 2},
    "liger": {"forward": 1, "backward": 2, "full": 2},
    # eager: the three powers, their squares and norms, the weighted terms (saved for backward).
    "torch": {"forward": 14, "backward": 20, "full": 20},
    "torch_compile": {"forward": 2, "backward": 4, "full": 4},
}


def memory_estimate(p, dtype, provider, mode):
    t, h, b = p["tokens"], p["hidden"], itemsize(dtype)
    return t * h * b * (1 + _PER_ELEMENT[provider][mode]) + 64 * t + (1 << 16)


BENCHMARK = OpBenchmark(
    name="poly_norm",
    make_inputs=make_inputs,
    onca=onca,
    reference=reference,
    liger=liger,
    sweeps=(
        d1("tokens", [1024, 2048, 4096, 8192, 16384, 32768], {"hidden": 8192}, "tokens (width 8192)"),
        d1("hidden", [1024, 2048, 4096, 8192, 16384, 32768], {"tokens": TOKENS}, "width (8192 tokens)"),
        # PolyNorm replaces the MLP's activation: its width is the intermediate size.
        d2(lambda m: {"tokens": TOKENS, "hidden": m.intermediate_size}),
    ),
    bytes_moved=bytes_moved,
    memory_estimate=memory_estimate,
    probe={"tokens": 256, "hidden": 1024},
    config="eps=1e-6, in_place backward for onca and liger",
)
