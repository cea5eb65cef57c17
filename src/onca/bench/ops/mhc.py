"""mHC benchmark: one layer wrapped in manifold-constrained hyper-connections over a widened stream
``(tokens, hc, c)``: coefficients (projection, sigmoids, Sinkhorn), mix-down, the layer (here
``silu``, elementwise, so that the hyper-connection's own cost dominates), mix-back.

Providers: Onca's ``mhc``; the plain PyTorch composition (liger-kernel's test reference); liger's
``liger_mhc_forward``. ``tmax=20`` Sinkhorn iterations (liger's default).
"""

from __future__ import annotations

import torch

from onca.bench.spec import OpBenchmark, d1, d2, itemsize

TOKENS = 8192
HC = 4
CFG = dict(tmax=20, rms_eps=1e-6, pre_eps=0.0, sinkhorn_eps=1e-6, post_mult=2.0)


def make_inputs(p, dtype, device):
    t, hc, c = p["tokens"], p["hc"], p["c"]
    m = hc * hc + 2 * hc
    x = torch.randn(t, hc, c, dtype=dtype, device=device, requires_grad=True)
    phi = (torch.randn(hc * c, m, device=device) * 0.02).requires_grad_(True)
    b = torch.zeros(m, device=device, requires_grad=True)
    alphas = {f"alpha_{k}": torch.ones((), device=device, requires_grad=True) for k in ("pre", "post", "res")}
    return {"x": x, "phi": phi, "b": b, **alphas}


def _args(inputs):
    return (inputs["phi"], inputs["b"], inputs["alpha_pre"], inputs["alpha_post"], inputs["alpha_res"])


def layer(t):
    return torch.nn.functional.silu(t)


def onca(p, inputs):
    from onca.ops.mhc import mhc

    return lambda: mhc(inputs["x"], layer, *_args(inputs), **CFG)


def reference(p, inputs):
    def torch_mhc(x, phi, b, a_pre, a_post, a_res):
        hc, c = x.shape[-2:]
        xm = x.reshape(-1, hc * c).float()
        mix = (xm @ phi) * torch.rsqrt(xm.square().mean(-1, keepdim=True) + CFG["rms_eps"])
        h_pre = torch.sigmoid(mix[:, :hc] * a_pre + b[:hc]) + CFG["pre_eps"]
        h_post = torch.sigmoid(mix[:, hc:2 * hc] * a_post + b[hc:2 * hc]) * CFG["post_mult"]
        eps = CFG["sinkhorn_eps"]
        mat = torch.softmax(mix[:, 2 * hc:].reshape(-1, hc, hc) * a_res + b[2 * hc:].reshape(hc, hc), -1) + eps
        mat = mat / (mat.sum(-2, keepdim=True) + eps)
        for _ in range(CFG["tmax"] - 1):
            mat = mat / (mat.sum(-1, keepdim=True) + eps)
            mat = mat / (mat.sum(-2, keepdim=True) + eps)
        x_in = (x.float() * h_pre[..., None]).sum(-2).to(x.dtype)
        f = layer(x_in)
        out = torch.einsum("nij,njc->nic", mat, x.float()) + h_post[..., None] * f.float()[:, None, :]
        return out.to(x.dtype)

    return lambda: torch_mhc(inputs["x"], *_args(inputs))


def liger(p, inputs):
    from liger_kernel.transformers.functional import liger_mhc_forward

    allow_fp32 = inputs["x"].dtype == torch.float32
    return lambda: liger_mhc_forward(inputs["x"], layer, *_args(inputs), allow_fp32=allow_fp32, **CFG)


def bytes_moved(p, dtype, mode):
    t, hc, c = p["tokens"], p["hc"], p["c"]
    b = itemsize(dtype)
    stream = t * hc * c * b
    # coefficients read x; pre reads x, writes x_in; post_res reads x and f, writes x_out.
    forward = 3 * stream + 3 * t * c * b + 4 * hc * c * (hc * hc + 2 * hc)
    backward = 2 * forward
    return {"forward": forward, "backward": backward, "full": forward + backward}[mode]


# Peak (tokens x hc x c) tensors beyond the input x (fp32 ones count double).
_PEAK = {
    "onca": {"forward": 1.5, "backward": 4, "full": 4},
    "liger": {"forward": 1.5, "backward": 4, "full": 4},
    "torch": {"forward": 8, "backward": 14, "full": 14},
    "torch_compile": {"forward": 2, "backward": 5, "full": 5},
}


def memory_estimate(p, dtype, provider, mode):
    t, hc, c = p["tokens"], p["hc"], p["c"]
    stream = t * hc * c * itemsize(dtype)
    m = hc * hc + 2 * hc
    return int(stream * (1 + _PEAK[provider][mode])) + 8 * hc * c * m + 4 * t * m * 2 * CFG["tmax"]


BENCHMARK = OpBenchmark(
    name="mhc",
    make_inputs=make_inputs,
    onca=onca,
    reference=reference,
    liger=liger,
    sweeps=(
        d1("tokens", [1024, 2048, 4096, 8192, 16384], {"hc": HC, "c": 4096}, f"tokens (hc {HC}, c 4096)"),
        d1("c", [1024, 2048, 4096, 8192], {"tokens": TOKENS, "hc": HC}, f"stream width c ({TOKENS} tokens, hc {HC})"),
        d2(lambda m: {"tokens": TOKENS, "hc": HC, "c": m.hidden_size}),
    ),
    bytes_moved=bytes_moved,
    memory_estimate=memory_estimate,
    probe={"tokens": 64, "hc": HC, "c": 64},
    config=f"hc={HC}, tmax=20, layer=silu, phi/b/alphas fp32",
)
