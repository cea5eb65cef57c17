"""The ``onca`` command on the CPU."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import pathlib
import re
import sys

import pytest

from onca import cli
from onca import device as onca_device

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def test_env(capsys):
    assert cli.main(["env"]) == 0
    out = capsys.readouterr().out
    assert "profile" in out and "torch" in out and "triton" in out


def test_plan_prints_both_passes(capsys):
    in_force = onca_device.get_profile()
    assert cli.main(["plan", "rms_norm", "--shape", "16384x4096", "--profile", "ascend910b4"]) == 0
    out = capsys.readouterr().out
    assert "forward" in out and "backward" in out and "ascend910b4" in out
    assert onca_device.get_profile() == in_force  # --profile plans for that profile and changes nothing


def test_plan_unknown_profile_names_the_option(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["plan", "rms_norm", "--shape", "4x4", "--profile", "nosuch"])
    assert exit_info.value.code == 2
    err = _one_line(capsys.readouterr().err)
    assert "--profile" in err and "'nosuch'" in err and "ONCA_DEVICE_PROFILE" not in err
    assert all(name in err for name in onca_device.PROFILES)


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
    # --no-progress: a line per finished run (each point and provider), with its time.
    runs = [line for line in out.splitlines() if line.startswith("bench rms_norm ") and line.endswith(" s")]
    assert any("onca" in line for line in runs) and any("torch" in line for line in runs), out
    assert (out_dir / "results.csv").exists()
    assert list(out_dir.glob("rms_norm-cpu-bfloat16.json"))
    assert list((tmp_path / "plots").rglob("*.png"))  # the CPU run charts itself when asked


def test_bench_keeps_each_point_in_csv_and_json_when_cut_short(tmp_path, monkeypatch, capsys):
    """A run cut short (the device call's time limit) keeps every point measured before it, in the
    CSV and in the op's JSON record file (which once was written only at the end of the op's run)."""
    from onca.bench import harness, records

    calls = []
    real = harness.Harness._run_point

    def run_point(self, *args, **kwargs):
        if calls:  # the second (point, provider) run is cut off
            raise KeyboardInterrupt
        calls.append(args[1])
        return real(self, *args, **kwargs)

    monkeypatch.setattr(harness.Harness, "_run_point", run_point)
    out_dir = tmp_path / "data"
    with pytest.raises(KeyboardInterrupt):
        # One round (a GPU's default is more): the second call is the torch provider's.
        cli.main(["bench", "rms_norm", "--sweep", "d1", "--providers", "onca,torch", "--modes", "full",
                  "--rounds", "1", "--out", str(out_dir), "--no-progress"])
    capsys.readouterr()
    assert calls == ["onca"]
    rows = records.read_csv(str(out_dir / "results.csv"))
    assert [(r["kernel_provider"], r["metric_name"]) for r in rows] == [("onca", "speed"), ("onca", "memory")]
    saved = json.loads(next(out_dir.glob("rms_norm-*-bfloat16.json")).read_text())
    assert [(r["kernel_provider"], r["metric_name"], [str(x) for x in r["x_values"]]) for r in saved] == [
        ("onca", "speed", [rows[0]["x_value"]]), ("onca", "memory", [rows[0]["x_value"]])]


def test_bench_json_keeps_earlier_runs_into_the_same_directory(tmp_path, capsys):
    """Runs one after another into one directory (a provider per device call, say) add up in the op's
    JSON: each run keeps what earlier runs measured and replaces only the points it measured again."""
    out_dir = tmp_path / "data"
    run = lambda providers: cli.main(["bench", "rms_norm", "--sweep", "d1", "--providers", providers,  # noqa: E731
                                      "--modes", "full", "--out", str(out_dir), "--no-progress"])
    assert run("onca") == 0
    first = json.loads(next(out_dir.glob("rms_norm-*-bfloat16.json")).read_text())
    assert run("torch") == 0 and run("onca") == 0
    capsys.readouterr()
    saved = json.loads(next(out_dir.glob("rms_norm-*-bfloat16.json")).read_text())
    shape = lambda recs, provider: sorted(  # noqa: E731
        (provider, r["metric_name"], r["x_name"], tuple(map(str, r["x_values"]))) for r in recs)
    held = sorted((r["kernel_provider"], r["metric_name"], r["x_name"], tuple(map(str, r["x_values"])))
                  for r in saved)
    assert held == sorted(shape(first, "onca") + shape(first, "torch")), held
    onca_speed = next(r for r in saved if r["kernel_provider"] == "onca" and r["metric_name"] == "speed")
    assert onca_speed["timestamp"] >= first[0]["timestamp"]  # the rerun's points replaced the first run's


def test_bench_rejects_unknown_names(capsys):
    assert cli.main(["bench", "nope"]) == 2
    assert cli.main(["bench", "rms_norm", "--providers", "onca,jax"]) == 2
    capsys.readouterr()
    assert cli.main(["bench", "fused_moe", "--sweep", "d2", "--points", "mixtral-8x7b,llama-3-8b"]) == 2
    err = capsys.readouterr().err
    assert "--points llama-3-8b" in err and "gpt-oss-20b" in err and "mixtral-8x7b," not in err.split("(")[0]


def _one_line(err: str) -> str:
    """``err`` is one line (and no traceback); returns it."""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.fixture
def compare_module():
    pytest.importorskip("transformers")
    from onca.integrations.transformers import compare

    return compare


@pytest.fixture
def compare(compare_module, monkeypatch):
    """The compare module, with training refused: these errors must come before any training."""

    def train(*args, **kwargs):
        raise AssertionError("trained before refusing")

    monkeypatch.setattr(compare_module, "train", train)
    return compare_module


def test_compare_plot_without_matplotlib_fails_before_training(compare, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # not importable
    assert cli.main(["compare", "--plot", "--no-progress"]) == 2
    assert "pip install 'onca[plot]'" in _one_line(capsys.readouterr().err)


def test_compare_rejects_unknown_variants(compare, capsys):
    assert cli.main(["compare", "--variants", "onca,foo", "--no-progress"]) == 2
    err = _one_line(capsys.readouterr().err)
    assert "foo" in err and "huggingface, onca, liger" in err
    with pytest.raises(ValueError, match="unknown variant"):
        compare.run(compare.Settings(variants=()))


@pytest.mark.parametrize("option", ["--steps", "--batch", "--seq", "--layers"])
def test_compare_counts_must_be_positive(compare, capsys, option):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["compare", option, "0"])
    assert exit_info.value.code == 2
    assert f"argument {option}: must be a positive integer, got '0'" in _one_line(capsys.readouterr().err)
    with pytest.raises(ValueError, match=f"{option[2:]} must be at least 1, got 0"):
        compare.run(compare.Settings(**{option[2:]: 0}))


def test_compare_model_path_that_is_no_checkpoint(compare, tmp_path, capsys):
    assert cli.main(["compare", "--model", str(tmp_path / "missing")]) == 2
    assert _one_line(capsys.readouterr().err).endswith("missing' does not exist")
    file = tmp_path / "config.json"
    file.write_text("{}")
    assert cli.main(["compare", "--model", str(file)]) == 2
    assert "is not a directory" in _one_line(capsys.readouterr().err)
    assert cli.main(["compare", "--model", "gpt2"]) == 2  # a name, not a path: an unsupported type
    assert "does not support model type 'gpt2'" in _one_line(capsys.readouterr().err)


def test_errors_are_one_line_and_debug_shows_the_traceback(compare, monkeypatch, capsys):
    assert cli.main(["compare", "--model", "/nonexistent"]) == 2
    assert _one_line(capsys.readouterr().err) == "onca compare: model path '/nonexistent' does not exist"
    for argv in (["--debug", "compare", "--model", "/nonexistent"], ["compare", "--model", "/nonexistent",
                                                                     "--debug"]):
        with pytest.raises(ValueError, match="does not exist"):
            cli.main(argv)

    def broken(args):
        raise RuntimeError("disk on fire\nsecond line")

    monkeypatch.setattr(cli, "cmd_env", broken)
    assert cli.main(["env"]) == 1
    assert _one_line(capsys.readouterr().err) == (
        "onca env: RuntimeError: disk on fire (--debug shows the traceback)")
    with pytest.raises(RuntimeError, match="disk on fire"):
        cli.main(["--debug", "env"])


def test_progress_bar_counts_only_the_variants_that_can_run(compare_module, monkeypatch):
    import tqdm.auto

    bars = []

    class Bar:
        def __init__(self, total, **kwargs):
            self.total, self.steps = total, 0
            bars.append(self)

        def update(self, n):
            self.steps += n

        def set_postfix_str(self, text):
            pass

        def close(self):
            pass

    monkeypatch.setattr(tqdm.auto, "tqdm", Bar)
    monkeypatch.setattr(compare_module, "liger_installed", lambda: False)
    settings = compare_module.Settings(steps=2, batch=1, seq=8, variants=("huggingface", "liger"))
    results, _ = compare_module.run(settings)
    assert [r.error for r in results] == [None, "not installed (pip install liger-kernel)"]
    assert bars[0].total == bars[0].steps == 2


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices


def test_every_option_has_help():
    parser = cli.build_parser()
    for name, command in {"onca": parser, **_subparsers(parser)}.items():
        for action in command._actions:
            if not isinstance(action, argparse._SubParsersAction):
                assert action.help, f"{name} {'/'.join(action.option_strings) or action.dest} has no help"


def test_help_and_readme_agree_on_model_names():
    from onca.integrations.transformers import FAMILIES
    from onca.integrations.transformers.presets import ALIASES

    readme = README.read_text()
    table = readme.split("## Supported models")[1].split("\n## ")[0]
    listed = {name for row in table.splitlines() if row.startswith("|") and "`" in row
              for name in re.findall(r"`([a-z0-9_]+)`", row.split("|")[1])}
    assert listed == set(FAMILIES)
    model_help = next(a.help for a in _subparsers(cli.build_parser())["compare"]._actions
                      if a.dest == "model")
    assert all(re.search(rf"\b{re.escape(name)}\b", model_help) for name in [*FAMILIES, *ALIASES])
    examples = re.search(r"--model ([a-z0-9_|.]+)\|PATH", readme).group(1).split("|")
    assert all(name in FAMILIES or name in ALIASES for name in examples if name != "...")
    assert "`gemma3` short for `gemma3_text`" in readme and ALIASES["gemma3"] == "gemma3_text"


def test_readme_install_line_provides_what_its_run_line_offers():
    tomllib = pytest.importorskip("tomllib")
    extras = tomllib.loads((README.parent / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    installed = re.search(r'pip install "\.\[([a-z,]+)\]" && onca compare', README.read_text()).group(1)
    installed = set(installed.split(","))
    assert {"transformers", "plot"} <= installed <= set(extras)  # onca compare, and its --plot
    assert any(dep.startswith("matplotlib") for dep in extras["plot"])
def test_env_on_an_npu(fake_npu, capsys):
    fake_npu("Ascend910B4", {"num_vectorcore": 40})
    assert cli.main(["env"]) == 0
    out = capsys.readouterr().out
    assert "accelerator   npu" in out and "device        Ascend910B4" in out
    assert "torch_npu" in out and "ascend910b4 (npu): 40 compute units" in out


def test_audit_needs_a_compiler_and_triton_ascend(capsys):
    assert cli.main(["audit"]) == 2
    assert "--ascend" in capsys.readouterr().err
    assert cli.main(["audit", "--ascend", "--cuda"]) == 2
    # Stock Triton here: the audit says what it needs (its output comes from a child process).
    code = cli.main(["audit", "--ascend", "--ops", "rms_norm"])
    assert code == (0 if importlib.util.find_spec("triton.backends.ascend") else 2)


@pytest.mark.skipif(importlib.util.find_spec("triton.backends.nvidia") is None, reason="Triton without NVIDIA")
def test_cuda_audit_compiles_kernels_to_cubins_without_a_gpu():
    """Stock Triton compiles for the GPU profiles with its own ptxas: a kernel NVIDIA's compiler
    rejects fails CI on a machine without a GPU. Two small ops, in a child process (interpreter off)."""
    import subprocess

    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, "-m", "onca.audit", "--cuda", "--ops", "relu_squared,tvd"],
                          capture_output=True, text=True, env=env, timeout=900)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    summary = done.stdout.strip().splitlines()[-1]
    assert "compiled to a cubin (0 failures" in summary and "profiles h100, a100, cuda-generic" in summary
    assert "ok   relu_squared." in done.stdout
    for profile in ("h100", "a100", "cuda-generic"):  # each architecture compiled apart
        assert f"[{profile}; models:" in done.stdout, done.stdout[-2000:]
    # Each cubin's registers, spilled stack and shared memory, and the count of spilling compilations.
    resources = re.findall(r"; regs (\d+), stack (\d+), shared (\d+)$", done.stdout, re.MULTILINE)
    assert resources and all(0 < int(regs) <= 255 for regs, _, _ in resources), done.stdout[-2000:]
    assert all(int(shared) <= 101376 for _, _, shared in resources)  # TVD's and squared ReLU's rows
    spilling = sum(int(stack) > 0 for _, stack, _ in resources)
    assert f"0 failures, {spilling} spilling registers to the stack" in summary


def test_audit_records_a_benchmarks_audit_call():
    """Vocabulary-parallel cross entropy's benchmark call is cross entropy (the whole vocabulary on
    one rank); its ``audit`` call runs the sharded passes, so their kernels are compiled too."""
    import subprocess

    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": os.pathsep.join(sys.path)}
    command = [sys.executable, "-m", "onca.audit", "--cuda", "--profiles", "h100", "--ops",
               "vocab_parallel_cross_entropy"]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=900)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    for kernel in ("_shard_rows_kernel", "_global_rows_kernel"):
        assert f"ok   vocab_parallel_cross_entropy.{kernel}" in done.stdout, done.stdout[-2000:]


def test_audit_covers_every_cuda_profile_architecture():
    from onca import audit

    gpus = {n for n, p in onca_device.PROFILES.items() if p.kind == "cuda"}
    assert set(audit.CUDA_TARGETS) <= gpus and audit.CUDA_TARGETS


def test_audit_fails_a_cubin_over_its_profiles_shared_memory(monkeypatch):
    """Triton's launcher refuses a kernel that needs more shared memory than the device gives a
    program; the audit finds it without the device, against each profile that planned the launch."""
    import types

    from onca import audit

    def launch(*profiles):
        la = audit.Launch(kernel=None, signature={}, constants={}, attrs=None, on_910_95=False,
                          cuda_options=object(), cuda_arch=86)
        la.users.update(f"{p}/llama-3-8b" for p in profiles)
        return la

    generic = onca_device.PROFILES["cuda-generic"].shared_bytes
    assert audit.shared_memory_error(launch("cuda-generic"), generic) is None
    error = audit.shared_memory_error(launch("cuda-generic"), generic + 1)
    assert error == (f"{generic + 1} bytes of shared memory a program, over the cuda-generic profile's "
                     f"{generic}")
    assert audit.shared_memory_error(launch("h100"), generic + 1) is None  # within the H100's 232448
    assert "a100 profile's 166912" in audit.shared_memory_error(launch("h100", "a100"), 200000)

    # The check is what _check reports for a compiled cubin.
    compiled = types.SimpleNamespace(metadata=types.SimpleNamespace(shared=generic + 1024),
                                     asm={"cubin": b""})
    monkeypatch.setattr(audit, "compile_for_cuda", lambda la: compiled)
    monkeypatch.setattr(audit, "cubin_resources", lambda cubin: (32, 0))
    error, crash, resources = audit._check(launch("cuda-generic"))
    assert "over the cuda-generic profile's" in error and crash is None
    compiled.metadata.shared = 1024
    assert audit._check(launch("cuda-generic")) == (None, None, (32, 0, 1024))


def test_audit_finds_a_grid_with_more_programs_an_sm_than_fit_its_registers(monkeypatch):
    """A bounded (persistent) grid of two programs an SM whose cubin needs more than half the SM's
    registers runs them one after the other: the audit says so on the kernel's line and counts it,
    without failing it. Unbounded grids (thousands of programs) and one program an SM are not
    flagged."""
    import io
    import types

    from onca import audit

    units = onca_device.PROFILES["h100"].compute_units

    def launch(grid, warps=8):
        la = audit.Launch(kernel=None, signature={}, constants={}, attrs=None, on_910_95=False,
                          cuda_options=types.SimpleNamespace(num_warps=warps), cuda_arch=90)
        la.users.add("h100/llama-3-8b")
        la.max_grid = grid
        return la

    assert audit.programs_short(launch(2 * units), 160) == (1, 2)
    assert audit.programs_short(launch(2 * units), 128) is None  # two of 128 registers fit
    assert audit.programs_short(launch(4 * units, warps=4), 216) == (2, 4)
    assert audit.programs_short(launch(units), 255) is None  # one an SM: nothing waits
    assert audit.programs_short(launch(4096), 255) is None  # a program a tile: no plan of co-residency
    assert audit.programs_short(launch(1024), 255) is None  # a program a row of 1024 rows: not sized by units

    compiled = types.SimpleNamespace(metadata=types.SimpleNamespace(shared=0), asm={"cubin": b""})
    flagged = launch(2 * units)
    flagged.kernel = type("Kernel", (), {"fn": types.SimpleNamespace(__module__="onca.ops.x", __name__="k"),
                                         "params": []})()
    monkeypatch.setattr(audit, "collect", lambda ops, profiles: ({"k": flagged}, []))
    monkeypatch.setattr(audit, "compile_for_cuda", lambda la: compiled)
    monkeypatch.setattr(audit, "cubin_resources", lambda cubin: (160, 0))
    out = io.StringIO()
    assert audit.run(["x"], ["h100"], out, cuda=True) == 0
    text = out.getvalue()
    assert "regs 160, stack 0, shared 0; 1 of the 2 programs an SM its grid has fit" in text
    assert "1 whose grid has more programs an SM than their registers let fit" in text


def test_audit_covers_every_ascend_profile():
    from onca import audit

    assert set(audit.ASCEND_TARGETS) == {n for n, p in onca_device.PROFILES.items() if p.kind == "npu"}


def _adapter_failure(stderr: str, returncode: int) -> Exception:
    import subprocess

    return subprocess.CalledProcessError(returncode, ["triton-adapter-opt"], stderr=stderr.encode())


def test_audit_retries_an_adapter_crash_once_and_reports_it(monkeypatch):
    from onca import audit

    launch = audit.Launch(kernel=None, signature={}, constants={}, attrs=None, on_910_95=False)
    crash = _adapter_failure("TypeSupport.h:173: Assertion `abstractType' failed.", -6)
    outcomes = []

    def compile_to_linalg(_launch):
        outcome = outcomes.pop(0)
        if outcome is not None:
            raise outcome
        return "module {}"

    monkeypatch.setattr(audit, "compile_to_linalg", compile_to_linalg)
    outcomes[:] = [crash, None]  # crashed, then compiled: flaky, not failed
    error, first, _ = audit._check(launch)
    assert error is None and "Assertion" in first
    outcomes[:] = [crash, crash]  # crashed twice: a failure
    error, first, _ = audit._check(launch)
    assert "Assertion" in error and first is None
    # LLVM's crash handler, whatever the exit status (CI on 2026-12-04: fused MoE's combine kernel,
    # which compiled on the next three tries)
    llvm = _adapter_failure("PLEASE submit a bug report to https://github.com/llvm/llvm-project/issues/ and "
                            "include the crash backtrace.", 1)
    outcomes[:] = [llvm, None]
    error, first, _ = audit._check(launch)
    assert error is None and "PLEASE submit" in first
    outcomes[:] = [_adapter_failure("error: failed to legalize operation", 1)]  # a real error: no retry
    error, first, _ = audit._check(launch)
    assert "legalize" in error and not outcomes
    launch.max_grid = audit.MAX_GRID + 1
    assert "exceeds" in audit._check(launch)[0]
