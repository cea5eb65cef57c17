"""The ``onca`` command."""

from __future__ import annotations

import argparse
import importlib
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
    lines.append(f"interpreter   {'on (kernels run on the CPU, slowly)' if device.interpreter_active() else 'off'}")
    lines.append(f"profile       {profile.describe()}")
    print("\n".join(lines))
    return 0


def cmd_plan(args) -> int:
    import os

    from onca import device

    if args.profile:
        os.environ["ONCA_DEVICE_PROFILE"] = args.profile
        device.reset()
    if args.op not in op_names():
        print(f"onca plan: unknown op {args.op!r}; ops: {', '.join(op_names())}", file=sys.stderr)
        return 2
    module = importlib.import_module(f"onca.ops.{args.op}")
    profile = device.get_profile()
    print(f"{args.op} {'x'.join(map(str, args.shape))} {str(args.dtype).replace('torch.', '')} on {profile.describe()}")
    for name, plan in module.plan(args.shape, args.dtype, profile).items():
        print(f"  {name:>10}: {plan.describe()}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="onca", description="Fast, memory-lean Triton kernels for LLM training.")
    sub = parser.add_subparsers(dest="command", required=True)

    env = sub.add_parser("env", help="print the device, its profile, and versions")
    env.set_defaults(func=cmd_env)

    plan = sub.add_parser("plan", help="print how an op is tiled for a shape on a profile")
    plan.add_argument("op", help="op name, e.g. rms_norm")
    plan.add_argument("--shape", type=parse_shape, required=True, help="e.g. 16384x4096")
    plan.add_argument("--dtype", type=parse_dtype, default="bf16")
    plan.add_argument("--profile", help="a built-in profile name (default: detected)")
    plan.set_defaults(func=cmd_plan)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
