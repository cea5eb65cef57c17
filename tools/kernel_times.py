"""Device time per kernel of one forward + backward step of a benchmark point, per provider
(torch.profiler): which kernel a gap to a peer lives in, where the harness gives one number.

    python -m tools.kernel_times mhc qwen3-0.6b onca liger      # a D2 point (a model name)
    python -m tools.kernel_times rms_norm --small onca torch      # the overhead sweep's point
    python -m tools.kernel_times tvd llama-3-8b onca --top 5
    python -m tools.kernel_times fused_linear_logprobs llama-3-8b onca trl --gaps 8
    python -m tools.kernel_times fused_linear_cross_entropy gemma-2-9b onca torch_compile gemm_limit

On a GPU it times CUDA kernels over ``--steps`` steps after a warm-up (gradients cleared between
steps, as the harness does), and prints each provider's total and its ``--top`` kernels with their
launches per step. Without a GPU it runs the same steps on the CPU and lists torch's CPU ops (the
Triton kernels run under the interpreter and are not listed): a check that the point and providers
exist, not a measurement. A provider that fails prints one line and the next one runs.

``--gaps N`` adds where the device sat idle: the span of the profiled steps per step against the
kernels' sum, and the N longest gaps between consecutive kernels, each with the kernels on either
side and the host op that launched the one after it (a gap is the host running behind the device:
Python, planning, an allocation, a synchronisation). The profiler then records host ops too, which
adds host time: read the gaps as upper bounds.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import torch

from onca.bench import harness
from onca.bench.spec import build

def point_params(bench, point: str | None) -> dict:
    """The parameters of the op's D2 point named ``point`` (a model), or (None) of its overhead
    sweep's point (16 tokens)."""
    if point is None:
        return dict(bench.overhead_sweep().points[0][1])
    for sweep in bench.sweep("d2"):
        for x, params in sweep.points:
            if x == point:
                return dict(params)
    names = [x for sweep in bench.sweep("d2") for x, _ in sweep.points]
    raise SystemExit(f"kernel_times: {bench.name} has no D2 point {point!r} (points: {', '.join(names)})")


def step_fn(bench, provider: str, params: dict, device: str):
    """One forward + backward of ``provider`` at ``params``, as the harness's full mode runs it."""
    factory = harness.provider_factory(bench, provider)
    if factory is None:
        raise ValueError(f"{bench.name} has no provider {provider!r}")
    inputs = bench.make_inputs(params, torch.bfloat16 if device == "cuda" else torch.float32, device)
    run = build(factory, params, inputs)
    grads = harness._outputs_and_grads(run())[1]
    leaves = [t for t in inputs.values() if isinstance(t, torch.Tensor) and t.requires_grad]

    def step():
        for t in leaves:
            t.grad = None
        outs, _ = harness._outputs_and_grads(run(), make_grads=False)
        torch.autograd.backward(outs, grads)

    return step


def idle_gaps(trace: dict, top: int) -> tuple[float, list[tuple[float, str, str, str]]]:
    """From a Chrome trace of torch.profiler: ``(span, gaps)``, the microseconds from the first
    kernel's start to the last one's end, and the ``top`` longest gaps between consecutive kernels
    as ``(microseconds, kernel before, kernel after, host op that launched the one after)``."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    kernels = sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    if not kernels:
        return 0.0, []
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})}
    host_ops = sorted((e for e in events if e.get("cat") == "cpu_op"), key=lambda e: e["ts"])

    def launcher(kernel) -> str:
        launch = launches.get(kernel.get("args", {}).get("correlation"))
        if launch is None:
            return "?"
        # The innermost host op around the launch: the latest-starting one that still contains it.
        inside = [op for op in host_ops if op["ts"] <= launch["ts"] <= op["ts"] + op.get("dur", 0)]
        return inside[-1]["name"] if inside else "?"

    gaps = []
    end = kernels[0]["ts"] + kernels[0].get("dur", 0)
    for before, after in zip(kernels, kernels[1:]):
        gap = after["ts"] - end
        if gap > 0:
            gaps.append((gap, before, after))
        end = max(end, after["ts"] + after.get("dur", 0))
    span = end - kernels[0]["ts"]
    gaps.sort(key=lambda g: -g[0])
    return span, [(gap, b["name"], a["name"], launcher(a)) for gap, b, a in gaps[:top]]


def kernel_times(step, device: str, steps: int, trace_path: str | None = None) -> list[tuple[str, float, float]]:
    """``(kernel, microseconds per step, launches per step)``, longest first; ``trace_path`` also
    exports a Chrome trace of as many more steps there, host ops included."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        step()
    cuda = device == "cuda"
    if cuda:
        torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
        if cuda:
            torch.cuda.synchronize()
    if trace_path:
        # A second profile for the trace, host ops included (to name what launched the kernel after
        # a gap): recording them adds host time, so its gaps are upper bounds, and the kernel table
        # above stays the device-only profile's.
        with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as traced:
            for _ in range(steps):
                step()
            if cuda:
                torch.cuda.synchronize()
        traced.export_chrome_trace(trace_path)
    rows = []
    for event in prof.key_averages():
        us = event.device_time_total if cuda else event.self_cpu_time_total
        if us > 0:
            rows.append((event.key, us / steps, event.count / steps))
    return sorted(rows, key=lambda r: -r[1])


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.kernel_times", description=__doc__.splitlines()[0])
    parser.add_argument("op")
    parser.add_argument("point", nargs="?", help="a D2 point (model name); omit with --small")
    parser.add_argument("providers", nargs="*", default=["onca"])
    parser.add_argument("--small", action="store_true", help="the overhead sweep's point (16 tokens) instead")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--gaps", type=int, default=0, metavar="N",
                        help="also the span per step and the N longest idle gaps between kernels")
    args = parser.parse_intermixed_args(argv)
    if args.small and args.point is not None:
        args.providers.insert(0, args.point)
        args.point = None
    if not args.small and args.point is None:
        parser.error("name a D2 point (a model) or pass --small")
    bench = harness.load(args.op)
    params = point_params(bench, args.point)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    trace_dir = tempfile.mkdtemp() if args.gaps else None
    for provider in args.providers or ["onca"]:
        trace_path = os.path.join(trace_dir, f"{provider}.json") if trace_dir else None
        try:
            rows = kernel_times(step_fn(bench, provider, params, device), device, args.steps, trace_path)
        except Exception as exc:  # a peer that fails (not installed, out of memory) does not stop the rest
            print(f"== {args.op} {provider}: failed: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
            continue
        total = sum(us for _, us, _ in rows) if device == "cuda" else None
        head = f"== {args.op} {provider} {params}"
        print(head + (f": {total:.1f} us of kernels per step" if total is not None else " (CPU ops, not a measurement)"))
        for name, us, count in rows[:args.top]:
            print(f"  {us:10.1f} us  x{count:<5.1f} {name[:110]}")
        if trace_path:
            print_gaps(trace_path, args.steps, args.gaps)
        if device == "cuda":
            torch.cuda.empty_cache()
    return 0


def print_gaps(trace_path: str, steps: int, top: int) -> None:
    with open(trace_path) as f:
        span, gaps = idle_gaps(json.load(f), top)
    if not span:
        print("  (no device kernels in the trace)")
        return
    print(f"  span {span / steps:10.1f} us per step; longest idle gaps (over {steps} steps):")
    for gap, before, after, host in gaps:
        print(f"  {gap:10.1f} us  after {before[:40]} | before {after[:40]} | launched in {host[:40]}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
