"""Launching a Triton kernel again without Triton binding its arguments again.

``kernel[grid](*args, **constexprs)`` through ``JITFunction.run`` binds every argument, derives its
specialization in native code, builds a cache key from it, reads several runtime knobs and looks
the compiled kernel up: 26 us per launch measured on an H100 host for an 11-argument kernel, of
which the launch itself (``CompiledKernel.run``) is 9 us. A small op runs two to five launches, so
that binding is a large part of its host time, and the host time is the op's time at small sizes.

:func:`fast_launch` wraps a ``@triton.jit`` kernel so that the first launch of each specialization
goes through Triton as always (it compiles, caches and launches), and later launches with the same
specialization call the compiled kernel directly. The specialization is recomputed on every launch
in Python, from what Triton specializes on and nothing coarser:

- a tensor: its dtype and whether its address is 16-byte aligned;
- an int: whether it is 1, whether it is divisible by 16, and its integer type (i32, i64, u64);
- a float, a bool, None: the type alone;
- the keyword arguments (constexprs and launch options such as ``num_warps``): their values;
- the current device.

A caller that keeps a launch's non-tensor arguments and keyword arguments between calls (a launch
configuration kept per layout) can key them once, with :func:`prepared_key`, and launch with
:meth:`FastLaunch.launch_prepared`: each launch then keys its tensors alone.

Anything else (another argument type, a constexpr passed by position, a keyword argument that is
not a constexpr, a callable grid, a launch hook set by a profiler, the interpreter, a backend other
than CUDA) takes Triton's own path, unchanged. ``tests/ops/test_launch.py`` checks both claims the
shortcut rests on, against the installed Triton: the key above never merges two arguments that
Triton specializes differently, and a direct launch passes the compiled kernel exactly the
arguments ``JITFunction.run`` passes it, less the launch metadata and Triton's empty hook chains,
for which it passes None (the launcher then calls no hook, as with an empty chain).

Both routes end in Triton's launcher, which checks every pointer on every launch: a tensor in
pageable CPU memory is refused there ("cannot be accessed from Triton"), never read by the GPU.
That error names no argument; :class:`FastLaunch` re-raises it naming the kernel's CPU tensors.
"""

from __future__ import annotations

import contextlib

import torch

from onca.device import get_profile
from onca.tiling import plan_rows

__all__ = ["FastLaunch", "fast_launch", "launch_config", "prepared_key", "programs_fitting", "register_cap",
           "row_launch", "specialization_key", "through_triton"]

_INT32_MIN, _INT32_MAX = -(1 << 31), (1 << 31) - 1
_UINT64_MIN = 1 << 63
# Launch options that are compile options (in the key by value, never passed to the compiled kernel):
# debug and sanitize_overflow are how the embedding compiles its device-side index assertion in.
_OPTIONS = frozenset({"num_warps", "num_stages", "num_ctas", "maxnreg", "enable_fp_fusion", "launch_pdl",
                      "debug", "sanitize_overflow"})
_TENSOR, _PARAMETER = torch.Tensor, torch.nn.Parameter
_SLOW = object()  # a cache entry meaning: this specialization launches through Triton


# An NVIDIA SM's register file (32-bit registers; every GPU since Kepler), and the warps of the
# programs row_launch caps to share one two ways (see row_launch).
_GPU_REGISTERS_PER_UNIT = 65536
_CAPPED_WARPS = 16


# What a launch needs beyond its tensors (grid, keyword constexprs, buffer sizes), by everything it
# depends on: planning and assembling them cost more host time per call than the launch itself at
# the sizes where the host is the cost. Cleared when full: a run of ever-new shapes only re-plans.
_CONFIGS: dict = {}
_MAX_CONFIGS = 4096


def launch_config(key: tuple, make):
    """``make()``, computed once per ``key``: the key must hold everything the result depends on
    (the kernel, the sizes, the dtype, the device profile, the constexprs asked for). The result is
    shared between calls: callers never change it."""
    entry = _CONFIGS.get(key)
    if entry is None:
        if len(_CONFIGS) >= _MAX_CONFIGS:
            _CONFIGS.clear()
        entry = _CONFIGS[key] = make()
    return entry


def _plan_with_tiles(rows: int, cols: int, dtype: torch.dtype, tiles: dict):
    return plan_rows(rows, cols, dtype, **tiles)


