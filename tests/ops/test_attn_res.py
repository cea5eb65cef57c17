"""Attention residuals forward and backward (V, w_query, w_norm) against the formula in float64."""

from __future__ import annotations

import pytest
import torch

from onca import device as onca_device
from onca.models import MODELS
from onca.ops import attn_res as op
from onca.ops.attn_res import attn_res
from tests.contract import assert_op_contract
from tests.helpers import DTYPES, SCALE, assert_close, leaf, non_contiguous, randn

# V shapes (N, ..., D)
BASE = {"cpu": (5, 2, 7, 300), "gpu": (8, 1, 2048, 4096)}[SCALE]
SHAPES = {
    "cpu": [(1, 1, 1, 64), (3, 1, 5, 1000), (16, 2, 3, 96), (2, 4, 33), (2, 2, 3, 2, 64), (4, 1, 2, 1)],
    "gpu": [(8, 1, 4096, 2048), (16, 2, 256, 8192), (8, 1, 512, 16384), (4, 3, 77, 5376), (1, 1, 1, 4096),
            (8, 2, 1024, 1024)],
}[SCALE]
ASCEND = ("ascend910b2", "ascend910b4", "ascend950")


def reference(v, w_query, w_norm, eps=1e-6):
    """The issue's formula in float64: K = rms_norm(V) * w_norm over D, score = <w_query, K>,
    alpha = softmax over N, h = sum_n alpha * V."""
    v64, wq64, wn64 = (t.detach().to(torch.float64).requires_grad_(True) for t in (v, w_query, w_norm))
    k = v64 * torch.rsqrt(v64.pow(2).mean(-1, keepdim=True) + eps) * wn64
    score = (k * wq64).sum(-1)
    alpha = torch.softmax(score, dim=0)
    h = (alpha.unsqueeze(-1) * v64).sum(0)
    return h, (v64, wq64, wn64)


def reference_scores(v, w_query, w_norm, eps=1e-6):
    """The scores ``<w_query, K>`` in float64, shape ``V.shape[:-1]``."""
    v64 = v.to(torch.float64)
    k = v64 * torch.rsqrt(v64.pow(2).mean(-1, keepdim=True) + eps) * w_norm.to(torch.float64)
    return (k * w_query.to(torch.float64)).sum(-1)


def make(shape, dtype, device, w_dtype=None, query_std=0.3):
    # Layers of different scales, as the outputs of a residual stack are.
    scales = torch.rand(shape[0], *([1] * (len(shape) - 1)), device=device) * 3 + 0.1
    v = (randn(*shape, device=device) * scales).to(dtype)
    w_dtype = w_dtype or dtype
    w_query = randn(shape[-1], dtype=w_dtype, device=device, std=query_std)
    w_norm = (torch.rand(shape[-1], device=device) + 0.5).to(w_dtype)
    return v, w_query, w_norm


def check(v, w_query, w_norm, eps=1e-6, dh=None):
    vk, wqk, wnk = leaf(v), leaf(w_query), leaf(w_norm)
    h = attn_res(vk, wqk, wnk, eps)
    assert h.dtype == v.dtype and h.shape == v.shape[1:]
    ref, leaves = reference(v, w_query, w_norm, eps)
    assert_close(h, ref, v.dtype, "h")
    if dh is None:
        dh = randn(*h.shape, dtype=v.dtype, device=v.device)
    h.backward(dh)
    ref.backward(dh.to(torch.float64))
    for got, want, name in zip((vk, wqk, wnk), leaves, ("dV", "dw_query", "dw_norm")):
        assert got.grad.dtype == got.dtype and got.grad.shape == got.shape
        assert_close(got.grad, want.grad, got.dtype, name)
    return vk.grad, wqk.grad, wnk.grad


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_matches_reference(profile, device, dtype):
    check(*make(BASE, dtype, device))


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_shapes(profile, device, shape, dtype):
    check(*make(shape, dtype, device))


@pytest.mark.parametrize("how", ["rows", "cols"])
def test_non_contiguous_inputs(device, how):
    v, w_query, w_norm = make(BASE, torch.bfloat16, device)
    dh = non_contiguous(randn(*BASE[1:], dtype=torch.bfloat16, device=device), how)
    check(non_contiguous(v, how), w_query, w_norm, dh=dh)


