"""Live load sweep (`make bench`): every policy's SLO capacity on the machine that runs it, in one run.

    python -m bench.sweep --launch --model models/tiny --policies off,eager,taper --out runs/bench
    python -m bench.sweep --url off=URL1,eager=URL2,taper=URL3 --slo-tpot-ms 12 --out DIR

The load grid is fixed by a rule before anything is measured, so no point is picked after a result:
1. Start the first policy's server and probe it (bench.probe): T(S) = c0 + c_seq rows + c_ctx context.
2. SLO = max(T(32 rows of 256 KV tokens), 2.5 x T(1 row)) (bench.replay's auto SLO), unless given.
3. Fluid bound: R* rows of 256 KV tokens fit in a step of one SLO, so B = R* / SLO tok/s is the most
   any policy can deliver with every step inside the SLO. Load 1.0 is the arrival rate whose mean
   demand is B (B over the mean output tokens of this workload's programs).
4. Loads (default) 0.1, 0.16, 0.25, 0.4, 0.63 and 1.0 of that rate: geometric, x1.58 a point, from
   far below the bound (where per-request costs, not decode steps, decide) up to the bound itself,
   where no policy can hold (utilisation 1 plus prefills). The grid spans 10x, so a probe that is off
   by 2x either way still leaves the transition inside it.
5. All servers start once and stay up; the loads run in ascending order, each load runs every
   policy (in an order rotated per load, so a drift of a shared box does not always hit the same
   policy) on the same programs (one seed), each server's cache flushed before its run.
   Each run is a stationary schedule (bench.replay.stationary_schedule) of --duration-s seconds
   plus --drain-s; a program unfinished by then is a miss.
Reported per load: attainment over all arrivals (unfinished = miss), finished fraction, goodput and
P99 TTFT of each policy; per policy its capacity: the largest load up to which every load keeps
>= 95% attainment. The verdict checks that taper's attainment is >= each other policy's at every load
(within one request) and that its capacity is the highest. DIR gets sweep.json (everything),
capacity.json (bench.capacity's shape) and records per load.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from bench.client import Run
from bench.point import PointSetup, run_point
from bench.probe import Probe, probe
from bench.programs import Scaling, build_programs
from bench.results import write_records
from bench.workload import DEFAULT_TRACE, PRESETS, TraceError, load_trace, stationary_schedule
from branchwise.launch import LocalServer, ServerError

LOADS = (0.1, 0.16, 0.25, 0.4, 0.63, 1.0)
HOLD = 0.95


# --------------------------------------------------------------------------------- the load rule
@dataclass(frozen=True, slots=True)
class Grid:
    """The operating points of a sweep, derived from a probe by the rule in the module docstring."""

    slo_tpot_ms: float
    bound_tok_s: float  # fluid bound B = R* / SLO
    rows_at_slo: float  # R*
    mean_program_tokens: float
    reference_rate: float  # req/s at load 1.0
    loads: tuple[float, ...]

    @property
    def rates(self) -> list[float]:
        return [x * self.reference_rate for x in self.loads]


def mean_program_tokens(trace: Any, setup: PointSetup, seed: int, n: int = 2000) -> float:
    """Mean output tokens per program of this workload (a long stationary draw, scaled as replayed)."""
    sched = stationary_schedule(trace, 1.0, float(n), seed)
    specs = build_programs(trace, sched, setup.preset, seed, setup.scaling)
    return sum(s.output_tokens for s in specs) / max(len(specs), 1)


def load_grid(p: Probe, mean_tokens: float, loads: tuple[float, ...] = LOADS, slo_tpot_ms: float | None = None,
              slo_rows: float = 32.0, slo_context: float = 256.0, slo_floor: float = 2.5) -> Grid:
    slo_s = slo_tpot_ms / 1e3 if slo_tpot_ms else p.auto_slo_s(slo_rows, slo_context, slo_floor)
    rows = p.rows_within(slo_s, slo_context)
    bound = rows / slo_s
    return Grid(1e3 * slo_s, bound, rows, mean_tokens, bound / mean_tokens, tuple(loads))


# ------------------------------------------------------------------------------------ verdicts
def capacity(points: list[dict[str, Any]], hold: float = HOLD) -> dict[str, Any]:
    """Largest load (and rate) up to which every point keeps `hold` attainment; None if the first fails."""
    best = None
    for pt in sorted(points, key=lambda x: x["load"]):
        if (pt.get("attainment") or 0.0) < hold:
            break
        best = pt
    return {"load": best["load"] if best else None, "rate": best["rate"] if best else None}


def verdict(rows: list[dict[str, Any]], caps: dict[str, dict], focus: str = "taper") -> dict[str, Any]:
    """taper's attainment >= every other policy's at each load, within one request, and its capacity
    the highest (ties allowed); every load that breaks it is listed."""
    breaks = []
    for r in rows:
        pol = r["policies"]
        mine = (pol.get(focus) or {}).get("attainment")
        n = max((pol.get(focus) or {}).get("requests") or 0, 1)
        for k, v in pol.items():
            other = v.get("attainment")
            if k != focus and other is not None and (mine is None or mine < other - 1.0 / n - 1e-9):
                breaks.append({"load": r["load"], "policy": k, focus: mine, k: other, "requests": n})
    cap = {k: (v["load"] or 0.0) for k, v in caps.items()}
    highest = focus in cap and all(cap[focus] >= c for c in cap.values())
    spans = (rows[0]["policies"] and all((v.get("attainment") or 0) >= HOLD for v in rows[0]["policies"].values())
             and all((v.get("attainment") or 0) < HOLD for v in rows[-1]["policies"].values())) if rows else False
    return {"pointwise": not breaks, "breaks": breaks, "capacity_highest": highest,
            "grid_spans_hold_to_fail": bool(spans), "passed": not breaks and highest}


# ------------------------------------------------------------------------------------- output
def _f(x: float | None, pct: bool = False, nd: int = 1) -> str:
    if x is None:
        return "-"
    return f"{100 * x:.{nd}f}%" if pct else f"{x:.{nd}f}"


def table(rows: list[dict[str, Any]], policies: list[str]) -> str:
    head = f"{'load':>5}{'req/s':>7}{'reqs':>5}{'tok/s':>6}" + "".join(
        f" | {k[:8]:<8}{'att':>6}{'fin':>6}{'good':>6}{'ttft99':>7}" for k in policies)
    lines = [head, "-" * len(head)]
    for r in rows:
        cells = ""
        for k in policies:
            v = r["policies"].get(k) or {}
            cells += (f" | {'':<8}{_f(v.get('attainment'), True, 0):>6}{_f(v.get('finished_frac'), True, 0):>6}"
                      f"{_f(v.get('goodput_tok_s'), nd=0):>6}{_f(v.get('p99_ttft_s'), nd=2):>7}")
        lines.append(f"{r['load']:>5g}{r['rate']:>7.2f}{r['requests']:>5d}{_f(r['demand_tok_s'], nd=0):>6}{cells}")
    return "\n".join(lines)


def report(doc: dict[str, Any], policies: list[str]) -> str:
    g, v = doc["grid"], doc["verdict"]
    caps = ", ".join(f"{k} {_f(c['load'], nd=2)} ({_f(c['rate'], nd=2)} req/s)" for k, c in doc["capacity"].items())
    lines = [f"SLO {g['slo_tpot_ms']:.2f} ms; load 1.0 = {g['reference_rate']:.2f} req/s "
             f"(fluid bound {g['bound_tok_s']:.0f} tok/s = {g['rows_at_slo']:.0f} rows / SLO, "
             f"{g['mean_program_tokens']:.0f} tokens per program)",
             table(doc["rows"], policies), f"capacity (last load with >= {HOLD:.0%} and all below): {caps}"]
    if not v["grid_spans_hold_to_fail"]:
        lines.append("note: the grid does not span from a load where every policy holds to one where all fail")
    for b in v["breaks"]:
        lines.append(f"BREAK at load {b['load']:g}: taper {_f(b['taper'], True)} < {b['policy']} "
                     f"{_f(b[b['policy']], True)} by more than one of {b['requests']} requests")
    lines.append(f"acceptance (taper >= the others at every load within one request, capacity highest): "
                 f"{'PASS' if v['passed'] else 'FAIL'}")
    return "\n".join(lines)


def capacity_doc(rows: list[dict[str, Any]], caps: dict[str, dict], policies: list[str]) -> dict[str, Any]:
    """bench.capacity's capacity.json shape (one seed: no spread)."""
    keys = ("rate", "load", "goodput_tok_s", "attainment", "finished_frac", "p99_ttft_s")
    return {"engine": "replay", "policies": {k: {
        "capacity_rps": caps[k]["rate"], "capacity_spread": None,
        "points": [{m: (r["policies"].get(k) or {}).get(m, r.get(m)) for m in keys} for r in rows]}
        for k in policies}}


