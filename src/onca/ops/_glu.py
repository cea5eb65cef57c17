"""Gated activations ``act(a) * b`` (SwiGLU, GeGLU): the kernels, launchers and autograd Functions
shared by ``onca.ops.swiglu`` and ``onca.ops.geglu``, which differ only in the activation.

``a`` is the gate projection and ``b`` the up projection, both ``(..., intermediate)``. Rounding
follows the Hugging Face MLPs (``act_fn(gate) * up`` in the input dtype): the activation is
computed in fp32 and rounded to the input dtype, the product is computed in fp32 and rounded again.

Layouts: ``a`` and ``b`` may be strided views whose rows are not contiguous (unit column stride,
any row stride), such as the two halves of Phi-3's fused ``gate_up_proj`` output
(``(T, 2I).chunk(2, -1)``); the kernels take row strides, so no copy is made. ``b=None`` means
``a`` *is* the fused ``[gate | up]`` tensor ``(..., 2I)``; its gradient is then one ``(..., 2I)``
tensor, with no ``torch.cat`` in the backward pass.

Two autograd Functions:

- :class:`GLUFunction`: ``c = act(a) * b``. Saves ``a`` and ``b`` (not ``act(a)``: the backward
  recomputes it from ``a``). ``in_place=True`` writes ``da`` and ``db`` into the storage of ``a``
  and ``b`` (as liger-kernel always does), so the backward allocates nothing; the caller must not
  use ``a`` or ``b`` afterwards, and must not backward through the same graph twice.
- :class:`GLULinearFunction`: ``out = linear(act(a) * b, weight, bias)``, the MLP tail. The
  product ``c`` is *not* stored for the weight gradient: the backward computes
  ``dc = dout @ weight``, then one kernel reads ``a, b, dc`` and writes ``da``, ``db`` and the
  recomputed ``c`` (``c`` over ``dc``'s buffer, ``da``/``db`` over ``a``/``b`` when ``in_place``),
  then ``dweight = dout^T @ c``. Between forward and backward an MLP so keeps two
  ``(T, intermediate)`` tensors (``a``, ``b``) where ``nn.Linear`` + liger keep three (``a``, ``b``,
  ``c``), and its backward peaks at three (``a``, ``b``, ``dc``) where liger's peaks at four.

Every kernel loops over row blocks (``for rb in tl.range(pid, n_row_blocks, n_programs)``) and,
within a row block, over the column tiles the plan splits a row into: elements are independent, so
there is no reduction and one loop serves the single-tile and the column-tiled plans alike.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable

from onca.device import DeviceProfile
from onca.ops._validate import check_float, check_nonempty, check_same_device, check_tensor
from onca.tiling import RowPlan, plan_rows

__all__ = ["ACTIVATIONS", "GLUFunction", "GLULinearFunction", "glu", "glu_linear", "plan"]

# The activation constexpr of the kernels.
ACTIVATIONS = {"silu": 0, "gelu_tanh": 1, "gelu": 2}

# Live tiles of each kernel (input-dtype tiles, fp32 tiles), as the planner counts them.
FORWARD_TILES = dict(live_tiles=3, fp32_tiles=4)  # a, b, c; a, b, act(a), c in fp32
BACKWARD_TILES = dict(live_tiles=5, fp32_tiles=6)  # dc, a, b, da, db; dc, a, b, act, act', da/db
# The MLP tail's backward also stores the recomputed product.
PRODUCT_BACKWARD_TILES = dict(live_tiles=6, fp32_tiles=7)


# ----------------------------------------------------------------------------------------- kernels


@triton.jit
def _activation(a, ACTIVATION: tl.constexpr, WITH_GRAD: tl.constexpr):
    """``act(a)`` and, with ``WITH_GRAD``, ``act'(a)``, in fp32 (``a`` is fp32)."""
    if ACTIVATION == 0:  # silu(a) = a * sigmoid(a)
        s = tl.sigmoid(a)
        h = a * s
        dh = s
        if WITH_GRAD:
            dh = s + h * (1.0 - s)
    elif ACTIVATION == 1:  # gelu, tanh approximation (PyTorch's approximate="tanh")
        # 0.5 * (1 + tanh(u)) = sigmoid(2u): no cancellation where tanh(u) is near -1, and it
        # saturates to exactly 0 or 1. u = sqrt(2 / pi) * (a + 0.044715 * a^3), as PyTorch.
        u2 = 1.5957691216057308 * (a + 0.044715 * a * a * a)
        s = tl.sigmoid(u2)
        h = a * s
        dh = s
        if WITH_GRAD:
            # d/da [a * sigmoid(2u)] = s + a * s * (1 - s) * d(2u)/da
            du2 = 1.5957691216057308 * (1.0 + 3.0 * 0.044715 * a * a)
            dh = s + h * (1.0 - s) * du2
    else:  # gelu, exact: a * Phi(a)
        e = tl.math.erf(a * 0.7071067811865476)
        h = 0.5 * a * (1.0 + e)
        dh = e
        if WITH_GRAD:
            dh = 0.5 * (1.0 + e) + a * tl.exp(-0.5 * a * a) * 0.3989422804014327
    return h, dh


