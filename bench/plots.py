"""Plots (matplotlib, Agg backend, PNG out): Figure 2-style panels over time of a simulator or replay
run, and the two axes of a capacity run against offered load."""

from __future__ import annotations

import io
from collections.abc import Callable
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402
from PIL import Image  # noqa: E402  (matplotlib's own dependency)

from bench.metrics import timeseries  # noqa: E402

# (key in timeseries, title, y label, scale)
PANELS = (
    ("step_latency_mean_ms", "step latency", "ms", 1.0),
    ("raw_throughput_tok_s", "raw throughput", "tok/s", 1.0),
    ("goodput_tok_s", "goodput", "tok/s", 1.0),
    ("slo_attainment", "SLO attainment", "%", 100.0),
    ("p99_tpot_serial_ms", "serial P99 TPOT", "ms", 1.0),
    ("p99_tpot_parallel_ms", "parallel P99 TPOT (effective)", "ms", 1.0),
    ("admission_rate", "branch admission rate", "%", 100.0),
    ("ttft_mean_s", "mean TTFT (queueing)", "s", 1.0),
)


def plot_run(sims: dict, schedule, slo_s: float, out: str | Path, bins: int = 120) -> list[Path]:
    """Write figure2.png (all panels) for {name: SimResult}; returns the written paths."""
    out = Path(out)
    window = (0.0, schedule.duration_s)
    bin_s = schedule.duration_s / bins
    series = {name: timeseries(sim.records, slo_s, window, bin_s, sim.steps) for name, sim in sims.items()}
    fig, axes = plt.subplots(3, 3, figsize=(16, 12), sharex=True)
    axes = axes.ravel()
    t_min = np.arange(0.0, schedule.duration_s, bin_s) / 60.0
    rate = np.histogram(schedule.arrival_s, bins=len(t_min), range=window)[0] / bin_s
    axes[0].plot(t_min, rate, color="k")
    axes[0].set_title("(a) arrival rate")
    axes[0].set_ylabel("req/s")
    for panel, (key, title, unit, scale) in zip(axes[1:], PANELS, strict=True):
        for name, run_series in series.items():
            panel.plot(run_series["t_s"] / 60.0, run_series[key] * scale, label=name, lw=1.2)
        if key.startswith(("p99", "step")):
            panel.axhline(slo_s * 1e3, color="grey", ls="--", lw=0.8)
        panel.set_title(title)
        panel.set_ylabel(unit)
    for panel in axes:
        for regime in schedule.regimes[1:]:
            panel.axvline(regime.start_s / 60.0, color="grey", ls=":", lw=0.8)
    for panel in axes[-3:]:
        panel.set_xlabel("minute")
    axes[1].legend(fontsize=8)
    fig.subplots_adjust(left=0.05, right=0.98, bottom=0.05, top=0.96, wspace=0.22, hspace=0.25)
    path = out / "figure2.png"
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return [path]


MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")


def plot_capacity(doc: dict, path: Path, title: str, target: float, holds: Callable[[dict], bool],
                  latency_key: str = "decomp_e2e_p50_s") -> Path:
    """The two axes against offered load, one line per policy: decomposable P50 end to end on top
    (points that do not `hold` hollow), attainment underneath with the `target` line; each policy's
    capacity dotted in its colour, the fluid bound dashed."""
    fig, (ax_l, ax_a) = plt.subplots(2, 1, figsize=(9, 8), sharex=True, height_ratios=(3, 2))
    bound = doc.get("fluid_bound_rps")
    keys: list[Line2D] = []
    for j, (name, policy) in enumerate(doc["policies"].items()):
        pts = policy["points"]
        rate = np.array([point["rate"] for point in pts])
        lat = np.array([np.nan if point.get(latency_key) is None else point[latency_key] for point in pts])
        att = np.array([np.nan if point.get("attainment") is None else 100 * point["attainment"]
                        for point in pts])
        marker = MARKERS[j % len(MARKERS)]
        line, = ax_l.plot(rate, lat, lw=1.2)
        color = line.get_color()
        keys.append(Line2D([], [], color=color, marker=marker, lw=1.2, label=name))
        held = np.array([holds(point) for point in pts], bool)
        ax_l.scatter(rate[held], lat[held], color=color, marker=marker, zorder=3)
        ax_l.scatter(rate[~held], lat[~held], facecolors="none", edgecolors=color, marker=marker, zorder=3)
        ax_a.plot(rate, att, marker=marker, color=color, lw=1.2)
        for panel in (ax_l, ax_a):
            panel.axvline(policy["capacity_rps"], color=color, ls=":", lw=1)
    for panel in (ax_l, ax_a):
        if bound:
            panel.axvline(bound, color="grey", ls="--", lw=1)
        panel.grid(alpha=0.3)
    ax_a.axhline(100 * target, color="grey", lw=0.8)
    ax_l.set_ylabel("decomposable P50 end to end (s)")
    ax_l.set_title(f"{title}\nhollow: not held; dotted: capacity; dashed: fluid bound"
                   + (f" {bound:.3f} req/s" if bound else ""), fontsize=9)
    ax_l.legend(handles=keys, fontsize=8)
    ax_a.set_ylabel("attainment over all arrivals (%)")
    ax_a.set_xlabel("offered load (req/s)")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, dpi=90)
    plt.close(fig)
    # a 64-colour palette keeps the file small enough for docs/ (lines and markers need no more)
    Image.open(buf).convert("RGB").quantize(colors=64).save(path, optimize=True)
    return path
