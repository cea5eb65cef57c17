"""The direct-launch shortcut (``onca.ops._launch``) against the installed Triton, without a GPU: a
stand-in CUDA driver and a stand-in compiled kernel that records how it is launched.

The two claims the shortcut rests on: its key never puts two argument lists that Triton
specializes differently under one compiled kernel, and a direct launch hands the compiled kernel
exactly the arguments ``JITFunction.run`` hands it (no hooks where Triton's chains are empty)."""

from __future__ import annotations

import itertools

import pytest
import torch
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.runtime import driver
from triton.runtime.jit import JITFunction

from onca.ops import _launch
from onca.ops._launch import FastLaunch, prepared_key, specialization_key


def _sample(x_ptr, y_ptr, n, stride, scale, flag, BLOCK: tl.constexpr, MODE: tl.constexpr = 2):
    pass


class _Driver:
    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 1234

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)


class _Compiled:
    """What JITFunction.run returns: records each launch's arguments."""

    function = 77
    packed_metadata = ("meta",)
    error = None  # what the launcher raises (Triton's refuses a pointer the GPU cannot reach)

    def __init__(self, launches):
        self.launches = launches

    def launch_metadata(self, grid, stream, *args):
        return None

    def run(self, *args):
        if self.error is not None:
            raise self.error
        self.launches.append(args)


@pytest.fixture
def cuda_like(monkeypatch):
    """A JITFunction (the real class, not the interpreter's) whose compilation yields a
    ``_Compiled``, under a stand-in CUDA driver; yields the list of recorded launches."""
    launches = []

    def compile_stand_in(self, key, signature, device, constexprs, options, attrs, warmup):
        kernel = _Compiled(launches)
        self.device_caches[device][0][key] = kernel
        return kernel

    monkeypatch.setattr(driver, "_active", _Driver())
    monkeypatch.setattr(JITFunction, "_do_compile", compile_stand_in)
    monkeypatch.setattr(_launch, "_runtime", _launch._UNRESOLVED)
    yield launches


INTS = [0, 1, 2, 15, 16, 17, 48, -1, -16, -17, 2**31 - 16, 2**31 - 1, 2**31, 2**31 + 16, -2**31, -2**31 - 1,
        -2**31 - 16, 2**40, 2**40 + 3, 2**63 - 16, 2**63, 2**63 + 16, 2**63 + 1, 2**64 - 1]


def _tensors():
    out = []
    for dtype, size in ((torch.float32, 4), (torch.bfloat16, 2), (torch.int64, 8), (torch.uint8, 1)):
        for offset in (0, size, 16, 16 + size, 32):
            base = torch.zeros(256, dtype=torch.uint8)
            aligned = base[(-base.data_ptr()) % 16:]
            out.append(aligned[offset:offset + 64].view(dtype))
    return out


def test_key_is_never_coarser_than_tritons_specialization(cuda_like):
    kernel = JITFunction(_sample)
    binder = kernel.device_caches[0][4]
    x, y = _tensors()[0], _tensors()[1]
    samples = []
    for t in _tensors():
        samples.append((t, y, 16, 16, 0.5, True))
        samples.append((x, t, 16, 16, 0.5, True))
    for i in INTS:
        samples.append((x, y, i, 16, 0.5, True))
        samples.append((x, y, 16, i, 0.5, False))
    for scale, flag in itertools.product((0.0, 1.0, 0.5, 16.0), (True, False)):
        samples.append((x, y, 3, 5, scale, flag))
    seen = {}
    for args in samples:
        for kwargs in ({"BLOCK": 64}, {"BLOCK": 64, "num_warps": 8}, {"BLOCK": 128, "MODE": 3},
                       {"BLOCK": 64, "debug": True, "sanitize_overflow": False}):
            key = specialization_key(0, args, kwargs)
            assert key is not None
            _, specialization, options = binder(*args, **kwargs)
            triton_key = (repr(specialization), repr(options))
            assert seen.setdefault(key, triton_key) == triton_key, (
                f"one key for two Triton specializations: {args} {kwargs}")
    assert len(set(seen.values())) > 20  # the samples do exercise Triton's specializations


