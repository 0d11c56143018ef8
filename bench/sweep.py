"""Live load sweep (`make bench`, `make bench-seeds`): every policy's SLO capacity and latency on the
machine that runs it, in one run.

    python -m bench.sweep --launch --model models/tiny --policies off,eager,taper --out runs/bench \
        [--seeds 0,1,2] [--slo-scale F]
    python -m bench.sweep --url off=URL1,eager=URL2,taper=URL3 --slo-tpot-ms 12 --out DIR

The operating points are fixed by a rule before anything is measured (bench.live.calibrate):
1. probe the first non-taper server: T(S) = c0 + c_seq rows + c_ctx context tokens (bench.probe);
2. SLO = max(T(32 rows of 256 KV tokens), 2.5 x T(1 row)) x --slo-scale, unless --slo-tpot-ms;
3. load 1.0 = the fluid bound at that SLO (bench.bound over the programs' real contexts);
4. loads LOADS x that: geometric, x1.58 a point, from far below the bound (where per-request costs,
   not decode steps, decide) up to the bound itself, where no policy can hold. The grid spans 10x,
   so a probe that is off by 2x either way still leaves the transition inside it;
5. all servers start once and stay up; per seed the loads run in ascending order, each load runs
   every policy (in an order rotated per load, so a drift of a shared box does not always hit the
   same policy) on the same programs, each server's cache flushed before its run. A point is a
   stationary schedule of --duration-s plus --drain-s; a program unfinished by then is a miss.
It is bench.capacity's instrument at these loads without bisection: the same capacity rule (the
last load up to which every load holds 95%), the same two-axis verdict per seed and on the means
over seeds, the same capacity.json; DIR also gets sweep.json (grid, probes, every point),
capacity.png and records per point.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench import live
from bench.capacity import Engine, measure, plot, report, write
from bench.live import LivePoints, Servers, ServerSettings, calibrate, calibration_policy
from bench.point import PointSetup
from bench.programs import Scaling
from bench.report import write_json
from bench.workload import DEFAULT_TRACE, PRESETS, TraceError, load_trace
from branchwise.launch import ServerError

LOADS = (0.1, 0.16, 0.25, 0.4, 0.63, 1.0)


@dataclass(frozen=True, slots=True)
class Grid:
    """The operating points of a sweep, fixed from the probe before any point runs."""

    slo_tpot_ms: float
    probed_slo_ms: float  # the probe's auto SLO, before --slo-scale
    slo_scale: float
    fluid_bound_rps: float  # load 1.0
    loads: tuple[float, ...]

    @property
    def rates(self) -> list[float]:
        return [x * self.fluid_bound_rps for x in self.loads]

    def line(self) -> str:
        return (f"SLO {self.slo_tpot_ms:.2f} ms (probe {self.probed_slo_ms:.2f} ms x {self.slo_scale:g}); load 1.0 = "
                f"fluid bound {self.fluid_bound_rps:.3f} req/s; loads " + ", ".join(
                    f"{x:g} ({r:.3f} req/s)" for x, r in zip(self.loads, self.rates, strict=True)))


def _csv(kind: type, text: str, what: str) -> tuple:
    try:
        vals = tuple(kind(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{what}: expected values separated by commas, got {text!r}") from None
    if not vals:
        raise argparse.ArgumentTypeError(f"{what}: none given")
    return vals


def _loads(text: str) -> tuple[float, ...]:
    vals = _csv(float, text, "--loads")
    if any(not v > 0 for v in vals) or list(vals) != sorted(vals):
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
    ap.add_argument("--seeds", type=lambda t: _csv(int, t, "--seeds"), default=(0,),
                    help="each seed runs every load (its own programs); verdict per seed and on the means")
    ap.add_argument("--loads", type=_loads, default=LOADS, help="fractions of the fluid bound")
    ap.add_argument("--slo-tpot-ms", type=float, default=None, help="default: from the probe (module docstring)")
    ap.add_argument("--slo-scale", type=float, default=1.0, help="SLO sensitivity: the SLO times this")
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
    a = ap.parse_args(argv)
    if not a.slo_scale > 0:
        ap.error("--slo-scale must be > 0")
    return a


def _config(a: argparse.Namespace) -> dict[str, Any]:
    return {k: v for k, v in vars(a).items() if k != "url"} | {"servers": "launch" if a.launch else dict(a.url)}


def run(a: argparse.Namespace, policies: list[str], base: PointSetup, servers: Servers, doc: dict[str, Any]) -> dict:
    """Calibrate, then every seed at every load; bench.capacity's result (the doc gets grid and probes)."""
    out = Path(a.out)
    op = calibrate(servers, policies, base, out, a.slo_tpot_ms, a.slo_scale)
    grid = Grid(op.setup.slo_tpot_ms, op.probed_slo_ms, a.slo_scale, op.fluid_bound_rps, a.loads)
    doc["grid"], doc["probes"]["start"] = asdict(grid) | {"rates": grid.rates}, op.probe.as_dict()
    print(grid.line(), flush=True)
    points = doc["points"] = LivePoints(servers, op.setup, op.fluid_bound_rps, out, progress=not a.no_progress)
    engine = Engine("replay", points, op.fluid_bound_rps, 1, {"fluid_bound_rps": op.fluid_bound_rps})
    res = measure(engine, policies, list(a.seeds), rates=grid.rates, bisect_steps=0)
    end = calibration_policy(policies) if calibration_policy(policies) in policies else policies[0]
    doc["probes"]["end"] = live.probe_server(servers.url(end)).as_dict()
    return res


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    try:
        trace = load_trace(a.trace)
        scaling = Scaling(a.output_scale, a.max_stage_tokens)
    except (TraceError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    policies = list(a.url) if a.url else [p.strip() for p in a.policies.split(",") if p.strip()]
    settings = ServerSettings(a.model, a.taper_rho, a.server_threads, a.max_total_tokens, a.server_args)
    servers = Servers(urls=dict(a.url)) if a.url else Servers(settings, max_alive=len(policies) + 1)
    base = PointSetup(trace, 1.0, scaling, a.duration_s, a.drain_s, a.preset, a.slo_ttft_s)
    out = Path(a.out)
    doc: dict[str, Any] = {"config": _config(a), "probes": {}, "grid": None}
    res, rc = None, 0
    try:
        res = run(a, policies, base, servers, doc)
    except (ServerError, ConnectionError, RuntimeError, OSError) as e:
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        rc = 1
    except KeyboardInterrupt:
        print("interrupted: what ran is saved", file=sys.stderr)
        rc = 130
    finally:
        servers.close()
    points = doc.pop("points", None)
    doc["points"] = points.done if points is not None else []
    if res is None:
        write_json(out / "sweep.json", doc | {"partial": True}, indent=1, default=float)
        return rc or 1
    path = write(out, res, doc["config"] | {"grid": doc["grid"], "probes": doc["probes"]})
    write_json(out / "sweep.json", doc | {"capacity": res["capacity"], "per_seed": res["per_seed"],
                                          "wall_s": res["wall_s"]}, indent=1, default=float)
    plot(res["capacity"], out, f"live sweep, {Path(a.trace).stem}, SLO {doc['grid']['slo_tpot_ms']:.2f} ms, "
         f"seeds {','.join(map(str, a.seeds))}")
    print("\n" + report(res) + f"\nwall {res['wall_s']:.0f} s -> {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
