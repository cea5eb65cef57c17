"""Compile every kernel a test launches for an H100/H200 (sm_90a) on a machine with no GPU.

A pytest plugin for developers: it costs no device time, catches kernels that run under the
interpreter but do not compile for the GPU, and reports each kernel's registers, spills, tensor-core
dots and asynchronous (pipelined) loads.

    ONCA_DEVICE_PROFILE=h100 python -m pytest -p tools.sm90_compile tests/ops/test_rms_norm.py -q

Launches compile and then return without running; the tests' numerical checks are switched off
and other assertions may fail in this mode: read the table printed at the end, not the outcomes.
Set ONCA_DEVICE_PROFILE (h100, ascend910b4, ...) to compile the plans of that profile. Needs the ptxas that ships with
Triton's wheel (no CUDA driver).
"""

from __future__ import annotations

import os


os.environ.setdefault("TRITON_INTERPRET", "0")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import make_backend  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

from onca.audit import CudaSpecializer, compile_for_cuda, cubin_resources  # noqa: E402

_RESULTS: dict[tuple, tuple[str, str]] = {}
_TARGET = GPUTarget("cuda", 90, 32)
_SPECIALIZE = CudaSpecializer(make_backend(_TARGET))


def _resources(cubin: bytes) -> str:
    found = cubin_resources(cubin)
    registers, stack = found if found is not None else ("?", "?")
    return f"regs {registers:>3}  stack {stack:>4}"


def _pipelining(ttgir: str) -> str:
    """What the GPU's IR says of the main loops: Hopper tensor-core dots (wgmma) and loads copied
    asynchronously into shared memory, i.e. pipelined ahead of their use. A matmul whose tile loads
    are not pipelined waits on global memory every step (``async 0`` beside ``wgmma`` > 0, or only
    a few small index loads)."""
    return f"wgmma {ttgir.count('ttng.warp_group_dot ')}  async {ttgir.count('ttg.async_copy_global_to_local')}"


def _compile_only(self, *args, grid, warmup, **kwargs):
    # Specialised as Triton's JIT specialises a launch (integers divisible by 16, aligned
    # pointers): without that, masks and pointers look unaligned, no load is pipelined and the
    # registers differ from what the GPU runs.
    key, launch = _SPECIALIZE(self, *args, **kwargs)
    if key not in _RESULTS:
        try:
            compiled = compile_for_cuda(launch)
            result = f"{_resources(compiled.asm['cubin'])}  {_pipelining(compiled.asm['ttgir'])}"
        except Exception as exc:  # report, don't stop: the point is to see every kernel
            result = f"FAILED: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
        _RESULTS[key] = (_label(launch), result)
    return None


def _label(launch) -> str:
    """``kernel[CONSTEXPR=value, ...; num_warps=..., num_stages=...]``."""
    params = launch.kernel.params
    consts = sorted(f"{params[k[0] if isinstance(k, tuple) else k].name}={v}" for k, v in launch.constants.items()
                    if params[k[0] if isinstance(k, tuple) else k].is_constexpr)
    opts = launch.cuda_options
    return f"{launch.kernel.fn.__name__}[{', '.join(consts)}; num_warps={opts.num_warps}, num_stages={opts.num_stages}]"


JITFunction.run = _compile_only

# Outputs are never computed in this mode: let the tests run on past their checks, so that the
# backward kernels are reached and compiled too.
import tests.helpers  # noqa: E402

tests.helpers.assert_close = lambda *args, **kwargs: None


def pytest_terminal_summary(terminalreporter):
    tr = terminalreporter
    tr.section("sm_90a compile report")
    failed = 0
    for label, result in sorted(_RESULTS.values()):
        failed += result.startswith("FAILED")
        tr.write_line(f"{label}: {result}")
    tr.write_line(f"{len(_RESULTS)} kernel variants compiled, {failed} failed")
