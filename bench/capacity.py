"""SLO capacity per policy: goodput and attainment over a grid of stationary loads, and the largest
rate at which each policy keeps >= 95% attainment over all arrivals (bisection, per seed).

    python -m bench.capacity --trace CSV --policies off,cap:2,cap:5,eager,taper-paper,taper \
        --slo-tpot-ms 50 --seeds 0,1,2 --out DIR [--preset multiverse|sprint] [--max-running sglang|slo|N]
        [--slo-ttft-s S] [--engine sim|replay (--launch | --url URL)]

Every point is one policy at one stationary rate (`workload.stationary_schedule`: the trace's burst
pattern at a constant mean rate from a seed-chosen place in the trace; the seed also draws the
requests' branch structure and the latency noise). Metrics are bench.metrics' over every request
that arrived in the measured window: unfinished or failed requests are misses.

The rules, fixed before any result was seen:
* grid: the fluid bound L* (bench.capacity.fluid_bound: the arrival rate whose mean demand fills
  steps of exactly the SLO, prefill included, at the workload's mean context) times
  GRID = 0.25, 0.4, 0.55, 0.7, 0.85, 1.0, 1.15; the same rates for every policy and seed;
* capacity of one seed: the lowest grid rate below 95% bounds it from above and the grid rate under
  it from below (every grid rate up to it passes); BISECT_STEPS halvings of that bracket (a point
  >= 95% moves the lower end up); the lower end is the capacity. A policy that holds 95% at every
  grid rate reports the top rate (a lower bound, flagged); one below 95% at the lowest reports 0 or
  the bisection below it;
* capacity_rps is the mean over seeds, capacity_spread their max - min.
Simulator windows: WARMUP_S of load before the measured window, WINDOW_S measured (arrivals
counted), arrivals go on for DRAIN_S after it, and whatever has not finished then is a miss.

Engines: `sim` (bench.engine's simulator and the server's own controller, default) and `replay`
(live servers: `bench.sweep.capacity_engine(options) -> Engine`, points from bench.point's
`run_point`). An Engine runs points; `point(policy, rate, seed) -> dict` with the keys of POINT_KEYS.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from bench.engine import EngineConfig, Simulator, build_controller, resolve_max_running
from bench.metrics import summarize
from bench.programs import Scaling, scale_spec
from bench.regimes import get_regime
from bench.report import Col, blank, fmt, render, write_json
from bench.workload import PRESETS, RequestSpec, compose, load_trace, stationary_schedule, workload_stats
from branchwise.taper import LinearLatencyModel, load_model, parse_policy_name

GRID = (0.25, 0.4, 0.55, 0.7, 0.85, 1.0, 1.15)  # x the fluid bound
TARGET = 0.95  # attainment over all arrivals that counts as holding the SLO
BISECT_STEPS = 3
WARMUP_S, WINDOW_S, DRAIN_S = 180.0, 600.0, 300.0
POINT_KEYS = ("rate", "goodput_tok_s", "attainment", "finished_frac", "p99_ttft_s")  # capacity.json
FIXED = ("off", "eager")  # with cap:K: the fixed-width policies taper is compared against

PointFn = Callable[[str, float, int], dict]


@dataclass(slots=True)
class Engine:
    """What bench.capacity needs from an engine: points, and the rate its grid is built on."""

    name: str
    point: PointFn  # (policy, rate, seed) -> {rate, goodput_tok_s, attainment, finished_frac, p99_ttft_s, ...}
    base_rps: float  # the grid's 1.0 (the fluid bound for the simulator)
    workers: int = 1  # points it may run at once (the simulator: processes; a live server: 1)
    config: dict = field(default_factory=dict)
    _pool: ProcessPoolExecutor | None = None

    def run(self, jobs: Sequence[tuple[str, float, int]]) -> list[dict]:
        if self.workers <= 1 or len(jobs) <= 1:
            return [self.point(*j) for j in jobs]
        if self._pool is None:
            self._pool = ProcessPoolExecutor(self.workers)
        # the per-step policies at high load first: the long jobs do not end up last
        order = sorted(range(len(jobs)), key=lambda i: (not jobs[i][0].startswith("taper"), -jobs[i][1]))
        futs = {i: self._pool.submit(self.point, *jobs[i]) for i in order}
        return [futs[i].result() for i in range(len(jobs))]

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None


# ------------------------------------------------------------------------------------- sim engine
def fluid_bound(model: LinearLatencyModel, slo_s: float, specs: list[RequestSpec]) -> float:
    """Arrival rate (req/s) whose mean demand fills steps of exactly the SLO: per second of engine
    time, decode rows at the mean context plus the prompts' prefill fill 1 / slo steps, i.e.
    L * (out * per_row + prompt * c_tok) = (slo - c0) / slo, per_row = c_seq + c_ctx * (prompt + out / 2)."""
    out = float(np.mean([s.output_tokens for s in specs]))
    prompt = float(np.mean([s.prompt_tokens for s in specs]))
    per_row = model.c_seq + model.c_ctx * (prompt + out / 2)
    return (slo_s - model.c0) / (slo_s * (out * per_row + prompt * model.c_tok))


@dataclass(frozen=True, slots=True)
class SimSetup:
    trace: str
    preset: str
    slo_s: float
    slo_ttft_s: float | None
    rho: float
    model: tuple[float, float, float, float]
    calibrated: bool
    cfg: EngineConfig
    warmup_s: float = WARMUP_S
    window_s: float = WINDOW_S
    drain_s: float = DRAIN_S
    scaling: Scaling | None = None  # the regime's program scaling (bench.regimes); None: trace lengths
    drain_arrivals: bool = True  # False: arrivals stop when the window ends (live points)


def sim_specs(trace: Any, rate: float, duration_s: float, seed: int, preset: str,
              scaling: Scaling | None) -> list[RequestSpec]:
    """A stationary point's requests, scaled as the regime's programs are."""
    specs = compose(trace, stationary_schedule(trace, rate, duration_s, seed), preset, seed)
    return [scale_spec(s, scaling) for s in specs] if scaling is not None else specs


_TRACES: dict[str, Any] = {}


def sim_point(setup: SimSetup, policy: str, rate: float, seed: int) -> dict:
    """One simulated point: metrics over the requests that arrived in the measured window."""
    trace = _TRACES.get(setup.trace)
    if trace is None:
        trace = _TRACES[setup.trace] = load_trace(setup.trace)
    t_end = setup.warmup_s + setup.window_s + setup.drain_s
    arrivals_s = t_end if setup.drain_arrivals else setup.warmup_s + setup.window_s
    specs = sim_specs(trace, rate, arrivals_s, seed, setup.preset, setup.scaling)
    model = LinearLatencyModel(*setup.model)
    ctl = build_controller(policy, model, setup.rho, setup.calibrated)
    res = Simulator(specs, ctl, model, setup.cfg, t_end, seed).run()
    window = (setup.warmup_s, setup.warmup_s + setup.window_s)
    m = summarize(res.records, setup.slo_s, window, steps=res.steps, slo_ttft_s=setup.slo_ttft_s, horizon_s=t_end)
    return {"rate": rate, "goodput_tok_s": m["goodput_tok_s"], "attainment": m["slo_attainment"],
            "finished_frac": m["finished_frac"], "p99_ttft_s": m["ttft_p99_s"], "requests": m["requests"],
            "raw_throughput_tok_s": m["raw_throughput_tok_s"], "slo_attainment_gap": m["slo_attainment_gap"],
            "ttft_p50_s": m["ttft_p50_s"], "step_latency_mean_ms": m.get("step_latency_mean_ms"),
            "admission_rate": m.get("admission_rate"), "cpu_s": res.stats["cpu_s"]}


class _SimPoint:
    """A picklable point function over one SimSetup (process pools ship it to the workers)."""

    def __init__(self, setup: SimSetup) -> None:
        self.setup = setup

    def __call__(self, policy: str, rate: float, seed: int) -> dict:
        return sim_point(self.setup, policy, rate, seed)


def sim_engine(a: CapacityOptions) -> Engine:
    trace = load_trace(a.trace)
    reg = get_regime(a.regime)
    model = load_model(a.latency_model) if a.latency_model else reg.model
    if not isinstance(model, LinearLatencyModel):
        raise ValueError("the simulator needs a linear latency model")
    slo_s = a.slo_tpot_ms / 1e3
    # the workload's means at a nominal rate (the grid rule and the SLO-sized cap use them)
    ref = sim_specs(trace, 1.0, 3600.0, 0, a.preset, reg.scaling)
    cfg = reg.engine_for(slo_s, resolve_max_running(a.max_running, model, slo_s, ref))
    setup = SimSetup(a.trace, a.preset, slo_s, a.slo_ttft_s, a.rho, model.coefs(),
                     bool(a.latency_model) or reg.calibrated, cfg, reg.warmup_s, reg.window_s, reg.drain_s,
                     reg.scaling, reg.drain_arrivals)
    bound = fluid_bound(model, slo_s, ref)
    conf = {"engine": "sim", "regime": reg.name, "fluid_bound_rps": bound, "engine_config": asdict(cfg), "running_cap": cfg.running_cap,
            "latency_model": dict(zip(("c0", "c_seq", "c_ctx", "c_tok"), model.coefs(), strict=True)),
            "workload": workload_stats(ref), "warmup_s": setup.warmup_s, "window_s": setup.window_s,
            "drain_s": setup.drain_s}
    return Engine("sim", _SimPoint(setup), bound, a.jobs, conf)


def replay_engine(a: CapacityOptions) -> Engine:
    """Live servers (bench.sweep builds the engine: probe, grid, servers)."""
    if not (a.launch or a.url):
        raise ValueError("--engine replay needs --launch or --url")
    from bench.sweep import capacity_engine

    return capacity_engine(a)


# ----------------------------------------------------------------------------------- the instrument
def grid(base_rps: float) -> list[float]:
    return [round(g * base_rps, 6) for g in GRID]


def _mean(points: list[dict], key: str) -> float | None:
    v = [p[key] for p in points if p.get(key) is not None and math.isfinite(p[key])]
    return float(np.mean(v)) if v else None


def bracket(rates: list[float], att: list[float | None]) -> tuple[float, float | None]:
    """(lower, upper): the highest grid rate with every rate up to it at >= TARGET (0.0 if the first
    fails) and the first one below TARGET (None if all hold)."""
    lo = 0.0
    for r, x in zip(rates, att, strict=True):
        if x is None or x < TARGET:
            return lo, r
        lo = r
    return lo, None


def measure(engine: Engine, policies: list[str], seeds: list[int], log: Callable[[str], None] = print) -> dict:
    """Grid points for every (policy, seed), then the bisection rounds; capacity.json's document
    plus per-seed details."""
    rates = grid(engine.base_rps)
    jobs = [(p, r, s) for p in policies for s in seeds for r in rates]
    t0 = time.perf_counter()
    got = dict(zip(jobs, engine.run(jobs), strict=True))
    log(f"grid: {len(jobs)} points in {time.perf_counter() - t0:.0f} s")
    brackets = {}
    for p in policies:
        for s in seeds:
            brackets[(p, s)] = bracket(rates, [got[(p, r, s)]["attainment"] for r in rates])
    for step in range(BISECT_STEPS):
        todo = {k: (lo + hi) / 2 for k, (lo, hi) in brackets.items() if hi is not None}
        if not todo:
            break
        res = engine.run([(p, mid, s) for (p, s), mid in todo.items()])
        for ((p, s), mid), pt in zip(todo.items(), res, strict=True):
            lo, hi = brackets[(p, s)]
            ok = pt["attainment"] is not None and pt["attainment"] >= TARGET
            brackets[(p, s)] = (mid, hi) if ok else (lo, mid)
            got[(p, mid, s)] = pt
        log(f"bisection {step + 1}/{BISECT_STEPS}: {len(todo)} points, {time.perf_counter() - t0:.0f} s")
    doc: dict[str, Any] = {"policies": {}}
    detail: dict[str, Any] = {}
    for p in policies:
        caps = [brackets[(p, s)][0] for s in seeds]
        points = []
        for r in rates:
            per_seed = [got[(p, r, s)] for s in seeds]
            points.append({"rate": r} | {k: _mean(per_seed, k) for k in POINT_KEYS[1:]})
        doc["policies"][p] = {"capacity_rps": float(np.mean(caps)), "capacity_spread": float(max(caps) - min(caps)),
                              "points": points}
        detail[p] = {"capacity_per_seed": dict(zip(map(str, seeds), caps, strict=True)),
                     "holds_whole_grid": [brackets[(p, s)][1] is None for s in seeds],
                     "points": [got[k] | {"seed": k[2]} for k in sorted(got) if k[0] == p]}
    return {"capacity": doc, "detail": detail, "wall_s": time.perf_counter() - t0}


def is_fixed(policy: str) -> bool:
    return policy in FIXED or policy.startswith("cap:")


def verdict(doc: dict, policy: str = "taper", ratio: float = 0.97) -> list[str]:
    """The acceptance checks, as lines: `policy`'s capacity against every other policy's, and its
    goodput against the best fixed-width policy's at every grid point."""
    pols = doc["policies"]
    if policy not in pols:
        return []
    me = pols[policy]
    lines = []
    others = {k: v["capacity_rps"] for k, v in pols.items() if k != policy}
    worse = [k for k, c in others.items() if c > me["capacity_rps"] + 1e-12]
    lines.append(f"capacity: {policy} {me['capacity_rps']:.3f} req/s "
                 + ("PASS (>= every other)" if not worse else f"FAIL (below {', '.join(worse)})"))
    fixed = [k for k in pols if is_fixed(k)]
    for i, pt in enumerate(me["points"]):
        best_k = max(fixed, key=lambda k: pols[k]["points"][i]["goodput_tok_s"] or 0.0, default=None)
        if best_k is None:
            continue
        best = pols[best_k]["points"][i]["goodput_tok_s"] or 0.0
        mine = pt["goodput_tok_s"] or 0.0
        ok = mine >= ratio * best
        lines.append(f"rate {pt['rate']:.3f}: {policy} goodput {mine:.1f} vs best fixed {best_k} {best:.1f} "
                     f"({mine / best if best else float('nan'):.3f}x) {'PASS' if ok else 'FAIL'}")
    return lines


