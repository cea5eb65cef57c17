"""Sparsemax forward and backward against the paper's sort-based algorithm in float64."""

from __future__ import annotations

import pytest
import torch

from onca.ops import sparsemax as op
from onca.ops.sparsemax import sparsemax
from tests.contract import assert_op_contract
from tests.helpers import DTYPES, SCALE, assert_close, leaf, non_contiguous, randn

SHAPES = {
    "cpu": [(1, 1), (1, 77), (37, 300), (2, 3, 96), (2, 4099)],
    "gpu": [(16384, 4096), (4096, 8192), (4, 2048, 1000), (64, 65536), (1, 4096)],
}[SCALE]
BASE_SHAPE = {"cpu": (2, 7, 300), "gpu": (8, 1024, 4096)}[SCALE]
TILED_COLS = {"cpu": 300, "gpu": 65536}[SCALE]
TILED_DTYPES = {"cpu": [torch.bfloat16], "gpu": [torch.float32, torch.bfloat16]}[SCALE]


def reference(x, dim=-1):
    """Martins & Astudillo's Algorithm 1 (sort, cumulative sum, support size)."""
    z = x.movedim(dim, -1)
    srt, _ = torch.sort(z, dim=-1, descending=True)
    cum = srt.cumsum(-1)
    r = torch.arange(1, z.shape[-1] + 1, dtype=z.dtype, device=z.device)
    support = 1 + r * srt > cum
    k = support.sum(-1, keepdim=True)
    tau = ((srt * support).sum(-1, keepdim=True) - 1) / k
    return (z - tau).clamp(min=0).movedim(-1, dim)


def reference_grad(y, dy, dim=-1):
    """The paper's Jacobian-vector product: ``dy - mean(dy over S)`` on the support ``S = {y > 0}``,
    0 off it (autograd through ``clamp`` would also pass the gradient where ``z == tau`` exactly)."""
    support = y > 0
    mean = torch.where(support, dy, 0.0).sum(dim, keepdim=True) / support.sum(dim, keepdim=True)
    return torch.where(support, dy - mean, 0.0)


def check(x, dim=-1):
    """Kernel vs float64 reference: ``y`` (non-negative) and ``dx``."""
    xk = leaf(x)
    y = sparsemax(xk, dim)
    ref = reference(x.detach().to(torch.float64), dim)
    assert y.dtype == x.dtype and y.shape == x.shape
    assert_close(y, ref, x.dtype, "y")
    assert (y >= 0).all()
    dy = randn(*x.shape, dtype=x.dtype, device=x.device)
    y.backward(dy)
    ref_dx = reference_grad(ref, dy.to(torch.float64), dim)
    # Where the kernel and the reference disagree on the support (an element within rounding of
    # tau), their gradients legitimately differ: compare on the elements both put in or out.
    same = (y.detach().to(torch.float64) > 0) == (ref.detach() > 0)
    assert same.float().mean() > 0.99
    rows_ok = same.all(dim=dim, keepdim=True).expand_as(same)
    assert_close(torch.where(rows_ok, xk.grad.to(torch.float64), 0.0),
                 torch.where(rows_ok, ref_dx, 0.0), x.dtype, "dx")
    assert xk.grad.dtype == x.dtype


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_matches_reference(profile, device, dtype):
    check(randn(*BASE_SHAPE, dtype=dtype, device=device, std=2.0))


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_shapes(profile, device, shape):
    check(randn(*shape, dtype=torch.float32, device=device))


@pytest.mark.parametrize("dtype", TILED_DTYPES, ids=str)
def test_column_tiled_path(profile, device, onchip_bytes, dtype):
    forced = onchip_bytes(4096 if SCALE == "cpu" else 65536)
    plans = op.plan((9, TILED_COLS), dtype, forced)
    assert plans["forward"].col_tiles > 1 and plans["backward"].col_tiles > 1
    check(randn(2, 2, TILED_COLS, dtype=dtype, device=device, std=0.3))