@triton.jit
def _glu_forward_kernel(
    a_ptr, b_ptr, c_ptr,
    n_rows, n_cols, a_row_stride, b_row_stride, c_row_stride,
    ACTIVATION: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    COL_TILES: tl.constexpr,
):
    DTYPE: tl.constexpr = c_ptr.dtype.element_ty
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    n_row_blocks = tl.cdiv(n_rows, BLOCK_ROWS)
    col_offsets = tl.arange(0, BLOCK_COLS)
    for row_block in tl.range(pid, n_row_blocks, n_programs):
        rows = row_block * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        row_mask = rows < n_rows
        rows64 = rows.to(tl.int64)[:, None]
        a_rows = a_ptr + rows64 * a_row_stride
        b_rows = b_ptr + rows64 * b_row_stride
        c_rows = c_ptr + rows64 * c_row_stride
        for tile in range(COL_TILES):
            cols = (tile * BLOCK_COLS + col_offsets)[None, :]
            mask = row_mask[:, None] & (cols < n_cols)
            a = tl.load(a_rows + cols, mask=mask, other=0.0).to(tl.float32)
            h, _ = _activation(a, ACTIVATION, False)
            # act(a) rounded to the input dtype, as the Hugging Face MLP materialises it
            h = h.to(DTYPE).to(tl.float32)
            b = tl.load(b_rows + cols, mask=mask, other=0.0).to(tl.float32)
            tl.store(c_rows + cols, (h * b).to(DTYPE), mask=mask)


@triton.jit
def _glu_backward_kernel(
    dc_ptr, a_ptr, b_ptr, da_ptr, db_ptr, c_ptr,
    n_rows, n_cols,
    dc_row_stride, a_row_stride, b_row_stride, da_row_stride, db_row_stride, c_row_stride,
    ACTIVATION: tl.constexpr,
    STORE_C: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    COL_TILES: tl.constexpr,
):
    # Outputs may alias inputs element for element (da over a, db over b, c over dc): every
    # element is loaded before it is stored, by the same program, and never read again.
    DTYPE: tl.constexpr = a_ptr.dtype.element_ty
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    n_row_blocks = tl.cdiv(n_rows, BLOCK_ROWS)
    col_offsets = tl.arange(0, BLOCK_COLS)
    for row_block in tl.range(pid, n_row_blocks, n_programs):
        rows = row_block * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        row_mask = rows < n_rows
        rows64 = rows.to(tl.int64)[:, None]
        dc_rows = dc_ptr + rows64 * dc_row_stride
        a_rows = a_ptr + rows64 * a_row_stride
        b_rows = b_ptr + rows64 * b_row_stride
        da_rows = da_ptr + rows64 * da_row_stride
        db_rows = db_ptr + rows64 * db_row_stride
        c_rows = c_ptr + rows64 * c_row_stride
        for tile in range(COL_TILES):
            cols = (tile * BLOCK_COLS + col_offsets)[None, :]
            mask = row_mask[:, None] & (cols < n_cols)
            dc = tl.load(dc_rows + cols, mask=mask, other=0.0).to(tl.float32)
            a = tl.load(a_rows + cols, mask=mask, other=0.0).to(tl.float32)
            b = tl.load(b_rows + cols, mask=mask, other=0.0).to(tl.float32)
            h, dh = _activation(a, ACTIVATION, True)
            h = h.to(DTYPE).to(tl.float32)  # the rounded act(a) the forward multiplied by
            if STORE_C:
                tl.store(c_rows + cols, (h * b).to(DTYPE), mask=mask)
            tl.store(da_rows + cols, (dc * b * dh).to(DTYPE), mask=mask)
            tl.store(db_rows + cols, (dc * h).to(DTYPE), mask=mask)