def test_direct_launch_passes_what_triton_passes(cuda_like):
    launches = cuda_like
    kernel = FastLaunch(JITFunction(_sample))
    x, y = _tensors()[0], _tensors()[5]
    for args, kwargs, grid in (
        ((x, y, 7, 32, 0.25, False), {"BLOCK": 64, "num_warps": 4}, (3,)),
        ((x, y, 1, 33, 2.0, True), {"BLOCK": 128, "MODE": 5}, (2, 5)),
        ((y, x, 2**33, 16, 1.0, True), {"BLOCK": 64}, (1, 2, 3)),
        # The embedding's device-side assertions: compile options, launched directly too.
        ((x, y, 7, 32, 0.25, False), {"BLOCK": 64, "debug": True, "sanitize_overflow": False}, (3,)),
    ):
        launches.clear()
        kernel[grid](*args, **kwargs)  # compiles (here: the stand-in) and launches through Triton
        kernel[grid](*args, **kwargs)  # the direct launch
        assert len(launches) == 2
        through_triton, direct = launches
        # Grid, stream, function, metadata and every argument alike; no launch metadata and no
        # hooks where Triton passes its empty hook chains.
        assert direct[:6] == through_triton[:6] and direct[9:] == through_triton[9:]
        assert direct[6:9] == (None, None, None)
        assert not through_triton[7].calls and not through_triton[8].calls
    assert kernel.arg_names == ["x_ptr", "y_ptr", "n", "stride", "scale", "flag", "BLOCK", "MODE"]  # passed through


def test_specializations_triton_cannot_share_are_launched_apart(cuda_like):
    kernel = FastLaunch(JITFunction(_sample))
    tensors = _tensors()
    aligned, unaligned = tensors[0], tensors[1]  # fp32 at offset 0 and at 4 bytes
    kernel[(1,)](aligned, aligned, 16, 16, 1.0, True, BLOCK=64)
    kernel[(1,)](unaligned, aligned, 16, 16, 1.0, True, BLOCK=64)
    kernel[(1,)](aligned, aligned, 1, 16, 1.0, True, BLOCK=64)
    assert len(kernel._compiled) == 3
    assert len(kernel.fn.device_caches[0][0]) == 3  # and Triton compiled three kernels for them


def test_prepared_launch_passes_what_triton_passes(cuda_like):
    """A launch with its scalars and keyword arguments keyed once (launch_prepared) hands the
    compiled kernel what an ordinary launch hands it, and compiles apart what Triton specializes
    apart: the tensors' dtypes and alignments (keyed per launch), the scalars' values (keyed in the
    prepared key)."""
    launches = cuda_like
    kernel = FastLaunch(JITFunction(_sample))
    tensors = _tensors()
    x, y, unaligned = tensors[0], tensors[5], tensors[1]
    for pair, scalars, kwargs in (((x, y), (7, 32, 0.25, False), {"BLOCK": 64, "num_warps": 4}),
                                  ((unaligned, y), (7, 32, 0.25, False), {"BLOCK": 64, "num_warps": 4}),
                                  ((x, y), (1, 32, 0.25, False), {"BLOCK": 64, "num_warps": 4}),
                                  ((x, y), (7, 32, 0.25, False), {"BLOCK": 128, "num_warps": 4})):
        launches.clear()
        key = prepared_key(scalars, kwargs)
        kernel.launch_prepared((3,), pair, scalars, kwargs, key)  # compiles, through Triton
        kernel.launch_prepared((3,), pair, scalars, kwargs, key)  # direct
        kernel[(3,)](*pair, *scalars, **kwargs)  # an ordinary launch of the same arguments
        through_triton, direct, ordinary = launches
        assert direct[:6] == through_triton[:6] and direct[9:] == through_triton[9:] == ordinary[9:]
        assert direct[6:9] == (None, None, None)
    assert len(kernel._prepared) == 4 and len(kernel.fn.device_caches[0][0]) == 4
    # A tensor among the scalars is never keyed ahead (its address changes): Triton's path.
    assert prepared_key((x, 3), {"BLOCK": 64}) is None
    calls = len(launches)
    kernel.launch_prepared((1,), (x,), (y, 7, 32, 0.25, False), {"BLOCK": 64}, None)
    assert len(launches) == calls + 1


@pytest.mark.parametrize("case", ["callable grid", "unknown argument type", "launch hook", "constexpr by position",
                                  "runtime argument by keyword"])
