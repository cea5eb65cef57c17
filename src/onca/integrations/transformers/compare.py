"""``onca compare``: train the same model from the same seed with and without Onca (and, when it is
installed, with liger-kernel), and report throughput, step time, peak memory and every step's loss
side by side.

The model is built from its config with random weights (no download); a local checkpoint path
works too. Each variant starts from identical weights and sees identical batches, so the loss
curves are directly comparable.
"""

from __future__ import annotations

import importlib.util
import math
import os
import sys
import time
from dataclasses import dataclass, field

import torch

from onca.integrations.transformers import presets

VARIANTS = ("huggingface", "onca", "liger")


@dataclass
class Settings:
    model: str = "qwen3"
    preset: str = "tiny"
    batch: int = 2
    seq: int = 64
    steps: int = 8
    dtype: torch.dtype = torch.float32
    lr: float = 1e-4
    gradient_checkpointing: bool = False
    compile: bool = False  # every variant's model under torch.compile (inductor)
    layers: int | None = None
    warmup_steps: int = 2
    seed: int = 0
    device: str = "cpu"
    variants: tuple[str, ...] = VARIANTS
    # FSDP2 (``fully_shard`` per decoder layer and at the root) over the ranks torchrun started:
    # each rank trains on its own batches; throughput and peak memory are per GPU.
    fsdp: bool = False


@dataclass
class RunResult:
    variant: str
    losses: list[float] = field(default_factory=list)
    step_ms: list[float] = field(default_factory=list)
    peak_mb: float | None = None
    error: str | None = None
    kernels: dict[str, int] = field(default_factory=dict)  # Onca's kernels in the patched model, counted

    @property
    def ok(self) -> bool:
        return self.error is None

    def timed_ms(self, warmup: int) -> list[float]:
        return self.step_ms[warmup:] if len(self.step_ms) > warmup else self.step_ms

    def tokens_per_s(self, tokens_per_step: int, warmup: int) -> float:
        steps = self.timed_ms(warmup)
        return tokens_per_step * len(steps) / (sum(steps) / 1e3) if steps else math.nan


def defaults_for(device: str) -> Settings:
    """With no arguments: a tiny model on the CPU (about a minute), a Qwen3-0.6B shape on a GPU."""
    if device == "cuda":
        return Settings(model="qwen3", preset="0.6b", batch=4, seq=2048, steps=20, dtype=torch.bfloat16,
                        gradient_checkpointing=True, warmup_steps=3, device=device)
    return Settings(device=device, steps=16, lr=1e-3)


def liger_installed() -> bool:
    return importlib.util.find_spec("liger_kernel") is not None


def resolve_model(name: str) -> str | None:
    """The model type ``name`` stands for (aliases resolved), or None for a checkpoint directory.
    A name that is or looks like a path but is no directory is an error that says so, not an
    unknown model type."""
    if os.path.isdir(name):
        return None
    separators = [sep for sep in (os.sep, os.altsep) if sep]
    if os.path.exists(name) or any(sep in name for sep in separators) or name.startswith((".", "~")):
        problem = "is not a directory (a checkpoint is one)" if os.path.exists(name) else "does not exist"
        raise ValueError(f"model path {name!r} {problem}")
    return presets.resolve_model_type(name)


def check_settings(settings: Settings) -> None:
    """Refuse settings that could not train, before anything is built: one clear error each."""
    unknown = [v for v in settings.variants if v not in VARIANTS]
    if unknown or not settings.variants:
        raise ValueError(f"unknown variant(s) {', '.join(unknown) or '(none given)'}; "
                         f"variants: {', '.join(VARIANTS)}")
    for name in ("steps", "batch", "seq", "layers"):
        value = getattr(settings, name)
        if value is not None and value < 1:
            raise ValueError(f"{name} must be at least 1, got {value}")
    resolve_model(settings.model)


def build_config(settings: Settings):
    if os.path.isdir(settings.model):
        import transformers

        return transformers.AutoConfig.from_pretrained(settings.model)
    if settings.preset == "tiny":
        return presets.tiny_config(settings.model)
    return presets.registry_config(settings.model, settings.preset, settings.layers)


