"""Replay a trace schedule against live Branchwise servers: goodput and SLO attainment per policy.

    python -m bench.replay --url URL --schedule rate:6 --duration-s 60 --out DIR [--policy-label taper]
    python -m bench.replay --launch --model models/tiny --compare --policies serial,eager,taper --out runs/bench

Every scheduled arrival becomes a client-side fork/join program (bench.programs), run on the server
by bench.client at its arrival time; bench.metrics turns the token delivery times into goodput, SLO
attainment and per-class P99 TPOT. The operating point (SLO, arrival rate, taper's T(S)) is
calibrated from a probe of the first server unless given (bench.probe). Results (bench.results)
are saved after every policy, so a dead server, a failed start or Ctrl-C keeps what ran. What is
measured and how: docs/design/bench-micro.md. Live points at one stationary load (what the load
sweeps run) are bench.point's `run_point`.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench.cli import add_server_source, policy_list
from bench.client import Outcome, Run, Target, execute, server_report
from bench.live import ServerSettings
from bench.metrics import RequestRecord, StepLog
from bench.probe import Calibration, Point, Probe, calibrate, probe_url
from bench.programs import Scaling, build_programs, fit_schedule, mean_demand_tok_s
from bench.results import report_text, summarize_run, write_records, write_results
from bench.workload import DEFAULT_TRACE, PRESETS, RequestSpec, Schedule, load_trace, workload_stats
from branchwise.taper.predictor import load_model
from branchwise.tools.launch import LocalServer, ServerError

_DEF = Scaling()


@dataclass(frozen=True, slots=True)
class ReplayOptions:
    """One `python -m bench.replay` invocation (its flags, parsed; see parse_args for each)."""

    out: str
    cal: Calibration  # the workload and the operating point (given, or from a probe)
    url: str | None = None
    model: str = "models/tiny"
    # one run per policy; otherwise one run labelled policy_label (or the server's policy)
    compare: bool = False
    policies: tuple[str, ...] = ("serial", "eager", "taper")
    policy_label: str | None = None
    trace: str = DEFAULT_TRACE
    drain_s: float = 30.0
    scaling: Scaling = _DEF
    taper_rho: float = 0.8
    server_args: str = ""
    max_total_tokens: int = 65536
    vocab: int = 400
    server_threads: int = 1
    stream_interval: int = 8
    poll_s: float = 1.0
    plots: bool = True
    progress: bool = True

    @property
    def launch(self) -> bool:
        return self.cal.launch


def _auto_float(text: str) -> float | None:
    if text == "auto":
        return None
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or 'auto', got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text!r}")
    return value


_POINT_FLAGS = (  # flag, type, default, help
    ("--slo-tpot-ms", _auto_float, None, "ms | auto: the probed step latency at --slo-rows"),
    ("--rate-scale", _auto_float, None,
     "arrival rates x this | auto: mean demand = --load x the probed tokens/s at --slo-rows"),
    ("--slo-rows", float, 32.0, None),
    ("--slo-context", float, 256.0,
     "KV tokens per row for the auto SLO (the default workload decodes at 250-310 on average)"),
    ("--slo-floor", float, 2.5, "auto SLO >= this x the probed T(1)"),
    ("--load", _auto_float, 0.35,
     "mean demanded tok/s as a fraction of the probed decode rate at the SLO "
     "composition (the 3-regime schedule peaks at ~2x its mean); load sweeps: python -m bench.sweep"),
    ("--latency-model", str, "auto",
     "T(S) JSON for --launch servers | auto: the probe's fit | none: server default, refit online"),
)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.replay",
                                     description=__doc__.split("\n\n")[0])
    add_server_source(parser, "a running server (its --branch-policy is fixed)",
                      "start a server per policy (branchwise.tools.launch)")
    parser.add_argument("--compare", action="store_true", help="run the schedule once per --policies")
    parser.add_argument("--policies", type=policy_list, default="serial,eager,taper")
    parser.add_argument("--policy-label",
                        help="name of a single --url run (default: the server's policy)")
    parser.add_argument("--trace", default=DEFAULT_TRACE)
    parser.add_argument("--schedule", default="paper-3regime", help="unscaled | rate:X | paper-3regime")
    parser.add_argument("--duration-s", type=float, default=60.0, help="the schedule is compressed to this")
    parser.add_argument("--drain-s", type=float, default=30.0,
                        help="wait this long after the schedule for stragglers")
    parser.add_argument("--preset", default="multiverse", choices=sorted(PRESETS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-scale", type=float, default=_DEF.output_scale)
    parser.add_argument("--max-stage-tokens", type=int, default=_DEF.max_stage_tokens)
    parser.add_argument("--prompt-scale", type=float, default=_DEF.prompt_scale)
    parser.add_argument("--max-prompt-tokens", type=int, default=_DEF.max_prompt_tokens)
    parser.add_argument("--max-program-tokens", type=int, default=_DEF.max_program_tokens)
    point_flags = parser.add_argument_group(
        "operating point (auto: calibrated from a probe of the first server)")
    for flag, kind, default, text in _POINT_FLAGS:
        point_flags.add_argument(flag, type=kind, default=default, help=text)
    parser.add_argument("--taper-rho", type=float, default=0.8, help="with --launch")
    parser.add_argument("--server-args", default="", help="extra flags for --launch servers")
    parser.add_argument("--max-total-tokens", type=int, default=65536,
                        help="KV pool of --launch servers: room for every live prefix, "
                             "so no policy pays re-prefills")
    parser.add_argument("--vocab", type=int, default=400, help="prompt token ids are drawn below this")
    parser.add_argument("--server-threads", type=int, default=1,
                        help="OMP threads of --launch servers; 0: torch's default")
    parser.add_argument("--stream-interval", type=int, default=8,
                        help="chunk every n tokens: 8x less detokenize/HTTP work; stage TPOT stays exact")
    parser.add_argument("--out", required=True)
    parser.add_argument("--poll-s", type=float, default=1.0,
                        help="server /metrics poll period; 0: no step series")
    parser.add_argument("--no-plots", action="store_true")
    parser.add_argument("--no-progress", action="store_true")
    return parser


def parse_args(argv: list[str] | None) -> ReplayOptions:
    """The flags as ReplayOptions; a bad value exits 2 with the reason (argparse)."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.load is None:
        parser.error("--load takes a number > 0")
    try:
        scaling = Scaling(args.output_scale, args.max_stage_tokens, args.prompt_scale,
                          args.max_prompt_tokens, args.max_program_tokens)
    except ValueError as err:
        parser.error(str(err))
    policies = args.policies
    cal = Calibration(args.schedule, args.duration_s, args.preset, args.seed, args.slo_tpot_ms,
                      args.rate_scale, args.slo_rows, args.slo_context, args.slo_floor, args.load,
                      args.latency_model, args.launch)
    return ReplayOptions(
        args.out, cal, args.url, args.model, args.compare, policies, args.policy_label, args.trace,
        args.drain_s, scaling, args.taper_rho, args.server_args, args.max_total_tokens, args.vocab,
        args.server_threads, args.stream_interval, args.poll_s, not args.no_plots, not args.no_progress)


