"""SLO capacity and latency per policy over a grid of stationary loads, and taper's two-axis verdict.

    python -m bench.capacity --trace CSV --policies serial,cap:2,cap:5,eager,taper-paper,taper \
        --slo-tpot-ms 50 --seeds 0,1,2 --out DIR [--preset multiverse|sprint] [--max-running sglang|slo|N]
        [--slo-ttft-s S] [--rates R1,R2,...] [--engine sim|replay (--launch | --url URL)]

Every point is one policy at one stationary rate (`workload.stationary_schedule`), scored by
bench.metrics over every request that arrived in the measured window. The grid is the fluid bound
(bench.bound) times GRID; a seed's capacity is the lower end of its hold/fail bracket after
BISECT_STEPS halvings. `verdict`: (a) taper's capacity >= every other policy's; (b) wherever a
fixed-width policy holds TARGET, taper holds and is within FRONTIER_SLACK of the latency frontier.
Engines: `sim` (bench.engine's simulator, default) and `replay` (live servers, bench.live). Live
points carry their requests: each gets bootstrap intervals (bench.confidence), and each part of the
verdict is PASS or FAIL where the intervals decide it and UNDECIDED where one straddles its bound
(the verdict lists those apart). The rules in full: docs/benchmarks.md ("SLO capacity").
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from bench import confidence, emulated
from bench.bound import fluid_bound_rps
from bench.engine import EngineConfig, Simulator, build_controller, resolve_max_running
from bench.metrics import POINT_KEYS, load_point, summarize
from bench.programs import Scaling
from bench.regimes import get_regime, regime_specs
from bench.report import Col, blank, fmt, num, render, write_json
from bench.variants import TTFT_TARGET_S, engine_for, parse_variant, ttft_attainment, variant_name
from bench.workload import PRESETS, load_trace, workload_stats
from branchwise.taper import LinearLatencyModel, load_model

GRID = (0.25, 0.4, 0.55, 0.7, 0.85, 1.0, 1.15)  # x the fluid bound
TARGET = 0.95  # attainment over all arrivals that counts as holding the SLO; 1 - TARGET: the most
# the admission queue may grow over the window, per arrival (the point sustained its load)
FRONTIER_SLACK = 1.05  # taper's decomposable P50 end to end may be this much above the frontier
LATENCY = "decomp_e2e_p50_s"  # the latency axis
BISECT_STEPS = 3
WARMUP_S, WINDOW_S, DRAIN_S = 180.0, 600.0, 300.0
FIXED = ("serial", "eager")  # with cap:K: the fixed-width policies taper is compared against

DOC_KEYS = (*POINT_KEYS, "queue_growth")  # a capacity.json point (queue_growth: None on live points)

PointFn = Callable[[str, float, int], dict]
Job = tuple[str, float, int]  # (policy, rate, seed)


@dataclass(slots=True)
class Engine:
    """What bench.capacity needs from an engine: points, and the rate its grid is built on."""

    name: str
    point: PointFn  # (policy, rate, seed) -> bench.metrics.load_point figures (and more)
    fluid_bound_rps: float  # the grid's 1.0
    workers: int = 1  # points it may run at once (the simulator: processes; live servers: 1)
    config: dict = field(default_factory=dict)
    on_close: Callable[[], None] | None = None
    batch: Callable[[Sequence[Job]], list[dict]] | None = None  # runs jobs itself (live repeats)
    _pool: ProcessPoolExecutor | None = None

    def run(self, jobs: Sequence[Job]) -> list[dict]:
        if self.batch is not None:
            return self.batch(jobs)
        if self.workers <= 1 or len(jobs) <= 1:
            return [self.point(*job) for job in jobs]
        if self._pool is None:
            self._pool = ProcessPoolExecutor(self.workers)
        # the per-step policies at high load first: the long jobs do not end up last
        order = sorted(range(len(jobs)),
                       key=lambda idx: (not jobs[idx][0].startswith("taper"), -jobs[idx][1]))
        futs = {idx: self._pool.submit(self.point, *jobs[idx]) for idx in order}
        return [futs[idx].result() for idx in range(len(jobs))]

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None
        if self.on_close is not None:
            self.on_close()


# ------------------------------------------------------------------------------------- sim engine
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
    ttft_target_s: float | None = TTFT_TARGET_S  # the TTFT column's SLO and taper-prefill's TTFT clause
    graph_batch_sizes: tuple[int, ...] = ()  # the model pads decode rows to these (device regimes)


@functools.cache
def _trace(path: str) -> Any:
    """The trace, read once per process (a pool's worker runs many points)."""
    return load_trace(path)


class _SimPoint:
    """A picklable point function over one SimSetup (process pools ship it to the workers)."""

    def __init__(self, setup: SimSetup) -> None:
        self.setup = setup

    def __call__(self, policy: str, rate: float, seed: int) -> dict:
        setup = self.setup
        trace = _trace(setup.trace)
        t_end = setup.warmup_s + setup.window_s + setup.drain_s
        arrivals_s = t_end if setup.drain_arrivals else setup.warmup_s + setup.window_s
        specs = regime_specs(trace, rate, arrivals_s, seed, setup.preset, setup.scaling)
        model = LinearLatencyModel(*setup.model, graph_batch_sizes=setup.graph_batch_sizes)
        var = parse_variant(policy)  # POLICY@chunk and taper-prefill (bench.prefill)
        cfg = engine_for(setup.cfg, var, model, setup.rho, setup.ttft_target_s)
        ctl = build_controller(var.policy, model, setup.rho, setup.calibrated)
        res = Simulator(specs, ctl, model, cfg, t_end, seed).run()
        window = (setup.warmup_s, setup.warmup_s + setup.window_s)
        ttft = np.array([rec.ttft_s for rec in res.records if window[0] <= rec.arrival_s < window[1]])
        metrics = summarize(res.records, setup.slo_s, window, steps=res.steps, slo_ttft_s=setup.slo_ttft_s,
                            horizon_s=t_end)
        extra = ("requests", "raw_throughput_tok_s", "slo_attainment_gap", "ttft_p50_s",
                 "step_latency_mean_ms", "admission_rate", "decomp_decode_p50_s", "serial_decode_p50_s")
        steady = {"queue_growth": metrics["queue_growth"]} if setup.warmup_s > 0 else {}
        return (load_point(rate, metrics) | {key: metrics.get(key) for key in extra}
                | steady | {"cpu_s": res.stats["cpu_s"]}
                | ({"ttft_attainment": ttft_attainment(ttft, setup.ttft_target_s)} if setup.ttft_target_s else {}))


def seed_list(text: str) -> list[int]:
    """--seeds: integers separated by commas (ValueError otherwise)."""
    return [int(seed) for seed in text.split(",") if seed.strip()]


def window_bound_rps(setup: SimSetup, model: LinearLatencyModel, rate: float, seed: int) -> float:
    """The fluid bound of the requests one seed's window measures at `rate`: a seed's place in the
    trace can ask for more or less work per request than the workload the grid is built on, so a
    seed's capacity is judged against its own limit too."""
    end = setup.warmup_s + setup.window_s
    specs = regime_specs(_trace(setup.trace), rate, end, seed, setup.preset, setup.scaling)
    return fluid_bound_rps(model, setup.slo_s, [spec for spec in specs if spec.arrival_s >= setup.warmup_s])


def sim_engine(opts: CapacityOptions) -> Engine:
    trace = load_trace(opts.trace)
    reg = get_regime(opts.regime)
    model = load_model(opts.latency_model) if opts.latency_model else reg.model
    if not isinstance(model, LinearLatencyModel):
        raise ValueError("the simulator needs a linear latency model")
    slo_s = opts.slo_tpot_ms / 1e3
    # the workload's means at a nominal rate (the bound and the SLO-sized cap use them)
    ref = regime_specs(trace, 1.0, 3600.0, 0, opts.preset, reg.scaling)
    cfg = reg.engine_for(slo_s, resolve_max_running(opts.max_running, model, slo_s, ref))
    setup = SimSetup(opts.trace, opts.preset, slo_s, opts.slo_ttft_s, opts.rho, model.coefs(),
                     bool(opts.latency_model) or reg.calibrated, cfg, reg.warmup_s, reg.window_s,
                     reg.drain_s, reg.scaling, reg.drain_arrivals, opts.ttft_target_s, model.graph_batch_sizes)
    bound = fluid_bound_rps(model, slo_s, ref)
    conf = {"engine": "sim", "regime": reg.name, "fluid_bound_rps": bound,
            "window_bounds_rps": {seed: window_bound_rps(setup, model, bound, seed)
                                  for seed in seed_list(opts.seeds)},
            "engine_config": asdict(cfg),
            "running_cap": cfg.running_cap,
            "latency_model": dict(zip(("c0", "c_seq", "c_ctx", "c_tok"), model.coefs(), strict=True)),
            "workload": workload_stats(ref), "warmup_s": setup.warmup_s, "window_s": setup.window_s,
            "drain_s": setup.drain_s}
    if model.graph_batch_sizes:
        conf["graph_batch_sizes"] = list(model.graph_batch_sizes)
    return Engine("sim", _SimPoint(setup), bound, opts.jobs, conf)


def replay_engine(opts: CapacityOptions) -> Engine:
    """Live servers (bench.live): one server per policy (--launch) or one running server (--url), the
    grid's 1.0 at the live fluid bound of a probe of the first non-taper server."""
    from bench.live import LivePoints, Servers, ServerSettings, calibrate
    from bench.point import PointSetup
    from bench.programs import Scaling

    policies = [name.strip() for name in opts.policies.split(",") if name.strip()]
    if not (opts.launch or opts.url):
        raise ValueError("--engine replay needs --launch or --url")
    if opts.url and len(policies) != 1:
        raise ValueError("--engine replay --url: a running server has one policy; pass it alone in "
                         "--policies (or use --launch)")
    settings = ServerSettings(opts.model, opts.rho, opts.server_threads, opts.max_total_tokens,
                              opts.server_args)
    servers = (Servers(settings, slo_ms=opts.slo_tpot_ms) if opts.launch
               else Servers(urls={policies[0]: opts.url}))
    base = PointSetup(load_trace(opts.trace), opts.slo_tpot_ms, Scaling(1.0, 256), preset=opts.preset,
                      slo_ttft_s=opts.slo_ttft_s)
    try:
        operating = calibrate(servers, policies, base, Path(opts.out), slo_ms=opts.slo_tpot_ms)
    except BaseException:
        servers.close()
        raise
    points = LivePoints(servers, operating.setup, operating.fluid_bound_rps, Path(opts.out))
    conf = {"engine": "replay", "fluid_bound_rps": operating.fluid_bound_rps,
            "probe": operating.probe.as_dict(),
            "duration_s": operating.setup.duration_s, "drain_s": operating.setup.drain_s,
            "scaling": asdict(operating.setup.scaling),
            "server": "launch" if opts.launch else opts.url}
    return Engine("replay", points, operating.fluid_bound_rps, 1, conf, on_close=servers.close)


# ----------------------------------------------------------------------------------- the instrument
def grid(bound_rps: float) -> list[float]:
    return [round(frac * bound_rps, 6) for frac in GRID]


def _mean(points: list[dict], key: str) -> float | None:
    values = [point[key] for point in points if point.get(key) is not None and math.isfinite(point[key])]
    return float(np.mean(values)) if values else None


def sustained(point: Mapping[str, Any]) -> bool:
    """The point kept up with its load: its admission queue grew by at most (1 - TARGET) of the
    window's arrivals. Only a window that opens in steady state (after a warm-up: simulated points)
    carries the figure; a live point opens empty and stops its arrivals with its window, so its
    short drain bounds the backlog instead."""
    growth = point.get("queue_growth")
    return growth is None or growth <= 1 - TARGET + 1e-12


def holds(point: Mapping[str, Any]) -> bool:
    """TARGET attainment over all arrivals, at a load the point sustained: attainment alone counts a
    backlog that grows all window as good while the drain still clears it. An invalid point (an
    emulated device's overruns, bench.emulated) never counts as held."""
    return (point.get("attainment") is not None and point["attainment"] >= TARGET and sustained(point)
            and not point.get("invalid"))


def bracket(rates: list[float], held: list[bool]) -> tuple[float, float | None]:
    """(lower, upper): the highest grid rate with every rate up to it held (0.0 if the first fails)
    and the first one not held (None if all hold)."""
    lower = 0.0
    for rate, ok in zip(rates, held, strict=True):
        if not ok:
            return lower, rate
        lower = rate
    return lower, None


def _rotated(policies: list[str], shift: int) -> list[str]:
    start = shift % len(policies)
    return policies[start:] + policies[:start]


def _document(bound: float, policies: list[str], rates: list[float], caps: dict[str, list[float]],
              got: dict[Job, dict], seeds: list[int]) -> dict[str, Any]:
    """capacity.json's document over `seeds`: capacities (mean, spread) and points averaged over
    seeds."""
    doc: dict[str, Any] = {"fluid_bound_rps": bound, "policies": {}}
    for policy in policies:
        policy_caps = caps[policy]
        points = [{"rate": rate} | {key: _mean([got[(policy, rate, seed)] for seed in seeds], key)
                                    for key in DOC_KEYS[1:]}
                  | emulated.seeds_point([got[(policy, rate, seed)] for seed in seeds])
                  for rate in rates]
        mean = float(np.mean(policy_caps))
        spread = float(max(policy_caps) - min(policy_caps))
        doc["policies"][policy] = {"capacity_rps": mean, "capacity_spread": spread,
                                   "capacity_of_bound": mean / bound if bound > 0 else None,
                                   "points": points}
    return doc


def measure(engine: Engine, policies: list[str], seeds: list[int], log: Callable[[str], None] = print,
            rates: list[float] | None = None, bisect_steps: int | None = None) -> dict:
    """Grid points for every (policy, seed) (per seed in ascending rates, the policies' order rotated
    per rate so a drift of a live machine does not always hit the same one), then the bisection
    rounds. {"capacity": capacity.json's document (means over seeds), "per_seed": {seed: the same
    for one seed}, "detail": per policy capacities per seed and every point, "wall_s"}."""
    rates = rates or grid(engine.fluid_bound_rps)
    steps = BISECT_STEPS if bisect_steps is None else bisect_steps
    jobs = [(policy, rate, seed) for seed in seeds for idx, rate in enumerate(rates)
            for policy in _rotated(policies, idx)]
    start = time.perf_counter()
    got = dict(zip(jobs, engine.run(jobs), strict=True))
    log(f"grid: {len(jobs)} points in {time.perf_counter() - start:.0f} s")
    brackets = {(policy, seed): bracket(rates, [holds(got[(policy, rate, seed)]) for rate in rates])
                for policy in policies for seed in seeds}
    for step in range(steps):
        todo = {key: (lower + upper) / 2 for key, (lower, upper) in brackets.items() if upper is not None}
        if not todo:
            break
        res = engine.run([(policy, mid, seed) for (policy, seed), mid in todo.items()])
        for ((policy, seed), mid), point in zip(todo.items(), res, strict=True):
            lower, upper = brackets[(policy, seed)]
            brackets[(policy, seed)] = (mid, upper) if holds(point) else (lower, mid)
            got[(policy, mid, seed)] = point
        log(f"bisection {step + 1}/{steps}: {len(todo)} points, {time.perf_counter() - start:.0f} s")
    bound = engine.fluid_bound_rps
    caps = {policy: [brackets[(policy, seed)][0] for seed in seeds] for policy in policies}
    per_seed = {seed: _document(bound, policies, rates,
                                {policy: [brackets[(policy, seed)][0]] for policy in policies}, got, [seed])
                for seed in seeds}
    detail = {policy: {"capacity_per_seed": dict(zip(map(str, seeds), caps[policy], strict=True)),
                       "holds_whole_grid": [brackets[(policy, seed)][1] is None for seed in seeds],
                       "points": [got[job] | {"seed": job[2]} for job in sorted(got) if job[0] == policy]}
              for policy in policies}
    capacity = _document(bound, policies, rates, caps, got, seeds)
    _intervals(capacity, per_seed, got, seeds, rates)
    return {"capacity": capacity, "per_seed": per_seed, "detail": detail, "wall_s": time.perf_counter() - start}


def _intervals(doc: dict, per_seed: dict[int, dict], got: dict[Job, dict], seeds: list[int],
               rates: list[float]) -> None:
    """Live points' intervals (bench.confidence.annotate) on every document and, without bisection
    points, each policy's `capacity_range_rps` (`capacity_range`; on the means, the means of the
    seeds' ends). Simulated points carry no requests and get neither."""
    if not all([confidence.annotate(seed_doc, got, [seed]) for seed, seed_doc in per_seed.items()]):
        return
    confidence.annotate(doc, got, seeds)
    if any(job[1] not in rates for job in got):
        return
    for seed_doc in per_seed.values():
        for entry in seed_doc["policies"].values():
            entry["capacity_range_rps"] = capacity_range(entry["points"])
    for policy, entry in doc["policies"].items():
        ends = np.array([per_seed[seed]["policies"][policy]["capacity_range_rps"] for seed in seeds])
        entry["capacity_range_rps"] = [float(value) for value in ends.mean(axis=0)]


def hold_outcome(point: Mapping[str, Any]) -> str:
    """`holds` read with the point's attainment interval where it has one: PASS when the interval's
    lower end reaches TARGET, FAIL when its upper end is below, UNDECIDED when it straddles. A load
    not sustained fails. An invalid point (bench.emulated's overrun rule) is UNDECIDED: it neither
    holds nor fails, so no capacity or verdict counts it."""
    if point.get("invalid"):
        return confidence.UNDECIDED
    att = point.get("attainment")
    if att is None or not sustained(point):
        return confidence.FAIL
    lo, hi = point.get("attainment_ci") or (att, att)
    return confidence.decide(lo, hi, TARGET, above_ok=True)


def capacity_range(points: Sequence[Mapping[str, Any]]) -> list[float]:
    """[lower, upper] capacity over grid points: the bracket's lower end counting only the holds
    the intervals decide, and counting every hold they do not rule out."""
    rates = [point["rate"] for point in points]
    outcomes = [hold_outcome(point) for point in points]
    return [bracket(rates, [out == confidence.PASS for out in outcomes])[0],
            bracket(rates, [out != confidence.FAIL for out in outcomes])[0]]


# ------------------------------------------------------------------------------------- the verdict
def is_fixed(policy: str) -> bool:
    return policy in FIXED or policy.startswith("cap:")


@dataclass(frozen=True, slots=True)
class LatencyCheck:
    """Check (b) at one rate: the frontier, and whether taper holds and stays within FRONTIER_SLACK,
    as the points' intervals decide (`outcome`; point values where a point has no interval)."""

    rate: float
    frontier: str | None  # the policy with the lowest decomposable P50 end to end among those holding
    frontier_s: float | None
    mine_s: float | None
    mine_attainment: float | None
    applies: bool  # some fixed-width policy holds here, or may (its interval straddles TARGET)
    ok: bool  # outcome is PASS
    outcome: str = confidence.PASS  # PASS, FAIL or UNDECIDED
    versus: str | None = None  # the policy `ratio` is against: the comparison that decides the outcome
    ratio: tuple[float, float, float] | None = None  # mine / versus's P50: value, interval lo, hi
    mine_attainment_ci: tuple[float, float] | None = None
    unsure: tuple[str, ...] = ()  # the policies whose runs leave a part UNDECIDED (more runs may decide)

    def line(self, focus: str) -> str:
        head = f"rate {self.rate:.3f}: "
        if not self.applies:
            return head + "no fixed-width policy holds 95% (n/a)"
        att = fmt(self.mine_attainment, True) + (f" [{confidence.span(self.mine_attainment_ci, pct=True)}]"
                                                 if self.mine_attainment_ci else "")
        ratio = ("" if self.ratio is None else f"; {self.ratio[0]:.2f}x {self.versus}"
                 + ("" if self.ratio[1] == self.ratio[2]
                    else f" [under {confidence.MIN_REQUESTS} pairs]" if math.isinf(self.ratio[2])
                    else f" [{self.ratio[1]:.2f}-{self.ratio[2]:.2f}]"))
        return (head + f"{focus} {att} att, decomposable P50 e2e {fmt(self.mine_s, nd=1)} s vs frontier "
                f"{self.frontier} {fmt(self.frontier_s, nd=1)} s{ratio} {self.outcome}")


def _within(own: Mapping[str, Any], other: str, point: Mapping[str, Any]) -> tuple[str, tuple | None]:
    """Whether own's LATENCY is within FRONTIER_SLACK of `other`'s, by the paired ratio interval
    (bench.confidence.p50_ratio) where the points carry one, else by the point values."""
    mine, theirs = own[LATENCY], point[LATENCY]
    found = (own.get("p50_ratio") or {}).get(other)
    ratio = ((found[0], found[1], math.inf if found[2] is None else found[2]) if found
             else (mine / theirs,) * 3 if theirs > 0 else None)
    if ratio is None:
        return confidence.PASS if mine <= FRONTIER_SLACK * theirs + 1e-12 else confidence.FAIL, None
    return confidence.decide(ratio[1], ratio[2], FRONTIER_SLACK, above_ok=False), ratio


def latency_check(rate: float, points: Mapping[str, Mapping[str, Any]], focus: str = "taper") -> LatencyCheck:
    """(b) over {policy: point} at one rate: the frontier is the lowest LATENCY among the policies
    holding TARGET; where a fixed-width policy holds, `focus` must hold too and be within
    FRONTIER_SLACK of every policy that holds (so of the frontier). Each part is three-valued
    (`hold_outcome`, `_within`) and they combine as Kleene logic: a part no interval decides leaves
    the check UNDECIDED unless another part decides it."""
    holding = {policy: point[LATENCY] for policy, point in points.items()
               if holds(point) and point.get(LATENCY) is not None}
    frontier = min(holding, key=lambda policy: holding[policy], default=None)
    own = points.get(focus, {})
    mine = own.get(LATENCY)
    held = {policy: hold_outcome(point) for policy, point in points.items()}
    applies = confidence.any_of(held[policy] for policy in points if is_fixed(policy))
    parts = [held.get(focus, confidence.FAIL), confidence.PASS if mine is not None else confidence.FAIL]
    compared: dict[str, tuple[str, tuple | None]] = {}
    for policy, point in points.items():
        if policy != focus and mine is not None and point.get(LATENCY) is not None:
            within, ratio = _within(own, policy, point)
            parts.append(confidence.any_of([confidence.negate(held[policy]), within]))
            if held[policy] != confidence.FAIL:
                compared[policy] = (parts[-1], ratio)
    outcome = confidence.any_of([confidence.negate(applies), confidence.all_of(parts)])
    rank = {confidence.FAIL: 0, confidence.UNDECIDED: 1, confidence.PASS: 2}
    versus = min(compared, key=lambda policy: (rank[compared[policy][0]], points[policy][LATENCY]),
                 default=None)
    return LatencyCheck(rate, frontier, holding.get(frontier) if frontier else None, mine,
                        own.get("attainment"), applies != confidence.FAIL, outcome == confidence.PASS,
                        outcome, versus, compared[versus][1] if versus else None,
                        tuple(own["attainment_ci"]) if own.get("attainment_ci") else None,
                        _unsure(focus, held, compared) if outcome == confidence.UNDECIDED else ())


def _unsure(focus: str, held: Mapping[str, str], compared: Mapping[str, tuple[str, Any]]) -> tuple[str, ...]:
    """Whose runs an UNDECIDED check waits on: `focus`, each policy whose hold is undecided and each
    one the focus's comparison with is."""
    return tuple(policy for policy in held
                 if policy == focus or held[policy] == confidence.UNDECIDED
                 or compared.get(policy, (None,))[0] == confidence.UNDECIDED)


@dataclass(frozen=True, slots=True)
class Verdict:
    focus: str
    capacity_rps: float
    above: tuple[str, ...]  # (a) fails against these
    latency: tuple[LatencyCheck, ...]  # (b) per grid rate
    over_bound: tuple[str, ...]  # policies whose capacity exceeds the fluid bound (the bound is wrong)
    spans: bool  # the grid runs from a rate every policy holds to one none holds
    # (a) against each other policy as the capacity ranges decide (point capacities where none)
    capacity_vs: tuple[tuple[str, str], ...] = ()
    capacity_range: tuple[float, float] | None = None  # focus's `capacity_range`, where it has one

    @property
    def capacity_outcome(self) -> str:
        return confidence.all_of(outcome for _, outcome in self.capacity_vs)

    @property
    def outcome(self) -> str:
        """FAIL where an interval shows a rule broken, else UNDECIDED where one cannot tell, else PASS."""
        return confidence.all_of([self.capacity_outcome, *(check.outcome for check in self.latency)])

    @property
    def passed(self) -> bool:
        return self.outcome == confidence.PASS

    @property
    def undecided(self) -> list[str]:
        """What one run cannot decide: the capacity comparison and the rates of latency checks."""
        return ((["capacity"] if self.capacity_outcome == confidence.UNDECIDED else [])
                + [f"latency at {check.rate:.3f}" for check in self.latency
                   if check.outcome == confidence.UNDECIDED])

    def failed(self) -> list[str]:
        below = [policy for policy, outcome in self.capacity_vs if outcome == confidence.FAIL]
        return (([f"capacity below {', '.join(below)}"] if below else [])
                + [f"latency at {check.rate:.3f}" for check in self.latency if check.outcome == confidence.FAIL])

    def lines(self, bound: float) -> list[str]:
        focus = self.focus
        of_bound = fmt(self.capacity_rps / bound if bound else None, nd=3)
        rng = ("" if self.capacity_range is None
               else f" [{self.capacity_range[0]:.3f}-{self.capacity_range[1]:.3f}]")
        which = {outcome: [policy for policy, got in self.capacity_vs if got == outcome]
                 for outcome in (confidence.FAIL, confidence.UNDECIDED)}
        why = {confidence.PASS: "(>= every other)", confidence.FAIL: f"(below {', '.join(which['FAIL'])})",
               confidence.UNDECIDED: f"(the ranges overlap {', '.join(which['UNDECIDED'])})"}
        out = [f"(a) capacity: {focus} {self.capacity_rps:.3f} req/s{rng} ({of_bound} of the fluid bound "
               f"{bound:.3f}) {self.capacity_outcome} {why[self.capacity_outcome]}"]
        out += [f"(b) {check.line(focus)}" for check in self.latency]
        if self.over_bound:
            out.append(f"note: capacity above the fluid bound: {', '.join(self.over_bound)}")
        if not self.spans:
            out.append("note: the grid does not run from a rate every policy holds to one none holds")
        undecided = self.undecided
        out.append(f"verdict ({focus}: capacity highest, and at every rate a fixed policy holds, holding and "
                   f"within {FRONTIER_SLACK:g}x the latency frontier): {self.outcome}"
                   + (f" (undecided: {'; '.join(undecided)})" if undecided else ""))
        return out

    def as_dict(self) -> dict[str, Any]:
        return {"passed": self.passed, "outcome": self.outcome, "undecided": self.undecided,
                "capacity_outcome": self.capacity_outcome, "capacity_vs": dict(self.capacity_vs),
                "capacity_range_rps": self.capacity_range,
                "capacity_highest": not self.above, "above": list(self.above),
                "latency": [asdict(check) for check in self.latency], "over_bound": list(self.over_bound),
                "grid_spans_hold_to_fail": self.spans}


def _not_below(mine: Sequence[float], theirs: Sequence[float]) -> str:
    """Capacity range `mine` >= `theirs`: PASS when its lower end reaches their upper end, FAIL when
    its upper end is below their lower end, else UNDECIDED."""
    if mine[0] >= theirs[1] - 1e-12:
        return confidence.PASS
    return confidence.FAIL if mine[1] < theirs[0] - 1e-12 else confidence.UNDECIDED


def verdict(doc: dict, focus: str = "taper") -> Verdict | None:
    """taper's two-axis verdict on a capacity document: (a) `focus`'s capacity >= every other
    policy's, (b) `latency_check` at every grid rate. None without `focus`."""
    pols = doc["policies"]
    if focus not in pols:
        return None
    own_capacity = pols[focus]["capacity_rps"]
    above = tuple(policy for policy, entry in pols.items()
                  if policy != focus and entry["capacity_rps"] > own_capacity + 1e-12)
    rates = [point["rate"] for point in pols[focus]["points"]]
    checks = tuple(latency_check(rate, {policy: entry["points"][idx] for policy, entry in pols.items()},
                                 focus)
                   for idx, rate in enumerate(rates))
    bound = doc.get("fluid_bound_rps") or math.inf
    over = tuple(policy for policy, entry in pols.items() if entry["capacity_rps"] > bound * (1 + 1e-9))
    first = [entry["points"][0] for entry in pols.values()]
    last = [entry["points"][-1] for entry in pols.values()]
    spans = all(holds(point) for point in first) and not any(holds(point) for point in last)
    ranges = {policy: entry.get("capacity_range_rps") or [entry["capacity_rps"]] * 2
              for policy, entry in pols.items()}
    versus = tuple((policy, _not_below(ranges[focus], ranges[policy])) for policy in pols if policy != focus)
    own_range = pols[focus].get("capacity_range_rps")
    return Verdict(focus, own_capacity, above, checks, over, spans, versus,
                   tuple(own_range) if own_range else None)


# ------------------------------------------------------------------------------------------ output
def _rate_cols(rates: list[float], cell: Callable[[dict], str], sub: str, width: int) -> list[Col]:
    return [Col(f"{rate:.3f}", width, lambda _name, entry, idx=idx: cell(entry["points"][idx]), sub=sub)
            for idx, rate in enumerate(rates)]


def tables(doc: dict) -> str:
    """Two tables, policy by rate: the SLO axis (attainment, finished, goodput) with each capacity
    (also as a fraction of the fluid bound), and the latency axis (decomposable P50 / P99 end to end
    and finished share, serial P50 end to end; seconds). Live points show their attainment and
    decomposable P50 with its 95% bootstrap interval in brackets (bench.confidence)."""
    pols = doc["policies"]
    rates = [point["rate"] for point in next(iter(pols.values()))["points"]]
    ci = any("attainment_ci" in point for entry in pols.values() for point in entry["points"])

    def bracketed(point: dict, name: str, pct: bool) -> str:
        return f" [{confidence.span(point.get(name), pct=pct)}]" if ci else ""

    def slo(point: dict) -> str:
        return (f"{fmt(point['attainment'], True, 0)}{bracketed(point, 'attainment_ci', True)} "
                f"{fmt(point['finished_frac'], True, 0)} "
                f"{fmt(point['goodput_tok_s'], nd=0)}" + ("" if sustained(point) else "*")
                + ("!" if point.get("invalid") else ""))

    def lat(point: dict) -> str:
        return (f"{fmt(point['decomp_e2e_p50_s'], nd=1)}{bracketed(point, 'decomp_e2e_p50_s_ci', False)} "
                f"{num(point['decomp_e2e_p99_s'])} "
                f"{fmt(point['decomp_finished_frac'], True, 0)} {fmt(point['serial_e2e_p50_s'], nd=1)}")

    caps = [Col("capacity", 10, lambda _name, entry: f"{entry['capacity_rps']:.3f}", sub="req/s"),
            Col("x bound", 8, lambda _name, entry: fmt(entry.get("capacity_of_bound"), nd=3)),
            Col("spread", 8, lambda _name, entry: fmt(entry["capacity_spread"], nd=3)), blank(2)]
    if ci:  # the capacity the intervals decide, and the one they do not rule out
        caps.insert(1, Col("range", 13, lambda _name, entry: confidence.span(entry.get("capacity_range_rps"),
                                                                            nd=3), sub="req/s"))
    note = "; [lo-hi]: 95% bootstrap interval over the point's requests" if ci else ""
    return "\n\n".join([
        "SLO axis: attainment, finished, goodput (tok/s) per offered rate (req/s)" + (
            "; *: not sustained (the admission queue grew by more than 5% of the window's arrivals)"
            if any(point.get("queue_growth") is not None
                   for entry in pols.values() for point in entry["points"])
            else "") + ("; !: invalid (emulated device overruns), not counted"
                        if any(point.get("invalid") for entry in pols.values() for point in entry["points"])
                        else "") + note,
        render(pols, [*caps, *_rate_cols(rates, slo, "att fin good", 27 if ci else 17)], name_width=14),
        "latency axis: decomposable P50 / P99 end to end (s), decomposable finished, "
        "serial P50 end to end (s)" + note,
        render(pols, _rate_cols(rates, lat, "dP50 dP99 dfin sP50", 34 if ci else 22), name_width=14)])


def report(res: dict, focus: str = "taper") -> str:
    """The tables, the verdict on the means and each seed's verdict in one line."""
    doc = res["capacity"]
    parts = [tables(doc)] + [part for part in [emulated.device_table(doc)] if part]
    result = verdict(doc, focus)
    if result is not None:
        parts.append("\n".join(result.lines(doc["fluid_bound_rps"])))
        per = res.get("per_seed") or {}
        if len(per) > 1:
            parts.append("per seed: "
                         + "; ".join(_seed_line(seed, seed_doc, focus) for seed, seed_doc in per.items()))
    return "\n\n".join(parts)


def _seed_line(seed: int, doc: dict, focus: str) -> str:
    result = verdict(doc, focus)
    assert result is not None
    caps = ", ".join(f"{policy} {entry['capacity_rps']:.3f}" for policy, entry in doc["policies"].items())
    why = [] if not result.failed() else ["fails: " + "; ".join(result.failed())]
    why += [] if not result.undecided else ["undecided: " + "; ".join(result.undecided)]
    return f"seed {seed}: {caps} -> {result.outcome}" + (f" ({', '.join(why)})" if why else "")


def plot(doc: dict, out: Path, title: str) -> Path:
    from bench.plots import plot_capacity

    return plot_capacity(doc, out / "capacity.png", title, TARGET, holds, LATENCY)


def write(out: Path, res: dict, config: dict, focus: str = "taper") -> Path:
    """capacity.json (the capacity document) and capacity_detail.json (config, per-seed documents and
    points, verdicts): the one writer of both, for the simulator, the replay engine and bench.sweep."""
    verdicts = {"means": verdict(res["capacity"], focus)}
    verdicts |= {str(seed): verdict(doc, focus) for seed, doc in res["per_seed"].items()}
    detail = {"config": config | {"grid": list(GRID), "target": TARGET, "frontier_slack": FRONTIER_SLACK},
              "verdict": {key: result.as_dict() for key, result in verdicts.items() if result is not None},
              "per_seed": {str(seed): doc for seed, doc in res["per_seed"].items()},
              "policies": res["detail"], "wall_s": res["wall_s"]}
    write_json(out / "capacity_detail.json", detail, indent=1, default=str)
    return write_json(out / "capacity.json", res["capacity"], indent=1)


# --------------------------------------------------------------------------------------------- CLI
@dataclass(slots=True)
class CapacityOptions:
    """One `python -m bench.capacity` run (its flags, parsed)."""

    trace: str
    out: str
    policies: str = "serial,cap:2,cap:5,eager,taper-paper,taper"  # comma-separated, as given
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
    rates: str = ""  # comma-separated req/s instead of the grid (no bisection)
    regime: str = "default"  # sim: bench.regimes (latency model, SLO, engine costs, program scale)
    ttft_target_s: float | None = TTFT_TARGET_S  # sim: TTFT attainment's target, taper-prefill's clause


def _rates(text: str) -> list[float]:
    try:
        vals = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"--rates takes numbers separated by commas, got {text!r}") from None
    if any(not rate > 0 for rate in vals) or vals != sorted(vals):
        raise ValueError(f"--rates must be > 0 and ascending, got {text!r}")
    return vals


