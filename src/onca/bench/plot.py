"""PNG charts from the results CSV: per op, sweep axis and metric, one panel per mode. A numeric
axis (tokens, vocabulary) gets one line per provider with its 20th–80th percentile band; a
categorical one (models, option sets) grouped bars with the band as error bars. A limit row
(``*_limit``, never a peer) is drawn hatched."""

from __future__ import annotations

import math
import os
import re

from onca.bench.records import axis, latest, read_csv
from onca.bench.report import LIMIT_SUFFIX, ordered
from onca.bench.spec import MODES

COLORS = {"onca": "#d1495b", "torch": "#8d99ae", "torch_compile": "#00798c", "liger": "#edae49",
          "trl": "#6a4c93", "cut_cross_entropy": "#2e4057", "gemm_limit": "#5c5c5c"}


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9.]+", "-", text.lower()).strip("-")


def _x_sort_key(value: str):
    try:
        return (0, float(value))
    except ValueError:
        return (1, value)


def plot_csv(csv_path: str, out_dir: str, ops: list[str] | None = None, include_cpu: bool = False) -> list[str]:
    """Draw every chart the CSV holds (newest run of each point); returns the files written."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RuntimeError("charts need matplotlib: pip install 'onca[plot]'") from None

    rows = [r for r in latest(read_csv(csv_path)) if include_cpu or r["gpu_name"] != "cpu"]
    if ops:
        rows = [r for r in rows if r["kernel_name"] in ops]
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        key = (r["kernel_name"], r["gpu_name"], r["dtype"], *axis(r), r["metric_name"])
        groups.setdefault(key, []).append(r)
    # Two sweeps of one op over the same x name (fused MoE's tokens at two expert shapes) get their
    # labels into the chart's file name; every other chart keeps its name.
    names = [(op, gpu, dtype, sweep, x_name, metric) for op, gpu, dtype, sweep, x_name, _, metric in groups]

    written = []
    for (op, gpu, dtype, sweep, x_name, x_label, metric), group in sorted(groups.items()):
        if all(math.isnan(r["y_value_50"]) for r in group):
            continue  # nothing measured (e.g. memory on the CPU)
        modes = [m for m in MODES if any(r["kernel_operation_mode"] == m for r in group)]
        xs = sorted({r["x_value"] for r in group}, key=_x_sort_key)
        numeric = all(_x_sort_key(x)[0] == 0 for x in xs)
        fig, axes = plt.subplots(1, len(modes), figsize=(5.2 * len(modes), 4.2), squeeze=False)
        for ax, mode in zip(axes[0], modes):
            providers = [p for p in ordered(r["kernel_provider"] for r in group)
                         if any(r["kernel_operation_mode"] == mode and r["kernel_provider"] == p
                                and not math.isnan(r["y_value_50"]) for r in group)]
            for index, provider in enumerate(providers):
                pts = {r["x_value"]: r for r in group
                       if r["kernel_operation_mode"] == mode and r["kernel_provider"] == provider}
                y50 = [pts[x]["y_value_50"] if x in pts else math.nan for x in xs]
                y20 = [pts[x]["y_value_20"] if x in pts else math.nan for x in xs]
                y80 = [pts[x]["y_value_80"] if x in pts else math.nan for x in xs]
                color = COLORS.get(provider)
                if numeric:
                    xv = [float(x) for x in xs]
                    ax.plot(xv, y50, marker="o", ms=3.5, lw=1.8, label=provider, color=color)
                    ax.fill_between(xv, y20, y80, alpha=0.2, color=color, lw=0)
                    continue
                width = 0.8 / len(providers)
                xv = [i - 0.4 + width * (index + 0.5) for i in range(len(xs))]
                errors = [[max(0.0, m - lo) for m, lo in zip(y50, y20)], [max(0.0, hi - m) for m, hi in zip(y50, y80)]]
                ax.bar(xv, y50, width, label=provider, color=color, yerr=errors, ecolor="#333333", capsize=2,
                       hatch="//" if provider.endswith(LIMIT_SUFFIX) else None,
                       alpha=0.55 if provider.endswith(LIMIT_SUFFIX) else 1.0)
            ax.set_title(f"{mode}")
            ax.set_xlabel(group[0]["x_label"])
            ax.set_ylabel(f"{metric} ({group[0]['metric_unit']})")
            if numeric:
                ax.set_xscale("log", base=2)
                ax.set_xticks([float(x) for x in xs])
                ax.set_xticklabels(xs, rotation=45, ha="right", fontsize=7)
            else:
                ax.set_xticks(range(len(xs)))
                ax.set_xticklabels(xs, rotation=45, ha="right", fontsize=7)
            ax.set_ylim(bottom=0)
            ax.grid(alpha=0.3)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=8)
        fig.suptitle(f"{op} · {metric} · {sweep} over {x_name} · {gpu} · {dtype}", fontsize=10)
        fig.tight_layout()
        shared = names.count((op, gpu, dtype, sweep, x_name, metric)) > 1
        axis_name = _slug(x_label if shared else x_name)
        path = os.path.join(out_dir, op, f"{_slug(gpu)}-{dtype}-{sweep}-{axis_name}-{metric}.png")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written