# ------------------------------------------------------------------------------------- servers
def _server(opts: ReplayOptions, policy: str, point: Point | None) -> LocalServer:
    """A --launch server (not started) for `policy` at the operating point, once it is known."""
    settings = ServerSettings(opts.model, opts.taper_rho, opts.server_threads, opts.max_total_tokens,
                              opts.server_args)
    return settings.server(policy, point.slo_tpot_ms if point else None,
                           point.latency_model if point else None)


# ---------------------------------------------------------------------------------- one bench run
@dataclass(slots=True)
class _Plotted:  # what bench.plots reads from a run
    records: list[RequestRecord]
    steps: StepLog


@dataclass(slots=True)
class Workload:
    """The programs every policy runs, once the operating point is known, and their config record."""

    schedule: Schedule
    specs: list[RequestSpec]
    config: dict[str, Any]


def prepare(opts: ReplayOptions, trace: Any, point: Point) -> Workload:
    schedule = fit_schedule(trace, opts.cal.schedule, opts.cal.duration_s, point.rate_scale)
    specs = build_programs(trace, schedule, opts.cal.preset, opts.cal.seed, opts.scaling)
    stats = workload_stats(specs)
    auto_slo, auto_rate = opts.cal.slo_tpot_ms is None, opts.cal.rate_scale is None
    config = {
        "trace": opts.trace, "schedule": schedule.name, "duration_s": schedule.duration_s,
        "rate_scale": point.rate_scale, "preset": opts.cal.preset, "seed": opts.cal.seed,
        "scaling": asdict(opts.scaling),
        "slo_tpot_ms": point.slo_tpot_ms, "slo_rows": opts.cal.slo_rows if auto_slo else None,
        "slo_floor": opts.cal.slo_floor if auto_slo else None,
        "slo_context": opts.cal.slo_context if auto_slo else None,
        "load": opts.cal.load if auto_rate else None,
        "demand_tok_s": mean_demand_tok_s(specs, schedule.duration_s),
        "taper_rho": opts.taper_rho if opts.launch else None, "latency_model": point.latency_model,
        "calibration_probe": point.probe.as_dict() if point.probe else None,
        "server": ("launch " + opts.model) if opts.launch else opts.url,
        "server_threads": opts.server_threads if opts.launch else None,
        "stream_interval": opts.stream_interval, "workload": stats,
        "step_series": "server /metrics deltas, polled every 1 s",
    }
    print(f"{len(specs)} programs over {schedule.duration_s:.0f} s ({schedule.name}), "
          f"{config['demand_tok_s']:.0f} tok/s demanded, SLO {point.slo_tpot_ms:.1f} ms, "
          f"{stats['pdr']:.0%} decomposable, ABF {stats['abf']:.1f}", flush=True)
    return Workload(schedule, specs, config)