# -------------------------------------------------------------------------------------- the run
@dataclass(slots=True)
class Sweep:
    a: argparse.Namespace
    policies: list[str]
    setup: PointSetup | None = None
    grid: Grid | None = None
    probes: dict[str, Any] = field(default_factory=dict)
    rows: list[dict[str, Any]] = field(default_factory=list)
    t0: float = field(default_factory=time.perf_counter)

    def document(self) -> dict[str, Any]:
        pts = {k: [{"load": r["load"], "rate": r["rate"]} | (r["policies"].get(k) or {}) for r in self.rows]
               for k in self.policies}
        caps = {k: capacity(v) for k, v in pts.items()}
        cfg = {k: v for k, v in vars(self.a).items() if k not in ("url",)}
        return {"grid": asdict(self.grid) if self.grid else None, "rows": self.rows, "capacity": caps,
                "verdict": verdict(self.rows, caps), "probes": self.probes, "config": cfg,
                "setup": {"slo_tpot_ms": self.setup.slo_tpot_ms, "duration_s": self.setup.duration_s,
                          "drain_s": self.setup.drain_s, "preset": self.setup.preset,
                          "scaling": asdict(self.setup.scaling), "slo_ttft_s": self.setup.slo_ttft_s}
                if self.setup else None, "wall_s": time.perf_counter() - self.t0}

    def save(self) -> dict[str, Any]:
        out = Path(self.a.out)
        out.mkdir(parents=True, exist_ok=True)
        doc = self.document()
        (out / "sweep.json").write_text(json.dumps(doc, indent=1, default=float))
        (out / "capacity.json").write_text(json.dumps(capacity_doc(self.rows, doc["capacity"], self.policies),
                                                      indent=1, default=float))
        return doc

    def run_load(self, i: int, load: float, rate: float, urls: dict[str, str]) -> bool:
        """Every policy at one load; False when interrupted."""
        order = self.policies[i % len(self.policies):] + self.policies[:i % len(self.policies)]
        sched, specs = self.setup.programs(rate, self.a.seed)
        row = {"load": load, "rate": rate, "requests": len(specs),
               "demand_tok_s": sum(s.output_tokens for s in specs) / sched.duration_s, "order": order,
               "policies": {}}
        self.rows.append(row)
        runs: dict[str, Run] = {}
        print(f"\n== load {load:g}: {rate:.2f} req/s, {len(specs)} programs, {row['demand_tok_s']:.0f} tok/s "
              f"demanded; order {','.join(order)}", flush=True)
        for k in order:
            m, run = run_point(urls[k], k, rate, self.a.seed, self.setup, progress=not self.a.no_progress)
            row["policies"][k], runs[k] = m, run
            print(f"{k:>10}: attainment {_f(m['attainment'], True)}, finished {_f(m['finished_frac'], True)}, "
                  f"goodput {_f(m['goodput_tok_s'], nd=0)} tok/s, P99 TTFT {_f(m['p99_ttft_s'], nd=2)} s"
                  + (f"  [{m['error']}]" if m.get("error") else ""), flush=True)
            self.save()
            if run.interrupted:
                return False
        write_records(Path(self.a.out) / f"load_{load:g}", runs)
        return True


