"""fp32 results from bf16/fp16 matmul operands, shared by the fused linear losses."""

from __future__ import annotations

import functools

import torch

__all__ = ["has_fp32_out_dtype"]


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
