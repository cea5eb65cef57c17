"""Fixtures shared by every test: where kernels run, at what scale, under which device profile."""

from __future__ import annotations

import os
import sys
import types

import pytest
import torch

# Tests check Onca's kernels at every size: no call takes torch's small-call route (its own
# tests turn it on), here or in the subprocesses tests start.
os.environ["ONCA_SMALL_CALL_LIMIT"] = "0"

import onca  # noqa: E402  (switches the interpreter on when there is no accelerator)
from onca import device as onca_device  # noqa: E402
from tests.helpers import SCALE  # noqa: E402

onca.set_small_call_limit(0)  # in case a plugin imported onca before the variable was set

# Profiles every op is tested under: the one detected here, and an Ascend NPU's.
PROFILES = ("default", "ascend910b4")


@pytest.fixture(scope="session")
def device() -> str:
    """Where test tensors live: the accelerator if there is one, else the CPU (interpreter)."""
    where = onca_device.accelerator()
    return {"cuda": "cuda", "npu": "npu"}.get(where, "cpu")


@pytest.fixture(scope="session")
def scale() -> str:
    """``"cpu"`` (small shapes, CI) or ``"gpu"`` (``ONCA_TEST_SCALE=gpu``: real sizes)."""
    return SCALE


@pytest.fixture(params=PROFILES)
def profile(request, monkeypatch):
    """Run the test under the detected profile and under the Ascend 910B4 profile."""
    if request.param == "default":
        monkeypatch.delenv("ONCA_DEVICE_PROFILE", raising=False)
    else:
        monkeypatch.setenv("ONCA_DEVICE_PROFILE", request.param)
    onca_device.reset()
    yield onca_device.get_profile()
    onca_device.reset()


@pytest.fixture
def gpu_profile(monkeypatch):
    """Run the test under the H200 profile, whatever the device: a GPU's plans (one program per
    unit of work, its tile sizes) executed by the interpreter on the CPU."""
    monkeypatch.setenv("ONCA_DEVICE_PROFILE", "h200")
    onca_device.reset()
    yield onca_device.get_profile()
    monkeypatch.delenv("ONCA_DEVICE_PROFILE", raising=False)
    onca_device.reset()


@pytest.fixture
def onchip_bytes(monkeypatch):
    """Force a small on-chip budget (so wide rows take the column-tiled path); returns a setter."""

    def force(n: int):
        monkeypatch.setenv("ONCA_ONCHIP_BYTES", str(n))
        onca_device.reset()
        return onca_device.get_profile()

    yield force
    monkeypatch.delenv("ONCA_ONCHIP_BYTES", raising=False)
    onca_device.reset()


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


_TEST_SECONDS: dict[str, list] = {}  # per test: [seconds so far, failed in a phase]


def pytest_runtest_logreport(report):
    """With ``ONCA_TEST_TIMES`` set to a file, each test's seconds (setup, call and teardown) and
    outcome are appended to it as the test ends: a GPU shard cut off by a device call's time limit
    still shows where its time went (pytest's ``--durations`` prints only at the end)."""
    path = os.environ.get("ONCA_TEST_TIMES")
    if not path:
        return
    entry = _TEST_SECONDS.setdefault(report.nodeid, [0.0, False, "passed"])
    entry[0] += report.duration
    entry[1] = entry[1] or report.failed
    if report.when == "call" or report.skipped:
        entry[2] = report.outcome
    if report.when == "teardown":
        seconds, failed, outcome = _TEST_SECONDS.pop(report.nodeid)
        with open(path, "a") as log:
            log.write(f"{seconds:.1f}\t{'failed' if failed else outcome}\t{report.nodeid}\n")


def pytest_report_header(config):
    return (
        f"onca: scale={SCALE}, accelerator={onca_device.accelerator()}, "
        f"TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET', '0')}, "
        f"profile={onca_device.get_profile().name}"
    )


@pytest.fixture
def fake_npu(monkeypatch):
    """Make this CPU machine look like an Ascend NPU host: an importable ``torch_npu``, a
    ``torch.npu`` that names the chip, and triton-ascend's driver reporting ``properties``."""
    import triton.runtime  # here, not at the top: Onca must switch the interpreter on first

    def install(chip: str, properties=None):
        monkeypatch.setitem(sys.modules, "torch_npu", types.ModuleType("torch_npu"))
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
        npu = types.SimpleNamespace(is_available=lambda: True, current_device=lambda: 0,
                                    get_device_name=lambda index: chip)
        monkeypatch.setattr(torch, "npu", npu, raising=False)
        if properties is None:
            monkeypatch.setattr(triton.runtime, "driver", None)  # no driver: `driver.active` fails
        else:
            utils = types.SimpleNamespace(get_device_properties=lambda index: properties)
            monkeypatch.setattr(triton.runtime, "driver",
                                types.SimpleNamespace(active=types.SimpleNamespace(utils=utils)))
        onca_device.reset()

    yield install
    onca_device.reset()  # the next profile is detected without the mocks
