"""DeepSpeed ZeRO-3 through Accelerate and the Hugging Face Trainer on two ranks (gloo on the CPU,
NCCL on two GPUs): an Onca-patched model trains with the same losses as the unpatched one, its
partitioned parameters gathered where Onca reads them (``ds_trainer.py``, run by torchrun).

Needs ``deepspeed`` (``pip install 'onca[distributed]'``; on the CPU it builds a small shared-memory
communication op with ninja and a C++ compiler on first use)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytest.importorskip("deepspeed", reason="deepspeed is not installed (pip install 'onca[distributed]')")

pytestmark = pytest.mark.distributed

ROOT = Path(__file__).resolve().parents[2]
MODELS = ("llama", "qwen3")


@pytest.fixture(scope="module")
def losses():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT)]))
    if not (env.get("CUDA_VISIBLE_DEVICES") is None and _gpus() >= 2):
        env["CUDA_VISIBLE_DEVICES"] = ""  # the CPU, under Triton's interpreter
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "tests.distributed.ds_trainer", *MODELS]
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    lines = [line for line in run.stdout.splitlines() if line.startswith("ONCA-RESULT ")]
    assert run.returncode == 0 and lines, f"torchrun failed ({run.returncode}):\n{run.stdout[-3000:]}\n{run.stderr[-6000:]}"
    return json.loads(lines[-1].removeprefix("ONCA-RESULT "))


def _gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.parametrize("model_type", MODELS)
def test_zero3_trainer_loss_parity(losses, model_type):
    hf, ours = losses[model_type]["huggingface"], losses[model_type]["onca"]
    assert len(hf) == len(ours) == 3
    for step, (a, b) in enumerate(zip(ours, hf)):
        assert abs(a - b) <= 1e-4 * max(1.0, abs(b)), f"step {step}: onca {a} vs Hugging Face {b}"