def test_layer_dimension_not_outermost_in_memory(device):
    """V as a permuted view ([B, N, T, D] storage): its (B, T) rows do not merge, so it is copied."""
    n, b, t, d = BASE
    v = randn(b, n, t, d, dtype=torch.bfloat16, device=device).transpose(0, 1)
    _, w_query, w_norm = make(BASE, torch.bfloat16, device)
    check(v, w_query, w_norm)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_column_tiled_path(profile, device, onchip_bytes, dtype):
    # A 16 KiB budget cannot hold a 1000-wide row: both kernels must tile D.
    forced = onchip_bytes(16384)
    shape = (5, 3, 3, 1000) if SCALE == "cpu" else (5, 4, 512, 8192)
    plans = op.plan(shape, dtype, forced)
    assert plans["forward"].col_tiles > 1 and plans["backward"].col_tiles > 1
    # More rows than any profile has compute units is not needed here: with one row per block and
    # nine rows, every program of a 4-unit grid handles several rows and accumulates its partial G.
    check(*make(shape, dtype, device))


def test_single_pass_forward_with_tiled_backward(device, onchip_bytes):
    """The forward (fewer live tiles) can fit where the backward does not: the backward recomputes
    the scores over D tiles and must agree with the saved log-sum-exp of the single-pass forward."""
    shape = (3, 2, 5, 256)
    budget = 26 * 256  # bf16: forward 22 bytes per column fits 256 columns, backward 32 does not
    forced = onchip_bytes(budget)
    plans = op.plan(shape, torch.bfloat16, forced)
    assert plans["forward"].single_pass and not plans["backward"].single_pass
    check(*make(shape, torch.bfloat16, device))


def test_int64_offsets(device, monkeypatch):
    """Slabs past 2**31 elements address with int64 (forced here: the same results)."""
    monkeypatch.setattr(op, "_needs_offsets_64", lambda *args: True)
    check(*make(BASE, torch.bfloat16, device))


@pytest.mark.parametrize("name", ["h100", *ASCEND])
def test_widest_hidden_on_every_profile(monkeypatch, device, name):
    """D = 16384 with N = 16 (the issue's largest) plans and runs under each profile."""
    monkeypatch.setenv("ONCA_DEVICE_PROFILE", name)
    onca_device.reset()
    try:
        rows = 2 if SCALE == "cpu" else 256
        check(*make((16, 1, rows, 16384), torch.bfloat16, device))
    finally:
        onca_device.reset()


def test_peaked_softmax_is_stable(device):
    """Scores of ten thousand and more: the softmax must not overflow (running max in the forward).

    Slab 0 leans along ``u = w_query * w_norm``, so its score leads every other one by far more than
    fp32's error in a score (exp(-50) and less): alpha is one-hot in every row. Large random scores
    alone would leave, over thousands of rows, near ties whose gradients no fp32 kernel can match to
    the fp64 reference within fp32's tolerance (the softmax itself is that ill-conditioned there)."""
    v, w_query, w_norm = make(BASE, torch.float32, device, query_std=40.0)
    u = w_query * w_norm
    v[0] += 3.0 * u / u.pow(2).mean().sqrt()
    ref, _ = reference(v, w_query, w_norm)
    scores = reference_scores(v, w_query, w_norm)
    top2 = scores.topk(2, dim=0).values
    assert top2[0].min() > 500 and (top2[0] - top2[1]).min() > 50  # peaked, and far from a tie
    check(v, w_query, w_norm)
    assert ref.abs().max() > 0


def test_fp32_weights_with_bf16_values(device):
    """Mixed precision: fp32 master weights, bf16 activations."""
    check(*make(BASE, torch.bfloat16, device, w_dtype=torch.float32))


def test_zero_query_is_the_mean(device):
    v, _, w_norm = make(BASE, torch.float32, device)
    h = attn_res(v, torch.zeros_like(w_norm), w_norm)
    assert_close(h, v.to(torch.float64).mean(0), torch.float32, "h")