# --------------------------------------------------------------------------------------- launchers


def plan(shape, dtype: torch.dtype, profile: DeviceProfile | None = None) -> dict[str, RowPlan]:
    """The plans for ``a`` of ``shape`` ``(..., intermediate)``: the op's forward and backward, and
    the MLP tail's backward (which also writes the recomputed product)."""
    shape = tuple(int(s) for s in shape)
    rows, cols = 1, shape[-1]
    for s in shape[:-1]:
        rows *= s
    return {
        "forward": plan_rows(rows, cols, dtype, profile=profile, **FORWARD_TILES),
        "backward": plan_rows(rows, cols, dtype, profile=profile, **BACKWARD_TILES),
        "product_backward": plan_rows(rows, cols, dtype, profile=profile, **PRODUCT_BACKWARD_TILES),
    }


def glu_forward(a2d: torch.Tensor, b2d: torch.Tensor, activation: int) -> torch.Tensor:
    rows, cols = a2d.shape
    p = plan_rows(rows, cols, a2d.dtype, **FORWARD_TILES)
    c = torch.empty((rows, cols), dtype=a2d.dtype, device=a2d.device)
    _glu_forward_kernel[(p.grid,)](
        a2d, b2d, c,
        rows, cols, a2d.stride(0), b2d.stride(0), c.stride(0),
        ACTIVATION=activation, BLOCK_ROWS=p.block_rows, BLOCK_COLS=p.block_cols, COL_TILES=p.col_tiles,
        num_warps=p.num_warps,
    )
    return c


def glu_backward(dc2d, a2d, b2d, da2d, db2d, activation: int, c2d=None) -> None:
    """Write ``da`` and ``db`` (and, if ``c2d`` is given, the recomputed product) for ``dc``."""
    rows, cols = a2d.shape
    store_c = c2d is not None
    tiles = PRODUCT_BACKWARD_TILES if store_c else BACKWARD_TILES
    p = plan_rows(rows, cols, a2d.dtype, **tiles)
    c_arg = c2d if store_c else dc2d  # unused (never stored to) without STORE_C
    _glu_backward_kernel[(p.grid,)](
        dc2d, a2d, b2d, da2d, db2d, c_arg,
        rows, cols,
        dc2d.stride(0), a2d.stride(0), b2d.stride(0), da2d.stride(0), db2d.stride(0), c_arg.stride(0),
        ACTIVATION=activation, STORE_C=store_c,
        BLOCK_ROWS=p.block_rows, BLOCK_COLS=p.block_cols, COL_TILES=p.col_tiles,
        num_warps=p.num_warps,
    )


# ------------------------------------------------------------------------------------------ layout


