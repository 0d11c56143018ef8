"""The cheaper per-step decision chooses exactly what the decision before it chose (issue 19).

The live StepController (the scheduler hook's path: select -> Policy.plan -> the planner) runs
beside taper_reference.ReferenceController (the code before, frozen) on the same inputs, step by
step over randomized batches whose rows evolve, finish and join, for every policy: the same active
rows every step, and the same stats, clocks, pins and refit model after it. The policies are also
compared on random ArrayBatches directly, non-finite slack included.
"""

from __future__ import annotations

import dataclasses
import math
import random

import numpy as np
import pytest

from branchwise.taper.controller import Delivery, Row, StepController
from branchwise.taper.planner import ArrayBatch, StepPlan
from branchwise.taper.policies import parse_policy
from branchwise.taper.predictor import ConstantLatencyModel, LinearLatencyModel, OnlineRefit
from tests.unit import taper_reference as ref

POLICIES = ["off", "cap:2", "cap:5", "eager", "stock", "taper", "taper-no-mean", "taper-no-overload",
            "taper-no-backlog", "taper-defer-cost", "taper-paper", "taper-no-slack", "taper-no-replan",
            "taper-const-predictor"]
SEEDS = range(12)
STEPS = 40


def coefs(rng: random.Random) -> tuple[float, ...]:
    """c0, c_seq, c_ctx, c_tok, c_defer, c_deferred: from the tiny model's box to the paper's."""
    c_defer, c_deferred = (rng.uniform(0, 3e-4), rng.uniform(0, 2e-5)) if rng.random() < 0.7 else (0.0, 0.0)
    return (rng.uniform(1e-3, 15e-3), rng.uniform(0, 3e-4), rng.uniform(0, 2e-7), 0.0, c_defer, c_deferred)


def pair(name: str, rng: random.Random, c: tuple[float, ...]) -> tuple[StepController, StepController]:
    """A live and a reference controller over equal, separate models (coefficients `c`) and refits."""
    kw = {"rho": rng.choice([0.5, 0.8, 1.0]), "utility": rng.choice(["linear", "linear", "concave", "priority"]),
          "fill": rng.random() < 0.25}
    out = []
    for cls in (StepController, ref.ReferenceController):
        policy = parse_policy(name, model=LinearLatencyModel(*c), **kw)
        refit = OnlineRefit(policy.model, every=8, min_samples=8, deferral=policy.terms.defer_cost) \
            if isinstance(policy.model, LinearLatencyModel | ConstantLatencyModel) else None
        out.append(cls(policy, refit))
    return out[0], out[1]


@dataclasses.dataclass
class Key:
    """One request (serial: one row) or phase (its branches' rows): branch order -> context."""

    key: str
    phase: bool
    slo_s: float
    weight: float
    rows: dict[int, int]


def new_key(rng: random.Random, i: int, c0: float) -> Key:
    """A serial request or a phase of 2-16 branches, its SLO from tight (1.5 step floors) to loose."""
    phase = rng.random() < 0.6
    n = rng.randint(2, 16) if phase else 1
    base = rng.randint(20, 3000)
    rows = {b: base + rng.randint(0, 400) for b in range(n)}
    return Key(("phase:" if phase else "rid:") + str(i), phase, c0 * rng.choice([1.5, 3.0, 6.0, 12.0, 24.0]),
               rng.choice([1.0, 1.0, 0.0, 0.5, 3.0]), rows)


def batch_rows(rng: random.Random, keys: list[Key]) -> list[Row]:
    rows = [Row(key=k.key, order=b, ctx=c, slo_s=k.slo_s, weight=k.weight, phase=k.phase,
                forced=rng.random() < 0.03) for k in keys for b, c in k.rows.items()]
    rng.shuffle(rows)  # a running batch lists rows in admission order
    return rows


def state(ctl: StepController) -> tuple:
    stats = dataclasses.replace(ctl.stats, planner_s=0.0, terms=dict(ctl.stats.terms))
    model = ctl.policy.model
    return stats, dict(ctl.trackers), dict(ctl.fixed), dataclasses.astuple(model) if model is not None else None


