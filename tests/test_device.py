"""Device profiles: the table, detection order, overrides and the interpreter switch."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest

from onca import device as d


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    for var in ("ONCA_DEVICE_PROFILE", "ONCA_ONCHIP_BYTES", "ONCA_COMPUTE_UNITS"):
        monkeypatch.delenv(var, raising=False)
    d.reset()
    yield
    d.reset()


def test_builtin_profiles_hold_the_platform_figures():
    for name in ("h100", "h200", "a100", "ascend910b2", "ascend910b4", "ascend950", "cpu-interpreter"):
        assert name in d.PROFILES
    assert d.PROFILES["ascend910b2"].onchip_bytes == 196608
    assert d.PROFILES["ascend910b4"].onchip_bytes == 196608
    assert d.PROFILES["ascend950"].onchip_bytes == 253952
    assert [d.PROFILES[n].compute_units for n in ("ascend910b2", "ascend910b4", "ascend950")] == [48, 40, 56]
    for name in ("ascend910b2", "ascend910b4", "ascend950"):
        p = d.PROFILES[name]
        assert p.kind == "npu" and p.persistent and p.align_bytes == 32


def test_profiles_are_frozen_and_validated():
    p = d.PROFILES["h100"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.compute_units = 1
    with pytest.raises(ValueError, match="kind"):
        d.DeviceProfile("tpu", "x", 1, 1, True, 0.0)
    with pytest.raises(ValueError, match="onchip_bytes"):
        d.DeviceProfile("cuda", "x", 1, 0, True, 0.0)


def test_env_profile_wins(monkeypatch):
    monkeypatch.setenv("ONCA_DEVICE_PROFILE", "ascend910b4")
    assert d.get_profile() is d.PROFILES["ascend910b4"]


def test_unknown_env_profile_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("ONCA_DEVICE_PROFILE", "tpu-v9")
    with pytest.raises(ValueError, match="ONCA_DEVICE_PROFILE='tpu-v9' is not a built-in profile"):
        d.get_profile()


def test_field_overrides(monkeypatch):
    monkeypatch.setenv("ONCA_DEVICE_PROFILE", "ascend950")
    monkeypatch.setenv("ONCA_ONCHIP_BYTES", "4096")
    monkeypatch.setenv("ONCA_COMPUTE_UNITS", "3")
    p = d.get_profile()
    assert (p.name, p.onchip_bytes, p.compute_units) == ("ascend950", 4096, 3)
    monkeypatch.setenv("ONCA_COMPUTE_UNITS", "many")
    assert d.get_profile() is p  # kept until reset(): every launch asks for the profile
    d.reset()
    with pytest.raises(ValueError, match="ONCA_COMPUTE_UNITS must be a positive integer"):
        d.get_profile()


def test_profile_named_takes_the_overrides_and_changes_nothing(monkeypatch):
    in_force = d.get_profile()
    monkeypatch.setenv("ONCA_ONCHIP_BYTES", "4096")
    p = d.profile_named("ascend910b4")
    assert (p.name, p.onchip_bytes, p.compute_units) == ("ascend910b4", 4096, 40)
    assert d.get_profile() is in_force
    with pytest.raises(ValueError, match="unknown device profile 'tpu-v9'; profiles: a100, "):
        d.profile_named("tpu-v9")


def test_detection_falls_back_to_the_accelerator_or_interpreter():
    p = d.get_profile()
    where = d.accelerator()
    assert p.kind == where
    if where == "cpu":
        assert p.name == "cpu-interpreter"
        assert d.interpreter_active()
    if where == "cuda":
        import torch

        props = torch.cuda.get_device_properties(0)
        assert p.compute_units == props.multi_processor_count  # read from the device, not the table
        from triton.runtime import driver

        assert p.shared_bytes == driver.active.utils.get_device_properties(0)["max_shared_mem"]


def test_shared_memory_comes_from_triton_driver_or_the_table(monkeypatch):
    """Triton's launcher checks a kernel's shared memory against its driver's ``max_shared_mem``:
    the planner's limit is that figure where the driver gives it, the profile's table otherwise."""
    import types

    from triton.runtime import driver

    def props(value):
        utils = types.SimpleNamespace(get_device_properties=lambda device: value)
        return types.SimpleNamespace(utils=utils)

    monkeypatch.setattr(d.torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(driver, "_active", props({"max_shared_mem": 101376}), raising=False)
    monkeypatch.setattr(type(driver), "active", property(lambda self: self._active), raising=False)
    assert d._cuda_shared_bytes() == 101376
    monkeypatch.setattr(driver, "_active", props({}), raising=False)
    assert d._cuda_shared_bytes() is None
    assert d.PROFILES["h200"].shared_bytes == 232448 and d.PROFILES["ascend910b4"].shared_bytes == 0
    assert "(232448 of them shared memory)" in d.PROFILES["h200"].describe()
    assert "shared" not in d.PROFILES["ascend910b4"].describe()
    with pytest.raises(ValueError, match="shared_bytes must be a non-negative int"):
        d.DeviceProfile("cuda", "x", 1, 1024, False, 0.0, shared_bytes=-1)


def _run(code: str, env: dict) -> str:
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          check=True).stdout.strip()


@pytest.mark.skipif(d.accelerator() != "cpu", reason="the automatic switch applies without an accelerator")
def test_interpreter_switched_on_without_accelerator_unless_user_chose():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = "import onca, os; print(os.environ.get('TRITON_INTERPRET'))"
    assert _run(code, env) == "1"
    assert _run(code, {**env, "TRITON_INTERPRET": "0"}) == "0"


def test_interpreter_scalars_index_on_triton_releases_that_used_int_of_an_array(monkeypatch):
    # Triton <= 3.6's interpreter indexed a program id (a one-element array) with int(array), which
    # NumPy >= 2.4 refuses; Onca's patch must make such a scalar usable as a range bound.
    import numpy as np
    from triton.runtime import interpreter

    def old_patch(tensor, scope):
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data))

    monkeypatch.setattr(interpreter, "_patch_lang_tensor", old_patch)
    d._scalar_index_in_interpreter()
    d._scalar_index_in_interpreter()  # a second call must not wrap twice
    assert interpreter._patch_lang_tensor.onca_scalar_index

    class Scope:
        def set_attr(self, obj, name, value):
            setattr(obj, name, value)

    class Handle:
        data = np.array([3], dtype=np.int32)

    class Scalar:
        handle = Handle()

    interpreter._patch_lang_tensor(Scalar, Scope())
    assert list(range(Scalar(), 6)) == [3, 4, 5]


# ------------------------------------------------- NPU detection, torch_npu mocked (conftest's fake_npu)


@pytest.mark.parametrize("chip,profile", [
    ("Ascend910B1", "ascend910b2"), ("Ascend910B2", "ascend910b2"), ("Ascend910B2C", "ascend910b2"),
    ("Ascend910B3", "ascend910b4"), ("Ascend910B4", "ascend910b4"), ("Ascend950PR", "ascend950"),
    ("Ascend910_9589", "ascend950"), ("Ascend 910B4", "ascend910b4"), ("Ascend310P3", "ascend910b2"),
])
def test_npu_profile_from_the_device_name(fake_npu, chip, profile):
    fake_npu(chip)
    assert d.accelerator() == "npu"
    assert d.get_profile() == d.PROFILES[profile]  # no driver figures: the table's


def test_npu_limits_come_from_triton_ascends_driver(fake_npu):
    fake_npu("Ascend910B4", {"max_shared_mem": 1, "num_aicore": 24, "num_vectorcore": 48})
    p = d.get_profile()
    assert (p.name, p.compute_units, p.onchip_bytes) == ("ascend910b4", 48, 196608)  # no UB size reported
    fake_npu("Ascend950PR", {"num_vectorcore": 64, "ub_size": 131072})
    p = d.get_profile()
    assert (p.name, p.compute_units, p.onchip_bytes) == ("ascend950", 64, 131072)
    fake_npu("Ascend910B2", {"num_vectorcore": 0})  # a nonsense report: the table stands
    assert d.get_profile() == d.PROFILES["ascend910b2"]


def test_npu_host_compiles_kernels_unless_told(fake_npu, monkeypatch):
    fake_npu("Ascend910B4")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not d.ensure_interpreter()  # kernels are compiled by triton-ascend, not interpreted
    monkeypatch.setenv("ONCA_DEVICE_PROFILE", "h100")
    d.reset()
    assert d.get_profile() is d.PROFILES["h100"]  # the environment still wins


def test_without_torch_npu_there_is_no_npu(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # import fails
    assert d.accelerator() != "npu"


def test_interpreter_rounds_fp32_to_bf16_as_the_gpu_does():
    """Round to nearest, ties to even, carries into the exponent, overflow to inf, NaN kept: what
    torch's cast (and the GPU's cvt.rn.bf16.f32) gives; the stock interpreter truncates."""
    import torch
    import triton
    import triton.language as tl

    @triton.jit
    def cast(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=offs < n).to(tl.bfloat16), mask=offs < n)

    device = "cuda" if torch.cuda.is_available() else "cpu"
    special = torch.tensor([1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8, 1.0 + 2 ** -8 + 2 ** -20, 2 - 2 ** -9, -1.0 - 2 ** -7 + 2 ** -9,
                            3.4e38, float("inf"), float("-inf"), float("nan"), 0.0, -0.0, 1e-40])
    x = torch.cat([special, torch.randn(500) * 10.0 ** torch.randint(-6, 6, (500,))]).to(device)
    y = torch.empty(x.shape, dtype=torch.bfloat16, device=device)
    cast[(1,)](x, y, x.numel(), BLOCK=1024)
    expected = x.to(torch.bfloat16)
    same = (y.view(torch.int16) == expected.view(torch.int16)) | (y.isnan() & expected.isnan())
    assert bool(same.all()), f"{int((~same).sum())} casts differ, e.g. {x[~same][:4].tolist()}"


_CAST_SCRIPT = '''
import torch, triton, triton.language as tl
import onca  # switches the interpreter on (no accelerator) and makes its casts round as the GPU's

@triton.jit
def cast(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=offs < n).to(tl.bfloat16), mask=offs < n)

x = torch.tensor([1.0 + 2 ** -8 + 2 ** -20, 1.0 + 3 * 2 ** -8, -1.0 - 2 ** -7 + 2 ** -9] + [0.1 * k for k in range(1, 30)])
y = torch.empty(x.shape, dtype=torch.bfloat16)
cast[(1,)](x, y, x.numel(), BLOCK=32)
print(int((y.view(torch.int16) != x.to(torch.bfloat16).view(torch.int16)).sum()))
'''


@pytest.mark.skipif(d.accelerator() != "cpu", reason="the interpreter: a CPU without an accelerator")
def test_onca_makes_any_interpreter_run_round_as_the_gpu(tmp_path):
    """Not the tests' doing: a plain script that imports Onca gets round-to-nearest casts (the stock
    interpreter truncates, which shrank cross entropy's bf16 gradient by 0.28% on average)."""
    script = tmp_path / "cast.py"
    script.write_text(_CAST_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-1] == "0", out.stdout
