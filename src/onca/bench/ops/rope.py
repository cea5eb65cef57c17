"""RoPE benchmark: q and k rotated together, in the layout Hugging Face attention produces.

q/k are ``proj(x).view(batch, seq, heads, head_dim).transpose(1, 2)`` (strided views, as in the
Llama/Qwen/Mistral attention modules), cos/sin are ``(1, seq, rotary_dim)`` tables as
``LlamaRotaryEmbedding`` returns them in the model's dtype.
"""

from __future__ import annotations

import torch

from onca.bench.spec import OpBenchmark, d1, d2, itemsize

BATCH = 4
SEQ = 2048
THETA = 10000.0


def _dims(p):
    return (p["batch"], p["seq"], p["q_heads"], p["kv_heads"], p["head_dim"],
            p.get("rotary_dim") or p["head_dim"])


def rotary_tables(seq, rotary_dim, dtype, device):
    """cos/sin of shape (1, seq, rotary_dim), as transformers' LlamaRotaryEmbedding computes them."""
    inv_freq = 1.0 / (THETA ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=device) / rotary_dim))
    freqs = torch.arange(seq, dtype=torch.float32, device=device)[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)[None]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def make_inputs(p, dtype, device):
    b, s, hq, hk, d, r = _dims(p)
    q = torch.randn(b, s, hq, d, dtype=dtype, device=device).transpose(1, 2).requires_grad_(True)
    k = torch.randn(b, s, hk, d, dtype=dtype, device=device).transpose(1, 2).requires_grad_(True)
    cos, sin = rotary_tables(s, r, dtype, device)
    return {"q": q, "k": k, "cos": cos, "sin": sin}


def onca(p, inputs):
    from onca.functional import rotary_pos_emb

    # q/k rotated in place and dq/dk written over the incoming gradients, as liger-kernel does.
    return lambda: rotary_pos_emb(inputs["q"], inputs["k"], inputs["cos"], inputs["sin"],
                                  overwrite_grad_output=True, overwrite_inputs=True)


def reference(p, inputs):
    d, r = _dims(p)[4:]
    if r == d:
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
    else:  # partial rotary: the Phi-3 function slices, rotates and concatenates
        from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb

    return lambda: apply_rotary_pos_emb(inputs["q"], inputs["k"], inputs["cos"], inputs["sin"])


def liger(p, inputs):
    from liger_kernel.transformers.rope import liger_rotary_pos_emb

    # Rotates q and k (and, in backward, the incoming gradients) in place.
    return lambda: liger_rotary_pos_emb(inputs["q"], inputs["k"], inputs["cos"], inputs["sin"])


def _qk_bytes(p, dtype):
    b, s, hq, hk, d, _ = _dims(p)
    return b * s * (hq + hk) * d * itemsize(dtype)


def _cs_bytes(p, dtype):
    _, s, _, _, _, r = _dims(p)
    return 2 * s * r * itemsize(dtype)


def bytes_moved(p, dtype, mode):
    # Each direction reads q and k (or their gradients) and cos/sin once and writes q and k once.
    one = 2 * _qk_bytes(p, dtype) + _cs_bytes(p, dtype)
    return {"forward": one, "backward": one, "full": 2 * one}[mode]


# Peak bytes in units of q+k, inputs included (q and k; outputs; incoming gradients; dq and dk).
_QK_UNITS = {
    # q/k rotated in place (overwrite_inputs), dq/dk written over the incoming gradients
    # (overwrite_grad_output), as liger's
    "onca": {"forward": 1, "backward": 2, "full": 2},
    # q/k rotated in place (outputs are views of the inputs), and so are the gradients
    "liger": {"forward": 1, "backward": 2, "full": 2},
    # q * cos, rotate_half (a negated half and a cat), its product with sin, the sum; the backward
    # mirrors it with the gradient
    "torch": {"forward": 4, "backward": 6, "full": 6},
    "torch_compile": {"forward": 2, "backward": 4, "full": 4},
}


def memory_estimate(p, dtype, provider, mode):
    return _QK_UNITS[provider][mode] * _qk_bytes(p, dtype) + _cs_bytes(p, dtype) + (1 << 20)


FIXED = {"batch": BATCH, "seq": SEQ, "q_heads": 32, "kv_heads": 8, "head_dim": 128}

BENCHMARK = OpBenchmark(
    name="rope",
    make_inputs=make_inputs,
    onca=onca,
    reference=reference,
    liger=liger,
    sweeps=(
        d1("seq", [1024, 2048, 8192, 16384], FIXED, "sequence length (batch 4, 32 q / 8 kv heads, head dim 128)"),
        d1("head_dim", [64, 96, 128, 256], FIXED, "head dim (batch 4, seq 2048, 32 q / 8 kv heads)"),
        d2(lambda m: {"batch": BATCH, "seq": SEQ, "q_heads": m.num_heads, "kv_heads": m.num_kv_heads,
                      "head_dim": m.head_dim, "rotary_dim": m.rotary_dim}),
    ),
    bytes_moved=bytes_moved,
    memory_estimate=memory_estimate,
    probe={"batch": 1, "seq": 128, "q_heads": 8, "kv_heads": 2, "head_dim": 128},
    config="q/k = proj.view(B, S, H, D).transpose(1, 2), cos/sin (1, S, rotary_dim); "
           "onca overwrite_inputs=True, overwrite_grad_output=True; liger rotates in place",
)