def parse_args(argv: list[str] | None) -> CapacityOptions:
    parser = argparse.ArgumentParser(prog="python -m bench.capacity", description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", required=True)
    parser.add_argument("--policies", default="serial,cap:2,cap:5,eager,taper-paper,taper")
    parser.add_argument("--slo-tpot-ms", type=float, default=None,
                        help="default: the regime's (50 ms by default)")
    parser.add_argument("--slo-ttft-s", type=float, default=None,
                        help="TTFT target that attainment also requires")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--out", required=True)
    parser.add_argument("--engine", choices=("sim", "replay"), default="sim")
    parser.add_argument("--preset", default="multiverse", choices=sorted(PRESETS))
    parser.add_argument("--rho", type=float, default=0.8)
    parser.add_argument("--max-running", default="sglang",
                        help="sim: running-request limit, sglang (SGLang's default for the pool), "
                             "slo (sensitivity) or N")
    parser.add_argument("--latency-model",
                        help="sim: JSON latency model; default: branchwise's default model")
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="sim: worker processes")
    parser.add_argument("--rates", default="",
                        help="these rates (req/s, ascending) instead of the grid; no bisection")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--launch", action="store_true", help="replay: start a server per policy")
    where.add_argument("--url", help="replay: a running server")
    parser.add_argument("--server-args", default="", help="replay: extra flags for --launch servers")
    parser.add_argument("--regime", default="default",
                        help="sim: bench.regimes' setting (default, live, live-fast, device:PRESET): latency "
                             "model, SLO, engine costs, program scale, point length")
    parser.add_argument("--device", default=None, metavar="PRESET|FILE[@xS]",
                        help="sim: --regime device:PRESET, the emulated device's T(S) and SLO (as make bench "
                             "with --emulate-device PRESET)")
    parser.add_argument("--ttft-target-s", type=float, default=TTFT_TARGET_S,
                        help="sim: TTFT target of the ttft_attainment figure and of taper-prefill's TTFT "
                             "clause (attainment itself requires TTFT only with --slo-ttft-s)")
    parser.add_argument("--no-plot", action="store_true")
    args = parser.parse_args(argv)
    if args.device:
        args.regime = f"device:{args.device}"
    try:
        if args.slo_tpot_ms is None:
            args.slo_tpot_ms = 1e3 * get_regime(args.regime).slo_s
    except ValueError as exc:
        parser.error(str(exc))
    return CapacityOptions(args.trace, args.out, args.policies, args.slo_tpot_ms, args.slo_ttft_s,
                           args.seeds, args.engine, args.preset, args.rho, args.max_running,
                           args.latency_model, args.jobs, args.launch, args.url, args.server_args,
                           not args.no_plot, rates=args.rates, regime=args.regime,
                           ttft_target_s=args.ttft_target_s)


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(argv)
    try:
        policies = [variant_name(name) for name in opts.policies.split(",") if name.strip()]
        seeds = seed_list(opts.seeds)
        rates = _rates(opts.rates) if opts.rates else None
        if not policies or not seeds:
            raise ValueError("need at least one policy and one seed")
        engine = sim_engine(opts) if opts.engine == "sim" else replay_engine(opts)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    shown = rates or grid(engine.fluid_bound_rps)
    if engine.config.get("window_bounds_rps"):
        bounds = engine.config["window_bounds_rps"]
        print("fluid bound of each seed's window: "
              + ", ".join(f"seed {seed} {value:.3f}" for seed, value in bounds.items()) + " req/s")
    print(f"{engine.name}: fluid bound {engine.fluid_bound_rps:.3f} req/s; "
          f"rates {', '.join(f'{rate:.3f}' for rate in shown)} req/s; seeds {seeds}; "
          f"policies {', '.join(policies)}")
    try:
        res = measure(engine, policies, seeds, rates=rates, bisect_steps=0 if rates else None)
    finally:
        engine.close()
    out = Path(opts.out)
    path = write(out, res, asdict(opts) | engine.config)
    print(report(res))
    if opts.plot:
        plot(res["capacity"], out, f"{Path(opts.trace).stem}, {opts.preset}, TPOT SLO {opts.slo_tpot_ms:g} "
             f"ms, max running {opts.max_running}, seeds {opts.seeds}")
    print(f"wall {res['wall_s']:.0f} s -> {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
