"""Time an op's kernel variants side by side in one process, at its benchmark's points.

    python -m tools.kernel_variants SPEC.json [--points 8192,llama-3-8b] [--mode full] [--rounds 2]
                                              [--peers liger,torch_compile] [--device-time] [--memory]
                                              [--out FILE.json]

``SPEC.json`` names the op and its variants, each a list of text substitutions in the op's module
(``src/onca/ops/<op>.py``)::

    {"op": "modulated_rms_norm",
     "variants": {"tile_4096": [["GPU_BACKWARD_TILE = 8192", "GPU_BACKWARD_TILE = 4096"]],
                  "tile_16384": [["GPU_BACKWARD_TILE = 8192", "GPU_BACKWARD_TILE = 16384"]]}}

(``"module"``, optional, names another module: fused linear cross entropy's variants of the
cross-entropy kernel are substitutions in ``onca.ops.cross_entropy``.)

Each variant is the module's source with its substitutions applied (each old text must occur
exactly once), of which only the Triton functions (``@triton.jit`` and the decorators above it) and
the upper-case module constants (tile declarations, thresholds) are executed, in a copy of the
module's namespace, from a file of their own (Triton reads a kernel's source from its file). While a
variant is timed those names are swapped into the module, so the op's own launchers and public
function run it (a tile dict and a ``fast_launch`` kernel in place, so that whoever holds the object
itself runs the variant too: the row map's registered ops); the base (the module as it is) is
always timed too. Plans and launch configurations cached by Onca are dropped at each swap (a
constant may have changed them).

Each point's inputs are made once (the benchmark's ``make_inputs``); the variants and the peers
take turns for ``--rounds`` rounds, each keeping its fastest ``do_bench`` median (on a CPU: one
timed call, the interpreter's; for checking a spec, not for timing; ``--device-time``: the median of
the call replayed from a CUDA graph, the harness's device time, where a host-bound point's wall
clock says nothing of the kernels), printed with the base's time over each (above 1: faster than
the base). A point small enough for Onca's small-call route runs torch's op instead of the kernels
(reported; ``ONCA_SMALL_CALL_LIMIT=0`` turns the route off).
Before timing, every variant's outputs and input gradients from fresh inputs are compared with the
base's: bitwise equal, or the largest absolute difference. Other names the op's module imports
from another module (``from ... import _helper``) keep the base's object: substitute in that
module instead.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import functools
import json
import os
import sys
import tempfile
import time
import types

import torch

from onca.bench import harness
from onca.bench.spec import build
from onca.ops import _small_calls as small_calls
from onca.ops._launch import FastLaunch

__all__ = ["variant_names", "swapped", "compare", "time_points", "main"]


def _is_jit(node: ast.AST) -> bool:
    return isinstance(node, ast.FunctionDef) and any("jit" in ast.unparse(d) for d in node.decorator_list)


def _targets(node: ast.AST) -> list:
    if isinstance(node, ast.Assign):
        return node.targets
    return [node.target] if isinstance(node, ast.AnnAssign) else []


def _is_constant(node: ast.AST) -> bool:
    targets = _targets(node)
    return bool(targets) and all(isinstance(t, ast.Name) and t.id.isupper() for t in targets)


def _substituted(source: str, substitutions: list, variant: str) -> str:
    for old, new in substitutions:
        count = source.count(old)
        if count != 1:
            raise ValueError(f"variant {variant!r}: {old[:60]!r} occurs {count} times in the module "
                             "(must be once)")
        source = source.replace(old, new)
    return source


def variant_names(module: types.ModuleType, substitutions: list, variant: str, workdir: str) -> dict:
    """The Triton functions and upper-case constants of ``module`` with ``substitutions`` applied,
    executed from a file in ``workdir`` in a copy of the module's namespace: ``{name: object}``."""
    source = _substituted(open(module.__file__).read(), substitutions, variant)
    path = os.path.join(workdir, f"{module.__name__.rsplit('.', 1)[-1]}__{variant}.py")
    with open(path, "w") as f:
        f.write(source)
    tree = ast.parse(source, filename=path)
    chosen = [n for n in tree.body if _is_jit(n) or _is_constant(n)]
    namespace = dict(vars(module))
    exec(compile(ast.Module(body=chosen, type_ignores=[]), path, "exec"), namespace)  # noqa: S102
    names = [n.name if isinstance(n, ast.FunctionDef) else t.id
             for n in chosen for t in ([n] if isinstance(n, ast.FunctionDef) else _targets(n))]
    return {name: namespace[name] for name in names}


def changes_kernels(module: types.ModuleType, substitutions: list, variant: str) -> bool:
    """Whether ``substitutions`` change the source of one of ``module``'s Triton functions (else
    they change only its constants, which reach a launch only through the launchers' lookups)."""
    original = open(module.__file__).read()

    def kernels(source: str) -> dict:
        return {n.name: ast.unparse(n) for n in ast.parse(source).body if _is_jit(n)}

    return kernels(original) != kernels(_substituted(original, substitutions, variant))


