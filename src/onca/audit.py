"""Compile every Onca kernel without the device: with triton-ascend up to Linalg (``--ascend``), or
with stock Triton for an NVIDIA GPU down to a cubin by Triton's own ptxas (``--cuda``).

For each Ascend profile and each model configuration of an op's benchmark D2 sweep, the op's
benchmark runs forward and backward on ``meta`` tensors while a recording stand-in replaces
``JITFunction.run``: every ``kernel[grid](...)`` call is bound as Triton would bind it (signature,
specialisation, constexprs) and recorded instead of launched. The contract's "no host
synchronisation" is what makes this sound: which kernels launch never depends on tensor data.

Launches that compile identically (same kernel, signature, constexprs and compiler family) are
compiled once, through triton-ascend's ``ttir`` and ``ttadapter`` (Linalg) stages. The next stage,
``bishengir-compile`` to an NPU binary, needs CANN and is not run here.

``--ascend`` needs triton-ascend in place of stock Triton (``pip install triton-ascend==3.2.0
pybind11`` in its own environment). ``--cuda`` compiles with the installed Triton for each GPU
profile's compute capability (the plans of that profile, the cubin Triton would launch), so a
kernel that the interpreter runs but NVIDIA's compiler rejects, or whose cubin needs more shared
memory than the profile's GPUs give a program, fails on a machine without a GPU.
Both need ``TRITON_INTERPRET=0`` before Onca is imported, so that kernels are compiled
``JITFunction``s rather than interpreted ones: run them as ``onca audit --ascend`` / ``--cuda``.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import math
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import torch

from onca import device
from onca.bench import harness
from onca.bench.spec import build
from onca.ops._launch import programs_fitting

__all__ = ["ASCEND_TARGETS", "CUDA_TARGETS", "Launch", "collect", "compile_to_linalg", "compile_for_cuda",
           "cubin_resources", "shared_memory_error", "main"]

# Each Onca profile, as the chip name triton-ascend targets. The 950 family is "Ascend910_95xx"
# there and is compiled with ``compile_on_910_95``; the 910B parts share one code path.
ASCEND_TARGETS = {
    "ascend910b2": "Ascend910B2",
    "ascend910b4": "Ascend910B4",
    "ascend950": "Ascend910_9589",
}
# Each GPU profile audited with --cuda, as the compute capability compiled for. The H200 shares the
# H100's plans' limits and architecture (one is enough); the generic profile, which every GPU that
# is not an H100, H200 or A100 starts from, is compiled for sm_86 (its 99 KiB of shared memory is
# the A10's, RTX 30's and sm_89's L4, L40S and RTX 40's; an sm_86 cubin also runs on sm_89).
CUDA_TARGETS = {"h100": 90, "a100": 80, "cuda-generic": 86}
# triton-ascend refuses to launch a grid of more programs than this (runtime/jit.py).
MAX_GRID = 65535
# The benchmarks' training dtype, and fp32, which takes other paths (e.g. embedding's atomic backward).
DTYPES = (torch.bfloat16, torch.float32)


@dataclass
class Launch:
    """One distinct compilation, and every (profile, model) whose launches need it."""

    kernel: object  # triton.runtime.JITFunction
    signature: dict
    constants: dict
    attrs: object
    on_910_95: bool
    users: set = field(default_factory=set)
    max_grid: int = 0
    cuda_options: object = None  # --cuda: the options Triton parsed for this launch (None: Ascend)
    cuda_arch: int = 0  # --cuda: the compute capability compiled for

    @property
    def profiles(self) -> list[str]:
        """The profiles whose plans need this compilation (a user is ``profile/model``)."""
        return sorted({u.split("/")[0] for u in self.users})

    @property
    def name(self) -> str:
        return f"{self.kernel.fn.__module__.rsplit('.', 1)[-1]}.{self.kernel.fn.__name__}"

    def sort_key(self) -> tuple:
        return (self.name, self.describe_types(), self.describe_constants(), self.on_910_95)

    def describe_types(self) -> str:
        return "/".join(sorted({t for t in self.signature.values() if t.startswith("*")}))

    def describe_constants(self) -> str:
        names = {p.name for p in self.kernel.params if p.is_constexpr}
        # Stock Triton keys its constexprs by argument path ((index,)), triton-ascend by name.
        constants = {(self.kernel.params[k[0]].name if isinstance(k, tuple) else k): v
                     for k, v in self.constants.items()}
        shown = {k: v for k, v in constants.items() if k in names}
        return ", ".join(f"{k}={getattr(v, 'name', v)}" for k, v in sorted(shown.items()))


def _launch_key(kernel, signature, constants, on_910_95) -> tuple:
    return (kernel, tuple(signature.items()), tuple((k, repr(v)) for k, v in constants.items()), on_910_95)


@contextlib.contextmanager
def _launches_replaced_by(record):
    """Every ``kernel[grid](...)`` calls ``record`` instead of launching, while inside."""
    from triton.runtime.jit import JITFunction

    from onca.ops._launch import through_triton

    original = JITFunction.run
    JITFunction.run = record
    try:
        with through_triton():
            yield
    finally:
        JITFunction.run = original


def _recording(backend, on_910_95: bool, user: str, launches: dict):
    """Replace kernel launches with recording their compilation inputs (as triton-ascend's
    ``JITFunction.run`` computes them) into ``launches``."""

    def record(kernel, *args, grid, warmup, **kwargs):
        if kernel.binder is None:
            kernel.create_binder(backend)
        bound, sig_and_spec, _, _, _ = kernel.binder(*args, **kwargs)
        names = [kernel.params[i].name for i in kernel.non_constexpr_indices]
        signature = {k: ("*i8" if v == "none" else v) for k, v in zip(names, sig_and_spec[: len(names)])}
        values = tuple(bound.values())
        attrs = backend.get_attrs_descriptor(kernel.params, values)
        constant_params = attrs.get_constants()
        constants = {p.name: v for v, p in zip(values, kernel.params)
                     if p.is_constexpr or p.num in constant_params or v is None}
        grid = grid(bound) if callable(grid) else grid
        programs = 1
        for size in grid:
            programs *= size
        key = _launch_key(kernel, signature, constants, on_910_95)
        launch = launches.setdefault(key, Launch(kernel, signature, constants, attrs, on_910_95))
        launch.users.add(user)
        launch.max_grid = max(launch.max_grid, programs)

    return _launches_replaced_by(record)


class CudaSpecializer:
    """A launch's compilation inputs as stock Triton's ``JITFunction.run`` computes them for
    ``backend``'s target: its signature, constants and specialisation (integers divisible by 16,
    aligned pointers), as a ``Launch`` and a key that tells distinct compilations apart."""

    def __init__(self, backend):
        self.backend, self.binders = backend, {}

    def __call__(self, kernel, *args, **kwargs) -> tuple[tuple, Launch]:
        from triton.runtime.jit import create_function_from_signature

        binder = self.binders.get(kernel)
        if binder is None:
            binder = self.binders[kernel] = create_function_from_signature(kernel.signature, kernel.params,
                                                                           self.backend)
        bound, specialization, options = binder(*args, **kwargs)
        options, signature, constants, attrs = kernel._pack_args(self.backend, kwargs, bound, specialization,
                                                                 options)
        # Two architectures can parse to the same options: the target is part of the key.
        key = (kernel, self.backend.target.arch, tuple(signature.items()), repr(constants), repr(attrs),
               repr(options))
        return key, Launch(kernel, signature, constants, attrs, False, cuda_options=options,
                           cuda_arch=self.backend.target.arch)


def _recording_cuda(backend, user: str, launches: dict):
    """Replace kernel launches with recording their compilation inputs into ``launches``."""
    specialize = CudaSpecializer(backend)

    def record(kernel, *args, grid, warmup, **kwargs):
        key, launch = specialize(kernel, *args, **kwargs)
        launch = launches.setdefault(key, launch)
        launch.users.add(user)
        if not callable(grid):  # Onca's launches pass tuples; a callable grid's size is not known here
            launch.max_grid = max(launch.max_grid, math.prod(grid))

    return _launches_replaced_by(record)


def _run_point(bench, params, dtype) -> None:
    """The op's forward and backward, as the benchmark's ``full`` mode runs them, on meta tensors."""
    inputs = bench.make_inputs(params, dtype, "meta")
    result = build(bench.audit or bench.onca, params, inputs)()
    items = result if isinstance(result, (tuple, list)) else (result,)
    outs = [t for t in items if isinstance(t, torch.Tensor) and t.requires_grad]
    torch.autograd.backward(outs, [torch.ones_like(t) for t in outs])


def _recorder(profile: str, launches: dict):
    """``user -> context manager`` recording one point's launches for ``profile``'s compiler."""
    from triton.backends.compiler import GPUTarget

    if profile in CUDA_TARGETS:
        from triton.compiler import make_backend

        backend = make_backend(GPUTarget("cuda", CUDA_TARGETS[profile], 32))
        return lambda user: _recording_cuda(backend, user, launches)
    from triton.backends.ascend.compiler import AscendBackend

    backend = AscendBackend(GPUTarget("npu", ASCEND_TARGETS[profile], 0))
    return lambda user: _recording(backend, profile == "ascend950", user, launches)


def collect(ops: list[str], profiles: list[str]) -> tuple[dict, list[str]]:
    """Every distinct compilation the ops' D2 sweeps need under ``profiles`` (Ascend or GPU ones),
    and the points that could not be run (with their error)."""
    launches: dict = {}
    failures = []
    for profile in profiles:
        os.environ["ONCA_DEVICE_PROFILE"] = profile
        device.reset()
        recording = _recorder(profile, launches)
        for op in ops:
            bench = harness.load(op)
            for sweep in bench.sweep("d2"):
                for (model, params), dtype in itertools.product(sweep.points, DTYPES):
                    user = f"{profile}/{model}"
                    try:
                        with recording(user):
                            _run_point(bench, params, dtype)
                    except Exception as exc:  # reported with the point, the others still run
                        failures.append(f"FAIL {op} {user} {dtype}: not collected: "
                                        f"{type(exc).__name__}: {exc}")
    return launches, failures


def compile_to_linalg(launch: Launch) -> str:
    """Lower one launch through ``ttir`` and ``ttadapter``; the Linalg module's text."""
    from triton._C.libtriton import ir
    from triton.backends.ascend.compiler import AscendBackend, make_ttir, ttir_to_linalg
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import ASTSource

    target = ASCEND_TARGETS["ascend950" if launch.on_910_95 else "ascend910b4"]
    backend = AscendBackend(GPUTarget("npu", target, 0))
    options = backend.parse_options({"compile_on_910_95": launch.on_910_95,
                                     "enable_select_analysis": launch.on_910_95})
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    source = ASTSource(launch.kernel, launch.signature, launch.constants, launch.attrs)
    module = source.make_ir(options, backend.get_codegen_implementation(), backend.get_module_map(), context)
    metadata = dict(options.__dict__)
    ttir = make_ttir(module, metadata, options)
    return ttir_to_linalg(ttir, metadata, options, named_ops=True)


