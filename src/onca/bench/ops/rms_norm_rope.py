"""Per-head RMSNorm + RoPE benchmark: the q/k path of a Qwen3 attention layer.

q and k arrive as ``proj(x).view(batch, seq, heads, head_dim)`` (contiguous), each is normalised
per head by its own weight (``Qwen3RMSNorm``: llama casting), transposed to ``(batch, heads, seq,
head_dim)`` and rotated by ``(1, seq, head_dim)`` cos/sin tables in the model's dtype. Onca runs its
fused op (q and k in one launch); torch runs transformers' modules' arithmetic and ``apply_rotary_pos_emb``
(``torch_compile`` compiles that); liger-kernel, which has no fused op, runs its RMSNorm on q and k
and its RoPE on both.
"""

from __future__ import annotations

import torch

from onca.bench.ops.rope import rotary_tables
from onca.bench.spec import OpBenchmark, d1, d2, itemsize

EPS = 1e-6
BATCH = 4
SEQ = 2048


def _dims(p):
    return p["batch"], p["seq"], p["q_heads"], p["kv_heads"], p["head_dim"]


def make_inputs(p, dtype, device):
    b, s, hq, hk, d = _dims(p)
    q = torch.randn(b, s, hq, d, dtype=dtype, device=device, requires_grad=True)
    k = torch.randn(b, s, hk, d, dtype=dtype, device=device, requires_grad=True)
    wq = (torch.rand(d, dtype=torch.float32, device=device) + 0.5).to(dtype).requires_grad_(True)
    wk = (torch.rand(d, dtype=torch.float32, device=device) + 0.5).to(dtype).requires_grad_(True)
    cos, sin = rotary_tables(s, d, dtype, device)
    return {"q": q, "k": k, "wq": wq, "wk": wk, "cos": cos, "sin": sin}


def onca(p, inputs):
    from onca.ops.rms_norm_rope import rms_norm_rope

    # dq/dk written over the incoming gradients, as liger-kernel's in-place backward does.
    def run():
        q, k = rms_norm_rope(inputs["q"], inputs["k"], inputs["wq"], inputs["wk"], inputs["cos"],
                             inputs["sin"], EPS, overwrite_grad_output=True)
        return q.transpose(1, 2), k.transpose(1, 2)

    return run


def _qwen3_rms_norm(x, w):  # transformers' Qwen3RMSNorm.forward
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)
    return w * h.to(x.dtype)


def reference(p, inputs):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    def run():
        q = _qwen3_rms_norm(inputs["q"], inputs["wq"]).transpose(1, 2)
        k = _qwen3_rms_norm(inputs["k"], inputs["wk"]).transpose(1, 2)
        return apply_rotary_pos_emb(q, k, inputs["cos"], inputs["sin"])

    return run


def liger(p, inputs):
    from liger_kernel.ops.rms_norm import LigerRMSNormFunction
    from liger_kernel.transformers.rope import liger_rotary_pos_emb

    def run():
        q = LigerRMSNormFunction.apply(inputs["q"], inputs["wq"], EPS, 0.0, "llama", True).transpose(1, 2)
        k = LigerRMSNormFunction.apply(inputs["k"], inputs["wk"], EPS, 0.0, "llama", True).transpose(1, 2)
        return liger_rotary_pos_emb(q, k, inputs["cos"], inputs["sin"])

    return run


def _qk_bytes(p, dtype):
    b, s, hq, hk, d = _dims(p)
    return b * s * (hq + hk) * d * itemsize(dtype)


def bytes_moved(p, dtype, mode):
    # The fused minimum: each direction reads the heads (forward: q, k; backward: their gradients
    # and q, k again) and the tables, and writes the heads once.
    tables = 2 * p["seq"] * p["head_dim"] * itemsize(dtype)
    forward = 2 * _qk_bytes(p, dtype) + tables
    backward = 3 * _qk_bytes(p, dtype) + tables
    return {"forward": forward, "backward": backward, "full": forward + backward}[mode]


# Peak bytes in units of q+k, inputs included.
_QK_UNITS = {
    # inputs (saved), outputs; backward: the incoming gradients, dq/dk written over them
    "onca": {"forward": 2, "backward": 3, "full": 3},
    # inputs (saved), the norms' outputs (rotated in place); the gradients rotated in place, dq/dk
    "liger": {"forward": 2, "backward": 3, "full": 3},
    # the fp32 upcast, normalised rows and their casts; the rotation's temporaries
    "torch": {"forward": 9, "backward": 12, "full": 12},
    "torch_compile": {"forward": 3, "backward": 5, "full": 5},
}


def memory_estimate(p, dtype, provider, mode):
    tables = 2 * p["seq"] * p["head_dim"] * itemsize(dtype)
    return _QK_UNITS[provider][mode] * _qk_bytes(p, dtype) + tables + (1 << 20)


FIXED = {"batch": BATCH, "seq": SEQ, "q_heads": 16, "kv_heads": 8, "head_dim": 128}

BENCHMARK = OpBenchmark(
    name="rms_norm_rope",
    make_inputs=make_inputs,
    onca=onca,
    reference=reference,
    liger=liger,
    sweeps=(
        d1("seq", [1024, 2048, 4096, 8192, 16384], FIXED,
           "sequence length (batch 4, 16 q / 8 kv heads, head dim 128)"),
        d2(lambda m: None if m.rotary_dim != m.head_dim else {
            "batch": BATCH, "seq": SEQ, "q_heads": m.num_heads, "kv_heads": m.num_kv_heads,
            "head_dim": m.head_dim}),
    ),
    bytes_moved=bytes_moved,
    memory_estimate=memory_estimate,
    probe={"batch": 1, "seq": 128, "q_heads": 8, "kv_heads": 2, "head_dim": 128},
    config="q/k = proj.view(B, S, H, D), per-head Qwen3 RMSNorm (llama casting), then RoPE with (1, S, D) "
           "cos/sin; onca overwrite_grad_output=True; liger: its RMSNorm (in place backward) and its "
           "in-place RoPE",
)