def _build_model(settings: Settings, config):
    import transformers

    torch.manual_seed(settings.seed)
    if os.path.isdir(settings.model):
        model = transformers.AutoModelForCausalLM.from_pretrained(settings.model, dtype=settings.dtype)
    else:
        # Initialised where it trains: on the host, a real-width model's init outlasts its steps.
        with torch.device(_device(settings)):
            model = _model_class(config)._from_config(config, dtype=settings.dtype)
    return model.to(_device(settings))


# ------------------------------------------------------------------------------ distributed (FSDP2)


def distributed() -> bool:
    """Whether torch.distributed is initialised (``onca compare --fsdp`` under torchrun)."""
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def init_distributed(device: str) -> tuple[int, int]:
    """Join the process group torchrun set up (NCCL on GPUs, one per local rank; gloo on the CPU);
    returns ``(rank, world size)``."""
    import torch.distributed as dist

    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise ValueError("onca compare --fsdp runs under torchrun: torchrun --nproc_per_node N -m onca.cli "
                         "compare --fsdp ...")
    if not dist.is_initialized():
        if device == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if device == "cuda" else "gloo")
    return dist.get_rank(), dist.get_world_size()


def _device(settings: Settings):
    if settings.device == "cuda" and distributed():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(settings.device)


def _shard(model):
    """FSDP2 as the usual recipe: each decoder layer, then the root (embedding, norm and head)."""
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model


def _across_ranks(value: float, op: str) -> float:
    """``value`` reduced over the ranks (``"max"`` or ``"avg"``); itself without distributed."""
    if not distributed():
        return value
    import torch.distributed as dist

    device = "cuda" if torch.cuda.is_available() and dist.get_backend() == "nccl" else "cpu"
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
    return t.item() / (1 if op == "max" else dist.get_world_size())


def _model_class(config):
    """The class Onca patches for ``config``'s family (a multimodal family's
    ``ForConditionalGeneration``), else transformers' causal-LM auto class."""
    import transformers

    from onca.integrations.transformers.families import FAMILIES

    family = FAMILIES.get(config.model_type)
    if family is not None and family.causal_lm_class and family.available():
        return getattr(family.modeling(), family.causal_lm_class)
    return transformers.AutoModelForCausalLM


def _patch(variant: str, model):
    if variant == "onca":
        import onca

        onca.apply(model)
    elif variant == "liger":
        from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN

        apply_fn = MODEL_TYPE_TO_APPLY_LIGER_FN.get(model.config.model_type)
        if apply_fn is None:
            raise ImportError(f"liger-kernel has no patch for {model.config.model_type}")
        apply_fn(model=model)


def _unpatch(variant: str, model):
    if variant == "onca":
        import onca

        onca.unapply(model)


def batches(settings: Settings, vocab_size: int) -> list[torch.Tensor]:
    """A fixed token stream, the same for every variant: four random batches cycled, so that the
    loss falls visibly as they are learnt (speed does not depend on the tokens). Distributed, each
    rank has its own stream."""
    rank = torch.distributed.get_rank() if distributed() else 0
    g = torch.Generator().manual_seed(settings.seed + 1 + 1000 * rank)
    distinct = [torch.randint(0, vocab_size, (settings.batch, settings.seq), generator=g)
                for _ in range(min(4, settings.steps))]
    return [distinct[i % len(distinct)] for i in range(settings.steps)]


