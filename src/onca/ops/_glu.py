"""Gated activations ``act(a) * b`` (SwiGLU, GeGLU): the kernels, launchers, custom ops and
autograd shared by ``onca.ops.swiglu`` and ``onca.ops.geglu``, which differ only in the activation.

``a`` is the gate projection and ``b`` the up projection, both ``(..., intermediate)``. Rounding
follows the Hugging Face MLPs (``act_fn(gate) * up`` in the input dtype): the activation is
computed in fp32 and rounded to the input dtype, the product is computed in fp32 and rounded again.

Multipliers (Falcon-H1 / Granite muP, as liger-kernel defines them): ``gate_multiplier`` scales the
gate before the activation (``act(a * gate_multiplier)``, the scaled gate rounded to the input
dtype as ``gate_proj(x) * gate_multiplier`` is in the model); ``down_multiplier`` scales the
result of the down projection. It is linear, so the kernels fold it into the product (``c =
act(...) * b * down_multiplier``, one rounding), and the MLP tail scales its bias by it too: the
tail's output is ``down_multiplier * linear(act(...) * b, W, bias)``, Falcon-H1's
``down_proj(y) * down_multiplier``. Both are plain multiplications inside the kernels.

Layouts: ``a`` and ``b`` may be strided views whose rows are not contiguous (unit column stride,
any row stride), such as the two halves of Phi-3's fused ``gate_up_proj`` output
(``(T, 2I).chunk(2, -1)``); the kernels take row strides, so no copy is made. ``b=None`` means
``a`` *is* the fused ``[gate | up]`` tensor ``(..., 2I)``; its gradient is then one ``(..., 2I)``
tensor, with no ``torch.cat`` in the backward pass.

Each op is a pair of custom ops registered by :func:`register_gated` (``<op>_forward``,
``<op>_backward``) or :func:`register_gated_linear` (the MLP tail):

- gated: ``c = act(a) * b``. Saves ``a`` and ``b`` (not ``act(a)``: the backward recomputes it).
  ``overwrite_inputs=True`` writes ``da`` and ``db`` into the storage of ``a`` and ``b`` (as
  liger-kernel always does), so the backward allocates nothing; the caller must not use ``a`` or
  ``b`` afterwards, and a second backward through the same graph is refused.
- gated linear: ``out = linear(act(a) * b, weight, bias)``, the MLP tail. The product ``c`` is
  *not* stored for the weight gradient: the backward computes ``dc = dout @ weight``, then one
  kernel reads ``a, b, dc`` and writes ``da``, ``db`` and the recomputed ``c`` (``c`` over ``dc``'s
  buffer, ``da``/``db`` over ``a``/``b`` with ``overwrite_inputs``), then ``dweight = dout^T @ c``.
  Between forward and backward an MLP so keeps two ``(T, intermediate)`` tensors (``a``, ``b``)
  where ``nn.Linear`` + liger keep three (``a``, ``b``, ``c``), and its backward peaks at three
  (``a``, ``b``, ``dc``) where liger's peaks at four.

``overwrite_inputs`` acts on the eager route only: a traced graph (``torch.compile``) writes new
buffers and mutates nothing.

Every kernel loops over (row block, column tile) jobs (``for job in tl.range(pid, n_row_blocks *
COL_TILES, n_programs)``): elements are independent, so there is no reduction, and one loop serves
the single-tile and the column-tiled plans alike. On a GPU the grid has a program per job; a
persistent plan (Ascend) gives each program its share of them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from onca.device import DeviceProfile
from onca.ops import _small_calls as small_calls
from onca.ops._contract import Op, custom_op, register_autograd, tracing
from onca.ops._launch import fast_launch, row_launch
from onca.ops._rows import rows_cols, rows_in_place, rows_ready
from onca.ops._validate import check_bool, check_float, check_number, check_same_device, check_tensor
from onca.tiling import RowPlan, plan_rows

__all__ = ["ACTIVATIONS", "gated", "gated_linear", "plan", "register_gated", "register_gated_linear"]

# The activation constexpr of the kernels.
ACTIVATIONS = {"silu": 0, "gelu_tanh": 1, "gelu": 2}

# Live tiles of each kernel (input-dtype tiles, fp32 tiles), as the planner counts them.
# Every kernel is an elementwise map: one (row block, column tile) job a program on a GPU (see
# ``plan_rows``).
FORWARD_TILES = dict(live_tiles=3, fp32_tiles=4, elementwise=True)  # a, b, c; a, b, act(a), c in fp32
# dc, a, b, da, db; dc, a, b, act, act', da/db in fp32
BACKWARD_TILES = dict(live_tiles=5, fp32_tiles=6, elementwise=True)
# The MLP tail's backward also stores the recomputed product.
PRODUCT_BACKWARD_TILES = dict(live_tiles=6, fp32_tiles=7, elementwise=True)


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
def _scaled_gate(a, gate_multiplier, DTYPE: tl.constexpr):
    """``a * gate_multiplier`` in fp32, rounded to the input dtype as the model's scaled gate."""
    return (a.to(tl.float32) * gate_multiplier).to(DTYPE).to(tl.float32)