def _probe(url: str) -> Probe:
    p = asyncio.run(probe(url, repeats=3))
    print(f"probe {url}: {p.line()}", flush=True)
    return p


def server_args(policy: str, a: argparse.Namespace, slo_ms: float | None, model: str | None) -> list[str]:
    """Requests carry their SLO stamp; the flag covers unstamped ones (none before calibration)."""
    args = ["--branch-policy", policy, "--taper-rho", f"{a.taper_rho:g}", "--enable-metrics"]
    args += ["--branch-slo-tpot-ms", f"{slo_ms:.6g}"] if slo_ms else []
    return args + (["--latency-model", model] if model else []) + a.server_args.split()


def _env(a: argparse.Namespace) -> dict[str, str]:
    # torch's OpenMP threads spin at barriers: more threads than free cores slows every step
    return {"OMP_NUM_THREADS": str(a.server_threads)} if a.server_threads else {}


def start(a: argparse.Namespace, args: list[str]) -> LocalServer:
    return LocalServer(a.model, args, env=_env(a), max_total_tokens=a.max_total_tokens).start()


# ------------------------------------------------------------- bench.capacity's replay engine
@dataclass(slots=True)
class ServerPool:
    """One launched server per policy, at most `max_alive` at once (least recently used stops first):
    bench.capacity runs policies one after another, and a server holds ~3 GB on CPU."""

    a: argparse.Namespace
    slo_ms: float
    model: str | None
    alive: dict[str, LocalServer] = field(default_factory=dict)
    max_alive: int = 3

    def url(self, policy: str) -> str:
        if policy in self.alive:
            self.alive[policy] = self.alive.pop(policy)  # most recently used last
            return self.alive[policy].url
        while len(self.alive) >= self.max_alive:
            self.alive.pop(next(iter(self.alive))).stop()
        self.alive[policy] = start(self.a, server_args(policy, self.a, self.slo_ms, self.model))
        return self.alive[policy].url

    def close(self) -> None:
        while self.alive:
            self.alive.popitem()[1].stop()


