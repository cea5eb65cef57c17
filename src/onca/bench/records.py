"""Benchmark records: the schema of ARCHITECTURE.md, CSV rows (one per point) and JSON records.

A JSON record is one object per (op, provider, metric, mode) over a sweep, holding the x values and
the 50th/20th/80th percentiles of y at each. A CSV row is one point of one record. Points that did
not run carry a ``status`` (``skipped``: the memory estimate did not fit the device; ``oom``: it
ran out of memory; ``error``; ``unavailable``: the provider is not installed) and a ``note``.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import os
from dataclasses import asdict, dataclass, field

CSV_FIELDS = (
    "kernel_name", "kernel_provider", "metric_name", "metric_unit", "gpu_name", "x_name", "x_label",
    "x_value", "y_value_50", "y_value_20", "y_value_80", "timestamp", "kernel_operation_mode",
    "extra_benchmark_config_str", "onca_version", "sweep", "dtype", "status", "note", "gbps",
    "pct_of_peak", "pct_of_copy", "tflops", "estimate_mb", "device_ms",
)


@dataclass
class Point:
    """One measured (or not) point of a record."""

    x: object
    y50: float = math.nan
    y20: float = math.nan
    y80: float = math.nan
    status: str = "ok"
    note: str = ""
    gbps: float | None = None
    pct_of_peak: float | None = None
    pct_of_copy: float | None = None
    tflops: float | None = None
    estimate_mb: float | None = None
    # A speed point's GPU time alone: the same call captured in a CUDA graph and replayed (the
    # host path left out), beside the time a caller sees (y50). None where it was not measured.
    device_ms: float | None = None


# The optional per-point numbers, in the JSON record and the CSV row alike.
EXTRAS = ("gbps", "pct_of_peak", "pct_of_copy", "tflops", "estimate_mb", "device_ms")


@dataclass
class Record:
    kernel_name: str
    kernel_provider: str
    metric_name: str  # "speed" or "memory"
    metric_unit: str  # "ms" or "MB"
    gpu_name: str
    x_name: str
    x_label: str
    timestamp: str
    kernel_operation_mode: str
    extra_benchmark_config_str: str
    onca_version: str
    sweep: str
    dtype: str
    points: list[Point] = field(default_factory=list)

    def to_json(self) -> dict:
        """The schema's shape: parallel lists over the sweep's x values."""
        head = {k: v for k, v in asdict(self).items() if k != "points"}
        pts = self.points
        head.update(
            x_values=[p.x for p in pts],
            y_values_50=[_num(p.y50) for p in pts],
            y_values_20=[_num(p.y20) for p in pts],
            y_values_80=[_num(p.y80) for p in pts],
            status=[p.status for p in pts],
            note=[p.note for p in pts],
        )
        for extra in EXTRAS:
            values = [getattr(p, extra) for p in pts]
            if any(v is not None for v in values):
                head[extra] = [_num(v) for v in values]
        return head

    def csv_rows(self) -> list[dict]:
        base = {k: v for k, v in asdict(self).items() if k != "points"}
        rows = []
        for p in self.points:
            rows.append({
                **base,
                "x_value": p.x, "y_value_50": _num(p.y50), "y_value_20": _num(p.y20),
                "y_value_80": _num(p.y80), "status": p.status, "note": p.note,
                **{extra: _num(getattr(p, extra)) for extra in EXTRAS},
            })
        return rows


def _num(v):
    if v is None:
        return None
    v = float(v)
    return None if math.isnan(v) else round(v, 6)


def append_csv(path: str, records: list[Record]) -> int:
    """Append every point of ``records`` to ``path`` (created with a header); returns rows written."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    new = not os.path.exists(path) or os.path.getsize(path) == 0
    if not new:
        _upgrade_header(path)
    rows = [row for r in records for row in r.csv_rows()]
    with open(path, "a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        if new:
            writer.writeheader()
        for row in rows:
            writer.writerow({k: ("" if row.get(k) is None else row.get(k)) for k in CSV_FIELDS})
    return len(rows)


def _upgrade_header(path: str) -> None:
    """Rewrite a CSV written before a column was added under today's header (the new columns
    empty), so that appended rows line up with it."""
    with open(path, newline="") as f:
        header = next(csv.reader(f), None)
    if header is None or tuple(header) == CSV_FIELDS:
        return
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: row.get(k) or "" for k in CSV_FIELDS})


def read_csv(path: str) -> list[dict]:
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    for row in rows:
        for key in ("y_value_50", "y_value_20", "y_value_80", *EXTRAS):
            row[key] = float(row[key]) if row.get(key) not in (None, "") else math.nan
    return rows


def latest(rows: list[dict]) -> list[dict]:
    """Keep, for every (op, provider, metric, mode, sweep axis, x, device, dtype), the newest row."""
    best: dict[tuple, dict] = {}
    for row in rows:
        key = (row["kernel_name"], row["kernel_provider"], row["metric_name"], row["kernel_operation_mode"],
               *axis(row), row["x_value"], row["gpu_name"], row["dtype"])
        if key not in best or row["timestamp"] >= best[key]["timestamp"]:
            best[key] = row
    return list(best.values())


