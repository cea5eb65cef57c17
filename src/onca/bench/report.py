"""The compact table printed after a benchmark run: each provider's median, and onca's speedup."""

from __future__ import annotations

import math

from onca.bench.records import Record, axis
from onca.bench.spec import PROVIDERS

SHORT = {"onca": "onca", "torch": "torch", "torch_compile": "compile", "liger": "liger"}


def ordered(providers) -> list[str]:
    """The harness's providers in their usual order, then peers (``OpBenchmark.peers``) by name."""
    providers = set(providers)
    return [p for p in PROVIDERS if p in providers] + sorted(providers - set(PROVIDERS))


def _cell(point, unit) -> str:
    if point is None:
        return "-"
    if point.status != "ok":
        return point.status
    return f"{point.y50:.3f}" if unit == "ms" else f"{point.y50:.0f}"


def table(records: list[Record], metric: str = "speed") -> str:
    """One block per (op, sweep axis, mode): rows are x values, columns providers, then ratios.

    For speed the ratio is other / onca (above 1: onca is faster); for memory it is onca / other
    (below 1: onca uses less).
    """
    blocks = []
    groups: dict[tuple, dict[str, Record]] = {}
    for r in records:
        if r.metric_name == metric:
            groups.setdefault((r.kernel_name, *axis(r), r.kernel_operation_mode), {})[r.kernel_provider] = r
    for (op, sweep, x_name, x_label, mode), by_provider in groups.items():
        providers = ordered(by_provider)
        others = [p for p in providers if p != "onca"]
        unit = next(iter(by_provider.values())).metric_unit
        head = [x_name] + [f"{SHORT.get(p, p)} {unit}" for p in providers]
        if "onca" in by_provider:
            head += [f"vs {SHORT.get(p, p)}" for p in others]
        rows = []
        xs = [pt.x for pt in next(iter(by_provider.values())).points]
        for i, x in enumerate(xs):
            pts = {p: by_provider[p].points[i] if i < len(by_provider[p].points) else None for p in providers}
            row = [str(x)] + [_cell(pts[p], unit) for p in providers]
            if "onca" in by_provider:
                row += [_ratio(pts["onca"], pts[p], metric) for p in others]
            rows.append(row)
        widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
        lines = [f"{op} · {sweep} over {x_label or x_name} · {mode} · {metric}"]
        lines.append("  ".join(h.rjust(w) for h, w in zip(head, widths)))
        lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


def _ratio(onca, other, metric) -> str:
    if onca is None or other is None or onca.status != "ok" or other.status != "ok":
        return "-"
    if not (onca.y50 > 0 and other.y50 > 0) or math.isnan(onca.y50) or math.isnan(other.y50):
        return "-"
    value = other.y50 / onca.y50 if metric == "speed" else onca.y50 / other.y50
    return f"{value:.2f}x"


# The D2 point each op's headline row shows: a Llama-3-8B-shaped layer where the op has one
# (Gemma's shapes for GeGLU, which only Gemma uses).
HEADLINE_MODEL = {"geglu": "gemma-2-9b"}
DEFAULT_HEADLINE_MODEL = "llama-3-8b"


def short_gpu_name(name: str) -> str:
    """``NVIDIA H100 80GB HBM3`` -> ``H100``: the table says which machine each row is from, as
    rows from different runs (and GPUs) sit in one table."""
    words = name.replace("NVIDIA", "").split()
    return words[0] if words else "-"


def _on_newest_gpu(rows: list[dict], what) -> tuple[dict, dict]:
    """``({(op, gpu, what(row)): newest row}, {op: the GPU of its newest onca row})``: a table line
    takes every provider from the GPU that onca last ran on, never a ratio across two GPUs. Ops
    that onca never ran are left out."""
    by_key: dict[tuple, dict] = {}
    newest_onca: dict[str, dict] = {}
    for r in rows:
        key = (r["kernel_name"], r["gpu_name"], what(r))
        if key not in by_key or r.get("timestamp", "") >= by_key[key].get("timestamp", ""):
            by_key[key] = r
        if r["kernel_provider"] == "onca":
            held = newest_onca.get(r["kernel_name"])
            if held is None or r.get("timestamp", "") >= held.get("timestamp", ""):
                newest_onca[r["kernel_name"]] = r
    # Ops in the order they first appear, as before.
    order = list(dict.fromkeys(r["kernel_name"] for r in rows if r["kernel_name"] in newest_onca))
    return by_key, {op: newest_onca[op]["gpu_name"] for op in order}


