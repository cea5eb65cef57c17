"""Tiled SwiGLU MLP benchmark: a long-sequence MLP computed in token shards (memory is the point:
compare peak memory with the untiled MLP's)."""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F

from onca.bench.spec import OpBenchmark, d1, d2, itemsize

BATCH = 1
SEQ = 16384


def make_inputs(p, dtype, device):
    h, i = p["hidden"], p["intermediate"]
    x = torch.randn(p["batch"], p["seq"], h, dtype=dtype, device=device).requires_grad_(True)
    # Parameters, so that liger-kernel's module holds these very tensors: the harness clears their
    # gradients between calls (a module of fresh Parameters sharing their storage kept its own
    # gradients from call to call, allocated before the peak was reset: 3 weights' worth, 352 MB
    # at Llama-3-8B, missing from liger-kernel's peak).
    ws = {name: torch.nn.Parameter(torch.randn(shape, dtype=dtype, device=device) * shape[1] ** -0.5)
          for name, shape in (("gate", (i, h)), ("up", (i, h)), ("down", (h, i)))}
    return {"x": x, **ws}


def onca(p, inputs):
    from onca.functional import tiled_mlp

    return lambda: tiled_mlp(inputs["x"], inputs["gate"], inputs["up"], inputs["down"], "silu")


def reference(p, inputs):
    # The untiled Hugging Face MLP expression.
    return lambda: F.linear(F.silu(F.linear(inputs["x"], inputs["gate"])) * F.linear(inputs["x"], inputs["up"]),
                            inputs["down"])


def liger(p, inputs):
    from liger_kernel.transformers.tiled_mlp import LigerTiledSwiGLUMLP

    config = types.SimpleNamespace(hidden_size=p["hidden"], intermediate_size=p["intermediate"], hidden_act="silu")
    x = inputs["x"]
    mlp = LigerTiledSwiGLUMLP(config).to(device=x.device, dtype=x.dtype)
    mlp.gate_proj.weight, mlp.up_proj.weight = inputs["gate"], inputs["up"]
    mlp.down_proj.weight = inputs["down"]
    return lambda: mlp(x)


class _ElevenGemms(torch.autograd.Function):
    """The matmuls a tiled MLP that recomputes its activations must do, and nothing else: the
    three projections (forward); the gate and up projections again, then the six gradient matmuls
    (backward). A speed limit, not an implementation: untiled, it holds whole-sequence
    activations; the down projection reads the gate projection where the MLP reads its product."""

    @staticmethod
    def forward(ctx, x, gate, up, down):
        rows = x.reshape(-1, x.shape[-1])
        g, _u = rows @ gate.t(), rows @ up.t()
        ctx.save_for_backward(rows, gate, up, down)
        ctx.x_shape = x.shape
        return (g @ down.t()).view(*x.shape[:-1], down.shape[0])

    @staticmethod
    def backward(ctx, dout):
        rows, gate, up, down = ctx.saved_tensors
        dout = dout.reshape(-1, dout.shape[-1])
        g, u = rows @ gate.t(), rows @ up.t()  # recomputed
        dh = dout @ down
        dx = torch.addmm(dh @ gate, u, up)
        return dx.view(ctx.x_shape), dh.t() @ rows, u.t() @ rows, dout.t() @ g


def gemm_limit(p, inputs):
    return lambda: _ElevenGemms.apply(inputs["x"], inputs["gate"], inputs["up"], inputs["down"])


def flops(p, mode):
    t = p["batch"] * p["seq"]
    fwd = 2 * t * p["hidden"] * p["intermediate"] * 3
    # backward: the recomputed projections (2 of 3 GEMMs) plus the 6 gradient GEMMs
    return {"forward": fwd, "backward": fwd * 8 / 3, "full": fwd * 11 / 3}[mode]


def memory_estimate(p, dtype, provider, mode):
    t, h, i = p["batch"] * p["seq"], p["hidden"], p["intermediate"]
    n = itemsize(dtype)
    weights = 3 * h * i * n * 2  # weights and their gradients
    io = 3 * t * h * n  # x, out, dx
    if provider in ("onca", "liger"):
        shards = max(1, -(-p["seq"] // h))
        acts = 4 * -(-t // shards) * i * n
    else:
        acts = {"torch": 6, "torch_compile": 4, "gemm_limit": 3}[provider] * t * i * n
    return weights + io + acts + (16 << 20)


FIXED = {"batch": BATCH, "seq": SEQ, "hidden": 4096, "intermediate": 14336}

BENCHMARK = OpBenchmark(
    name="tiled_mlp",
    make_inputs=make_inputs,
    onca=onca,
    reference=reference,
    liger=liger,
    # The cuBLAS time of the eleven matmuls a recomputing MLP must do, as the limit row.
    peers={"gemm_limit": gemm_limit},
    sweeps=(
        d1("seq", [4096, 16384, 32768, 65536], FIXED, "sequence length (batch 1, Llama-3-8B MLP)"),
        d2(lambda m: {"batch": 1, "seq": SEQ, "hidden": m.hidden_size, "intermediate": m.intermediate_size}
           if m.hidden_act == "silu" and m.hidden_size <= 8192 else None),
    ),
    flops=flops,
    memory_estimate=memory_estimate,
    probe={"batch": 1, "seq": 256, "hidden": 64, "intermediate": 128},
    config="SwiGLU, num_shards = ceil(seq / hidden) (liger's default), no biases",
)
