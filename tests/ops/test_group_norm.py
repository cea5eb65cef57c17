"""GroupNorm forward and backward against PyTorch's group_norm computed in float64."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from onca.ops import group_norm as op
from onca.ops.group_norm import group_norm
from tests.contract import assert_op_contract
from tests.helpers import DTYPES, SCALE, assert_close, leaf, randn

# (shape, num_groups)
CASES = {
    "cpu": [((2, 12, 5, 7), 4), ((1, 6, 1), 3), ((3, 8), 2), ((2, 9, 33), 3), ((1, 1, 2), 1)],
    "gpu": [((8, 320, 64, 64), 32), ((4, 1280, 16, 16), 32), ((16, 64, 4096), 8), ((2, 512, 32, 32, 4), 32)],
}[SCALE]
BASE = {"cpu": ((2, 12, 6, 5), 3), "gpu": ((8, 640, 32, 32), 32)}[SCALE]
AFFINE = ("weight+bias", "weight", "none")


def params(channels, affine, dtype, device):
    w = randn(channels, dtype=dtype, device=device, std=0.5) + 1.0 if affine != "none" else None
    b = randn(channels, dtype=dtype, device=device, std=0.5) if affine == "weight+bias" else None
    return w, b


def check(x, num_groups, w, b, eps=1e-5):
    ks = [None if t is None else leaf(t) for t in (x, w, b)]
    y = group_norm(ks[0], num_groups, ks[1], ks[2], eps)
    assert y.dtype == x.dtype and y.shape == x.shape
    t64 = [None if t is None else t.detach().to(torch.float64).requires_grad_(True) for t in (x, w, b)]
    ref = F.group_norm(t64[0], num_groups, t64[1], t64[2], eps)
    assert_close(y, ref, x.dtype, "y")
    dy = randn(*x.shape, dtype=x.dtype, device=x.device)
    y.backward(dy)
    ref.backward(dy.to(torch.float64))
    for name, k, r, t in zip(("dx", "dweight", "dbias"), ks, t64, (x, w, b)):
        if t is not None:
            assert k.grad.dtype == t.dtype, name
            assert_close(k.grad, r.grad, x.dtype, name)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_matches_reference(profile, device, dtype):
    shape, groups = BASE
    check(randn(*shape, dtype=dtype, device=device, std=2.0) + 1.0, groups, *params(shape[1], "weight+bias", dtype,
                                                                                     device))


@pytest.mark.parametrize("case, affine", [(c, AFFINE[i % 3]) for i, c in enumerate(CASES)] + [(CASES[0], "weight"),
                                                                              (CASES[0], "none")],
                         ids=lambda v: "x".join(map(str, v[0])) + f"-g{v[1]}" if isinstance(v, tuple) else v)
def test_shapes_and_affine(device, case, affine):
    shape, groups = case
    check(randn(*shape, dtype=torch.float32, device=device), groups, *params(shape[1], affine, torch.float32, device))


def test_non_contiguous_input(profile, device):
    shape, groups = BASE
    x = randn(shape[0], *shape[2:], shape[1], device=device).movedim(-1, 1)
    assert not x.is_contiguous()
    check(x, groups, *params(shape[1], "weight+bias", torch.float32, device))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_tiled_path(profile, device, onchip_bytes, dtype):
    """A group larger than a tile: statistics over tiles, then a second pass, with a large mean."""
    forced = onchip_bytes(4096)
    shape, groups = ((2, 6, 300), 2) if SCALE == "cpu" else ((4, 64, 8192), 8)
    plans = op.plan(shape, dtype, forced, num_groups=groups)
    assert plans["forward"].col_tiles > 1 and plans["backward"].col_tiles > 1
    x = randn(*shape, dtype=dtype, device=device) + 30.0
    check(x, groups, *params(shape[1], "weight+bias", dtype, device))


def test_fp32_params_with_bf16_input(device):
    shape, groups = BASE
    check(randn(*shape, dtype=torch.bfloat16, device=device), groups, *params(shape[1], "weight+bias",
                                                                               torch.float32, device))


def test_parameter_gradients_are_deterministic(device):
    shape, groups = BASE
    x = randn(*shape, dtype=torch.bfloat16, device=device)
    grads = []
    for _ in range(2):
        w, b = (leaf(t) for t in params(shape[1], "weight+bias", torch.bfloat16, device))
        group_norm(x, groups, w, b).sum().backward()
        grads.append((w.grad, b.grad))
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])


def test_bad_input(device):
    x = randn(2, 6, 5, device=device)
    w, b = params(6, "weight+bias", torch.float32, device)
    with pytest.raises(ValueError, match="divisible by num_groups=4"):
        group_norm(x, 4, w, b)
    with pytest.raises(ValueError, match="num_groups must be a positive int"):
        group_norm(x, 0, w, b)
    with pytest.raises(ValueError, match="num_groups must be a positive int"):
        group_norm(x, 2.0, w, b)
    with pytest.raises(ValueError, match=r"x must have shape \(batch, channels"):
        group_norm(randn(6, device=device), 2)
    with pytest.raises(TypeError, match="x must have a floating dtype"):
        group_norm(x.int(), 2)
    with pytest.raises(ValueError, match="weight must be 1-D"):
        group_norm(x, 2, randn(5, device=device))
    with pytest.raises(ValueError, match="bias is on meta"):
        group_norm(x, 2, w, torch.empty(6, device="meta"))
    with pytest.raises(ValueError, match="eps"):
        group_norm(x, 2, w, b, eps=-1.0)


@pytest.mark.parametrize("shape", [(0, 6, 5), (2, 6, 0)])
def test_empty_input(device, shape):
    xk = leaf(randn(*shape, device=device))
    w, b = (leaf(t) for t in params(6, "weight+bias", torch.float32, device))
    y = group_norm(xk, 3, w, b)
    assert y.shape == shape
    y.sum().backward()
    assert xk.grad.shape == shape
    assert torch.equal(w.grad, torch.zeros_like(w)) and torch.equal(b.grad, torch.zeros_like(b))


def test_op_contract(device):
    """Custom ops (opcheck), fullgraph compile equal to eager, no host synchronisation."""
    x = randn(2, 8, 3, 5, dtype=torch.bfloat16, device=device).requires_grad_()
    w, b = (t.requires_grad_() for t in params(8, "weight+bias", torch.bfloat16, device))
    assert_op_contract(lambda x, w, b: group_norm(x, 4, w, b), (x, w, b),
                       expect_ops={"group_norm_forward", "group_norm_backward"})


@pytest.mark.parametrize("profile_name", ["h100", "ascend910b4"])
@pytest.mark.parametrize("dtype, affine", [(torch.float32, "weight+bias"), (torch.bfloat16, "weight+bias"),
                                           (torch.float32, "weight"), (torch.bfloat16, "none")], ids=str)
def test_groups_split_into_slices(device, monkeypatch, profile_name, dtype, affine):
    """Fewer groups than half the programs: the backward takes each group in slices of channel
    blocks (two launches), with a large mean; the reference's values and gradients."""
    from onca import device as onca_device

    monkeypatch.setenv("ONCA_DEVICE_PROFILE", profile_name)
    onca_device.reset()
    if SCALE == "cpu":  # groups of 480 elements: split as a large group would be
        monkeypatch.setattr(op, "MIN_SPLIT_ELEMENTS", 1)
    shape, groups = ((2, 24, 40), 2) if SCALE == "cpu" else ((1, 5376, 1024), 16)
    n_groups, ch_per_group, n_pos = op._dims(shape, groups)
    p = op._plan(n_groups, ch_per_group, n_pos, dtype, op.BACKWARD_TILES)
    assert op._slices(p, n_groups, ch_per_group)[0] > 1
    x = randn(*shape, dtype=dtype, device=device) + 30.0
    check(x, groups, *params(shape[1], affine, dtype, device))
    onca_device.reset()


