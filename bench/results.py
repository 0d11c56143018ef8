"""What a live replay reports: each run's metrics, results.json and records.json, tables and notes.

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

SERVER_COUNTERS = ("steps", "planned_steps", "unpriced_steps", "fit_steps", "rows_run", "rows_deferred",
                   "candidates", "admitted")


def server_delta(before: dict | None, after: dict | None) -> dict[str, Any] | None:
    """The scheduler's TAPER counters over this run (the server may have served other work before)."""
    if not after:
        return None
    base = before or {}
    delta: dict[str, Any] = {name: after.get(name, 0) - base.get(name, 0) for name in SERVER_COUNTERS}
    delta["admission_rate"] = delta["admitted"] / delta["candidates"] if delta["candidates"] else None
    delta["policy"], delta["planner_ms_mean"] = after.get("policy"), after.get("planner_ms_mean")
    delta["model"] = after.get("model")
    return delta


def stage_gaps_ms(outcomes: list[Outcome]) -> dict[str, float | None]:
    """Client-side fork/join cost: previous stage's last token -> a stage's first token (HTTP round
    trip, queueing, prefill of the branch headers or of the joined text). Chained into stage TPOT."""
    gaps: dict[bool, list[float]] = {True: [], False: []}
    for outcome in outcomes:
        prev = None
        for parallel, times in outcome.stages:
            if times:
                if prev is not None:
                    gaps[parallel].append(min(times) - prev)
                prev = max(times)
    out: dict[str, float | None] = {}
    for name, parallel in (("fork", True), ("join", False)):
        kind_gaps = np.asarray(gaps[parallel])
        for pct in (50, 99):
            gap_ms = float(np.percentile(kind_gaps, pct) * 1e3) if len(kind_gaps) else None
            out[f"{name}_gap_p{pct}_ms"] = gap_ms
    return out


def client_stalls(lags: list[tuple[float, float]], over_s: float = 0.1) -> dict[str, float | int]:
    """How long this process's event loop could not stamp deliveries: a starved client (a busy shared
    box) delays every chunk it reads, and the stages in flight absorb the delay into their TPOT."""
    late = [delay for _, delay in lags if delay > over_s]
    return {"max_ms": 1e3 * max((delay for _, delay in lags), default=0.0), "over_100ms": len(late),
            "stalled_s": sum(late)}


def _run_bookkeeping(run: Run, window_s: float, srv: dict | None) -> dict[str, Any]:
    started = [outcome for outcome in run.outcomes if outcome.started]
    errors = [outcome.error for outcome in started if outcome.error]
    return {
        "programs": len(run.outcomes), "started": len(started),
        "finished": sum(outcome.finished for outcome in started), "failed": len(errors),
        "first_failure": errors[0] if errors else None, "error": run.error, "warning": run.warning,
        "interrupted": run.interrupted,
        "window_s": window_s, "server": srv, "stage_gaps": stage_gaps_ms(started),
        "client_stalls": client_stalls(run.loop_lag_s),
    }


def summarize_run(run: Run, slo_s: float, schedule: Schedule,
                  slo_ttft_s: float | None = None) -> dict[str, Any]:
    """The simulator's per-policy results (bench.metrics.summarize) plus the replay's bookkeeping."""
    end = schedule.duration_s if run.t_stop is None else min(schedule.duration_s, run.t_stop)
    window = (0.0, max(end, 1e-9))
    regimes = [(regime.name, regime.start_s, min(regime.end_s, end))
               for regime in schedule.regimes if regime.start_s < end]
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
    keys = ("goodput_tok_s", "raw_throughput_tok_s", "slo_attainment", "p99_tpot_serial_ms",
            "p99_tpot_parallel_ms")
    return {name: None for name in keys} | {"per_regime": {regime: {} for regime, _, _ in regimes}}


# ---------------------------------------------------------------------------------------- files
def write_results(out: Path, results: dict[str, dict], config: dict, partial: bool, wall_s: float) -> Path:
    doc = {"policies": results, "config": config, "partial": partial, "wall_s": wall_s}
    return write_json(out / "results.json", doc, indent=1, default=float)