def capacity_engine(a: argparse.Namespace) -> Any:
    """bench.capacity --engine replay: live points (bench.replay.run_point) at the given TPOT SLO,
    the grid's 1.0 at bench.capacity.fluid_bound of a probe of the first server (its T(S) has no
    prefill term). --launch: one server per policy, taper ones planning with the probe's fit;
    --url: one running server, so one policy."""
    from bench.capacity import Engine, fluid_bound

    for k, v in (("model", "models/tiny"), ("server_threads", 1), ("max_total_tokens", 65536),
                 ("taper_rho", getattr(a, "rho", 0.8))):
        if not hasattr(a, k):
            setattr(a, k, v)
    policies = [p.strip() for p in a.policies.split(",") if p.strip()]
    if a.url and len(policies) != 1:
        raise ValueError("--engine replay --url: a running server has one policy; pass it alone in --policies "
                         "(or use --launch)")
    trace = load_trace(a.trace)
    setup = PointSetup(trace, a.slo_tpot_ms, Scaling(1.0, 256), preset=a.preset, slo_ttft_s=a.slo_ttft_s)
    pool = ServerPool(a, a.slo_tpot_ms, None) if a.launch else None
    calib = next((k for k in policies if not k.startswith("taper")), "off")
    try:
        p = _probe(pool.url(calib) if pool else a.url)
    except BaseException:
        if pool:
            pool.close()
        raise
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if pool:
        pool.model = str(out / "latency_model.json")
        p.model.save(pool.model)
        if calib not in policies:
            pool.close()
    ref = replace(setup, duration_s=2000.0).programs(1.0, 0)[1]  # the workload's means
    base = fluid_bound(p.model, a.slo_tpot_ms / 1e3, ref)

    def point(policy: str, rate: float, seed: int) -> dict:
        url = pool.url(policy) if pool else a.url
        m, run = run_point(url, policy, rate, seed, setup)
        if run.interrupted:
            raise KeyboardInterrupt
        return m

    class _Live(Engine):
        def close(self) -> None:
            Engine.close(self)
            if pool:
                pool.close()

    conf = {"engine": "replay", "fluid_bound_rps": base, "probe": p.as_dict(), "duration_s": setup.duration_s,
            "drain_s": setup.drain_s, "scaling": asdict(setup.scaling), "server": "launch" if pool else a.url}
    return _Live("replay", point, base, 1, conf)


def _loads(text: str) -> tuple[float, ...]:
    try:
        vals = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers separated by commas, got {text!r}") from None
    if not vals or any(not v > 0 for v in vals) or list(vals) != sorted(vals):
        raise argparse.ArgumentTypeError(f"loads must be > 0 and ascending, got {text!r}")
    return vals


