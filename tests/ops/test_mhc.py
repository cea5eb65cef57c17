"""mHC (manifold-constrained hyper-connections) forward and backward against a float64 reference
of liger-kernel's semantics: the coefficients (RMS-normalised projection, sigmoids, Sinkhorn), the
mix-down ``mhc_pre`` and the mix-back ``mhc_post_res``."""

from __future__ import annotations

import pytest
import torch

from onca.ops import mhc as op
from onca.ops.mhc import mhc, mhc_coeffs, mhc_post_res, mhc_pre
from tests.contract import assert_op_contract
from tests.helpers import SCALE, assert_close, randn, rounded, tolerance

# (batch, seq, HC, C)
BASE = {"cpu": (2, 3, 4, 40), "gpu": (4, 2048, 4, 2048)}[SCALE]
CFG = dict(tmax=8, rms_eps=1e-6, pre_eps=1e-4, sinkhorn_eps=1e-6, post_mult=2.0)


def coeff_params(hc, c, device, std=0.05):
    m = hc * hc + 2 * hc
    phi = randn(hc * c, m, device=device, std=std)
    b = randn(m, device=device, std=0.1)
    alphas = [torch.tensor(v, device=device) for v in (0.9, 1.1, 1.3)]
    return [phi, b, *alphas]


def ref_coeffs(x, phi, b, a_pre, a_post, a_res, tmax, rms_eps, pre_eps, sinkhorn_eps, post_mult):
    hc, c = x.shape[-2:]
    xm = x.reshape(-1, hc * c)
    mix = (xm @ phi) * torch.rsqrt(xm.square().mean(-1, keepdim=True) + rms_eps)
    # An alpha is a scalar or one value per token (the check's reference, to see each token's share)
    h_pre = torch.sigmoid(mix[:, :hc] * a_pre.reshape(-1, 1) + b[:hc]) + pre_eps
    h_post = torch.sigmoid(mix[:, hc:2 * hc] * a_post.reshape(-1, 1) + b[hc:2 * hc]) * post_mult
    mat = torch.softmax(mix[:, 2 * hc:].reshape(-1, hc, hc) * a_res.reshape(-1, 1, 1) + b[2 * hc:].reshape(hc, hc),
                        -1) + sinkhorn_eps
    mat = mat / (mat.sum(-2, keepdim=True) + sinkhorn_eps)
    for _ in range(tmax - 1):
        mat = mat / (mat.sum(-1, keepdim=True) + sinkhorn_eps)
        mat = mat / (mat.sum(-2, keepdim=True) + sinkhorn_eps)
    lead = x.shape[:-2]
    return h_pre.view(*lead, hc), h_post.view(*lead, hc), mat.view(*lead, hc, hc)


def layer(t):
    return torch.tanh(t) * 1.5


def check(x, params, **cfg):
    cfg = {**CFG, **cfg}
    mine = [t.detach().clone().requires_grad_(True) for t in (x, *params)]
    out, coeffs = mhc(mine[0], layer, *mine[1:], return_coeffs=True, **cfg)
    tokens = x[..., 0, 0].numel()
    theirs = [t.detach().to(torch.float64) for t in (x, *params)]
    theirs[3:] = [a.expand(tokens).clone() for a in theirs[3:]]  # per-token alphas: see assert_sum_close
    theirs = [t.requires_grad_(True) for t in theirs]
    r_coeffs = ref_coeffs(*theirs, **cfg)
    h_pre, h_post, h_res = r_coeffs
    x64 = theirs[0]
    x_in = rounded((x64 * h_pre[..., None]).sum(-2), x.dtype)
    f = layer(x_in)
    r_out = rounded(torch.einsum("...ij,...jc->...ic", h_res, x64) + h_post[..., None] * rounded(f, x.dtype)[..., None, :],
                    x.dtype)
    assert out.dtype == x.dtype and out.shape == x.shape
    for name, a, e in zip(("h_pre", "h_post", "h_res"), coeffs, r_coeffs):
        # fp32 from the stream's exact values whatever its dtype: the projection's matmul must
        # not round x or phi to bf16 (its split products keep about 16 bits of each).
        assert a.dtype == torch.float32
        assert_close(a, e, torch.float32, name)
    assert_close(out, r_out, x.dtype, "x_out")
    dout = randn(*x.shape, dtype=x.dtype, device=x.device)
    out.backward(dout)
    r_out.backward(dout.to(torch.float64))
    for name, a, e in zip(("dx", "dphi", "db"), mine, theirs):
        assert a.grad.dtype == a.dtype
        assert_close(a.grad, e.grad, x.dtype, name)
    for name, a, e in zip(("d_alpha_pre", "d_alpha_post", "d_alpha_res"), mine[3:], theirs[3:]):
        assert a.grad.dtype == a.dtype
        assert_sum_close(a.grad, e.grad, x.dtype, name)


