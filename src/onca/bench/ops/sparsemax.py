"""Sparsemax benchmark: ``sparsemax(x, dim=-1)`` over ``(tokens, hidden)``, liger-kernel's setup.

The reference is the paper's algorithm in PyTorch (sort, cumulative sum, support size), as in
liger-kernel's benchmark; liger-kernel itself sorts each row with ``torch.sort`` before its
kernel; Onca finds the threshold without sorting (see ``onca.ops.sparsemax``).
"""

from __future__ import annotations

import torch

from onca.bench.spec import OpBenchmark, d1, d2, itemsize

TOKENS = 16384
HIDDEN = 4096


def make_inputs(p, dtype, device):
    x = torch.randn(p["tokens"], p["hidden"], dtype=dtype, device=device, requires_grad=True)
    return {"x": x}


def onca(p, inputs):
    from onca.ops.sparsemax import sparsemax

    return lambda: sparsemax(inputs["x"])


def torch_sparsemax(x: torch.Tensor) -> torch.Tensor:
    """Martins & Astudillo's Algorithm 1 over the last dimension."""
    z, _ = torch.sort(x, dim=-1, descending=True)
    cumulative = torch.cumsum(z, dim=-1)
    r = torch.arange(1, x.shape[-1] + 1, device=x.device, dtype=x.dtype)
    support = 1 + r * z > cumulative
    k = support.sum(dim=-1, keepdim=True).clamp(min=1)
    tau = ((z * support).sum(dim=-1, keepdim=True) - 1) / k
    return torch.clamp(x - tau, min=0)


def reference(p, inputs):
    return lambda: torch_sparsemax(inputs["x"])


def liger(p, inputs):
    from liger_kernel.ops.sparsemax import LigerSparsemaxFunction

    return lambda: LigerSparsemaxFunction.apply(inputs["x"], -1)


def bytes_moved(p, dtype, mode):
    n = p["tokens"] * p["hidden"] * itemsize(dtype)
    forward = 2 * n  # read x, write y
    backward = 3 * n  # read dy and y, write dx
    return {"forward": forward, "backward": backward, "full": forward + backward}[mode]


# Peak (tokens x hidden) tensors of the input dtype alive, the input included (fp32 counts two
# for a 16-bit input).
_TENSORS = {
    # y; the backward reads y and dy, writes dx.
    "onca": {"forward": 2, "backward": 4, "full": 4},
    # an fp32 sorted copy and y; y is saved.
    "liger": {"forward": 4, "backward": 4, "full": 4},
    # sort values and indices (int64: four), cumsum, r * z, the support mask, z * support, x - tau.
    "torch": {"forward": 11, "backward": 13, "full": 13},
    "torch_compile": {"forward": 8, "backward": 10, "full": 10},
}


def memory_estimate(p, dtype, provider, mode):
    return _TENSORS[provider][mode] * p["tokens"] * p["hidden"] * itemsize(dtype)


BENCHMARK = OpBenchmark(
    name="sparsemax",
    make_inputs=make_inputs,
    onca=onca,
    reference=reference,
    liger=liger,
    sweeps=(
        d1("tokens", [2048, 8192, 16384, 32768], {"hidden": HIDDEN}, f"tokens (hidden {HIDDEN})"),
        d1("hidden", [512, 1024, 2048, 4096, 8192, 16384], {"tokens": TOKENS}, f"row width ({TOKENS} rows)"),
        d2(lambda m: {"tokens": TOKENS, "hidden": m.hidden_size}),
    ),
    bytes_moved=bytes_moved,
    memory_estimate=memory_estimate,
    probe={"tokens": 256, "hidden": 1024},
    config="dim=-1, x ~ N(0, 1); D2: each model's hidden size (liger-kernel's setup)",
)