@dataclass(slots=True)
class Bench:
    """One invocation: the operating point once known, and what each policy's run produced."""

    opts: ReplayOptions
    trace: Any
    operating_point: Point | None = None
    work: Workload | None = None
    results: dict[str, dict] = field(default_factory=dict)
    runs: dict[str, Run] = field(default_factory=dict)
    t_wall: float = field(default_factory=time.perf_counter)

    @property
    def out(self) -> Path:
        return Path(self.opts.out)

    def point(self, probe: Probe | None) -> Point:
        """The operating point, calibrated on the first probe; the workload follows from it."""
        if self.operating_point is None:
            assert probe is not None
            self.operating_point = calibrate(self.opts.cal, self.trace, self.opts.scaling, probe, self.out)
        if self.work is None:
            self.work = prepare(self.opts, self.trace, self.operating_point)
        return self.operating_point

    def _replay(self, policy: str, url: str, probe: Probe | None) -> Run:
        opts, point = self.opts, self.point(probe)
        assert self.work is not None
        run = Run(policy, [Outcome(spec) for spec in self.work.specs])
        target = Target(url, point.slo_tpot_ms, opts.cal.seed, opts.stream_interval, vocab=opts.vocab)
        execute(run, target, self.work.schedule.duration_s + opts.drain_s, opts.poll_s,
                progress=opts.progress)
        res = summarize_run(run, point.slo_tpot_ms / 1e3, self.work.schedule)
        cal = opts.cal
        res["run"]["probe"] = (
            probe.as_dict() | {"at_slo_rows_ms": 1e3 * probe.at(cal.slo_rows, cal.slo_context)}
            if probe else None)
        self.runs[policy], self.results[policy] = run, res
        if run.warning:
            print(f"{policy}: warning: {run.warning}", file=sys.stderr)
        return run

    def run_policy(self, policy: str) -> bool:
        """Start (or reuse) the server, probe it, replay; False when the whole bench must stop."""
        opts = self.opts
        server = _server(opts, policy, self.operating_point) if opts.launch else None
        stop = False
        try:
            url = server.start().url if server else opts.url
            assert url is not None
            known = self.operating_point
            probe = probe_url(url) if opts.launch else (known.probe if known else None)
            self.point(probe)  # the first (non-taper) server calibrates the operating point
            # --url: the server's own
            policy = policy or (server_report(url) or {}).get("policy") or "server"
            run = self._replay(policy, url, probe)
            stop = run.interrupted or (run.error is not None and not opts.launch)
        except (ServerError, ConnectionError, RuntimeError) as err:  # start, probe or a bug in between
            self.results[policy] = {"run": {"error": f"{type(err).__name__}: {err}"}, "partial": True}
        except KeyboardInterrupt:  # during a server start or probe
            self.results[policy] = {"run": {"error": "interrupted (Ctrl-C)", "interrupted": True},
                                    "partial": True}
            stop = True
        finally:
            if server is not None:
                server.stop()
        if err := self.results[policy].get("run", {}).get("error"):
            print(f"{policy}: {err}", file=sys.stderr)
        return not stop

    def save(self, expected: int, stopped: bool) -> None:
        if self.work is None:
            return
        partial = (stopped or any(res.get("partial") for res in self.results.values())
                   or len(self.results) < expected)
        write_results(self.out, self.results, self.work.config, partial, time.perf_counter() - self.t_wall)
        write_records(self.out, self.runs)

    def report(self) -> None:
        if self.opts.plots and self.runs and self.work and self.operating_point:
            from bench.plots import plot_run

            plotted = {policy: _Plotted(run.records, run.steps) for policy, run in self.runs.items()}
            plot_run(plotted, self.work.schedule, self.operating_point.slo_tpot_ms / 1e3, self.out)
        print(report_text(self.results))