def _as_rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as ``(rows, last_dim)`` with unit column stride and any row stride; copies only when
    no such view exists (a column stride other than 1, or leading dims that do not merge)."""
    if t.stride(-1) != 1 and t.shape[-1] > 1:
        t = t.contiguous()
    try:
        rows = t.view(-1, t.shape[-1])
    except RuntimeError:  # leading dimensions that cannot be merged into one row stride
        rows = t.reshape(-1, t.shape[-1]).contiguous()
    if rows.shape[0] > 1 and rows.stride(0) < rows.shape[1]:  # overlapping rows (expanded)
        rows = rows.contiguous()
    if rows.stride(1) != 1:  # a single column
        rows = rows.contiguous()
    return rows


def _split(a: torch.Tensor, b: torch.Tensor | None):
    """Row views ``(a2d, b2d)`` of the gate and up inputs, and the 2-D form of ``a`` as given.

    With ``b=None``, ``a`` is the fused ``[gate | up]`` tensor and the views are its halves."""
    if b is None:
        fused = _as_rows(a)
        half = fused.shape[1] // 2
        return fused[:, :half], fused[:, half:], fused
    return _as_rows(a), _as_rows(b), None


def _check_inputs(a, b, activation: str, in_place) -> int:
    check_float(a, "a")
    check_nonempty(a, "a")
    if a.dim() == 0:
        raise ValueError("a must have at least one dimension (..., intermediate)")
    if b is None:
        if a.shape[-1] % 2:
            raise ValueError(
                f"with b=None, a is the fused [gate | up] tensor and needs an even last dimension, "
                f"got shape {tuple(a.shape)}"
            )
    else:
        check_tensor(b, "b")
        if b.dtype != a.dtype:
            raise TypeError(f"b must have a's dtype {a.dtype}, got {b.dtype}")
        if b.shape != a.shape:
            raise ValueError(f"b must have a's shape {tuple(a.shape)}, got {tuple(b.shape)}")
        check_same_device(b, "b", a, "a")
        if in_place and a.data_ptr() == b.data_ptr():
            raise ValueError("in_place=True needs a and b in separate memory (they alias)")
    if not isinstance(in_place, bool):
        raise TypeError(f"in_place must be a bool, got {type(in_place).__name__}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {sorted(ACTIVATIONS)}, got {activation!r}")
    return ACTIVATIONS[activation]


# ---------------------------------------------------------------------------------------- autograd


_CONSUMED = (
    "this in_place gated-activation backward has already written its gradients over the saved "
    "activations; to backward twice through one graph (retain_graph=True), use in_place=False"
)


class GLUFunction(torch.autograd.Function):
    """``c = act(a) * b``. Saves ``a`` and ``b`` (2-D row views; ``act(a)`` is recomputed).

    ``guard`` (with ``in_place``): refuse a second backward through the same graph, whose saved
    ``a``/``b`` the first one overwrote. The modules set it; the bare op leaves it off, as liger
    does, so that a benchmark may time repeated backward passes (on meaningless values).
    """

    @staticmethod
    def forward(ctx, a, b, activation, in_place, guard):
        act = _check_inputs(a, b, activation, in_place)
        a2d, b2d, fused = _split(a, b)
        c = glu_forward(a2d, b2d, act)
        ctx.save_for_backward(a2d, b2d, fused)
        ctx.act, ctx.in_place, ctx.a_shape = act, in_place, a.shape
        ctx.b_is_none, ctx.guard, ctx.consumed = b is None, bool(guard), False
        out_shape = a.shape if b is not None else (*a.shape[:-1], a.shape[-1] // 2)
        return c.view(out_shape)

    @staticmethod
    @once_differentiable
    def backward(ctx, dc):
        if ctx.consumed:
            raise RuntimeError(_CONSUMED)
        a2d, b2d, fused = ctx.saved_tensors
        ctx.consumed = ctx.in_place and ctx.guard
        dc2d = _as_rows(dc)
        if ctx.in_place:
            da2d, db2d = a2d, b2d
        elif ctx.b_is_none:
            grad = torch.empty(fused.shape, dtype=a2d.dtype, device=a2d.device)
            da2d, db2d = grad.chunk(2, dim=1)
        else:
            da2d, db2d = torch.empty_like(a2d), torch.empty_like(b2d)
        glu_backward(dc2d, a2d, b2d, da2d, db2d, ctx.act)
        if ctx.b_is_none:
            grad = fused if ctx.in_place else grad
            return grad.view(ctx.a_shape), None, None, None, None
        return da2d.view(ctx.a_shape), db2d.view(ctx.a_shape), None, None, None


def glu(a, b=None, activation: str = "silu", in_place: bool = False, guard: bool = False) -> torch.Tensor:
    """``act(a) * b`` over ``(..., intermediate)``; ``b=None``: ``a`` is fused ``[gate | up]``."""
    return GLUFunction.apply(a, b, activation, in_place, guard)


def _compute_weight(weight: torch.Tensor, bias, dtype: torch.dtype, device_type: str):
    """The weight (and bias) in the dtype the product is multiplied in: ``dtype`` itself, or a cast
    copy under autocast (as ``nn.Linear`` would compute inside ``torch.autocast``)."""
    if weight.dtype == dtype:
        return weight, bias
    if torch.is_autocast_enabled(device_type) and torch.get_autocast_dtype(device_type) == dtype:
        return weight.to(dtype), (bias.to(dtype) if bias is not None else None)
    raise TypeError(
        f"weight must have the activations' dtype {dtype} (or run under torch.autocast to {dtype}), "
        f"got {weight.dtype}"
    )


class GLULinearFunction(torch.autograd.Function):
    """``out = linear(act(a) * b, weight, bias)`` with the product recomputed for the backward.

    Saves ``a``, ``b`` (or the fused ``[gate | up]`` tensor), ``weight`` and ``bias``: the
    ``(T, intermediate)`` product is freed as soon as the forward's matmul has read it. The
    backward writes it again into the buffer of ``dc = dout @ weight`` (see the module docstring).
    With ``in_place``, ``da``/``db`` overwrite the saved ``a``/``b``, so a second backward through
    the same graph is refused (``retain_graph=True``: use ``in_place=False``).
    """

    @staticmethod
    def forward(ctx, a, b, weight, bias, activation, in_place):
        act = _check_inputs(a, b, activation, in_place)
        check_float(weight, "weight")
        check_same_device(weight, "weight", a, "a")
        cols = a.shape[-1] if b is not None else a.shape[-1] // 2
        if weight.dim() != 2 or weight.shape[1] != cols:
            raise ValueError(
                f"weight must be 2-D (out_features, {cols}) to take the product's {cols} columns, "
                f"got shape {tuple(weight.shape)}"
            )
        if bias is not None:
            check_float(bias, "bias")
            check_same_device(bias, "bias", a, "a")
            if bias.shape != (weight.shape[0],):
                raise ValueError(f"bias must have shape ({weight.shape[0]},), got {tuple(bias.shape)}")
        w, bias_c = _compute_weight(weight, bias, a.dtype, a.device.type)
        a2d, b2d, fused = _split(a, b)
        c = glu_forward(a2d, b2d, act)
        out = F.linear(c, w, bias_c)
        del c  # not saved: recomputed in the backward
        ctx.save_for_backward(a2d, b2d, fused, weight)
        ctx.act, ctx.in_place, ctx.a_shape, ctx.b_is_none = act, in_place, a.shape, b is None
        ctx.bias_dtype = bias.dtype if bias is not None else None
        ctx.consumed = False
        return out.view(*a.shape[:-1], weight.shape[0])

    @staticmethod
    @once_differentiable
    def backward(ctx, dout):
        if ctx.consumed:
            raise RuntimeError(_CONSUMED)
        a2d, b2d, fused, weight = ctx.saved_tensors
        ctx.consumed = ctx.in_place
        dtype = a2d.dtype
        w = weight if weight.dtype == dtype else weight.to(dtype)
        dout2d = dout.reshape(-1, dout.shape[-1])
        if dout2d.dtype != dtype:
            dout2d = dout2d.to(dtype)
        dc = dout2d @ w  # (T, intermediate), contiguous; becomes the recomputed product below
        if ctx.in_place:
            da2d, db2d = a2d, b2d
        elif ctx.b_is_none:
            grad = torch.empty(fused.shape, dtype=dtype, device=a2d.device)
            da2d, db2d = grad.chunk(2, dim=1)
        else:
            da2d, db2d = torch.empty_like(a2d), torch.empty_like(b2d)
        glu_backward(dc, a2d, b2d, da2d, db2d, ctx.act, c2d=dc)
        c = dc
        dweight = dbias = None
        if ctx.needs_input_grad[2]:
            dweight = (dout2d.t() @ c).to(weight.dtype)
        if ctx.bias_dtype is not None and ctx.needs_input_grad[3]:
            dbias = dout2d.sum(0, dtype=torch.float32).to(ctx.bias_dtype)
        del c, dc
        if ctx.b_is_none:
            grad = fused if ctx.in_place else grad
            return grad.view(ctx.a_shape), None, dweight, dbias, None, None
        return da2d.view(ctx.a_shape), db2d.view(ctx.a_shape), dweight, dbias, None, None


def glu_linear(a, b, weight, bias=None, activation: str = "silu", in_place: bool = False):
    """``linear(act(a) * b, weight, bias)``, storing no product for the backward."""
    return GLULinearFunction.apply(a, b, weight, bias, activation, in_place)