def write_records(out: Path, runs: dict[str, Run]) -> Path:
    """Raw per-program token delivery times (seconds from the run start), for offline analysis."""
    def program(outcome: Outcome) -> dict[str, Any]:
        spec = outcome.spec
        stages = [[parallel, [round(t_s, 6) for t_s in times]] for parallel, times in outcome.stages]
        return {"rid": spec.rid, "arrival_s": spec.arrival_s, "stages_spec": spec.stages,
                "finished": outcome.finished, "error": outcome.error, "stages": stages}

    doc = {name: {"programs": [program(outcome) for outcome in run.outcomes if outcome.started],
                  "client_stalls": [[round(t_s, 3), round(delay, 4)] for t_s, delay in run.loop_lag_s
                                    if delay > 0.1],
                  "steps": {column: list(values) for column, values in run.steps.arrays().items()}}
           for name, run in runs.items()}
    return write_json(out / "records.json", doc)


# ------------------------------------------------------------------------------- tables and notes
def _ratio_to(base: dict | None) -> Callable[[str, dict], str]:
    def cell(_name: str, row: dict) -> str:
        goodput, base_goodput = row.get("goodput_tok_s"), (base or {}).get("goodput_tok_s")
        return fmt(goodput / base_goodput if goodput is not None and base_goodput else None, nd=2)

    return cell


def comparison_table(results: dict[str, dict]) -> str:
    """One row per policy: goodput (and its ratio to serial and eager), the headline, TPOTs, admission."""
    def done(_name: str, row: dict) -> str:
        run = row.get("run", {})
        return f"{run.get('finished', 0)}/{run.get('started', 0)}"

    def probe_ms(_name: str, row: dict) -> str:
        return fmt((row.get("run", {}).get("probe") or {}).get("at_slo_rows_ms"))

    cols = [Col("goodput", 9, key("goodput_tok_s")), Col("x serial", 9, _ratio_to(results.get("serial"))),
            Col("x eager", 8, _ratio_to(results.get("eager"))),
            Col("raw tok/s", 10, key("raw_throughput_tok_s")), *HEADLINE,
            Col("P99 ser", 8, key("p99_tpot_serial_ms")), Col("P99 par", 8, key("p99_tpot_parallel_ms")),
            Col("step ms", 8, key("step_latency_mean_ms")), Col("admit", 7, key("admission_rate", True, 0)),
            Col("done", 9, done), Col("probe ms", 9, probe_ms), *LATENCY_COLS]
    return render(results, cols)


def regime_table(results: dict[str, dict]) -> str:
    """Attainment per regime, one row per policy (empty with fewer than two regimes)."""
    names = list(dict.fromkeys(regime for row in results.values() for regime in row.get("per_regime", {})))
    if len(names) < 2:
        return ""

    def att(regime: str) -> Col:
        return Col(regime, 12,
                   lambda _name, row: fmt(row["per_regime"].get(regime, {}).get("slo_attainment"), True))

    return render(results, [att(regime) for regime in names], name="attain")


def report_text(results: dict[str, dict]) -> str:
    """The comparison table, the per-regime table and whichever notes apply."""
    parts = [comparison_table(results), regime_table(results), drift_note(results), stall_note(results)]
    return "\n\n".join(part for part in parts if part)


def stall_note(results: dict[str, dict], worst_s: float = 0.25) -> str | None:
    stalls = {name: row.get("run", {}).get("client_stalls") or {} for name, row in results.items()}
    bad = {name: stall for name, stall in stalls.items() if stall.get("max_ms", 0) > 1e3 * worst_s}
    if not bad:
        return None
    return ("note: the client was starved of CPU (" + ", ".join(
        f"{name}: {stall['over_100ms']} stalls > 100 ms, worst {stall['max_ms']:.0f} ms"
        for name, stall in bad.items()) +
        "): deliveries in flight were stamped late, which inflates those stages' TPOT")


def drift_note(results: dict[str, dict], tolerance: float = 0.3) -> str | None:
    """Policies run one after another: say so when the machine's speed moved in between."""
    probed = {name: (row.get("run", {}).get("probe") or {}).get("at_slo_rows_ms")
              for name, row in results.items()}
    probed = {name: step_ms for name, step_ms in probed.items() if step_ms}
    if len(probed) > 1 and max(probed.values()) > (1 + tolerance) * min(probed.values()):
        return ("note: the probed step latency moved between policy runs (" +
                ", ".join(f"{name} {step_ms:.1f} ms" for name, step_ms in probed.items()) +
                "): the box's load changed; compare with care")
    return None
