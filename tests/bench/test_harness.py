"""The benchmark harness's logic, on the CPU: schema, percentiles, memory estimates and skipping,
OOM handling, CSV append, charts and the model registry (every op's declaration: test_declarations.py)."""

from __future__ import annotations

import gc
import importlib
import json
import math
import weakref

import pytest
import torch

from onca.bench import harness, plot, records, report
from onca.models import MODELS, get_model
from onca.bench.spec import OpBenchmark, Sweep, build, d1, d2

SCHEMA = {
    "kernel_name", "kernel_provider", "metric_name", "metric_unit", "gpu_name", "x_name", "x_label",
    "x_values", "y_values_50", "y_values_20", "y_values_80", "timestamp", "kernel_operation_mode",
    "extra_benchmark_config_str", "onca_version",
}


def toy_benchmark(memory=lambda p, dtype, provider, mode: 1024, onca=None, liger=None) -> OpBenchmark:
    def make_inputs(p, dtype, device):
        return {"x": torch.randn(p["n"], 8, dtype=dtype, device=device, requires_grad=True)}

    def scale(p, inputs):
        return lambda: inputs["x"] * 2.0

    return OpBenchmark(
        name="toy", make_inputs=make_inputs, onca=onca or scale, reference=scale, liger=liger,
        sweeps=(d1("n", [4, 8], {}), d2(lambda m: {"n": 4} if m.name == "qwen3-0.6b" else None)),
        memory_estimate=memory, bytes_moved=lambda p, dtype, mode: 2 * p["n"] * 8 * 4, probe={"n": 4},
        config="toy",
    )


def cpu_harness(**kw) -> harness.Harness:
    settings = harness.Settings(device="cpu", dtype=torch.float32, providers=("onca", "torch", "liger"), **kw)
    return harness.Harness(settings, progress=False)


def by(records_, provider, metric, mode):
    return next(r for r in records_ if (r.kernel_provider, r.metric_name, r.kernel_operation_mode)
                == (provider, metric, mode))


def test_percentiles():
    assert harness.percentiles([5, 1, 3, 2, 4]) == (3.0, 1.8, 4.2)
    assert harness.percentiles([7.0]) == (7.0, 7.0, 7.0)
    assert all(math.isnan(v) for v in harness.percentiles([]))


def test_a_factory_that_takes_the_mode_is_built_for_each_mode():
    """A factory with ``mode`` is called once per mode with that mode (the others once per point),
    so an op can write gradients over its inputs in the full mode but not in the backward mode,
    which backpropagates through one graph again and again."""
    built = []

    def per_mode(p, inputs, mode):
        built.append(mode)
        return lambda: inputs["x"] * 2.0

    bench = toy_benchmark(onca=per_mode)
    cpu_harness().run(bench, [bench.sweeps[0]])
    # The probe's availability check, then the one point a CPU run takes.
    assert built == ["full", *harness.MODES]
    assert build(per_mode, {}, {"x": torch.ones(1)}, "backward") is not None and built[-1] == "backward"


@pytest.mark.parametrize("op", ["swiglu", "geglu"])
def test_gated_activations_write_gradients_over_their_inputs_outside_the_backward_mode(op, device):
    """In the full mode Onca reuses ``a``/``b`` for their gradients, as liger-kernel and the patched
    MLPs do (the memory comparison is like for like); the backward mode keeps them."""
    bench = harness.load(op)
    for mode, overwrites in (("full", True), ("backward", False)):
        inputs = bench.make_inputs({"tokens": 4, "intermediate": 8}, torch.float32, device)
        a = inputs["a"]
        out = build(bench.onca, {}, inputs, mode)()
        out.backward(torch.ones_like(out))
        assert (a.grad.data_ptr() == a.data_ptr()) is overwrites, mode


def test_rounds_time_the_providers_in_turns_and_keep_each_ones_fastest(monkeypatch):
    """Round after round every provider is timed again, in turn, and keeps its fastest median; the
    memory is measured once. A provider that failed in the first round is not run again."""
    order, times = [], iter([5.0, 9.0, 4.0, 1.0, 3.0, 3.0, 3.0, 3.0])

    def timed(self, run, leaves, mode, wall_clock=False):
        order.append(run())
        t = next(times)
        return t, t, t

    def failing(p, inputs):
        def run():
            order.append("liger")
            raise RuntimeError("no kernel")

        return run

    monkeypatch.setattr(harness.Harness, "_time_mode", timed)
    bench = toy_benchmark(onca=lambda p, inputs: lambda: "onca")
    bench = OpBenchmark(**{**bench.__dict__, "reference": lambda p, inputs: lambda: "torch", "liger": failing})
    settings = harness.Settings(device="cpu", dtype=torch.float32, providers=("onca", "torch", "liger"),
                                modes=("full",), rounds=4, max_points=1)
    new = harness.Harness(settings, progress=False).run(bench, [bench.sweeps[0]])
    assert order == ["onca", "torch", "liger"] + ["onca", "torch"] * 3
    assert by(new, "onca", "speed", "full").points[0].y50 == 3.0  # 5, 4, 3, 3
    assert by(new, "torch", "speed", "full").points[0].y50 == 1.0  # 9, 1, 3, 3
    assert by(new, "liger", "speed", "full").points[0].status == "error"
    assert len(by(new, "onca", "memory", "full").points) == 1