def test_what_the_shortcut_leaves_to_triton(cuda_like, monkeypatch, case):
    launches = cuda_like
    kernel = FastLaunch(JITFunction(_sample))
    x = _tensors()[0]
    args, kwargs, grid = (x, x, 16, 16, 1.0, True), {"BLOCK": 64}, (1,)
    if case == "callable grid":
        grid = lambda meta: (1,)
    elif case == "unknown argument type":
        args = (x, x, _IntLike(16), 16, 1.0, True)
    elif case == "launch hook":
        from triton import knobs

        chain = type(knobs.runtime.launch_enter_hook)()
        chain.add(lambda metadata: None)
        monkeypatch.setattr(knobs.runtime, "launch_enter_hook", chain)
    elif case == "constexpr by position":
        args, kwargs = (x, x, 16, 16, 1.0, True, 64), {}
    elif case == "runtime argument by keyword":
        args, kwargs = (x, x, 16, 16, 1.0), {"flag": True, "BLOCK": 64}
    calls = []
    original = JITFunction.run
    monkeypatch.setattr(JITFunction, "run", lambda self, *a, **k: calls.append(1) or original(self, *a, **k))
    for _ in range(3):
        kernel[grid](*args, **kwargs)
    assert len(calls) == 3 and len(launches) == 3  # every launch went through JITFunction.run


@pytest.mark.parametrize("route", ["through Triton", "direct"])
def test_a_cpu_tensor_is_named(cuda_like, monkeypatch, route):
    """Triton's launcher refuses a pointer the GPU cannot reach without naming it; both routes name
    the kernel's CPU tensors instead. Other errors pass through unchanged."""
    kernel = FastLaunch(JITFunction(_sample))
    x = _tensors()[0]
    if route == "direct":
        kernel[(1,)](x, x, 16, 16, 1.0, True, BLOCK=64)  # compiled: the next launch is direct

    monkeypatch.setattr(_Compiled, "error", ValueError("Pointer argument cannot be accessed from Triton (cpu tensor?)"))
    with pytest.raises(ValueError, match=r"_sample: x_ptr, y_ptr are CPU tensors, but this kernel runs on the GPU"):
        kernel[(1,)](x, x, 16, 16, 1.0, True, BLOCK=64)
    monkeypatch.setattr(_Compiled, "error", ValueError("other"))
    with pytest.raises(ValueError, match="^other$"):
        kernel[(1,)](x, x, 16, 16, 1.0, True, BLOCK=64)


class _IntLike(int):
    """An int subclass (numpy's and SymInt's kind of stand-in): not a type the key knows."""


def test_interpreted_and_other_kernels_are_passed_through():
    class NotJit:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: ("launched", grid, args, kwargs)

    wrapped = FastLaunch(NotJit())
    assert wrapped[(2,)](1, A=3) == ("launched", (2,), (1,), {"A": 3})
    assert not wrapped._jit


def test_through_triton_sends_every_launch_to_jitfunction_run(cuda_like, monkeypatch):
    kernel = FastLaunch(JITFunction(_sample))
    x = _tensors()[0]
    kernel[(1,)](x, x, 16, 16, 1.0, True, BLOCK=64)  # compiled: the next launch would be direct
    calls = []
    original = JITFunction.run
    monkeypatch.setattr(JITFunction, "run", lambda self, *a, **k: calls.append(1) or original(self, *a, **k))
    with _launch.through_triton():
        kernel[(1,)](x, x, 16, 16, 1.0, True, BLOCK=64)
    kernel[(1,)](x, x, 16, 16, 1.0, True, BLOCK=64)
    assert calls == [1]


def test_every_launched_kernel_takes_the_fast_path():
    """Every module-level ``*_kernel`` in onca.ops is wrapped (a new kernel copies the decorator)."""
    import importlib
    import pkgutil

    import onca.ops

    unwrapped = []
    for info in pkgutil.iter_modules(onca.ops.__path__):
        module = importlib.import_module(f"onca.ops.{info.name}")
        for name, value in vars(module).items():
            if name.endswith("_kernel") and hasattr(value, "__getitem__") and not isinstance(value, FastLaunch):
                if hasattr(value, "fn") or hasattr(value, "arg_names"):
                    unwrapped.append(f"{info.name}.{name}")
    assert unwrapped == []
    assert isinstance(onca.ops.layer_norm._layer_norm_forward_kernel, FastLaunch)


@pytest.mark.parametrize("profile_name, cols, capped", [
    ("h100", 16384, True),   # a one-pass 16-warp tile: two programs' registers each
    ("h200", 16384, True),
    ("h100", 4096, False),   # fewer warps: capping measured slower
    ("h100", 32768, False),  # a two-pass tile
    ("ascend910b4", 16384, False),  # not a GPU
])
def test_wide_row_norm_forwards_keep_two_programs_per_sm(monkeypatch, profile_name, cols, capped):
    from onca import device
    from onca.ops.layer_norm import FORWARD_TILES, _layer_norm_forward_kernel

    monkeypatch.setenv("ONCA_DEVICE_PROFILE", profile_name)
    device.reset()
    try:
        for cap in (True, False):
            _, kwargs, plan = _launch.row_launch(_layer_norm_forward_kernel, 4096, cols, torch.bfloat16,
                                                 FORWARD_TILES, {}, cap_registers=cap)
            want = cap and capped
            assert ("maxnreg" in kwargs) == want, (cap, kwargs)
            if want:
                assert kwargs["maxnreg"] * 2 * 32 * kwargs["num_warps"] == 65536 and plan.col_tiles == 1
    finally:
        monkeypatch.delenv("ONCA_DEVICE_PROFILE")
        device.reset()


