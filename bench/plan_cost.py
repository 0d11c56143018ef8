"""Per-planned-step CPU cost of TAPER's decision (`StepController.select`) on live-sized batches.

    python -m bench.plan_cost [--against REV] [--sizes 8,16,32,64] [--reps 400] [--out FILE]

Times the call the scheduler hook makes (scheduler_hook._decide) on random batches like the live
CPU server's, with every key's clock primed, at `loose` slack (everything fits) and `tight` slack
(the budget terms and the greedy pass run), per policy. `--against REV` times the taper package
of that git revision beside this checkout's, alternately in this process, after checking that
both choose the same rows. Writes {"points": [{"rows", "slack", "policy", "us", "ref_us"}]}.
The batches, the clocks and the statistics: docs/design/bench-micro.md.
"""

from __future__ import annotations

import argparse
import importlib
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any

try:
    import branchwise  # noqa: F401
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "overlay"))

from bench.report import write_json  # noqa: E402

POLICIES = ("eager", "serial", "taper", "taper-paper", "taper-defer-cost")  # the last: taper with a price (an alias)
COEFS = (1.38e-3, 8.9e-5, 9.9e-8)  # the live box's probe: T = 1.38 ms + 0.089 ms/row + 0.099 us/token
PRICE = (5e-4, 5e-5)  # a learned deferral price: per deferring step, per deferred row (seconds)
SLO_S = 5.05e-3
TAPER = "branchwise.taper"
_MODULES = ("utility", "predictor", "planner", "policies", "controller")


def reference(rev: str) -> str:
    """The taper package of git revision `rev`, importable as `taper_ref` (its own imports renamed)."""
    root = Path(__file__).resolve().parents[1]
    pkg = Path(tempfile.mkdtemp(prefix="plan_cost_")) / "taper_ref"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    for name in _MODULES:
        src = subprocess.run(["git", "show", f"{rev}:overlay/branchwise/taper/{name}.py"], cwd=root,
                             check=True, capture_output=True, text=True).stdout
        (pkg / f"{name}.py").write_text(src.replace(f"{TAPER}.", "taper_ref."))
    sys.path.insert(0, str(pkg.parent))
    return "taper_ref"


def batch(rng: random.Random, size: int) -> list[tuple[str, int, int, bool]]:
    """(key, branch order, ctx, in a phase) per row: serial requests and phases of 2-16 branches."""
    rows: list[tuple[str, int, int, bool]] = []
    while len(rows) < size:
        fanout = min(rng.randint(2, 16), size - len(rows)) if rng.random() < 0.6 else 1
        key, prefix = f"k{len(rows)}", rng.randint(50, 1200)
        if fanout == 1:
            rows.append(("rid:" + key, 0, prefix, False))
        else:
            rows += [("phase:" + key, order, prefix + rng.randint(0, 300), True) for order in range(fanout)]
    rng.shuffle(rows)  # the running batch lists rows in admission order, not by key
    return rows


def clocks(rng: random.Random, keys: dict[str, bool], tight: bool) -> dict[str, tuple[float, int, float]]:
    """Per key: (seconds since its clock started, tokens delivered since, seconds since the last)."""
    out = {}
    for key in keys:
        tokens = rng.randint(1, 60)
        own = (tokens + 1) * SLO_S
        age = own - rng.uniform(-0.5, 1.5) * 2e-3 if tight else own * rng.uniform(0.3, 0.8)
        out[key] = (age, tokens, rng.uniform(0.3, 1.0) * SLO_S)
    return out


