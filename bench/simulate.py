"""The simulator's CLI: a trace schedule through `bench.engine` once per policy, then tables and results.json.

    python -m bench.simulate --trace CSV --schedule paper-3regime --policies serial,cap:2,cap:5,eager,taper \
        --slo-tpot-ms 50 --rho 0.8 --seed 0 --out DIR [--ablations] [--preset multiverse|sprint] \
        [--compress F] [--latency-model model.json] [--trace-outputs] [--max-running sglang|slo|N]

Every policy runs the same composed requests (bench.workload) through its own engine and controller
(bench.engine: the engine model, the controller's driver, the step windows); bench.metrics turns each
run's records into the results; bench.report prints the comparison and per-regime tables.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.capacity import latency_check
from bench.engine import EngineConfig, SimResult, Simulator, build_controller, resolve_max_running
from bench.metrics import load_point, summarize
from bench.report import HEADLINE, LATENCY_COLS, Col, fmt, key, num, render, write_json
from bench.workload import PRESETS, RequestSpec, Schedule, build_schedule, compose, load_trace, workload_stats
from branchwise.taper import POLICY_NAMES, LinearLatencyModel, default_model, load_model, parse_policy

_DEF = EngineConfig()


@dataclass(frozen=True, slots=True)
class Job:
    key: str  # name in results.json
    policy: str
    rho: float
    calibrated: bool = False  # the latency model came from --latency-model (the hook's refit differs)


def _run_job(job: Job, specs: list[RequestSpec], model: LinearLatencyModel, cfg: EngineConfig,
             duration: float, seed: int) -> SimResult:
    ctl = build_controller(job.policy, model, job.rho, job.calibrated)
    res = Simulator(specs, ctl, model, cfg, duration + cfg.drain_s, seed).run()
    res.policy = job.key
    return res


def run_jobs(jobs: list[Job], specs: list[RequestSpec], model: LinearLatencyModel, cfg: EngineConfig,
             duration: float, seed: int, workers: int = 1) -> dict[str, SimResult]:
    # slowest first: per-step policies dominate the wall time
    order = sorted(jobs, key=lambda job: not job.policy.startswith("taper"))
    if workers <= 1 or len(jobs) == 1:
        done = {job.key: _run_job(job, specs, model, cfg, duration, seed) for job in order}
    else:
        with ProcessPoolExecutor(workers) as pool:
            futs = {job.key: pool.submit(_run_job, job, specs, model, cfg, duration, seed) for job in order}
            done = {key: fut.result() for key, fut in futs.items()}
    return {job.key: done[job.key] for job in jobs}


def job_list(policies: list[str], rho: float, ablations: bool, calibrated: bool = False) -> list[Job]:
    jobs = [Job(policy, policy, rho, calibrated) for policy in policies]
    if ablations:
        names = {job.key for job in jobs}
        abl = ("taper-no-mean", "taper-no-overload", "taper-no-backlog", "taper-no-defer-cost", "taper-no-slack",
               "taper-no-replan", "taper-const-predictor")
        jobs += [Job(policy, policy, rho, calibrated) for policy in abl
                 if policy in POLICY_NAMES and policy not in names]
        jobs += [Job(f"taper(rho={alt:g})", "taper", alt, calibrated)
                 for alt in (0.5, 0.8, 1.0) if alt != rho]
    return jobs


# ------------------------------------------------------------------------------------------ tables
def comparison_table(results: dict[str, dict], baseline: str = "serial") -> str:
    """One row per policy: attainment over all arrivals, finished fraction and P99 TTFT first."""
    base = results.get(baseline, {}).get("goodput_tok_s")

    def ratio(_name: str, row: dict) -> str:
        return fmt(row["goodput_tok_s"] / base if base else None, nd=2)

    def high(_name: str, row: dict) -> str:
        return fmt(row.get("per_regime", {}).get("high", {}).get("slo_attainment"), True)

    cols = [Col("goodput", 9, key("goodput_tok_s")), Col("x serial", 9, ratio), *HEADLINE,
            Col("att-high", 9, high), Col("att-gap", 8, key("slo_attainment_gap", True)),
            Col("raw tok/s", 10, key("raw_throughput_tok_s")),
            Col("P99 ser", 9, lambda _name, row: num(row["p99_tpot_serial_ms"])),
            Col("P99 par", 9, lambda _name, row: num(row["p99_tpot_parallel_ms"])),
            Col("P99 gap", 9, lambda _name, row: num(row.get("max_gap_p99_ms"))),
            Col("step ms", 8, key("step_latency_mean_ms")), Col("admit", 7, key("admission_rate", True, 0)),
            *LATENCY_COLS]
    return render(results, cols, name_width=24)


def latency_lines(results: dict[str, dict], focus: str = "taper") -> list[str]:
    """bench.capacity's latency check (b) over the whole run and each regime: wherever a fixed-width
    policy holds 95%, taper holds and is within 1.05x the lowest decomposable P50 end to end."""
    if focus not in results:
        return []
    out = []
    windows = {"run": dict(results)}
    for regime in dict.fromkeys(regime for row in results.values() for regime in row.get("per_regime", {})):
        windows[regime] = {policy: row["per_regime"].get(regime, {}) for policy, row in results.items()}
    for name, per in windows.items():
        check = latency_check(0.0, {policy: load_point(0.0, row) for policy, row in per.items()}, focus)
        out.append(f"latency check ({name}): " + check.line(focus).split(": ", 1)[1])
    return out


def regime_table(results: dict[str, dict]) -> str:
    """Per regime: mean step latency, attainment, finished fraction, P99 TTFT, admission rate."""
    regimes = [regime for regime in ("low", "high", "moderate")
               if any(regime in row["per_regime"] for row in results.values())]
    if not regimes:
        return ""

    def cell(regime: str, name: str, pick: Any) -> Col:
        return Col(f"{regime[:4]} {name}", 12, lambda _name, row: pick(row["per_regime"].get(regime, {})))

    cols = [col for regime in regimes for col in (
        cell(regime, "step", lambda metrics: fmt(metrics.get("step_latency_mean_ms"))),
        cell(regime, "att", lambda metrics: fmt(metrics.get("slo_attainment"), True)),
        cell(regime, "done", lambda metrics: fmt(metrics.get("finished_frac"), True)),
        cell(regime, "TTFT99", lambda metrics: num(metrics.get("ttft_p99_s"))),
        cell(regime, "adm", lambda metrics: fmt(metrics.get("admission_rate"), True, 0)))]
    return render(results, cols, name_width=24)


# --------------------------------------------------------------------------------------------- CLI
@dataclass(frozen=True, slots=True)
class SimOptions:
    """What one `python -m bench.simulate` run does (its flags, parsed)."""

    trace: str
    out: str
    schedule: str = "paper-3regime"
    policies: tuple[str, ...] = ("serial", "cap:2", "cap:5", "eager", "taper")
    slo_tpot_ms: float = 50.0
    slo_ttft_s: float | None = None
    rho: float = 0.8
    seed: int = 0
    latency_model: str | None = None
    ablations: bool = False
    preset: str = "multiverse"
    compress: float = 1.0
    trace_outputs: bool = False
    max_running: str = "sglang"
    kv_tokens: int = _DEF.kv_tokens
    chunk_tokens: int = _DEF.chunk_tokens
    noise: float = _DEF.noise
    jobs: int = 1
    plots: bool = True


def parse_args(argv: list[str] | None) -> SimOptions:
    parser = argparse.ArgumentParser(prog="python -m bench.simulate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", required=True)
    parser.add_argument("--schedule", default="paper-3regime", help="unscaled | rate:X | paper-3regime")
    parser.add_argument("--policies", default="serial,cap:2,cap:5,eager,taper")
    parser.add_argument("--slo-tpot-ms", type=float, default=50.0)
    parser.add_argument("--slo-ttft-s", type=float, default=None,
                        help="TTFT target that attainment and goodput also require (default: none)")
    parser.add_argument("--rho", type=float, default=0.8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True)
    parser.add_argument("--latency-model",
                        help="JSON latency model (predictor.py format); default: calibrated")
    parser.add_argument("--ablations", action="store_true",
                        help="add taper's terms off one at a time (no-mean, no-overload, no-backlog), the "
                             "paper's ablations (no-slack, no-replan, const-predictor) and taper at rho "
                             "0.5 / 1.0")
    parser.add_argument("--preset", default="multiverse", choices=sorted(PRESETS))
    parser.add_argument("--compress", type=float, default=1.0, help="run F times shorter at the same load")
    parser.add_argument("--trace-outputs", action="store_true", help="output lengths from the trace")
    parser.add_argument("--max-running", default="sglang",
                        help="running-request limit (branches count): sglang (SGLang's default for the "
                             "pool), slo (sensitivity: the largest batch whose T stays within the SLO) or N")
    parser.add_argument("--kv-tokens", type=int, default=_DEF.kv_tokens)
    parser.add_argument("--chunk-tokens", type=int, default=_DEF.chunk_tokens)
    parser.add_argument("--noise", type=float, default=_DEF.noise)
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1))
    parser.add_argument("--no-plots", action="store_true")
    args = parser.parse_args(argv)
    policies = tuple(name.strip() for name in args.policies.split(",") if name.strip())
    return SimOptions(
        args.trace, args.out, args.schedule, policies, args.slo_tpot_ms, args.slo_ttft_s, args.rho, args.seed,
        args.latency_model, args.ablations, args.preset, args.compress, args.trace_outputs, args.max_running,
        args.kv_tokens, args.chunk_tokens, args.noise, args.jobs, not args.no_plots)


@dataclass(slots=True)
class _Setup:
    """The run's inputs, checked: the composed requests, the latency model and the engine."""

    schedule: Schedule
    specs: list[RequestSpec]
    model: LinearLatencyModel
    cfg: EngineConfig


