"""GroupNorm benchmark: ``torch.nn.GroupNorm`` (32 groups, weight and bias) over (batch, channels,
positions), at the widths of a diffusion UNet's blocks."""

from __future__ import annotations

import torch

from onca.bench.spec import OpBenchmark, d1, d2, itemsize

EPS = 1e-5
GROUPS = 32
POSITIONS = 4096  # a 64 x 64 feature map


def make_inputs(p, dtype, device):
    x = torch.randn(p["batch"], p["channels"], p["positions"], dtype=dtype, device=device, requires_grad=True)
    w = (torch.rand(p["channels"], dtype=torch.float32, device=device) + 0.5).to(dtype).requires_grad_(True)
    b = (torch.randn(p["channels"], dtype=torch.float32, device=device) * 0.1).to(dtype).requires_grad_(True)
    return {"x": x, "w": w, "b": b}


def onca(p, inputs):
    from onca.ops.group_norm import group_norm

    return lambda: group_norm(inputs["x"], GROUPS, inputs["w"], inputs["b"], EPS)


def reference(p, inputs):
    return lambda: torch.nn.functional.group_norm(inputs["x"], GROUPS, inputs["w"], inputs["b"], EPS)


def liger(p, inputs):
    from liger_kernel.ops.group_norm import LigerGroupNormFunction

    return lambda: LigerGroupNormFunction.apply(inputs["x"], inputs["w"], inputs["b"], p["channels"], GROUPS, EPS)


def bytes_moved(p, dtype, mode):
    n, c, b = p["batch"] * p["channels"] * p["positions"], p["channels"], itemsize(dtype)
    stats = 8 * p["batch"] * GROUPS
    forward = 2 * n * b + 2 * c * b + stats  # read x, w, b; write y, mean, rstd
    backward = 3 * n * b + 3 * c * b + stats  # read x, dy, w, mean, rstd; write dx, dw, db
    return {"forward": forward, "backward": backward, "full": forward + backward}[mode]


_PER_ELEMENT = {
    "onca": {"forward": 1, "backward": 2, "full": 3},
    "liger": {"forward": 1, "backward": 2, "full": 3},
    "torch": {"forward": 1, "backward": 2, "full": 3},
    "torch_compile": {"forward": 1, "backward": 2, "full": 3},
}


def memory_estimate(p, dtype, provider, mode):
    n = p["batch"] * p["channels"] * p["positions"]
    # The per-(sample, channel) fp32 sums of dW and dB.
    return n * itemsize(dtype) * (1 + _PER_ELEMENT[provider][mode]) + 8 * p["batch"] * p["channels"] + (1 << 16)


BENCHMARK = OpBenchmark(
    name="group_norm",
    make_inputs=make_inputs,
    onca=onca,
    reference=reference,
    liger=liger,
    sweeps=(
        d1("channels", [128, 256, 320, 512, 640, 1024, 1280], {"batch": 8, "positions": POSITIONS},
           "channels (batch 8, 64 x 64 positions)"),
        d1("positions", [256, 1024, 4096, 16384], {"batch": 8, "channels": 512}, "positions (batch 8, 512 channels)"),
        # GroupNorm is not in the registry's language models: their hidden size as channels.
        d2(lambda m: {"batch": 4, "channels": m.hidden_size, "positions": 1024}),
    ),
    bytes_moved=bytes_moved,
    memory_estimate=memory_estimate,
    probe={"batch": 2, "channels": 64, "positions": 256},
    config="32 groups, weight and bias, eps=1e-5",
)
