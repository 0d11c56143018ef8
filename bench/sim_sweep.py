"""`make bench`'s load sweep in the simulator: the live grid rule, a bench.regimes setting, several seeds.

    python -m bench.sim_sweep --regime live-fast --policies serial,eager,taper --seeds 0,1,2 \
        [--loads 0.1,0.16,0.25,0.4,0.63,1.0] [--reference-rps R] [--without TERMS] [--out FILE]
    python -m bench.sim_sweep --device a100-qwen3-32b-tp8 ...   (= --regime device:a100-qwen3-32b-tp8)

Load 1.0 is bench.sweep's grid rule (the live fluid bound of the regime's T(S) at its SLO,
bench.live.live_bound_rps) unless --reference-rps pins it to a live run's req/s; each point is the
regime's. Per load it prints each policy's attainment (mean over the seeds and per seed), per
policy its capacity by bench.sweep's rule in every seed, and per point the engine's tallies to set
against a live run's step accounting (bench.step_account). `--without` drops parts of the regime
(TERMS) to see which of them decide the ranking; docs/design/simulator.md says what each term is.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from bench.capacity import seed_list
from bench.engine import HostCosts, Simulator, build_controller
from bench.live import live_bound_rps
from bench.metrics import summarize
from bench.point import PointSetup
from bench.probe import Probe
from bench.regimes import SimRegime, get_regime, regime_specs
from bench.sweep import LOADS
from bench.workload import DEFAULT_TRACE, load_trace
from branchwise.taper import parse_policy_name

TERMS = ("plan", "subset", "step", "prefill", "client", "scaling", "padding")


def without(reg: SimRegime, terms: set[str]) -> SimRegime:
    """The regime less some of its parts (`--without`; docs/design/simulator.md)."""
    if bad := terms - set(TERMS):
        raise ValueError(f"unknown --without terms {sorted(bad)}; valid: {', '.join(TERMS)}")
    host, eng, coefs = reg.engine.host, reg.engine, reg.coefs
    drop = {"plan": ("plan",), "subset": ("subset", "same_subset"), "step": ("step",),
            "prefill": ("prefill",)}
    host = replace(host, **{name: HostCosts().__getattribute__(name)
                            for term in terms & drop.keys() for name in drop[term]})
    if "client" in terms:
        eng = replace(eng, client_programs=False, prefill_steps=False)
        host = replace(host, prefill=HostCosts().prefill)
        coefs = coefs[:3] + (0.0,)
    return replace(reg, engine=replace(eng, host=host), coefs=coefs,
                   scaling=None if "scaling" in terms else reg.scaling,
                   graph_batch_sizes=() if "padding" in terms else reg.graph_batch_sizes)


def capacity(points: list[dict[str, Any]], hold: float = 0.95) -> float | None:
    """The last load up to which every load keeps `hold` attainment (None if the first does not)."""
    best = None
    for row in sorted(points, key=lambda row: row["load"]):
        if row["attainment"] < hold:
            break
        best = row["load"]
    return best


def point(reg: SimRegime, trace: Any, policy: str, rate: float, seed: int) -> dict[str, Any]:
    """One simulated point of the regime: attainment, finished fraction and the engine's tallies."""
    t_end = reg.warmup_s + reg.window_s + reg.drain_s
    arrivals_s = t_end if reg.drain_arrivals else reg.warmup_s + reg.window_s
    specs = regime_specs(trace, rate, arrivals_s, seed, "multiverse", reg.scaling)
    cfg, model = reg.engine_for(), reg.model
    ctl = build_controller(policy, model, 0.8, reg.calibrated)
    res = Simulator(specs, ctl, model, cfg, t_end, seed).run()
    metrics = summarize(res.records, cfg.slo_s, (reg.warmup_s, reg.warmup_s + reg.window_s),
                        steps=res.steps, horizon_s=t_end)
    stats, n_steps = res.stats, max(res.stats["decode_steps"], 1)
    return {"attainment": metrics["slo_attainment"], "finished_frac": metrics["finished_frac"],
            "requests": metrics["requests"], "admission_rate": metrics.get("admission_rate"),
            "decode_steps": stats["decode_steps"], "step_ms": 1e3 * stats["decode_s"] / n_steps,
            "rows": stats["rows_run"] / n_steps, "deferred": stats["rows_deferred"] / n_steps,
            "prefill_steps": stats["prefill_steps"],
            "prefill_ms": 1e3 * stats["prefill_s"] / max(stats["prefill_steps"], 1)}


