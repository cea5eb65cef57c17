"""GRPO loss benchmark: the per-token GRPO loss over given logits (B, L + 1, V), DAPO reduction
with the KL penalty, as TRL's GRPOTrainer computes it from the policy's logits."""

from __future__ import annotations

import torch

from onca.bench.spec import OpBenchmark, d1, d2, itemsize

BATCH = 8
SEQ = 1024
TEMPERATURE = 0.9


def make_inputs(p, dtype, device):
    b, seq, v = p["batch"], p["seq"], p["vocab"]
    logits = torch.randn(b, seq + 1, v, dtype=dtype, device=device).requires_grad_(True)
    ids = torch.randint(0, v, (b, seq), device=device)
    old = -torch.rand(b, seq, device=device) * 10
    ref = -torch.rand(b, seq, device=device) * 10
    adv = torch.randn(b, device=device)
    mask = torch.ones(b, seq, dtype=torch.int64, device=device)
    return {"logits": logits, "old_logp": old, "ref_logp": ref, "completion_ids": ids, "advantages": adv,
            "completion_mask": mask}


def _args(inputs):
    return (inputs["logits"], inputs["old_logp"], inputs["ref_logp"], inputs["completion_ids"],
            inputs["advantages"], inputs["completion_mask"])


def onca(p, inputs):
    from onca.functional import grpo_loss

    return lambda: grpo_loss(*_args(inputs), temperature=TEMPERATURE, reduce=True)[0]


def reference(p, inputs):
    def run():
        logits, old, ref, ids, adv, mask = _args(inputs)
        logp = (logits[:, :-1].float() / TEMPERATURE).log_softmax(-1).gather(-1, ids[..., None]).squeeze(-1)
        r = torch.exp(logp - old)
        a = adv[:, None]
        loss = -torch.min(r * a, torch.clamp(r, 0.8, 1.4) * a)
        kl = torch.exp(ref - logp) - (ref - logp) - 1
        loss = loss + 0.04 * kl
        m = mask.float()
        return (loss * m).sum() / m.sum().clamp(min=1.0)

    return run


def liger(p, inputs):
    from liger_kernel.transformers.grpo_loss import triton_grpo_loss

    return lambda: triton_grpo_loss(*_args(inputs), temperature=TEMPERATURE, inplace=False, reduce=True)[0]


def _logit_bytes(p, dtype):
    return p["batch"] * (p["seq"] + 1) * p["vocab"] * itemsize(dtype)


def bytes_moved(p, dtype, mode):
    # Forward reads the logits once; backward reads them once and writes their gradient.
    return {"forward": 1, "backward": 2, "full": 3}[mode] * _logit_bytes(p, dtype)


# Peak bytes in units of the logits (in their dtype): inputs, fp32 upcasts and log-softmax for the
# reference, the gradient for all.
_UNITS = {
    "onca": {"forward": 1, "backward": 2, "full": 2},
    "liger": {"forward": 1, "backward": 2, "full": 2},
    "torch": {"forward": 5, "backward": 9, "full": 9},
    "torch_compile": {"forward": 3, "backward": 5, "full": 5},
}


def memory_estimate(p, dtype, provider, mode):
    return _UNITS[provider][mode] * _logit_bytes(p, dtype) + (8 << 20)


FIXED = {"batch": BATCH, "seq": SEQ, "vocab": 151936}

BENCHMARK = OpBenchmark(
    name="grpo_loss",
    make_inputs=make_inputs,
    onca=onca,
    reference=reference,
    liger=liger,
    sweeps=(
        d1("seq", [256, 512, 1024, 2048], FIXED, "completion length (batch 8, vocab 151936)"),
        d2(lambda m: {"batch": 4, "seq": 1024, "vocab": m.vocab_size}),
    ),
    bytes_moved=bytes_moved,
    memory_estimate=memory_estimate,
    probe={"batch": 2, "seq": 64, "vocab": 4096},
    config="DAPO reduction, beta 0.04, eps 0.2/0.4, temperature 0.9, token-level IS; liger inplace=False",
)
