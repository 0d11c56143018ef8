"""What a live replay reports: each run's metrics, results.json and records.json, the tables and notes.

`summarize_run` gives the simulator's per-policy results (bench.metrics.summarize over every program
that arrived in the window) plus the replay's bookkeeping: program counts and failures, the server's
TAPER counters over the run, the client-side fork/join gaps, and the client's own stalls.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from bench.client import Outcome, Run
from bench.metrics import summarize
from bench.report import HEADLINE, LATENCY_COLS, Col, fmt, key, render, write_json
from bench.workload import Schedule

SERVER_COUNTERS = ("steps", "planned_steps", "rows_run", "rows_deferred", "candidates", "admitted")


def server_delta(before: dict | None, after: dict | None) -> dict[str, Any] | None:
    """The scheduler's TAPER counters over this run (the server may have served other work before)."""
    if not after:
        return None
    b = before or {}
    d: dict[str, Any] = {k: after.get(k, 0) - b.get(k, 0) for k in SERVER_COUNTERS}
    d["admission_rate"] = d["admitted"] / d["candidates"] if d["candidates"] else None
    d["policy"], d["planner_ms_mean"], d["model"] = after.get("policy"), after.get("planner_ms_mean"), after.get("model")
    return d


def stage_gaps_ms(outcomes: list[Outcome]) -> dict[str, float | None]:
    """Client-side fork/join cost: previous stage's last token -> a stage's first token (HTTP round
    trip, queueing, prefill of the branch headers or of the joined text). Chained into stage TPOT."""
    gaps: dict[bool, list[float]] = {True: [], False: []}
    for o in outcomes:
        prev = None
        for par, ts in o.stages:
            if ts:
                if prev is not None:
                    gaps[par].append(min(ts) - prev)
                prev = max(ts)
    out: dict[str, float | None] = {}
    for name, par in (("fork", True), ("join", False)):
        g = np.asarray(gaps[par])
        for q in (50, 99):
            out[f"{name}_gap_p{q}_ms"] = float(np.percentile(g, q) * 1e3) if len(g) else None
    return out


def client_stalls(lags: list[tuple[float, float]], over_s: float = 0.1) -> dict[str, float | int]:
    """How long this process's event loop could not stamp deliveries: a starved client (a busy shared
    box) delays every chunk it reads, and the stages in flight absorb the delay into their TPOT."""
    late = [d for _, d in lags if d > over_s]
    return {"max_ms": 1e3 * max((d for _, d in lags), default=0.0), "over_100ms": len(late),
            "stalled_s": sum(late)}


def _run_bookkeeping(run: Run, window_s: float, srv: dict | None) -> dict[str, Any]:
    started = [o for o in run.outcomes if o.started]
    errors = [o.error for o in started if o.error]
    return {
        "programs": len(run.outcomes), "started": len(started),
        "finished": sum(o.finished for o in started), "failed": len(errors),
        "first_failure": errors[0] if errors else None, "error": run.error, "warning": run.warning,
        "interrupted": run.interrupted,
        "window_s": window_s, "server": srv, "stage_gaps": stage_gaps_ms(started),
        "client_stalls": client_stalls(run.loop_lag_s),
    }


def summarize_run(run: Run, slo_s: float, schedule: Schedule, slo_ttft_s: float | None = None) -> dict[str, Any]:
    """The simulator's per-policy results (bench.metrics.summarize) plus the replay's bookkeeping."""
    end = schedule.duration_s if run.t_stop is None else min(schedule.duration_s, run.t_stop)
    window = (0.0, max(end, 1e-9))
    regimes = [(g.name, g.start_s, min(g.end_s, end)) for g in schedule.regimes if g.start_s < end]
    recs = run.records
    horizon = run.t_end if run.t_end is not None else window[1]
    out = (summarize(recs, slo_s, window, regimes, run.steps, slo_ttft_s=slo_ttft_s, horizon_s=horizon)
           if recs else _empty(regimes))
    srv = server_delta(run.report_before, run.report_after)
    out["admission_rate"] = srv["admission_rate"] if srv else out.get("admission_rate")
    out["run"] = _run_bookkeeping(run, window[1], srv)
    out["partial"] = run.interrupted or run.t_stop is not None
    return out


def _empty(regimes: list[tuple[str, float, float]]) -> dict[str, Any]:
    keys = ("goodput_tok_s", "raw_throughput_tok_s", "slo_attainment", "p99_tpot_serial_ms", "p99_tpot_parallel_ms")
    return {k: None for k in keys} | {"per_regime": {g: {} for g, _, _ in regimes}}