def step(rng: random.Random, live: StepController, old: StepController, keys: list[Key], now: float,
         box: LinearLatencyModel) -> float:
    """One decode step through both controllers on a machine whose steps take about `box`'s
    T(S) and deferral price; returns the time it ends."""
    rows = batch_rows(rng, keys)
    bubble, waiting = rng.random() < 0.1, rng.choice([0, 0, 0, 2, 7])
    active = live.select(rows, now, bubble, waiting=waiting)
    assert active == old.select(rows, now, bubble, waiting=waiting)
    ran: dict[str, int] = {}
    for i in active:
        r = rows[i]
        ran[r.key] = ran.get(r.key, 0) + 1
        next(k for k in keys if k.key == r.key).rows[r.order] += 1
    ctx = sum(rows[i].ctx for i in active)
    latency = box.predict(len(active), ctx) * rng.uniform(0.9, 1.3) + box.deferral_s(len(rows) - len(active))
    delivered = {k.key: Delivery(ran[k.key], k.slo_s, k.phase) for k in keys if k.key in ran}
    for ctl in (live, old):
        ctl.on_step_done(delivered, now + latency, len(active))
        ctl.on_latency(len(active), ctx, latency, len(rows) - len(active))
    return now + latency * rng.choice([1.0, 1.0, 1.0, 3.0])  # sometimes a prefill step in between


def churn(rng: random.Random, live: StepController, old: StepController, keys: list[Key], serial: int,
          c0: float) -> int:
    """Branches and requests finish (their keys leave both controllers), new ones join."""
    for k in list(keys):
        for b in [b for b in k.rows if rng.random() < 0.05]:
            del k.rows[b]
        if not k.rows:
            keys.remove(k)
            for ctl in (live, old):
                ctl.on_finished([k.key])
    while len(keys) < 2 or rng.random() < 0.15:
        keys.append(new_key(rng, serial, c0))
        serial += 1
    return serial


@pytest.mark.parametrize("name", POLICIES)
def test_the_live_controller_decides_as_the_reference_did(name):
    for seed in SEEDS:
        rng = random.Random(f"{name}/{seed}")
        c = coefs(rng)
        live, old = pair(name, rng, c)
        keys = [new_key(rng, i, c[0]) for i in range(rng.randint(2, 8))]
        serial, now = len(keys), 10.0
        for _ in range(STEPS):
            now = step(rng, live, old, keys, now, LinearLatencyModel(*c))
            assert state(live) == state(old), (name, seed)
            serial = churn(rng, live, old, keys, serial, c[0])
        assert live.stats.planned_steps > 0


def random_batch(rng: np.random.Generator, pinned: bool) -> ArrayBatch:
    n = int(rng.integers(1, 16))
    ready = rng.integers(1, 9, n)
    slack = rng.uniform(-0.01, 0.06, n)
    if rng.random() < 0.1:  # a broken clock: non-finite slack
        slack[rng.integers(0, n)] = rng.choice([math.nan, math.inf, -math.inf])
    phase = (ready > 1) | (rng.random(n) < 0.1)
    fixed = np.where(rng.random(n) < 0.5, rng.integers(0, 6, n), 0) if pinned else None
    return ArrayBatch([f"k{i}" for i in range(n)], ready, rng.integers(1, 6000, int(ready.sum())), slack,
                      rng.choice([0.0, 1.0, 2.5], n), phase, fixed, int(rng.choice([0, 0, 64])),
                      rng.choice([5e-3, 2e-2, 5e-2], n), int(rng.choice([0, 3])), slack - rng.uniform(0, 0.01, n))


def same(x: object, y: object) -> bool:
    if isinstance(x, float) and isinstance(y, float):
        return x == y or (math.isnan(x) and math.isnan(y))
    if isinstance(x, dict) and isinstance(y, dict):
        return x.keys() == y.keys() and all(same(x[k], y[k]) for k in x)
    return x == y


def same_plan(a: StepPlan, b: StepPlan) -> bool:
    return (list(a.rids) == list(b.rids) and np.array_equal(a.widths, b.widths) and a.considered == b.considered
            and same(a.predicted_s, b.predicted_s) and same(a.budget_s, b.budget_s) and same(a.notes, b.notes))


@pytest.mark.parametrize("name", POLICIES)
def test_every_policy_plans_a_batch_as_the_reference_did(name):
    pyrng = random.Random(name)
    rng = np.random.default_rng(pyrng.getrandbits(32))
    with np.errstate(invalid="ignore"):  # the non-finite slacks' casts
        for _ in range(150):
            c = coefs(pyrng)
            kw = {"rho": pyrng.choice([0.5, 0.8, 1.0]), "utility": pyrng.choice(["linear", "concave", "priority"]),
                  "fill": pyrng.random() < 0.3}
            policy, frozen = (parse_policy(name, model=LinearLatencyModel(*c), **kw) for _ in range(2))
            a = random_batch(rng, pinned=not policy.replan)
            assert same_plan(policy.plan(a), ref.policy_plan(frozen, a)), a
            if policy.rho is not None:
                budget, floor, notes = policy.budget(a)
                want = ref.budget_rule(frozen, a)
                assert same(budget, want[0]) and same(notes, want[2])
                assert (floor is None) == (want[1] is None) and (floor is None or np.array_equal(floor, want[1]))
                assert same(policy.held_price(a, budget, floor), ref.held_price(frozen, a, budget, floor))
