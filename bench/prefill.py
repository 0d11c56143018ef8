"""The prefill budget in the simulator: policy variants, the long-prompt workload, the TTFT table.

bench.capacity takes these names in --policies beside the plain ones:

* `POLICY@N`: POLICY (serial, eager, taper, ...) with a fixed --chunked-prefill-size of N tokens:
  the baselines, the prefill analogue of cap:K (`BASELINES`: {serial, eager, taper} x CHUNKS).
* `taper-prefill` (or `taper-prefill@N`): taper, with each step's chunk sized by the decoding
  requests' slack (branchwise.taper.prefill_budget) under a cap of N (default: the engine's
  chunk_tokens, 8192). The floor is min_chunk_for(SLO, rho, c_tok); the TTFT clause uses the run's
  TTFT target (--ttft-target-s).

    python -m bench.prefill longprompt OUT.csv      # the long-prompt workload (docstring of long_prompt_trace)
    python -m bench.prefill report DIR              # TTFT beside TPOT attainment from a capacity run

The rule and the workload's statistics: docs/design/prefill-budget.md; results: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from bench.capacity import CapacityOptions
from bench.variants import BASELINES, RULED, TTFT_TARGET_S, variant_name
from bench.workload import DEFAULT_TRACE, Trace, load_trace, write_trace

# The long-prompt workload (long_prompt_trace): the Azure 2023 code trace's published median prompt
# (Patel et al., Splitwise, ISCA 2024: 1500 tokens for coding, 1020 for conversation) with the
# spread of the conversation trace's own prompts (lognormal sigma from its quartiles)
CODE_MEDIAN_PROMPT = 1500
MAX_PROMPT = 16000


# --------------------------------------------------------------------------------- the workload
def long_prompt_trace(base: Trace, seed: int = 0) -> Trace:
    """The Azure conversation trace's arrivals and outputs with long prompts: lognormal, median
    CODE_MEDIAN_PROMPT (the published median of the Azure 2023 code trace), sigma of the
    conversation trace's own log prompts (from its interquartile range), clipped to
    [1, MAX_PROMPT]. With sigma 0.815 the mean is ~2.1k tokens, P90 ~4.3k, P99 ~10k."""
    q25, q75 = np.percentile(np.log(np.maximum(base.prompt_tokens, 1)), [25, 75])
    sigma = float((q75 - q25) / 1.3489795)
    rng = np.random.default_rng(seed)
    prompts = np.clip(rng.lognormal(math.log(CODE_MEDIAN_PROMPT), sigma, len(base)), 1, MAX_PROMPT)
    return Trace(base.arrival_s, prompts.astype(np.int64), base.output_tokens,
                 f"long-prompt(median={CODE_MEDIAN_PROMPT},sigma={sigma:.3f},seed={seed})")


# ------------------------------------------------------------------------------------ the table
def _pct(value: float | None, pct: bool = False) -> str:
    if value is None or not math.isfinite(value):
        return "-"
    return f"{100 * value:.0f}%" if pct else f"{value:.2f}"


def report(detail: dict, means: dict | None = None) -> str:
    """Per policy: capacity (mean and per seed), then at each grid rate TPOT attainment, TTFT
    attainment (target in the config), TTFT P50 / P99 (s) and decomposable P50 end to end (s),
    means over the seeds."""
    conf = detail["config"]
    bound = conf.get("fluid_bound_rps")
    target = conf.get("ttft_target_s")
    lines = [f"fluid bound {bound:.3f} req/s (prefill work included); TTFT target {target} s",
             "per rate: TPOT att / TTFT att / TTFT P50 / TTFT P99 / decomposable P50 e2e (s), means over seeds"]
    policies = detail["policies"]
    rates = sorted({point["rate"] for entry in policies.values() for point in entry["points"]})
    grid = [rate for rate in rates if all(any(point["rate"] == rate for point in entry["points"])
                                          for entry in policies.values())]
    lines.append(f"{'policy':<16}{'capacity':>9} {'x bound':>7}  per seed" + "".join(
        f"{rate:>31.3f}" for rate in grid))
    for name, entry in policies.items():
        caps = list(entry["capacity_per_seed"].values())
        mean = float(np.mean(caps))
        cells = []
        for rate in grid:
            pts = [point for point in entry["points"] if point["rate"] == rate]

            def avg(key: str, pts: list[dict] = pts) -> float | None:
                vals = [point[key] for point in pts if point.get(key) is not None]
                return float(np.mean(vals)) if vals else None
            cells.append(f"{_pct(avg('attainment'), True)}/{_pct(avg('ttft_attainment'), True)}/"
                         f"{_pct(avg('ttft_p50_s'))}/{_pct(avg('p99_ttft_s'))}/{_pct(avg('decomp_e2e_p50_s'))}")
        of_bound = f"{mean / bound:.3f}" if bound else "-"
        lines.append(f"{name:<16}{mean:>9.3f} {of_bound:>7}  " + "/".join(f"{cap:.3f}" for cap in caps)
                     + "".join(f"{cell:>31}" for cell in cells))
    lines += verdict_lines(detail, means)
    return "\n".join(lines)


def verdict_lines(detail: dict, means: dict | None = None, focus: str = RULED) -> list[str]:
    """bench.capacity's two-axis verdict with `focus` (taper-prefill) against every other entry, on
    the means (capacity.json's document) and in each seed."""
    from bench.capacity import verdict  # bench.capacity imports this module

    out = []
    for seed, doc in [("means", means), *detail.get("per_seed", {}).items()]:
        if doc is None:
            continue
        result = verdict(doc, focus)
        if result is None:
            return []
        fails = "; ".join(result.failed()) if result.failed() else ""
        out.append(f"seed {seed}: {result.outcome}" + (f" ({fails})" if fails else ""))
    return out


def run_points(opts: CapacityOptions, fracs: list[float], out: Path) -> Path:
    """bench.capacity's points at fixed fractions of the fluid bound, seed by seed, each appended to
    out/points.jsonl as it ends (a run cut short keeps what it measured; points already there are
    not run again)."""
    from concurrent.futures import ProcessPoolExecutor, as_completed

    from bench.capacity import seed_list, sim_engine

    engine = sim_engine(opts)
    bound = engine.fluid_bound_rps
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(engine.config | {"fracs": fracs, "policies": opts.policies,
                                                                 "ttft_target_s": opts.ttft_target_s},
                                                default=str, indent=1))
    path = out / "points.jsonl"
    done = set()
    if path.exists():
        done = {(point["policy"], point["frac"], point["seed"]) for point in map(json.loads, path.read_text().splitlines())}
    policies = [variant_name(name) for name in opts.policies.split(",") if name.strip()]
    jobs = [(policy, frac, seed) for seed in seed_list(opts.seeds) for frac in fracs for policy in policies
            if (policy, frac, seed) not in done]
    with ProcessPoolExecutor(max(opts.jobs, 1)) as pool, path.open("a") as sink:
        futs = {pool.submit(engine.point, policy, round(frac * bound, 6), seed): (policy, frac, seed)
                for policy, frac, seed in jobs}
        for fut in as_completed(futs):
            policy, frac, seed = futs[fut]
            sink.write(json.dumps(fut.result() | {"policy": policy, "frac": frac, "seed": seed}) + "\n")
            sink.flush()
    return path