def table(doc: dict) -> str:
    """Capacity and spread per policy, then goodput, attainment, finished fraction and P99 TTFT per rate."""
    pols = doc["policies"]
    rates = [p["rate"] for p in next(iter(pols.values()))["points"]]

    def at(i: int) -> Col:
        def cell(_k: str, v: dict) -> str:
            p = v["points"][i]
            ttft = p["p99_ttft_s"]
            return (f"{fmt(p['goodput_tok_s'], nd=0)} {fmt(p['attainment'], True, 0)} "
                    f"{fmt(p['finished_frac'], True, 0)} {fmt(ttft, nd=1 if (ttft or 0) < 100 else 0)}")

        return Col(f"{rates[i]:.3f}", 22, cell, sub="good att fin TTFT99")

    cols = [Col("capacity", 10, lambda _k, v: f"{v['capacity_rps']:.3f}", sub="req/s"),
            Col("spread", 8, lambda _k, v: f"{v['capacity_spread']:.3f}"), blank(2), *map(at, range(len(rates)))]
    return render(pols, cols, name_width=14)


def plot(doc: dict, base_rps: float, out: Path, slo_tpot_ms: float) -> Path:
    """Goodput and attainment against offered load, with each policy's capacity marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_g, ax_a) = plt.subplots(1, 2, figsize=(13, 5))
    for k, v in doc["policies"].items():
        r = [p["rate"] for p in v["points"]]
        line, = ax_g.plot(r, [p["goodput_tok_s"] or 0.0 for p in v["points"]], marker="o", label=k)
        ax_a.plot(r, [100 * (p["attainment"] or 0.0) for p in v["points"]], marker="o", color=line.get_color())
        ax_a.axvline(v["capacity_rps"], color=line.get_color(), ls=":", lw=1)
    for ax in (ax_g, ax_a):
        ax.axvline(base_rps, color="grey", ls="--", lw=0.8)
        ax.set_xlabel("offered load (req/s)")
    ax_a.axhline(100 * TARGET, color="grey", lw=0.8)
    ax_g.set_ylabel("goodput (tok/s)")
    ax_a.set_ylabel("attainment over all arrivals (%)")
    ax_g.set_title(f"goodput (TPOT SLO {slo_tpot_ms:g} ms; dashed: fluid bound)")
    ax_a.set_title("attainment (dotted: each policy's SLO capacity)")
    ax_g.legend(fontsize=8)
    fig.tight_layout()
    path = out / "capacity.png"
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


@dataclass(slots=True)
class CapacityOptions:
    """One `python -m bench.capacity` run (its flags, parsed). The replay engine (bench.sweep) reads the
    same names, and the launched servers' settings below."""

    trace: str
    out: str
    policies: str = "off,cap:2,cap:5,eager,taper-paper,taper"  # comma-separated, as given
    slo_tpot_ms: float = 50.0
    slo_ttft_s: float | None = None
    seeds: str = "0,1,2"
    engine: str = "sim"
    preset: str = "multiverse"
    rho: float = 0.8
    max_running: str = "sglang"
    latency_model: str | None = None
    jobs: int = 1
    launch: bool = False
    url: str | None = None
    server_args: str = ""
    plot: bool = True
    model: str = "models/tiny"  # replay --launch servers
    server_threads: int = 1
    max_total_tokens: int = 65536
    regime: str = "default"  # sim: bench.regimes (latency model, SLO, engine costs, program scale)

    @property
    def taper_rho(self) -> float:
        return self.rho


