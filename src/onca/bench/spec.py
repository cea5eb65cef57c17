"""What an op's benchmark declares; the harness (``onca.bench.harness``) does the rest.

Each op has one module ``onca/bench/ops/<op>.py`` defining ``BENCHMARK = OpBenchmark(...)``:

- ``make_inputs(params, dtype, device)``: the input tensors of one point, as a dict; tensors that
  take gradients are leaves with ``requires_grad=True``.
- ``onca`` / ``reference`` / ``liger``: provider factories ``factory(params, inputs) -> run`` where
  ``run()`` computes the op on ``inputs`` and returns its output (a tensor or a tuple of tensors).
  Factories build modules and pick options outside the timed region. A factory that also takes
  ``mode`` is built for each mode (:func:`build`): e.g. to write gradients over inputs where the
  backward mode's repeated backward through one graph does not forbid it. ``reference`` is the plain
  PyTorch / Hugging Face computation; the harness times it as ``torch`` and, compiled, as
  ``torch_compile``. ``liger`` imports liger-kernel inside the factory; an ``ImportError`` marks
  the provider unavailable.
- ``peers``: other libraries' implementations of the same contract, by provider name (e.g.
  ``{"trl": factory}``: TRL's chunked log-prob function beside Onca's), timed and recorded like
  ``liger``; an ``ImportError`` in the factory marks the peer unavailable. A run includes every
  peer of the op unless its providers are named explicitly (``onca bench OP --providers ...``).
- ``sweeps``: D1 sweeps over one non-model dimension and a D2 sweep over the model registry. Every
  op also has an overhead sweep, derived from ``probe`` (16 tokens): a host-bound point, timed by
  wall clock over back-to-back calls, where each provider's Python and launch path is the cost.
- ``bytes_moved(params, dtype, mode)``: the fewest bytes the mode must move through memory (each
  input read once, each output written once), for achieved GB/s; ``flops(params, mode)`` for
  matmul-bound ops.
- ``memory_estimate(params, dtype, provider, mode)``: the peak bytes a provider needs for a mode,
  inputs included; the harness checks it against a small probe run before trusting it.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from onca.models import MODELS, ModelConfig

MODES = ("forward", "backward", "full")
SWEEP_KINDS = ("d1", "d2", "overhead")
# The overhead sweep's size: few enough tokens that every provider is bound by its host path.
OVERHEAD_TOKENS = 16
PROVIDERS = ("onca", "torch", "torch_compile", "liger")

Params = dict[str, Any]
Inputs = dict[str, torch.Tensor]
Factory = Callable[..., Callable[[], Any]]


def takes_mode(factory: Factory | None) -> bool:
    """Whether ``factory`` takes ``mode`` (``"forward"``, ``"backward"`` or ``"full"``)."""
    return factory is not None and "mode" in inspect.signature(factory).parameters


def build(factory: Factory, params: Params, inputs: Inputs, mode: str = "full") -> Callable[[], Any]:
    """The call to time: ``factory(params, inputs)``, with ``mode`` where the factory takes it."""
    return factory(params, inputs, mode=mode) if takes_mode(factory) else factory(params, inputs)


@dataclass(frozen=True)
class Sweep:
    """A list of points: ``(x value, params)`` pairs along one axis."""

    kind: str  # "d1", "d2" or "overhead"
    x_name: str
    x_label: str
    points: tuple[tuple[Any, Params], ...]

    def __post_init__(self):
        if self.kind not in SWEEP_KINDS:
            raise ValueError(f"Sweep.kind must be one of {', '.join(SWEEP_KINDS)}, got {self.kind!r}")


def d1(x_name: str, values, fixed: Params, x_label: str | None = None) -> Sweep:
    """Sweep one non-model dimension ``x_name`` over ``values`` with the other parameters fixed."""
    return Sweep("d1", x_name, x_label or x_name, tuple((v, {**fixed, x_name: v}) for v in values))


def d2(params_of: Callable[[ModelConfig], Params | None], models=None) -> Sweep:
    """Sweep real model configurations: ``params_of(model)`` gives the op's parameters, or None
    where the op does not apply to that model (e.g. GeGLU on a SiLU model)."""
    points = []
    for model in (models or MODELS.values()):
        params = params_of(model)
        if params is not None:
            points.append((model.name, {"model": model.name, **params}))
    return Sweep("d2", "model", "model", tuple(points))


@dataclass(frozen=True)
class OpBenchmark:
    name: str
    make_inputs: Callable[[Params, torch.dtype, Any], Inputs]
    onca: Factory
    reference: Factory
    sweeps: tuple[Sweep, ...]
    memory_estimate: Callable[[Params, torch.dtype, str, str], int]
    liger: Factory | None = None
    # Peer providers: other libraries' implementations, by provider name (not one of PROVIDERS).
    peers: dict[str, Factory] = field(default_factory=dict)
    bytes_moved: Callable[[Params, torch.dtype, str], int] | None = None
    flops: Callable[[Params, str], float] | None = None
    modes: tuple[str, ...] = MODES
    # A small point used to check memory estimates against a real run before a sweep.
    probe: Params = field(default_factory=dict)
    # Shown with every record: what is fixed about the configuration (options, layouts).
    config: str = ""
    # The call ``onca audit`` records in place of ``onca``, where the benchmark's call does not reach
    # every kernel of the op (None: ``onca``).
    audit: Factory | None = None

    def __post_init__(self):
        clash = [p for p in self.peers if p in PROVIDERS]
        if clash:
            raise ValueError(f"{self.name}: peer providers must not reuse the names {PROVIDERS}, got {clash}")

    @property
    def providers(self) -> tuple[str, ...]:
        """Every provider this benchmark can run: the harness's own, then its peers."""
        return PROVIDERS + tuple(self.peers)

    def sweep(self, kind: str) -> list[Sweep]:
        if kind == "overhead":
            return [self.overhead_sweep()]
        return [s for s in self.sweeps if s.kind == kind]

    def overhead_sweep(self) -> Sweep:
        """The probe's configuration cut to ``OVERHEAD_TOKENS`` tokens (or sequence positions)."""
        params = {k: (OVERHEAD_TOKENS if k in ("tokens", "seq") else v) for k, v in self.probe.items()}
        label = f"host-bound point ({OVERHEAD_TOKENS} tokens, wall clock)"
        return Sweep("overhead", "tokens", label, ((OVERHEAD_TOKENS, params),))


def itemsize(dtype: torch.dtype) -> int:
    return dtype.itemsize
