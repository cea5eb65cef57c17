"""Llama 4 RoPE benchmark: q and k rotated by the complex table, as Llama 4's attention calls it.

q/k are ``proj(x).view(batch, seq, heads, head_dim)`` (before the transpose, where Llama 4 applies
its rotary embedding), ``freqs_cis`` the ``(1, seq, head_dim / 2)`` complex64 table that
``Llama4TextRotaryEmbedding`` returns.
"""

from __future__ import annotations

import torch

from onca.bench.spec import OpBenchmark, d1, d2, itemsize

BATCH = 4
SEQ = 2048
THETA = 500000.0


def _dims(p):
    return p["batch"], p["seq"], p["q_heads"], p["kv_heads"], p["head_dim"]


def make_inputs(p, dtype, device):
    b, s, hq, hk, d = _dims(p)
    q = torch.randn(b, s, hq, d, dtype=dtype, device=device).requires_grad_(True)
    k = torch.randn(b, s, hk, d, dtype=dtype, device=device).requires_grad_(True)
    inv_freq = 1.0 / (THETA ** (torch.arange(0, d, 2, dtype=torch.float32, device=device) / d))
    freqs = torch.arange(s, dtype=torch.float32, device=device)[None, :, None] * inv_freq
    return {"q": q, "k": k, "freqs_cis": torch.polar(torch.ones_like(freqs), freqs)}


def onca(p, inputs):
    from onca.functional import llama4_rope

    # q/k rotated in place and dq/dk written over the incoming gradients, as liger-kernel does.
    return lambda: llama4_rope(inputs["q"], inputs["k"], inputs["freqs_cis"], overwrite_grad_output=True,
                               overwrite_inputs=True)


def reference(p, inputs):
    from transformers.models.llama4.modeling_llama4 import apply_rotary_emb

    return lambda: apply_rotary_emb(inputs["q"], inputs["k"], inputs["freqs_cis"])


def liger(p, inputs):
    from liger_kernel.transformers.llama4_rope import liger_llama4_text_rotary_pos_emb

    return lambda: liger_llama4_text_rotary_pos_emb(inputs["q"], inputs["k"], inputs["freqs_cis"])


def _qk_bytes(p, dtype):
    b, s, hq, hk, d = _dims(p)
    return b * s * (hq + hk) * d * itemsize(dtype)


def _table_bytes(p):
    return p["seq"] * p["head_dim"] * 4  # complex64: head_dim / 2 pairs of fp32


def bytes_moved(p, dtype, mode):
    one = 2 * _qk_bytes(p, dtype) + _table_bytes(p)
    return {"forward": one, "backward": one, "full": 2 * one}[mode]


# Peak bytes in units of q+k in the input dtype. The reference holds fp32 copies of q/k, their
# complex products and the fp32 results (about 3 fp32 copies: 6 units in bf16) and mirrors that
# in backward.
_QK_UNITS = {
    "onca": {"forward": 1, "backward": 2, "full": 2},  # in place, as rope's
    "liger": {"forward": 2, "backward": 3, "full": 3},
    "torch": {"forward": 8, "backward": 12, "full": 12},
    "torch_compile": {"forward": 4, "backward": 6, "full": 6},
}


def memory_estimate(p, dtype, provider, mode):
    return _QK_UNITS[provider][mode] * _qk_bytes(p, dtype) + _table_bytes(p) + (1 << 20)


FIXED = {"batch": BATCH, "seq": SEQ, "q_heads": 40, "kv_heads": 8, "head_dim": 128}

BENCHMARK = OpBenchmark(
    name="llama4_rope",
    make_inputs=make_inputs,
    onca=onca,
    reference=reference,
    liger=liger,
    sweeps=(
        d1("seq", [1024, 2048, 8192, 16384], FIXED, "sequence length (batch 4, 40 q / 8 kv heads, head dim 128: Llama 4)"),
        d2(lambda m: {"batch": BATCH, "seq": SEQ, "q_heads": m.num_heads, "kv_heads": m.num_kv_heads,
                      "head_dim": m.head_dim}),
    ),
    bytes_moved=bytes_moved,
    memory_estimate=memory_estimate,
    probe={"batch": 1, "seq": 128, "q_heads": 8, "kv_heads": 2, "head_dim": 128},
    config="q/k = proj.view(B, S, H, D), freqs_cis complex64 (1, S, D/2); onca overwrite_inputs=True, "
           "overwrite_grad_output=True; liger rotates in place",
)