def _setup(opts: SimOptions) -> _Setup:
    """Load and check everything a run needs; ValueError names what is wrong."""
    trace = load_trace(opts.trace)
    model = load_model(opts.latency_model) if opts.latency_model else default_model()
    sched = build_schedule(trace, opts.schedule, opts.compress)
    for policy in opts.policies:
        parse_policy(policy)
    if not isinstance(model, LinearLatencyModel):
        raise ValueError("the engine needs a linear latency model")
    specs = compose(trace, sched, opts.preset, opts.seed, trace_outputs=opts.trace_outputs)
    slo_s = opts.slo_tpot_ms / 1e3
    cap = resolve_max_running(opts.max_running, model, slo_s, specs)
    cfg = EngineConfig(slo_s=slo_s, max_running=cap, kv_tokens=opts.kv_tokens,
                       chunk_tokens=opts.chunk_tokens, noise=opts.noise, drain_s=600.0 / opts.compress)
    return _Setup(sched, specs, model, cfg)


def _document(opts: SimOptions, setup: _Setup, results: dict[str, dict],
              phase_s: dict[str, float]) -> dict[str, Any]:
    return {
        "policies": results,
        "config": {
            "trace": opts.trace, "schedule": opts.schedule, "compress": opts.compress, "preset": opts.preset,
            "trace_outputs": opts.trace_outputs, "seed": opts.seed, "rho": opts.rho,
            "slo_ttft_s": opts.slo_ttft_s,
            "engine": asdict(setup.cfg),
            "latency_model": dict(zip(("c0", "c_seq", "c_ctx", "c_tok"), setup.model.coefs(), strict=True)),
            "workload": workload_stats(setup.specs), "duration_s": setup.schedule.duration_s,
        },
        "phase_s": phase_s,
    }