def _launch_configurations() -> list:
    """The launch configurations Onca has cached since the last swap (grids, constexprs, plans)."""
    from onca.ops import _launch

    return sorted(repr(value) for value in _launch._CONFIGS.values())


def _drop_cached_plans(module: types.ModuleType) -> None:
    from onca import tiling
    from onca.ops import _launch

    _launch._CONFIGS.clear()
    tiling._plan_rows.cache_clear()
    for obj in vars(module).values():
        if isinstance(obj, functools._lru_cache_wrapper):
            obj.cache_clear()


def _state(obj) -> dict | None:
    """What :func:`swapped` replaces in place of an object a launcher may hold itself (a tile dict
    or a ``fast_launch`` kernel, both registered with the row map's ops): a copy of its contents,
    or None for anything else (swapped on the module only)."""
    if isinstance(obj, dict):
        return dict(obj)
    if isinstance(obj, FastLaunch):
        return dict(vars(obj))
    return None


def _replace(obj, contents: dict) -> None:
    """``obj``'s contents (a dict's items, a kernel's attributes) replaced by ``contents``."""
    target = obj if isinstance(obj, dict) else vars(obj)
    target.clear()
    target.update(contents)


@contextlib.contextmanager
def swapped(module: types.ModuleType, names: dict):
    """``names`` set on ``module`` for the duration (the base: an empty dict). A dict constant (a
    tile declaration) and a ``fast_launch`` kernel are swapped in place, their contents replaced,
    so that a launcher holding the object itself (the row map's, registered with its op's tile
    dicts and kernels) sees the variant too."""
    saved = {name: getattr(module, name) for name in names}
    contents = {name: state for name, obj in saved.items() if (state := _state(obj)) is not None}
    _drop_cached_plans(module)
    for name, obj in names.items():
        if name in contents and type(obj) is type(saved[name]):
            _replace(saved[name], _state(obj))
        else:
            setattr(module, name, obj)
    try:
        yield
    finally:
        for name, obj in saved.items():
            setattr(module, name, obj)
            if name in contents:
                _replace(obj, contents[name])
        _drop_cached_plans(module)


def _result(bench, params, device, dtype, mode):
    """Outputs (forward) and input gradients (backward modes) of the op on fresh seeded inputs."""
    torch.manual_seed(0)
    inputs = bench.make_inputs(params, dtype, device)
    leaves = harness._leaves(inputs)
    outs, _ = harness._outputs_and_grads(build(bench.onca, params, inputs, mode)(), make_grads=False)
    tensors = [o.detach().clone() for o in outs]
    if mode != "forward":
        torch.manual_seed(1)
        torch.autograd.backward(outs, [torch.randn_like(o) if o.dim() else torch.ones_like(o) for o in outs])
        tensors += [t.grad.clone() for t in leaves if t.grad is not None]
    return tensors


def compare(base: list, other: list) -> str:
    """"bitwise equal", or the largest absolute difference over the tensors."""
    if len(base) != len(other):
        return f"{len(other)} tensors against the base's {len(base)}"
    if all(torch.equal(a, b) for a, b in zip(base, other)):
        return "bitwise equal"
    worst = max((a.float() - b.float()).abs().max().item() for a, b in zip(base, other))
    return f"max abs diff {worst:.3g}"


def _time_once(fn, on_gpu: bool) -> float:
    if on_gpu:
        import triton.testing

        # The median, asked for directly: with a one-element ``quantiles`` Triton 3.6 returns a float
        # where older versions return a list.
        return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def _device_time_once(factory, params, inputs, leaves, mode: str, device: str) -> float:
    """Milliseconds of one call replayed from a CUDA graph (the harness's device time: the host
    path left out); inf where the call cannot be captured."""
    ms = _measurer(device)._device_ms(build(factory, params, inputs, mode), leaves, mode)
    return float("inf") if ms is None else ms


