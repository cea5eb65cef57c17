"""Run a check function on two ranks of a process group and collect each check's outcome.

The tests of this folder run their checks in two spawned processes (``torch.multiprocessing``), once
per test module (the startup, importing torch, Triton and transformers, is the slow part), and
assert on the outcomes one test per check. Where two GPUs are visible the ranks use NCCL on
``cuda:0`` and ``cuda:1``; otherwise gloo on the CPU, the kernels under Triton's interpreter (any
single GPU is hidden from the ranks).
"""

from __future__ import annotations

import importlib
import json
import os
import tempfile
import traceback

import torch
import torch.multiprocessing as mp

WORLD = 2


def use_gpus() -> bool:
    return torch.cuda.is_available() and torch.cuda.device_count() >= WORLD


def _worker(rank: int, target: str, store: str, out_dir: str, gpus: bool) -> None:
    import torch.distributed as dist

    if gpus:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if gpus else "gloo", init_method=f"file://{store}", rank=rank,
                            world_size=WORLD)
    module, name = target.split(":")
    results = {}
    try:
        checks = getattr(importlib.import_module(module), name)
        device = torch.device("cuda", rank) if gpus else torch.device("cpu")
        for check_name, check in checks.items():
            torch.manual_seed(0)
            try:
                check(rank, device)
                results[check_name] = "ok"
            except Exception:  # one failing check must not hide the others
                results[check_name] = traceback.format_exc()
            dist.barrier()
    finally:
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(results, f)
        dist.destroy_process_group()


def run_checks(target: str) -> dict[str, list[str]]:
    """Run every check of the dict ``module:NAME`` (name -> ``check(rank, device)``) on two ranks;
    returns each check's outcome per rank (``"ok"`` or the traceback)."""
    gpus = use_gpus()
    with tempfile.TemporaryDirectory() as tmp:
        hidden = os.environ.get("CUDA_VISIBLE_DEVICES")
        if not gpus:
            os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the ranks run on the CPU, under the interpreter
        try:
            mp.start_processes(_worker, args=(target, os.path.join(tmp, "store"), tmp, gpus), nprocs=WORLD,
                               start_method="spawn", join=True)
        finally:
            if not gpus:
                if hidden is None:
                    os.environ.pop("CUDA_VISIBLE_DEVICES", None)
                else:
                    os.environ["CUDA_VISIBLE_DEVICES"] = hidden
        outcomes: dict[str, list[str]] = {}
        for rank in range(WORLD):
            with open(os.path.join(tmp, f"rank{rank}.json")) as f:
                for name, outcome in json.load(f).items():
                    outcomes.setdefault(name, []).append(outcome)
    return outcomes


def assert_ok(outcomes: dict[str, list[str]], name: str) -> None:
    assert name in outcomes, f"check {name} did not run"
    failures = [f"rank {r}:\n{o}" for r, o in enumerate(outcomes[name]) if o != "ok"]
    assert not failures, "\n".join(failures)
