"""Vocabulary-parallel cross entropy on one rank: the whole vocabulary in one shard of a one-rank
process group, as tensor parallelism of size 1 calls it. Such a call shards nothing and is Onca's
cross entropy (its kernels, torch's ops for a small call), so this is what a one-rank caller gets
beside plain cross entropy. The sharded passes' own cost on one rank was swept on an H200 on
2026-12-03 (benchmarks/NOTES.md); multi-rank figures come from ``onca compare --fsdp`` and the
distributed tests."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from onca.bench.spec import OpBenchmark, d1, d2, itemsize

TOKENS = 8192
VOCAB = 128256


def make_inputs(p, dtype, device):
    t, v = p["tokens"], p["vocab"]
    logits = torch.randn(t, v, dtype=torch.float32, device=device).to(dtype).requires_grad_(True)
    return {"logits": logits, "target": torch.randint(0, v, (t,), device=device)}


def one_rank_group(device):
    """The default process group if there is one, else a one-rank group in this process."""
    import torch.distributed as dist

    if not dist.is_initialized():
        # Both backends where CUDA is there: the host-path tool runs this op on CPU tensors too.
        backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return dist.group.WORLD


def onca(p, inputs):
    from onca.ops.vocab_parallel_cross_entropy import vocab_parallel_cross_entropy

    group = one_rank_group(inputs["logits"].device)
    # Even shards (vocab_start=None): the usual tensor-parallel layout, and no gather of the shard
    # sizes on the host (an explicit vocab_start for uneven shards gathers them every call).
    return lambda: vocab_parallel_cross_entropy(inputs["logits"], inputs["target"], group)


def sharded_passes(p, inputs):
    """For ``onca audit``: the sharded passes, which the benchmark's call (the whole vocabulary on
    one rank: cross entropy) does not run. A vocabulary one class wider than the shard makes the
    shard not the whole vocabulary; the kernels and their compile-time options are a multi-rank
    call's."""
    from onca.ops.vocab_parallel_cross_entropy import vocab_parallel_cross_entropy

    group = one_rank_group(inputs["logits"].device)
    vocab = inputs["logits"].shape[-1]
    return lambda: vocab_parallel_cross_entropy(inputs["logits"], inputs["target"], group, vocab_start=0,
                                                vocab_size=vocab + 1)


def reference(p, inputs):
    return lambda: F.cross_entropy(inputs["logits"].float(), inputs["target"])


def bytes_moved(p, dtype, mode):
    logits = p["tokens"] * p["vocab"] * itemsize(dtype)
    return {"forward": logits, "backward": 2 * logits, "full": 3 * logits}[mode]


def memory_estimate(p, dtype, provider, mode):
    t, v, b = p["tokens"], p["vocab"], itemsize(dtype)
    extra = t * v * b if provider == "onca" else t * v * (4 + 4 + b)  # torch: fp32 copy and log-softmax
    return t * v * b + extra + (1 << 20)


BENCHMARK = OpBenchmark(
    name="vocab_parallel_cross_entropy",
    make_inputs=make_inputs,
    onca=onca,
    reference=reference,
    sweeps=(
        d1("tokens", [2048, 8192, 16384], {"vocab": VOCAB}, "tokens (vocab 128256, one rank)"),
        d2(lambda m: {"tokens": TOKENS, "vocab": m.vocab_size}),
    ),
    bytes_moved=bytes_moved,
    memory_estimate=memory_estimate,
    probe={"tokens": 64, "vocab": 1024},
    config="one rank holding the whole vocabulary; mean over 8192 tokens",
    audit=sharded_passes,
)
