"""Fused MoE benchmark: the experts of a SwiGLU mixture-of-experts MLP (routing given), over
``(tokens, hidden)`` with ``experts``, ``top_k`` and the expert ``intermediate`` size.

The reference is the Hugging Face expert loop (``MixtralExperts.forward``: one-hot mask, a Python
loop over the experts hit, ``index_add_``), which the harness also compiles. liger-kernel's
``LigerFusedMoEFunction`` takes the same ``(E, 2I, H)`` / ``(E, H, I)`` weights. D2 runs the expert
shapes of Mixtral 8x7B, Qwen3-30B-A3B and GPT-OSS 20B (the latter with plain SwiGLU and no biases,
so that every provider computes the same thing). Routing is random top-k of softmax scores, fixed
per point. Matmul-bound: ``flops`` counts the three expert GEMMs (forward) and six (backward).
"""

from __future__ import annotations

import torch

from onca.bench.spec import OpBenchmark, d1, d2, itemsize
from onca.models import ModelConfig

TOKENS = 4096

# name: (hidden, expert intermediate, experts, top_k), from each model's config.json.
MOE_MODELS = {
    "mixtral-8x7b": (4096, 14336, 8, 2),
    "qwen3-30b-a3b": (2048, 768, 128, 8),
    "gpt-oss-20b": (2880, 2880, 32, 4),
}
_REGISTRY = [ModelConfig(name, "moe", h, i, 32, 8, 128, 32000, 24) for name, (h, i, _, _) in MOE_MODELS.items()]


def make_inputs(p, dtype, device):
    t, h, i, e, k = p["tokens"], p["hidden"], p["intermediate"], p["experts"], p["top_k"]
    x = torch.randn(t, h, dtype=dtype, device=device, requires_grad=True)
    w1 = (torch.randn(e, 2 * i, h, device=device) * h ** -0.5).to(dtype).requires_grad_(True)
    w2 = (torch.randn(e, h, i, device=device) * i ** -0.5).to(dtype).requires_grad_(True)
    scores = torch.softmax(torch.randn(t, e, device=device), -1)
    weights, index = torch.topk(scores, k, -1)
    weights = (weights / weights.sum(-1, keepdim=True)).requires_grad_(True)
    return {"x": x, "gate_up_proj": w1, "down_proj": w2, "top_k_index": index, "top_k_weights": weights}


def _args(inputs):
    return (inputs["x"], inputs["gate_up_proj"], inputs["down_proj"], inputs["top_k_index"],
            inputs["top_k_weights"])


def onca(p, inputs):
    from onca.ops.fused_moe import fused_moe

    return lambda: fused_moe(*_args(inputs))


def reference(p, inputs):
    n_experts = p["experts"]

    def hf_experts(x, gate_up_proj, down_proj, top_k_index, top_k_weights):  # MixtralExperts.forward
        out = torch.zeros_like(x)
        with torch.no_grad():
            mask = torch.nn.functional.one_hot(top_k_index, num_classes=n_experts + 1).permute(2, 1, 0)
            hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
        for e in hit:
            e = e[0]
            if e == n_experts:
                continue
            slot, token = torch.where(mask[e])
            gate, up = torch.nn.functional.linear(x[token], gate_up_proj[e]).chunk(2, dim=-1)
            y = torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, down_proj[e])
            y = y * top_k_weights[token, slot, None]
            out.index_add_(0, token, y.to(out.dtype))
        return out

    return lambda: hf_experts(*_args(inputs))


def liger(p, inputs):
    from liger_kernel.ops.fused_moe import LigerFusedMoEFunction

    x, w1, w2, index, weights = _args(inputs)
    index = index.to(torch.int32)
    return lambda: LigerFusedMoEFunction.apply(x, w1, w2, index, weights)


def flops(p, mode):
    forward = 6 * p["tokens"] * p["top_k"] * p["hidden"] * p["intermediate"]
    return {"forward": forward, "backward": 2 * forward, "full": 3 * forward}[mode]


def bytes_moved(p, dtype, mode):
    # A lower bound: every expert weight and the token rows once (the routed pairs' intermediates
    # can stay on chip, so top_k does not add to it).
    t, h, i, e = p["tokens"], p["hidden"], p["intermediate"], p["experts"]
    b = itemsize(dtype)
    weights = 3 * e * h * i * b
    forward = weights + 2 * t * h * b
    backward = 2 * weights + 3 * t * h * b
    return {"forward": forward, "backward": backward, "full": forward + backward}[mode]


# The (pairs x intermediate, pairs x hidden) tensors alive at each phase of a run beyond the inputs
# and weights (the peak is the largest phase), and weight copies (1: the weight gradients).
_PEAK = {
    # forward: pre (2I) + act (I) + y (H); backward: pre, d_pre (2I) with act (I), then with dx rows (H).
    "onca": {"forward": (((3, 1),), 0), "backward": (((5, 0), (4, 1)), 1), "full": (((5, 0), (4, 1)), 1)},
    "liger": {"forward": (((3, 1),), 0), "backward": (((5, 2),), 1), "full": (((5, 2),), 1)},
    # per expert: gathered x, gate_up, silu, product, y, weighted y, all saved for backward.
    "torch": {"forward": (((5, 3),), 0), "backward": (((9, 4),), 1), "full": (((9, 4),), 1)},
    "torch_compile": {"forward": (((4, 2),), 0), "backward": (((8, 3),), 1), "full": (((8, 3),), 1)},
}


def memory_estimate(p, dtype, provider, mode):
    t, h, i, e, k = p["tokens"], p["hidden"], p["intermediate"], p["experts"], p["top_k"]
    b = itemsize(dtype)
    phases, weight_copies = _PEAK[provider][mode]
    weights = 3 * e * h * i * b
    rows = max(per_i * i + per_h * h for per_i, per_h in phases)
    return weights * (1 + weight_copies) + 3 * t * h * b + t * k * rows * b + 16 * t * k


def _moe_model(m):
    h, i, e, k = MOE_MODELS[m.name]
    return {"tokens": TOKENS, "hidden": h, "intermediate": i, "experts": e, "top_k": k}


BENCHMARK = OpBenchmark(
    name="fused_moe",
    make_inputs=make_inputs,
    onca=onca,
    reference=reference,
    liger=liger,
    sweeps=(
        d1("tokens", [512, 1024, 2048, 4096, 8192, 16384],
           {"hidden": 2048, "intermediate": 768, "experts": 128, "top_k": 8},
           "tokens (Qwen3-30B-A3B experts: hidden 2048, intermediate 768, 128 experts, top 8)"),
        d1("tokens", [512, 1024, 2048, 4096, 8192],
           {"hidden": 4096, "intermediate": 14336, "experts": 8, "top_k": 2},
           "tokens (Mixtral 8x7B experts: hidden 4096, intermediate 14336, 8 experts, top 2)"),
        d2(_moe_model, models=_REGISTRY),
    ),
    bytes_moved=bytes_moved,
    flops=flops,
    memory_estimate=memory_estimate,
    probe={"tokens": 64, "hidden": 64, "intermediate": 32, "experts": 4, "top_k": 2},
    config="SwiGLU experts, [gate | up] layout, routing given (softmax top-k, renormalised)",
)
