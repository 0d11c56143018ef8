"""`make bench`'s load sweep in the simulator: the live grid rule, a bench.regimes setting, several seeds.

    python -m bench.sim_sweep --regime live-fast --policies off,eager,taper --seeds 0,1,2 \
        [--loads 0.1,0.16,0.25,0.4,0.63,1.0] [--reference-rps R] [--without TERMS] [--out FILE]

The grid is bench.sweep's (load 1.0 = the live fluid bound of the regime's T(S) at its SLO over the
sweep's programs, bench.live.live_bound_rps) unless --reference-rps pins load 1.0 to a live run's
req/s.
Each point is the regime's (bench.regimes: a live point is 40 s of arrivals and 20 s of drain from an
idle server). Per load it prints each policy's attainment, mean over the seeds and per seed; per
policy its capacity by bench.sweep's rule (the last load up to which every load holds 95%) in every seed; and per point the engine's tallies (decode
steps, mean step, rows run and deferred per step, prefill forwards) to set against a live run's
step accounting (bench.step_account). `--without` drops parts of the regime, to see which of them
decide the ranking: `plan`, `subset` (both deferring-step costs), `step`, `prefill` (HostCosts
terms), `client` (server-side phases and prefill chunks in mixed steps instead of client-side
fork/join and prefill forwards, no prefill cost), `scaling` (trace-scale programs).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from bench.engine import HostCosts, Simulator, build_controller
from bench.live import live_bound_rps
from bench.metrics import summarize
from bench.point import PointSetup
from bench.probe import Probe
from bench.regimes import SimRegime, get_regime, regime_specs
from bench.sweep import LOADS
from bench.workload import DEFAULT_TRACE, load_trace
from branchwise.taper import parse_policy_name

TERMS = ("plan", "subset", "step", "prefill", "client", "scaling")


def without(reg: SimRegime, terms: set[str]) -> SimRegime:
    """The regime less some of its parts (module docstring)."""
    if bad := terms - set(TERMS):
        raise ValueError(f"unknown --without terms {sorted(bad)}; valid: {', '.join(TERMS)}")
    host, eng, coefs = reg.engine.host, reg.engine, reg.coefs
    drop = {"plan": ("plan",), "subset": ("subset", "same_subset"), "step": ("step",), "prefill": ("prefill",)}
    host = replace(host, **{f: HostCosts().__getattribute__(f) for t in terms & drop.keys() for f in drop[t]})
    if "client" in terms:
        eng, host, coefs = replace(eng, client_programs=False, prefill_steps=False), replace(host, prefill=HostCosts().prefill), \
            coefs[:3] + (0.0,)
    return replace(reg, engine=replace(eng, host=host), coefs=coefs,
                   scaling=None if "scaling" in terms else reg.scaling)


def capacity(points: list[dict[str, Any]], hold: float = 0.95) -> float | None:
    """The last load up to which every load keeps `hold` attainment (None if the first does not)."""
    best = None
    for pt in sorted(points, key=lambda x: x["load"]):
        if pt["attainment"] < hold:
            break
        best = pt["load"]
    return best


def point(reg: SimRegime, trace: Any, policy: str, rate: float, seed: int) -> dict[str, Any]:
    """One simulated point of the regime: attainment, finished fraction and the engine's tallies."""
    t_end = reg.warmup_s + reg.window_s + reg.drain_s
    arrivals_s = t_end if reg.drain_arrivals else reg.warmup_s + reg.window_s
    specs = regime_specs(trace, rate, arrivals_s, seed, "multiverse", reg.scaling)
    cfg, model = reg.engine_for(), reg.model
    res = Simulator(specs, build_controller(policy, model, 0.8, reg.calibrated), model, cfg, t_end, seed).run()
    m = summarize(res.records, cfg.slo_s, (reg.warmup_s, reg.warmup_s + reg.window_s), steps=res.steps,
                  horizon_s=t_end)
    st, n = res.stats, max(res.stats["decode_steps"], 1)
    return {"attainment": m["slo_attainment"], "finished_frac": m["finished_frac"], "requests": m["requests"],
            "admission_rate": m.get("admission_rate"), "decode_steps": st["decode_steps"],
            "step_ms": 1e3 * st["decode_s"] / n, "rows": st["rows_run"] / n, "deferred": st["rows_deferred"] / n,
            "prefill_steps": st["prefill_steps"],
            "prefill_ms": 1e3 * st["prefill_s"] / max(st["prefill_steps"], 1)}


def run(reg: SimRegime, trace_path: str, policies: list[str], seeds: list[int], loads: tuple[float, ...],
        reference_rps: float | None) -> dict[str, Any]:
    trace = load_trace(trace_path)
    ref = reference_rps
    if ref is None:
        setup = PointSetup(trace, 1e3 * reg.slo_s, reg.scaling) if reg.scaling else PointSetup(trace, 1e3 * reg.slo_s)
        ref = live_bound_rps(Probe({}, reg.model), setup)
    rows = []
    for load in loads:
        rate = load * ref
        pts = {p: {str(s): point(reg, trace, p, rate, s) for s in seeds} for p in policies}
        rows.append({"load": load, "rate": rate, "policies": pts})
    caps = {p: {str(s): capacity([{"load": r["load"], "rate": r["rate"], **r["policies"][p][str(s)]} for r in rows])
                for s in seeds} for p in policies}
    return {"regime": reg.name, "engine": asdict(reg.engine), "coefs": reg.coefs, "slo_ms": 1e3 * reg.slo_s, "reference_rps": ref, "seeds": seeds, "rows": rows,
            "capacity": caps}


def table(doc: dict[str, Any], policies: list[str]) -> str:
    lines = [f"regime {doc['regime']}: SLO {doc['slo_ms']:.2f} ms, load 1.0 = {doc['reference_rps']:.2f} req/s, "
             f"seeds {doc['seeds']}; attainment % (mean; per seed)",
             "| load | req/s | " + " | ".join(policies) + " |", "|---|---|" + "---|" * len(policies)]
    for r in doc["rows"]:
        cells = []
        for p in policies:
            att = [100 * v["attainment"] for v in r["policies"][p].values()]
            cells.append(f"{statistics.fmean(att):.1f} ({' / '.join(f'{a:.0f}' for a in att)})")
        lines.append(f"| {r['load']:g} | {r['rate']:.2f} | " + " | ".join(cells) + " |")
    lines.append("capacity (load) per seed: " + "; ".join(
        f"{p} " + " / ".join(str(c) for c in doc["capacity"][p].values()) for p in policies))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.sim_sweep", description=__doc__.split("\n\n")[0])
    ap.add_argument("--regime", default="live-fast")
    ap.add_argument("--trace", default=DEFAULT_TRACE)
    ap.add_argument("--policies", default="off,eager,taper")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--loads", default=",".join(map(str, LOADS)))
    ap.add_argument("--reference-rps", type=float, default=None, help="load 1.0 in req/s (default: the grid rule)")
    ap.add_argument("--without", default="", help=f"drop parts of the regime: {', '.join(TERMS)}")
    ap.add_argument("--out", help="write the points as JSON here")
    a = ap.parse_args(argv)
    try:
        reg = without(get_regime(a.regime), {t.strip() for t in a.without.split(",") if t.strip()})
        policies = [parse_policy_name(p) for p in a.policies.split(",") if p.strip()]
        seeds = [int(s) for s in a.seeds.split(",") if s.strip()]
        loads = tuple(float(x) for x in a.loads.split(",") if x.strip())
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    doc = run(reg, a.trace, policies, seeds, loads, a.reference_rps)
    print(table(doc, policies))
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
