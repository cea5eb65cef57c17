"""Modulated RMSNorm forward and backward against a float64 PyTorch reference: the RMSNorm of the
model (rounding where it rounds), then ``* (1 + scale) + shift`` with liger-kernel's broadcast."""

from __future__ import annotations

import pytest
import torch

from onca.ops import modulated_rms_norm as op
from onca.ops.modulated_rms_norm import modulated_rms_norm
from tests.contract import assert_op_contract
from tests.helpers import DTYPES, SCALE, assert_close, leaf, non_contiguous, randn, rounded

CASTINGS = ("llama", "gemma", "none")
BASE_SHAPE = {"cpu": (3, 6, 200), "gpu": (8, 1024, 3072)}[SCALE]


def modulation_shape(shape, layout):
    """``global``: one row; ``batch``: one per sequence; ``batch3d``: (B, 1, H); ``token``: one per row."""
    b, h = shape[0], shape[-1]
    return {"global": (h,), "batch": (b, h), "batch3d": (b, 1, h), "token": shape}[layout]


def make(shape, dtype, device, layout="batch", shift=True, weight=True, offset=0.0):
    x = randn(*shape, dtype=dtype, device=device)
    w = randn(shape[-1], dtype=dtype, device=device, std=0.5) + (0.0 if offset else 1.0) if weight else None
    mod = modulation_shape(shape, layout)
    s = randn(*mod, dtype=dtype, device=device, std=0.5)
    sh = randn(*mod, dtype=dtype, device=device, std=0.5) if shift else None
    return x, w, s, sh