def test_weight_gradients_are_deterministic(device):
    v, w_query, w_norm = make(BASE, torch.bfloat16, device)
    dh = randn(*BASE[1:], dtype=torch.bfloat16, device=device)
    runs = []
    for _ in range(2):
        vk, wqk, wnk = leaf(v), leaf(w_query), leaf(w_norm)
        attn_res(vk, wqk, wnk).backward(dh)
        runs.append((vk.grad, wqk.grad, wnk.grad))
    assert all(torch.equal(a, b) for a, b in zip(*runs))


def test_does_not_modify_caller_tensors(device):
    v, w_query, w_norm = make(BASE, torch.bfloat16, device)
    dh = randn(*BASE[1:], dtype=torch.bfloat16, device=device)
    before = [t.clone() for t in (v, w_query, w_norm, dh)]
    attn_res(leaf(v), leaf(w_query), leaf(w_norm)).backward(dh)
    assert all(torch.equal(a, b) for a, b in zip(before, (v, w_query, w_norm, dh)))


def test_output_may_be_modified_in_place(device):
    """The output is not a view and is not saved for backward: the caller may modify it in place
    (as a residual stream does), and the gradient flows through the modification."""
    v, w_query, w_norm = make(BASE, torch.float32, device)
    vk = leaf(v)
    dh = randn(*BASE[1:], device=device)
    expected = torch.autograd.grad(attn_res(vk, leaf(w_query), leaf(w_norm)), vk, dh)[0]
    h = attn_res(vk, leaf(w_query), leaf(w_norm))
    h.mul_(2)
    assert torch.equal(torch.autograd.grad(h, vk, dh / 2)[0], expected)


def test_bad_input(device):
    v, w_query, w_norm = make((3, 2, 4, 64), torch.float32, device)
    with pytest.raises(TypeError, match="V must be a torch.Tensor"):
        attn_res([1.0], w_query, w_norm)
    with pytest.raises(TypeError, match="V must have a floating dtype"):
        attn_res(v.long(), w_query, w_norm)
    with pytest.raises(TypeError, match="w_query must have a floating dtype"):
        attn_res(v, w_query.long(), w_norm)
    with pytest.raises(TypeError, match="w_norm must have a floating dtype"):
        attn_res(v, w_query, w_norm.int())
    with pytest.raises(ValueError, match="V must have shape"):
        attn_res(v[0, 0, 0], w_query, w_norm)
    with pytest.raises(ValueError, match=r"w_query must have shape \(64,\)"):
        attn_res(v, w_query[:32], w_norm)
    with pytest.raises(ValueError, match=r"w_norm must have shape \(64,\)"):
        attn_res(v, w_query, w_norm.view(1, 64))
    with pytest.raises(ValueError, match="w_norm is on meta"):
        attn_res(v, w_query, torch.empty(64, device="meta"))
    with pytest.raises(ValueError, match="eps"):
        attn_res(v, w_query, w_norm, eps=float("nan"))
    with pytest.raises(ValueError, match="eps"):
        attn_res(v, w_query, w_norm, eps=-1.0)
    with pytest.raises(TypeError, match="eps must be a number"):
        attn_res(v, w_query, w_norm, eps="1e-6")
    with pytest.raises(TypeError, match="w_query must be a torch.Tensor"):
        attn_res(v, None, w_norm)


@pytest.mark.parametrize("shape", [(0, 2, 5, 16), (3, 0, 16), (3, 2, 0, 16), (3, 4, 0)],
                         ids=["no-layers", "no-rows", "2x0-rows", "no-columns"])
def test_empty_input_as_torch(device, shape):
    """Empty V: the formula's results in PyTorch (no layers: h is a sum over nothing, zeros; the
    weights' gradients are zeros) and no kernel launch."""
    v, w_query, w_norm = make(shape, torch.float32, device)
    _, dw_query, dw_norm = check(v, w_query, w_norm)
    h = attn_res(v, w_query, w_norm)
    assert torch.equal(h, torch.zeros_like(h))
    assert torch.equal(dw_query, torch.zeros_like(dw_query)) and torch.equal(dw_norm, torch.zeros_like(dw_norm))


