"""Device time of one whole training step of an ``onca compare`` model, per kind of kernel and per
variant: where a step's time goes, and which kernels a gap between two variants lives in.

    python -m tools.step_kernels --compile huggingface onca            # Qwen3-0.6B shape on a GPU
    python -m tools.step_kernels --compile onca onca:rope=off,mlp=off  # Onca with some switches off
    python -m tools.step_kernels --compile onca --gaps 10                # where the device sat idle
    python -m tools.step_kernels --preset tiny --steps 1 huggingface onca   # a CPU check

A variant is ``huggingface``, ``liger``, or ``onca`` with optional ``onca.apply`` switches after a
colon (``onca:rope=off,rms_norm=off``). Each variant's model is built, patched, checkpointed and
(``--compile``) compiled as ``onca compare`` does, trained three warm-up steps (compilation happens
there), then profiled over ``--steps`` steps. Printed per variant: the wall time per step (steps
synchronised, timed without the profiler), the peak memory, the kernels' device time per step
grouped by kind (GEMM, attention, Onca's Triton kernels, inductor's Triton kernels, optimizer,
copies and fills, other ATen kernels), the ``--top`` kernels, and with ``--gaps N`` the span of a
step against its kernels and the N longest idle gaps between kernels (as ``tools.kernel_times
--gaps``). Without a GPU the steps run on the CPU (Triton under the interpreter) and only the wall
time and CPU ops are printed: a check, not a measurement.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
import time

import torch

from onca.integrations.transformers import compare
from tools.kernel_times import kernel_times, print_gaps

KINDS = ("gemm", "attention", "onca", "inductor", "optimizer", "copy/fill", "other")


def onca_kernel_names() -> set[str]:
    """The names of every Triton kernel in Onca's op modules."""
    import importlib
    import pkgutil

    import onca.ops

    names = set()
    for info in pkgutil.iter_modules(onca.ops.__path__):
        module = importlib.import_module(f"onca.ops.{info.name}")
        for value in vars(module).values():
            fn = getattr(value, "fn", None)  # a JITFunction (or Onca's fast-launch wrapper of one)
            while fn is not None and not callable(getattr(fn, "__code__", None)) and hasattr(fn, "fn"):
                fn = fn.fn
            name = getattr(fn, "__name__", None)
            if name and type(value).__module__.startswith(("triton", "onca")):
                names.add(name)
    return names


def kind(name: str, onca_names: set[str]) -> str:
    """The kind of a CUDA kernel, by its name."""
    low = name.lower()
    if name in onca_names or name.split("_0d")[0] in onca_names:
        return "onca"
    if low.startswith("triton_"):
        return "inductor"
    if any(k in low for k in ("flash", "fmha", "sdpa", "attention", "attn")):
        return "attention"
    if any(k in low for k in ("gemm", "nvjet", "cutlass", "xmma", "cublas", "sm90_", "sm80_")):
        return "gemm"
    if any(k in low for k in ("multi_tensor", "adam", "foreach")):
        return "optimizer"
    if any(k in low for k in ("memcpy", "memset", "copy", "fill", "cat")):
        return "copy/fill"
    return "other"


def parse_variant(text: str) -> tuple[str, dict[str, bool]]:
    name, _, switches = text.partition(":")
    if name not in compare.VARIANTS:
        raise SystemExit(f"step_kernels: unknown variant {name!r}; variants: {', '.join(compare.VARIANTS)}")
    chosen = {}
    for item in filter(None, switches.split(",")):
        key, _, value = item.partition("=")
        if value not in ("on", "off"):
            raise SystemExit(f"step_kernels: switch {item!r} must be name=on or name=off")
        chosen[key] = value == "on"
    if chosen and name != "onca":
        raise SystemExit(f"step_kernels: switches apply to onca only, not {name!r}")
    return name, chosen


