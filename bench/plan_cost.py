"""Per-planned-step CPU cost of TAPER's decision (`StepController.select`) on live-sized batches.

    python -m bench.plan_cost [--against REV] [--sizes 8,16,32,64] [--reps 400] [--out FILE]

The call the scheduler hook makes (scheduler_hook._decide) on batches like the live CPU server's:
8-64 rows, a mix of serial requests and phases of 2-16 branches, contexts of 50-1500 tokens, the
live box's T(S) and SLO, every key's clock primed with a delivery history. `loose`: every clock
is well inside its SLO (everything fits); `tight`: the clocks sit around their SLO, with a queue
(the budget terms and the greedy pass run). taper-defer-cost plans with a learned deferral price.
Each (size, slack) point holds `--batches` random batches; each is planned `--reps` times per
policy and the median per-call time is taken, then the median over the batches.

`--against REV` loads the taper package of that git revision beside this checkout's and times the
two alternately in this process (so both see the same machine), after checking that they choose
the same rows on every batch. Writes {"points": [{"rows", "slack", "policy", "us", "ref_us"}]}.
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

POLICIES = ("eager", "off", "taper", "taper-paper", "taper-defer-cost")
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
        src = subprocess.run(["git", "show", f"{rev}:overlay/branchwise/taper/{name}.py"], cwd=root, check=True,
                             capture_output=True, text=True).stdout
        (pkg / f"{name}.py").write_text(src.replace(f"{TAPER}.", "taper_ref."))
    sys.path.insert(0, str(pkg.parent))
    return "taper_ref"


def batch(rng: random.Random, n: int) -> list[tuple[str, int, int, bool]]:
    """(key, branch order, ctx, in a phase) per row: serial requests and phases of 2-16 branches."""
    rows: list[tuple[str, int, int, bool]] = []
    while len(rows) < n:
        fanout = min(rng.randint(2, 16), n - len(rows)) if rng.random() < 0.6 else 1
        key, prefix = f"k{len(rows)}", rng.randint(50, 1200)
        if fanout == 1:
            rows.append(("rid:" + key, 0, prefix, False))
        else:
            rows += [("phase:" + key, b, prefix + rng.randint(0, 300), True) for b in range(fanout)]
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
    ctl = ctl_mod.StepController(pol_mod.parse_policy(policy, model=model))
    phase = {key: ph for key, _, _, ph in spec}
    for key, (age, tokens, gap) in clock.items():
        ctl.on_step_done({key: ctl_mod.Delivery(0, SLO_S, phase[key])}, now - age, 0)
        ctl.on_step_done({key: ctl_mod.Delivery(tokens, SLO_S, phase[key])}, now - gap, 0)
    rows = [ctl_mod.Row(key=k, order=o, ctx=c, slo_s=SLO_S, phase=p) for k, o, c, p in spec]
    return ctl, rows


def _time(ctl: Any, rows: list[Any], now: float, waiting: int) -> float:
    t = time.perf_counter()
    ctl.select(rows, now, waiting=waiting)
    return time.perf_counter() - t


def point(pkgs: list[str], policy: str, n: int, tight: bool, batches: int, reps: int, seed: int) -> list[float]:
    """Median us per select call for each package, over `batches` batches (median of `reps` each)."""
    rng = random.Random(f"{seed}/{n}/{tight}")
    per: list[list[float]] = [[] for _ in pkgs]
    now, waiting = 100.0, 2 if tight else 0
    for _ in range(batches):
        spec = batch(rng, n)
        clock = clocks(rng, {k: p for k, _, _, p in spec}, tight)
        arms = [controller(pkg, policy, spec, clock, now) for pkg in pkgs]
        chosen = [ctl.select(rows, now, waiting=waiting) for ctl, rows in arms]
        if any(c != chosen[0] for c in chosen):
            raise SystemExit(f"{policy} at {n} rows ({'tight' if tight else 'loose'}): the packages chose "
                             f"different rows: {chosen}")
        times: list[list[float]] = [[] for _ in pkgs]
        for r in range(reps):  # alternate, first one arm then the other, so both see the same load
            for j in (range(len(arms)) if r % 2 == 0 else reversed(range(len(arms)))):
                times[j].append(_time(*arms[j], now, waiting))
        for j, t in enumerate(times):
            per[j].append(statistics.median(t))
    return [1e6 * statistics.median(p) for p in per]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--against", help="git revision whose taper package is timed alongside this one")
    ap.add_argument("--sizes", default="8,16,32,64")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--batches", type=int, default=20)
    ap.add_argument("--reps", type=int, default=400)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    pkgs = [TAPER] + ([reference(a.against)] if a.against else [])
    points = []
    print(f"{'rows':>4} {'slack':>5} {'policy':<17} {'us':>7}" + (f" {'ref us':>7} {'change':>7}" if a.against else ""))
    for n in [int(x) for x in a.sizes.split(",")]:
        for tight in (False, True):
            for policy in a.policies.split(","):
                us = point(pkgs, policy, n, tight, a.batches, a.reps, a.seed)
                p = {"rows": n, "slack": "tight" if tight else "loose", "policy": policy, "us": us[0],
                     "ref_us": us[1] if a.against else None}
                points.append(p)
                line = f"{n:4d} {p['slack']:>5} {policy:<17} {us[0]:7.1f}"
                print(line + (f" {us[1]:7.1f} {us[0] / us[1] - 1:+7.1%}" if a.against else ""), flush=True)
    if a.out:
        write_json(Path(a.out), {"against": a.against, "points": points})


if __name__ == "__main__":
    main()