def test_the_compiled_provider_compiles_without_a_worker_pool(monkeypatch):
    """Building the ``torch_compile`` provider turns inductor's compile workers off, so their start
    (a torch import in every worker) never competes with the host-bound providers being timed."""
    import torch._inductor.config as inductor_config

    monkeypatch.setattr(inductor_config, "compile_threads", 8)
    bench = toy_benchmark()
    compiled = harness.provider_factory(bench, "torch_compile")
    run = compiled({"n": 4}, bench.make_inputs({"n": 4}, torch.float32, "cpu"))
    assert callable(run) and inductor_config.compile_threads == 1


def test_records_follow_the_schema():
    h = cpu_harness()
    new = h.run(toy_benchmark(), [toy_benchmark().sweeps[0]])
    # One record per (provider, metric, mode): 3 providers x 2 metrics x 3 modes.
    assert len(new) == 18
    for r in new:
        obj = r.to_json()
        assert SCHEMA <= set(obj), SCHEMA - set(obj)
        assert len(obj["x_values"]) == len(obj["y_values_50"]) == len(obj["y_values_80"])
        json.dumps(obj)  # serialisable
    speed = by(new, "onca", "speed", "forward").points[0]
    assert speed.status == "ok" and speed.y20 <= speed.y50 <= speed.y80 and speed.gbps > 0
    # liger has no implementation in the toy: recorded as unavailable, not an error.
    assert by(new, "liger", "speed", "full").points[0].status == "unavailable"
    # No memory counters on the CPU: said so, not made up.
    assert by(new, "onca", "memory", "full").points[0].status == "unmeasured"


def test_points_that_cannot_fit_are_skipped_with_their_estimate(monkeypatch):
    huge = lambda p, dtype, provider, mode: (1 << 50) if provider == "torch" else 1024  # noqa: E731
    h = cpu_harness()
    monkeypatch.setattr(h, "free_bytes", lambda: 1 << 30)
    new = h.run(toy_benchmark(memory=huge), [toy_benchmark().sweeps[0]])
    skipped = by(new, "torch", "speed", "full").points[0]
    assert skipped.status == "skipped" and skipped.estimate_mb == (1 << 50) / (1 << 20)
    assert "MB free" in skipped.note
    assert by(new, "onca", "speed", "full").points[0].status == "ok"


def test_out_of_memory_is_recorded_and_the_sweep_goes_on():
    calls = []

    def flaky(p, inputs):
        def run():
            calls.append(1)
            if len(calls) == 1:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1 TiB")
            return inputs["x"] * 2.0

        return run

    h = cpu_harness(modes=("forward",))
    new = h.run(toy_benchmark(onca=flaky), [toy_benchmark().sweeps[0]])
    first = by(new, "onca", "speed", "forward").points[0]
    assert first.status == "oom" and "out of memory" in first.note
    assert by(new, "torch", "speed", "forward").points[0].status == "ok"


def test_errors_are_recorded_not_raised():
    def broken(p, inputs):
        def run():
            raise RuntimeError("kernel exploded")

        return run

    new = cpu_harness(modes=("forward",)).run(toy_benchmark(onca=broken), [toy_benchmark().sweeps[0]])
    point = by(new, "onca", "speed", "forward").points[0]
    assert point.status == "error" and "kernel exploded" in point.note


def test_a_run_scans_only_its_own_objects_for_garbage_and_still_frees_its_cycles():
    """The heap alive before a run is frozen during it (a full collection took 0.28 s on a GPU host,
    eight per point and provider) and thawed after; a cycle the run made is collected within it."""
    frozen_while_building, frozen_when_freed = [], []

    class Node:
        pass

    def cyclic(p, inputs):
        node = Node()
        node.self, node.tensor = node, torch.ones(4)
        weakref.finalize(node, lambda: frozen_when_freed.append(gc.get_freeze_count()))
        frozen_while_building.append(gc.get_freeze_count())
        return lambda: inputs["x"] * 2.0

    cpu_harness(modes=("forward",)).run(toy_benchmark(onca=cyclic), [toy_benchmark().sweeps[0]])
    assert frozen_while_building and min(frozen_while_building) > 0
    assert frozen_when_freed and min(frozen_when_freed) > 0  # collected during the run
    assert gc.get_freeze_count() == 0


def test_the_line_log_gives_each_run_its_own_seconds_over_the_rounds(monkeypatch, capsys):
    """Two providers, two rounds: each line is the provider's own time in both rounds (the first
    provider's line once held the whole first round of both)."""
    clock = iter([0.0, 1.0, 3.0, 4.0, 4.5, 5.0, 8.0])
    monkeypatch.setattr(harness.time, "monotonic", lambda: next(clock))
    log = harness._LineLog("bench toy")  # 0
    log.set_postfix_str("n=4 onca")  # 1
    log.set_postfix_str("n=4 torch")  # 3: onca's first round, 2 s
    log.set_postfix_str("n=4 onca")  # 4: torch's first round, 1 s
    log.update()  # 4.5: onca's second round, 0.5 s
    log.set_postfix_str("n=4 torch")  # 5: between the two, no one's
    log.update()  # 8: torch's second round, 3 s
    assert capsys.readouterr().out.splitlines() == ["bench toy n=4 onca: 2.5 s", "bench toy n=4 torch: 4.0 s"]


def test_memory_calibration_only_corrects_upwards_and_within_reason():
    assert harness.calibration(100, 200) == 1.0
    assert harness.calibration(300, 200) == 1.5
    assert harness.calibration(10_000, 200) == 4.0