def parse_args(argv: list[str] | None) -> CapacityOptions:
    ap = argparse.ArgumentParser(prog="python -m bench.capacity", description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", required=True)
    ap.add_argument("--policies", default="off,cap:2,cap:5,eager,taper-paper,taper")
    ap.add_argument("--slo-tpot-ms", type=float, default=None, help="default: the regime's (50 ms by default)")
    ap.add_argument("--slo-ttft-s", type=float, default=None, help="TTFT target that attainment also requires")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--out", required=True)
    ap.add_argument("--engine", choices=("sim", "replay"), default="sim")
    ap.add_argument("--preset", default="multiverse", choices=sorted(PRESETS))
    ap.add_argument("--rho", type=float, default=0.8)
    ap.add_argument("--max-running", default="sglang",
                    help="sim: running-request limit, sglang (SGLang's default for the pool), slo (sensitivity) or N")
    ap.add_argument("--latency-model", help="sim: JSON latency model; default: branchwise's default model")
    ap.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="sim: worker processes")
    where = ap.add_mutually_exclusive_group()
    where.add_argument("--launch", action="store_true", help="replay: start a server per policy")
    where.add_argument("--url", help="replay: a running server")
    ap.add_argument("--server-args", default="", help="replay: extra flags for --launch servers")
    ap.add_argument("--regime", default="default",
                    help="sim: bench.regimes' setting (default, live-fast, live-slow): latency model, SLO, "
                         "engine costs, program scale, point length")
    ap.add_argument("--no-plot", action="store_true")
    a = ap.parse_args(argv)
    try:
        slo_ms = a.slo_tpot_ms if a.slo_tpot_ms is not None else 1e3 * get_regime(a.regime).slo_s
    except ValueError as e:
        ap.error(str(e))
    return CapacityOptions(a.trace, a.out, a.policies, slo_ms, a.slo_ttft_s, a.seeds, a.engine, a.preset,
                           a.rho, a.max_running, a.latency_model, a.jobs, a.launch, a.url, a.server_args,
                           not a.no_plot, regime=a.regime)