def run(reg: SimRegime, trace_path: str, policies: list[str], seeds: list[int], loads: tuple[float, ...],
        reference_rps: float | None) -> dict[str, Any]:
    trace = load_trace(trace_path)
    ref = reference_rps
    if ref is None:
        if reg.scaling:
            setup = PointSetup(trace, 1e3 * reg.slo_s, reg.scaling)
        else:
            setup = PointSetup(trace, 1e3 * reg.slo_s)
        ref = live_bound_rps(Probe({}, reg.model), setup)
    rows = []
    for load in loads:
        rate = load * ref
        per_policy = {policy: {str(seed): point(reg, trace, policy, rate, seed) for seed in seeds}
                      for policy in policies}
        rows.append({"load": load, "rate": rate, "policies": per_policy})

    def seed_capacity(policy: str, seed: int) -> float | None:
        return capacity([{"load": row["load"], "rate": row["rate"], **row["policies"][policy][str(seed)]}
                         for row in rows])

    caps = {policy: {str(seed): seed_capacity(policy, seed) for seed in seeds} for policy in policies}
    doc = {"regime": reg.name, "engine": asdict(reg.engine), "coefs": reg.coefs, "slo_ms": 1e3 * reg.slo_s,
           "reference_rps": ref, "seeds": seeds, "rows": rows, "capacity": caps}
    return doc | ({"graph_batch_sizes": list(reg.graph_batch_sizes)} if reg.graph_batch_sizes else {})


def table(doc: dict[str, Any], policies: list[str]) -> str:
    lines = [f"regime {doc['regime']}: SLO {doc['slo_ms']:.2f} ms, load 1.0 = {doc['reference_rps']:.2f} "
             f"req/s, seeds {doc['seeds']}; attainment % (mean; per seed)",
             "| load | req/s | " + " | ".join(policies) + " |", "|---|---|" + "---|" * len(policies)]
    for row in doc["rows"]:
        cells = []
        for policy in policies:
            att = [100 * seed_point["attainment"] for seed_point in row["policies"][policy].values()]
            per_seed = " / ".join(f"{pct:.0f}" for pct in att)
            cells.append(f"{statistics.fmean(att):.1f} ({per_seed})")
        lines.append(f"| {row['load']:g} | {row['rate']:.2f} | " + " | ".join(cells) + " |")
    lines.append("capacity (load) per seed: " + "; ".join(
        f"{policy} " + " / ".join(str(cap) for cap in doc["capacity"][policy].values())
        for policy in policies))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.sim_sweep", description=__doc__.split("\n\n")[0])
    parser.add_argument("--regime", default="live-fast", help="a bench.regimes name or device:PRESET")
    parser.add_argument("--device", default=None, metavar="PRESET|FILE[@xS]",
                        help="an emulated device's regime (--regime device:PRESET): the same T(S) and SLO "
                             "as make bench with --emulate-device PRESET")
    parser.add_argument("--trace", default=DEFAULT_TRACE)
    parser.add_argument("--policies", default="serial,eager,taper")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--loads", default=",".join(map(str, LOADS)))
    parser.add_argument("--reference-rps", type=float, default=None,
                        help="load 1.0 in req/s (default: the grid rule)")
    parser.add_argument("--without", default="", help=f"drop parts of the regime: {', '.join(TERMS)}")
    parser.add_argument("--out", help="write the points as JSON here")
    args = parser.parse_args(argv)
    try:
        terms = {term.strip() for term in args.without.split(",") if term.strip()}
        reg = without(get_regime(f"device:{args.device}" if args.device else args.regime), terms)
        policies = [parse_policy_name(name) for name in args.policies.split(",") if name.strip()]
        seeds = seed_list(args.seeds)
        loads = tuple(float(load) for load in args.loads.split(",") if load.strip())
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    doc = run(reg, args.trace, policies, seeds, loads, args.reference_rps)
    print(table(doc, policies))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