def train(variant: str, settings: Settings, config, data, progress=None) -> RunResult:
    result = RunResult(variant)
    cuda = settings.device == "cuda"
    model = optimizer = forward = None
    try:
        model = _build_model(settings, config)
        _patch(variant, model)
        if variant == "onca":
            result.kernels = dict(getattr(model, "_onca_kernels", {}))
        if settings.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if settings.fsdp:
            _shard(model)
        model.train()
        forward = torch.compile(model) if settings.compile else model
        optimizer = torch.optim.AdamW(model.parameters(), lr=settings.lr, **({"fused": True} if cuda else {}))
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        for tokens in data:
            tokens = tokens.to(_device(settings))
            _sync(cuda)
            start = time.perf_counter()
            loss = forward(input_ids=tokens, labels=tokens).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            _sync(cuda)
            # Distributed: the slowest rank's step time, the loss averaged over the ranks' batches.
            result.step_ms.append(_across_ranks((time.perf_counter() - start) * 1e3, "max"))
            result.losses.append(_across_ranks(loss.item(), "avg"))
            if progress is not None:
                progress.update(1)
        if cuda:
            result.peak_mb = _across_ranks(torch.cuda.max_memory_allocated() / 2**20, "max")
    except ImportError as exc:
        result.error = f"not installed ({exc})"
    except torch.OutOfMemoryError as exc:
        result.error = f"out of memory: {str(exc).splitlines()[0][:120]}"
    except Exception as exc:  # one failing variant must not hide the others' results
        result.error = f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
    finally:
        if model is not None:
            _unpatch(variant, model)
        forward = None
        del model, optimizer, forward
        if cuda:
            torch.cuda.empty_cache()
    return result


def _sync(cuda: bool):
    if cuda:
        torch.cuda.synchronize()


def run(settings: Settings, show_progress: bool = True) -> tuple[list[RunResult], object]:
    check_settings(settings)
    config = build_config(settings)
    data = batches(settings, config.vocab_size)
    runnable = [v for v in settings.variants if v != "liger" or liger_installed()]
    bar = None
    if show_progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=settings.steps * len(runnable), desc="onca compare", unit="step", leave=False)
    results = []
    for variant in settings.variants:  # liger last: its patches are process-wide
        if variant not in runnable:
            results.append(RunResult(variant, error="not installed (pip install liger-kernel)"))
            continue
        if bar is not None:
            bar.set_postfix_str(variant)
        results.append(train(variant, settings, config, data, bar))
        if bar is None:  # a log still shows how far a run got if it is cut off
            print(f"onca compare: {variant} done ({results[-1].error or f'{len(results[-1].step_ms)} steps'})",
                  file=sys.stderr, flush=True)
    if bar is not None:
        bar.close()
    return results, config


def report(results: list[RunResult], settings: Settings, config) -> str:
    tokens = settings.batch * settings.seq
    base = results[0]
    lines = [
        f"{config.model_type} ({settings.preset if not os.path.isdir(settings.model) else settings.model}): "
        f"hidden {config.hidden_size}, {config.num_hidden_layers} layers, vocab {config.vocab_size}; "
        f"batch {settings.batch} x seq {settings.seq}, {str(settings.dtype).replace('torch.', '')}, AdamW, "
        f"gradient checkpointing {'on' if settings.gradient_checkpointing else 'off'}, "
        f"{'torch.compile, ' if settings.compile else ''}{settings.device}",
        "",
    ]
    if settings.fsdp:
        world = torch.distributed.get_world_size() if distributed() else 1
        lines.insert(1, f"FSDP2 (fully_shard per decoder layer and at the root) over {world} ranks, each with its "
                        "own batch: tokens/s and peak MB are per GPU (the slowest rank's step, the largest "
                        "peak); losses are averaged over the ranks")
    head = f"{'':14s}{'tokens/s':>12s}{'step ms':>10s}{'peak MB':>10s}{'final loss':>12s}{'speed':>8s}{'memory':>8s}"
    lines.append(head)
    for r in results:
        if not r.ok:
            lines.append(f"{r.variant:14s}{r.error}")
            continue
        tps = r.tokens_per_s(tokens, settings.warmup_steps)
        step = sum(r.timed_ms(settings.warmup_steps)) / max(1, len(r.timed_ms(settings.warmup_steps)))
        peak = f"{r.peak_mb:.0f}" if r.peak_mb is not None else "n/a"
        speed = f"{tps / base.tokens_per_s(tokens, settings.warmup_steps):7.2f}x" if base.ok else "      -"
        mem = f"{r.peak_mb / base.peak_mb:7.2f}x" if (r.peak_mb and base.ok and base.peak_mb) else "    n/a"
        lines.append(f"{r.variant:14s}{tps:12.0f}{step:10.1f}{peak:>10s}{r.losses[-1]:12.4f}{speed}{mem}")
    lines += ["", "loss per step:", f"{'step':>6s}" + "".join(f"{r.variant:>14s}" for r in results if r.ok)]
    ok = [r for r in results if r.ok]
    for i in range(settings.steps):
        lines.append(f"{i:6d}" + "".join(f"{r.losses[i]:14.4f}" for r in ok))
    onca_run = next((r for r in ok if r.variant == "onca"), None)
    if onca_run is not None:
        ran = ", ".join(f"{name} x{n}" for name, n in onca_run.kernels.items()) or "none"
        lines.append(f"Onca kernels in the patched model: {ran}")
        if settings.compile:
            from onca.integrations.transformers.patch import EAGER_BY_DEFAULT

            handed = ", ".join(sorted(EAGER_BY_DEFAULT & set(onca_run.kernels)))
            if handed:
                lines.append(f"  (compiled, {handed} run as the model's own code for inductor to fuse: "
                             "onca.apply's \"eager\" default)")
    if len(ok) > 1:
        worst = max(abs(a - b) for r in ok[1:] for a, b in zip(r.losses, ok[0].losses))
        lines.append(f"largest loss difference from {ok[0].variant}: {worst:.2e}")
    if settings.device != "cuda":
        lines.append("(CPU: kernels run under Triton's interpreter; timings here say nothing about GPU speed)")
    return "\n".join(lines)


