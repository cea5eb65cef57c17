"""The host path of every op at the overhead sweep's size, on any machine: kernel launches per
forward + backward (Triton's and torch's own), and the Python time around them, with Triton's
launch stubbed out.

    python -m tools.host_path                 # every op with a benchmark
    python -m tools.host_path rms_norm cross_entropy
    python -m tools.host_path --small [OP ...]  # torch's small-call route, run for real on the CPU

On a GPU an op's host cost at host-bound sizes is about (this Python time) + launches x (Triton's
per-launch cost, tens of microseconds in Triton 3.6's Python launcher): both numbers are what a
change to an op's host path can lower, and both are measured here without an accelerator (the
kernels do not run, so outputs are garbage; nothing reads them). Torch's own time for the same
computation is printed beside it (on the CPU: torch's C++ path plus a tiny computation).

``--small`` times the ops whose overhead-point call takes torch's route on CUDA
(:mod:`onca.ops._small_calls`) with that route switched on for the CPU: Onca's forward + backward
against the benchmark's reference, both computing with torch's CPU kernels, bf16. Their ratio is
the host paths' (Onca's checks, its routing, a torch op more or fewer), on one CPU thread. They
are for comparing two versions of one op's host path on one machine where no GPU is lent, not GPU
figures: on 2026-12-04 a 2-core CI host's ratios lay between 0.27 below and 0.12 above the
committed H200 overhead sweep's, op by op.
"""

from __future__ import annotations

import contextlib
import sys
import time

import torch

from onca.bench import harness
from onca.bench.spec import build


@contextlib.contextmanager
def stubbed_launches(counter: list):
    """Every Triton kernel launch (compiled or interpreted) counted in ``counter[0]``, not run."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    from onca.ops._launch import through_triton

    def run(self, *args, grid, warmup, **kwargs):
        counter[0] += 1

    originals = {cls: cls.run for cls in (JITFunction, InterpretedFunction)}
    for cls in originals:
        cls.run = run
    try:
        with through_triton():
            yield
    finally:
        for cls, original in originals.items():
            cls.run = original


# torch ops that launch no kernel (allocation, views, metadata): everything else a step runs at the
# bottom of torch's call tree (a fill, a copy, a cast, an addition) is one kernel launch on a GPU.
_NO_KERNEL = frozenset(f"aten::{name}" for name in (
    "empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "view", "_unsafe_view",
    "_reshape_alias", "reshape", "as_strided", "alias", "detach", "lift_fresh", "t", "transpose", "permute",
    "expand", "slice", "select", "unsqueeze", "squeeze", "resolve_conj", "resolve_neg", "result_type",
    "contiguous", "set_", "resize_", "numpy_T", "unbind", "split", "chunk", "narrow", "view_as_real",
    "view_as_complex", "promote_types", "_nnpack_available", "scalar_tensor",
    # ``to`` is a leaf only where it returns its input (a real cast calls ``_to_copy`` below it)
    "to",
))
# A read of a device value on the host: a synchronisation on a GPU (the op contract forbids it).
HOST_SYNC = "aten::_local_scalar_dense"


def _step(bench, provider_fn, params, dtype):
    inputs = bench.make_inputs(params, dtype, "cpu")
    run = build(provider_fn, params, inputs)
    leaves = [t for t in inputs.values() if isinstance(t, torch.Tensor) and t.requires_grad]
    seeds = []  # the incoming gradients, made once: their fills are not the op's

    def step():
        for t in leaves:
            t.grad = None
        result = run()
        items = result if isinstance(result, (tuple, list)) else (result,)
        outs = [t for t in items if isinstance(t, torch.Tensor) and t.requires_grad]
        if not seeds:
            seeds.extend(torch.ones_like(t) for t in outs)
        torch.autograd.backward(outs, seeds)

    return step


def torch_kernels(step) -> list[str]:
    """The torch ops of one ``step()`` that launch a kernel: the leaves of its call tree."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    return sorted(_called_name(e) for e in prof.events()
                  if e.name.startswith("aten::") and not e.cpu_children and e.name not in _NO_KERNEL)


