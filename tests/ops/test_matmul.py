"""The gradient accumulators of the fused linear losses (``onca.ops._matmul``), on each of their paths."""

from __future__ import annotations

import pytest
import torch

from onca.ops import _matmul
from onca.ops._matmul import accumulate_dw, accumulate_mm


def _operands(dtype):
    g = torch.Generator().manual_seed(0)
    # The product 13x larger than a: the rounded fallback takes many slices.
    a, b = (torch.randn(shape, generator=g).to(dtype) for shape in ((37, 3), (3, 40)))
    return a, b


@pytest.mark.parametrize("path", ["same-dtype", "upcast", "rounded-slices"])
def test_accumulate_mm_writes_then_adds(monkeypatch, path):
    """``first`` overwrites whatever ``acc`` held (NaN here), later calls add; the rounded fallback
    (a GPU torch without ``out_dtype``) in slices no larger than ``a`` gives the same sums as one
    rounded product."""
    dtype = torch.float32 if path == "same-dtype" else torch.bfloat16
    if path == "rounded-slices":
        monkeypatch.setattr(_matmul, "upcasts_operands", lambda device_type: False)
        monkeypatch.setattr(_matmul, "has_fp32_out_dtype", lambda device_type, dtype: False)
    a, b = _operands(dtype)
    acc = torch.full((37, 40), float("nan"))
    accumulate_mm(acc, a, b, first=True)
    accumulate_mm(acc, a, b, first=False)
    product = (a @ b).float() if path == "rounded-slices" else a.float() @ b.float()
    torch.testing.assert_close(acc, 2 * product)


def test_accumulate_dw_is_the_transposed_product():
    g, h = (torch.randn(shape) for shape in ((6, 9), (6, 4)))
    dw = torch.full((9, 4), float("nan"))
    accumulate_dw(dw, g, h, first=True)
    torch.testing.assert_close(dw, g.t() @ h)
