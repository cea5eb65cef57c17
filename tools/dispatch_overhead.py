"""What the dispatcher costs per call: an op's eager route (launcher and autograd.Function called
directly) against its registered route (``torch.ops.onca.*`` through the dispatcher's Python
custom-op layers), forward + backward at a host-bound size, wall clock over back-to-back calls.

    python -m tools.dispatch_overhead            # on a GPU; prints microseconds per call
    python -m tools.dispatch_overhead --profile  # and where the eager route's host time goes

This is the measurement behind ``onca.ops._contract``'s choice to bypass the dispatcher in eager
mode; it forces the registered route by making the contract's route test always answer "traced".
"""

from __future__ import annotations

import cProfile
import pstats
import sys
import time

from unittest import mock

import torch
import triton
import triton.language as tl

from onca.functional import rms_norm
from onca.ops import _contract, rms_norm as rms_norm_module


def _per_call_us(fn, calls=300, repeats=7) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
    return best


@triton.jit
def _empty_kernel(x_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(x_ptr + offsets, tl.load(x_ptr + offsets, mask=offsets < n), mask=offsets < n)


def main() -> None:
    x = torch.randn(16, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.ones(4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)

    def step():
        x.grad = w.grad = None
        rms_norm(x, w).backward(dy)

    def native():
        x.grad = w.grad = None
        torch.nn.functional.rms_norm(x, (4096,), w, 1e-6).backward(dy)

    eager = _per_call_us(step)
    always_traced = lambda *tensors: True  # noqa: E731
    with mock.patch.object(_contract, "tracing", always_traced), \
            mock.patch.object(rms_norm_module, "tracing", always_traced):
        registered = _per_call_us(step)
    native_us = _per_call_us(native)
    print(f"rms_norm fwd+bwd, 16x4096 bf16, {torch.cuda.get_device_name()}:")
    print(f"  eager route (launcher called directly)   {eager:8.1f} us/call")
    print(f"  registered route (torch.ops.onca.*)       {registered:8.1f} us/call")
    print(f"  torch.nn.functional.rms_norm              {native_us:8.1f} us/call")
    buf = torch.zeros(16, device="cuda")
    launch_us = _per_call_us(lambda: _empty_kernel[(1,)](buf, 16, BLOCK=16))
    print(f"  one launch of a trivial Triton kernel     {launch_us:8.1f} us/call (Triton {triton.__version__})")
    if "--profile" in sys.argv:
        profile = cProfile.Profile()
        profile.runcall(lambda: [step() for _ in range(500)])
        pstats.Stats(profile).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