def compile_for_cuda(launch: Launch) -> object:
    """Compile one launch with the installed Triton down to the cubin it would launch (Triton's own
    ptxas; no GPU needed); returns the compiled kernel."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import ASTSource

    target = GPUTarget("cuda", launch.cuda_arch, 32)
    source = ASTSource(launch.kernel, launch.signature, launch.constants, launch.attrs)
    return triton.compile(source, target=target, options=launch.cuda_options.__dict__)


def cubin_resources(cubin: bytes) -> tuple[int, int] | None:
    """``(registers per thread, stack bytes per thread)`` of a cubin, by the ``cuobjdump`` that ships
    with Triton's NVIDIA backend (None without it). Stack bytes are registers spilled to local
    memory: on sm_90, a kernel of 1024 threads has at most 64 registers each."""
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(tool):
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    line = next((ln for ln in out.splitlines() if "REG:" in ln), "")
    fields = dict(tok.split(":", 1) for tok in line.split() if ":" in tok)
    try:
        return int(fields["REG"]), int(fields["STACK"])
    except (KeyError, ValueError):
        return None


def _error_message(exc: Exception) -> str:
    """The compiler's own words: the adapter's stderr, else the exception, on one line."""
    if isinstance(exc, subprocess.CalledProcessError):
        text = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else str(exc.stderr)
        lines = [ln.strip() for ln in text.splitlines() if "error" in ln.lower()] or text.splitlines()[:1]
        return f"triton-adapter-opt: {' | '.join(lines[:3])}"
    return " ".join(f"{type(exc).__name__}: {exc}".split())[:600]


# LLVM's banner over a crash's backtrace, printed however the process then exits.
_LLVM_CRASH = "PLEASE submit a bug report"


def _is_crash(exc: Exception) -> bool:
    """The adapter died (an assertion, a signal, LLVM's crash handler) instead of reporting an error
    in the IR."""
    if not isinstance(exc, subprocess.CalledProcessError):
        return False
    text = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else str(exc.stderr)
    return exc.returncode < 0 or "Assertion" in text or _LLVM_CRASH in text


def shared_memory_error(launch: Launch, shared: int) -> str | None:
    """Why a cubin holding ``shared`` bytes of shared memory a program cannot launch on one of the
    GPU profiles that planned it (Triton's launcher refuses more than the device's
    ``max_shared_mem``), or None. A profile's ``shared_bytes`` is the smallest such limit of the
    GPUs it stands for; on a device, the device's own figure replaces it."""
    for profile in launch.profiles:
        limit = device.PROFILES[profile].shared_bytes
        if limit and shared > limit:
            return f"{shared} bytes of shared memory a program, over the {profile} profile's {limit}"
    return None


# A grid sized by the unit count (a whole number of programs a unit, at most this many, at the
# largest model shape) is a planned (persistent) grid: it counts on that many programs sharing a
# unit. A grid of a program a tile has thousands of programs at model shapes, and no such plan.
BOUNDED_PROGRAMS_PER_UNIT = 8


def programs_short(launch: Launch, registers: int) -> tuple[int, int] | None:
    """``(fit, planned)`` where a bounded grid has ``planned`` programs an SM (at the largest model
    shape) but only ``fit`` of them fit its register file at ``registers`` a thread (the rest wait
    for a later wave: a persistent grid's plan counted on them running side by side), else None.
    Not a failure: a register cap may spill and run slower (measured per kernel, ``onca.ops._launch.
    row_launch``'s ``cap_registers``); the count shows where to look. LayerNorm's bf16 backward was
    such a kernel (160 registers in 8 warps, one of two an SM): capped, 1.13-1.23x faster."""
    units = min(device.PROFILES[p].compute_units for p in launch.profiles)
    warps = getattr(launch.cuda_options, "num_warps", 4)
    planned, rest = divmod(launch.max_grid, units)
    if rest or planned < 2 or planned > BOUNDED_PROGRAMS_PER_UNIT:
        return None
    fit = programs_fitting(registers, warps)
    return (fit, planned) if fit < planned else None


def _check(launch: Launch) -> tuple[str | None, str | None, tuple[int, int, int] | None]:
    """``(error, crash, resources)``: error is None when the launch compiles (to Linalg, its grid
    able to launch; or to a cubin within its profiles' shared memory), else why not; crash is the
    adapter's message when it crashed once and then compiled; resources are a cubin's
    :func:`cubin_resources` and its shared bytes a program (None for Ascend).

    triton-adapter-opt crashes at random on inputs that compile on the next try (an MLIR assertion
    on a malformed type, or a signal; one or two of about 1460 compilations per run, a different
    kernel each time): a crash is retried once and the launch is reported as ``flaky``, so the
    compiler bug is seen but does not fail CI. An error the adapter reports, or a second crash, is
    a failure.
    """
    if launch.cuda_options is not None:
        try:
            compiled = compile_for_cuda(launch)
        except Exception as exc:  # any compiler failure is the audit's finding
            return _error_message(exc), None, None
        shared = int(compiled.metadata.shared)
        error = shared_memory_error(launch, shared)
        resources = cubin_resources(compiled.asm["cubin"])
        return error, None, None if resources is None else (*resources, shared)
    if launch.max_grid > MAX_GRID:
        return f"grid of {launch.max_grid} programs exceeds triton-ascend's limit of {MAX_GRID}", None, None
    crash = None
    for _attempt in range(2):
        try:
            compile_to_linalg(launch)
        except Exception as exc:  # any compiler failure is the audit's finding
            if crash is None and _is_crash(exc):
                crash = _error_message(exc)
                continue
            return _error_message(exc), None, None
        return None, crash, None
    return crash, None, None


def _line(status: str, launch: Launch) -> str:
    models = len({u.split("/")[1] for u in launch.users})
    return (f"{status:4s} {launch.name} ({launch.describe_types()}) [{', '.join(launch.profiles)}; "
            f"models: {models}] {launch.describe_constants()}")


def run(ops: list[str], profiles: list[str], out=sys.stdout, *, cuda: bool = False) -> int:
    """Collect, compile and report; 0 when every launch compiled (to Linalg, or a cubin with
    ``cuda``), else 1."""
    start = time.time()
    launches, failures = collect(ops, profiles)
    for failure in failures:
        print(failure, file=out, flush=True)
    passed = flaky = spilled = short = 0
    for launch in sorted(launches.values(), key=Launch.sort_key):
        error, crash, resources = _check(launch)
        if error is not None:
            failures.append(launch.name)
            print(f"{_line('FAIL', launch)}: {error}", file=out, flush=True)
            continue
        passed += 1
        if resources is not None:
            registers, stack, shared = resources
            spilled += stack > 0
            waits = programs_short(launch, registers)
            short += waits is not None
            note = "" if waits is None else f"; {waits[0]} of the {waits[1]} programs an SM its grid has fit"
            print(f"{_line('ok', launch)}; regs {registers}, stack {stack}, shared {shared}{note}", file=out,
                  flush=True)
        elif crash is None:
            print(_line("ok", launch), file=out, flush=True)
        else:
            flaky += 1
            print(f"{_line('flaky', launch)}: compiled on the second try; first: {crash}", file=out, flush=True)
    kernels = len({la.kernel for la in launches.values()})
    if cuda:
        # A spill is not a failure: the plan was timed on the device; the count shows where to look.
        reached = (f"compiled to a cubin ({len(failures)} failures, {spilled} spilling registers to the "
                   f"stack, {short} whose grid has more programs an SM than their registers let fit")
        tail = "the kernels were not run"
    else:
        reached = f"reached Linalg ({len(failures)} failures, {flaky} compiled after an adapter crash"
        tail = "the NPU binary stage needs CANN and was not run"
    print(f"onca audit --{'cuda' if cuda else 'ascend'}: {passed} of {len(launches)} compilations of {kernels} "
          f"kernels {reached}; {len(ops)} ops, profiles {', '.join(profiles)}; {time.time() - start:.0f} s; {tail})",
          file=out)
    return 1 if failures else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m onca.audit", description=__doc__.splitlines()[0])
    parser.add_argument("--cuda", action="store_true", help="compile for the GPU profiles with the installed Triton")
    parser.add_argument("--ops", help="comma-separated ops (default: every op with a benchmark)")
    parser.add_argument("--profiles", help=f"comma-separated profiles (default: {', '.join(ASCEND_TARGETS)}; "
                                           f"with --cuda: {', '.join(CUDA_TARGETS)})")
    args = parser.parse_args(argv)
    flag = "--cuda" if args.cuda else "--ascend"
    try:
        if args.cuda:
            import triton.backends.nvidia.compiler  # noqa: F401
        else:
            import triton.backends.ascend.compiler  # noqa: F401
    except ImportError as exc:
        need = "Triton with its NVIDIA backend" if args.cuda else "triton-ascend in place of triton"
        print(f"onca audit {flag} needs {need} ({exc}); see README.md", file=sys.stderr)
        return 2
    if device.interpreter_active():
        print(f"onca audit {flag}: run with TRITON_INTERPRET=0 (interpreted kernels cannot be compiled)",
              file=sys.stderr)
        return 2
    targets = CUDA_TARGETS if args.cuda else ASCEND_TARGETS
    ops = args.ops.split(",") if args.ops else harness.list_ops()
    profiles = args.profiles.split(",") if args.profiles else list(targets)
    unknown = [p for p in profiles if p not in targets]
    unknown += [op for op in ops if op not in harness.list_ops()]
    if unknown:
        print(f"onca audit {flag}: unknown op or profile {', '.join(unknown)}", file=sys.stderr)
        return 2
    return run(ops, profiles, cuda=args.cuda)


if __name__ == "__main__":
    sys.exit(main())