# ---------------------------------------------------------------------------------------- files
def write_results(out: Path, results: dict[str, dict], config: dict, partial: bool, wall_s: float) -> Path:
    doc = {"policies": results, "config": config, "partial": partial, "wall_s": wall_s}
    return write_json(out / "results.json", doc, indent=1, default=float)


def write_records(out: Path, runs: dict[str, Run]) -> Path:
    """Raw per-program token delivery times (seconds from the run start), for offline analysis."""
    doc = {k: {"programs": [{"rid": o.spec.rid, "arrival_s": o.spec.arrival_s, "stages_spec": o.spec.stages,
                             "finished": o.finished, "error": o.error,
                             "stages": [[par, [round(t, 6) for t in ts]] for par, ts in o.stages]}
                            for o in r.outcomes if o.started],
               "client_stalls": [[round(t, 3), round(d, 4)] for t, d in r.loop_lag_s if d > 0.1],
               "steps": {k2: list(v) for k2, v in r.steps.arrays().items()}} for k, r in runs.items()}
    return write_json(out / "records.json", doc)


# ------------------------------------------------------------------------------- tables and notes
def _ratio_to(base: dict | None) -> Callable[[str, dict], str]:
    def cell(_k: str, r: dict) -> str:
        g, b = r.get("goodput_tok_s"), (base or {}).get("goodput_tok_s")
        return fmt(g / b if g is not None and b else None, nd=2)

    return cell


def comparison_table(results: dict[str, dict]) -> str:
    """One row per policy: goodput (and its ratio to off and eager), the headline, TPOTs, admission."""
    def done(_k: str, r: dict) -> str:
        run = r.get("run", {})
        return f"{run.get('finished', 0)}/{run.get('started', 0)}"

    def probe_ms(_k: str, r: dict) -> str:
        return fmt((r.get("run", {}).get("probe") or {}).get("at_slo_rows_ms"))

    cols = [Col("goodput", 9, key("goodput_tok_s")), Col("x off", 7, _ratio_to(results.get("off"))),
            Col("x eager", 8, _ratio_to(results.get("eager"))), Col("raw tok/s", 10, key("raw_throughput_tok_s")),
            *HEADLINE, Col("P99 ser", 8, key("p99_tpot_serial_ms")), Col("P99 par", 8, key("p99_tpot_parallel_ms")),
            Col("step ms", 8, key("step_latency_mean_ms")), Col("admit", 7, key("admission_rate", True, 0)),
            Col("done", 9, done), Col("probe ms", 9, probe_ms), *LATENCY_COLS]
    return render(results, cols)


def regime_table(results: dict[str, dict]) -> str:
    """Attainment per regime, one row per policy (empty with fewer than two regimes)."""
    names = list(dict.fromkeys(g for r in results.values() for g in r.get("per_regime", {})))
    if len(names) < 2:
        return ""

    def att(g: str) -> Col:
        return Col(g, 12, lambda _k, r: fmt(r["per_regime"].get(g, {}).get("slo_attainment"), True))

    return render(results, [att(g) for g in names], name="attain")


def report_text(results: dict[str, dict]) -> str:
    """The comparison table, the per-regime table and whichever notes apply."""
    parts = [comparison_table(results), regime_table(results), drift_note(results), stall_note(results)]
    return "\n\n".join(p for p in parts if p)


def stall_note(results: dict[str, dict], worst_s: float = 0.25) -> str | None:
    st = {k: r.get("run", {}).get("client_stalls") or {} for k, r in results.items()}
    bad = {k: v for k, v in st.items() if v.get("max_ms", 0) > 1e3 * worst_s}
    if not bad:
        return None
    return ("note: the client was starved of CPU (" + ", ".join(
        f"{k}: {v['over_100ms']} stalls > 100 ms, worst {v['max_ms']:.0f} ms" for k, v in bad.items()) +
        "): deliveries in flight were stamped late, which inflates those stages' TPOT")


def drift_note(results: dict[str, dict], tolerance: float = 0.3) -> str | None:
    """Policies run one after another: say so when the machine's speed moved in between."""
    t = {k: (r.get("run", {}).get("probe") or {}).get("at_slo_rows_ms") for k, r in results.items()}
    t = {k: v for k, v in t.items() if v}
    if len(t) > 1 and max(t.values()) > (1 + tolerance) * min(t.values()):
        return ("note: the probed step latency moved between policy runs (" +
                ", ".join(f"{k} {v:.1f} ms" for k, v in t.items()) + "): the box's load changed; compare with care")
    return None
