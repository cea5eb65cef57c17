"""Cross entropy benchmark: a causal LM's loss over ``(tokens, vocab)`` logits.

Reference: Hugging Face's ``ForCausalLMLoss`` arithmetic, ``F.cross_entropy(logits.float(), y)``:
the logits are upcast to fp32 first, as every HF causal LM does (timed eager as ``torch`` and
compiled as ``torch_compile``). Onca and liger-kernel both compute the gradient in the forward
pass and write it over the logits (``overwrite_logits=True``; liger's only mode), so neither
allocates a second logits-sized buffer. No target is ignored; reduction is the mean. The
``options`` sweep times the options liger-kernel's users pass, each provider computing the same
outputs: per-class weights (``class_weights``), the token accuracy and predicted tokens
(``token_metrics``; the reference takes the argmax of the logits).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from onca.bench.spec import OpBenchmark, d1, d2, itemsize

TOKENS = 8192
VOCAB = 128256
# The option sets of the ``options`` sweep ("plain": none).
OPTION_SETS = ("plain", "class_weights", "token_metrics")


def make_inputs(p, dtype, device):
    logits = torch.randn(p["tokens"], p["vocab"], dtype=torch.float32, device=device).mul_(2.0)
    logits = logits.to(dtype).requires_grad_(True)
    target = torch.randint(0, p["vocab"], (p["tokens"],), device=device)
    inputs = {"logits": logits, "target": target}
    if p.get("options") == "class_weights":
        inputs["class_weight"] = torch.rand(p["vocab"], device=device) + 0.5
    return inputs


def _metrics(p) -> bool:
    return p.get("options") == "token_metrics"


def onca(p, inputs):
    from onca.ops.cross_entropy import cross_entropy

    metrics = _metrics(p)
    return lambda: cross_entropy(inputs["logits"], inputs["target"], overwrite_logits=True,
                                 weight=inputs.get("class_weight"), return_token_accuracy=metrics,
                                 return_predicted_tokens=metrics)


def reference(p, inputs):
    def hf_causal_lm_loss(logits, target, weight):  # transformers.loss.loss_utils.ForCausalLMLoss
        return F.cross_entropy(logits.float(), target, weight=weight, ignore_index=-100)

    def with_metrics(logits, target):
        predicted = logits.detach().argmax(dim=-1)
        return hf_causal_lm_loss(logits, target, None), (predicted == target).float().mean(), predicted

    if _metrics(p):
        return lambda: with_metrics(inputs["logits"], inputs["target"])
    return lambda: hf_causal_lm_loss(inputs["logits"], inputs["target"], inputs.get("class_weight"))


def liger(p, inputs):
    from liger_kernel.ops.cross_entropy import LigerCrossEntropyFunction

    # (input, target, weight, ignore_index, lse_square_scale, label_smoothing, reduction, softcap,
    #  return_z_loss, return_token_accuracy, return_predicted_tokens): returns (loss, z_loss,
    #  token_accuracy, predicted_tokens).
    metrics = _metrics(p)
    return lambda: LigerCrossEntropyFunction.apply(inputs["logits"], inputs["target"],
                                                   inputs.get("class_weight"), -100, 0.0, 0.0, "mean", None,
                                                   False, metrics, metrics)


def bytes_moved(p, dtype, mode):
    t, v, b = p["tokens"], p["vocab"], itemsize(dtype)
    forward = t * v * b + 8 * t  # read the logits and the targets
    backward = 2 * t * v * b  # read the logits (or what was saved), write their gradient
    full = t * v * b + t * v * b + 8 * t  # read once, write the gradient once
    return {"forward": forward, "backward": backward, "full": full}[mode]


def _per_element(provider, mode, b):
    """Peak bytes per logit, inputs included."""
    if provider in ("onca", "liger"):
        return b  # the gradient lives in the logits' storage
    if provider == "torch":
        # fp32 upcast and its log-softmax (kept for backward); backward: the fp32 gradients of
        # both and the gradient in the input dtype.
        return b + 8 if mode == "forward" else 2 * b + 12
    # torch.compile: one fused kernel each way; the gradient is a second logits-sized buffer.
    return b + 4 if mode == "forward" else 2 * b + 4


def memory_estimate(p, dtype, provider, mode):
    t, v = p["tokens"], p["vocab"]
    return t * v * _per_element(provider, mode, itemsize(dtype)) + 64 * t + (1 << 20)


BENCHMARK = OpBenchmark(
    name="cross_entropy",
    make_inputs=make_inputs,
    onca=onca,
    reference=reference,
    liger=liger,
    sweeps=(
        d1("tokens", [2048, 8192, 16384, 32768], {"vocab": VOCAB}, "tokens (vocab 128256)"),
        d1("vocab", [32000, 128256, 151936, 262144], {"tokens": TOKENS},
           "vocabulary (8192 tokens)"),
        d1("options", OPTION_SETS, {"tokens": TOKENS, "vocab": VOCAB}, "options (8192 tokens, vocab 128256)"),
        d2(lambda m: {"tokens": TOKENS, "vocab": m.vocab_size}),
    ),
    bytes_moved=bytes_moved,
    memory_estimate=memory_estimate,
    probe={"tokens": 256, "vocab": 4096},
    config="mean over 8192-token batches by default, no ignored targets; reference = HF ForCausalLMLoss "
           "(logits.float() then F.cross_entropy); onca and liger write the gradient over the logits",
)