def assert_sum_close(actual, shares, dtype, name):
    """A scalar gradient against the sum of its per-token ``shares`` (float64).

    The shares have random signs and cancel: at 8192 tokens the sum is a few thousandths of their
    total size, so a relative tolerance on the sum alone judges rounding noise, not the kernel. Each
    token's share carries its own rounding (the reductions over ``C`` behind it), independent from
    token to token: the error floor is the dtype's atol times the shares' norm, as in
    ``assert_close``'s norm check. A wrong term in the tokens' shares (a missed factor, a wrong
    column) moves the sum by about the shares' norm times its size, far above that floor; a bug that
    scales every share alike hides in the cancellation, but the same per-token terms feed ``dphi``
    and ``db``, checked element-wise above."""
    rtol, atol, _ = tolerance(dtype)
    expected = shares.sum()
    err = (actual.double() - expected).abs().item()
    allowed = rtol * expected.abs().item() + atol * shares.norm().item()
    assert err <= allowed, f"{name}: {actual.item():.9g} vs {expected.item():.9g}, error {err:.3g} > {allowed:.3g}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_matches_reference(profile, device, dtype):
    b, t, hc, c = BASE
    check(randn(b, t, hc, c, dtype=dtype, device=device), coeff_params(hc, c, device))


def test_transposed_phi(device):
    """``phi`` as the transpose of an ``(M, HC*C)`` parameter (the layout of a Linear's weight), and
    a strided ``b``: the kernels read both at unit stride, so they are copied first (the kernels
    read the wrong entries of them as they were)."""
    x = randn(5, 4, 24, device=device)
    phi, *rest = coeff_params(4, 24, device)
    transposed = phi.t().contiguous().t()
    assert not transposed.is_contiguous()
    check(x, [transposed, *rest])
    b = rest[0]
    wide = torch.zeros(2 * b.shape[0], device=device)
    wide[::2] = b
    for got, want in zip(mhc_coeffs(x, phi, wide[::2], *rest[1:]), mhc_coeffs(x, phi, b, *rest[1:])):
        assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_projection_backward_keeps_fp32_operands_exact(device, dtype):
    """The projection's backward multiplies fp32 ``d_proj`` and ``phi`` as split bf16 parts: ``dx
    = d_proj @ phi.T - rms_coef * x`` where the two terms cancel to a few bf16 ulps (a single bf16
    product would be wrong by as much as the result), and ``dphi = x.T @ d_proj`` at fp32's
    tolerance."""
    n, hc, c = 37, 4, 40 if SCALE == "cpu" else 1000
    m = hc * hc + 2 * hc
    phi, d_proj = randn(hc * c, m, device=device), randn(n, m, device=device)
    rms_coef = torch.rand(n, device=device) + 0.5
    product = d_proj.double() @ phi.double().t()
    x = (product / rms_coef.double()[:, None]).to(dtype).view(n, hc, c)  # cancels up to x's rounding
    dx, dphi = op._project_backward(x, phi, d_proj, rms_coef)
    x64 = x.double().view(n, hc * c)
    expected_dx = product - rms_coef.double()[:, None] * x64
    assert_close(dx.view(n, hc * c), rounded(expected_dx, dtype), dtype, "dx")
    assert_close(dphi, x64.t() @ d_proj.double(), torch.float32, "dphi")


def test_column_tiled_path_and_odd_streams(device, onchip_bytes):
    """Three streams (not a power of two) and a width that an 8 KiB budget splits into column tiles;
    the projection splits the stream's columns over several programs (few tokens), in both dtypes'
    matmul paths."""
    forced = onchip_bytes(8192)
    c = 200 if SCALE == "cpu" else 8192
    plans = op.plan((5, 3, c), torch.float32, forced)
    assert plans["pre"].col_tiles > 1 and plans["post_res"].col_tiles > 1
    for dtype in (torch.float32, torch.bfloat16):
        assert op._projection_splits(5, 3 * c, op.plan((5, 3, c), dtype, forced)["projection"], forced) > 1
        check(randn(5, 3, c, dtype=dtype, device=device), coeff_params(3, c, device), tmax=3)


@pytest.mark.parametrize("hc,tmax,sinkhorn_eps", [(1, 1, 1e-6), (3, 2, 1e-6), (4, 20, 1e-6), (5, 5, 1e-6),
                                                  (5, 4, 0.0)])
