"""Fused linear cross entropy benchmark: a causal LM's head and loss, ``hidden (T, H) -> loss``.

Reference: the eager computation of a Hugging Face causal LM, ``F.cross_entropy((h @ W.T).float(),
y)`` (the head's matmul in the input dtype, the loss on upcast logits), timed eager as ``torch`` and
compiled as ``torch_compile``. liger-kernel: ``LigerFusedLinearCrossEntropyFunction`` with its
defaults. Matmul-bound: three ``2 * T * V * H`` matmuls for forward + backward (``flops``); the
memory metric of the D1 sweeps shows the peak against tokens and vocabulary with the eager line
beside it. The ``chunk_tokens`` sweep varies only Onca's tokens per chunk (the other providers
are repeated unchanged at each point), to show its speed/memory trade-off. The ``options`` sweep
times the options liger-kernel's users pass, each provider computing the same outputs: per-class
weights (``class_weights``), each token's loss scaled by its detached probability of the target
(``token_scaling``), the token accuracy and predicted tokens (``token_metrics``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from onca.bench.ops._gemm_limit import head_gemm_bytes, head_gemm_limit
from onca.bench.spec import OpBenchmark, d1, d2, itemsize

TOKENS = 8192
HIDDEN = 4096
VOCAB = 128256
# The option sets of the ``options`` sweep ("plain": none).
OPTION_SETS = ("plain", "class_weights", "token_scaling", "token_metrics")


def make_inputs(p, dtype, device):
    t, h, v = p["tokens"], p["hidden"], p["vocab"]
    hidden = torch.randn(t, h, dtype=torch.float32, device=device).to(dtype).requires_grad_(True)
    weight = (torch.randn(v, h, dtype=torch.float32, device=device) * h ** -0.5).to(dtype).requires_grad_(True)
    target = torch.randint(0, v, (t,), device=device)
    inputs = {"hidden": hidden, "weight": weight, "target": target}
    if p.get("options") == "class_weights":
        inputs["ce_weight"] = torch.rand(v, device=device) + 0.5
    return inputs


def _flags(p) -> tuple[bool, bool]:
    """(use_token_scaling, token metrics) of the point's option set."""
    return p.get("options") == "token_scaling", p.get("options") == "token_metrics"


def onca(p, inputs):
    from onca.ops.fused_linear_cross_entropy import fused_linear_cross_entropy

    chunk = p.get("chunk_tokens")
    scaling, metrics = _flags(p)
    return lambda: fused_linear_cross_entropy(inputs["hidden"], inputs["weight"], inputs["target"],
                                              chunk_tokens=chunk, ce_weight=inputs.get("ce_weight"),
                                              use_token_scaling=scaling, return_token_accuracy=metrics,
                                              return_predicted_tokens=metrics)


def reference(p, inputs):
    scaling, metrics = _flags(p)

    def hf_head_and_loss(hidden, weight, target, ce_weight):  # lm_head, then ForCausalLMLoss's upcast
        logits = (hidden @ weight.T).float()
        if not (scaling or metrics):
            return F.cross_entropy(logits, target, weight=ce_weight, ignore_index=-100)
        per_token = F.cross_entropy(logits, target, ignore_index=-100, reduction="none")
        if scaling:  # liger-kernel's token scaling: times the detached probability of the target
            p_target = torch.softmax(logits.detach(), dim=-1).gather(1, target[:, None])[:, 0]
            return (per_token * p_target).mean()
        predicted = logits.detach().argmax(dim=-1)
        return per_token.mean(), (predicted == target).float().mean(), predicted

    return lambda: hf_head_and_loss(inputs["hidden"], inputs["weight"], inputs["target"],
                                    inputs.get("ce_weight"))


def liger(p, inputs):
    from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction

    # (input, weight, target, bias, ce_weight, ignore_index, lse_square_scale, label_smoothing,
    #  reduction, softcap, return_z_loss, accum_dtype, use_token_scaling, return_token_accuracy,
    #  return_predicted_tokens): returns (loss, z_loss, token_accuracy, predicted_tokens).
    scaling, metrics = _flags(p)
    return lambda: LigerFusedLinearCrossEntropyFunction.apply(
        inputs["hidden"], inputs["weight"], inputs["target"], None, inputs.get("ce_weight"), -100, 0.0, 0.0,
        "mean", None, False, None, scaling, metrics, metrics)


