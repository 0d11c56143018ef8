"""Live load sweep (`make bench`, `make bench-seeds`): every policy's SLO capacity and latency on the
machine that runs it, in one run.

    python -m bench.sweep --launch --model models/tiny --policies serial,eager,taper --out runs/bench \
        [--seeds 0,1,2] [--slo-scale F]
    python -m bench.sweep --url serial=URL1,eager=URL2,taper=URL3 --slo-tpot-ms 12 --out DIR
    python -m bench.sweep --launch --policies stock --variant async-output=stock:--async-output \
        --emulate-device a100-qwen3-32b-tp8 --loads 0.25,0.5,0.75 --out DIR

The operating points are fixed from a probe before anything is measured (bench.live.calibrate):
SLO = max(T(32 rows of 256 KV tokens), 2.5 x T(1 row)) x --slo-scale unless --slo-tpot-ms is
given, load 1.0 = the fluid bound at that SLO, and the loads are LOADS x that. It is
bench.capacity's instrument at these loads without bisection (the same capacity rule, verdicts
and capacity.json); DIR also gets sweep.json (grid, probes, every run), capacity.png and records
per run. `--repeats R` runs every point R times (the same programs) and pools their requests; then
up to --refine-rounds rounds run once more the policies whose runs leave a (load, seed)
undecided in the verdict, lightest first, while their estimated time fits --refine-budget x the sweep's own. The
rule and the run order in full: docs/design/bench-micro.md.

`--emulate-device SPEC` (issue 36): every launched server gets the flag, the SLO and the loads come
from the preset's T(S) instead of the probe (bench.emulated's load rule), every point carries its
device counters and a point whose overruns exceed 1% of its forwards is invalid (not counted).
`--variant LABEL=POLICY[:FLAGS]` adds a server variant: LABEL runs as one more policy of the sweep,
served by POLICY with FLAGS added (e.g. stock against stock with --async-output at the same loads);
a NAME=VALUE token in FLAGS sets the server's environment, e.g. the prefill budget:
`--variant taper-prefill=taper:"BRANCHWISE_PREFILL_BUDGET=1 --chunked-prefill-size 2048"`.
"""

from __future__ import annotations

import argparse
import re
import shlex
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bench import emulated, live
from bench.capacity import Engine, hold_outcome, measure, plot, report, verdict, write
from bench.cli import policy_list
from bench.confidence import UNDECIDED
from bench.live import LivePoints, Servers, ServerSettings, calibrate, calibration_policy
from bench.point import PointSetup
from bench.programs import Scaling
from bench.report import write_json
from bench.workload import DEFAULT_TRACE, PRESETS, TraceError, load_trace
from branchwise.tools.launch import ServerError

LOADS = (0.1, 0.16, 0.25, 0.4, 0.63, 1.0)
REFINE_ROUNDS, REFINE_BUDGET = 2, 0.3  # at most 1.3x the sweep's time, spent where it cannot decide


@dataclass(frozen=True, slots=True)
class Grid:
    """The operating points of a sweep, fixed from the probe before any point runs."""

    slo_tpot_ms: float
    probed_slo_ms: float  # the probe's auto SLO, before --slo-scale
    slo_scale: float
    fluid_bound_rps: float  # load 1.0
    loads: tuple[float, ...]
    slo_source: str = "probe"  # or the emulated device whose T(S) gave the auto SLO

    @property
    def rates(self) -> list[float]:
        return [load * self.fluid_bound_rps for load in self.loads]

    def line(self) -> str:
        loads = ", ".join(f"{load:g} ({rate:.3f} req/s)"
                          for load, rate in zip(self.loads, self.rates, strict=True))
        return (f"SLO {self.slo_tpot_ms:.2f} ms ({self.slo_source} {self.probed_slo_ms:.2f} ms x {self.slo_scale:g}); "
                f"load 1.0 = fluid bound {self.fluid_bound_rps:.3f} req/s; loads " + loads)


