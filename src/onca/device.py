"""Which accelerator is here, and the `DeviceProfile` that kernel plans are built from.

Detection order: the ``ONCA_DEVICE_PROFILE`` environment variable (a built-in profile name), then a
CUDA device, then an Ascend NPU (``torch_npu``), else ``cpu-interpreter``. Single fields can be
forced with ``ONCA_ONCHIP_BYTES`` and ``ONCA_COMPUTE_UNITS``. On a real device the compute units (and,
on a GPU, the memory bandwidth) are read from the runtime and win over the table.

When no accelerator is present, Triton's interpreter is switched on (``TRITON_INTERPRET=1``) so the
real kernels run on the CPU, unless the user has set ``TRITON_INTERPRET`` themselves. This has to
happen before any kernel is decorated, which is why ``onca/__init__.py`` imports this module first.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from dataclasses import dataclass

import torch

__all__ = [
    "DeviceProfile",
    "PROFILES",
    "get_profile",
    "profile_named",
    "reset",
    "accelerator",
    "interpreter_active",
    "ensure_interpreter",
    "free_memory",
    "npu_profile_name",
]


@dataclass(frozen=True)
class DeviceProfile:
    """What a kernel plan needs to know about the hardware.

    ``onchip_bytes`` is the working-set budget of one program: the Unified Buffer on Ascend, a
    register budget on a GPU chosen so that a tile does not spill. ``align_bytes`` is the unit every
    block must be a multiple of (32 bytes, one UB block, on Ascend). ``persistent`` means grids are
    capped at ``compute_units`` and each program loops over its share of the work.

    Three GPU-only fields (0 elsewhere): ``tile_elements``, the tile size a one-pass kernel is fastest
    with (registers, not a byte budget, bound GPU tiles); ``warps_per_unit``, the warps a persistent
    grid keeps resident per SM, as several programs per SM, so loads stay in flight (with
    ``warps_per_unit == 0`` a persistent grid has at most one program per compute unit);
    ``shared_bytes``, the shared memory one program may hold (Triton's ``max_shared_mem``), which
    bounds a matmul's pipelined operand tiles beside the on-chip budget.
    """

    kind: str  # "cuda", "npu" or "cpu"
    name: str
    compute_units: int
    onchip_bytes: int
    persistent: bool
    peak_gbps: float
    align_bytes: int = 16
    max_warps: int = 16
    tile_elements: int = 0
    warps_per_unit: int = 0
    shared_bytes: int = 0

    def __post_init__(self):
        if self.kind not in ("cuda", "npu", "cpu"):
            raise ValueError(f"DeviceProfile.kind must be 'cuda', 'npu' or 'cpu', got {self.kind!r}")
        for field in ("compute_units", "onchip_bytes", "align_bytes", "max_warps"):
            value = getattr(self, field)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"DeviceProfile.{field} must be a positive int, got {value!r}")
        for field in ("tile_elements", "warps_per_unit", "shared_bytes"):
            value = getattr(self, field)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"DeviceProfile.{field} must be a non-negative int, got {value!r}")

    def __hash__(self) -> int:
        # Plans are cached per profile: hash the fields once, not on every kernel launch.
        cached = self.__dict__.get("_hash")
        if cached is None:
            cached = hash(dataclasses.astuple(self))
            object.__setattr__(self, "_hash", cached)
        return cached

    def describe(self) -> str:
        mode = "persistent" if self.persistent else "one program per tile"
        if self.warps_per_unit:
            mode += f" ({self.warps_per_unit} warps per unit when persistent)"
        bw = f"{self.peak_gbps:.0f} GB/s" if self.peak_gbps else "n/a"
        shared = f" ({self.shared_bytes} of them shared memory)" if self.shared_bytes else ""
        return (
            f"{self.name} ({self.kind}): {self.compute_units} compute units, "
            f"{self.onchip_bytes} on-chip bytes per program{shared}, {self.align_bytes}-byte alignment, "
            f"{mode} grids, peak bandwidth {bw}"
        )


# GPU budget: 512 KiB of live tile data per program, counting fp32 temporaries the compiler need
# not keep alive at once; the planner also caps a GPU tile at 32 elements per thread of a 16-warp
# program. Tile size and occupancy come from an H200 sweep of RMSNorm launch configurations
# (16384 x 1024..32768, bf16): one-pass kernels were fastest with about 2048-element tiles,
# persistent ones with 16 resident warps per SM, and column-tiled ones with 8192-wide tiles.
_GPU_ONCHIP = 512 * 1024
_GPU = dict(tile_elements=2048, warps_per_unit=16)

# Ascend figures come from the chips' platform configurations: the Unified Buffer is 196608 bytes
# on the 910B family and 253952 on the 950 family, in 32-byte blocks; vector-core counts per chip.
# Bandwidths are nominal (vendor) figures, used only to report a fraction of peak.
PROFILES: dict[str, DeviceProfile] = {
    p.name: p
    for p in (
        DeviceProfile("cuda", "h100", 132, _GPU_ONCHIP, False, 3350.0, shared_bytes=232448, **_GPU),
        DeviceProfile("cuda", "h200", 132, _GPU_ONCHIP, False, 4800.0, shared_bytes=232448, **_GPU),
        DeviceProfile("cuda", "a100", 108, _GPU_ONCHIP, False, 2039.0, shared_bytes=166912, **_GPU),
        DeviceProfile("cuda", "cuda-generic", 80, _GPU_ONCHIP, False, 1000.0, shared_bytes=101376, **_GPU),
        DeviceProfile("npu", "ascend910b2", 48, 196608, True, 1600.0, align_bytes=32),
        DeviceProfile("npu", "ascend910b4", 40, 196608, True, 800.0, align_bytes=32),
        DeviceProfile("npu", "ascend950", 56, 253952, True, 1600.0, align_bytes=32),
        # The interpreter runs programs one after another, each as vectorised NumPy: a few large
        # programs are far faster than many small ones.
        DeviceProfile("cpu", "cpu-interpreter", 4, 1 << 20, True, 0.0),
    )
}


def accelerator() -> str:
    """``"cuda"``, ``"npu"`` or ``"cpu"``: where tensors for the kernels should live."""
    if torch.cuda.is_available():
        return "cuda"
    if _npu_available():
        return "npu"
    return "cpu"


def _npu_available() -> bool:
    try:
        import torch_npu  # noqa: F401
    except ImportError:
        return False
    return bool(getattr(torch, "npu", None)) and torch.npu.is_available()


def ensure_interpreter() -> bool:
    """Switch Triton's interpreter on when there is no accelerator, unless the user chose already.

    Returns whether the interpreter is on afterwards.
    """
    if "TRITON_INTERPRET" not in os.environ and accelerator() == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
    if interpreter_active():
        _scalar_index_in_interpreter()
        _nearest_bf16_in_interpreter()
    return interpreter_active()


def _scalar_index_in_interpreter() -> None:
    """Let the interpreter's scalars index like Python ints under NumPy >= 2.4 on older Triton.

    A program id in Triton's interpreter is a one-element array; Triton <= 3.6 turns it into an index
    with ``int(array)``, which NumPy 2.4 refuses for an array of one dimension, so every
    ``tl.range(pid, ...)`` loop failed there (PyTorch 2.11 ships Triton 3.6). Newer Triton squeezes
    the array first; this gives older ones the same ``__index__``, and is a no-op on newer ones.
    """
    from triton.runtime import interpreter

    patch_tensor = getattr(interpreter, "_patch_lang_tensor", None)
    if patch_tensor is None or getattr(patch_tensor, "onca_scalar_index", False):
        return

    def patch_with_scalar_index(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    patch_with_scalar_index.onca_scalar_index = True
    interpreter._patch_lang_tensor = patch_with_scalar_index


def _nearest_bf16_in_interpreter() -> None:
    """Make the interpreter round fp32 -> bf16 to nearest even, as the GPU does (``cvt.rn.bf16.f32``,
    torch's cast); nothing changes on a GPU.

    The stock interpreter truncates: about half of a bf16 kernel's outputs land a whole ulp towards
    zero of the GPU's, with twice the error and a bias: cross entropy's bf16 gradient came out
    0.28% small on average (the mean of a truncated mantissa's loss), and a patched Qwen3's weight
    gradients about twice as far from an fp32 run's as Hugging Face's bf16 ones (64 tokens). A run
    on the CPU would then judge the interpreter rather than Onca's arithmetic.
    """
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    if getattr(builder.cast_impl, "onca_nearest", False):
        return
    truncating = builder.cast_impl

    def cast(self, src, dst_type):
        if src.dtype.scalar != tl.float32 or dst_type.scalar != tl.bfloat16:
            return truncating(self, src, dst_type)
        nearest = torch.from_numpy(np.array(src.data, dtype=np.float32)).to(torch.bfloat16)
        # the interpreter holds bf16 as uint16 bit patterns
        return interpreter.TensorHandle(nearest.view(torch.int16).numpy().view(np.uint16), dst_type.scalar)

    cast.onca_nearest = True
    builder.cast_impl = cast


def interpreter_active() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _cuda_profile() -> DeviceProfile:
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    name = props.name.lower()
    base = next(
        (PROFILES[key] for key in ("h200", "h100", "a100") if key in name),
        PROFILES["cuda-generic"],
    )
    changes = {"compute_units": props.multi_processor_count}
    shared = _cuda_shared_bytes()
    if shared:
        changes["shared_bytes"] = shared
    gbps = _cuda_bandwidth_gbps(props)
    if gbps:
        changes["peak_gbps"] = gbps
    return dataclasses.replace(base, **changes)


def _cuda_shared_bytes() -> int | None:
    """The shared memory one program may hold, as Triton's driver reports it (what its launcher
    checks a kernel against), or None where it cannot say."""
    try:
        from triton.runtime import driver

        props = driver.active.utils.get_device_properties(torch.cuda.current_device())
        shared = int(props["max_shared_mem"])
    except Exception:  # another Triton, or no driver: the profile's figure stands
        return None
    return shared if shared > 0 else None


def _cuda_bandwidth_gbps(props) -> float | None:
    """Theoretical DRAM bandwidth from the memory clock and bus width, when the runtime gives them."""
    clock_khz = getattr(props, "memory_clock_rate", None)
    bus_bits = getattr(props, "memory_bus_width", None)
    if not clock_khz or not bus_bits:
        return None
    # Double data rate: two transfers per clock.
    return 2 * clock_khz * 1e3 * (bus_bits / 8) / 1e9


# Chip names as the NPU runtime gives them (``torch.npu.get_device_name``: "Ascend910B2", ...;
# the 950 family also by its SoC name "Ascend910_95xx"), lower-cased without spaces, to the profile
# with the same Unified Buffer and nearest vector-core count: the driver's core count wins anyway.
_NPU_NAMES = (
    ("ascend950", "ascend950"),
    ("ascend910_95", "ascend950"),
    ("ascend910b1", "ascend910b2"),
    ("ascend910b2", "ascend910b2"),
    ("ascend910b3", "ascend910b4"),
    ("ascend910b4", "ascend910b4"),
)


def npu_profile_name(device_name: str) -> str:
    """The built-in profile for an NPU named ``device_name``; the 910B2's for a chip not listed."""
    key = device_name.lower().replace(" ", "")
    return next((profile for prefix, profile in _NPU_NAMES if key.startswith(prefix)), "ascend910b2")


def _npu_profile() -> DeviceProfile:
    try:
        name = torch.npu.get_device_name(torch.npu.current_device())
    except Exception:  # the runtime may not name the chip; fall back to the most common part
        name = ""
    base = PROFILES[npu_profile_name(name)]
    changes = {}
    ub_bytes, vector_cores = _npu_runtime_limits()
    if ub_bytes:
        changes["onchip_bytes"] = ub_bytes
    if vector_cores:
        changes["compute_units"] = vector_cores
    return dataclasses.replace(base, **changes)


def _npu_runtime_limits() -> tuple[int | None, int | None]:
    """UB size and vector-core count as triton-ascend's driver reports them, where it can.

    triton-ascend 3.2 reports ``num_vectorcore`` (and ``num_aicore``) but no UB size: the profile's
    stands unless a later driver adds ``ub_size``."""
    try:
        from triton.runtime import driver

        props = driver.active.utils.get_device_properties(torch.npu.current_device())
    except Exception:  # an older triton-ascend, or no driver: the table stands
        return None, None
    if not isinstance(props, dict):
        return None, None
    ub = props.get("ub_size") or props.get("max_ub_size")
    cores = props.get("num_vectorcore")
    return (int(ub) if ub and ub > 0 else None), (int(cores) if cores and cores > 0 else None)


def free_memory(device: torch.device | str | None = None) -> int:
    """Bytes free on ``device`` now (CUDA and NPU from the runtime; the CPU from the OS)."""
    device = torch.device(device) if device is not None else torch.device(accelerator())
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    if device.type == "npu":
        return int(torch.npu.mem_get_info(device)[0])
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):  # not a POSIX system: assume a modest machine
        return 8 << 30


def _env_int(name: str) -> int | None:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return None
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name} must be a positive integer, got {raw!r}") from None
    if value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {raw!r}")
    return value


