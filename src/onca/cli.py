"""The ``onca`` command."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import pkgutil
import platform
import sys

DTYPES = {"fp32": "float32", "float32": "float32", "bf16": "bfloat16", "bfloat16": "bfloat16",
          "fp16": "float16", "float16": "float16"}


def parse_dtype(name: str):
    import torch

    if name not in DTYPES:
        raise argparse.ArgumentTypeError(f"unknown dtype {name!r} (use one of {', '.join(DTYPES)})")
    return getattr(torch, DTYPES[name])


def parse_shape(text: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(s) for s in text.lower().replace(",", "x").split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--shape must look like 16384x4096, got {text!r}") from None
    if not shape or any(s <= 0 for s in shape):
        raise argparse.ArgumentTypeError(f"--shape needs positive sizes, got {text!r}")
    return shape


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def parse_profile(name: str) -> str:
    from onca.device import PROFILES

    if name not in PROFILES:
        raise argparse.ArgumentTypeError(f"unknown profile {name!r}; profiles: {', '.join(sorted(PROFILES))}")
    return name


def op_names() -> list[str]:
    import onca.ops

    return sorted(m.name for m in pkgutil.iter_modules(onca.ops.__path__) if not m.name.startswith("_"))


def _version(module: str) -> str:
    try:
        return importlib.import_module(module).__version__
    except Exception:
        return "not installed"


def cmd_env(args) -> int:
    import torch

    import onca
    from onca import device

    profile = device.get_profile()
    where = device.accelerator()
    lines = [
        f"onca          {onca.__version__}",
        f"python        {platform.python_version()} ({sys.executable})",
        f"torch         {torch.__version__}",
        f"triton        {_version('triton')}",
        f"transformers  {_version('transformers')}",
        f"accelerator   {where}",
    ]
    if where == "cuda":
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        lines.append(f"device        {props.name}, {props.total_memory / 2**30:.1f} GiB")
    if where == "npu":
        lines.insert(3, f"torch_npu     {_version('torch_npu')}")
        lines.append(f"device        {torch.npu.get_device_name(torch.npu.current_device())}")
    lines.append(f"interpreter   {'on (kernels run on the CPU, slowly)' if device.interpreter_active() else 'off'}")
    lines.append(f"profile       {profile.describe()}")
    print("\n".join(lines))
    return 0


def cmd_plan(args) -> int:
    from onca import device

    if args.op not in op_names():
        print(f"onca plan: unknown op {args.op!r}; ops: {', '.join(op_names())}", file=sys.stderr)
        return 2
    module = importlib.import_module(f"onca.ops.{args.op}")
    profile = device.profile_named(args.profile) if args.profile else device.get_profile()
    print(f"{args.op} {'x'.join(map(str, args.shape))} {str(args.dtype).replace('torch.', '')} on {profile.describe()}")
    for name, plan in module.plan(args.shape, args.dtype, profile).items():
        print(f"  {name:>10}: {plan.describe()}")
    return 0


def _csv_list(text: str) -> tuple[str, ...]:
    return tuple(t.strip() for t in text.split(",") if t.strip())


def cmd_bench(args) -> int:
    import os

    import torch

    from onca import device
    from onca.bench import harness, plot, records, report
    from onca.bench.spec import MODES, PROVIDERS, SWEEP_KINDS

    if args.list:
        for op in harness.list_ops():
            bench = harness.load(op)
            sweeps = ", ".join(f"{s.kind}:{s.x_name}({len(s.points)})" for s in bench.sweeps)
            print(f"{op:28s} {sweeps}")
        return 0
    targets = list(args.targets)
    if targets[:1] == ["summary"]:
        if len(targets) != 2:
            print("usage: onca bench summary CSV", file=sys.stderr)
            return 2
        rows = records.latest(records.read_csv(targets[1]))
        print(report.summary(rows))
        behind = report.below_peers(rows)
        if behind:
            print("\nWhere onca is below the fastest peer (full mode, peer time / onca time):\n")
            print(behind)
        overhead = report.overhead_summary(rows)
        if overhead:
            print("\nHost overhead (16 tokens, full mode, wall clock per call):\n")
            print(overhead)
        return 0
    if targets[:1] == ["merge"]:
        if len(targets) < 2:
            print("usage: onca bench merge RUN_DIR [RUN_DIR ...] [--out DIR]", file=sys.stderr)
            return 2
        for line in records.merge_runs(targets[1:], args.out):
            print(line)
        return 0
    if targets[:1] == ["plot"]:
        if len(targets) != 2:
            print("usage: onca bench plot CSV", file=sys.stderr)
            return 2
        for path in plot.plot_csv(targets[1], args.plot_dir, include_cpu=args.include_cpu):
            print(path)
        return 0
    if not targets:
        print("onca bench: name an op, 'all', 'plot CSV', 'summary CSV', 'merge RUN_DIR...', or use --list",
              file=sys.stderr)
        return 2
    ops = harness.list_ops() if targets == ["all"] else targets
    unknown = [op for op in ops if op not in harness.list_ops()]
    if unknown:
        print(f"onca bench: no benchmark for {', '.join(unknown)}; see onca bench --list", file=sys.stderr)
        return 2
    # Providers: the harness's own and the peers the named ops declare (OpBenchmark.peers); by
    # default every one of them, peers included.
    known = list(PROVIDERS) + [p for op in ops for p in harness.load(op).peers if p not in PROVIDERS]
    providers = PROVIDERS if args.providers is None else args.providers
    bad = [m for m in args.modes if m not in MODES] + [p for p in providers if p not in known]
    if bad:
        print(f"onca bench: unknown mode/provider {', '.join(bad)} (modes: {', '.join(MODES)}; "
              f"providers: {', '.join(dict.fromkeys(known))})", file=sys.stderr)
        return 2

    kinds = SWEEP_KINDS if args.sweep == "all" else (args.sweep,)
    if args.points is not None:
        declared = {str(x) for op in ops for kind in kinds for s in harness.load(op).sweep(kind) for x, _ in s.points}
        missing = [x for x in args.points if x not in declared]
        if missing:
            print(f"onca bench: --points {', '.join(missing)} is no point of the {args.sweep} sweeps of "
                  f"{', '.join(ops)} (points: {', '.join(sorted(declared))})", file=sys.stderr)
            return 2

    where = device.accelerator()
    settings = harness.Settings(device="cuda" if where == "cuda" else "cpu", dtype=args.dtype,
                                providers=providers, peers=args.providers is None, modes=args.modes,
                                max_points=args.max_points, points=args.points,
                                rounds=args.rounds if where == "cuda" else 1,
                                device_time=not args.no_device_time)
    if not settings.on_gpu:
        print("onca bench: no GPU here; running each sweep once at a tiny size on the CPU "
              "(a smoke test of the benchmark code, not a measurement)")
    runner = harness.Harness(settings, progress=not args.no_progress)
    for op in ops:
        bench = harness.load(op)
        sweeps = [s for kind in kinds for s in bench.sweep(kind)]
        dtype = str(args.dtype).replace("torch.", "")
        csv_path = os.path.join(args.out, "results.csv")
        json_path = os.path.join(args.out, f"{op}-{plot._slug(runner.gpu_name)}-{dtype}.json")
        # Each point goes to the CSV and the JSON as it is measured: a run cut short keeps them. The
        # JSON keeps what earlier runs into this directory measured (other providers, sweeps, points).
        measured, appended = records.read_json(json_path), []

        def keep(done, csv_path=csv_path, json_path=json_path, measured=measured, appended=appended):
            appended.append(records.append_csv(csv_path, done))
            measured.extend(done)
            records.write_json(json_path, records.merge(measured))

        new = runner.run(bench, sweeps, on_point=keep)
        print(report.table(new, "speed"))
        if settings.on_gpu:
            print()
            print(report.table([r for r in new if r.kernel_operation_mode == "full"], "memory"))
        print(f"\n{op}: {sum(appended)} rows appended to {csv_path}")
    if args.plot:
        for path in plot.plot_csv(os.path.join(args.out, "results.csv"), args.plot_dir, ops=ops,
                                  include_cpu=not settings.on_gpu):
            print(path)
    del torch
    return 0


def cmd_compare(args) -> int:
    import dataclasses

    from onca import device

    try:
        from onca.integrations.transformers import compare, presets
    except ImportError as exc:
        print(f"onca compare needs transformers: pip install 'onca[transformers]' ({exc})", file=sys.stderr)
        return 2
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        print("onca compare --plot needs matplotlib: pip install 'onca[plot]'", file=sys.stderr)
        return 2
    where = "cuda" if device.accelerator() == "cuda" else "cpu"
    settings = compare.defaults_for(where)
    changes = {k: v for k, v in dict(model=args.model, preset=args.preset, batch=args.batch, seq=args.seq,
                                     steps=args.steps, dtype=args.dtype, lr=args.lr, layers=args.layers,
                                     seed=args.seed, variants=args.variants).items() if v is not None}
    if args.gradient_checkpointing is not None:
        changes["gradient_checkpointing"] = args.gradient_checkpointing
    if args.compile:
        changes["compile"] = True
    model_type = compare.resolve_model(args.model) if args.model is not None else None
    if model_type is not None and args.preset is None:
        # Another family than the default: its first registry preset on a GPU, tiny on the CPU.
        choices = list(presets.PRESETS.get(model_type, {}))
        changes["preset"] = choices[0] if (where == "cuda" and choices) else "tiny"
    rank = 0
    if args.fsdp:
        changes["fsdp"] = True
        try:
            rank, _ = compare.init_distributed(where)
        except ValueError as exc:
            print(f"onca compare: {exc}", file=sys.stderr)
            return 2
    settings = dataclasses.replace(settings, **changes)
    if settings.steps <= settings.warmup_steps:
        settings = dataclasses.replace(settings, warmup_steps=settings.steps - 1)
    results, config = compare.run(settings, show_progress=not args.no_progress and rank == 0)
    if rank == 0:
        print(compare.report(results, settings, config))
        if args.plot:
            print(f"plot: {compare.plot(results, settings, args.plot)}")
        if args.output:
            import json

            os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
            with open(args.output, "w") as f:
                json.dump(compare.to_json(results, settings, config), f, indent=1)
            print(f"output: {args.output}")
    if args.fsdp:
        import torch.distributed as dist

        # Every rank leaves together: a rank that tore its group down while rank 0 was still
        # reporting made gloo's transport threads abort ("terminate called") at exit.
        dist.barrier()
        dist.destroy_process_group()
    return 0 if all(r.ok or r.variant == "liger" for r in results) else 1


class _Parser(argparse.ArgumentParser):
    """Usage errors as one line (what is wrong and where to look), not argparse's usage block."""

    def error(self, message):
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def _model_help() -> str:
    from onca.integrations.transformers.families import FAMILIES
    from onca.integrations.transformers.presets import ALIASES

    short = ", ".join(f"{alias} for {model_type}" for alias, model_type in ALIASES.items())
    return f"a model type ({', '.join(FAMILIES)}; {short}) or a local checkpoint directory"