def _csv(kind: type, text: str, what: str) -> tuple:
    try:
        vals = tuple(kind(item) for item in text.split(",") if item.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{what}: expected values separated by commas, got {text!r}") from None
    if not vals:
        raise argparse.ArgumentTypeError(f"{what}: none given")
    return vals


def _loads(text: str) -> tuple[float, ...]:
    vals = _csv(float, text, "--loads")
    if any(not load > 0 for load in vals) or list(vals) != sorted(vals):
        raise argparse.ArgumentTypeError(f"loads must be > 0 and ascending, got {text!r}")
    return vals


def _urls(text: str) -> dict[str, str]:
    pairs = [item.split("=", 1) for item in text.split(",") if item.strip()]
    if not pairs or any(len(pair) != 2 or not pair[0] or not pair[1] for pair in pairs):
        raise argparse.ArgumentTypeError(f"expected policy=URL pairs separated by commas, got {text!r}")
    return dict(pairs)


def _device(text: str) -> str:
    try:
        emulated.spec_model(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return text


def parse_variant(text: str) -> tuple[str, tuple[str, str]]:
    """--variant LABEL=POLICY[:FLAGS] -> (LABEL, (POLICY, FLAGS)); the policy canonical, the label a
    plain name (it names record files)."""
    label, sep, rest = text.partition("=")
    policy, _, flags = rest.partition(":")
    if not sep or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.+-]*", label) or not policy.strip():
        raise argparse.ArgumentTypeError(f"--variant: expected LABEL=POLICY[:FLAGS] with a plain LABEL, "
                                         f"got {text!r}")
    try:
        return label, (policy_list(policy)[0], flags.strip())
    except argparse.ArgumentTypeError as err:
        raise argparse.ArgumentTypeError(f"--variant {text!r}: {err}") from None


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.sweep", description=__doc__.split("\n\n")[0])
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--launch", action="store_true", help="start one server per policy")
    where.add_argument("--url", type=_urls, help="running servers, policy=URL,...")
    parser.add_argument("--model", default="models/tiny")
    parser.add_argument("--policies", type=policy_list, default="serial,eager,taper", help="with --launch")
    parser.add_argument("--trace", default=DEFAULT_TRACE)
    parser.add_argument("--preset", default="multiverse", choices=sorted(PRESETS))
    parser.add_argument("--seeds", type=lambda text: _csv(int, text, "--seeds"), default=(0,),
                        help="each seed runs every load (its own programs); "
                             "verdict per seed and on the means")
    parser.add_argument("--loads", type=_loads, default=LOADS, help="fractions of the fluid bound")
    parser.add_argument("--slo-tpot-ms", type=float, default=None,
                        help="default: from the probe (module docstring)")
    parser.add_argument("--slo-scale", type=float, default=1.0, help="SLO sensitivity: the SLO times this")
    parser.add_argument("--slo-ttft-s", type=float, default=None,
                        help="a TTFT target attainment also requires")
    parser.add_argument("--duration-s", type=float, default=40.0)
    parser.add_argument("--drain-s", type=float, default=20.0)
    parser.add_argument("--output-scale", type=float, default=1.0)
    parser.add_argument("--max-stage-tokens", type=int, default=256)
    parser.add_argument("--taper-rho", type=float, default=0.8)
    parser.add_argument("--server-args", default="", help="extra flags for --launch servers")
    parser.add_argument("--emulate-device", type=_device, default=None, metavar="PRESET|FILE[@xS]",
                        help="servers run on this emulated device (--launch: each gets the flag); the SLO "
                             "and the loads from its T(S), overruns per point")
    parser.add_argument("--variant", type=parse_variant, action="append", default=[],
                        metavar="LABEL=POLICY[:FLAGS]",
                        help="with --launch: one more policy of the sweep, LABEL, served by POLICY with FLAGS")
    parser.add_argument("--server-threads", type=int, default=1,
                        help="OMP threads of --launch servers; 0: torch's")
    parser.add_argument("--max-total-tokens", type=int, default=65536)
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs of every point (the same programs), their requests pooled")
    parser.add_argument("--refine-rounds", type=int, default=REFINE_ROUNDS,
                        help="rounds of one more run of each point the verdict cannot decide")
    parser.add_argument("--refine-budget", type=float, default=REFINE_BUDGET,
                        help="those runs' estimated time at most this x the sweep's own")
    parser.add_argument("--out", required=True)
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    if not args.slo_scale > 0:
        parser.error("--slo-scale must be > 0")
    if args.repeats < 1 or args.refine_rounds < 0 or not args.refine_budget >= 0:
        parser.error("--repeats must be >= 1, --refine-rounds and --refine-budget >= 0")
    labels = [label for label, _ in args.variant]
    if args.variant and not args.launch:
        parser.error("--variant needs --launch")
    if len(set(labels)) != len(labels) or set(labels) & set(args.policies):
        parser.error("--variant labels must differ from each other and from --policies")
    return args


def _config(args: argparse.Namespace) -> dict[str, Any]:
    flags = {name: value for name, value in vars(args).items() if name not in ("url", "variant")}
    flags["variants"] = {label: {"policy": policy, "flags": extra} for label, (policy, extra) in args.variant}
    return flags | {"servers": "launch" if args.launch else dict(args.url)}


def undecided(res: dict, focus: str = "taper") -> dict[tuple[float, int], list[str]]:
    """Per (rate, seed) a seed's verdict cannot decide, ascending rates, the policies whose runs it
    waits on: those of an UNDECIDED latency check there (LatencyCheck.unsure) and, with the capacity
    comparison UNDECIDED, each policy whose hold is."""
    out: dict[tuple[float, int], set[str]] = {}
    for seed, seed_doc in res["per_seed"].items():
        result = verdict(seed_doc, focus)
        if result is None:
            continue
        for check in result.latency:
            out.setdefault((check.rate, seed), set()).update(check.unsure)
        if result.capacity_outcome == UNDECIDED:
            for policy, entry in seed_doc["policies"].items():
                for point in entry["points"]:
                    if hold_outcome(point) == UNDECIDED:
                        out.setdefault((point["rate"], seed), set()).add(policy)
    order = list(res["capacity"]["policies"])
    return {key: sorted(out[key], key=order.index) for key in sorted(out) if out[key]}


def refine_plan(res: dict, walls: dict[tuple[str, float, int], list[float]],
                budget_s: float) -> list[tuple[tuple[float, int], list[str], float]]:
    """The undecided points to run once more ((rate, seed), policies), lightest first, while their
    estimated time (each policy's mean run there so far, `walls`) fits `budget_s`; with that estimate."""
    plan, left = [], budget_s
    for (rate, seed), policies in undecided(res).items():
        cost = sum(float(np.mean(walls.get((policy, rate, seed)) or [0.0])) for policy in policies)
        if cost <= left:
            plan.append(((rate, seed), policies, cost))
            left -= cost
    return plan


def run(args: argparse.Namespace, policies: list[str], base: PointSetup, servers: Servers,
        doc: dict[str, Any]) -> dict:
    """Calibrate, then every seed at every load; bench.capacity's result (the doc gets grid and probes)."""
    out = Path(args.out)
    operating = calibrate(servers, policies, base, out, args.slo_tpot_ms, args.slo_scale, args.emulate_device)
    bound = operating.fluid_bound_rps
    grid = Grid(operating.setup.slo_tpot_ms, operating.probed_slo_ms, args.slo_scale, bound, args.loads,
                args.emulate_device or "probe")
    doc["grid"], doc["probes"]["start"] = asdict(grid) | {"rates": grid.rates}, operating.probe.as_dict()
    print(grid.line(), flush=True)
    points = doc["points"] = LivePoints(servers, operating.setup, bound, out, progress=not args.no_progress,
                                        repeats=args.repeats)
    engine = Engine("replay", points, bound, 1, {"fluid_bound_rps": bound}, batch=points.batch)
    start = time.perf_counter()
    res = measure(engine, policies, list(args.seeds), rates=grid.rates, bisect_steps=0)
    budget_s = args.refine_budget * (time.perf_counter() - start)
    for round_idx in range(args.refine_rounds):
        todo = refine_plan(res, points.walls, budget_s)
        if not todo:
            break
        budget_s -= sum(cost for _, _, cost in todo)
        doc["refined"].append([[rate, seed, names] for (rate, seed), names, _ in todo])
        print(f"refine {round_idx + 1}/{args.refine_rounds}: one more run at "
              + "; ".join(f"{rate:.3f} req/s seed {seed} ({', '.join(names)})" for (rate, seed), names, _ in todo)
              + " (the verdict cannot decide there)", flush=True)
        for (rate, seed), names, _ in todo:
            for policy in names:
                points.extra[(policy, rate, seed)] = points.extra.get((policy, rate, seed), 0) + 1
        res = measure(engine, policies, list(args.seeds), rates=grid.rates, bisect_steps=0)
    res["wall_s"] = time.perf_counter() - start
    end = calibration_policy(policies) if calibration_policy(policies) in policies else policies[0]
    doc["probes"]["end"] = live.probe_server(servers.url(end)).as_dict()
    return res


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        trace = load_trace(args.trace)
        scaling = Scaling(args.output_scale, args.max_stage_tokens)
    except (TraceError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    policies = (list(args.url) if args.url
                else list(args.policies) + [label for label, _ in args.variant])
    server_args = args.server_args + (f" --emulate-device {shlex.quote(args.emulate_device)}"
                                      if args.emulate_device else "")
    settings = ServerSettings(args.model, args.taper_rho, args.server_threads, args.max_total_tokens,
                              server_args, dict(args.variant))
    servers = Servers(urls=dict(args.url)) if args.url else Servers(settings, max_alive=len(policies) + 1)
    duration_s, drain_s = emulated.point_window_s(args.emulate_device, args.duration_s, args.drain_s)
    base = PointSetup(trace, 1.0, scaling, duration_s, drain_s, args.preset, args.slo_ttft_s)
    out = Path(args.out)
    doc: dict[str, Any] = {"config": _config(args), "probes": {}, "grid": None, "refined": []}
    res, exit_code = None, 0
    try:
        res = run(args, policies, base, servers, doc)
    except (ServerError, ConnectionError, RuntimeError, OSError) as err:
        print(f"error: {type(err).__name__}: {err}", file=sys.stderr)
        exit_code = 1
    except KeyboardInterrupt:
        print("interrupted: what ran is saved", file=sys.stderr)
        exit_code = 130
    finally:
        servers.close()
    points = doc.pop("points", None)
    doc["points"] = points.done if points is not None else []
    if res is None:
        write_json(out / "sweep.json", doc | {"partial": True}, indent=1, default=float)
        return exit_code or 1
    path = write(out, res, doc["config"] | {"grid": doc["grid"], "probes": doc["probes"]})
    write_json(out / "sweep.json", doc | {"capacity": res["capacity"], "per_seed": res["per_seed"],
                                          "wall_s": res["wall_s"]}, indent=1, default=float)
    plot(res["capacity"], out, f"live sweep, {Path(args.trace).stem}, "
         f"SLO {doc['grid']['slo_tpot_ms']:.2f} ms, seeds {','.join(map(str, args.seeds))}")
    print("\n" + report(res) + f"\nwall {res['wall_s']:.0f} s -> {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