def points_report(out: Path, markdown: bool = False) -> str:
    """Per workload run (run_points): per policy and seed the capacity on the fixed rates (the highest
    rate with it and every lower one held, bench.capacity.holds), then per rate the means over seeds
    of TPOT attainment / TTFT attainment / TTFT P50 / TTFT P99 / decomposable P50 end to end."""
    from bench.capacity import holds

    conf = json.loads((out / "config.json").read_text())
    pts = [json.loads(line) for line in (out / "points.jsonl").read_text().splitlines()]
    policies = list(dict.fromkeys(variant_name(name) for name in conf["policies"].split(",") if name.strip()))
    fracs = sorted({point["frac"] for point in pts})
    seeds = sorted({point["seed"] for point in pts})
    got = {(point["policy"], point["frac"], point["seed"]): point for point in pts}
    bound = conf["fluid_bound_rps"]
    lines = [f"fluid bound {bound:.3f} req/s (prefill work included); TTFT target {conf['ttft_target_s']} s; "
             f"rates {', '.join(f'{frac:g}' for frac in fracs)} x bound; seeds with points: {seeds}",
             "capacity per seed: highest fixed rate held with every lower one (0: the first fails; ?: missing)",
             "per rate: TPOT att / TTFT att / TTFT P50 s / TTFT P99 s / decomposable P50 e2e s (means over seeds)"]
    if markdown:
        lines += ["", "| policy | capacity per seed | " + " | ".join(f"{frac * bound:.3f} req/s" for frac in fracs) + " |",
                  "|---|---|" + "---|" * len(fracs)]
    else:
        lines.append(f"{'policy':<18}{'capacity per seed':<24}"
                     + "".join(f"{frac * bound:>34.3f}" for frac in fracs))
    for policy in policies:
        caps = []
        for seed in seeds:
            cap = 0.0
            for frac in fracs:
                point = got.get((policy, frac, seed))
                if point is None:
                    cap = None
                    break
                if not holds(point):
                    break
                cap = frac * bound
            caps.append("?" if cap is None else f"{cap:.3f}")
        cells = []
        for frac in fracs:
            here = [got[(policy, frac, seed)] for seed in seeds if (policy, frac, seed) in got]

            def avg(key: str, here: list[dict] = here) -> float | None:
                vals = [point[key] for point in here if point.get(key) is not None]
                return float(np.mean(vals)) if vals else None
            cells.append(f"{_pct(avg('attainment'), True)}/{_pct(avg('ttft_attainment'), True)}/"
                         f"{_pct(avg('ttft_p50_s'))}/{_pct(avg('p99_ttft_s'))}/{_pct(avg('decomp_e2e_p50_s'))}"
                         + ("" if len(here) == len(seeds) else f"({len(here)})"))
        if markdown:
            lines.append(f"| {policy} | {' / '.join(caps)} | " + " | ".join(cells) + " |")
        else:
            lines.append(f"{policy:<18}{' '.join(caps):<24}" + "".join(f"{cell:>34}" for cell in cells))
    lines += _points_verdict(got, policies, fracs, seeds, bound)
    return "\n".join(lines)