def _urls(text: str) -> dict[str, str]:
    pairs = [x.split("=", 1) for x in text.split(",") if x.strip()]
    if not pairs or any(len(p) != 2 or not p[0] or not p[1] for p in pairs):
        raise argparse.ArgumentTypeError(f"expected policy=URL pairs separated by commas, got {text!r}")
    return dict(pairs)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.sweep", description=__doc__.split("\n\n")[0])
    where = ap.add_mutually_exclusive_group(required=True)
    where.add_argument("--launch", action="store_true", help="start one server per policy")
    where.add_argument("--url", type=_urls, help="running servers, policy=URL,...")
    ap.add_argument("--model", default="models/tiny")
    ap.add_argument("--policies", default="off,eager,taper", help="with --launch")
    ap.add_argument("--trace", default=DEFAULT_TRACE)
    ap.add_argument("--preset", default="multiverse", choices=sorted(PRESETS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--loads", type=_loads, default=LOADS, help="fractions of the fluid-bound rate")
    ap.add_argument("--slo-tpot-ms", type=float, default=None, help="default: from the probe (module docstring)")
    ap.add_argument("--slo-ttft-s", type=float, default=None, help="a TTFT target attainment also requires")
    ap.add_argument("--duration-s", type=float, default=40.0)
    ap.add_argument("--drain-s", type=float, default=20.0)
    ap.add_argument("--output-scale", type=float, default=1.0)
    ap.add_argument("--max-stage-tokens", type=int, default=256)
    ap.add_argument("--taper-rho", type=float, default=0.8)
    ap.add_argument("--server-args", default="", help="extra flags for --launch servers")
    ap.add_argument("--server-threads", type=int, default=1, help="OMP threads of --launch servers; 0: torch's")
    ap.add_argument("--max-total-tokens", type=int, default=65536)
    ap.add_argument("--out", required=True)
    ap.add_argument("--no-progress", action="store_true")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    try:
        trace = load_trace(a.trace)
        scaling = Scaling(a.output_scale, a.max_stage_tokens)
    except (TraceError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    policies = list(a.url) if a.url else [p.strip() for p in a.policies.split(",") if p.strip()]
    sw = Sweep(a, policies)
    servers: list[LocalServer] = []
    try:
        urls = dict(a.url or {})
        # a server whose policy needs no T(S) calibrates (serial probe streams: the policy does not
        # matter); the others start with its fit. Only taper policies: a temporary off server.
        calib = next((k for k in policies if not k.startswith("taper")), None)
        if a.launch:
            servers.append(start(a, server_args(calib or "off", a, a.slo_tpot_ms, None)))
            urls[calib or "calibration"] = servers[0].url
        p = _probe(urls[calib or ("calibration" if a.launch else policies[0])])
        if calib is None and a.launch:
            servers.pop().stop()
        sw.probes["start"] = p.as_dict()
        base = PointSetup(trace, 1.0, scaling, a.duration_s, a.drain_s, a.preset, a.slo_ttft_s)
        sw.grid = load_grid(p, mean_program_tokens(trace, base, a.seed), a.loads, a.slo_tpot_ms)
        sw.setup = PointSetup(trace, sw.grid.slo_tpot_ms, scaling, a.duration_s, a.drain_s, a.preset, a.slo_ttft_s)
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        model = str(out / "latency_model.json")
        p.model.save(model)
        if a.launch:
            for k in policies:
                if k not in urls:
                    servers.append(LocalServer(a.model, server_args(k, a, sw.grid.slo_tpot_ms, model), env=_env(a),
                                               max_total_tokens=a.max_total_tokens))
                    urls[k] = servers[-1].start().url
        g = sw.grid
        print(f"SLO {g.slo_tpot_ms:.2f} ms, load 1.0 = {g.reference_rate:.2f} req/s; loads "
              + ", ".join(f"{x:g} ({r:.2f} req/s)" for x, r in zip(g.loads, g.rates, strict=True)), flush=True)
        sw.save()
        for i, (load, rate) in enumerate(zip(g.loads, g.rates, strict=True)):
            if not sw.run_load(i, load, rate, urls):
                print("interrupted: what ran is saved", file=sys.stderr)
                return 130
        end = _probe(urls[calib or policies[0]])
        sw.probes["end"] = end.as_dict()
    except (ServerError, ConnectionError, RuntimeError, OSError) as e:
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted: what ran is saved", file=sys.stderr)
        return 130
    finally:
        for s in servers:
            s.stop()
        if sw.grid is not None:
            doc = sw.save()
            print("\n" + report(doc, policies) + f"\nwall {doc['wall_s']:.0f} s -> {Path(a.out) / 'sweep.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
