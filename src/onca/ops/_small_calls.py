"""Host-bound calls go to torch's own op.

At a few million elements or fewer an op's GPU time is a few microseconds whoever computes it, and
the host decides the speed. Where torch computes the op as one C++ call (LayerNorm, softmax,
embedding, cross entropy, KL divergence, GroupNorm) or a few (the gated activations, ReLU², DyT,
a head followed by cross entropy, multi-token attention's masked softmax and convolution, the
total variation distance, the tiled MLP's three projections, neighborhood attention as masked
scaled dot-product attention), no
Python-launched kernel can match it there: an autograd Function alone costs more host time forward
+ backward than torch's whole op (measured on an H100 host: an empty Function 104 µs, torch's
LayerNorm of 16 tokens 68 to 154 µs). Such an op's public function therefore calls torch's op when
the call is *small*:

- eager (nothing tracing: under ``torch.compile`` the host path is gone and the graph keeps Onca's
  op, whatever the size) and outside ``torch.autocast`` (which would run several of torch's ops in
  fp32 and return fp32 where Onca's keep the input's dtype),
- on a device type in :data:`DEVICE_TYPES` (CUDA: the interpreter exists to run Onca's kernels,
  and torch_npu's ops are not measured),
- its largest tensor at most :func:`limit` elements (default :data:`DEFAULT_LIMIT`, 2**22: 8 MB in
  bf16, 16 tokens of a 256k vocabulary, 1024 tokens of a 4096-wide row; an op whose kernels win
  on the device at far fewer elements counts each element several times: multi-token attention's
  ``SMALL_CALL_WEIGHT``), and
- its options within what torch's op computes (each op says which; anything else stays Onca's).

The LM heads of the post-training losses and of ``fused_linear_logprobs`` (the chunk driver,
:mod:`onca.ops._chunked_head`) take the unfused computation the same way, their logits counted as
the largest tensor: one GEMM, torch's fp32 log-softmax and NLL (a gather that zeroes ignored labels),
autograd for the gradient.
Distillation (:mod:`onca.ops.fused_linear_distill`) likewise: one GEMM per head, then its
divergence and hard-label cross entropy in fp32.

Where ``torch.nn.functional``'s Python wrapper only checks what Onca's function has already
checked (LayerNorm, GroupNorm, embedding, cross entropy), the route calls the ATen op beneath it:
the same computation, microseconds less host time a call.

The result is torch's, to its rounding: each op's tests compare both routes. Above the limit the
kernels' fewer passes and smaller saved state pay off wherever the host runs ahead of the GPU (a
training step), even where an isolated call on a slow host is still bound by its Python path.
``ONCA_SMALL_CALL_LIMIT`` (an element count; 0 turns the route off) or :func:`set_limit` change
the limit; :data:`taken` counts the calls that took torch's route (the benchmark notes them).
"""

from __future__ import annotations

import os

import torch

from onca.ops._contract import PLAIN_TYPES

__all__ = ["DEFAULT_LIMIT", "DEVICE_TYPES", "fits", "kept", "limit", "set_limit", "small", "same_dtype"]

DEFAULT_LIMIT = 1 << 22
# Device types whose calls may take torch's route.
DEVICE_TYPES = ("cuda",)


def _limit_from_environment() -> int:
    raw = os.environ.get("ONCA_SMALL_CALL_LIMIT")
    if raw is None or raw.strip() == "":
        return DEFAULT_LIMIT
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"ONCA_SMALL_CALL_LIMIT must be a whole number of elements, got {raw!r}") from None
    if value < 0:
        raise ValueError(f"ONCA_SMALL_CALL_LIMIT must be 0 (off) or more, got {value}")
    return value


_limit = _limit_from_environment()
# Calls that took torch's route since import (read by the benchmark harness).
taken = 0


def limit() -> int:
    """The largest element count of a call that takes torch's route (0: none does)."""
    return _limit


def set_limit(elements: int) -> int:
    """Set :func:`limit` (0 turns torch's route off); returns the previous limit."""
    global _limit
    if isinstance(elements, bool) or not isinstance(elements, int) or elements < 0:
        raise ValueError(f"elements must be an int >= 0 (0 turns small calls off), got {elements!r}")
    previous, _limit = _limit, elements
    return previous


def fits(elements: int, *tensors: torch.Tensor | None) -> bool:
    """Whether a call whose largest tensor has ``elements`` elements, on ``tensors`` (the first
    decides the device; None skipped), may take torch's route (not counted: see :func:`small`).

    Every routed call pays this check, so it is written flat (no helper calls: each costs a
    fraction of a microsecond on a training host, and the route exists to save microseconds);
    it asks what :func:`onca.ops._contract.tracing` asks."""
    if elements > _limit or _limit == 0:  # first: the one check every large call pays
        return False
    device_type = tensors[0].device.type
    if (device_type not in DEVICE_TYPES or torch.compiler.is_compiling()
            or torch._C._len_torch_dispatch_stack() > 0):
        return False
    for t in tensors:
        if t is not None and type(t) not in PLAIN_TYPES:  # fake tensors, DTensor, other subclasses
            return False
    return not torch.is_autocast_enabled(device_type)


def small(elements: int, *tensors: torch.Tensor | None) -> bool:
    """:func:`fits`, counted in :data:`taken` when it does: the check of the call that then takes
    torch's route."""
    global taken
    if not fits(elements, *tensors):
        return False
    taken += 1
    return True


def same_dtype(first: torch.Tensor, *others: torch.Tensor | None) -> bool:
    """Whether every tensor given (None skipped) has ``first``'s dtype: torch's ops promote mixed
    dtypes where Onca's keep the input's, so mixed calls stay Onca's."""
    dtype = first.dtype
    for t in others:  # a loop, not all() over a generator: half the time, on every routed call
        if t is not None and t.dtype != dtype:
            return False
    return True


# Constant tensors the routes build from sizes alone (causal and window masks), by key. Never
# dropped once kept: a CUDA graph captured reading one replays reading its memory. A small call's
# mask is small (64 kB at most at the default limit), and past MAX_KEPT keys one is made per call.
_kept: dict = {}
MAX_KEPT = 64


def kept(key: tuple, make) -> torch.Tensor:
    """``make()``, kept under ``key`` (which must hold everything it depends on, the device
    included) for later calls. One made while a CUDA graph is being captured is not kept: the
    capture records the kernels that fill it without running them, so an eager call reading it
    later would read garbage."""
    tensor = _kept.get(key)
    if tensor is None:
        tensor = make()
        capturing = tensor.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        if len(_kept) < MAX_KEPT and not capturing:
            _kept[key] = tensor
    return tensor
