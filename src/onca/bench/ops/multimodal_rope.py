"""Multimodal RoPE benchmark (Qwen2-VL / Qwen2.5-VL M-RoPE): q and k rotated with per-stream tables.

q/k are ``proj(x).view(batch, seq, heads, head_dim).transpose(1, 2)`` (strided views, as in the
Qwen2-VL attention module); cos/sin are ``(3, batch, seq, head_dim)`` tables, one per position
stream, in the model's dtype. The reference assembles the per-column table from the sections
(transformers' ``split``/``cat``) and applies transformers' ``apply_rotary_pos_emb``.
"""

from __future__ import annotations

import torch

from onca.bench.spec import OpBenchmark, d1, d2, itemsize

BATCH = 4
SEQ = 2048
THETA = 1000000.0


def _section(head_dim):
    """Qwen2-VL's (16, 24, 24) at head_dim 128, scaled to other head dims."""
    half = head_dim // 2
    t = half // 4
    h = (half - t) // 2
    return (t, h, half - t - h)


def _dims(p):
    return p["batch"], p["seq"], p["q_heads"], p["kv_heads"], p["head_dim"]


def make_inputs(p, dtype, device):
    b, s, hq, hk, d = _dims(p)
    q = torch.randn(b, s, hq, d, dtype=dtype, device=device).transpose(1, 2).requires_grad_(True)
    k = torch.randn(b, s, hk, d, dtype=dtype, device=device).transpose(1, 2).requires_grad_(True)
    inv_freq = 1.0 / (THETA ** (torch.arange(0, d, 2, dtype=torch.float32, device=device) / d))
    pos = torch.arange(s, dtype=torch.float32, device=device).expand(3, b, s).clone()
    pos[1:] = pos[1:] // 4  # image-like height/width positions
    freqs = pos[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return {"q": q, "k": k, "cos": emb.cos().to(dtype), "sin": emb.sin().to(dtype)}


def onca(p, inputs):
    from onca.functional import multimodal_rope

    sec = _section(p["head_dim"])
    # q/k rotated in place and dq/dk written over the incoming gradients, as liger-kernel does.
    return lambda: multimodal_rope(inputs["q"], inputs["k"], inputs["cos"], inputs["sin"], sec,
                                   overwrite_grad_output=True, overwrite_inputs=True)


def reference(p, inputs):
    from transformers.models.qwen2_vl.modeling_qwen2_vl import apply_rotary_pos_emb

    sec = list(_section(p["head_dim"])) * 2

    def run():
        cos = torch.cat([m[i % 3] for i, m in enumerate(inputs["cos"].split(sec, dim=-1))], dim=-1)
        sin = torch.cat([m[i % 3] for i, m in enumerate(inputs["sin"].split(sec, dim=-1))], dim=-1)
        return apply_rotary_pos_emb(inputs["q"], inputs["k"], cos, sin)

    return run


def liger(p, inputs):
    from liger_kernel.transformers.qwen2vl_mrope import liger_multimodal_rotary_pos_emb

    sec = list(_section(p["head_dim"]))
    return lambda: liger_multimodal_rotary_pos_emb(inputs["q"], inputs["k"], inputs["cos"], inputs["sin"], sec)


def _qk_bytes(p, dtype):
    b, s, hq, hk, d = _dims(p)
    return b * s * (hq + hk) * d * itemsize(dtype)


def _cs_bytes(p, dtype):
    b, s, _, _, d = _dims(p)
    return 2 * 3 * b * s * d * itemsize(dtype)


def bytes_moved(p, dtype, mode):
    # Each direction reads q and k (or their gradients) and the used third of the tables once
    # and writes q and k once.
    one = 2 * _qk_bytes(p, dtype) + _cs_bytes(p, dtype) // 3
    return {"forward": one, "backward": one, "full": 2 * one}[mode]


# Peak bytes in units of q+k (see rope's benchmark) plus the tables; the reference also holds the
# assembled tables.
_QK_UNITS = {
    "onca": {"forward": 1, "backward": 2, "full": 2},
    "liger": {"forward": 1, "backward": 2, "full": 2},
    "torch": {"forward": 4, "backward": 6, "full": 6},
    "torch_compile": {"forward": 2, "backward": 4, "full": 4},
}


def memory_estimate(p, dtype, provider, mode):
    return _QK_UNITS[provider][mode] * _qk_bytes(p, dtype) + 2 * _cs_bytes(p, dtype) + (1 << 20)


FIXED = {"batch": BATCH, "seq": SEQ, "q_heads": 28, "kv_heads": 4, "head_dim": 128}

BENCHMARK = OpBenchmark(
    name="multimodal_rope",
    make_inputs=make_inputs,
    onca=onca,
    reference=reference,
    liger=liger,
    sweeps=(
        d1("seq", [1024, 2048, 8192, 16384], FIXED, "sequence length (batch 4, 28 q / 4 kv heads, head dim 128)"),
        d2(lambda m: {"batch": BATCH, "seq": SEQ, "q_heads": m.num_heads, "kv_heads": m.num_kv_heads,
                      "head_dim": m.head_dim} if m.rotary_dim == m.head_dim else None),
    ),
    bytes_moved=bytes_moved,
    memory_estimate=memory_estimate,
    probe={"batch": 1, "seq": 128, "q_heads": 8, "kv_heads": 2, "head_dim": 128},
    config="Qwen2-VL M-RoPE, sections (16, 24, 24) at head dim 128; q/k = proj.view(B, S, H, D)"
           ".transpose(1, 2), cos/sin (3, B, S, D); onca overwrite_inputs=True, overwrite_grad_output=True; "
           "liger in place",
)
