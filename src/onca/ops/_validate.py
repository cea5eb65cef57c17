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


def check_same_device(t: torch.Tensor, name: str, ref: torch.Tensor, ref_name: str) -> None:
    if t.device != ref.device:
        raise ValueError(f"{name} is on {t.device} but {ref_name} is on {ref.device}; move them to one device")


def check_last_dim(t: torch.Tensor, name: str, size: int, what: str) -> None:
    if t.dim() == 0 or t.shape[-1] != size:
        raise ValueError(f"{name} must have last dimension {size} ({what}), got shape {tuple(t.shape)}")


def check_bool(value, name: str) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")


def check_accum_dtype(accum_dtype, weight_dtype: torch.dtype, name: str = "accum_dtype") -> bool:
    """Whether a weight gradient accumulated over chunks is kept in fp32: ``accum_dtype`` is None
    (the weight's own dtype), ``torch.float32`` or the weight's dtype."""
    if accum_dtype is not None and accum_dtype not in (torch.float32, weight_dtype):
        raise ValueError(f"{name} must be None, torch.float32 or the weight's dtype {weight_dtype}, "
                         f"got {accum_dtype!r}")
    return accum_dtype == torch.float32 and weight_dtype != torch.float32


def check_number(value, name: str, *, minimum: float | None = None) -> None:
    """``value`` is a real Python number (not a string, not a tensor), at least ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    if value != value or (minimum is not None and not value >= minimum):
        bound = "" if minimum is None else f" >= {minimum}"
        raise ValueError(f"{name} must be a number{bound}, got {value!r}")


def check_dim(dim, name: str, ndim: int) -> int:
    """``dim`` (an int in ``[-ndim, ndim)``, as torch takes it) as a non-negative index."""
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"{name} must be an int, got {type(dim).__name__} {dim!r}")
    if not -ndim <= dim < ndim:
        raise ValueError(f"{name} must be in [{-ndim}, {ndim - 1}] for a {ndim}-d input, got {dim}")
    return dim % ndim


# Device types with an autocast mode; torch.amp.is_autocast_available is not traceable by every
# Dynamo version Onca supports (PyTorch 2.11's refuses it), so the list is kept here.
_AUTOCAST_DEVICES = ("cpu", "cuda", "xpu", "npu", "hpu", "mps", "mtia", "xla")


def autocast_enabled(device_type: str) -> bool:
    """Whether ``torch.autocast`` is on for ``device_type`` (traceable by torch.compile)."""
    return device_type in _AUTOCAST_DEVICES and torch.is_autocast_enabled(device_type)