@pytest.mark.parametrize("tiled", [False, True], ids=["single-pass", "d-tiled"])
def test_op_contract(device, onchip_bytes, tiled):
    """Custom ops (opcheck), fullgraph compile equal to eager, no host synchronisation."""
    if tiled:  # a 2 KiB budget cannot hold a 96-wide row: both kernels tile D
        forced = onchip_bytes(2048)
        assert op.plan((3, 2, 3, 96), torch.float32, forced)["backward"].col_tiles > 1
    v, w_query, w_norm = make((3, 2, 3, 96), torch.float32 if tiled else torch.bfloat16, device)
    if tiled:  # rows inside a wider buffer: the kernels take the layout without a copy
        v = non_contiguous(v, "rows")
    inputs = tuple(t.requires_grad_() for t in (v, w_query, w_norm))
    assert_op_contract(attn_res, inputs, expect_ops={"attn_res_forward", "attn_res_backward"})


@pytest.mark.parametrize("name", ASCEND)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_plans_fit_ascend_for_every_model(name, dtype):
    """Every D2 point (N = 8 and 16 layers, 4096 tokens, each registry model's hidden size) plans
    within the Unified Buffer, 32-byte aligned, on a grid no larger than the vector cores."""
    profile = onca_device.PROFILES[name]
    itemsize = torch.empty((), dtype=dtype).element_size()
    for model in MODELS.values():
        for n in (8, 16):
            for kind, p in op.plan((n, 1, 4096, model.hidden_size), dtype, profile).items():
                assert p.tile_bytes <= profile.onchip_bytes, (model.name, kind, p.describe())
                assert (p.block_cols * itemsize) % 32 == 0, (model.name, kind, p.describe())
                assert p.persistent and p.grid <= profile.compute_units, (model.name, kind, p.describe())
                assert p.block_cols * p.col_tiles >= model.hidden_size
    # The 910B's Unified Buffer holds a 4096-wide row in one pass, but not a 16384-wide one.
    if name != "ascend950":
        assert op.plan((8, 1, 4096, 4096), dtype, profile)["forward"].single_pass
        assert not op.plan((8, 1, 4096, 16384), dtype, profile)["backward"].single_pass


def test_gpu_rows_plan(monkeypatch, device):
    """A GPU's plan: one row per program; the backward on the persistent grid the profile's warps
    per unit allow (the H100's 16: 4 programs of 4 warps per unit), or, for rows wider than
    GPU_WIDE_COLS, the GPU_WIDE_PROGRAMS a unit whose registers fit; with more rows than programs
    some programs loop (540 rows on 528 programs, 300 or 500 on 264)."""
    h100 = onca_device.profile_named("h100")
    for cols, grid in ((1024, 528), (2048, 528), (2560, 264), (4096, 264)):
        plans = op.plan((8, 1, 4096, cols), torch.bfloat16, h100)
        assert plans["forward"].block_rows == 1 and plans["forward"].grid == 4096
        backward = plans["backward"]
        assert (backward.block_rows, backward.grid, backward.num_warps) == (1, grid, 4)
    ascend = onca_device.profile_named("ascend910b2")
    assert op.plan((8, 1, 4096, 4096), torch.bfloat16, ascend)["backward"].grid == ascend.compute_units
    monkeypatch.setenv("ONCA_DEVICE_PROFILE", "h100")
    onca_device.reset()
    try:
        shapes = ([(3, 1, 540, 64), (2, 1, 300, 2560)] if SCALE == "cpu"
                  else [(8, 1, 540, 2048), (8, 1, 500, 4096)])
        for shape in shapes:
            assert op.plan(shape, torch.bfloat16)["backward"].row_blocks_per_program == 2
            check(*make(shape, torch.bfloat16, device))
    finally:
        onca_device.reset()


def test_backward_plan_is_persistent(profile):
    """G's partial sums need a bounded grid: one buffer row per program, at most one per unit."""
    p = op.plan(BASE, torch.bfloat16, profile)["backward"]
    per_unit = max(1, profile.warps_per_unit // p.num_warps) if profile.warps_per_unit else 1
    assert p.persistent and p.grid <= profile.compute_units * per_unit
