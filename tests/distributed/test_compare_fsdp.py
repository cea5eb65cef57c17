"""``onca compare --fsdp`` under torchrun on two ranks (gloo on the CPU): it trains Hugging Face and
Onca under FSDP2, reports per-GPU figures and the loss curves, and writes them as JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

pytestmark = pytest.mark.distributed

ROOT = Path(__file__).resolve().parents[2]


def test_compare_fsdp_two_ranks(tmp_path):
    out = tmp_path / "compare-fsdp.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT)]), CUDA_VISIBLE_DEVICES="")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "onca.cli",
           "compare", "--fsdp", "--model", "llama", "--steps", "2", "--batch", "1", "--seq", "8",
           "--variants", "huggingface,onca", "--no-progress", "--output", str(out)]
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, f"{run.stdout[-3000:]}\n{run.stderr[-5000:]}"
    assert "FSDP2" in run.stdout and "over 2 ranks" in run.stdout
    result = json.loads(out.read_text())
    assert result["fsdp"] and result["world_size"] == 2
    hf, onca = result["variants"]["huggingface"], result["variants"]["onca"]
    assert len(hf["losses"]) == len(onca["losses"]) == 2
    for a, b in zip(onca["losses"], hf["losses"]):
        assert abs(a - b) <= 1e-4 * abs(b)
    assert onca["tokens_per_s_per_gpu"] > 0


def test_compare_fsdp_needs_torchrun():
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    for name in ("RANK", "WORLD_SIZE"):
        env.pop(name, None)
    run = subprocess.run([sys.executable, "-m", "onca.cli", "compare", "--fsdp"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 2 and "torchrun" in run.stderr
