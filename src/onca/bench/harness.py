"""The benchmark harness: runs one op's declared benchmark for every available provider.

For each point of a sweep and each provider, the harness

1. estimates the provider's peak memory for each mode (the op's formula, corrected by a probe run
   at a small size) and skips what would not fit the device's free memory, recording the estimate;
2. times forward, backward and full (forward + backward) with the 20th, 50th and 80th percentiles
   (GPU: ``triton.testing.do_bench``, CUDA events, warm-up and an L2 flush before each repetition;
   the overhead sweep instead times back-to-back calls by wall clock, host path included, as a
   small training step experiences them). With ``Settings.rounds`` above 1, every provider of a
   point is timed again in that many rounds, the providers taking turns, and each keeps its fastest
   round: on a shared host the same call's time drifts by 2-3x over seconds at host-bound sizes,
   and a one-shot measurement taken during a slow spell would decide the ratio;
3. measures the peak memory of each mode (``torch.cuda.max_memory_allocated``, inputs included)
   and, once per point, its device time (the call captured in a CUDA graph and replayed under
   ``do_bench``: the GPU's time without the host path, ``Point.device_ms``);
4. turns bytes moved into GB/s and percent of the profile's peak and of the measured copy bandwidth,
   and FLOPs into TFLOP/s, where the op declares them.

An out-of-memory error is caught and recorded, and the sweep goes on. On the CPU the same code runs
once per sweep at the op's small probe size: a smoke test of the benchmark, not a measurement.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import importlib
import math
import pkgutil
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Callable

import torch

from onca.bench.records import Point, Record
from onca.bench.spec import MODES, PROVIDERS, OpBenchmark, Sweep, build, takes_mode
from onca.ops import _small_calls as small_calls

MB = 1 << 20
# Fraction of the free device memory a point may be estimated to use before it is skipped.
FIT_FRACTION = 0.9
# The note of a point where Onca's function called torch's op (onca.ops._small_calls).
SMALL_CALL_NOTE = "small call: torch's op"


def list_ops() -> list[str]:
    import onca.bench.ops

    return sorted(m.name for m in pkgutil.iter_modules(onca.bench.ops.__path__) if not m.name.startswith("_"))


def load(op: str) -> OpBenchmark:
    if op not in list_ops():
        raise ValueError(f"no benchmark for {op!r}; benchmarks: {', '.join(list_ops())}")
    return importlib.import_module(f"onca.bench.ops.{op}").BENCHMARK


def _version() -> str:
    import onca

    return onca.__version__


@dataclass
class Settings:
    device: str
    dtype: torch.dtype = torch.bfloat16
    providers: tuple[str, ...] = PROVIDERS
    # Also run every peer provider an op's benchmark declares (``OpBenchmark.peers``).
    peers: bool = True
    modes: tuple[str, ...] = MODES
    warmup_ms: int = 25
    rep_ms: int = 100
    # Timing rounds per point, the providers taking turns; each provider keeps its fastest round.
    rounds: int = 1
    # Also time each point's call replayed from a CUDA graph (its device time, the host left out).
    device_time: bool = True
    cpu_reps: int = 2
    # At most this many points per sweep (evenly spaced, the ends included); None: all of them.
    max_points: int | None = None
    # Only the points whose x value (a model name, a size) is one of these; None: every point.
    points: tuple[str, ...] | None = None

    @property
    def on_gpu(self) -> bool:
        return torch.device(self.device).type == "cuda"


@dataclass
class _ProviderState:
    available: bool = True
    note: str = ""
    # measured / estimated peak memory at the probe size, per mode (>= 1 after clamping)
    memory_ratio: dict[str, float] = field(default_factory=dict)


def provider_factory(bench: OpBenchmark, provider: str):
    """The factory of ``provider``'s run of ``bench`` (onca, torch, torch_compile, liger, or a peer
    the op declares), or None where this op has none."""
    if provider == "onca":
        return bench.onca
    if provider == "torch":
        return bench.reference
    if provider == "torch_compile":
        def compiled(params, inputs):
            import torch._inductor.config as inductor_config

            # Inductor compiles in this process: its pool of compile workers (one per core)
            # starts with the first compile and imports torch in every worker for seconds,
            # slowing every host-bound provider timed meanwhile (the first points of a sweep).
            inductor_config.compile_threads = 1
            torch._dynamo.reset()  # a fresh cache per point: no silent fall back to eager
            return torch.compile(bench.reference(params, inputs))

        return compiled
    if provider == "liger":
        return bench.liger
    # A peer of this op, or a peer another op declares (then: no implementation here).
    return bench.peers.get(provider)


class Harness:
    """Runs sweeps of one op; ``records`` accumulates what was measured."""

    def __init__(self, settings: Settings, progress: bool = True):
        self.settings = settings
        self.progress = progress
        self.records: list[Record] = []
        self._copy_gbps: float | None = None

    # ------------------------------------------------------------------------------ device facts

    @property
    def gpu_name(self) -> str:
        if self.settings.on_gpu:
            return torch.cuda.get_device_name(torch.device(self.settings.device))
        return "cpu"

    def copy_gbps(self) -> float | None:
        """Device-to-device copy bandwidth, bytes read plus written (measured once)."""
        if not self.settings.on_gpu:
            return None
        if self._copy_gbps is None:
            import triton.testing

            src = torch.empty(1 << 30, dtype=torch.uint8, device=self.settings.device)
            dst = torch.empty_like(src)
            ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=25, rep=200)
            self._copy_gbps = 2 * src.numel() / (ms * 1e-3) / 1e9
            del src, dst
            _free()
        return self._copy_gbps

    def free_bytes(self) -> int:
        from onca.device import free_memory

        return free_memory(self.settings.device)

    # ---------------------------------------------------------------------------------- sweeps

    def points(self, bench: OpBenchmark, sweep: Sweep):
        if self.settings.on_gpu:
            chosen = [pt for pt in sweep.points if self.settings.points is None or str(pt[0]) in self.settings.points]
            return subsample(chosen, self.settings.max_points)
        # CPU: one point at the op's probe size, through the very same code path.
        return [(bench.probe.get(sweep.x_name, "probe"), dict(bench.probe))]

    def providers(self, bench: OpBenchmark) -> tuple[str, ...]:
        """The providers a run of ``bench`` measures: the settings' own, then (with
        ``Settings.peers``) the peers the benchmark declares."""
        extra = tuple(p for p in bench.peers if p not in self.settings.providers) if self.settings.peers else ()
        return tuple(self.settings.providers) + extra

    def run(self, bench: OpBenchmark, sweeps: list[Sweep],
            on_point: Callable[[list[Record]], None] | None = None) -> list[Record]:
        """Measure every point of ``sweeps`` with each provider; ``on_point`` receives each
        (point, provider)'s records as soon as they are measured (a run cut short keeps them)."""
        with _heap_frozen():
            return self._run(bench, sweeps, on_point)

    def _run(self, bench, sweeps, on_point) -> list[Record]:
        from onca.device import get_profile

        profile = get_profile()
        providers = self.providers(bench)
        states = self._probe(bench)
        stamp = datetime.now(timezone.utc).isoformat(timespec="seconds")
        new_records: list[Record] = []
        work = [(sweep, x, params) for sweep in sweeps for x, params in self.points(bench, sweep)]
        bar = _progress(len(work) * len(providers), f"bench {bench.name}", self.progress)
        # Points with the same parameters (models sharing a hidden size, a D1 point that is also a
        # D2 point) are measured once and reported under each x.
        measured: dict[tuple, dict] = {}
        for sweep in sweeps:
            sweep_work = [w for w in work if w[0] is sweep]
            if not sweep_work:  # none of its points chosen (--points names another sweep's): no records
                continue
            records = self._records_for(bench, sweep, stamp)
            for _, x, params in sweep_work:
                key = (sweep.kind == "overhead",
                       tuple(sorted((k, repr(v)) for k, v in params.items() if k != "model")))
                fresh = [p for p in providers if (p, key) not in measured]
                last = self.settings.rounds - 1
                for round_ in range(self.settings.rounds):
                    for provider in providers:
                        bar.set_postfix_str(f"{sweep.x_name}={x} {provider}")
                        if provider in fresh and round_ == 0:
                            measured[(provider, key)] = self._run_point(bench, provider, states[provider], params,
                                                                        x, profile, wall_clock=key[0])
                        elif provider in fresh and _all_timed(measured[(provider, key)]):
                            again = self._run_point(bench, provider, states[provider], params, x, profile,
                                                    wall_clock=key[0], memory=False)
                            measured[(provider, key)] = _fastest(measured[(provider, key)], again)
                        if round_ == last:  # each provider's records as soon as they are final
                            _report(records, measured[(provider, key)], provider, x, on_point)
                            bar.update(1)
            new_records.extend(records.values())
        bar.close()
        self.records.extend(new_records)
        return new_records

    def _records_for(self, bench, sweep, stamp) -> dict[tuple, Record]:
        records = {}
        for provider in self.providers(bench):
            for metric, unit in (("speed", "ms"), ("memory", "MB")):
                for mode in self.settings.modes:
                    records[(provider, metric, mode)] = Record(
                        kernel_name=bench.name, kernel_provider=provider, metric_name=metric,
                        metric_unit=unit, gpu_name=self.gpu_name, x_name=sweep.x_name,
                        x_label=sweep.x_label, timestamp=stamp, kernel_operation_mode=mode,
                        extra_benchmark_config_str=bench.config, onca_version=_version(),
                        sweep=sweep.kind, dtype=str(self.settings.dtype).replace("torch.", ""),
                    )
        return records

    # -------------------------------------------------------------------------------- a point

    def _run_point(self, bench, provider, state, params, x, profile, wall_clock=False,
                   memory=True) -> dict[tuple, Point]:
        """One provider at one point: ``{(metric, mode): Point}``; ``memory=False`` (a later timing
        round) times the modes and leaves the memory out."""
        modes = [m for m in self.settings.modes if m in bench.modes]
        out: dict[tuple, Point] = {}
        if not state.available:
            for mode in modes:
                for metric in ("speed", "memory"):
                    out[(metric, mode)] = Point(x, status="unavailable", note=state.note)
            return out
        free = self.free_bytes()
        inputs = run = None
        try:
            for mode in modes:
                estimate = bench.memory_estimate(params, self.settings.dtype, provider, mode)
                estimate *= state.memory_ratio.get(mode, 1.0)
                est_mb = estimate / MB
                if estimate > FIT_FRACTION * free:
                    note = f"estimated {est_mb:.0f} MB > {FIT_FRACTION:.0%} of {free / MB:.0f} MB free"
                    for metric in ("speed", "memory"):
                        out[(metric, mode)] = Point(x, status="skipped", note=note, estimate_mb=est_mb)
                    continue
                try:
                    if inputs is None:
                        inputs = bench.make_inputs(params, self.settings.dtype, self.settings.device)
                        factory = provider_factory(bench, provider)
                    if run is None or takes_mode(factory):
                        # Built once per point (modules, options and torch.compile's graph), or once
                        # per mode by a factory that takes the mode.
                        run = build(factory, params, inputs, mode)
                    taken = small_calls.taken
                    speed, peak, device = self._measure(run, inputs, mode, wall_clock, memory)
                    small = small_calls.taken != taken
                except torch.OutOfMemoryError as exc:
                    inputs = run = None
                    _free()
                    note = f"out of memory: {str(exc).splitlines()[0][:160]}"
                    for metric in ("speed", "memory"):
                        out[(metric, mode)] = Point(x, status="oom", note=note, estimate_mb=est_mb)
                    continue
                except Exception as exc:  # one failing provider must not end the sweep
                    note = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
                    for metric in ("speed", "memory"):
                        out[(metric, mode)] = Point(x, status="error", note=note, estimate_mb=est_mb)
                    continue
                p50, p20, p80 = speed
                point = Point(x, p50, p20, p80, estimate_mb=est_mb, device_ms=device,
                              note=SMALL_CALL_NOTE if small else "")
                self._rates(point, bench, params, mode, profile)
                out[("speed", mode)] = point
                if not memory:
                    continue
                if peak is None:
                    out[("memory", mode)] = Point(x, status="unmeasured", note="no memory counters on the CPU",
                                                  estimate_mb=est_mb)
                else:
                    out[("memory", mode)] = Point(x, peak, peak, peak, estimate_mb=est_mb, note=point.note)
        finally:
            del inputs, run
            _free()
        return out

    def _rates(self, point: Point, bench, params, mode, profile) -> None:
        seconds = point.y50 * 1e-3
        if bench.bytes_moved is not None and seconds > 0:
            gbps = bench.bytes_moved(params, self.settings.dtype, mode) / seconds / 1e9
            point.gbps = gbps
            if profile.peak_gbps:
                point.pct_of_peak = 100 * gbps / profile.peak_gbps
            copy = self.copy_gbps()
            if copy:
                point.pct_of_copy = 100 * gbps / copy
        if bench.flops is not None and seconds > 0:
            point.tflops = bench.flops(params, mode) / seconds / 1e12

    # ---------------------------------------------------------------------------- measuring

    def _measure(self, run, inputs, mode, wall_clock=False, memory=True):
        """``((p50, p20, p80) ms, peak MB or None, device ms or None)``; the peak memory and the
        device time only with ``memory`` (a point's first round: neither drifts between rounds)."""
        leaves = _leaves(inputs)
        speed = self._time_mode(run, leaves, mode, wall_clock)
        # The timing closure (and any graph it kept) is gone before memory is measured.
        peak = self._peak_memory(run, mode, inputs) if memory else None
        device = self._device_ms(run, leaves, mode) if memory else None
        return speed, peak, device

    def _time_mode(self, run, leaves, mode, wall_clock=False):
        timed = self._step(run, leaves, mode)
        timed()  # warm-up outside the timed region: compilation, autotuning, allocator growth
        if wall_clock and self.settings.on_gpu:
            return self._time_back_to_back(timed)
        return self._time(timed, leaves)

    @staticmethod
    def _step(run, leaves, mode):
        """One call of ``mode`` as it is timed: forward; backward through one kept graph; or a
        forward and its backward. Leaves' gradients are cleared first."""
        for t in leaves:
            t.grad = None
        if mode == "forward":
            fn = run
        elif mode == "backward":
            outs, grads = _outputs_and_grads(run())

            def fn():
                torch.autograd.backward(outs, grads, retain_graph=True)
        elif mode == "full":
            grads = _outputs_and_grads(run())[1]  # the first outputs (and graph) die here

            def fn():
                outs, _ = _outputs_and_grads(run(), make_grads=False)
                torch.autograd.backward(outs, grads)
        else:
            raise ValueError(f"unknown mode {mode!r}")
        def timed():
            # Gradients never accumulate across calls (do_bench clears them only in its timed loop,
            # not while it warms up): as zero_grad(set_to_none=True) does between training steps.
            for t in leaves:
                t.grad = None
            return fn()

        return timed

    def _device_ms(self, run, leaves, mode) -> float | None:
        """The median GPU time of a call of ``mode`` without its host path: the call captured once
        in a CUDA graph, then replayed under ``do_bench`` (an L2 flush before each replay, CUDA
        events). At sizes where a call is bound by its Python and launches, this says whose kernels
        are faster. None where the call cannot be captured (a peer that reads a device value on the
        host), off a GPU, and with ``Settings.device_time`` off."""
        if not (self.settings.on_gpu and self.settings.device_time):
            return None
        import triton.testing

        graph = None
        try:
            # Warm-up off the default stream, as torch.cuda.graphs asks, and the capture on that
            # same stream: autograd runs each backward op on its forward op's stream, so the
            # backward mode's forward (run once, outside the capture) must be on the capturing
            # stream, or its backward launches on the default stream and the capture fails.
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                step = self._step(run, leaves, mode)
                step()
                synchronises = _synchronises(step)
            torch.cuda.current_stream().wait_stream(side)
            if synchronises:
                # Never start a capture that must fail: a failed capture leaves torch's CUDA random
                # generator in capture mode, and every later torch.randn raises "Offset increment
                # outside graph capture" (the rest of a sweep's inputs could not be made).
                return None
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=side, capture_error_mode="thread_local"):
                step()
            ms = triton.testing.do_bench(graph.replay, warmup=self.settings.warmup_ms,
                                         rep=self.settings.rep_ms, return_mode="median")
            return float(ms)
        except Exception:  # noqa: BLE001 (not capturable: the time a caller sees still stands)
            return None
        finally:
            for t in leaves:
                t.grad = None  # the captured gradients live in the graph's memory pool
            del graph
            _free()

    def _time_back_to_back(self, fn, calls: int = 200, repeats: int = 7):
        """Milliseconds per call of ``calls`` calls issued back to back, then one synchronisation:
        at host-bound sizes this is the host path's cost, which event timing of one call hides."""
        times = []
        for _ in range(repeats):
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            torch.cuda.synchronize()
            times.append((time.perf_counter() - start) * 1e3 / calls)
        return percentiles(times)

    def _time(self, fn, leaves):
        if self.settings.on_gpu:
            import triton.testing

            q = triton.testing.do_bench(fn, warmup=self.settings.warmup_ms, rep=self.settings.rep_ms,
                                        grad_to_none=leaves or None, quantiles=[0.5, 0.2, 0.8])
            return tuple(float(v) for v in q)
        times = []
        for _ in range(self.settings.cpu_reps):
            for t in leaves:
                t.grad = None
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        return percentiles(times)

    def _peak_memory(self, run, mode, inputs):
        if not self.settings.on_gpu:
            return None
        for t in _leaves(inputs):
            t.grad = None
        _free()
        torch.cuda.synchronize()
        # Allocated now: the inputs, and whatever another provider's global state still holds (a
        # peer's autotuner keeps the arguments of a launch that failed, 1 GB at DyT's 65536-token
        # point, until its next call); only the inputs count towards this point's peak.
        elsewhere = torch.cuda.memory_allocated() - _tensor_bytes(inputs.values())
        if mode == "forward":
            torch.cuda.reset_peak_memory_stats()
            result = run()
            del result
        elif mode == "backward":
            # The forward's saved tensors are part of the backward's footprint: build them first.
            outs, grads = _outputs_and_grads(run())
            torch.cuda.reset_peak_memory_stats()
            torch.autograd.backward(outs, grads)
            del outs, grads
        else:
            grads = _outputs_and_grads(run())[1]
            _free()
            torch.cuda.reset_peak_memory_stats()
            outs, _ = _outputs_and_grads(run(), make_grads=False)
            torch.autograd.backward(outs, grads)
            del outs, grads
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - elsewhere) / MB

    # ------------------------------------------------------------------------------- probing

    def _probe(self, bench: OpBenchmark) -> dict[str, _ProviderState]:
        """Check availability and calibrate memory estimates at the op's small probe size."""
        states = {}
        for provider in self.providers(bench):
            state = _ProviderState()
            factory = provider_factory(bench, provider)
            if factory is None:
                state.available, state.note = False, f"{bench.name} has no {provider} implementation"
                states[provider] = state
                continue
            inputs = None
            try:
                inputs = bench.make_inputs(bench.probe, self.settings.dtype, self.settings.device)
                run = build(factory, bench.probe, inputs)
                if self.settings.on_gpu:
                    for mode in self.settings.modes:
                        if mode not in bench.modes:
                            continue
                        if takes_mode(factory):
                            run = build(factory, bench.probe, inputs, mode)
                        leaves = _leaves(inputs)
                        self._step(run, leaves, mode)()  # compilation and autotuning first
                        measured = self._peak_memory(run, mode, inputs)
                        estimate = bench.memory_estimate(bench.probe, self.settings.dtype, provider, mode)
                        state.memory_ratio[mode] = calibration(measured * MB, estimate)
            except ImportError as exc:
                state.available, state.note = False, f"not installed ({exc.name or exc})"
            except Exception as exc:
                state.available = False
                state.note = f"probe failed: {type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
            finally:
                del inputs
                _free()
            states[provider] = state
        return states


