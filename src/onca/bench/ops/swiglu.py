"""SwiGLU benchmark: the activation product ``c = silu(a) * b`` over ``(tokens, intermediate)``.

As liger-kernel's own SwiGLU benchmark, the op alone is timed (the projections are matmuls that
every provider runs alike). Liger writes ``da``/``db`` over ``a``/``b`` in the backward, and so does
Onca (``overwrite_inputs=True``, what the patched models' MLPs pass: there ``a``/``b`` are the
projections' outputs, dead after the backward) in the forward and full modes. The backward mode
repeats the backward through one graph (``retain_graph``), which Onca refuses once the saved inputs
are overwritten (liger goes on, on its own gradients): there Onca allocates ``da``/``db``.
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
    from onca.ops.swiglu import swiglu

    overwrite = mode != "backward"
    return lambda: swiglu(inputs["a"], inputs["b"], overwrite_inputs=overwrite)


def reference(p, inputs):
    def llama_swiglu(a, b):  # transformers' LlamaMLP: act_fn(gate_proj(x)) * up_proj(x)
        return torch.nn.functional.silu(a) * b

    return lambda: llama_swiglu(inputs["a"], inputs["b"])


def liger(p, inputs):
    from liger_kernel.ops.swiglu import LigerSiLUMulFunction

    return lambda: LigerSiLUMulFunction.apply(inputs["a"], inputs["b"])


def bytes_moved(p, dtype, mode):
    elements = p["tokens"] * p["intermediate"] * itemsize(dtype)
    forward = 3 * elements  # read a, b; write c
    backward = 5 * elements  # read dc, a, b; write da, db
    return {"forward": forward, "backward": backward, "full": forward + backward}[mode]


# Peak (T x I) tensors alive, inputs a and b included; backward modes also hold c and dc.
_TENSORS = {
    # c; the backward allocates da and db.
    "onca": {"forward": 3, "backward": 6, "full": 4},
    # c; the backward writes da/db over a/b and allocates nothing.
    "liger": {"forward": 3, "backward": 4, "full": 4},
    # silu(a) is saved for the product's backward; the backward allocates silu(a)'s gradient,
    # da and db.
    "torch": {"forward": 4, "backward": 8, "full": 8},
    # fused: saves a and b, the backward allocates da and db.
    "torch_compile": {"forward": 3, "backward": 6, "full": 6},
}


def memory_estimate(p, dtype, provider, mode):
    return _TENSORS[provider][mode] * p["tokens"] * p["intermediate"] * itemsize(dtype)


def _silu_model(m):
    return {"tokens": TOKENS, "intermediate": m.intermediate_size} if m.hidden_act == "silu" else None


BENCHMARK = OpBenchmark(
    name="swiglu",
    make_inputs=make_inputs,
    onca=onca,
    reference=reference,
    liger=liger,
    sweeps=(
        d1("tokens", [2048, 8192, 16384, 32768], {"intermediate": INTERMEDIATE},
           f"tokens (intermediate {INTERMEDIATE})"),
        d2(_silu_model),
    ),
    bytes_moved=bytes_moved,
    memory_estimate=memory_estimate,
    probe={"tokens": 256, "intermediate": 1024},
    config="c = silu(a) * b; liger writes da/db over a/b, onca too (overwrite_inputs=True) except in "
           "the backward mode, where it allocates them",
)