@pytest.mark.parametrize("profile_name, cols, sharing", [
    ("h100", 1024, 2),   # 8-warp programs, two an SM: each capped at half the register file
    ("h200", 2048, 2),
    ("h100", 4096, 1),   # 16-warp programs (min_gpu_rows): one an SM, nothing to cap
    ("ascend910b4", 1024, 1),  # not a GPU
])
def test_persistent_backward_caps_registers_for_the_programs_its_grid_counts_on(monkeypatch, profile_name,
                                                                              cols, sharing):
    from onca import device
    from onca.ops._row_norm import backward_plan
    from onca.ops.layer_norm import BACKWARD_TILES, _layer_norm_backward_kernel

    monkeypatch.setenv("ONCA_DEVICE_PROFILE", profile_name)
    device.reset()
    try:
        for cap in (True, False):
            _, kwargs, plan = _launch.row_launch(_layer_norm_backward_kernel, 16384, cols, torch.bfloat16,
                                                 BACKWARD_TILES, {}, plan=backward_plan, cap_registers=cap)
            assert plan.persistent
            want = cap and sharing > 1
            assert ("maxnreg" in kwargs) == want, (cap, kwargs)
            if want:
                assert kwargs["maxnreg"] * sharing * 32 * kwargs["num_warps"] == 65536
                assert _launch.programs_fitting(kwargs["maxnreg"], kwargs["num_warps"]) == sharing
                assert plan.grid == sharing * device.get_profile().compute_units
    finally:
        monkeypatch.delenv("ONCA_DEVICE_PROFILE")
        device.reset()


def test_layer_norms_16_bit_forward_and_backward_ask_for_the_cap_and_agree(monkeypatch, device):
    # The interpreter takes the GPU profile's capped launch too (maxnreg is a compile option only).
    from onca import device as onca_device
    from onca.ops import _row_norm
    from onca.ops.layer_norm import layer_norm

    asked = []

    def spy(*args, cap_registers=False, **kwargs):
        asked.append(cap_registers)
        return _launch.row_launch(*args, cap_registers=cap_registers, **kwargs)

    monkeypatch.setattr(_row_norm, "row_launch", spy)
    monkeypatch.setenv("ONCA_DEVICE_PROFILE", "h100")
    onca_device.reset()
    try:
        for dtype in (torch.bfloat16, torch.float32):
            x = torch.randn(2, 16384, dtype=dtype, device=device)
            w = torch.rand(16384, dtype=dtype, device=device) + 0.5
            b = torch.randn(16384, dtype=dtype, device=device)
            x.requires_grad_(True)
            y = layer_norm(x, w, b, 1e-5)
            ref = torch.nn.functional.layer_norm(x.float(), (16384,), w.float(), b.float(), 1e-5)
            torch.testing.assert_close(y.float(), ref, rtol=2e-2, atol=3e-2)
            dy = torch.randn_like(y)
            (dx,) = torch.autograd.grad(y, x, dy)
            (ref_dx,) = torch.autograd.grad(ref, x, dy.float())
            torch.testing.assert_close(dx.float(), ref_dx.float(), rtol=2e-2, atol=3e-2)
        assert asked == [True, True, False, False]  # forward, backward: bf16 capped, fp32 not
    finally:
        monkeypatch.delenv("ONCA_DEVICE_PROFILE")
        onca_device.reset()


def test_the_eager_route_takes_plain_tensors_and_scalars_only():
    """An op call runs its launcher directly only on plain tensors (parameters too) and schema
    scalars; any tensor subclass takes the registered op, whatever its place among the arguments."""
    from onca.ops._contract import _traced

    class Wrapped(torch.Tensor):
        pass

    x = torch.ones(2)
    plain = (x, torch.nn.Parameter(x.clone()), 3, 0.5, True, "mean", None, torch.float32)
    assert not _traced(plain)
    assert _traced(plain + (x.as_subclass(Wrapped),))
    assert _traced((x.as_subclass(Wrapped), 1))