def test_csv_append_plot_and_latest(tmp_path):
    rec = records.Record("toy", "onca", "speed", "ms", "NVIDIA H200", "n", "n", "2026-01-01T00:00:00+00:00",
                         "full", "toy", "0.1", "d1", "bfloat16",
                         [records.Point(4, 1.0, 0.9, 1.1), records.Point(8, 2.0, 1.9, 2.1)])
    newer = records.Record(**{**rec.__dict__, "timestamp": "2026-02-01T00:00:00+00:00",
                              "points": [records.Point(4, 0.5, 0.4, 0.6)]})
    path = tmp_path / "results.csv"
    assert records.append_csv(str(path), [rec]) == 2
    assert records.append_csv(str(path), [newer]) == 1
    lines = path.read_text().splitlines()
    assert lines[0].startswith("kernel_name,") and len(lines) == 4  # one header, three rows
    rows = records.latest(records.read_csv(str(path)))
    assert sorted((r["x_value"], r["y_value_50"]) for r in rows) == [("4", 0.5), ("8", 2.0)]
    pngs = plot.plot_csv(str(path), str(tmp_path / "plots"))
    assert len(pngs) == 1 and pngs[0].endswith(".png")
    with open(pngs[0], "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_a_csv_from_before_a_new_column_is_rewritten_under_the_new_header(tmp_path):
    """Rows appended to a results file written before ``device_ms`` existed line up with a header
    that has it (the old rows keep every value and get an empty device time); JSON and CSV carry
    the device time of a point."""
    path = tmp_path / "results.csv"
    old_fields = [f for f in records.CSV_FIELDS if f != "device_ms"]
    old_row = {f: "" for f in old_fields}
    old_row.update(kernel_name="toy", kernel_provider="torch", metric_name="speed", x_value="4",
                   y_value_50="3.0", timestamp="2026-01-01", sweep="d1", pct_of_copy="40.0")
    path.write_text(",".join(old_fields) + "\n" + ",".join(old_row[f] for f in old_fields) + "\n")
    rec = records.Record("toy", "onca", "speed", "ms", "H100", "n", "n", "2026-02-01", "full", "toy", "0.1",
                         "d1", "bfloat16", [records.Point(4, 1.0, 0.9, 1.1, device_ms=0.25)])
    assert records.append_csv(str(path), [rec]) == 1
    rows = records.read_csv(str(path))
    assert path.read_text().splitlines()[0] == ",".join(records.CSV_FIELDS)
    assert [(r["kernel_provider"], r["y_value_50"]) for r in rows] == [("torch", 3.0), ("onca", 1.0)]
    assert rows[0]["pct_of_copy"] == 40.0 and math.isnan(rows[0]["device_ms"])
    assert rows[1]["device_ms"] == 0.25
    records.write_json(str(tmp_path / "toy.json"), [rec])
    assert records.read_json(str(tmp_path / "toy.json"))[0].points[0].device_ms == 0.25


def test_peak_memory_counts_the_inputs_once_whatever_their_views():
    """The inputs' bytes subtracted from what is allocated (the rest belongs to another provider's
    leftovers) are their distinct storages: a view of an input is not counted twice."""
    base = torch.zeros(64, 8)
    values = [base, base.t(), base[1:], torch.zeros(10, dtype=torch.float16), "not a tensor"]
    assert harness._tensor_bytes(values) == 64 * 8 * 4 + 10 * 2


def test_the_device_time_of_a_points_first_round_is_kept(monkeypatch):
    """Each provider's device time is measured once, in a point's first round, and stays with the
    point when a later round's faster wall-clock time replaces it."""
    assert cpu_harness()._device_ms(lambda: None, [], "forward") is None  # no GPU: not measured
    times, devices = iter([5.0, 9.0, 4.0, 1.0]), iter([0.5, 0.75])

    def timed(self, run, leaves, mode, wall_clock=False):
        t = next(times)
        return t, t, t

    monkeypatch.setattr(harness.Harness, "_time_mode", timed)
    monkeypatch.setattr(harness.Harness, "_device_ms", lambda self, run, leaves, mode: next(devices))
    bench = toy_benchmark()
    settings = harness.Settings(device="cpu", dtype=torch.float32, providers=("onca", "torch"),
                                modes=("full",), rounds=2, max_points=1)
    new = harness.Harness(settings, progress=False).run(bench, [bench.sweeps[0]])
    onca, ref = by(new, "onca", "speed", "full").points[0], by(new, "torch", "speed", "full").points[0]
    assert (onca.y50, onca.device_ms) == (4.0, 0.5) and (ref.y50, ref.device_ms) == (1.0, 0.75)



@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_a_call_that_synchronises_gets_no_device_time_and_breaks_nothing_after_it():
    """A peer that reads a device value on the host (liger-kernel's cross entropy counts its
    targets with ``.item()``) cannot be captured: its device time is None, and the random inputs of
    the next point can still be made (a capture started and failed left torch's CUDA generator in
    capture mode: every later ``torch.randn`` raised, and a whole sweep after one such peer failed)."""
    settings = harness.Settings(device="cuda", dtype=torch.float32, providers=("onca",))
    h = harness.Harness(settings, progress=False)
    x = torch.randn(64, device="cuda", requires_grad=True)
    assert h._device_ms(lambda: x * float(x.sum()), [x], "full") is None
    assert torch.randn(8, device="cuda").shape == (8,)
    assert h._device_ms(lambda: x * 2.0, [x], "full") > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("mode", ["forward", "backward", "full"])
def test_every_mode_of_an_op_gets_its_device_time_and_breaks_nothing_after_it(mode):
    """Each mode of a Triton op is captured: the backward mode's forward runs outside the capture,
    and autograd launches each backward kernel on its forward's stream, so that forward must be on
    the capturing stream (on the default stream the capture failed, and every point of a sweep
    after it raised "Offset increment outside graph capture")."""
    from onca.ops.rms_norm import rms_norm

    settings = harness.Settings(device="cuda", dtype=torch.float32, providers=("onca",))
    h = harness.Harness(settings, progress=False)
    x = torch.randn(256, 512, device="cuda", requires_grad=True)
    w = torch.ones(512, device="cuda", requires_grad=True)
    assert h._device_ms(lambda: rms_norm(x, w), [x, w], mode) > 0
    assert torch.randn(8, device="cuda").shape == (8,)


def test_plot_draws_a_categorical_sweep_as_bars_and_a_limit_hatched(tmp_path, monkeypatch):
    import matplotlib.axes

    recs = [records.Record("toy", provider, "speed", "ms", "NVIDIA H200", "model", "model", "t", "full", "toy",
                           "0.1", "d2", "bfloat16", [records.Point(m, ms, ms * 0.9, ms * 1.1)
                                                     for m, ms in (("llama-3-8b", 2.0), ("phi-3-mini", 1.0))])
            for provider in ("onca", "liger", "gemm_limit")]
    path = tmp_path / "results.csv"
    records.append_csv(str(path), recs)
    bars = []
    draw = matplotlib.axes.Axes.bar
    monkeypatch.setattr(matplotlib.axes.Axes, "bar",
                        lambda ax, *a, **k: bars.append((k["label"], k.get("hatch"))) or draw(ax, *a, **k))
    assert len(plot.plot_csv(str(path), str(tmp_path / "plots"))) == 1
    assert bars == [("onca", None), ("liger", None), ("gemm_limit", "//")]


def test_report_table_shows_speedups():
    recs = []
    for provider, ms in (("onca", 1.0), ("torch", 3.0)):
        recs.append(records.Record("toy", provider, "speed", "ms", "gpu", "n", "n", "t", "full", "", "0", "d1",
                                   "bf16", [records.Point(4, ms, ms, ms)]))
    text = report.table(recs)
    assert "vs torch" in text and "3.00x" in text


def test_model_registry():
    for name in ("llama-3-8b", "llama-3-70b", "qwen3-0.6b", "qwen3-8b", "qwen2.5-7b", "mistral-7b",
                 "gemma-2-9b", "gemma-3-27b", "phi-3-mini"):
        m = get_model(name)
        assert m.hidden_size > 0 and m.intermediate_size > m.hidden_size and m.vocab_size > 30000
        assert m.num_heads % m.num_kv_heads == 0 and m.head_dim in (64, 96, 128, 256)
    assert get_model("llama-3-8b").num_heads * get_model("llama-3-8b").head_dim == 4096
    with pytest.raises(ValueError, match="unknown model 'gpt-9'"):
        get_model("gpt-9")
    assert len(MODELS) >= 9


def test_sweep_helpers():
    s = d1("tokens", [1, 2], {"hidden": 8})
    assert s.points == ((1, {"hidden": 8, "tokens": 1}), (2, {"hidden": 8, "tokens": 2}))
    with pytest.raises(ValueError, match="kind"):
        Sweep("d3", "x", "x", ())


def test_each_point_reaches_on_point_as_it_is_measured(device):
    """``on_point`` gets every (point, provider)'s records once, as measured: together they are the
    run's records (what ``onca bench`` appends to its CSV while it runs)."""
    bench = harness.load("rms_norm")
    # Short timings (a GPU's default times each call for 100 ms): what is tested is the records.
    settings = harness.Settings(device=device, dtype=torch.float32, providers=("onca", "torch"), peers=False,
                                modes=("forward", "full"), cpu_reps=1, max_points=1, warmup_ms=1, rep_ms=5)
    seen = []
    new = harness.Harness(settings, progress=False).run(bench, bench.sweep("d1")[:1], on_point=seen.append)
    assert len(seen) == 2 and all(len(done) == 4 for done in seen)  # 2 providers; 2 metrics x 2 modes
    flat = sorted((r.kernel_provider, r.metric_name, r.kernel_operation_mode, p.x, p.y50)
                  for done in seen for r in done for p in r.points)
    assert flat == sorted((r.kernel_provider, r.metric_name, r.kernel_operation_mode, p.x, p.y50)
                          for r in new for p in r.points)


def test_points_selects_sweep_points_by_their_x_value():
    """``--points``: only the named D2 models (before ``max_points`` subsamples); a GPU run's choice,
    decided without touching a GPU."""
    sweep = harness.load("fused_moe").sweep("d2")[0]
    pick = harness.Harness(harness.Settings(device="cuda", points=("gpt-oss-20b", "mixtral-8x7b")), progress=False)
    assert [x for x, _ in pick.points(harness.load("fused_moe"), sweep)] == ["mixtral-8x7b", "gpt-oss-20b"]
    every = harness.Harness(harness.Settings(device="cuda", max_points=2), progress=False)
    assert [x for x, _ in every.points(harness.load("fused_moe"), sweep)] == ["mixtral-8x7b", "gpt-oss-20b"]
    none = harness.Harness(harness.Settings(device="cuda", points=("llama-3-8b",)), progress=False)
    assert none.points(harness.load("fused_moe"), sweep) == []


def test_a_sweep_with_no_chosen_point_gives_no_records(monkeypatch):
    """``--points 256,512`` over an op whose other D1 sweep has no such point: that sweep adds no
    empty records (whose table once failed the run after every point was measured)."""
    h = cpu_harness(modes=("full",))
    monkeypatch.setattr(h, "points", lambda bench, sweep: [(4, {"n": 4})] if sweep.kind == "d1" else [])
    new = h.run(toy_benchmark(), list(toy_benchmark().sweeps))
    assert {r.sweep for r in new} == {"d1"} and all(len(r.points) == 1 for r in new)
    assert "toy · d1 over n · full · speed" in report.table(new, "speed")


def test_subsample_keeps_the_ends_evenly():
    pts = list(range(10))
    assert harness.subsample(pts, None) == pts and harness.subsample(pts, 20) == pts
    assert harness.subsample(pts, 3) == [0, 4, 9] or harness.subsample(pts, 3) == [0, 5, 9]
    assert harness.subsample(pts, 2) == [0, 9] and harness.subsample(pts, 1) == [0]


@pytest.mark.parametrize("op", ["cross_entropy", "fused_linear_cross_entropy"])
def test_loss_option_sets_compute_what_their_reference_does(op, device):
    """Each point of the losses' ``options`` sweep gives Onca and the reference the same work: the
    same loss and, for the token metrics, the same accuracy and predicted tokens (probe size)."""
    bench = harness.load(op)
    sweep, = (s for s in bench.sweep("d1") if s.x_name == "options")
    for name, _ in sweep.points:
        params = {**bench.probe, "options": name}
        inputs = bench.make_inputs(params, torch.float32, device)
        expected = bench.reference(params, inputs)()  # first: Onca's cross entropy overwrites the logits
        ours = build(bench.onca, params, inputs)()
        if name == "token_metrics":
            loss, accuracy, predicted = expected
            assert torch.equal(ours.predicted_tokens, predicted)
            torch.testing.assert_close(ours.token_accuracy, accuracy)
            ours, expected = ours.loss, loss
        torch.testing.assert_close(ours, expected, msg=lambda m, name=name: f"{name}: {m}")


def test_below_peers_lists_the_points_where_onca_loses():
    from onca.bench.report import below_peers

    def row(provider, x, metric, value):
        return {"kernel_name": "op", "sweep": "d1", "x_value": x, "kernel_operation_mode": "full",
                "status": "ok", "metric_name": metric, "kernel_provider": provider, "y_value_50": value}

    rows = [row("onca", 1, "speed", 2.0), row("torch", 1, "speed", 1.0), row("liger", 1, "speed", 3.0),
            row("onca", 2, "speed", 1.0), row("torch", 2, "speed", 4.0), row("liger", 2, "speed", 3.0),
            row("gemm_limit", 2, "speed", 0.5),  # a limit, not a peer: never the fastest peer
            row("onca", 1, "memory", 30.0), row("liger", 1, "memory", 20.0),
            row("onca", 2, "memory", 10.0), row("liger", 2, "memory", 20.0)]
    text = below_peers(rows)
    assert "op: below the fastest peer at 1 of 2 points; peak memory at most 1.50x liger's" in text
    assert "d1 1: 0.50x torch" in text and "d1 2" not in text


def test_below_peers_counts_the_points_at_the_copy_bandwidth_limit():
    """A point where onca is behind but already moves its bytes at 85% or more of the copy
    bandwidth is counted as at the limit, and every behind point shows onca's share."""
    from onca.bench.report import below_peers

    def row(provider, x, value, pct=math.nan):
        return {"kernel_name": "op", "sweep": "d1", "x_value": x, "kernel_operation_mode": "full",
                "status": "ok", "metric_name": "speed", "kernel_provider": provider, "y_value_50": value,
                "pct_of_copy": pct}

    rows = [row("onca", 1, 1.02, 97.6), row("torch_compile", 1, 1.0, 99.5),  # behind, at the limit
            row("onca", 2, 2.0, 42.0), row("liger", 2, 1.0, 84.0),  # behind, far from it
            row("onca", 3, 2.0), row("liger", 3, 1.0),  # behind, no bytes model
            row("onca", 4, 1.0, 90.0), row("liger", 4, 2.0, 45.0)]  # ahead: not listed
    lines = below_peers(rows).splitlines()
    assert lines[0].startswith("op: below the fastest peer at 3 of 4 points (1 of them at the copy-bandwidth limit);")
    assert lines[1:] == ["    d1 1: 0.98x torch_compile (onca at 98% of copy bandwidth)",
                         "    d1 2: 0.50x liger (onca at 42% of copy bandwidth)",
                         "    d1 3: 0.50x liger"]


def test_below_peers_gives_onca_s_share_of_a_limit_row_and_counts_the_points_at_85_percent():
    """A matmul-bound op behind a peer shows its speed as a share of the limit row's (the matmuls
    it must do, alone); at 85% or more of it the point is counted as at that limit."""
    from onca.bench.report import below_peers

    def row(provider, x, value):
        return {"kernel_name": "op", "sweep": "d2", "x_value": x, "kernel_operation_mode": "full",
                "status": "ok", "metric_name": "speed", "kernel_provider": provider, "y_value_50": value}

    rows = [row("onca", "a", 10.0), row("torch_compile", "a", 9.5), row("gemm_limit", "a", 9.0),
            row("onca", "b", 10.0), row("torch_compile", "b", 8.0), row("gemm_limit", "b", 8.0)]
    lines = below_peers(rows).splitlines()
    assert lines[0].startswith("op: below the fastest peer at 2 of 2 points (1 at 85% or more of a limit "
                               "row's speed);")
    assert lines[1:] == ["    d2 a: 0.95x torch_compile (onca at 90% of gemm_limit's speed)",
                         "    d2 b: 0.80x torch_compile (onca at 80% of gemm_limit's speed)"]


def test_below_peers_shows_the_device_time_and_counts_host_bound_points():
    """A point onca loses by wall clock but whose kernels are at or ahead of the peer's in CUDA-graph
    replay is host-bound, and said so; a newer row without a device time drops the older one's."""
    from onca.bench.report import below_peers

    def row(provider, x, value, device=math.nan):
        return {"kernel_name": "op", "sweep": "d2", "x_value": x, "kernel_operation_mode": "full",
                "status": "ok", "metric_name": "speed", "kernel_provider": provider, "y_value_50": value,
                "device_ms": device}

    rows = [row("onca", "a", 2.0, 0.10), row("liger", "a", 1.0, 0.12),  # behind, kernels faster
            row("onca", "b", 2.0, 0.30), row("liger", "b", 1.0, 0.20),  # behind, kernels slower
            row("onca", "c", 2.0, 0.10), row("liger", "c", 1.0, 0.50),
            row("onca", "c", 2.0)]  # re-run without the device time
    lines = below_peers(rows).splitlines()
    assert lines[0].startswith("op: below the fastest peer at 3 of 3 points (1 host-bound, onca's device "
                               "time at or below the peer's);")
    assert lines[1:] == ["    d2 a: 0.50x liger (device time 0.100 vs 0.120 ms: host-bound)",
                         "    d2 b: 0.50x liger (device time 0.300 vs 0.200 ms)",
                         "    d2 c: 0.50x liger"]


def test_below_peers_keeps_two_sweeps_with_one_x_value_apart():
    """A D1 sweep over tokens and one over hidden sizes both have a 1024 point: two points, never
    one point whose providers come from either."""
    from onca.bench.report import below_peers

    def row(provider, x_name, value):
        return {"kernel_name": "op", "sweep": "d1", "x_name": x_name, "x_value": 1024,
                "kernel_operation_mode": "full", "status": "ok", "metric_name": "speed",
                "kernel_provider": provider, "y_value_50": value}

    rows = [row("onca", "tokens", 2.0), row("torch", "tokens", 1.0),
            row("onca", "hidden", 1.0), row("torch", "hidden", 4.0)]
    lines = below_peers(rows).splitlines()
    assert lines == ["op: below the fastest peer at 1 of 2 points; no liger-kernel memory to compare",
                     "    d1 tokens 1024: 0.50x torch"]


def test_below_peers_never_compares_two_gpus():
    """Onca's H100 run is compared with the H100 peers only, and the stale H200 sweep gets its own
    line: without the GPU in the key, the H200 torch row (the faster one) would be the H100 point's
    fastest peer."""
    def row(provider, value, gpu, stamp):
        return {"kernel_name": "op", "sweep": "d1", "x_value": 1, "kernel_operation_mode": "full",
                "status": "ok", "metric_name": "speed", "kernel_provider": provider, "y_value_50": value,
                "gpu_name": gpu, "timestamp": stamp}

    h100, h200 = "NVIDIA H100 80GB HBM3", "NVIDIA H200"
    rows = [row("onca", 2.0, h100, "2026-11-25"), row("liger", 3.0, h100, "2026-11-25"),
            row("onca", 4.0, h200, "2026-11-22"), row("torch", 1.0, h200, "2026-11-22")]
    from onca.bench.report import below_peers

    lines = below_peers(rows).splitlines()
    assert lines[0] == "op on H100 (2026-11-25): below the fastest peer at 0 of 1 points; no liger-kernel memory to compare"
    assert lines[1].startswith("op on H200 (2026-11-22): below the fastest peer at 1 of 1 points")
    assert lines[2] == "    d1 1: 0.25x torch"


def test_summary_names_the_gpu_of_each_row():
    def row(op, provider, metric, value, gpu):
        return {"kernel_name": op, "sweep": "d2", "x_value": "llama-3-8b", "kernel_operation_mode": "full",
                "status": "ok", "metric_name": metric, "kernel_provider": provider, "y_value_50": value,
                "gpu_name": gpu}

    rows = [row("a", "onca", "speed", 1.0, "NVIDIA H200"), row("a", "liger", "speed", 2.0, "NVIDIA H200"),
            row("b", "onca", "speed", 2.0, "NVIDIA H100 80GB HBM3"), row("b", "torch", "speed", 1.0,
                                                                            "NVIDIA H100 80GB HBM3")]
    lines = report.summary(rows).splitlines()
    assert lines[0].startswith("| kernel | shape | gpu | onca ms")
    assert lines[2].startswith("| a | llama-3-8b | H200 | 1.000 |") and "2.00x" in lines[2]
    assert lines[3].startswith("| b | llama-3-8b | H100 | 2.000 | 0.50x |")
    for r in rows:
        r["sweep"] = "overhead"
    lines = report.overhead_summary(rows).splitlines()
    assert lines[0].startswith("| kernel | gpu | onca ms | torch ms")
    assert lines[2].startswith("| a | H200 | 1.0000 |") and lines[3].startswith("| b | H100 | 2.0000 | 1.0000 |")


def test_summary_never_divides_across_gpus():
    """A line takes every provider from the GPU onca last ran on: an op re-run on another GPU without
    torch shows no torch ratio rather than one against the other GPU's torch."""
    def row(provider, value, gpu, stamp):
        return {"kernel_name": "a", "sweep": "d2", "x_value": "llama-3-8b", "kernel_operation_mode": "full",
                "status": "ok", "metric_name": "speed", "kernel_provider": provider, "y_value_50": value,
                "gpu_name": gpu, "timestamp": stamp}

    rows = [row("onca", 4.0, "NVIDIA H200", "2026-11-22"), row("torch", 8.0, "NVIDIA H200", "2026-11-22"),
            row("onca", 2.0, "NVIDIA H100 80GB HBM3", "2026-11-25"), row("liger", 3.0, "NVIDIA H100 80GB HBM3",
                                                                          "2026-11-25")]
    line = report.summary(rows).splitlines()[2]
    assert line.startswith("| a | llama-3-8b | H100 | 2.000 | - | - | 1.50x |"), line
    for r in rows:
        r["sweep"] = "overhead"
    line = report.overhead_summary(rows).splitlines()[2]
    assert line.startswith("| a | H100 | 2.0000 | - |"), line


def test_peer_providers_are_run_beside_the_harness_own():
    """A benchmark's ``peers`` (another library's implementation) are measured and recorded like
    liger; naming the providers explicitly leaves them out; a failing import marks one unavailable."""
    def missing(p, inputs):
        raise ImportError("no module named 'otherlib'", name="otherlib")

    base = toy_benchmark()
    bench = OpBenchmark(**{**base.__dict__, "peers": {"other": base.reference, "gone": missing}})
    assert bench.providers[-2:] == ("other", "gone")
    new = cpu_harness(modes=("forward",)).run(bench, [bench.sweeps[0]])
    assert by(new, "other", "speed", "forward").points[0].status == "ok"
    gone = by(new, "gone", "speed", "forward").points[0]
    assert gone.status == "unavailable" and "otherlib" in gone.note
    assert "vs other" in report.table(new)
    only = cpu_harness(modes=("forward",), peers=False).run(bench, [bench.sweeps[0]])
    assert {r.kernel_provider for r in only} == {"onca", "torch", "liger"}
    with pytest.raises(ValueError, match="peer"):
        OpBenchmark(**{**base.__dict__, "peers": {"liger": base.reference}})


def test_trl_peer_of_the_fused_head_benchmark(device):
    """TRL's chunked log-prob function as the ``trl`` peer of ``fused_linear_logprobs``: it runs at
    the probe size and computes what Onca's provider computes."""
    pytest.importorskip("trl.kernels.chunked_logprob")
    bench = harness.load("fused_linear_logprobs")
    for outputs in ("none", "sft", "dpo"):
        params = {**bench.probe, "outputs": outputs}
        inputs = bench.make_inputs(params, torch.float32, device)
        ours, theirs, ref = (f(params, inputs)() for f in (bench.onca, bench.peers["trl"], bench.reference))
        spec = importlib.import_module("onca.bench.ops.fused_linear_logprobs")
        assert len(ours) == len(theirs) == len(ref) == 1 + len(spec.OUTPUTS[outputs])
        for a, b, c in zip(ours, theirs, ref):
            if a.dtype == torch.bool:
                assert torch.equal(a, b) and torch.equal(a, c)
            else:
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
                torch.testing.assert_close(a, c, rtol=1e-4, atol=1e-4)
    settings = harness.Settings(device=device, dtype=torch.float32, providers=("onca",), modes=("full",),
                                cpu_reps=1, max_points=1)
    new = harness.Harness(settings, progress=False).run(bench, bench.sweep("d1")[:1])
    assert {p.status for r in new if r.metric_name == "speed" for p in r.points} == {"ok"}
    assert {r.kernel_provider for r in new} == {"onca", "trl", "gemm_limit"}  # the peers run beside onca


def _run_record(provider, xs, ms, metric="speed", timestamp="2026-03-01T00:00:00+00:00", x_name="n"):
    unit = "ms" if metric == "speed" else "MB"
    return records.Record("toy", provider, metric, unit, "NVIDIA H200", x_name, x_name, timestamp, "full",
                          "toy", "0.1", "d1", "bfloat16", [records.Point(x, ms) for x in xs])


def test_merge_keeps_the_points_every_provider_reached_and_the_later_run(tmp_path, capsys):
    from onca import cli

    first, second, data = tmp_path / "first", tmp_path / "second", tmp_path / "data"
    name = "toy-nvidia-h200-bfloat16.json"
    # The first run was cut at x=8: torch never reached it (nor the "m" sweep after it); onca's
    # memory point there goes too.
    records.write_json(str(first / name), [_run_record("onca", [4, 8], 1.0), _run_record("torch", [4], 2.0),
                                           _run_record("onca", [4, 8], 10.0, "memory"),
                                           _run_record("onca", [16], 1.0, x_name="m")])
    later, earlier = "2026-04-01T00:00:00+00:00", "2026-01-01T00:00:00+00:00"
    records.write_json(str(second / name), [_run_record("onca", [8], 0.5, timestamp=later),
                                            _run_record("torch", [8], 3.0, timestamp=later)])
    records.write_json(str(data / name), [_run_record("onca", [2], 7.0, timestamp=earlier)])
    kept, dropped = records.whole_points(records.read_json(str(first / name)))
    assert dropped == [("toy", "d1", "full", "16"), ("toy", "d1", "full", "8")]
    assert {(r.kernel_provider, r.metric_name, p.x) for r in kept for p in r.points} == {
        ("onca", "speed", 4), ("torch", "speed", 4), ("onca", "memory", 4)}

    assert cli.main(["bench", "merge", str(first), str(second), "--out", str(data)]) == 0
    out = capsys.readouterr().out
    assert "1 points; left out (cut before every provider ran): d1 full 16, d1 full 8" in out
    merged = {(r.kernel_provider, r.metric_name): {p.x: p.y50 for p in r.points}
              for r in records.read_json(str(data / name))}
    assert merged[("onca", "speed")] == {2: 7.0, 4: 1.0, 8: 0.5}  # earlier data kept, the runs added
    assert merged[("torch", "speed")] == {4: 2.0, 8: 3.0}
    assert merged[("onca", "memory")] == {4: 10.0}
    rows = records.read_csv(str(data / "results.csv"))
    assert sorted((r["kernel_provider"], r["metric_name"], r["x_value"]) for r in rows) == [
        ("onca", "memory", "4"), ("onca", "speed", "4"), ("onca", "speed", "8"), ("torch", "speed", "4"),
        ("torch", "speed", "8")]
    (tmp_path / "empty").mkdir()
    assert cli.main(["bench", "merge", str(tmp_path / "empty"), "--out", str(data)]) == 1
    assert "empty: no benchmark JSON" in capsys.readouterr().err


def test_two_sweeps_over_one_x_name_stay_apart(tmp_path, monkeypatch):
    """Fused MoE sweeps tokens twice (at two models' expert shapes): each sweep's points stay its own
    in the run's records, the merged JSON and CSV, the tables, the summary and the charts. Keyed by
    the x name alone, the second sweep's points replaced the first's at the x values both have and
    took the first's others under its own label (an H200 run of 2026-12-01)."""
    import dataclasses

    small, wide = "n (small rows)", "n (wide rows)"
    bench = dataclasses.replace(toy_benchmark(), sweeps=(d1("n", [4, 8], {"w": 1}, small),
                                                         d1("n", [4, 16], {"w": 2}, wide)))
    # Every point of each sweep, not the CPU's one probe point.
    monkeypatch.setattr(harness.Harness, "points", lambda self, bench, sweep: list(sweep.points))
    run = cpu_harness().run(bench, list(bench.sweeps))

    def points(recs):
        return {(r.x_label, str(p.x)) for r in recs
                if (r.kernel_provider, r.metric_name, r.kernel_operation_mode) == ("onca", "speed", "full")
                for p in r.points}

    expected = {(small, "4"), (small, "8"), (wide, "4"), (wide, "16")}
    assert points(records.merge(run)) == expected
    run_dir, data = tmp_path / "run", tmp_path / "data"
    records.write_json(str(run_dir / "toy-cpu-float32.json"), records.merge(run))
    lines = records.merge_runs([str(run_dir)], str(data))
    assert lines == [f"{run_dir}/toy-cpu-float32.json: 12 points"]  # 4 x values, 3 modes
    assert points(records.read_json(str(data / "toy-cpu-float32.json"))) == expected
    rows = records.latest(records.read_csv(str(data / "results.csv")))
    assert {(r["x_label"], r["x_value"]) for r in rows if r["kernel_provider"] == "onca"
            and r["metric_name"] == "speed" and r["kernel_operation_mode"] == "full"} == expected
    text = report.table(run, "speed")
    assert f"toy · d1 over {small} · full · speed" in text
    assert f"toy · d1 over {wide} · full · speed" in text
    assert " of 4 points" in report.below_peers(rows).splitlines()[0]
    names = {p.rsplit("/", 1)[-1] for p in plot.plot_csv(str(data / "results.csv"), str(tmp_path / "plots"),
                                                            include_cpu=True) if p.endswith("-speed.png")}
    assert names == {"cpu-float32-d1-n-small-rows-speed.png", "cpu-float32-d1-n-wide-rows-speed.png"}


def test_below_peers_says_when_the_peer_s_row_is_from_another_run():
    """A run of some providers only (onca beside its limit row) leaves the peers' rows of an
    earlier run: a behind point whose ratio spans two runs says so, with the peer's run date."""
    from onca.bench.report import below_peers

    def row(provider, x, value, stamp):
        return {"kernel_name": "op", "sweep": "d2", "x_value": x, "kernel_operation_mode": "full",
                "status": "ok", "metric_name": "speed", "kernel_provider": provider, "y_value_50": value,
                "timestamp": stamp}

    first, second = "2026-12-01T10:00:00+00:00", "2026-12-02T10:00:00+00:00"
    rows = [row("onca", "a", 2.0, first), row("torch_compile", "a", 1.0, first),
            row("onca", "b", 2.0, first), row("torch_compile", "b", 1.0, first),
            row("onca", "b", 2.0, second), row("gemm_limit", "b", 1.0, second)]
    lines = below_peers(rows).splitlines()
    assert lines[1:] == ["    d2 a: 0.50x torch_compile",
                         "    d2 b: 0.50x torch_compile (onca at 50% of gemm_limit's speed; "
                         "torch_compile's row from another run, 2026-12-01)"]
