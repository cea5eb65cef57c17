"""RMSNorm benchmark: Llama-style RMSNorm over (tokens, hidden)."""

from __future__ import annotations

import torch

from onca.bench.spec import OpBenchmark, d1, d2, itemsize

EPS = 1e-6
TOKENS = 16384


def make_inputs(p, dtype, device):
    x = torch.randn(p["tokens"], p["hidden"], dtype=dtype, device=device, requires_grad=True)
    w = (torch.rand(p["hidden"], dtype=torch.float32, device=device) + 0.5).to(dtype).requires_grad_(True)
    return {"x": x, "w": w}


def onca(p, inputs):
    from onca.ops.rms_norm import rms_norm

    # dx written over the incoming gradient, as liger-kernel's default (in_place) does.
    return lambda: rms_norm(inputs["x"], inputs["w"], EPS, 0.0, "llama", overwrite_grad_output=True)


def reference(p, inputs):
    def llama_rms_norm(x, w):  # transformers' LlamaRMSNorm.forward
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)
        return w * h.to(dtype)

    return lambda: llama_rms_norm(inputs["x"], inputs["w"])


def liger(p, inputs):
    from liger_kernel.ops.rms_norm import LigerRMSNormFunction

    return lambda: LigerRMSNormFunction.apply(inputs["x"], inputs["w"], EPS, 0.0, "llama", True)


def bytes_moved(p, dtype, mode):
    t, h, b = p["tokens"], p["hidden"], itemsize(dtype)
    forward = 2 * t * h * b + h * b + 4 * t  # read x and w, write y and rstd
    backward = 3 * t * h * b + 2 * h * b + 4 * t  # read x, dy, w, rstd; write dx and dw
    return {"forward": forward, "backward": backward, "full": forward + backward}[mode]


# Peak bytes per element of x, inputs included (x, and dy for backward modes).
_PER_ELEMENT = {
    # y; backward writes dx over dy (overwrite_grad_output) and keeps one row of fp32 partials per program.
    "onca": {"forward": 2, "backward": 3, "full": 3},
    "liger": {"forward": 2, "backward": 3, "full": 3},
    # eager: fp32 upcast, its square, the normalised fp32 row, the bf16 cast, and y; saved for
    # backward, plus the fp32 gradient temporaries.
    "torch": {"forward": 8, "backward": 12, "full": 12},
    "torch_compile": {"forward": 2, "backward": 4, "full": 4},
}


def memory_estimate(p, dtype, provider, mode):
    t, h, b = p["tokens"], p["hidden"], itemsize(dtype)
    per_element = _PER_ELEMENT[provider][mode]
    # In units of the input's element size; fp32 intermediates count as two bf16 elements.
    return t * h * b * (1 + per_element) + 132 * h * 4 + 8 * t


BENCHMARK = OpBenchmark(
    name="rms_norm",
    make_inputs=make_inputs,
    onca=onca,
    reference=reference,
    liger=liger,
    sweeps=(
        d1("tokens", [1024, 2048, 4096, 8192, 16384, 32768, 65536], {"hidden": 4096}, "tokens (hidden 4096)"),
        d1("hidden", [1024, 2048, 4096, 8192, 16384, 32768], {"tokens": TOKENS}, "hidden size (16384 tokens)"),
        d2(lambda m: {"tokens": TOKENS, "hidden": m.hidden_size}),
    ),
    bytes_moved=bytes_moved,
    memory_estimate=memory_estimate,
    probe={"tokens": 256, "hidden": 1024},
    config="casting_mode=llama, eps=1e-6, in_place backward for onca and liger",
)