def _report(records: dict[tuple, Record], point: dict[tuple, Point], provider: str, x, on_point) -> None:
    """Add one provider's points at ``x`` to the sweep's ``records`` and hand them to ``on_point``."""
    done = []
    for (metric, mode), p in point.items():
        p = dataclasses.replace(p, x=x)
        records[(provider, metric, mode)].points.append(p)
        done.append(dataclasses.replace(records[(provider, metric, mode)], points=[p]))
    if on_point is not None:
        on_point(done)


def _all_timed(point: dict[tuple, Point]) -> bool:
    """Whether every mode of a provider's point was timed (not skipped, out of memory or failed)."""
    return all(p.status == "ok" for (metric, _), p in point.items() if metric == "speed")


def _fastest(first: dict[tuple, Point], again: dict[tuple, Point]) -> dict[tuple, Point]:
    """``first`` with each speed point replaced by ``again``'s where that round was faster (the
    first round's device time kept: later rounds do not measure it)."""
    out = dict(first)
    for key, p in again.items():
        if key[0] == "speed" and p.status == "ok" and p.y50 < first[key].y50:
            out[key] = dataclasses.replace(p, device_ms=first[key].device_ms)
    return out


def _tensor_bytes(values) -> int:
    """Bytes of the distinct storages of the tensors among ``values``."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in values if isinstance(t, torch.Tensor)}
    return sum(storages.values())


def _leaves(inputs: dict) -> list:
    return [t for t in inputs.values() if isinstance(t, torch.Tensor) and t.requires_grad]


def subsample(points: list, limit: int | None) -> list:
    """``limit`` evenly spaced points, the first and the last included (all of them if ``limit`` is
    None or not smaller)."""
    if limit is None or limit >= len(points):
        return points
    if limit <= 1:
        return points[:1]
    step = (len(points) - 1) / (limit - 1)
    return [points[round(i * step)] for i in range(limit)]


def calibration(measured_bytes: float, estimated_bytes: float) -> float:
    """The factor applied to a provider's estimates after its probe run: measured over estimated,
    only ever upwards (an estimate that was too high stays, it only skips more) and at most 4x (the
    formula is the model; a probe dominated by fixed costs must not inflate large points)."""
    return min(4.0, max(1.0, measured_bytes / max(estimated_bytes, 1.0)))


def _outputs_and_grads(result, make_grads: bool = True):
    """The differentiable tensors of a provider's result, and a gradient for each."""
    items = result if isinstance(result, (tuple, list)) else (result,)
    outs = tuple(t for t in items if isinstance(t, torch.Tensor) and t.requires_grad)
    if not outs:
        raise RuntimeError("the provider's result has no tensor that requires grad")
    if not make_grads:
        return outs, None
    grads = tuple(torch.ones_like(t) if t.dim() == 0 else torch.randn_like(t) for t in outs)
    return outs, grads