def _called_name(event) -> str:
    """A leaf's name as the caller wrote it where devices differ in dispatch: CUDA's ``zero_``
    runs ``fill_``, the CPU's runs its own kernel."""
    parent = event.cpu_parent
    return "aten::zero_" if event.name == "aten::fill_" and parent is not None and parent.name == "aten::zero_" \
        else event.name


def _us_per_call(step, calls=200, repeats=5) -> float:
    step()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            step()
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
    return best


def measure(op: str, dtype=torch.float32, timed: bool = True) -> tuple[int, list[str], float | None, float | None]:
    """(Triton launches per forward + backward, the torch kernels beside them, Onca's Python µs per
    call, torch's µs per call); the times are None unless ``timed``."""
    bench = harness.load(op)
    params = dict(bench.overhead_sweep().points[0][1])
    counter = [0]
    with stubbed_launches(counter):
        onca_step = _step(bench, bench.onca, params, dtype)
        onca_step()
        counter[0] = 0
        kernels = torch_kernels(onca_step)
        launches = counter[0]
        if not timed:
            return launches, kernels, None, None
        onca_us = _us_per_call(onca_step)
    torch_us = _us_per_call(_step(bench, bench.reference, params, dtype))
    return launches, kernels, onca_us, torch_us


@contextlib.contextmanager
def small_route_on_cpu():
    """Small calls on the CPU take torch's route, as on CUDA (:mod:`onca.ops._small_calls`)."""
    from onca.ops import _small_calls

    saved = _small_calls.DEVICE_TYPES
    _small_calls.DEVICE_TYPES = (*saved, "cpu")
    try:
        yield
    finally:
        _small_calls.DEVICE_TYPES = saved


def measure_small(op: str, dtype=torch.bfloat16,
                  timed: bool = True) -> tuple[int, float | None, float | None]:
    """(Onca's calls that took torch's route in one forward + backward, Onca's µs per call, the
    benchmark reference's µs per call) at the overhead point, on this CPU with the small-call route
    on: both run torch's kernels for real, so the difference is the two host paths (Onca's checks
    and routing, and any torch op one path calls more); the times are None unless ``timed`` (and
    the call took the route)."""
    bench = harness.load(op)
    params = dict(bench.overhead_sweep().points[0][1])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the tiny kernels' threading is noise here, not host path
    try:
        return _measure_small(bench, params, dtype, timed)
    finally:
        torch.set_num_threads(threads)


def _measure_small(bench, params, dtype, timed):
    from onca.ops import _small_calls

    with small_route_on_cpu():
        onca_step = _step(bench, bench.onca, params, dtype)
        before = _small_calls.taken
        onca_step()
        taken = _small_calls.taken - before
        if not (timed and taken):
            return taken, None, None
        onca_us = min(_us_per_call(onca_step) for _ in range(3))
    reference = _step(bench, bench.reference, params, dtype)
    return taken, onca_us, min(_us_per_call(reference) for _ in range(3))


def main_small(ops: list[str]) -> int:
    print(f"{'op':36s} {'routed':>6s} {'onca µs':>9s} {'torch µs':>9s} {'torch/onca':>10s}")
    for op in ops:
        taken, onca_us, torch_us = measure_small(op)
        if not taken:
            print(f"{op:36s} {0:6d}  (no torch route at this size: python -m tools.host_path {op})")
            continue
        print(f"{op:36s} {taken:6d} {onca_us:9.1f} {torch_us:9.1f} {torch_us / onca_us:10.2f}", flush=True)
    return 0


def main(argv: list[str]) -> int:
    if argv[:1] == ["--small"]:
        return main_small(argv[1:] or harness.list_ops())
    ops = argv or harness.list_ops()
    print(f"{'op':36s} {'triton':>6s} {'torch':>5s} {'onca µs':>9s} {'torch µs':>9s}  torch kernels")
    for op in ops:
        try:
            launches, kernels, onca_us, torch_us = measure(op)
        except Exception as exc:  # noqa: BLE001 (one op's failure does not hide the others)
            print(f"{op:36s} failed: {type(exc).__name__}: {str(exc)[:120]}")
            continue
        names = ", ".join(k.removeprefix("aten::") for k in kernels)
        print(f"{op:36s} {launches:6d} {len(kernels):5d} {onca_us:9.1f} {torch_us:9.1f}  {names}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
