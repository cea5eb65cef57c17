"""Modulated RMSNorm benchmark: ``rms_norm(x) * (1 + scale) + shift`` over (tokens, hidden), one
modulation row per sequence of a batch of 4 (a diffusion transformer's AdaLN)."""

from __future__ import annotations

import torch

from onca.bench.spec import OpBenchmark, d1, d2, itemsize

EPS = 1e-6
TOKENS = 16384
BATCH = 4


def make_inputs(p, dtype, device):
    t, h = p["tokens"], p["hidden"]
    x = torch.randn(BATCH, t // BATCH, h, dtype=dtype, device=device, requires_grad=True)
    w = (torch.rand(h, dtype=torch.float32, device=device) + 0.5).to(dtype).requires_grad_(True)
    scale = (torch.randn(BATCH, 1, h, dtype=torch.float32, device=device) * 0.1).to(dtype).requires_grad_(True)
    shift = (torch.randn(BATCH, 1, h, dtype=torch.float32, device=device) * 0.1).to(dtype).requires_grad_(True)
    return {"x": x, "w": w, "scale": scale, "shift": shift}


def onca(p, inputs):
    from onca.ops.modulated_rms_norm import modulated_rms_norm

    return lambda: modulated_rms_norm(inputs["x"], inputs["w"], inputs["scale"], inputs["shift"], EPS, 0.0,
                                      "llama", overwrite_grad_output=True)


def reference(p, inputs):
    def modulated(x, w, scale, shift):  # a Llama RMSNorm, then the modulation (as VibeVoice's head)
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)
        return (w * h.to(x.dtype)) * (1 + scale) + shift

    return lambda: modulated(inputs["x"], inputs["w"], inputs["scale"], inputs["shift"])


def liger(p, inputs):
    from liger_kernel.ops.modulated_rms_norm import LigerModulatedRMSNormFunction

    return lambda: LigerModulatedRMSNormFunction.apply(inputs["x"], inputs["w"], inputs["scale"], inputs["shift"],
                                                       EPS, 0.0, "llama", True)


def bytes_moved(p, dtype, mode):
    t, h, b = p["tokens"], p["hidden"], itemsize(dtype)
    params = (1 + 2 * BATCH) * h * b
    forward = 2 * t * h * b + params + 4 * t  # read x, w, scale, shift; write y and rstd
    backward = 3 * t * h * b + 2 * params + 4 * t  # read x, dy, w, scale, rstd; write dx, dw, dscale, dshift
    return {"forward": forward, "backward": backward, "full": forward + backward}[mode]


_PER_ELEMENT = {
    "onca": {"forward": 2, "backward": 3, "full": 3},
    "liger": {"forward": 2, "backward": 3, "full": 3},
    # eager: the RMSNorm's fp32 temporaries, then the modulation's products (saved for backward).
    "torch": {"forward": 11, "backward": 16, "full": 16},
    "torch_compile": {"forward": 2, "backward": 5, "full": 5},
}


def memory_estimate(p, dtype, provider, mode):
    t, h, b = p["tokens"], p["hidden"], itemsize(dtype)
    # Partial rows of dW and the modulation slots: a few hundred fp32 rows each.
    return t * h * b * (1 + _PER_ELEMENT[provider][mode]) + 3 * 528 * h * 4 + 8 * t


BENCHMARK = OpBenchmark(
    name="modulated_rms_norm",
    make_inputs=make_inputs,
    onca=onca,
    reference=reference,
    liger=liger,
    sweeps=(
        d1("tokens", [1024, 2048, 4096, 8192, 16384, 32768, 65536], {"hidden": 3072}, "tokens (hidden 3072)"),
        d1("hidden", [1024, 2048, 3072, 4096, 8192, 16384], {"tokens": TOKENS}, "hidden size (16384 tokens)"),
        d2(lambda m: {"tokens": TOKENS, "hidden": m.hidden_size}),
    ),
    bytes_moved=bytes_moved,
    memory_estimate=memory_estimate,
    probe={"tokens": 256, "hidden": 1024},
    config="casting_mode=llama, scale and shift (4, 1, hidden), in_place backward for onca and liger",
)
