"""Squared ReLU: ``y = relu(x) ** 2``, elementwise (liger-kernel's ``LigerReLUSquared``).

The activation of Primer and of Nemotron's MLP (transformers' ``ACT2FN["relu2"]``,
``ReLUSquaredActivation``: ``torch.square(torch.relu(x))``). ``y`` is computed in fp32 and stored
once in the input's dtype (torch's eager bf16 ``relu`` is exact, and its ``square`` rounds once,
so the two agree). Saved for backward: the input ``x``; the backward pass is
``dx = 2 * relu(x) * dy``, in fp32, stored in the input's dtype (0 where ``x <= 0``; NaN where
``x`` is NaN, as torch).

Elements are independent: each program takes (row block, column tile) jobs, with no reduction, so
one loop serves every plan (one job a program on a GPU, a share of them on a persistent grid).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from onca.device import DeviceProfile
from onca.ops import _small_calls as small_calls
from onca.ops._contract import custom_op, register_autograd
from onca.ops._launch import fast_launch, row_launch
from onca.ops._rows import rows_cols, rows_in_place, rows_ready
from onca.ops._validate import check_float
from onca.tiling import RowPlan, plan_rows

__all__ = ["plan", "relu_squared"]

# Live tiles (input dtype; fp32). Forward: x and y; x and y in fp32. Backward: x, dy and dx; their
# fp32 forms. An elementwise map: one (row block, column tile) job a program on a GPU (plan_rows).
FORWARD_TILES = dict(live_tiles=2, fp32_tiles=2, elementwise=True)
BACKWARD_TILES = dict(live_tiles=3, fp32_tiles=3, elementwise=True)


# ----------------------------------------------------------------------------------------- kernels


@triton.jit
def _relu(x):
    """``max(x, 0)`` that keeps NaN (``tl.maximum`` may drop it), as torch's relu does."""
    return tl.where(x > 0.0, x, tl.where(x != x, x, 0.0))


@fast_launch
@triton.jit
def _relu_squared_kernel(
    x_ptr, dy_ptr, out_ptr, n_rows, n_cols, x_row_stride, dy_row_stride, out_row_stride,
    BACKWARD: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    COL_TILES: tl.constexpr,
):
    """Forward: ``out = relu(x) ** 2``. Backward: ``out = 2 * relu(x) * dy``."""
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    n_row_blocks = tl.cdiv(n_rows, BLOCK_ROWS)
    col_offsets = tl.arange(0, BLOCK_COLS)
    for job in tl.range(pid, n_row_blocks * COL_TILES, n_programs):
        rows = (job // COL_TILES) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        row_mask = rows < n_rows
        rows64 = rows.to(tl.int64)[:, None]
        cols = (job % COL_TILES) * BLOCK_COLS + col_offsets
        mask = row_mask[:, None] & (cols < n_cols)[None, :]
        x = tl.load(x_ptr + rows64 * x_row_stride + cols[None, :], mask=mask, other=0.0)
        r = _relu(x.to(tl.float32))
        if BACKWARD:
            dy = tl.load(dy_ptr + rows64 * dy_row_stride + cols[None, :], mask=mask, other=0.0)
            out = 2.0 * r * dy.to(tl.float32)
        else:
            out = r * r
        tl.store(out_ptr + rows64 * out_row_stride + cols[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=mask)


# --------------------------------------------------------------------------------------- launchers


def plan(shape, dtype: torch.dtype, profile: DeviceProfile | None = None) -> dict[str, RowPlan]:
    """The forward and backward plans for an input of ``shape`` (``(..., cols)``)."""
    rows, cols = rows_cols(shape)
    return {
        "forward": plan_rows(rows, cols, dtype, profile=profile, **FORWARD_TILES),
        "backward": plan_rows(rows, cols, dtype, profile=profile, **BACKWARD_TILES),
    }


def _launch(x: Tensor, dy: Tensor | None) -> Tensor:
    """The forward's ``y`` (``dy`` None) or the backward's ``dx``: a new contiguous tensor of
    ``x``'s shape (any, at least 1-D; ``dy`` the same)."""
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    cols = x.shape[-1]
    x, rows, x_stride = rows_in_place(x)
    if rows == 0 or cols == 0:
        return out
    d, _, d_stride = (x, rows, x_stride) if dy is None else rows_in_place(dy)  # dy: never read forward
    backward = dy is not None
    grid, kwargs, _ = row_launch(_relu_squared_kernel, rows, cols, x.dtype,
                                 BACKWARD_TILES if backward else FORWARD_TILES, {"BACKWARD": backward})
    _relu_squared_kernel[grid](x, d, out, rows, cols, x_stride, d_stride, cols, **kwargs)
    return out


@custom_op("relu_squared_forward")
def relu_squared_forward(x: Tensor) -> Tensor:
    """``relu(x) ** 2`` for ``x`` of any shape (at least 1-D), in ``x``'s dtype. The op takes ``x``
    whole: a reshape outside it would add autograd view nodes."""
    return _launch(x, None)


@relu_squared_forward.register_fake
def _(x):
    return x.new_empty(x.shape)


@custom_op("relu_squared_backward")
def relu_squared_backward(dy: Tensor, x: Tensor) -> Tensor:
    """``dx = 2 * relu(x) * dy`` for ``x``/``dy`` of one shape, in ``x``'s dtype."""
    return _launch(x, dy)


@relu_squared_backward.register_fake
def _(dy, x):
    return x.new_empty(x.shape)


# ---------------------------------------------------------------------------------------- autograd


def _setup_context(ctx, inputs, output):
    """Saves the input ``x``."""
    (x,) = inputs
    ctx.save_for_backward(x)


def _backward(ctx, dy):
    (x,) = ctx.saved_tensors
    return relu_squared_backward(dy, x)


register_autograd(relu_squared_forward, _backward, setup_context=_setup_context)


# ------------------------------------------------------------------------------------------ public


def relu_squared(x: Tensor) -> Tensor:
    """Squared ReLU ``relu(x) ** 2`` elementwise (liger-kernel's ``liger_relu_squared``;
    transformers' ``relu2`` activation): computed in fp32, the result in ``x``'s dtype and shape.
    ``x`` may have any shape, including no elements. Saves ``x`` for the backward pass."""
    check_float(x, "x")
    if small_calls.small(x.numel(), x):
        return torch.square(torch.nn.functional.relu(x))
    if x.dim() == 0:
        return relu_squared_forward(x.reshape(1, 1)).view(())
    return relu_squared_forward(rows_ready(x))
