"""Fused residual add + RMSNorm benchmark: a decoder layer's ``h = residual + x`` followed by
Llama's RMSNorm of ``h``, returning ``(rms_norm(h), h)``, over (tokens, hidden)."""

from __future__ import annotations

import torch

from onca.bench.spec import OpBenchmark, d1, d2, itemsize

EPS = 1e-6
TOKENS = 16384


def make_inputs(p, dtype, device):
    shape = (p["tokens"], p["hidden"])
    x = torch.randn(*shape, dtype=dtype, device=device, requires_grad=True)
    residual = torch.randn(*shape, dtype=dtype, device=device, requires_grad=True)
    w = (torch.rand(p["hidden"], dtype=torch.float32, device=device) + 0.5).to(dtype).requires_grad_(True)
    return {"x": x, "residual": residual, "w": w}


def onca(p, inputs):
    from onca.ops.fused_add_rms_norm import fused_add_rms_norm

    # The gradient written over the incoming one, as liger-kernel's in_place does.
    return lambda: fused_add_rms_norm(inputs["x"], inputs["residual"], inputs["w"], EPS, 0.0, "llama",
                                      overwrite_grad_output=True)


def reference(p, inputs):
    def add_then_llama_rms_norm(x, residual, w):
        h = residual + x  # transformers' decoder layer: hidden_states = residual + hidden_states
        dtype = h.dtype  # then LlamaRMSNorm.forward on it
        n = h.to(torch.float32)
        n = n * torch.rsqrt(n.pow(2).mean(-1, keepdim=True) + EPS)
        return w * n.to(dtype), h

    return lambda: add_then_llama_rms_norm(inputs["x"], inputs["residual"], inputs["w"])


def liger(p, inputs):
    from liger_kernel.ops.fused_add_rms_norm import LigerFusedAddRMSNormFunction

    return lambda: LigerFusedAddRMSNormFunction.apply(
        inputs["x"], inputs["residual"], inputs["w"], EPS, 0.0, "llama", True
    )


def bytes_moved(p, dtype, mode):
    t, h, b = p["tokens"], p["hidden"], itemsize(dtype)
    forward = 4 * t * h * b + h * b + 4 * t  # read x, residual and w; write y, h and rstd
    backward = 4 * t * h * b + 2 * h * b + 4 * t  # read h, dy, dh, w, rstd; write dx (= dresidual), dw
    return {"forward": forward, "backward": backward, "full": forward + backward}[mode]


# Peak bytes per element of x, beyond x and residual (and the two output gradients for backward
# modes), in units of the input's element size; fp32 intermediates count as two.
_PER_ELEMENT = {
    # y and h (h is saved for backward); backward writes its gradient over dy
    # (overwrite_grad_output) and keeps one row of fp32 partials per program.
    "onca": {"forward": 3, "backward": 5, "full": 5},
    "liger": {"forward": 3, "backward": 5, "full": 5},
    # eager: h, its fp32 upcast, the square, the normalised fp32 row, its cast and y; saved for
    # backward, plus the fp32 gradient temporaries.
    "torch": {"forward": 9, "backward": 14, "full": 14},
    "torch_compile": {"forward": 3, "backward": 6, "full": 6},
}


def memory_estimate(p, dtype, provider, mode):
    t, h, b = p["tokens"], p["hidden"], itemsize(dtype)
    per_element = _PER_ELEMENT[provider][mode]
    return t * h * b * (2 + per_element) + 264 * h * 4 + 8 * t


BENCHMARK = OpBenchmark(
    name="fused_add_rms_norm",
    make_inputs=make_inputs,
    onca=onca,
    reference=reference,
    liger=liger,
    sweeps=(
        d1("tokens", [1024, 2048, 4096, 8192, 16384, 32768, 65536], {"hidden": 4096}, "tokens (hidden 4096)"),
        d1("hidden", [1024, 2048, 4096, 8192, 16384, 32768], {"tokens": TOKENS},
           "hidden size (16384 tokens)"),
        d2(lambda m: {"tokens": TOKENS, "hidden": m.hidden_size}),
    ),
    bytes_moved=bytes_moved,
    memory_estimate=memory_estimate,
    probe={"tokens": 256, "hidden": 1024},
    config="casting_mode=llama, eps=1e-6, in_place backward for onca and liger",
)