@functools.lru_cache(maxsize=None)
def _detect(profile_name: str | None, onchip: int | None, units: int | None) -> DeviceProfile:
    if profile_name:
        if profile_name not in PROFILES:
            known = ", ".join(sorted(PROFILES))
            raise ValueError(f"ONCA_DEVICE_PROFILE={profile_name!r} is not a built-in profile ({known})")
        profile = PROFILES[profile_name]
    else:
        where = accelerator()
        if where == "cuda":
            profile = _cuda_profile()
        elif where == "npu":
            profile = _npu_profile()
        else:
            profile = PROFILES["cpu-interpreter"]
    changes = {}
    if onchip is not None:
        changes["onchip_bytes"] = onchip
    if units is not None:
        changes["compute_units"] = units
    return dataclasses.replace(profile, **changes) if changes else profile


_current: DeviceProfile | None = None


def get_profile() -> DeviceProfile:
    """The profile in force: detection plus the environment's overrides.

    Read once and kept (every kernel launch asks for it); call ``reset()`` after changing
    ``ONCA_DEVICE_PROFILE``, ``ONCA_ONCHIP_BYTES`` or ``ONCA_COMPUTE_UNITS`` in-process.
    """
    global _current
    if _current is None:
        _current = _detect(
            os.environ.get("ONCA_DEVICE_PROFILE") or None,
            _env_int("ONCA_ONCHIP_BYTES"),
            _env_int("ONCA_COMPUTE_UNITS"),
        )
    return _current


def profile_named(name: str) -> DeviceProfile:
    """The built-in profile ``name`` with the environment's single-field overrides, as
    ``get_profile()`` would give it under ``ONCA_DEVICE_PROFILE=name`` (nothing is changed)."""
    if name not in PROFILES:
        raise ValueError(f"unknown device profile {name!r}; profiles: {', '.join(sorted(PROFILES))}")
    return _detect(name, _env_int("ONCA_ONCHIP_BYTES"), _env_int("ONCA_COMPUTE_UNITS"))


def reset() -> None:
    """Forget the profile in force, so that the next ``get_profile()`` reads the environment again."""
    global _current
    _current = None
    _detect.cache_clear()
