"""Embedding benchmark: ``tokens`` int64 indices (uniform random) into a ``(vocab, hidden)`` table.

The reference is ``torch.nn.functional.embedding`` (PyTorch's fused CUDA gather and its sorted
segment-reduction backward). liger-kernel 0.8.5 has an experimental embedding
(``liger_kernel.ops.experimental.embedding.LigerEmbeddingFunction``: 128 x 128 tiles, atomic adds
into a zeroed gradient of the weight's dtype); it is the ``liger`` provider.
"""

from __future__ import annotations

import torch

from onca.bench.spec import OpBenchmark, d1, d2, itemsize

TOKENS = 16384
VOCAB = 128256
HIDDEN = 4096


def make_inputs(p, dtype, device):
    indices = torch.randint(0, p["vocab"], (p["tokens"],), dtype=torch.int64, device=device)
    weight = torch.randn(p["vocab"], p["hidden"], dtype=dtype, device=device, requires_grad=True)
    return {"indices": indices, "weight": weight}


def onca(p, inputs):
    from onca.ops.embedding import embedding

    # The default bounds check: a device-side assertion in the kernel, as PyTorch's CUDA kernel has.
    return lambda: embedding(inputs["indices"], inputs["weight"])


def reference(p, inputs):
    return lambda: torch.nn.functional.embedding(inputs["indices"], inputs["weight"])


def liger(p, inputs):
    from liger_kernel.ops.experimental.embedding import LigerEmbeddingFunction

    return lambda: LigerEmbeddingFunction.apply(inputs["weight"], inputs["indices"])


def bytes_moved(p, dtype, mode):
    t, v, h, b = p["tokens"], p["vocab"], p["hidden"], itemsize(dtype)
    forward = 2 * t * h * b + 8 * t  # read the indices and t rows, write t rows
    backward = t * h * b + v * h * b + 8 * t  # read the indices and dy, write the dense gradient
    return {"forward": forward, "backward": backward, "full": forward + backward}[mode]


def memory_estimate(p, dtype, provider, mode):
    t, v, h, b = p["tokens"], p["vocab"], p["hidden"], itemsize(dtype)
    inputs = v * h * b + 8 * t
    out = t * h * b
    if mode == "forward":
        return inputs + out
    # The output and its gradient, the dense weight gradient, and scratch: onca sorts the indices
    # (values, permutation, each run's end) and keeps two fp32 rows per chunk of sorted tokens for
    # the runs that cross chunks; torch sorts too; liger has none.
    chunks = -(-t // 16)  # onca.ops.embedding.RUN_CHUNK
    scratch = {"onca": 24 * t + chunks * (8 * h + 8), "torch": 48 * t + 8 * v,
               "torch_compile": 48 * t + 8 * v, "liger": 0}[provider]
    return inputs + 2 * out + v * h * b + scratch


BENCHMARK = OpBenchmark(
    name="embedding",
    make_inputs=make_inputs,
    onca=onca,
    reference=reference,
    liger=liger,
    sweeps=(
        d1("tokens", [1024, 4096, 16384, 65536], {"vocab": VOCAB, "hidden": HIDDEN},
           f"tokens (vocab {VOCAB}, hidden {HIDDEN})"),
        d1("vocab", [32000, 128256, 151936, 262144], {"tokens": TOKENS, "hidden": HIDDEN},
           f"vocabulary ({TOKENS} tokens, hidden {HIDDEN})"),
        d2(lambda m: {"tokens": TOKENS, "vocab": m.vocab_size, "hidden": m.hidden_size}),
    ),
    bytes_moved=bytes_moved,
    memory_estimate=memory_estimate,
    probe={"tokens": 256, "vocab": 1000, "hidden": 256},
    config=("int64 indices, uniform random; onca: default (device-side) bounds check and backward "
            "(sorted segment reduction for bf16/fp16 tables, fp32 atomics for fp32 tables)"),
)