def simulate(opts: SimOptions, setup: _Setup, start_t: float, phase_s: dict[str, float]) -> dict[str, Any]:
    """Every policy's run, its metrics and plots; results.json's document (written by the caller)."""
    jobs = job_list(list(opts.policies), opts.rho, opts.ablations, calibrated=bool(opts.latency_model))
    sims = run_jobs(jobs, setup.specs, setup.model, setup.cfg, setup.schedule.duration_s, opts.seed,
                    opts.jobs)
    phase_s["simulate"] = time.perf_counter() - start_t - sum(phase_s.values())
    window = (0.0, setup.schedule.duration_s)
    regimes = [(regime.name, regime.start_s, regime.end_s) for regime in setup.schedule.regimes]
    horizon = setup.schedule.duration_s + setup.cfg.drain_s
    results = {key: summarize(sim.records, setup.cfg.slo_s, window, regimes, sim.steps, opts.slo_ttft_s,
                              horizon) | {"sim": sim.stats}
               for key, sim in sims.items()}
    phase_s["metrics"] = time.perf_counter() - start_t - sum(phase_s.values())
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    doc = _document(opts, setup, results, phase_s)
    if opts.plots:
        from bench.plots import plot_run

        plot_run(sims, setup.schedule, setup.cfg.slo_s, out)
        phase_s["plots"] = time.perf_counter() - start_t - sum(phase_s.values())
    return doc


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(argv)
    start_t = time.perf_counter()
    try:
        setup = _setup(opts)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    doc = simulate(opts, setup, start_t, {"workload": time.perf_counter() - start_t})
    doc["wall_s"] = time.perf_counter() - start_t
    path = write_json(Path(opts.out) / "results.json", doc, indent=1)
    print(comparison_table(doc["policies"]))
    print()
    print(regime_table(doc["policies"]))
    print("\n".join(["", *latency_lines(doc["policies"])]))
    print(f"\n{len(setup.specs)} requests, {setup.schedule.duration_s / 60:.0f} min simulated, "
          f"wall {time.perf_counter() - start_t:.1f}s -> {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
