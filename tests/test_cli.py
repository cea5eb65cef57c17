"""The ``onca`` command on the CPU."""

from __future__ import annotations

import importlib.util

import pytest

from onca import cli
from onca import device as onca_device


def test_env(capsys):
    assert cli.main(["env"]) == 0
    out = capsys.readouterr().out
    assert "profile" in out and "torch" in out and "triton" in out


def test_plan_prints_both_passes(capsys):
    assert cli.main(["plan", "rms_norm", "--shape", "16384x4096", "--profile", "ascend910b4"]) == 0
    out = capsys.readouterr().out
    assert "forward" in out and "backward" in out and "ascend910b4" in out


def test_plan_bad_input(capsys):
    assert cli.main(["plan", "no_such_op", "--shape", "4x4"]) == 2
    with pytest.raises(SystemExit):
        cli.main(["plan", "rms_norm", "--shape", "4xfour"])


@pytest.mark.skipif(onca_device.accelerator() != "cpu", reason="the CPU smoke-test path of onca bench")
def test_bench_list_and_cpu_smoke(tmp_path, capsys):
    assert cli.main(["bench", "--list"]) == 0
    assert "rms_norm" in capsys.readouterr().out
    out_dir = tmp_path / "data"
    code = cli.main(["bench", "rms_norm", "--sweep", "d1", "--providers", "onca,torch", "--modes", "forward,full",
                     "--out", str(out_dir), "--no-progress", "--plot", "--plot-dir", str(tmp_path / "plots")])
    assert code == 0
    out = capsys.readouterr().out
    assert "smoke test" in out and "vs torch" in out
    assert (out_dir / "results.csv").exists()
    assert list(out_dir.glob("rms_norm-cpu-bfloat16.json"))
    assert list((tmp_path / "plots").rglob("*.png"))  # the CPU run charts itself when asked


def test_bench_rejects_unknown_names(capsys):
    assert cli.main(["bench", "nope"]) == 2
    assert cli.main(["bench", "rms_norm", "--providers", "onca,jax"]) == 2


def test_env_on_an_npu(fake_npu, capsys):
    fake_npu("Ascend910B4", {"num_vectorcore": 40})
    assert cli.main(["env"]) == 0
    out = capsys.readouterr().out
    assert "accelerator   npu" in out and "device        Ascend910B4" in out
    assert "torch_npu" in out and "ascend910b4 (npu): 40 compute units" in out


def test_audit_needs_a_compiler_and_triton_ascend(capsys):
    assert cli.main(["audit"]) == 2
    assert "--ascend" in capsys.readouterr().err
    # Stock Triton here: the audit says what it needs (its output comes from a child process).
    code = cli.main(["audit", "--ascend", "--ops", "rms_norm"])
    assert code == (0 if importlib.util.find_spec("triton.backends.ascend") else 2)


def test_audit_covers_every_ascend_profile():
    from onca import audit

    assert set(audit.ASCEND_TARGETS) == {n for n, p in onca_device.PROFILES.items() if p.kind == "npu"}