def write(out: Path, res: dict, o: CapacityOptions, engine: Engine) -> Path:
    """capacity.json (the capacity document) and capacity_detail.json (config, per-seed points)."""
    config = asdict(o) | engine.config | {"grid": list(GRID), "target": TARGET, "bisect_steps": BISECT_STEPS}
    write_json(out / "capacity_detail.json", {"config": config, "policies": res["detail"], "wall_s": res["wall_s"]},
               indent=1, default=str)
    return write_json(out / "capacity.json", res["capacity"], indent=1)


def main(argv: list[str] | None = None) -> int:
    o = parse_args(argv)
    try:
        policies = [parse_policy_name(p) for p in o.policies.split(",") if p.strip()]
        seeds = [int(s) for s in o.seeds.split(",") if s.strip()]
        if not policies or not seeds:
            raise ValueError("need at least one policy and one seed")
        engine = sim_engine(o) if o.engine == "sim" else replay_engine(o)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{engine.name}: grid {', '.join(f'{r:.3f}' for r in grid(engine.base_rps))} req/s "
          f"(x {engine.base_rps:.3f} req/s), seeds {seeds}, policies {', '.join(policies)}")
    try:
        res = measure(engine, policies, seeds)
    finally:
        engine.close()
    out = Path(o.out)
    path = write(out, res, o, engine)
    print(table(res["capacity"]))
    for line in verdict(res["capacity"]):
        print(line)
    if o.plot:
        plot(res["capacity"], engine.base_rps, out, o.slo_tpot_ms)
    print(f"wall {res['wall_s']:.0f} s -> {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
