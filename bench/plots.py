"""Figure 2-style panels from simulator (or replay) runs: matplotlib, Agg backend, PNG out."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

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
    series = {k: timeseries(s.records, slo_s, window, bin_s, s.steps) for k, s in sims.items()}
    fig, axes = plt.subplots(3, 3, figsize=(16, 12), sharex=True)
    axes = axes.ravel()
    t_min = np.arange(0.0, schedule.duration_s, bin_s) / 60.0
    rate = np.histogram(schedule.arrival_s, bins=len(t_min), range=window)[0] / bin_s
    axes[0].plot(t_min, rate, color="k")
    axes[0].set_title("(a) arrival rate")
    axes[0].set_ylabel("req/s")
    for ax, (key, title, unit, scale) in zip(axes[1:], PANELS, strict=True):
        for name, ts in series.items():
            ax.plot(ts["t_s"] / 60.0, ts[key] * scale, label=name, lw=1.2)
        if key.startswith(("p99", "step")):
            ax.axhline(slo_s * 1e3, color="grey", ls="--", lw=0.8)
        ax.set_title(title)
        ax.set_ylabel(unit)
    for ax in axes:
        for g in schedule.regimes[1:]:
            ax.axvline(g.start_s / 60.0, color="grey", ls=":", lw=0.8)
    for ax in axes[-3:]:
        ax.set_xlabel("minute")
    axes[1].legend(fontsize=8)
    fig.subplots_adjust(left=0.05, right=0.98, bottom=0.05, top=0.96, wspace=0.22, hspace=0.25)
    path = out / "figure2.png"
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return [path]