def summary(rows: list[dict], mode: str = "full") -> str:
    """A Markdown table, one line per op: its headline D2 point in ``mode`` (from CSV rows as
    ``records.read_csv`` returns them, newest record per point), the GPU it ran on, each provider's
    median time, and onca's peak memory beside liger-kernel's. Ratios as in :func:`table`."""
    headline = [r for r in rows if r["sweep"] == "d2" and r["kernel_operation_mode"] == mode
                and r["x_value"] == HEADLINE_MODEL.get(r["kernel_name"], DEFAULT_HEADLINE_MODEL)]
    by_key, gpu_of = _on_newest_gpu(headline, lambda r: (r["kernel_provider"], r["metric_name"]))
    ops = list(gpu_of)
    head = ["kernel", "shape", "gpu", "onca ms", "vs torch", "vs compile", "vs liger", "onca MB", "liger MB"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for op in ops:
        def get(provider, metric="speed"):
            r = by_key.get((op, gpu_of[op], (provider, metric)))
            return r["y_value_50"] if r and r["status"] == "ok" else math.nan
        onca = get("onca")
        measured_on = gpu_of[op]
        cells = [op, HEADLINE_MODEL.get(op, DEFAULT_HEADLINE_MODEL), short_gpu_name(measured_on), _fmt(onca, 3)]
        cells += [_fmt(get(p) / onca, 2, "x") for p in ("torch", "torch_compile", "liger")]
        cells += [_fmt(get("onca", "memory"), 0), _fmt(get("liger", "memory"), 0)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def overhead_summary(rows: list[dict], mode: str = "full") -> str:
    """A Markdown table of the overhead sweep (16 tokens, wall clock per call): per op, each
    provider's time and its ratio to onca's (above 1: onca is faster). Empty if none was run."""
    by_key, gpu_of = _on_newest_gpu(
        [r for r in rows if r["sweep"] == "overhead" and r["kernel_operation_mode"] == mode
         and r["metric_name"] == "speed"], lambda r: r["kernel_provider"])
    if not by_key:
        return ""
    # Only the peers that were run: a column of dashes says nothing.
    providers = tuple(p for p in ("torch", "torch_compile", "liger") if any(k[2] == p for k in by_key))
    head = ["kernel", "gpu", "onca ms", *(f"{p} ms" for p in providers), *(f"vs {p}" for p in providers)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for op in sorted(gpu_of):
        def get(provider):
            r = by_key.get((op, gpu_of[op], provider))
            return r["y_value_50"] if r and r["status"] == "ok" else math.nan
        onca = get("onca")
        measured_on = short_gpu_name(gpu_of[op])
        cells = [op, measured_on, _fmt(onca, 4), *(_fmt(get(p), 4) for p in providers), *(_fmt(get(p) / onca, 2, "x")
                                                                               for p in providers)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# A provider whose name ends so is a limit (e.g. ``gemm_limit``: the matmuls alone), not a peer:
# reported beside onca, never counted as the fastest peer.
LIMIT_SUFFIX = "_limit"

# A memory-bound pass at this share of the measured device-to-device copy bandwidth (the bytes it
# must move over its time) is at the hardware's limit: a peer ahead of it there is within the
# noise of that limit, not a kernel to beat (issue 13's criterion).
AT_COPY_LIMIT_PCT = 85.0
# A matmul-bound op at this share of its limit row's speed (``gemm_limit``: the cuBLAS matmuls it
# must do, timed alone) is at that limit (issue 13's target for fused linear cross entropy).
AT_LIMIT_ROW_PCT = 85.0


def below_peers(rows: list[dict], mode: str = "full") -> str:
    """Per kernel and GPU, over every D1/D2 point of ``mode``: how many points onca is below the
    fastest peer (its time / onca's below 1), each such point with that ratio, the peer and onca's
    share of the copy bandwidth where known, how many of those points onca is at the copy-bandwidth
    limit (``AT_COPY_LIMIT_PCT``), onca's speed as a share of each limit row's there (and how many
    points are at ``AT_LIMIT_ROW_PCT`` or more of one), onca's and the peer's device time where both
    were measured (at or below the peer's: the point is host-bound), whether the peer's row is from
    another run than onca's (a run of some providers only), and onca's largest peak memory
    relative to liger-kernel's. A ratio only ever compares rows of one GPU; a kernel measured on two GPUs gets
    a line for each (the newest onca run's GPU first). Empty if there are no such records."""
    speed: dict[tuple, dict[str, float]] = {}
    memory: dict[tuple, dict[str, float]] = {}
    copy_pct: dict[tuple, float] = {}  # onca's share of the copy bandwidth, per speed point
    device: dict[tuple, dict[str, float]] = {}  # device time (CUDA-graph replay) per point, provider
    stamp: dict[tuple, dict[str, str]] = {}  # the run (its timestamp) of each speed row kept
    newest: dict[tuple, str] = {}
    for r in rows:
        if r["sweep"] not in ("d1", "d2") or r["kernel_operation_mode"] != mode or r["status"] != "ok":
            continue
        table_ = speed if r["metric_name"] == "speed" else memory if r["metric_name"] == "memory" else None
        if table_ is None:
            continue
        where = (r["kernel_name"], r.get("gpu_name", ""))
        # The x name is part of the point: D1 sweeps over tokens and over hidden both have a 1024
        # (and the axis's label: two sweeps over tokens at two models' shapes).
        x = f"{r['x_name']} {r['x_value']}" if r.get("x_name") else str(r["x_value"])
        key = (*where, r["sweep"], x, r.get("x_label", ""))
        table_.setdefault(key, {})[r["kernel_provider"]] = r["y_value_50"]
        if table_ is speed:  # a later row's device time replaces an earlier one's, or its absence
            stamp.setdefault(key, {})[r["kernel_provider"]] = r.get("timestamp", "")
            device_ms = r.get("device_ms")
            held = device.setdefault(key, {})
            held.pop(r["kernel_provider"], None)
            if isinstance(device_ms, float) and not math.isnan(device_ms):
                held[r["kernel_provider"]] = device_ms
        if r["kernel_provider"] == "onca":
            newest[where] = max(newest.get(where, ""), r.get("timestamp", ""))
            pct = r.get("pct_of_copy")
            if table_ is speed and isinstance(pct, float) and not math.isnan(pct):
                copy_pct[key] = pct
    lines = []
    # Per kernel (a stable sort by name), its GPUs from the newest onca run to the oldest.
    order = sorted(sorted(newest, key=newest.get, reverse=True), key=lambda where: where[0])
    for op, gpu in order:
        points = [(k, v) for k, v in speed.items() if k[:2] == (op, gpu) and "onca" in v
                  and any(p != "onca" and not p.endswith(LIMIT_SUFFIX) for p in v)]
        behind, at_limit, at_gemm_limit, host_bound = [], 0, 0, 0
        for key, times in points:
            peers = [(p, t) for p, t in times.items() if p != "onca" and not p.endswith(LIMIT_SUFFIX)]
            peer, best = min(peers, key=lambda pt: pt[1])
            if best < times["onca"]:
                pct = copy_pct.get(key)
                at_limit += pct is not None and pct >= AT_COPY_LIMIT_PCT
                causes = [] if pct is None else [f"onca at {pct:.0f}% of copy bandwidth"]
                limits = _limit_shares(times)
                at_gemm_limit += any(share >= AT_LIMIT_ROW_PCT for _, share in limits)
                causes += [f"onca at {share:.0f}% of {name}'s speed" for name, share in limits]
                ours, theirs = device.get(key, {}).get("onca"), device.get(key, {}).get(peer)
                if ours is not None and theirs is not None:
                    # Onca's kernels at or ahead of the peer's: what it loses is host time.
                    host_bound += ours <= theirs
                    causes.append(f"device time {ours:.3f} vs {theirs:.3f} ms"
                                  + (": host-bound" if ours <= theirs else ""))
                ours_run, their_run = stamp[key].get("onca", ""), stamp[key].get(peer, "")
                if ours_run and their_run and ours_run != their_run:
                    # A run of some providers only (a limit row beside onca): the ratio spans two.
                    causes.append(f"{peer}'s row from another run, {their_run[:10]}")
                cause = f" ({'; '.join(causes)})" if causes else ""
                behind.append(f"{key[2]} {key[3]}: {best / times['onca']:.2f}x {peer}{cause}")
        ratios = [m["onca"] / m["liger"] for k, m in memory.items()
                  if k[:2] == (op, gpu) and m.get("onca") and m.get("liger")]
        memory_note = (f"peak memory at most {max(ratios):.2f}x liger's" if ratios
                       else "no liger-kernel memory to compare")
        on = f" on {short_gpu_name(gpu)} ({newest[(op, gpu)][:10]})" if gpu else ""
        notes = [f"{at_limit} of them at the copy-bandwidth limit"] if at_limit else []
        if at_gemm_limit:
            notes.append(f"{at_gemm_limit} at {AT_LIMIT_ROW_PCT:.0f}% or more of a limit row's speed")
        if host_bound:
            notes.append(f"{host_bound} host-bound, onca's device time at or below the peer's")
        limit_note = f" ({', '.join(notes)})" if notes else ""
        lines.append(f"{op}{on}: below the fastest peer at {len(behind)} of {len(points)} points"
                     f"{limit_note}; {memory_note}")
        lines += [f"    {b}" for b in behind]
    return "\n".join(lines)


def _limit_shares(times: dict[str, float]) -> list[tuple[str, float]]:
    """Onca's speed at a point as a percentage of each limit row's there (``gemm_limit``: the
    matmuls it must do, alone), by wall clock: a limit row is matmul-bound, milliseconds long, with
    no host path to speak of (and a CUDA-graph capture can change an op's plan: a chunk sized from
    the free memory sees the graph's pool)."""
    return [(name, 100.0 * limit / times["onca"]) for name, limit in sorted(times.items())
            if name.endswith(LIMIT_SUFFIX)]


def _fmt(value: float, digits: int, suffix: str = "") -> str:
    return "-" if math.isnan(value) else f"{value:.{digits}f}{suffix}"
