"""Onca against liger-kernel, op by op: each benchmark's liger provider and Onca's at the overhead
sweep's shape (16 tokens, fp32), forward outputs and input gradients compared.

    python -m tools.liger_parity              # every op whose benchmark has a liger provider
    python -m tools.liger_parity mhc rope     # some of them
    python -m tools.liger_parity --device cuda

Prints, per op, the largest difference of each output and gradient relative to the largest
magnitude of liger's (a gradient of magnitude below 1e-9 is reported as ``~0``: its relative gap is
noise), or the error a provider raised. It checks that the benchmark calls liger-kernel with the
semantics Onca implements (needs ``liger-kernel`` installed; on the CPU, under Triton's interpreter,
part of liger-kernel's kernels do not run).
"""

from __future__ import annotations

import argparse
import sys

import torch

from onca.bench import harness
from onca.bench.spec import build

TINY = 1e-9


def _tensors(result) -> list:
    items = result if isinstance(result, (tuple, list)) else (result,)
    return [t for t in items if isinstance(t, torch.Tensor)]


def _run(bench, factory, params, device):
    torch.manual_seed(0)
    inputs = bench.make_inputs(params, torch.float32, device)
    outs = _tensors(build(factory, params, inputs)())
    leaves = [t for t in inputs.values() if isinstance(t, torch.Tensor) and t.requires_grad]
    wanted = [t for t in outs if t.requires_grad]
    torch.autograd.backward(wanted, [torch.ones_like(t) for t in wanted])
    return [t.detach().float() for t in outs], [t.grad for t in leaves]


def _gap(a, b) -> str:
    if a is None or b is None:
        return "ok" if a is None and b is None else "missing"
    if a.shape != b.shape:
        return f"shape {tuple(a.shape)} vs {tuple(b.shape)}"
    scale = float(b.abs().max()) if b.numel() else 0.0
    if scale < TINY:
        return "~0"
    return f"{float((a.float() - b.float()).abs().max()) / scale:.1e}"


def compare(op: str, device: str) -> str:
    bench = harness.load(op)
    params = dict(bench.overhead_sweep().points[0][1])
    runs = {}
    for name, factory in (("onca", bench.onca), ("liger", bench.liger)):
        try:
            runs[name] = _run(bench, factory, params, device)
        except Exception as exc:  # noqa: BLE001 (reported per op; the others still run)
            return f"{name} failed: {type(exc).__name__}: {str(exc).splitlines()[0][:140] if str(exc) else ''}"
    (onca_out, onca_grads), (liger_out, liger_grads) = runs["onca"], runs["liger"]
    if len(onca_out) != len(liger_out):
        return f"{len(onca_out)} outputs vs liger's {len(liger_out)}"
    outs = [_gap(a, b) for a, b in zip(onca_out, liger_out)]
    grads = [_gap(a, b) for a, b in zip(onca_grads, liger_grads)]
    return f"outputs {' '.join(outs)} | gradients {' '.join(grads)}"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.liger_parity", description=__doc__.splitlines()[0])
    parser.add_argument("ops", nargs="*")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    ops = args.ops or [op for op in harness.list_ops() if harness.load(op).liger is not None]
    for op in ops:
        print(f"{op:36s} {compare(op, args.device)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