def _points_verdict(got: dict, policies: list[str], fracs: list[float], seeds: list[int],
                    bound: float) -> list[str]:
    """Per seed, the issue's acceptance on the fixed rates: (a) taper-prefill's capacity >= every
    other entry's; (b) at every rate where some entry holds, taper-prefill holds with decomposable
    P50 end to end within FRONTIER_SLACK of the best holder's."""
    from bench.capacity import FRONTIER_SLACK, holds

    if RULED not in policies:
        return []
    out = []
    for seed in seeds:
        if any((policy, frac, seed) not in got for policy in policies for frac in fracs):
            out.append(f"seed {seed}: incomplete")
            continue

        def cap(policy: str, seed: int = seed) -> float:
            held = 0.0
            for frac in fracs:
                if not holds(got[(policy, frac, seed)]):
                    break
                held = frac * bound
            return held
        mine = cap(RULED)
        above = [policy for policy in policies if cap(policy) > mine + 1e-12]
        fails = [f"capacity below {', '.join(above)}"] if above else []
        for frac in fracs:
            holders = [got[(policy, frac, seed)] for policy in policies if holds(got[(policy, frac, seed)])]
            if not holders:
                continue
            own = got[(RULED, frac, seed)]
            best = min(point["decomp_e2e_p50_s"] for point in holders)
            if not holds(own):
                fails.append(f"does not hold at {frac * bound:.3f}")
            elif own["decomp_e2e_p50_s"] > FRONTIER_SLACK * best:
                fails.append(f"dP50 {own['decomp_e2e_p50_s'] / best:.3f}x the best at {frac * bound:.3f}")
        out.append(f"seed {seed}: {'FAIL (' + '; '.join(fails) + ')' if fails else 'PASS'}")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.prefill", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    pts = sub.add_parser("points", help="capacity points at fixed fractions of the bound, kept as they end")
    pts.add_argument("--trace", required=True)
    pts.add_argument("--out", required=True)
    pts.add_argument("--preset", default="multiverse")
    pts.add_argument("--fracs", default="0.7,0.85,1.0,1.15")
    pts.add_argument("--seeds", default="0,1,2")
    pts.add_argument("--policies", default=",".join((*BASELINES, RULED)))
    pts.add_argument("--jobs", type=int, default=2)
    pts.add_argument("--ttft-target-s", type=float, default=TTFT_TARGET_S)
    prep = sub.add_parser("points-report", help="the table of a `points` run")
    prep.add_argument("dir")
    prep.add_argument("--markdown", action="store_true")
    longp = sub.add_parser("longprompt", help="write the long-prompt workload's trace CSV")
    longp.add_argument("out")
    longp.add_argument("--base", default=DEFAULT_TRACE)
    longp.add_argument("--seed", type=int, default=0)
    rep = sub.add_parser("report", help="TTFT beside TPOT attainment from a bench.capacity run")
    rep.add_argument("dir")
    args = parser.parse_args(argv)
    if args.cmd == "points":
        from bench.capacity import CapacityOptions

        opts = CapacityOptions(args.trace, args.out, args.policies, seeds=args.seeds, preset=args.preset,
                               jobs=args.jobs, ttft_target_s=args.ttft_target_s)
        print(run_points(opts, [float(frac) for frac in args.fracs.split(",")], Path(args.out)))
        return 0
    if args.cmd == "points-report":
        print(points_report(Path(args.dir), args.markdown))
        return 0
    if args.cmd == "longprompt":
        trace = long_prompt_trace(load_trace(args.base), args.seed)
        write_trace(args.out, trace)
        prompts = trace.prompt_tokens
        print(f"{args.out}: {len(trace)} requests, {trace.source}; prompt mean {prompts.mean():.0f}, "
              f"P50/P90/P99 {' / '.join(f'{v:.0f}' for v in np.percentile(prompts, [50, 90, 99]))}")
        return 0
    detail = json.loads((Path(args.dir) / "capacity_detail.json").read_text())
    means = json.loads((Path(args.dir) / "capacity.json").read_text())
    print(report(detail, means))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
