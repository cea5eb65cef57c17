"""GeGLU benchmark: the activation product ``c = gelu(a, approximate="tanh") * b`` (Gemma's
``gelu_pytorch_tanh``) over ``(tokens, intermediate)``.

As liger-kernel's benchmark, the op alone is timed. Liger writes ``da``/``db`` over ``a``/``b``
in the backward, and so does Onca except in the backward mode (see the SwiGLU benchmark).
"""

from __future__ import annotations

import torch

from onca.bench.spec import OpBenchmark, d1, d2, itemsize

TOKENS = 16384
INTERMEDIATE = 14336


def make_inputs(p, dtype, device):
    shape = (p["tokens"], p["intermediate"])
    a = torch.randn(shape, dtype=dtype, device=device, requires_grad=True)
    b = torch.randn(shape, dtype=dtype, device=device, requires_grad=True)
    return {"a": a, "b": b}


def onca(p, inputs, mode):
    from onca.ops.geglu import geglu

    overwrite = mode != "backward"
    return lambda: geglu(inputs["a"], inputs["b"], "tanh", overwrite_inputs=overwrite)


def reference(p, inputs):
    def gemma_geglu(a, b):  # transformers' GemmaMLP with gelu_pytorch_tanh
        return torch.nn.functional.gelu(a, approximate="tanh") * b

    return lambda: gemma_geglu(inputs["a"], inputs["b"])


def liger(p, inputs):
    from liger_kernel.ops.geglu import LigerGELUMulFunction

    return lambda: LigerGELUMulFunction.apply(inputs["a"], inputs["b"])


def bytes_moved(p, dtype, mode):
    elements = p["tokens"] * p["intermediate"] * itemsize(dtype)
    forward = 3 * elements  # read a, b; write c
    backward = 5 * elements  # read dc, a, b; write da, db
    return {"forward": forward, "backward": backward, "full": forward + backward}[mode]


# Peak (T x I) tensors alive, inputs a and b included; backward modes also hold c and dc.
_TENSORS = {
    "onca": {"forward": 3, "backward": 6, "full": 4},
    "liger": {"forward": 3, "backward": 4, "full": 4},
    "torch": {"forward": 4, "backward": 8, "full": 8},
    "torch_compile": {"forward": 3, "backward": 6, "full": 6},
}


def memory_estimate(p, dtype, provider, mode):
    return _TENSORS[provider][mode] * p["tokens"] * p["intermediate"] * itemsize(dtype)


def _gelu_tanh_model(m):
    if m.hidden_act != "gelu_pytorch_tanh":
        return None
    return {"tokens": TOKENS, "intermediate": m.intermediate_size}


BENCHMARK = OpBenchmark(
    name="geglu",
    make_inputs=make_inputs,
    onca=onca,
    reference=reference,
    liger=liger,
    sweeps=(
        d1("tokens", [2048, 8192, 16384, 32768], {"intermediate": INTERMEDIATE},
           f"tokens (intermediate {INTERMEDIATE})"),
        d2(_gelu_tanh_model),
    ),
    bytes_moved=bytes_moved,
    memory_estimate=memory_estimate,
    probe={"tokens": 256, "intermediate": 1024},
    config='c = gelu(a, approximate="tanh") * b; liger writes da/db over a/b, onca too '
           '(overwrite_inputs=True) except in the backward mode, where it allocates them',
)