def run_bench(bench: Bench, policies: list[str]) -> int:
    """Every policy at one operating point; partial results are saved after each. Exit code."""
    stopped = False
    for policy in policies:
        stopped = not bench.run_policy(policy)
        bench.save(len(policies), stopped)
        if stopped:
            break
    if bench.work is None:
        print("error: no run started", file=sys.stderr)
        return 1
    bench.report()
    failed = any(res.get("run", {}).get("error") for res in bench.results.values())
    print(f"\nwall {time.perf_counter() - bench.t_wall:.0f} s -> {bench.out / 'results.json'}"
          + (" (PARTIAL)" if failed or stopped else ""))
    if stopped and any(res.get("run", {}).get("interrupted") for res in bench.results.values()):
        return 130
    return 1 if failed else 0


# ------------------------------------------------------------------------------------------- CLI
def _policies(opts: ReplayOptions) -> list[str]:
    """The runs: one per --policies with --compare; --url runs once, as the server's own policy."""
    if not opts.compare:
        return [opts.policy_label or ""]
    if opts.url:
        pol = (server_report(opts.url) or {}).get("policy") or "unknown"
        print(f"note: --url {opts.url}: the server's policy is fixed ({pol}); running once as {pol!r}. "
              f"Use --launch to compare policies.")
        return [opts.policy_label or pol]
    return list(opts.policies)


def _calibrate_first(bench: Bench, policies: list[str]) -> None:
    """The operating point before the first run, where it can be had (taper's server needs the T(S)
    fit at start: calibrate on a serial server first)."""
    opts, cal = bench.opts, bench.opts.cal
    if not cal.needs_probe:
        bench.operating_point = cal.given()
    elif opts.launch and policies[0].startswith("taper"):
        with _server(opts, "serial", None) as srv:
            bench.point(probe_url(srv.url))
    elif opts.url:
        bench.point(probe_url(opts.url))


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(argv)
    try:
        trace = load_trace(opts.trace)
        # a bad schedule fails now
        fit_schedule(trace, opts.cal.schedule, opts.cal.duration_s, opts.cal.rate_scale or 1.0)
        if opts.cal.latency_model not in ("auto", "none"):
            load_model(opts.cal.latency_model)
    except ValueError as err:  # a TraceError too
        print(f"error: {err}", file=sys.stderr)
        return 2
    policies = _policies(opts)
    bench = Bench(opts, trace)
    try:
        _calibrate_first(bench, policies)
    except (ServerError, ConnectionError, RuntimeError) as err:
        print(f"error: calibration failed: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted during calibration; nothing measured", file=sys.stderr)
        return 130
    return run_bench(bench, policies)


if __name__ == "__main__":
    raise SystemExit(main())
