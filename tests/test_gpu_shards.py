"""Every test file belongs to exactly one GPU shard (``tools/gpu_tests.py``): a new test file that
no shard lists would never run on a GPU."""

from __future__ import annotations

import pathlib
import re
from types import SimpleNamespace

from tools.gpu_tests import SHARDS, command

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _files_of(entry: str) -> set[str]:
    path = ROOT / entry
    found = path.rglob("test_*.py") if path.is_dir() else [path]
    return {str(p.relative_to(ROOT)) for p in found}


def test_every_test_file_is_in_one_shard():
    listed = [f for entries in SHARDS.values() for e in entries for f in _files_of(e)]
    every = {str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py")}
    assert sorted(every - set(listed)) == [], "test files in no GPU shard"
    assert len(listed) == len(set(listed)), "a test file is in two shards"
    assert set(listed) <= every, "a shard lists a file that does not exist"


def test_memcheck_runs_under_the_sanitizer_at_ci_scale():
    cmd, env = command("1", memcheck=True, pytest_args=["-x"])
    assert cmd[cmd.index("--tool") + 1] == "memcheck" and cmd[-1] == "-x"
    assert env["ONCA_TEST_SCALE"] == "cpu"
    assert command("1", memcheck=False, pytest_args=[])[1]["ONCA_TEST_SCALE"] == "gpu"


def test_contributing_describes_every_shard():
    """CONTRIBUTING.md's table of shards (section "On a GPU") has one row per shard, no more."""
    text = (ROOT / "CONTRIBUTING.md").read_text()
    section = text.split("## On a GPU")[1].split("\n## ")[0]
    rows = re.findall(r"^\| (\w+) \| ", section, re.MULTILINE)
    assert sorted(r for r in rows if r != "shard") == sorted(SHARDS), "CONTRIBUTING.md's shard table is stale"


def test_each_tests_seconds_are_written_as_it_ends(tmp_path, monkeypatch):
    """``--times DIR``: the shard's tests append their seconds (setup + call + teardown) and outcome
    to DIR/shard-N.tsv one by one, so a run cut off by a time limit keeps them."""
    from tests import conftest

    path = command("19", memcheck=False, pytest_args=[], times=str(tmp_path))[1]["ONCA_TEST_TIMES"]
    assert path == str(tmp_path / "shard-19.tsv")
    monkeypatch.setenv("ONCA_TEST_TIMES", path)
    phases = {"t.py::a": [("setup", 0.5, "passed"), ("call", 2.0, "passed"), ("teardown", 0.3, "passed")],
              "t.py::b": [("setup", 0.1, "skipped"), ("teardown", 0.0, "passed")],
              "t.py::c": [("setup", 0.1, "passed"), ("call", 1.0, "failed"), ("teardown", 0.0, "passed")]}
    for nodeid, reports in phases.items():
        for when, seconds, outcome in reports:
            conftest.pytest_runtest_logreport(SimpleNamespace(
                nodeid=nodeid, when=when, duration=seconds, outcome=outcome,
                failed=outcome == "failed", skipped=outcome == "skipped"))
        if nodeid == "t.py::a":  # written when the test ends, not at the end of the run
            assert (tmp_path / "shard-19.tsv").read_text() == "2.8\tpassed\tt.py::a\n"
    assert (tmp_path / "shard-19.tsv").read_text().splitlines() == [
        "2.8\tpassed\tt.py::a", "0.1\tskipped\tt.py::b", "1.1\tfailed\tt.py::c"]