def row_launch(kernel, rows: int, cols: int, dtype: torch.dtype, tiles: dict, constexprs: dict,
               plan=_plan_with_tiles, *, cap_registers: bool = False) -> tuple:
    """``(grid, keyword arguments, plan)`` of a launch of the row kernel ``kernel`` over ``rows x
    cols`` of ``dtype``: the plan ``plan(rows, cols, dtype, tiles)`` (default: ``plan_rows`` with
    the kernel's tile counts) as the constexprs ``BLOCK_ROWS``, ``BLOCK_COLS`` and ``COL_TILES`` and
    its ``num_warps``, beside ``constexprs``. Kept by :func:`launch_config`, for the device profile
    in force.

    ``cap_registers``: on a GPU, compile for at most the registers (``maxnreg``) that let several
    programs share an SM, for the kernels that measured faster so (the caller asks):

    - a one-pass tile of a non-persistent kernel in ``_CAPPED_WARPS`` warps: two programs.
      Uncapped, LayerNorm's bf16 forward of a 16384-column row took 85-89 registers a thread, one
      512-thread program per SM, 45% of the DRAM bandwidth: 0.43 ms at 16384 x 16384 on an H200,
      0.28 capped (outputs bitwise equal); capping 8-warp tiles, or 32-warp two-pass ones,
      measured slower, and RMSNorm's forward, at 64 registers uncapped, slower capped.
    - a persistent plan: the programs an SM its grid counts on (the profile's warps a unit over
      the plan's warps), which run side by side only if they fit the register file together.
      LayerNorm's bf16 backward took 153-162 registers a thread in 8 warps (two programs an SM
      need at most 128), so half its grid waited: capped, forward + backward on an H200 (CUDA-graph
      replays) 100.7 -> 89.2 us at 16384 x 1024, 119.6 -> 97.4 at 16384 x 2048 (56 bytes of stack at
      1024 columns); RMSNorm + RoPE at Qwen3-0.6B 134.7 -> 112.5, at 4 x 16384 tokens of 16 + 8
      heads 991.7 -> 808.3. RMSNorm's (128 registers uncapped), DyT's and PolyNorm's backward
      measured 1-4% slower capped, fused add + RMSNorm's level."""
    profile = get_profile()
    key = (kernel, plan, rows, cols, dtype, profile, tuple(tiles.items()), tuple(constexprs.items()),
           cap_registers)

    def make():
        p = plan(rows, cols, dtype, tiles)
        kwargs = {**constexprs, "BLOCK_ROWS": p.block_rows, "BLOCK_COLS": p.block_cols,
                  "COL_TILES": p.col_tiles, "num_warps": p.num_warps}
        sharing = _programs_sharing_a_unit(p, profile) if cap_registers else 1
        if sharing > 1:
            kwargs["maxnreg"] = register_cap(p.num_warps, sharing)
        return (p.grid,), kwargs, p

    return launch_config(key, make)