def test_sinkhorn_depths_and_stream_counts(device, hc, tmax, sinkhorn_eps):
    """The coefficient kernels walk the Sinkhorn loop back from its last iterate: one iterate, the
    default twenty, a single stream and stream counts that pad their HC x HC block (with no
    epsilon too: a padding row sums to zero); 7 tokens (not a whole block of them)."""
    c = 24 if SCALE == "cpu" else 512
    check(randn(1, 7, hc, c, device=device), coeff_params(hc, c, device, std=0.2), tmax=tmax,
          sinkhorn_eps=sinkhorn_eps)


def test_pre_and_post_res_alone(device):
    """The mixing ops on their own, with coefficients from outside (liger-kernel's test's form)."""
    b, t, hc, c = BASE
    x = randn(b, t, hc, c, dtype=torch.bfloat16, device=device)
    hp, hpo = torch.rand(b, t, hc, device=device), torch.rand(b, t, hc, device=device)
    hr, f = torch.rand(b, t, hc, hc, device=device), randn(b, t, c, dtype=torch.bfloat16, device=device)
    mine = [v.clone().requires_grad_(True) for v in (x, hp, hpo, hr, f)]
    theirs = [v.to(torch.float64).requires_grad_(True) for v in (x, hp, hpo, hr, f)]
    outs = (mhc_pre(mine[0], mine[1]), mhc_post_res(mine[0], mine[4], mine[2], mine[3]))
    x64, hp64, hpo64, hr64, f64 = theirs
    refs = (rounded((x64 * hp64[..., None]).sum(-2), x.dtype),
            rounded(torch.einsum("...ij,...jc->...ic", hr64, x64) + hpo64[..., None] * f64[..., None, :], x.dtype))
    seeds = [randn(*o.shape, dtype=o.dtype, device=device) for o in outs]
    for o, r, s in zip(outs, refs, seeds):
        assert_close(o, r, x.dtype)
        o.backward(s)
        r.backward(s.to(torch.float64))
    for name, a, e in zip(("dx", "dh_pre", "dh_post", "dh_res", "df"), mine, theirs):
        assert a.grad.dtype == a.dtype
        assert_close(a.grad, e.grad, torch.bfloat16, name)


def test_zero_tokens(device):
    x = torch.zeros(0, 4, 16, device=device, requires_grad=True)
    params = [p.requires_grad_(True) for p in coeff_params(4, 16, device)]
    out = mhc(x, layer, *params, tmax=2)
    assert out.shape == x.shape
    out.sum().backward()
    assert x.grad.shape == x.shape and (params[0].grad == 0).all()


def test_bad_input(device):
    x = randn(2, 4, 16, device=device)
    phi, b, a1, a2, a3 = coeff_params(4, 16, device)
    with pytest.raises(ValueError, match="x must be"):
        mhc_coeffs(randn(4, 16, device=device), phi, b, a1, a2, a3)
    with pytest.raises(ValueError, match="phi must have shape"):
        mhc_coeffs(x, phi[:-1], b, a1, a2, a3)
    with pytest.raises(ValueError, match="b must have shape"):
        mhc_coeffs(x, phi, b[:-1], a1, a2, a3)
    with pytest.raises(ValueError, match="alpha_res must be a one-element tensor"):
        mhc_coeffs(x, phi, b, a1, a2, randn(2, device=device))
    with pytest.raises(ValueError, match="tmax must be an int"):
        mhc_coeffs(x, phi, b, a1, a2, a3, tmax=0)
    with pytest.raises(ValueError, match="sinkhorn_eps"):
        mhc_coeffs(x, phi, b, a1, a2, a3, sinkhorn_eps=-1.0)
    with pytest.raises(ValueError, match="h_pre must have shape"):
        mhc_pre(x, torch.rand(2, 3, device=device))
    with pytest.raises(ValueError, match="h_res must have shape"):
        mhc_post_res(x, randn(2, 16, device=device), torch.rand(2, 4, device=device), torch.rand(2, 4, device=device))
    with pytest.raises(TypeError, match="x must have a floating dtype"):
        mhc_pre(x.long(), torch.rand(2, 4, device=device))


def test_op_contract(device):
    x = randn(3, 2, 8, device=device, requires_grad=True)
    params = [p.requires_grad_(True) for p in coeff_params(2, 8, device)]
    fn = lambda x, *p: mhc(x, layer, *p, tmax=3)  # noqa: E731
    assert_op_contract(fn, (x, *params), expect_ops=("mhc_coeffs_forward", "mhc_coeffs_backward",
                                                     "mhc_pre_forward", "mhc_pre_backward",
                                                     "mhc_post_res_forward", "mhc_post_res_backward"))