def percentiles(values) -> tuple[float, float, float]:
    """(50th, 20th, 80th) percentiles with linear interpolation."""
    data = sorted(float(v) for v in values)
    if not data:
        return (math.nan,) * 3

    def q(frac):
        pos = frac * (len(data) - 1)
        lo, hi = math.floor(pos), math.ceil(pos)
        return data[lo] + (data[hi] - data[lo]) * (pos - lo)

    return q(0.5), q(0.2), q(0.8)


def _synchronises(step) -> bool:
    """Whether ``step()`` waits for the GPU on the host (``.item()``, a device-to-host copy): run
    once under torch's sync debug mode, which raises on such a call."""
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    except RuntimeError:
        return True
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    return False


@contextlib.contextmanager
def _heap_frozen():
    """The objects alive when a run starts are left out of the garbage collector's scans until it
    ends (``gc.freeze``): a run collects eight times per point and provider (``_free``, so that
    cyclic garbage holding device memory is gone before the next measurement), and a full
    collection scans the whole heap of torch, Triton and the benchmarks: 0.28 s each on an H200
    host, 2.2 of the 3.5 s of a LayerNorm point (cProfile, 2026-11-27). The garbage is always the
    run's own, which is still collected."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _free():
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


class _LineLog:
    """Without a progress bar (``--no-progress``, or no tqdm): one line per finished run, with its
    time, so that a run cut off by a time limit still shows how far it got and where time went.
    A run's time is its own over every round (the seconds between its ``set_postfix_str`` and the
    next one's): with several rounds the providers take turns, and timing from one finished run to
    the next gave the first provider the whole first round of every provider."""

    def __init__(self, desc):
        self.desc, self.what, self.start = desc, "", time.monotonic()
        self.spent: dict[str, float] = {}

    def _close_interval(self):
        now = time.monotonic()
        if self.what:  # "" after a finished run: nothing is running
            self.spent[self.what] = self.spent.get(self.what, 0.0) + now - self.start
        self.start = now

    def update(self, n=1):
        self._close_interval()
        print(f"{self.desc} {self.what}: {self.spent.pop(self.what, 0.0):.1f} s", flush=True)
        self.what = ""

    def set_postfix_str(self, s):
        self._close_interval()
        self.what = s

    def close(self):
        pass


def _progress(total, desc, enabled):
    if not enabled:
        return _LineLog(desc)
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return _LineLog(desc)
    return tqdm(total=total, desc=desc, unit="run", leave=False)