def merge(records: list[Record]) -> list[Record]:
    """One record per (op, provider, metric, mode, sweep, x axis, device, dtype) holding the points of
    ``records`` in their order: what the per-point records of a run (``Harness.run``'s ``on_point``)
    add up to. A later point at an x already held replaces it in place, and the record takes the
    later header (its timestamp): an earlier run's file merged with a new run keeps what the new
    run did not measure."""
    merged: dict[tuple, Record] = {}
    for r in records:
        key = (r.kernel_name, r.kernel_provider, r.metric_name, r.kernel_operation_mode, *axis(r), r.gpu_name,
               r.dtype)
        held = merged.get(key)
        merged[key] = dataclasses.replace(r, points=[] if held is None else held.points)
        at = {_x_key(p.x): i for i, p in enumerate(merged[key].points)}
        for p in r.points:
            if _x_key(p.x) in at:
                merged[key].points[at[_x_key(p.x)]] = p
            else:
                at[_x_key(p.x)] = len(merged[key].points)
                merged[key].points.append(p)
    return list(merged.values())


def axis(r) -> tuple[str, str, str]:
    """``(sweep, x_name, x_label)`` of a record or a CSV row: one sweep axis. The label is part of
    it: an op may sweep one x name twice (fused MoE's tokens, at two models' expert shapes), and
    the two sweeps' points must never merge."""
    if isinstance(r, dict):
        return r["sweep"], r.get("x_name", ""), r.get("x_label", "")
    return r.sweep, r.x_name, r.x_label


def _x_key(x) -> str:
    # JSON and the CSV give x back as text or a number; a point is the same point either way.
    return str(x)


def read_json(path: str) -> list[Record]:
    """The records of a JSON file written by ``write_json`` (an empty list if there is none)."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        items = json.load(f)
    heads = {f.name for f in dataclasses.fields(Record)} - {"points"}
    out = []
    for item in items:
        n = len(item["x_values"])
        extra = lambda key, i: item[key][i] if key in item else None  # noqa: E731
        nan = lambda v: math.nan if v is None else v  # noqa: E731
        points = [Point(x=item["x_values"][i], y50=nan(item["y_values_50"][i]), y20=nan(item["y_values_20"][i]),
                        y80=nan(item["y_values_80"][i]), status=item["status"][i], note=item["note"][i],
                        **{k: extra(k, i) for k in EXTRAS})
                  for i in range(n)]
        out.append(Record(**{k: item[k] for k in heads}, points=points))
    return out


def write_json(path: str, records: list[Record]) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump([r.to_json() for r in records], f, indent=1)


def whole_points(recs: list[Record]) -> tuple[list[Record], list[tuple]]:
    """``recs`` (one run's) with only the points that every provider of the run (of the point's
    mode) reached, and the points left out as ``(op, sweep, mode, x)``. A run cut by a time limit
    leaves points that some providers ran and others never reached, or a sweep that a slow peer
    never started; their rows would compare nothing side by side. A point a provider reached but
    could not run (``skipped``, ``oom``, ``error``) counts as reached."""
    def run_of(r):
        return r.kernel_name, r.kernel_operation_mode, r.gpu_name, r.dtype

    providers: dict[tuple, set] = {}
    reached: dict[tuple, dict[str, set]] = {}  # (run, sweep, x axis) -> provider -> x values
    for r in recs:
        if r.metric_name == "speed":
            providers.setdefault(run_of(r), set()).add(r.kernel_provider)
            seen = reached.setdefault((run_of(r), *axis(r)), {})
            seen.setdefault(r.kernel_provider, set()).update(_x_key(p.x) for p in r.points)
    whole, dropped = {}, set()
    for key, seen in reached.items():
        every = set.union(*seen.values())
        whole[key] = {x for x in every if all(x in seen.get(p, ()) for p in providers[key[0]])}
        dropped.update((key[0][0], key[1], key[0][1], x) for x in every - whole[key])
    kept = []
    for r in recs:
        points = [p for p in r.points if _x_key(p.x) in whole.get((run_of(r), *axis(r)), set())]
        if points:
            kept.append(dataclasses.replace(r, points=points))
    return kept, sorted(dropped)


def merge_runs(run_dirs: list[str], into: str) -> list[str]:
    """Bring the results of ``onca bench --out DIR`` runs into the results directory ``into`` (the
    committed ``benchmarks/data``): each run's whole points (:func:`whole_points`) are appended to
    ``into``'s ``results.csv`` and merged into its JSON of the same name, the runs in the order
    given (a later run's point replaces an earlier one's). Returns a line per run and file: the
    points kept and those left out."""
    lines, merged = [], {}
    for run in run_dirs:
        names = sorted(n for n in os.listdir(run) if n.endswith(".json"))
        if not names:
            raise FileNotFoundError(f"{run}: no benchmark JSON (onca bench --out writes OP-GPU-DTYPE.json)")
        for name in names:
            kept, dropped = whole_points(read_json(os.path.join(run, name)))
            append_csv(os.path.join(into, "results.csv"), kept)
            merged.setdefault(name, []).extend(kept)
            points = {(*axis(r), r.kernel_operation_mode, _x_key(p.x)) for r in kept for p in r.points}
            left = "; left out (cut before every provider ran): " + ", ".join(
                f"{sweep} {mode} {x}" for _, sweep, mode, x in dropped) if dropped else ""
            lines.append(f"{run}/{name}: {len(points)} points{left}")
    for name, recs in merged.items():
        path = os.path.join(into, name)
        write_json(path, merge(read_json(path) + recs))
    return lines
