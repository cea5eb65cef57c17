"""Every test file belongs to exactly one GPU shard (``tools/gpu_tests.py``): a new test file that
no shard lists would never run on a GPU."""

from __future__ import annotations

import pathlib
import re

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
