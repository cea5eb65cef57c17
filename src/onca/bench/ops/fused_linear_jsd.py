"""Fused linear JSD benchmark (distillation): student and teacher hidden states and LM heads of one
size, beta 0.5, temperature 1, no labels."""

from __future__ import annotations

import torch

from onca.bench.ops.jsd import torch_jsd
from onca.bench.ops._gemm_limit import head_gemm_bytes, head_gemm_limit
from onca.bench.spec import OpBenchmark, d1, d2, itemsize

TOKENS = 8192
HIDDEN = 4096
VOCAB = 128256
BETA = 0.5
TEMPERATURE = 1.0


def make_inputs(p, dtype, device):
    t, h, v = p["tokens"], p["hidden"], p["vocab"]
    std = h ** -0.5
    return {
        "student_hidden": torch.randn(t, h, dtype=dtype, device=device, requires_grad=True),
        "student_weight": (torch.randn(v, h, dtype=dtype, device=device) * std).requires_grad_(True),
        "teacher_hidden": torch.randn(t, h, dtype=dtype, device=device),
        "teacher_weight": torch.randn(v, h, dtype=dtype, device=device) * std,
    }


def _args(inputs):
    names = ("student_hidden", "student_weight", "teacher_hidden", "teacher_weight")
    return tuple(inputs[name] for name in names)


def onca(p, inputs):
    from onca.ops.fused_linear_jsd import fused_linear_jsd

    return lambda: fused_linear_jsd(*_args(inputs), None, BETA, -100, TEMPERATURE)


def reference(p, inputs):
    """Both heads' logits in full, then the plain PyTorch JSD (fp32 log-softmax at temperature)."""

    def eager(sh, sw, th, tw):
        log_q = torch.log_softmax((sh @ sw.T).float() / TEMPERATURE, dim=-1)
        with torch.no_grad():
            log_p = torch.log_softmax((th @ tw.T).float() / TEMPERATURE, dim=-1)
        return torch_jsd(log_q, log_p).to(sh.dtype)

    return lambda: eager(*_args(inputs))


def liger(p, inputs):
    from liger_kernel.ops.fused_linear_jsd import LigerFusedLinearJSDFunction

    # accum_dtype=fp32: the head's gradient accumulated in fp32, as onca does (liger's default
    # accumulates in the weight's dtype).
    args = _args(inputs)
    return lambda: LigerFusedLinearJSDFunction.apply(*args, None, BETA, -100, TEMPERATURE, torch.float32)


def flops(p, mode):
    t, h, v = p["tokens"], p["hidden"], p["vocab"]
    forward = 2 * (2 * t * h * v)  # student and teacher logits
    backward = 2 * (2 * t * h * v)  # dStudentHidden and dStudentWeight
    return {"forward": forward, "backward": backward, "full": forward + backward}[mode]


def memory_estimate(p, dtype, provider, mode):
    t, h, v = p["tokens"], p["hidden"], p["vocab"]
    b = itemsize(dtype)
    inputs = 2 * (t * h + v * h) * b
    grads = (t * h + v * h) * b  # dStudentHidden, dStudentWeight
    if provider == "onca":
        from onca.ops.fused_linear_jsd import MIN_CHUNK_TOKENS

        # fp32 dW accumulator and two (chunk, V) fp32 logits buffers (the chunk from the op's policy);
        # the backward rescales the forward's gradients in place.
        chunk = min(t, max(h // 4, MIN_CHUNK_TOKENS))
        extra = grads + 4 * v * h + 2 * chunk * v * 4
    elif provider == "liger":
        # chunks of about tokens * hidden / vocab rows; ~7 fp32 (chunk, V) buffers; fp32 dW.
        chunk = min(t, max(1, t * h // v))
        extra = grads + 4 * v * h + 7 * chunk * v * 4
    elif provider == "gemm_limit":
        extra = grads + head_gemm_bytes(t, v, b, 1)
    elif provider == "torch":  # both logits in the dtype and fp32, log-softmaxes, the JSD's fp32 terms
        extra = {"forward": 14, "backward": 16, "full": 16}[mode] * 4 * t * v + grads
    else:
        extra = {"forward": 4, "backward": 6, "full": 6}[mode] * 4 * t * v + grads
    return inputs + extra


BENCHMARK = OpBenchmark(
    name="fused_linear_jsd",
    make_inputs=make_inputs,
    onca=onca,
    reference=reference,
    liger=liger,
    # The student's three matmuls and the teacher's logits alone: the limit row.
    peers={"gemm_limit": head_gemm_limit(("student_hidden", "student_weight"),
                                         ("teacher_hidden", "teacher_weight"))},
    sweeps=(
        d1("tokens", [1024, 4096, 8192, 16384], {"hidden": HIDDEN, "vocab": VOCAB},
           f"tokens (hidden {HIDDEN}, vocab {VOCAB})"),
        d1("vocab", [32000, 128256, 151936, 262144], {"tokens": TOKENS, "hidden": HIDDEN},
           f"vocabulary ({TOKENS} tokens, hidden {HIDDEN})"),
        d2(lambda m: {"tokens": TOKENS, "hidden": m.hidden_size, "vocab": m.vocab_size}),
    ),
    flops=flops,
    memory_estimate=memory_estimate,
    probe={"tokens": 32, "hidden": 64, "vocab": 512},
    config=f"beta={BETA}, temperature={TEMPERATURE}, no labels, teacher of the student's size; "
           "liger with accum_dtype=fp32",
)