def cmd_audit(args) -> int:
    import subprocess

    if args.ascend == args.cuda:
        print("onca audit: say which compiler to audit with (--ascend or --cuda)", file=sys.stderr)
        return 2
    # Kernels must be compiled JITFunctions, not interpreted ones: a fresh process, interpreter off.
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    options = [arg for name in ("ops", "profiles") if getattr(args, name)
               for arg in (f"--{name}", getattr(args, name))]
    options += ["--cuda"] if args.cuda else []
    return subprocess.call([sys.executable, "-m", "onca.audit", *options], env=env)


def build_parser() -> argparse.ArgumentParser:
    # --debug is accepted before or after the command. Its action is shared by every parser built
    # from `debug`: with no default (SUPPRESS), a subcommand cannot overwrite a --debug given before it.
    debug = argparse.ArgumentParser(add_help=False)
    debug.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                       help="on an error, show the Python traceback instead of one line")
    parser = _Parser(prog="onca", description="Fast, memory-lean Triton kernels for LLM training.",
                     parents=[debug])
    sub = parser.add_subparsers(dest="command", required=True)

    env = sub.add_parser("env", help="print the device, its profile, and versions", parents=[debug])
    env.set_defaults(func=cmd_env)

    plan = sub.add_parser("plan", help="print how an op is tiled for a shape on a profile", parents=[debug])
    plan.add_argument("op", help="op name, e.g. rms_norm")
    plan.add_argument("--shape", type=parse_shape, required=True, help="e.g. 16384x4096")
    plan.add_argument("--dtype", type=parse_dtype, default="bf16", help="fp32, bf16 (default) or fp16")
    plan.add_argument("--profile", type=parse_profile,
                      help="a built-in device profile, e.g. h100 or ascend910b4 (default: the detected one)")
    plan.set_defaults(func=cmd_plan)

    bench = sub.add_parser("bench", help="benchmark ops against torch, torch.compile and liger-kernel",
                           parents=[debug],
                           description="onca bench OP|all [options], onca bench plot CSV, "
                                       "onca bench summary CSV, onca bench merge RUN_DIR... [--out DIR], "
                                       "onca bench --list")
    bench.add_argument("targets", nargs="*",
                       help="op names, 'all', 'plot CSV', 'summary CSV' or 'merge RUN_DIR...' (the "
                            "runs' whole points into --out)")
    bench.add_argument("--list", action="store_true", help="list the ops that have benchmarks")
    bench.add_argument("--sweep", choices=["d1", "d2", "overhead", "all"], default="all",
                       help="d1 (one dimension), d2 (model shapes), overhead (16 tokens, wall clock) or all")
    bench.add_argument("--modes", type=_csv_list, default=("forward", "backward", "full"),
                       help="comma-separated subset of forward,backward,full (default: all)")
    bench.add_argument("--providers", type=_csv_list, default=None,
                       help="comma-separated subset of onca,torch,torch_compile,liger and the op's peers "
                            "(e.g. trl) (default: all of them)")
    bench.add_argument("--dtype", type=parse_dtype, default="bf16", help="fp32, bf16 (default) or fp16")
    bench.add_argument("--out", default=os.path.join("benchmarks", "data"), help="results directory")
    bench.add_argument("--plot", action="store_true", help="draw PNG charts after the run")
    bench.add_argument("--plot-dir", default=os.path.join("benchmarks", "plots"),
                       help="where charts go (default benchmarks/plots)")
    bench.add_argument("--include-cpu", action="store_true", help="also chart CPU smoke-test rows")
    bench.add_argument("--max-points", type=positive_int,
                       help="at most this many points per sweep (evenly spaced)")
    bench.add_argument("--rounds", type=positive_int, default=3,
                       help="timing rounds per point on a GPU, the providers taking turns; each keeps its "
                            "fastest (default 3)")
    bench.add_argument("--no-device-time", action="store_true",
                       help="skip the device time (each point's call replayed from a CUDA graph, the host "
                            "path left out), recorded beside the time a caller sees")
    bench.add_argument("--points", type=_csv_list,
                       help="comma-separated x values to run, e.g. model names (default: every point)")
    bench.add_argument("--no-progress", action="store_true",
                       help="no progress bar: a line per finished run, with its time")
    bench.set_defaults(func=cmd_bench)

    compare = sub.add_parser(
        "compare", help="train a model with and without Onca (and liger-kernel) and compare", parents=[debug],
        description="Train the same model from the same seed with Hugging Face alone, with Onca and (when "
                    "installed) with liger-kernel; print tokens/s, step time, peak memory and the loss of "
                    "every step side by side. With no arguments: a tiny model on the CPU, a "
                    "Qwen3-0.6B-shaped model (batch 4, seq 2048, bf16, gradient checkpointing) on a GPU.")
    compare.add_argument("--model", help=_model_help())
    compare.add_argument("--preset",
                         help="tiny, or a real shape: 0.6b / 8b (qwen3), 8b / 70b (llama), 20b (gpt_oss), "
                              "scout (llama4_text), 8b (qwen3_vl), 3b (smollm3), 7b, ...")
    compare.add_argument("--layers", type=positive_int, help="build fewer layers than the preset has")
    compare.add_argument("--batch", type=positive_int, help="sequences per step")
    compare.add_argument("--seq", type=positive_int, help="tokens per sequence")
    compare.add_argument("--steps", type=positive_int, help="training steps per variant")
    compare.add_argument("--dtype", type=parse_dtype, help="fp32, bf16 or fp16 (default: fp32 on the CPU, "
                                                           "bf16 on a GPU)")
    compare.add_argument("--lr", type=float, help="AdamW's learning rate")
    compare.add_argument("--seed", type=int, help="seed of the weights and the token stream")
    compare.add_argument("--gradient-checkpointing", dest="gradient_checkpointing", action="store_true",
                         default=None, help="checkpoint every layer (default: on a GPU)")
    compare.add_argument("--no-gradient-checkpointing", dest="gradient_checkpointing", action="store_false",
                         help="no gradient checkpointing")
    compare.add_argument("--compile", action="store_true",
                         help="run every variant's model under torch.compile (inductor)")
    compare.add_argument("--variants", type=_csv_list,
                         help="comma-separated subset of huggingface,onca,liger (default: all)")
    compare.add_argument("--plot", nargs="?", const="onca-compare.png",
                         help="write a PNG of the loss curves and memory (default onca-compare.png; "
                              "needs matplotlib: pip install 'onca[plot]')")
    compare.add_argument("--no-progress", action="store_true", help="no progress bar")
    compare.add_argument("--fsdp", action="store_true",
                         help="FSDP2 over the ranks torchrun starts (torchrun --nproc_per_node N -m onca.cli "
                              "compare --fsdp ...): tokens/s and peak memory per GPU")
    compare.add_argument("--output", help="also write the comparison as JSON to this path")
    compare.set_defaults(func=cmd_compare)
    audit = sub.add_parser("audit", help="compile every kernel without the device: triton-ascend (--ascend) "
                                         "or NVIDIA's compiler (--cuda)", parents=[debug],
                           description="Compile every kernel of the ops' D2 sweeps (model shapes), under "
                                       "each profile's plan: --ascend with triton-ascend up to Linalg (needs "
                                       "triton-ascend installed in place of triton, see README.md); --cuda "
                                       "with the installed Triton down to a cubin, no GPU needed.")
    audit.add_argument("--ascend", action="store_true", help="audit with triton-ascend, up to Linalg")
    audit.add_argument("--cuda", action="store_true",
                       help="audit with the installed Triton for the GPU profiles, down to a cubin")
    audit.add_argument("--ops", help="comma-separated ops (default: all)")
    audit.add_argument("--profiles", help="comma-separated profiles (default: all of the compiler's)")
    audit.set_defaults(func=cmd_audit)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except Exception as exc:
        if getattr(args, "debug", False):
            raise
        print(f"onca {args.command}: {_one_line(exc)}", file=sys.stderr)
        return 2 if isinstance(exc, (ValueError, TypeError)) else 1


def _one_line(exc: Exception) -> str:
    """A ValueError's message (Onca's errors about what the user asked for), else the error's type
    and first line, with a pointer to the traceback."""
    lines = str(exc).strip().splitlines()
    if isinstance(exc, ValueError) and lines:
        return lines[0]
    return f"{type(exc).__name__}: {lines[0] if lines else ''} (--debug shows the traceback)"


if __name__ == "__main__":
    sys.exit(main())
