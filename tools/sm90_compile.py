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

import inspect
import os
import subprocess
import tempfile

import torch

os.environ.setdefault("TRITON_INTERPRET", "0")

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

_DTYPES = {
    torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.int64: "i64",
    torch.int32: "i32", torch.int16: "i16", torch.int8: "i8", torch.uint8: "u8", torch.bool: "i1",
}
_LAUNCH_OPTIONS = ("num_warps", "num_stages", "num_ctas", "maxnreg")
_RESULTS: dict[tuple, str] = {}
_TARGET = GPUTarget("cuda", 90, 32)


def _type_of(value) -> str:
    if isinstance(value, torch.Tensor):
        return "*" + _DTYPES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"cannot type argument {value!r}")


def _resources(cubin: bytes) -> str:
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([cuobjdump, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    line = next((ln for ln in out.splitlines() if "REG:" in ln), "")
    fields = dict(tok.split(":", 1) for tok in line.split() if ":" in tok)
    return f"regs {fields.get('REG', '?'):>3}  stack {fields.get('STACK', '?'):>4}  local {fields.get('LOCAL', '?')}"


def _pipelining(ttgir: str) -> str:
    """What the GPU's IR says of the main loops: Hopper tensor-core dots (wgmma) and loads copied
    asynchronously into shared memory, i.e. pipelined ahead of their use. A matmul whose tile loads
    are not pipelined waits on global memory every step (``async 0`` beside ``wgmma`` > 0, or only
    a few small index loads)."""
    return f"wgmma {ttgir.count('ttng.warp_group_dot ')}  async {ttgir.count('ttg.async_copy_global_to_local')}"


def _compile_only(self, *args, grid, warmup, **kwargs):
    options = {k: kwargs.pop(k) for k in _LAUNCH_OPTIONS if k in kwargs}
    bound = inspect.signature(self.fn).bind(*args, **kwargs)
    bound.apply_defaults()
    signature, constexprs = {}, {}
    for param in self.params:
        value = bound.arguments[param.name]
        if param.is_constexpr:
            signature[param.name] = "constexpr"
            constexprs[param.name] = value
        elif value is None:
            signature[param.name] = "constexpr"
            constexprs[param.name] = None
        else:
            signature[param.name] = _type_of(value)
    key = (self.fn.__name__, tuple(sorted((k, str(v)) for k, v in constexprs.items())),
           tuple(sorted(signature.items())), tuple(sorted(options.items())))
    if key not in _RESULTS:
        try:
            compiled = triton.compile(ASTSource(self, signature, constexprs), target=_TARGET, options=options)
            _RESULTS[key] = f"{_resources(compiled.asm['cubin'])}  {_pipelining(compiled.asm['ttgir'])}"
        except Exception as exc:  # report, don't stop: the point is to see every kernel
            _RESULTS[key] = f"FAILED: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    return None


JITFunction.run = _compile_only

# Outputs are never computed in this mode: let the tests run on past their checks, so that the
# backward kernels are reached and compiled too.
import tests.helpers  # noqa: E402

tests.helpers.assert_close = lambda *args, **kwargs: None


def pytest_terminal_summary(terminalreporter):
    tr = terminalreporter
    tr.section("sm_90a compile report")
    failed = 0
    for (name, constexprs, _sig, options), result in sorted(_RESULTS.items()):
        failed += result.startswith("FAILED")
        consts = ", ".join(f"{k}={v}" for k, v in constexprs)
        opts = ", ".join(f"{k}={v}" for k, v in options)
        tr.write_line(f"{name}[{consts}; {opts}]: {result}")
    tr.write_line(f"{len(_RESULTS)} kernel variants compiled, {failed} failed")