def build_step(settings: compare.Settings, config, variant: str, switches: dict[str, bool]):
    """``(model, step)``: one training step of ``variant``, as ``onca compare`` trains it. Undo
    the patch with ``compare._unpatch`` before the next variant: Onca's RoPE patch is
    module-level, and a variant with ``rope=off`` would otherwise still run it."""
    model = compare._build_model(settings, config)
    if variant == "onca":
        import onca

        onca.apply(model, **switches)
    else:
        compare._patch(variant, model)
    if settings.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    forward = torch.compile(model) if settings.compile else model
    cuda = settings.device == "cuda"
    optimizer = torch.optim.AdamW(model.parameters(), lr=settings.lr, **({"fused": True} if cuda else {}))
    tokens = compare.batches(settings, config.vocab_size)[0].to(settings.device)

    def step():
        loss = forward(input_ids=tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return model, step


def wall_ms(step, cuda: bool, steps: int) -> float:
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    if cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3 / steps


def by_kind(rows: list[tuple[str, float, float]], onca_names: set[str]) -> dict[str, float]:
    totals = dict.fromkeys(KINDS, 0.0)
    for name, us, _ in rows:
        totals[kind(name, onca_names)] += us
    return totals


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.step_kernels", description=__doc__.splitlines()[0])
    parser.add_argument("variants", nargs="+", help="huggingface, liger, onca or onca:switch=off,...")
    parser.add_argument("--model", default="qwen3")
    parser.add_argument("--preset", help="a registry preset (default: 0.6b on a GPU, tiny on the CPU)")
    parser.add_argument("--batch", type=int)
    parser.add_argument("--seq", type=int)
    parser.add_argument("--layers", type=int)
    parser.add_argument("--compile", action="store_true", help="every variant's model under torch.compile")
    parser.add_argument("--no-gradient-checkpointing", action="store_true")
    parser.add_argument("--steps", type=int, default=3, help="profiled (and separately timed) steps")
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--gaps", type=int, default=0, metavar="N",
                        help="also the span per step and the N longest idle gaps between kernels (a second, "
                             "host-traced profile: its gaps are upper bounds)")
    args = parser.parse_args(argv)
    trace_dir = tempfile.mkdtemp() if args.gaps else None
    variants = [parse_variant(v) for v in args.variants]
    cuda = torch.cuda.is_available()
    settings = compare.defaults_for("cuda" if cuda else "cpu")
    changes = {k: v for k, v in dict(model=args.model, preset=args.preset, batch=args.batch, seq=args.seq,
                                     layers=args.layers).items() if v is not None}
    settings = dataclasses.replace(settings, compile=args.compile, **changes)
    if args.no_gradient_checkpointing:
        settings = dataclasses.replace(settings, gradient_checkpointing=False)
    config = compare.build_config(settings)
    onca_names = onca_kernel_names()
    print(f"{config.model_type} ({settings.preset}): {config.num_hidden_layers} layers, hidden {config.hidden_size}, "
          f"batch {settings.batch} x {settings.seq}, {str(settings.dtype).replace('torch.', '')}, checkpointing "
          f"{'on' if settings.gradient_checkpointing else 'off'}{', torch.compile' if settings.compile else ''}, "
          f"{torch.cuda.get_device_name() if cuda else 'cpu'}", flush=True)
    for number, (text, (variant, switches)) in enumerate(zip(args.variants, variants)):
        model = step = None
        try:
            model, step = build_step(settings, config, variant, switches)
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            trace_path = os.path.join(trace_dir, f"{number}-{variant}.json") if trace_dir else None
            rows = kernel_times(step, settings.device, args.steps, trace_path)  # three warm-up steps first
            wall = wall_ms(step, cuda, args.steps)
            peak_mb = torch.cuda.max_memory_allocated() / 2**20 if cuda else None
        except Exception as exc:  # one failing variant does not hide the others
            print(f"== {text}: failed: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
            continue
        finally:
            if model is not None:
                compare._unpatch(variant, model)
            model = step = None
            torch._dynamo.reset()  # the next variant compiles afresh, with no graphs of this one held
            if cuda:
                torch.cuda.empty_cache()
        if not cuda:
            print(f"== {text}: {wall:.1f} ms per step on the CPU (kernels under the interpreter: not a measurement)")
            continue
        totals = by_kind(rows, onca_names)
        device_ms = sum(totals.values()) / 1e3
        print(f"== {text}: {wall:.2f} ms per step, {device_ms:.2f} ms of kernels, peak {peak_mb:.0f} MB")
        print("   " + "  ".join(f"{k} {v / 1e3:.2f}" for k, v in totals.items()))
        for name, us, count in rows[:args.top]:
            print(f"  {us / 1e3:9.3f} ms  x{count:<6.1f} {kind(name, onca_names):10s} {name[:100]}")
        if trace_path:
            print_gaps(trace_path, args.steps, args.gaps)
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
