"""Attention residuals benchmark: ``V`` of shape ``[N, B, T, D]``, ``w_query`` and ``w_norm`` of ``[D]``.

The reference is the formula in plain PyTorch, in fp32 as Onca computes it (rms_norm of each source,
the scores by einsum, softmax over N, the weighted sum by einsum), timed eager and compiled. The
liger provider is ``liger_kernel.ops.attn_res.LigerAttnResFunction`` (same arguments; it rounds the
normalised keys to the weight dtype before the score, which only moves the scores by that rounding).
"""

from __future__ import annotations

import torch

from onca.bench.spec import OpBenchmark, d1, d2, itemsize

EPS = 1e-6
N_SOURCES = 8
SEQ = 4096


def make_inputs(p, dtype, device):
    n, b, t, d = p["n"], p["batch"], p["seq"], p["hidden"]
    v = torch.randn(n, b, t, d, dtype=dtype, device=device, requires_grad=True)
    w_query = (0.02 * torch.randn(d, device=device)).to(dtype).requires_grad_(True)
    w_norm = (1.0 + 0.1 * torch.randn(d, device=device)).to(dtype).requires_grad_(True)
    return {"V": v, "w_query": w_query, "w_norm": w_norm}


def onca(p, inputs):
    from onca.ops.attn_res import attn_res

    return lambda: attn_res(inputs["V"], inputs["w_query"], inputs["w_norm"], EPS)


def attn_res_reference(v, w_query, w_norm, eps=EPS):
    """The formula in plain PyTorch, computed in fp32 (the result in V's dtype)."""
    x = v.float()
    k = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w_norm.float()
    scores = torch.einsum("d,nbtd->nbt", w_query.float(), k)
    alpha = torch.softmax(scores, dim=0)
    return torch.einsum("nbt,nbtd->btd", alpha, x).to(v.dtype)


def reference(p, inputs):
    return lambda: attn_res_reference(inputs["V"], inputs["w_query"], inputs["w_norm"])


def liger(p, inputs):
    from liger_kernel.ops.attn_res import LigerAttnResFunction

    return lambda: LigerAttnResFunction.apply(inputs["V"], inputs["w_query"], inputs["w_norm"], EPS)


def bytes_moved(p, dtype, mode):
    n, d, b = p["n"], p["hidden"], itemsize(dtype)
    rows = p["batch"] * p["seq"]
    forward = (n + 1) * rows * d * b + 2 * d * b  # read V and the weights, write h
    backward = (2 * n + 1) * rows * d * b + 4 * d * b  # read V, dh and the weights; write dV, dw
    return {"forward": forward, "backward": backward, "full": forward + backward}[mode]


def memory_estimate(p, dtype, provider, mode):
    n, d, b = p["n"], p["hidden"], itemsize(dtype)
    rows = p["batch"] * p["seq"]
    v_elems, h_elems = n * rows * d, rows * d
    if provider in ("onca", "liger"):
        # V, h; backward adds dh and dV, plus [rows, N] fp32 statistics (liger) and per-program
        # partial rows of the weight gradients.
        base = v_elems * b + h_elems * b + 8 * rows * n + 2 * 132 * d * 4
        return base if mode == "forward" else base + h_elems * b + v_elems * b
    if provider == "torch":
        # Saved fp32 tensors of V's size: the upcast, the normalised values and the keys (and a
        # transient square); backward holds about three fp32 gradients of V's size at once.
        fwd = v_elems * (b + 16) + h_elems * (4 + b)
        return fwd if mode == "forward" else fwd + v_elems * (12 + b) + h_elems * b
    # torch_compile: recomputes in its backward; one fp32 buffer of V's size at most.
    fwd = v_elems * b + h_elems * b + 8 * rows * n
    return fwd if mode == "forward" else fwd + v_elems * (b + 4) + h_elems * b


BENCHMARK = OpBenchmark(
    name="attn_res",
    make_inputs=make_inputs,
    onca=onca,
    reference=reference,
    liger=liger,
    sweeps=(
        d1("seq", [1024, 2048, 4096, 8192], {"n": N_SOURCES, "batch": 1, "hidden": 4096},
           f"sequence length (N={N_SOURCES}, B=1, D=4096)"),
        d2(lambda m: {"n": N_SOURCES, "batch": 1, "seq": SEQ, "hidden": m.hidden_size}),
    ),
    bytes_moved=bytes_moved,
    memory_estimate=memory_estimate,
    probe={"n": 4, "batch": 1, "seq": 64, "hidden": 256},
    config=f"N={N_SOURCES} sources, eps={EPS}; the reference computes in fp32; D2: B=1, T={SEQ}",
)
