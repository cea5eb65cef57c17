"""Input checks shared by every op's Function boundary.

A wrong input must become a ``TypeError``/``ValueError`` that names the argument, never a wrong
answer or an illegal memory access inside a kernel.
"""

from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INDEX_DTYPES = (torch.int32, torch.int64)


def check_tensor(value, name: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    return value


def check_float(t: torch.Tensor, name: str, dtypes=FLOAT_DTYPES) -> None:
    check_tensor(t, name)
    if t.dtype not in dtypes:
        allowed = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name} must have a floating dtype ({allowed}), got {t.dtype}")


def check_index(t: torch.Tensor, name: str) -> None:
    check_tensor(t, name)
    if t.dtype not in INDEX_DTYPES:
        raise TypeError(f"{name} must be an int32 or int64 tensor of indices, got {t.dtype}")


def check_nonempty(t: torch.Tensor, name: str) -> None:
    if t.numel() == 0:
        raise ValueError(f"{name} is empty (shape {tuple(t.shape)}); Onca kernels need at least one element")


def check_same_device(t: torch.Tensor, name: str, ref: torch.Tensor, ref_name: str) -> None:
    if t.device != ref.device:
        raise ValueError(f"{name} is on {t.device} but {ref_name} is on {ref.device}; move them to one device")


def check_last_dim(t: torch.Tensor, name: str, size: int, what: str) -> None:
    if t.dim() == 0 or t.shape[-1] != size:
        raise ValueError(f"{name} must have last dimension {size} ({what}), got shape {tuple(t.shape)}")


def check_shape(t: torch.Tensor, name: str, shape: tuple[int, ...]) -> None:
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")


def as_rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a 2-D ``(rows, last_dim)`` matrix with unit column stride, copying only if needed."""
    if t.is_contiguous():  # the common case, on every launch: keep it cheap
        return t.view(-1, t.shape[-1])
    if t.dim() > 0 and t.stride(-1) != 1:
        t = t.contiguous()
    rows = t.reshape(-1, t.shape[-1])
    if rows.stride(1) != 1 or (rows.shape[0] > 1 and rows.stride(0) < rows.shape[1]):
        rows = rows.contiguous()
    return rows