def reference(x, w, s, sh, eps, offset, casting):
    """In float64: RMSNorm as the casting mode rounds it, then the modulation."""
    t64 = [None if t is None else t.detach().to(torch.float64).requires_grad_(True) for t in (x, w, s, sh)]
    x64, w64, s64, sh64 = t64
    dtype, hidden = x.dtype, x.shape[-1]
    n = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps)
    if w is None:
        r = n if casting == "gemma" else rounded(n, dtype)
    elif casting == "llama":
        r = rounded(n, dtype) * (offset + w64)
    elif casting == "gemma":
        r = n * (offset + w64)
    else:
        r = rounded(rounded(n, dtype) * rounded(offset + w64, dtype), dtype)
    rows = x.numel() // hidden

    def spread(t):
        t = t.reshape(-1, hidden)
        return t.repeat_interleave(rows // t.shape[0], dim=0).reshape(x.shape)

    m = 1 + spread(s64)
    y = r * (rounded(m, dtype) if casting == "none" else m)
    if sh is not None:
        y = (rounded(y, dtype) if casting == "none" else y) + spread(sh64)
    return y, t64


def check(x, w, s, sh, eps=1e-6, offset=0.0, casting="llama", overwrite_grad_output=False):
    ks = [None if t is None else leaf(t) for t in (x, w, s, sh)]
    y = modulated_rms_norm(ks[0], ks[1], ks[2], ks[3], eps, offset, casting, overwrite_grad_output)
    assert y.dtype == x.dtype and y.shape == x.shape
    ref, t64 = reference(x, w, s, sh, eps, offset, casting)
    assert_close(y, ref, x.dtype, "y")
    dy = randn(*x.shape, dtype=x.dtype, device=x.device)
    y.backward(dy.clone())
    ref.backward(dy.to(torch.float64))
    for name, k, r, t in zip(("dx", "dweight", "dscale", "dshift"), ks, t64, (x, w, s, sh)):
        if t is None:
            continue
        assert k.grad.dtype == t.dtype and k.grad.shape == t.shape, name
        assert_close(k.grad, r.grad, x.dtype, name)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_matches_reference(profile, device, dtype):
    check(*make(BASE_SHAPE, dtype, device), eps=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("casting", ["gemma", "none"])
def test_casting_modes(device, dtype, casting):
    offset = 1.0 if casting == "gemma" else 0.0
    check(*make(BASE_SHAPE, dtype, device, offset=offset), eps=1e-5, offset=offset, casting=casting)


@pytest.mark.parametrize("layout, shift, weight", [("global", True, False), ("batch", False, True),
                                                   ("batch3d", True, True), ("token", True, True),
                                                   ("token", False, False)])
def test_modulation_layouts(device, layout, shift, weight):
    check(*make(BASE_SHAPE, torch.bfloat16, device, layout, shift, weight))


@pytest.mark.parametrize("shape, layout", [((7, 5, 96), "batch"), ((1, 64), "global"), ((1, 1), "token"),
                                           ((37, 300), "global"), ((2, 3, 4, 72), "batch")],
                         ids=["odd-seq", "one-row", "one-element", "2d", "4d"])
def test_shapes(device, shape, layout):
    check(*make(shape, torch.float32, device, layout))


def test_grouping_with_few_rows_per_modulation(device):
    """Two rows per modulation row, 2-D scale of 2-D x: blocks of two rows, many programs."""
    x, w, _, _ = make((40, 64), torch.float32, device)
    s, sh = randn(20, 64, device=device), randn(20, 64, device=device)
    check(x, w, s, sh)


@pytest.mark.parametrize("how", ["rows", "cols"])
def test_non_contiguous_inputs(device, how):
    x, w, s, sh = make(BASE_SHAPE, torch.float32, device)
    check(non_contiguous(x, how), w, non_contiguous(s, how), non_contiguous(sh, how))


@pytest.mark.parametrize("layout", ["batch", "token"])
def test_column_tiled_path(profile, device, onchip_bytes, layout):
    forced = onchip_bytes(16384)
    cols = 600 if SCALE == "cpu" else 8192
    shape = (2, 5, cols) if SCALE == "cpu" else (4, 9, cols)
    plans = op.plan(shape, torch.bfloat16, forced, modulation_rows=2)
    assert plans["forward"].col_tiles > 1 and plans["backward"].col_tiles > 1
    check(*make(shape, torch.bfloat16, device, layout), casting="none" if layout == "token" else "llama")


def test_gpu_backward_plan(device, monkeypatch):
    """On a GPU profile, rows up to ``GPU_BACKWARD_TILE`` wide take backward tiles of that many
    elements, one program per compute unit (measured faster on an H200); wider rows column tiles
    of at most ``GPU_WIDE_BACKWARD_COLS``, launched under a register cap; a GPU profile's plans compute
    the same gradients (under the interpreter here)."""
    from onca import device as onca_device
    from onca.tiling import plan_rows

    h100 = onca_device.profile_named("h100")
    p = op._backward_plan(16384, 1024, torch.bfloat16, 4, h100)
    tile = (p.block_rows * p.block_cols, p.num_warps, p.grid)
    assert tile == (op.GPU_BACKWARD_TILE, 8, h100.compute_units)
    wide = op._backward_plan(16384, 16384, torch.bfloat16, 4, h100)
    assert wide == plan_rows(16384, 16384, torch.bfloat16, profile=h100, persistent=True, max_block_rows=4096,
                             **dict(op.BACKWARD_TILES, max_block_cols=op.GPU_WIDE_BACKWARD_COLS))
    assert wide.col_tiles > 1 and wide.block_cols <= op.GPU_WIDE_BACKWARD_COLS
    ascend = onca_device.profile_named("ascend910b4")
    assert op._backward_plan(64, 96, torch.float32, 2, ascend) == plan_rows(
        64, 96, torch.float32, profile=ascend, persistent=True, max_block_rows=32, **op.BACKWARD_TILES)
    monkeypatch.setenv("ONCA_DEVICE_PROFILE", "h100")
    onca_device.reset()
    try:
        # Tiles of 8 rows, three row blocks a program, some programs' blocks in two modulation rows.
        p = op._backward_plan(3000, 64, torch.float32, 3)
        assert (p.block_rows, -(-p.row_blocks // p.grid)) == (8, 3) and (1000 // 8) % 3 != 0
        check(*make((3, 1000, 64), torch.float32, device))
        check(*make((2, 2, 16384), torch.bfloat16, device))  # wide rows: column tiles, the register cap
    finally:
        monkeypatch.delenv("ONCA_DEVICE_PROFILE")
        onca_device.reset()


def test_fp32_params_with_bf16_input(device):
    x, _, _, _ = make(BASE_SHAPE, torch.bfloat16, device)
    _, w, s, sh = make(BASE_SHAPE, torch.float32, device)
    check(x, w, s, sh, casting="gemma", offset=1.0)


def test_overwrite_grad_output_reuses_dy(device):
    x, w, s, sh = make(BASE_SHAPE, torch.bfloat16, device)
    dy = randn(*BASE_SHAPE, dtype=torch.bfloat16, device=device)
    x1 = leaf(x)
    expected = torch.autograd.grad(modulated_rms_norm(x1, w, s, sh), x1, dy.clone())[0]
    x2, dy_buffer = leaf(x), dy.clone()
    (dx,) = torch.autograd.grad(modulated_rms_norm(x2, w, s, sh, overwrite_grad_output=True), x2, dy_buffer)
    assert dx.data_ptr() == dy_buffer.data_ptr()
    assert torch.equal(dx, expected)


def test_gradients_are_deterministic(device):
    x, w, s, sh = make(BASE_SHAPE, torch.bfloat16, device)
    grads = []
    for _ in range(2):
        ks = [leaf(t) for t in (w, s, sh)]
        modulated_rms_norm(x, *ks).sum().backward()
        grads.append([k.grad for k in ks])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_bad_input(device):
    x, w, s, sh = make((2, 4, 64), torch.float32, device)
    with pytest.raises(ValueError, match="scale must have last dimension 64"):
        modulated_rms_norm(x, w, randn(2, 32, device=device))
    with pytest.raises(ValueError, match="scale must have a number of rows"):
        modulated_rms_norm(x, w, randn(3, 64, device=device))
    with pytest.raises(ValueError, match="shift must have scale's shape"):
        modulated_rms_norm(x, w, s, randn(64, device=device))
    with pytest.raises(TypeError, match="scale must have a floating dtype"):
        modulated_rms_norm(x, w, s.int())
    with pytest.raises(TypeError, match="scale must be a torch.Tensor"):
        modulated_rms_norm(x, w, None)
    with pytest.raises(ValueError, match="shift is on meta"):
        modulated_rms_norm(x, w, s, torch.empty(2, 64, device="meta"))
    with pytest.raises(ValueError, match="x must have last dimension 32"):
        modulated_rms_norm(x, randn(32, device=device), s)
    with pytest.raises(ValueError, match="casting_mode"):
        modulated_rms_norm(x, w, s, casting_mode="fp8")
    with pytest.raises(TypeError, match="overwrite_grad_output must be a bool"):
        modulated_rms_norm(x, w, s, overwrite_grad_output=None)


@pytest.mark.parametrize("shape", [(0, 64), (2, 0, 64)])
def test_empty_input(device, shape):
    xk = leaf(randn(*shape, device=device))
    w, s, sh = (leaf(randn(64, device=device)) for _ in range(3))
    y = modulated_rms_norm(xk, w, s, sh)
    assert y.shape == shape
    y.sum().backward()
    assert xk.grad.shape == shape
    assert all(torch.equal(t.grad, torch.zeros_like(t)) for t in (w, s, sh))


def test_op_contract(device):
    """Custom ops (opcheck), fullgraph compile equal to eager, no host synchronisation."""
    tensors = [t.requires_grad_() for t in make((3, 5, 48), torch.bfloat16, device, "batch")]
    assert_op_contract(modulated_rms_norm, tuple(tensors),
                       expect_ops={"modulated_rms_norm_forward", "modulated_rms_norm_backward"})


def test_slot_sum_takes_a_modulation_row_s_slots_in_few_steps():
    """The slot sum adds many slots a step: a batch of 4 sequences on a 264-program grid gives each
    modulation row about 67 slots, summed in at most 16 steps; rows of many modulation rows
    (about two slots each) take a small tile; wide tiles one slot a step."""
    assert -(-67 // op._slot_rows(268, 4, 64)) <= 16
    assert op._slot_rows(264 + 512, 512, 32) == 4
    assert op._slot_rows(268, 4, 4096) == 1