@fast_launch
@triton.jit
def _glu_forward_kernel(
    a_ptr, b_ptr, c_ptr,
    n_rows, n_cols, a_row_stride, b_row_stride, c_row_stride,
    gate_multiplier, down_multiplier,
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
    for job in tl.range(pid, n_row_blocks * COL_TILES, n_programs):
        rows = (job // COL_TILES) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        row_mask = rows < n_rows
        rows64 = rows.to(tl.int64)[:, None]
        cols = ((job % COL_TILES) * BLOCK_COLS + col_offsets)[None, :]
        mask = row_mask[:, None] & (cols < n_cols)
        a = _scaled_gate(tl.load(a_ptr + rows64 * a_row_stride + cols, mask=mask, other=0.0), gate_multiplier,
                         DTYPE)
        h, _ = _activation(a, ACTIVATION, False)
        # act(a) rounded to the input dtype, as the Hugging Face MLP materialises it
        h = h.to(DTYPE).to(tl.float32)
        b = tl.load(b_ptr + rows64 * b_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(c_ptr + rows64 * c_row_stride + cols, (h * b * down_multiplier).to(DTYPE), mask=mask)


@fast_launch
@triton.jit
def _glu_backward_kernel(
    dc_ptr, a_ptr, b_ptr, da_ptr, db_ptr, c_ptr,
    n_rows, n_cols,
    dc_row_stride, a_row_stride, b_row_stride, da_row_stride, db_row_stride, c_row_stride,
    gate_multiplier, down_multiplier,
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
    for job in tl.range(pid, n_row_blocks * COL_TILES, n_programs):
        rows = (job // COL_TILES) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        row_mask = rows < n_rows
        rows64 = rows.to(tl.int64)[:, None]
        cols = ((job % COL_TILES) * BLOCK_COLS + col_offsets)[None, :]
        mask = row_mask[:, None] & (cols < n_cols)
        # the gradient of the unscaled product act(a) * b
        dp = tl.load(dc_ptr + rows64 * dc_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
        dp = dp * down_multiplier
        a = _scaled_gate(tl.load(a_ptr + rows64 * a_row_stride + cols, mask=mask, other=0.0), gate_multiplier,
                         DTYPE)
        b = tl.load(b_ptr + rows64 * b_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
        h, dh = _activation(a, ACTIVATION, True)
        h = h.to(DTYPE).to(tl.float32)  # the rounded act(a) the forward multiplied by
        if STORE_C:
            tl.store(c_ptr + rows64 * c_row_stride + cols, (h * b * down_multiplier).to(DTYPE), mask=mask)
        tl.store(da_ptr + rows64 * da_row_stride + cols, (dp * b * dh * gate_multiplier).to(DTYPE), mask=mask)
        tl.store(db_ptr + rows64 * db_row_stride + cols, (dp * h).to(DTYPE), mask=mask)


# --------------------------------------------------------------------------------------- launchers


def plan(shape, dtype: torch.dtype, profile: DeviceProfile | None = None) -> dict[str, RowPlan]:
    """The plans for ``a`` of ``shape`` ``(..., intermediate)``: the op's forward and backward, and
    the MLP tail's backward (which also writes the recomputed product)."""
    rows, cols = rows_cols(shape)
    return {
        "forward": plan_rows(rows, cols, dtype, profile=profile, **FORWARD_TILES),
        "backward": plan_rows(rows, cols, dtype, profile=profile, **BACKWARD_TILES),
        "product_backward": plan_rows(rows, cols, dtype, profile=profile, **PRODUCT_BACKWARD_TILES),
    }


def _halves(gate: Tensor, up: Tensor | None) -> tuple[Tensor, Tensor]:
    """The gate and up inputs; with ``up=None``, ``gate`` is ``[gate | up]`` and they are its
    halves (views over its rows)."""
    if up is None:
        half = gate.shape[-1] // 2
        return gate[..., :half], gate[..., half:]
    return gate, up


def _product(a: Tensor, b: Tensor, activation: int, gate_multiplier: float,
             down_multiplier: float) -> Tensor:
    """``act(a * gate_multiplier) * b * down_multiplier``, a new contiguous tensor of ``a``'s
    shape (``a`` and ``b`` of any leading shape, the same)."""
    cols = a.shape[-1]
    c = a.new_empty(a.shape)
    a, rows, a_stride = rows_in_place(a)
    if rows == 0 or cols == 0:
        return c
    b, _, b_stride = rows_in_place(b)
    grid, kwargs, _ = row_launch(_glu_forward_kernel, rows, cols, a.dtype, FORWARD_TILES,
                                 {"ACTIVATION": activation})
    _glu_forward_kernel[grid](a, b, c, rows, cols, a_stride, b_stride, cols, gate_multiplier, down_multiplier,
                              **kwargs)
    return c


def _product_backward(dc, a, b, da, db, activation: int, gate_multiplier: float, down_multiplier: float,
                      product: Tensor | None = None) -> None:
    """Write ``da`` and ``db`` for ``dc`` (and, if given, the recomputed product into ``product``);
    every tensor of ``a``'s leading shape and columns, read and written in place."""
    cols = a.shape[-1]
    a, rows, a_stride = rows_in_place(a)
    if rows == 0 or cols == 0:
        return
    store_c = product is not None
    c = product if store_c else dc  # unused (never stored to) without STORE_C
    dc, _, dc_stride = rows_in_place(dc)
    b, _, b_stride = rows_in_place(b)
    c, _, c_stride = rows_in_place(c)
    # The gradients are written in place: each is a contiguous tensor or a half of one.
    da_stride, db_stride = _row_stride_of_output(da), _row_stride_of_output(db)
    grid, kwargs, _ = row_launch(_glu_backward_kernel, rows, cols, a.dtype,
                                 PRODUCT_BACKWARD_TILES if store_c else BACKWARD_TILES,
                                 {"ACTIVATION": activation, "STORE_C": store_c})
    _glu_backward_kernel[grid](dc, a, b, da, db, c, rows, cols, dc_stride, a_stride, b_stride, da_stride,
                               db_stride, c_stride, gate_multiplier, down_multiplier, **kwargs)


def _row_stride_of_output(t: Tensor) -> int:
    """The row stride of a gradient the kernel writes: a contiguous tensor, or a half of one (an
    input overwritten in place, or the ``[gate | up]`` gradient), which reads in place."""
    ready, _, stride = rows_in_place(t)
    if ready is not t:
        raise RuntimeError("internal: a gated-activation gradient must be one the kernel writes in place")
    return stride


def _input_gradients(gate: Tensor, up: Tensor | None, overwrite_inputs: bool):
    """``(d_gate, d_up)`` as the backward op returns them (``d_up`` empty when ``up`` is None) and
    the ``(da, db)`` row views the kernel writes: over ``gate``/``up`` themselves when
    ``overwrite_inputs``, else in new tensors."""
    if overwrite_inputs:
        # New tensor objects over the inputs' storage: autograd hands a gradient to a leaf's .grad
        # without a copy only when nothing else holds the tensor object (the caller holds gate).
        d_gate, d_up = gate.detach(), None if up is None else up.detach()
    else:
        d_gate = gate.new_empty(gate.shape)
        d_up = None if up is None else up.new_empty(up.shape)
    da, db = _halves(d_gate, d_up)
    return d_gate, (gate.new_empty(0) if d_up is None else d_up), da, db


def _fake_input_gradients(gate: Tensor, up: Tensor | None) -> tuple[Tensor, Tensor]:
    """The shapes of ``_input_gradients``' new tensors (``overwrite_inputs`` is eager only)."""
    return gate.new_empty(gate.shape), gate.new_empty(0) if up is None else up.new_empty(up.shape)


def _in_dtype(t: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    return t if t is None or t.dtype == dtype else t.to(dtype)


# ---------------------------------------------------------------------------------------- autograd


_OVERWRITTEN = (
    "this gated-activation backward has already written its gradients over the saved inputs "
    "(overwrite_inputs=True); to backward twice through one graph (retain_graph=True), use "
    "overwrite_inputs=False"
)


def _save_options(ctx, activation, gate_multiplier, down_multiplier, overwrite_inputs) -> None:
    ctx.activation, ctx.gate_multiplier, ctx.down_multiplier = activation, gate_multiplier, down_multiplier
    ctx.overwrite_inputs = overwrite_inputs
    ctx.inputs_overwritten = False


def _overwrite_now(ctx, *tensors) -> bool:
    """Whether this backward writes over the saved inputs: where the caller asked, on the eager
    route only. A backward after one that did would read gradients as inputs: refused."""
    if ctx.inputs_overwritten:
        raise RuntimeError(_OVERWRITTEN)
    ctx.inputs_overwritten = ctx.overwrite_inputs and not tracing(*tensors)
    return ctx.inputs_overwritten


def register_gated(name: str) -> tuple[Op, Op]:
    """Register ``<name>_forward`` (``c = act(a) * b``) and ``<name>_backward`` with autograd."""

    @custom_op(f"{name}_forward")
    def forward(gate: Tensor, up: Tensor | None, activation: int, gate_multiplier: float,
                down_multiplier: float, overwrite_inputs: bool) -> Tensor:
        """The product, in ``gate``'s leading shape; ``up=None``: ``gate`` is ``[gate | up]``.
        ``overwrite_inputs`` is the backward's."""
        return _product(*_halves(gate, up), activation, gate_multiplier, down_multiplier)

    @forward.register_fake
    def _(gate, up, activation, gate_multiplier, down_multiplier, overwrite_inputs):
        a, _ = _halves(gate, up)
        return a.new_empty(a.shape)

    @custom_op(f"{name}_backward")
    def backward(dc: Tensor, gate: Tensor, up: Tensor | None, activation: int, gate_multiplier: float,
                 down_multiplier: float, overwrite_inputs: bool) -> tuple[Tensor, Tensor]:
        """``(d_gate, d_up)``; ``up=None``: ``d_gate`` is the ``[gate | up]`` gradient, ``d_up``
        empty. With ``overwrite_inputs`` (eager route only) they are ``gate`` and ``up``."""
        d_gate, d_up, da, db = _input_gradients(gate, up, overwrite_inputs)
        a, b = _halves(gate, up)
        _product_backward(dc, a, b, da, db, activation, gate_multiplier, down_multiplier)
        return d_gate, d_up

    @backward.register_fake
    def _(dc, gate, up, activation, gate_multiplier, down_multiplier, overwrite_inputs):
        return _fake_input_gradients(gate, up)

    def setup_context(ctx, inputs, output):
        gate, up, *options = inputs
        ctx.save_for_backward(gate, up)
        _save_options(ctx, *options)

    def backward_of_forward(ctx, dc):
        gate, up = ctx.saved_tensors
        overwrite = _overwrite_now(ctx, dc, gate, up)
        d_gate, d_up = backward(dc, gate, up, ctx.activation, ctx.gate_multiplier,
                                ctx.down_multiplier, overwrite)
        return d_gate, (None if up is None else d_up), None, None, None, None

    register_autograd(forward, backward_of_forward, setup_context=setup_context)
    return forward, backward


def register_gated_linear(name: str) -> tuple[Op, Op]:
    """Register ``<name>_forward`` (``linear(act(a) * b, weight, bias)``, no product saved) and
    ``<name>_backward`` with autograd."""

    @custom_op(f"{name}_forward")
    def forward(gate: Tensor, up: Tensor | None, weight: Tensor, bias: Tensor | None, activation: int,
                gate_multiplier: float, down_multiplier: float, overwrite_inputs: bool) -> Tensor:
        """``down_multiplier * linear(product, weight, bias)`` in ``gate``'s dtype (the weight and
        bias cast to it where they differ, as under autocast); the product is freed here."""
        dtype = gate.dtype
        product = _product(*_halves(gate, up), activation, gate_multiplier, down_multiplier)
        bias = _in_dtype(bias, dtype)
        if bias is not None and down_multiplier != 1.0:
            bias = bias * down_multiplier
        return F.linear(product, _in_dtype(weight, dtype), bias)

    @forward.register_fake
    def _(gate, up, weight, bias, activation, gate_multiplier, down_multiplier, overwrite_inputs):
        return gate.new_empty((*gate.shape[:-1], weight.shape[0]))

    @custom_op(f"{name}_backward")
    def backward(dout: Tensor, gate: Tensor, up: Tensor | None, weight: Tensor, bias: Tensor | None,
                 activation: int, gate_multiplier: float, down_multiplier: float, overwrite_inputs: bool,
                 weight_grad: bool, bias_grad: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """``(d_gate, d_up, d_weight, d_bias)``, each empty where not wanted (``d_up`` with
        ``up=None``, whose ``d_gate`` is the ``[gate | up]`` gradient)."""
        dtype = gate.dtype
        dout = _in_dtype(dout, dtype)
        d_product = dout @ _in_dtype(weight, dtype)  # (T, intermediate); then the recomputed product
        d_gate, d_up, da, db = _input_gradients(gate, up, overwrite_inputs)
        a, b = _halves(gate, up)
        _product_backward(d_product, a, b, da, db, activation, gate_multiplier, down_multiplier,
                          product=d_product)
        # The parameter gradients sum over every leading position: as one matrix of rows.
        dout_rows = dout.reshape(-1, dout.shape[-1])
        d_weight = (dout_rows.t() @ d_product.reshape(-1, d_product.shape[-1])).to(weight.dtype) \
            if weight_grad else weight.new_empty(0)
        d_bias = weight.new_empty(0)
        if bias is not None and bias_grad:
            d_bias = dout_rows.sum(0, dtype=torch.float32)
            if down_multiplier != 1.0:
                d_bias = d_bias * down_multiplier
            d_bias = d_bias.to(bias.dtype)
        return d_gate, d_up, d_weight, d_bias

    @backward.register_fake
    def _(dout, gate, up, weight, bias, activation, gate_multiplier, down_multiplier, overwrite_inputs,
          weight_grad, bias_grad):
        d_weight = weight.new_empty(weight.shape if weight_grad else 0)
        d_bias = bias.new_empty(bias.shape) if bias is not None and bias_grad else weight.new_empty(0)
        return (*_fake_input_gradients(gate, up), d_weight, d_bias)

    def setup_context(ctx, inputs, output):
        gate, up, weight, bias, *options = inputs
        ctx.save_for_backward(gate, up, weight, bias)
        _save_options(ctx, *options)

    def backward_of_forward(ctx, dout):
        gate, up, weight, bias = ctx.saved_tensors
        overwrite = _overwrite_now(ctx, dout, gate, up)
        weight_grad, bias_grad = ctx.needs_input_grad[2], ctx.needs_input_grad[3]
        d_gate, d_up, d_weight, d_bias = backward(
            dout, gate, up, weight, bias, ctx.activation, ctx.gate_multiplier,
            ctx.down_multiplier, overwrite, weight_grad, bias_grad,
        )
        return (d_gate, None if up is None else d_up, d_weight if weight_grad else None,
                d_bias if bias is not None and bias_grad else None, None, None, None, None)

    register_autograd(forward, backward_of_forward, setup_context=setup_context)
    return forward, backward


# ------------------------------------------------------------------------------------------ public


def _check_gated(a, b, activation: str, gate_multiplier, down_multiplier, overwrite_inputs) -> int:
    check_float(a, "a")
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
    check_number(gate_multiplier, "gate_multiplier")
    check_number(down_multiplier, "down_multiplier")
    check_bool(overwrite_inputs, "overwrite_inputs")
    # Meta tensors (onca audit's launch recording) have no memory to alias: every data_ptr is 0.
    if (overwrite_inputs and b is not None and not tracing(a, b) and a.numel() and a.device.type != "meta"
            and a.data_ptr() == b.data_ptr()):
        raise ValueError("overwrite_inputs=True needs a and b in separate memory (they alias)")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {sorted(ACTIVATIONS)}, got {activation!r}")
    return ACTIVATIONS[activation]


def _check_linear(a, b, weight, bias) -> None:
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
    dtype, device_type = a.dtype, a.device.type
    autocast_to_dtype = (torch.is_autocast_enabled(device_type)
                         and torch.get_autocast_dtype(device_type) == dtype)
    if weight.dtype != dtype and not autocast_to_dtype:
        raise TypeError(
            f"weight must have the activations' dtype {dtype} (or run under torch.autocast to "
            f"{dtype}), got {weight.dtype}"
        )


def gated(forward: Op, a, b, activation: str, gate_multiplier, down_multiplier, overwrite_inputs) -> Tensor:
    """Validate, then ``act(a * gate_multiplier) * b * down_multiplier`` through ``forward`` (a
    :func:`register_gated` op), in ``a``'s leading shape."""
    act = _check_gated(a, b, activation, gate_multiplier, down_multiplier, overwrite_inputs)
    # overwrite_inputs only lets the op reuse a and b: torch's route allocates instead.
    if gate_multiplier == 1.0 and down_multiplier == 1.0 and small_calls.small(a.numel(), a, b):
        return _torch_gated(a, b, activation)
    return forward(rows_ready(a), None if b is None else rows_ready(b), act, float(gate_multiplier),
                   float(down_multiplier), overwrite_inputs)


# torch's activation of each form: what a Hugging Face MLP computes, rounded as the kernels round
# (the activation to the input dtype, then the product).
_TORCH_ACTIVATIONS = {
    "silu": F.silu,
    "gelu_tanh": lambda a: F.gelu(a, approximate="tanh"),
    "gelu": F.gelu,
}


def _torch_gated(a: Tensor, b: Tensor | None, activation: str) -> Tensor:
    """A small call's product by torch's ops (:mod:`onca.ops._small_calls`)."""
    if b is None:
        a, b = a.chunk(2, dim=-1)
    return _TORCH_ACTIVATIONS[activation](a) * b


def gated_linear(forward: Op, a, b, weight, bias, activation: str, gate_multiplier, down_multiplier,
                 overwrite_inputs) -> Tensor:
    """Validate, then ``down_multiplier * linear(act(a * gate_multiplier) * b, weight, bias)``
    through ``forward`` (a :func:`register_gated_linear` op), in ``a``'s leading shape."""
    act = _check_gated(a, b, activation, gate_multiplier, down_multiplier, overwrite_inputs)
    _check_linear(a, b, weight, bias)
    return forward(rows_ready(a), None if b is None else rows_ready(b), weight, bias, act,
                   float(gate_multiplier), float(down_multiplier), overwrite_inputs)