def _programs_sharing_a_unit(p, profile) -> int:
    """The programs of plan ``p`` meant to share one SM (see ``row_launch``'s ``cap_registers``), or 1
    where nothing is to be capped (another device, a plan of one program an SM)."""
    if profile.kind != "cuda":
        return 1
    if p.persistent:
        return max(1, profile.warps_per_unit // p.num_warps) if profile.warps_per_unit else 1
    return 2 if p.col_tiles == 1 and p.num_warps == _CAPPED_WARPS else 1


def register_cap(num_warps: int, programs_per_unit: int) -> int:
    """The ``maxnreg`` launch option (32-bit registers a thread) that lets ``programs_per_unit``
    programs of ``num_warps`` warps share an NVIDIA SM's register file (at most 255, the ISA's)."""
    return min(255, _GPU_REGISTERS_PER_UNIT // (programs_per_unit * 32 * num_warps))


def programs_fitting(registers: int, num_warps: int) -> int:
    """How many programs of ``num_warps`` warps at ``registers`` a thread an NVIDIA SM's register
    file holds side by side (the inverse of :func:`register_cap`)."""
    return _GPU_REGISTERS_PER_UNIT // (max(1, registers) * 32 * num_warps)


class _Runtime:
    """The CUDA driver's device and stream getters and Triton's runtime knobs, looked up once."""

    def __init__(self, current_device, current_stream, knobs):
        self.current_device = current_device
        self.current_stream = current_stream
        self.knobs = knobs


_UNRESOLVED = object()
_runtime = _UNRESOLVED  # a _Runtime, or None where the fast path does not apply


def _resolve_runtime():
    """The active driver's getters if it is CUDA's, else None (no GPU driver, another backend):
    then every launch takes Triton's own path, which handles or reports it."""
    global _runtime
    try:
        from triton import knobs
        from triton.runtime import driver

        active = driver.active
        cuda = active.get_current_target().backend == "cuda"
        _runtime = _Runtime(active.get_current_device, active.get_current_stream, knobs.runtime) if cuda else None
    except (ImportError, AttributeError, RuntimeError):  # no driver: "0 active drivers"
        _runtime = None
    return _runtime


@contextlib.contextmanager
def through_triton():
    """Every launch goes through ``JITFunction.run`` while inside: for tools that replace it (the
    launch counters, the audit's recorders), which a direct launch would bypass."""
    global _runtime
    saved, _runtime = _runtime, None
    try:
        yield
    finally:
        _runtime = saved


def specialization_key(device: int, args: tuple, kwargs: dict) -> tuple | None:
    """The launch's specialization as the fast path keys it (see the module); None where an
    argument's type is not one it knows. One loop and no call per argument: it runs every launch."""
    key = [device]
    key += kwargs.items()
    for arg in args:
        kind = type(arg)
        if kind is _TENSOR or kind is _PARAMETER:
            key.append(arg.dtype)
            key.append(not arg.data_ptr() & 15)
        elif kind is int:
            # 1 is a constant to Triton; any other int: divisible by 16 or not, i32 / i64 / u64.
            key.append(1 if arg == 1 else (2 if not arg & 15 else 3) if _INT32_MIN <= arg <= _INT32_MAX
                       else (4 if not arg & 15 else 5) if arg < _UINT64_MIN else (6 if not arg & 15 else 7))
        elif kind is float or kind is bool or arg is None:
            key.append(kind)
        else:
            return None
    return tuple(key)


def prepared_key(scalars: tuple, kwargs: dict) -> tuple | None:
    """The specialization of a launch's non-tensor arguments and keyword arguments, for
    :meth:`FastLaunch.launch_prepared`; None where an argument's type is not one the key knows, or
    is a tensor (whose address, and so its alignment, changes from launch to launch)."""
    if any(isinstance(arg, torch.Tensor) for arg in scalars):
        return None
    return specialization_key(0, scalars, kwargs)


class FastLaunch:
    """A ``@triton.jit`` kernel launched as ``kernel[grid](*args, **constexprs)``; see the module."""

    def __init__(self, fn):
        self.fn = fn
        self._compiled: dict = {}
        self._prepared: dict = {}  # launch_prepared's keys (tensors only, beside a scalars key)
        self._jit = _is_compiled_jit(fn)

    def __getattr__(self, name):
        # The wrapped kernel's attributes (fn, params, arg_names, ...): tools that inspect
        # kernels see the JITFunction's.
        return getattr(self.fn, name)

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launch(grid, args, kwargs)

    def launch(self, grid, args: tuple, kwargs: dict):
        runtime = self._direct_runtime(grid)
        if runtime is None:
            return self.fn[grid](*args, **kwargs)
        device = runtime.current_device()
        key = specialization_key(device, args, kwargs)
        return self._run(runtime, device, self._compiled, key, grid, args, kwargs)

    def launch_prepared(self, grid, tensors: tuple, scalars: tuple, kwargs: dict, scalars_key):
        """``kernel[grid](*tensors, *scalars, **kwargs)`` for a kernel whose arguments are ``tensors``
        then ``scalars``, with ``scalars_key = prepared_key(scalars, kwargs)`` computed once where the
        scalars and keyword arguments are kept (a launch configuration): each launch then keys only
        its tensors. RoPE's kernel takes 6 tensors and 24 ints: keying all 30 and 14 keyword
        arguments took 5.0 us per launch on this repository's CPU, the tensors alone 1.2 us."""
        args = tensors + scalars
        runtime = self._direct_runtime(grid)
        if runtime is None or scalars_key is None:
            return self.fn[grid](*args, **kwargs)
        device = runtime.current_device()
        key = [device, len(tensors), scalars_key]
        for arg in tensors:
            kind = type(arg)
            if kind is not _TENSOR and kind is not _PARAMETER:
                return self._run(runtime, device, self._compiled, None, grid, args, kwargs)
            key.append(arg.dtype)
            key.append(not arg.data_ptr() & 15)
        return self._run(runtime, device, self._prepared, tuple(key), grid, args, kwargs)

    def _direct_runtime(self, grid):
        """The runtime a direct launch uses, or None where this launch goes through Triton."""
        runtime = _runtime if _runtime is not _UNRESOLVED else _resolve_runtime()
        if runtime is None or not self._jit or type(grid) is not tuple:
            return None
        knobs = runtime.knobs
        if _hooked(knobs.launch_enter_hook) or _hooked(knobs.launch_exit_hook):
            return None
        return runtime

    def _run(self, runtime, device, table: dict, key, grid, args: tuple, kwargs: dict):
        """Launch directly where ``table`` has this ``key``'s compiled kernel; else through Triton,
        keeping what a direct launch of ``key`` needs (None: an argument the key does not know)."""
        entry = table.get(key, None) if key is not None else _SLOW
        try:
            if entry is None:
                compiled = self.fn[grid](*args, **kwargs)
                table[key] = self._entry(compiled, args, kwargs)
                return compiled
            if entry is _SLOW:
                return self.fn[grid](*args, **kwargs)
            run, function, metadata, tail = entry
            n = len(grid)
            run(grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1, runtime.current_stream(device), function,
                metadata, None, None, None, *args, *tail)
        except ValueError as exc:
            raise _named_pointer_error(self.fn, args, exc) from exc
        return None

    def _entry(self, compiled, args: tuple, kwargs: dict):
        """What a direct launch needs for this specialization, or ``_SLOW``: the compiled
        kernel's launcher, function and metadata, and the values of the parameters after the
        positional ones (keyword constexprs, then defaults), in signature order."""
        if compiled is None or not hasattr(compiled, "packed_metadata") or not hasattr(compiled, "function"):
            return _SLOW  # not a compiled CUDA kernel (a recorder, an older Triton): keep Triton's path
        params = self.fn.params
        if any(p.is_constexpr for p in params[:len(args)]):
            return _SLOW  # a constexpr passed by position: its value would have to be in the key
        if any(name not in _OPTIONS and name not in self.fn.arg_names for name in kwargs):
            return _SLOW
        tail = []
        for p in params[len(args):]:
            if p.name in kwargs:
                if not p.is_constexpr:
                    return _SLOW  # a runtime argument passed by keyword: its value is not in the key
                tail.append(kwargs[p.name])
            elif p.has_default:
                tail.append(p.default)
            else:
                return _SLOW
        return compiled.run, compiled.function, compiled.packed_metadata, tuple(tail)


def _named_pointer_error(fn, args: tuple, exc: ValueError) -> ValueError:
    """Triton's launcher refuses a pointer the GPU cannot reach (a tensor in pageable CPU memory)
    with "Pointer argument cannot be accessed from Triton (cpu tensor?)", naming no argument: the
    same error naming the kernel's CPU tensors. Any other error is returned as it is."""
    if "cannot be accessed from Triton" not in str(exc):
        return exc
    names = getattr(fn, "arg_names", None) or [f"argument {i}" for i in range(len(args))]
    cpu = [name for name, arg in zip(names, args) if isinstance(arg, torch.Tensor) and arg.device.type == "cpu"]
    if not cpu:
        return exc
    return ValueError(
        f"{getattr(fn, '__name__', 'kernel')}: {', '.join(cpu)} {'is a CPU tensor' if len(cpu) == 1 else 'are CPU tensors'}"
        f", but this kernel runs on the GPU: move the op's inputs to the GPU (e.g. tensor.cuda())")


def _hooked(hook) -> bool:
    """Whether a launch hook would run: set, and not an empty ``HookChain`` (Triton's default).
    A direct launch passes no hook and no launch metadata, which is what an empty chain does."""
    return hook is not None and bool(getattr(hook, "calls", True))


def _is_compiled_jit(fn) -> bool:
    """A JITFunction that compiles (not the interpreter's stand-in, not a subclass with its own
    launch, such as another backend's)."""
    try:
        from triton.runtime.jit import JITFunction
    except ImportError:
        return False
    return type(fn) is JITFunction


def fast_launch(fn) -> FastLaunch:
    """Decorator, above ``@triton.jit``: launch ``fn`` directly once a specialization has been
    compiled (see the module)."""
    return FastLaunch(fn)