@pytest.mark.parametrize("kind", ["uniform", "tiny", "huge", "ties", "geometric", "one-hot", "dense"])
def test_hard_rows(device, kind):
    """Rows on which Newton's step alone crawls or the bracket is degenerate: uniform values
    (large support), a tiny spread (everything in the support), large values (the bracket below
    fp32 resolution), exact ties, exponentially spaced values, one dominant entry, and a row whose
    support is every element."""
    n = 1000 if SCALE == "cpu" else 32768
    x = {
        "uniform": lambda: torch.rand(4, n, device=device),
        "tiny": lambda: 1e-4 * randn(4, n, device=device),
        "huge": lambda: 1e4 + randn(4, n, device=device),
        "ties": lambda: torch.randint(0, 3, (4, n), device=device).float() * 0.25,
        "geometric": lambda: -(2.0 ** -torch.arange(60, device=device, dtype=torch.float32)).repeat(4, 1),
        "one-hot": lambda: torch.zeros(4, n, device=device).index_fill_(1, torch.tensor([3], device=device),
                                                                        5.0),
        "dense": lambda: torch.full((4, n), 2.0, device=device) + 1e-6 * torch.arange(n, device=device),
    }[kind]()
    check(x)
    y = sparsemax(x)
    torch.testing.assert_close(y.sum(-1), torch.ones(4, device=device), rtol=0, atol=1e-4)


@pytest.mark.parametrize("how", ["rows", "cols"])
def test_non_contiguous(device, how):
    check(non_contiguous(randn(*BASE_SHAPE, device=device), how))


@pytest.mark.parametrize("dim", [0, 1, -2])
def test_other_dims(device, dim):
    check(randn(5, 6, 33, device=device), dim=dim)


def test_sparse_and_exact(device):
    """A peaked row gives exact zeros off its support and sums to 1 exactly where it can."""
    x = torch.tensor([[3.0, 1.0, 0.2, -1.0], [0.5, 0.5, 0.5, 0.5]], device=device)
    y = sparsemax(x)
    assert torch.equal(y, torch.tensor([[1.0, 0.0, 0.0, 0.0], [0.25, 0.25, 0.25, 0.25]], device=device))


def test_gradient_agrees_with_autograd_of_the_reference(device):
    """Away from ties, the analytic reference gradient is autograd's through Algorithm 1."""
    x = randn(4, 50, dtype=torch.float64, device=device, requires_grad=True)
    y = reference(x)
    dy = randn(4, 50, dtype=torch.float64, device=device)
    y.backward(dy)
    torch.testing.assert_close(x.grad, reference_grad(y.detach(), dy))



def test_does_not_modify_caller_tensors(device):
    x = randn(*BASE_SHAPE, dtype=torch.bfloat16, device=device)
    x0 = x.clone()
    dy = randn(*BASE_SHAPE, dtype=torch.bfloat16, device=device)
    dy0 = dy.clone()
    sparsemax(x.requires_grad_(True)).backward(dy)
    assert torch.equal(x.detach(), x0) and torch.equal(dy, dy0)


def test_bad_input(device):
    with pytest.raises(TypeError, match="input must have a floating dtype"):
        sparsemax(torch.ones(4, 8, dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match="input must have at least one dimension"):
        sparsemax(torch.tensor(1.0, device=device))
    with pytest.raises(ValueError, match="dim must be in"):
        sparsemax(torch.ones(4, 8, device=device), dim=-3)
    with pytest.raises(TypeError, match="dim must be an int"):
        sparsemax(torch.ones(4, 8, device=device), dim=None)


@pytest.mark.parametrize("shape", [(0, 64), (2, 0, 64), (3, 0)], ids=lambda s: "x".join(map(str, s)))
def test_empty_input(device, shape):
    x = leaf(torch.empty(shape, device=device))
    y = sparsemax(x)
    assert y.shape == x.shape
    y.sum().backward()
    assert x.grad.shape == x.shape


def test_op_contract(device):
    """Custom ops (opcheck), fullgraph compile equal to eager, no host synchronisation."""
    x = randn(2, 3, 19, device=device, requires_grad=True)
    assert_op_contract(sparsemax, (x,), expect_ops={"sparsemax_forward", "sparsemax_backward"})