def to_json(results: list[RunResult], settings: Settings, config) -> dict:
    """The comparison as one JSON object (what ``onca compare --output`` writes)."""
    tokens = settings.batch * settings.seq
    world = torch.distributed.get_world_size() if distributed() else 1
    gpu = torch.cuda.get_device_name() if settings.device == "cuda" else "cpu"
    return {
        "model_type": config.model_type, "preset": settings.preset, "hidden_size": config.hidden_size,
        "layers": config.num_hidden_layers, "vocab_size": config.vocab_size, "batch_per_gpu": settings.batch,
        "seq": settings.seq, "steps": settings.steps, "warmup_steps": settings.warmup_steps,
        "dtype": str(settings.dtype).replace("torch.", ""), "gradient_checkpointing": settings.gradient_checkpointing,
        "fsdp": settings.fsdp, "world_size": world, "gpu_name": gpu,
        "variants": {r.variant: ({"error": r.error} if not r.ok else {
            "tokens_per_s_per_gpu": r.tokens_per_s(tokens, settings.warmup_steps),
            "peak_mb_per_gpu": r.peak_mb, "step_ms": r.step_ms, "losses": r.losses}) for r in results},
    }


def plot(results: list[RunResult], settings: Settings, path: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in results if r.ok]
    fig, (ax_loss, ax_mem) = plt.subplots(1, 2, figsize=(11, 4), gridspec_kw={"width_ratios": [2, 1]})
    colors = {"huggingface": "#8d99ae", "onca": "#d1495b", "liger": "#edae49"}
    for r in ok:
        ax_loss.plot(range(len(r.losses)), r.losses, label=r.variant, color=colors.get(r.variant), lw=1.8,
                     ls="--" if r.variant != "huggingface" else "-")
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("loss")
    ax_loss.set_title("training loss")
    ax_loss.legend()
    ax_loss.grid(alpha=0.3)
    mems = [r for r in ok if r.peak_mb is not None]
    if mems:
        ax_mem.bar([r.variant for r in mems], [r.peak_mb / 1024 for r in mems],
                   color=[colors.get(r.variant) for r in mems])
        ax_mem.set_ylabel("peak memory (GB)")
        ax_mem.set_title("peak memory")
    else:
        ax_mem.text(0.5, 0.5, "no memory counters on the CPU", ha="center", va="center")
        ax_mem.set_axis_off()
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