def test_slices_follow_the_grid():
    """Split where at least half the programs would be idle, in whole channel blocks, never more
    slices than blocks or MAX_SLICES; a group in one channel block stays whole."""
    from onca.device import profile_named

    h100 = profile_named("h100")

    def slices(shape, groups):
        n_groups, ch_per_group, n_pos = op._dims(shape, groups)
        p = op._plan(n_groups, ch_per_group, n_pos, torch.bfloat16, op.BACKWARD_TILES, h100)
        return op._slices(p, n_groups, ch_per_group), -(-ch_per_group // p.block_rows)

    (count, per_slice), blocks = slices((4, 5376, 1024), 32)  # gemma-3-27b's width as channels
    assert (count, per_slice) == (blocks, 1) and count > 1
    assert slices((8, 512, 4096), 32)[0] == (1, slices((8, 512, 4096), 32)[1])  # 256 groups: whole
    (count, per_slice), blocks = slices((1, 65536, 256), 1)  # one group of many blocks
    assert count <= op.MAX_SLICES and count * per_slice >= blocks > (count - 1) * per_slice
    assert slices((1, 1, 1 << 16), 1)[0] == (1, 1)  # one channel: nothing to split
    # Groups too small to gain (the overhead sweep's): whole, one launch fewer on the host.
    n_groups, ch_per_group, n_pos = op._dims((2, 64, 256), 32)
    p = op._plan(n_groups, ch_per_group, n_pos, torch.bfloat16, op.BACKWARD_TILES, h100)
    assert ch_per_group * n_pos < op.MIN_SPLIT_ELEMENTS and op._slices(p, n_groups, ch_per_group)[0] == 1
    assert slices((4, 2048, 1024), 32)[0][0] > 1  # 64 channels x 1024 positions: the smallest gain measured
