"""fp32 results from bf16/fp16 matmul operands, and the gradient accumulators built on them, shared
by the fused linear losses."""

from __future__ import annotations

import functools

import torch
from torch import Tensor

__all__ = ["accumulate_dw", "accumulate_mm", "has_fp32_out_dtype", "upcasts_operands"]


@functools.lru_cache(maxsize=None)
def has_fp32_out_dtype(device_type: str, dtype: torch.dtype) -> bool:
    """Whether ``torch.mm`` and ``torch.addmm`` take ``out_dtype=torch.float32`` for ``dtype``
    operands on ``device_type`` (CUDA with torch >= 2.8), accumulating in fp32 without an upcast copy.

    A capability probe, run once per device type and dtype: an older torch rejects the keyword
    (``TypeError``), a device without the kernel raises ``RuntimeError``/``NotImplementedError``;
    callers then take their upcasting path.
    """
    try:
        a = torch.zeros(2, 2, dtype=dtype, device=device_type)
        c = torch.zeros(2, 2, dtype=torch.float32, device=device_type)
        torch.mm(a, a, out_dtype=torch.float32, out=c)
        torch.addmm(c, a, a, out_dtype=torch.float32, out=c)
        return True
    except (RuntimeError, TypeError, NotImplementedError):
        return False


def upcasts_operands(device_type: str) -> bool:
    """Whether a low-precision matmul without ``out_dtype`` upcasts its operands to fp32 (exact, as
    the fp32-output matmul; cheap enough on the CPU) rather than rounding the product."""
    return device_type == "cpu"


def accumulate_mm(acc: Tensor, a: Tensor, b: Tensor, *, first: bool) -> None:
    """``acc = a @ b`` (``first``: ``acc`` may be uninitialised) or ``acc += a @ b``, for an fp32
    (or the operands' own dtype) ``acc``, without rounding the product to the operands' dtype where
    torch can: CUDA's fp32-output matmul; upcast operands on the CPU. Elsewhere (a GPU torch without
    ``out_dtype``) the product is rounded, in slices of ``acc``'s rows no larger than ``a``, so the
    fallback never holds an ``acc``-sized temporary."""
    if a.dtype == acc.dtype:
        if first:
            torch.mm(a, b, out=acc)
        else:
            acc.addmm_(a, b)
    elif has_fp32_out_dtype(acc.device.type, a.dtype):
        if first:
            torch.mm(a, b, out_dtype=torch.float32, out=acc)
        else:
            torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    elif upcasts_operands(acc.device.type):
        if first:
            torch.mm(a.float(), b.float(), out=acc)
        else:
            acc.addmm_(a.float(), b.float())
    else:
        step = max(1, a.numel() // max(1, b.shape[1]))
        for r0 in range(0, acc.shape[0], step):
            part = torch.mm(a[r0:r0 + step], b)
            if first:
                acc[r0:r0 + step].copy_(part)
            else:
                acc[r0:r0 + step].add_(part)


def accumulate_dw(dw: Tensor, g: Tensor, h: Tensor, *, first: bool = False) -> None:
    """A head's weight gradient over one chunk of tokens: ``dw += g.T @ h`` (``dw = g.T @ h`` when
    ``first``: no zero-filled accumulator to read), ``g`` the chunk's ``dLoss/dLogits``, ``dw`` fp32
    or the weight's own dtype (:func:`accumulate_mm`)."""
    accumulate_mm(dw, g.t(), h.to(g.dtype), first=first)