def controller(pkg: str, policy: str, spec: list[tuple[str, int, int, bool]],
               clock: dict[str, tuple[float, int, float]], now: float) -> tuple[Any, list[Any]]:
    """A controller of package `pkg` for `policy`, its clocks primed; and the batch's rows."""
    ctl_mod: ModuleType = importlib.import_module(f"{pkg}.controller")
    pol_mod = importlib.import_module(f"{pkg}.policies")
    pred = importlib.import_module(f"{pkg}.predictor")
    price = PRICE if policy == "taper-defer-cost" else (0.0, 0.0)
    model = pred.LinearLatencyModel(*COEFS, 0.0, *price)
    if policy == "serial" and "serial" not in pol_mod.POLICY_NAMES:  # a revision from before the rename
        policy = "off"
    ctl = ctl_mod.StepController(pol_mod.parse_policy(policy, model=model))
    phase = {key: in_phase for key, _, _, in_phase in spec}
    for key, (age, tokens, gap) in clock.items():
        ctl.on_step_done({key: ctl_mod.Delivery(0, SLO_S, phase[key])}, now - age, 0)
        ctl.on_step_done({key: ctl_mod.Delivery(tokens, SLO_S, phase[key])}, now - gap, 0)
    rows = [ctl_mod.Row(key=key, order=order, ctx=ctx, slo_s=SLO_S, in_phase=in_phase)
            for key, order, ctx, in_phase in spec]
    return ctl, rows


def _time(ctl: Any, rows: list[Any], now: float, waiting: int) -> float:
    start = time.perf_counter()
    ctl.select(rows, now, waiting=waiting)
    return time.perf_counter() - start


def point(pkgs: list[str], policy: str, size: int, tight: bool, batches: int, reps: int,
          seed: int) -> list[float]:
    """Median us per select call for each package, over `batches` batches (median of `reps` each)."""
    rng = random.Random(f"{seed}/{size}/{tight}")
    per: list[list[float]] = [[] for _ in pkgs]
    now, waiting = 100.0, 2 if tight else 0
    for _ in range(batches):
        spec = batch(rng, size)
        clock = clocks(rng, {key: in_phase for key, _, _, in_phase in spec}, tight)
        arms = [controller(pkg, policy, spec, clock, now) for pkg in pkgs]
        chosen = [ctl.select(rows, now, waiting=waiting) for ctl, rows in arms]
        if any(choice != chosen[0] for choice in chosen):
            raise SystemExit(f"{policy} at {size} rows ({'tight' if tight else 'loose'}): the packages chose "
                             f"different rows: {chosen}")
        times: list[list[float]] = [[] for _ in pkgs]
        for rep in range(reps):  # alternate, first one arm then the other, so both see the same load
            for j in (range(len(arms)) if rep % 2 == 0 else reversed(range(len(arms)))):
                times[j].append(_time(*arms[j], now, waiting))
        for j, arm_times in enumerate(times):
            per[j].append(statistics.median(arm_times))
    return [1e6 * statistics.median(batch_medians) for batch_medians in per]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", help="git revision whose taper package is timed alongside this one")
    parser.add_argument("--sizes", default="8,16,32,64")
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--batches", type=int, default=20)
    parser.add_argument("--reps", type=int, default=400)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    pkgs = [TAPER] + ([reference(args.against)] if args.against else [])
    points = []
    print(f"{'rows':>4} {'slack':>5} {'policy':<17} {'us':>7}"
          + (f" {'ref us':>7} {'change':>7}" if args.against else ""))
    for size in [int(item) for item in args.sizes.split(",")]:
        for tight in (False, True):
            for policy in args.policies.split(","):
                per_call_us = point(pkgs, policy, size, tight, args.batches, args.reps, args.seed)
                row = {"rows": size, "slack": "tight" if tight else "loose", "policy": policy,
                       "us": per_call_us[0], "ref_us": per_call_us[1] if args.against else None}
                points.append(row)
                line = f"{size:4d} {row['slack']:>5} {policy:<17} {per_call_us[0]:7.1f}"
                change = (f" {per_call_us[1]:7.1f} {per_call_us[0] / per_call_us[1] - 1:+7.1%}"
                          if args.against else "")
                print(line + change, flush=True)
    if args.out:
        write_json(Path(args.out), {"against": args.against, "points": points})


if __name__ == "__main__":
    main()
