"""Shared declaration of the post-training loss benchmarks (not itself a benchmark: the leading
underscore keeps it out of ``onca bench``'s list). Inputs in TRL's concatenated layout: ``2B``
sequences of ``seq`` positions (``B`` pairs for the paired losses, ``2B`` completions otherwise),
the first quarter of each sequence a prompt (ignored); a reference model of the policy's size."""

from __future__ import annotations

import torch

from onca.bench.ops._gemm_limit import head_gemm_bytes, head_gemm_limit
from onca.bench.spec import OpBenchmark, d1, d2, itemsize

SEQUENCES = 8  # 2B
SEQ = 1024
HIDDEN = 4096
VOCAB = 128256


def make_inputs(p, dtype, device):
    n, t, h, v = p["sequences"], p["seq"], p["hidden"], p["vocab"]
    std = h ** -0.5
    labels = torch.randint(0, v, (n, t), device=device)
    labels[:, : t // 4] = -100
    return {
        "hidden": torch.randn(n, t, h, dtype=dtype, device=device, requires_grad=True),
        "weight": (torch.randn(v, h, dtype=dtype, device=device) * std).requires_grad_(True),
        "ref_hidden": torch.randn(n, t, h, dtype=dtype, device=device),
        "ref_weight": torch.randn(v, h, dtype=dtype, device=device) * std,
        "labels": labels,
        "advantages": torch.randn(n, device=device),
        "old_logps": torch.randn(n, t, device=device) - 5,
        "desirable": torch.arange(n, device=device) % 2 == 0,
    }


def token_logps(hidden, weight, labels, temperature=1.0):
    """The unfused computation: full logits in the input dtype, an fp32 log-softmax, a gather."""
    logits = (hidden @ weight.T).float() / temperature
    logp = torch.log_softmax(logits, -1).gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return torch.where(labels != -100, logp, 0.0)


def flops(uses_ref: bool):
    def count(p, mode):
        tokens = p["sequences"] * p["seq"]
        head = 2 * tokens * p["hidden"] * p["vocab"]
        forward = head * (2 if uses_ref else 1)
        backward = 2 * head
        return {"forward": forward, "backward": backward, "full": forward + backward}[mode]

    return count


def memory(uses_ref: bool):
    def estimate(p, dtype, provider, mode):
        n, t, h, v = p["sequences"], p["seq"], p["hidden"], p["vocab"]
        tokens, b = n * t, itemsize(dtype)
        inputs = (2 if uses_ref else 1) * (tokens * h + v * h) * b
        grads = (tokens * h + v * h) * b
        if provider == "onca":
            # dW accumulates in the weight's dtype (the grads above); 512-token chunks of logits
            # (twice that for fp32 inputs, whose dW is fp32 anyway) and per-token statistics.
            chunk = min(tokens, 512 if b < 4 else 1024)
            extra = grads + 2 * chunk * v * b + 8 * tokens * 4
        elif provider == "liger":
            extra = grads + 4 * v * h + 8 * 2 * t * v * 4  # chunks of one pair of sequences, fp32 temporaries
        elif provider == "gemm_limit":
            extra = grads + head_gemm_bytes(tokens, v, b, 1 if uses_ref else 0)
        else:  # logits in the dtype, fp32 copies, log-softmax and its gradient
            extra = grads + tokens * v * (b + 3 * 4) * (1 if mode == "forward" else 2)
        return inputs + extra

    return estimate


def benchmark(name, onca, reference, liger, *, uses_ref: bool, config: str) -> OpBenchmark:
    fixed = {"sequences": SEQUENCES, "hidden": HIDDEN, "vocab": VOCAB}
    return OpBenchmark(
        name=name,
        make_inputs=make_inputs,
        onca=onca,
        reference=reference,
        liger=liger,
        # The head matmuls alone (the policy's three, the reference model's logits): the limit row.
        peers={"gemm_limit": head_gemm_limit(("hidden", "weight"),
                                             ("ref_hidden", "ref_weight") if uses_ref else ())},
        sweeps=(
            d1("seq", [256, 512, 1024, 2048], fixed, f"positions per sequence ({SEQUENCES} sequences, hidden "
               f"{HIDDEN}, vocab {VOCAB})"),
            d1("vocab", [32000, 128256, 151936, 262144], {"sequences": SEQUENCES, "seq": SEQ, "hidden": HIDDEN},
               f"vocabulary ({SEQUENCES} x {SEQ} tokens, hidden {HIDDEN})"),
            d2(lambda m: {"sequences": SEQUENCES, "seq": SEQ, "hidden": m.hidden_size, "vocab": m.vocab_size}),
        ),
        flops=flops(uses_ref),
        memory_estimate=memory(uses_ref),
        probe={"sequences": 2, "seq": 16, "hidden": 64, "vocab": 512},
        config=config,
    )
