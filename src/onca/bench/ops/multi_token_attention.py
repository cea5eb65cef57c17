"""Multi-token attention benchmark: the key-query convolution over ``(B, heads, L, L)`` attention
scores, heads as channels in and out, a ``K x K`` kernel with ``padding = K // 2`` (liger-kernel's
benchmark configuration), softmax.

Providers: Onca's ``multi_token_attention`` (Triton causal softmax / output mask, torch's conv2d);
the plain torch composition (``masked_fill`` with ``-inf``, ``softmax``, ``F.conv2d``,
``masked_fill`` with 0; liger-kernel's benchmark reference), timed eager as ``torch`` and compiled
as ``torch_compile``; liger-kernel's ``LigerMultiTokenAttentionFunction``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from onca.bench.spec import OpBenchmark, d1, d2, itemsize

BATCH = 2
HEADS = 8
SEQ = 1024
KERNEL = 3


def make_inputs(p, dtype, device):
    c, L, k = p["heads"], p["seq"], p.get("kernel", KERNEL)
    scores = torch.randn(p["batch"], c, L, L, dtype=dtype, device=device, requires_grad=True)
    weight = (torch.randn(c, c, k, k, device=device) * (c * k * k) ** -0.5).to(dtype).requires_grad_(True)
    bias = torch.zeros(c, dtype=dtype, device=device, requires_grad=True)
    return {"scores": scores, "weight": weight, "bias": bias}


def onca(p, inputs):
    from onca.ops.multi_token_attention import multi_token_attention

    k = p.get("kernel", KERNEL)
    return lambda: multi_token_attention(inputs["scores"], inputs["weight"], inputs["bias"], 1, k // 2)


def reference(p, inputs):
    L, k = p["seq"], p.get("kernel", KERNEL)
    upper = torch.ones(L, L, dtype=torch.bool, device=inputs["scores"].device).triu(1)

    def torch_mta(scores, weight, bias):
        probs = torch.softmax(scores.masked_fill(upper, float("-inf")), dim=-1)
        return F.conv2d(probs, weight, bias, padding=k // 2).masked_fill(upper, 0.0)

    return lambda: torch_mta(inputs["scores"], inputs["weight"], inputs["bias"])


def liger(p, inputs):
    from liger_kernel.ops.multi_token_attention import LigerMultiTokenAttentionFunction

    k = p.get("kernel", KERNEL)
    return lambda: LigerMultiTokenAttentionFunction.apply(inputs["scores"], inputs["weight"], inputs["bias"], 1,
                                                          k // 2, 1, 1, False)


def bytes_moved(p, dtype, mode):
    square = p["batch"] * p["heads"] * p["seq"] ** 2 * itemsize(dtype)
    forward = 3 * square  # read scores; write probs (kept), write out (the conv reads probs: counted once)
    backward = 5 * square  # read dout, write the masked dout, read it and probs in the conv grads, write dscores
    return {"forward": forward, "backward": backward, "full": forward + backward}[mode]


def flops(p, mode):
    k = p.get("kernel", KERNEL)
    conv = 2.0 * p["batch"] * p["heads"] * p["heads"] * k * k * p["seq"] ** 2
    return {"forward": conv, "backward": 2 * conv, "full": 3 * conv}[mode]


def memory_estimate(p, dtype, provider, mode):
    square = p["batch"] * p["heads"] * p["seq"] ** 2 * itemsize(dtype)
    mask = p["seq"] ** 2
    if provider == "onca":
        # scores, probs, the convolution's channels-last output, out (+ dout, masked dout, grads)
        live = {"forward": 4, "backward": 5, "full": 6}[mode]
    elif provider == "liger":
        live = {"forward": 4, "backward": 7, "full": 8}[mode]  # also the masked scores, kept for backward
    elif provider == "torch":
        live = {"forward": 4, "backward": 8, "full": 9}[mode]
    else:
        live = {"forward": 3, "backward": 6, "full": 7}[mode]
    return live * square + mask + (1 << 20)


BENCHMARK = OpBenchmark(
    name="multi_token_attention",
    make_inputs=make_inputs,
    onca=onca,
    reference=reference,
    liger=liger,
    sweeps=(
        d1("seq", [256, 512, 1024, 2048, 4096], {"batch": BATCH, "heads": HEADS},
           "sequence length (2 x 8 heads, 3 x 3 kernel)"),
        d1("kernel", [3, 5, 7, 11], {"batch": BATCH, "heads": HEADS, "seq": SEQ},
           "kernel size (2 x 8 heads x 1024 x 1024)"),
        d2(lambda m: {"batch": 1, "heads": m.num_heads, "seq": SEQ}),
    ),
    bytes_moved=bytes_moved,
    flops=flops,
    memory_estimate=memory_estimate,
    probe={"batch": 1, "heads": 4, "seq": 128},
    config="softmax (not sparse), stride 1, padding K // 2, heads in = heads out, zero bias",
)