def time_points(bench, module, variants: dict, points: list, *, device: str, dtype=torch.bfloat16,
                mode: str = "full", rounds: int = 2, peers: tuple = (), device_time: bool = False,
                constants_only: frozenset = frozenset(), memory: bool = False, report=print) -> dict:
    """``{x: {name: ms}}`` for the base, every variant and every peer, at each ``(x, params)``;
    ``device_time`` (GPU only): each call replayed from a CUDA graph instead of timed as called.
    A variant named in ``constants_only`` (its substitutions change no kernel) that launches with
    the base's configurations and gives the base's results bitwise is reported: its constants did
    not reach the launches (a constant read once at import, or one that changes nothing at this
    point), so it times the base again.
    Where the op's launchers cache no configurations (they plan at each call: fused MoE's grouped
    GEMMs), there is nothing to compare, and the report says it was not checked. ``memory`` (GPU
    only): each one's peak memory of one call too (the harness's, inputs included), under
    ``"<x> peak MB"``."""
    on_gpu = torch.device(device).type == "cuda"
    device_time = device_time and on_gpu
    results = {}
    for x, params in points:
        with swapped(module, {}):
            base = _result(bench, params, device, dtype, mode)
            base_launches = _launch_configurations()
        for name, names in variants.items():
            with swapped(module, names):
                outcome = compare(base, _result(bench, params, device, dtype, mode))
                report(f"{x} {name}: {outcome}")
                # Results that differ from the base's: the constants reached the computation.
                same_results = outcome == "bitwise equal" and name in constants_only
                if same_results and not base_launches:
                    report(f"{x} {name}: not checked whether its constants reach the launches (the op's "
                           "launchers cache no launch configurations)")
                elif same_results and _launch_configurations() == base_launches:
                    report(f"{x} {name}: launched with the base's configurations: its constants did not "
                           "reach the launches (the variant times the base's code)")
        inputs = bench.make_inputs(params, dtype, device)
        leaves = harness._leaves(inputs)
        providers = {"base": (bench.onca, {}), **{n: (bench.onca, v) for n, v in variants.items()}}
        for peer in peers:
            factory = harness.provider_factory(bench, peer)
            if factory is None:
                raise ValueError(f"--peers: {bench.name} has no provider {peer!r}")
            providers[peer] = (factory, {})
        best = {name: float("inf") for name in providers}
        for _ in range(rounds):
            for name, (factory, names) in providers.items():
                with swapped(module, names):
                    step = harness.Harness._step(build(factory, params, inputs, mode), leaves, mode)
                    taken = small_calls.taken
                    step()  # compilation outside the timing
                    if small_calls.taken != taken and factory is bench.onca:
                        report(f"{x} {name}: took the small-call route (torch's op), not the kernels; "
                               "ONCA_SMALL_CALL_LIMIT=0 turns it off")
                    ms = (_device_time_once(factory, params, inputs, leaves, mode, device) if device_time
                          else _time_once(step, on_gpu))
                    best[name] = min(best[name], ms)
        results[str(x)] = best
        # The base's time over each one's: above 1, faster than the base.
        ratios = "  ".join(f"{n} {ms:.3f} ({best['base'] / ms:.2f}x)" for n, ms in best.items())
        report(f"{x}: {ratios}")
        if memory and on_gpu:
            peaks = {}
            for name, (factory, names) in providers.items():
                with swapped(module, names):
                    peaks[name] = _peak_mb(factory, params, inputs, mode, device)
            results[f"{x} peak MB"] = peaks
            report(f"{x} peak MB: " + "  ".join(f"{n} {mb:.1f}" for n, mb in peaks.items()))
    return results


def _peak_mb(factory, params, inputs, mode: str, device: str) -> float:
    """The harness's peak memory of one call of ``mode`` (MB, the inputs included)."""
    return float(_measurer(device)._peak_memory(build(factory, params, inputs, mode), mode, inputs))


def _measurer(device: str):
    """A harness on ``device`` with its default settings: its device-time and peak-memory methods
    measure a variant as a sweep would."""
    return harness.Harness(harness.Settings(device=device), progress=False)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.kernel_variants",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("spec", help="JSON: {\"op\": ..., \"variants\": {name: [[old, new], ...]}}")
    parser.add_argument("--points", help="comma-separated x values of the op's sweeps "
                        "(default: each D1 sweep's first)")
    parser.add_argument("--mode", default="full", choices=("forward", "backward", "full"))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--peers", default="",
                        help="comma-separated: torch, torch_compile, liger, or a peer the benchmark declares")
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"))
    parser.add_argument("--device-time", action="store_true",
                        help="time each call replayed from a CUDA graph (the host path left out)")
    parser.add_argument("--memory", action="store_true",
                        help="also each one's peak memory of one call (the harness's, inputs included)")
    parser.add_argument("--out", help="write the times (ms) to this JSON file")
    args = parser.parse_args(argv)
    spec = json.load(open(args.spec))
    bench = harness.load(spec["op"])
    name = spec.get("module", f"onca.ops.{spec['op']}")
    module = sys.modules.get(name) or __import__(name, fromlist=["_"])
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    wanted = set(args.points.split(",")) if args.points else None
    points = [(x, p) for sweep in bench.sweeps for x, p in sweep.points
              if (wanted is None and sweep.kind == "d1" and (x, p) == sweep.points[0])
              or (wanted is not None and str(x) in wanted)]
    if wanted is not None and {str(x) for x, _ in points} != wanted:
        parser.error(f"no such point(s): {sorted(wanted - {str(x) for x, _ in points})}")
    if device == "cpu":
        points = [("probe", dict(bench.probe))]  # a spec check at the benchmark's probe size
    with tempfile.TemporaryDirectory() as workdir:
        variants = {name: variant_names(module, subs, name, workdir)
                    for name, subs in spec["variants"].items()}
        constants_only = frozenset(name for name, subs in spec["variants"].items()
                                   if not changes_kernels(module, subs, name))
        peers = tuple(p for p in args.peers.split(",") if p)
        results = time_points(bench, module, variants, points, device=device, dtype=dtype, mode=args.mode,
                              rounds=args.rounds, peers=peers, device_time=args.device_time,
                              constants_only=constants_only, memory=args.memory)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
