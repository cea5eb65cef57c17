"""Neighborhood attention benchmark: ``(batch, heads, seq, head_dim)`` queries, keys and values,
each query attending to ``kernel_size`` positions around it (dilation 1, liger-kernel's default
window of 7).

Providers: Onca's ``neighborhood_attention`` (a windowed online softmax, O(L * K * D));
``torch.nn.functional.scaled_dot_product_attention`` with the boolean neighbourhood mask (built
outside the timed region; timed eager as ``torch`` and compiled as ``torch_compile``);
liger-kernel's ``LigerFusedNeighborhoodAttentionFunction`` (the full masked ``(L, L)`` scores, a
softmax over them, then ``@ V``).
"""

from __future__ import annotations

import torch

from onca.bench.spec import OpBenchmark, d1, d2, itemsize

BATCH = 2
HEADS = 16
HEAD_DIM = 128
SEQ = 4096
KERNEL = 7


def _mask(seq, kernel_size, dilation, device):
    i = torch.arange(seq, device=device)[:, None]
    j = torch.arange(seq, device=device)[None, :]
    half = kernel_size // 2
    return ((j >= (i - half * dilation).clamp(min=0)) & (j < (i + half * dilation + 1).clamp(max=seq))
            & ((j - i) % dilation == 0))


def make_inputs(p, dtype, device):
    shape = (p["batch"], p["heads"], p["seq"], p["head_dim"])
    return {name: torch.randn(shape, dtype=dtype, device=device, requires_grad=True) for name in ("q", "k", "v")}


def onca(p, inputs):
    from onca.ops.neighborhood_attention import neighborhood_attention

    k = p.get("kernel_size", KERNEL)
    return lambda: neighborhood_attention(inputs["q"], inputs["k"], inputs["v"], k, 1)


def reference(p, inputs):
    mask = _mask(p["seq"], p.get("kernel_size", KERNEL), 1, inputs["q"].device)

    def masked_sdpa(q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    return lambda: masked_sdpa(inputs["q"], inputs["k"], inputs["v"])


# liger-kernel 0.8.5 holds every (query, key) score; from 2**31 of them (2 x 16 heads x 8192**2) its
# kernels read or write out of bounds: an illegal memory access on an H200 (2026-11-28), caught
# after its 8192-token point in two sweeps (CUDA_LAUNCH_BLOCKING=1: reported after its point,
# never after Onca's), which ends the whole sweep's process.
LIGER_MAX_SCORES = (1 << 31) - 1


def liger(p, inputs):
    scores = p["batch"] * p["heads"] * p["seq"] ** 2
    if scores > LIGER_MAX_SCORES:
        raise NotImplementedError(f"liger-kernel's neighborhood attention faults at {scores} scores "
                                  f"(above 2**31 - 1; see LIGER_MAX_SCORES)")
    from liger_kernel.ops.fused_neighborhood_attention import LigerFusedNeighborhoodAttentionFunction

    k = p.get("kernel_size", KERNEL)
    return lambda: LigerFusedNeighborhoodAttentionFunction.apply(inputs["q"], inputs["k"], inputs["v"], k, 1, None)


def bytes_moved(p, dtype, mode):
    n = p["batch"] * p["heads"] * p["seq"]
    row = n * p["head_dim"] * itemsize(dtype)
    forward = 4 * row + 4 * n  # read q, k, v; write out and the fp32 lse
    backward = 7 * row + 8 * n  # read q, k, v, dout, lse; write dq, dk, dv (delta in between)
    return {"forward": forward, "backward": backward, "full": forward + backward}[mode]


def flops(p, mode):
    n = p["batch"] * p["heads"] * p["seq"]
    window = 2 * (p.get("kernel_size", KERNEL) // 2) + 1
    one = 2.0 * n * window * p["head_dim"]  # one of q.k and p.v over the window
    return {"forward": 2 * one, "backward": 5 * one, "full": 7 * one}[mode]


def memory_estimate(p, dtype, provider, mode):
    b = itemsize(dtype)
    bh, seq = p["batch"] * p["heads"], p["seq"]
    row = bh * seq * p["head_dim"] * b
    base = 3 * row + row  # inputs and the output
    if mode != "forward":
        base += 4 * row  # dout and the three gradients
    square = bh * seq * seq
    if provider == "onca":
        extra = 8 * bh * seq
    elif provider == "liger":
        # the (L, L) fp32 mask, the scores and the softmax (input dtype); backward: their gradients
        extra = seq * seq * 4 + square * b * (2 if mode == "forward" else 4)
    else:
        # the boolean mask and, as an additive bias, in the input dtype per (batch, head) broadcast;
        # a math fallback would hold the scores: counted once
        extra = seq * seq * (1 + b) + square * b
    return base + extra + (1 << 20)


BENCHMARK = OpBenchmark(
    name="neighborhood_attention",
    make_inputs=make_inputs,
    onca=onca,
    reference=reference,
    liger=liger,
    sweeps=(
        d1("seq", [1024, 2048, 4096, 8192, 16384],
           {"batch": BATCH, "heads": HEADS, "head_dim": HEAD_DIM}, "sequence length (2 x 16 heads x 128, window 7)"),
        d1("kernel_size", [3, 7, 15, 31, 63],
           {"batch": BATCH, "heads": HEADS, "head_dim": HEAD_DIM, "seq": SEQ}, "window (2 x 16 heads x 4096 x 128)"),
        d2(lambda m: {"batch": 1, "heads": m.num_heads, "head_dim": m.head_dim, "seq": SEQ}),
    ),
    bytes_moved=bytes_moved,
    flops=flops,
    memory_estimate=memory_estimate,
    probe={"batch": 1, "heads": 2, "seq": 256, "head_dim": 64},
    config="dilation 1, scale 1/sqrt(head_dim), window 7 unless swept; torch = SDPA with a boolean mask",
)