def cut_cross_entropy(p, inputs):
    """Apple's cut-cross-entropy (``linear_cross_entropy``, its default Triton kernel): the plain
    mean loss only (it has no class weights, token scaling or token metrics)."""
    from cut_cross_entropy import linear_cross_entropy

    if p.get("options", "plain") != "plain":
        raise NotImplementedError(f"cut-cross-entropy has no {p['options']} option")
    return lambda: linear_cross_entropy(inputs["hidden"], inputs["weight"], inputs["target"],
                                        ignore_index=-100, reduction="mean")


gemm_limit = head_gemm_limit(("hidden", "weight"))


def flops(p, mode):
    one = 2.0 * p["tokens"] * p["hidden"] * p["vocab"]  # one of the three matmuls
    return {"forward": one, "backward": 2 * one, "full": 3 * one}[mode]


def _onca_chunk(p):
    from onca.ops.fused_linear_cross_entropy import CHUNK_TOKENS

    return min(p["tokens"], p.get("chunk_tokens") or CHUNK_TOKENS)


def _liger_chunk(p):
    t, h, v = p["tokens"], p["hidden"], p["vocab"]
    inc = -(-v // h)
    chunk = 1 << max(0, (-(-t // inc) - 1).bit_length())
    return min(chunk, t)


def memory_estimate(p, dtype, provider, mode):
    t, h, v, b = p["tokens"], p["hidden"], p["vocab"], itemsize(dtype)
    inputs = (t * h + v * h) * b + 8 * t
    grads = (t * h + v * h) * b  # dHidden and dW, in every provider
    if provider == "onca":
        extra = _onca_chunk(p) * v * b + 16 * t
    elif provider == "liger":
        extra = _liger_chunk(p) * v * b + 16 * t
    elif provider == "cut_cross_entropy":
        extra = 16 * t  # per-token statistics; the logits live only on chip
    elif provider == "gemm_limit":
        extra = head_gemm_bytes(t, v, b)
    elif provider == "torch":
        # logits in the input dtype, their fp32 upcast and log-softmax; backward: fp32 gradients
        # of both and the logits' gradient in the input dtype.
        extra = t * v * (b + 8) if mode == "forward" else t * v * (2 * b + 12)
    else:  # torch_compile: the logits and their gradient
        extra = t * v * (b + 4) if mode == "forward" else t * v * (2 * b + 4)
    if provider in ("torch", "torch_compile") and p.get("options") == "token_scaling":
        extra += t * v * 4  # the fp32 softmax of the target's probability
    if provider in ("torch", "torch_compile") and mode == "forward":
        grads = 0
    return inputs + grads + extra + (1 << 20)


BENCHMARK = OpBenchmark(
    name="fused_linear_cross_entropy",
    make_inputs=make_inputs,
    onca=onca,
    reference=reference,
    liger=liger,
    # Apple's cut-cross-entropy as a peer, and the cuBLAS three-matmul time as the limit row.
    peers={"cut_cross_entropy": cut_cross_entropy, "gemm_limit": gemm_limit},
    sweeps=(
        d1("tokens", [2048, 8192, 16384, 32768], {"hidden": HIDDEN, "vocab": VOCAB},
           "tokens (hidden 4096, vocab 128256)"),
        d1("vocab", [32000, 128256, 151936, 262144], {"tokens": TOKENS, "hidden": HIDDEN},
           "vocabulary (8192 tokens, hidden 4096)"),
        d1("options", OPTION_SETS, {"tokens": TOKENS, "hidden": HIDDEN, "vocab": VOCAB},
           "options (8192 tokens, hidden 4096, vocab 128256)"),
        d1("chunk_tokens", [256, 512, 1024, 4096],
           {"tokens": TOKENS, "hidden": HIDDEN, "vocab": VOCAB},
           "Onca tokens per chunk (8192 tokens, hidden 4096, vocab 128256)"),
        d2(lambda m: {"tokens": TOKENS, "hidden": m.hidden_size, "vocab": m.vocab_size}),
    ),
    flops=flops,
    memory_estimate=memory_estimate,
    probe={"tokens": 256, "hidden": 256, "vocab": 4096},
    config="bf16 by default, mean, no ignored targets, no bias; reference = eager lm_head + "
           "F.cross_entropy on upcast logits (HF causal LM); liger and onca with their defaults",
)
