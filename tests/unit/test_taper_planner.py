"""Planner properties (TAPER Algorithm 1) against a literal heap implementation."""

from __future__ import annotations

import heapq
import math

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from branchwise.taper.planner import ArrayBatch, PlanOptions, StepPlan, greedy_order, plan_step
from branchwise.taper.predictor import ConstantLatencyModel, LinearLatencyModel
from branchwise.taper.utility import CONCAVE, LINEAR, PRIORITY, Utility

EPS = 1e-12
MODEL = LinearLatencyModel(c0=10e-3, c_seq=2e-4, c_ctx=1e-7)


def batch_of(lens: list[tuple[int, ...]], weights: list[float] | None = None, slack: float = 1.0,
             fixed: list[int] | None = None, extra_tokens: int = 0) -> ArrayBatch:
    """Request i is "r{i}" with rows of context lens[i] (a phase when it has more than one)."""
    n = len(lens)
    return ArrayBatch([f"r{i}" for i in range(n)], np.array([len(c) for c in lens], dtype=np.int64),
                      np.array([x for c in lens for x in c], dtype=np.int64), np.full(n, slack),
                      np.array(weights or [1.0] * n), np.array([len(c) > 1 for c in lens], dtype=bool),
                      np.array(fixed, dtype=np.int64) if fixed else None, extra_tokens)


def width(plan: StepPlan) -> dict[str, int]:
    return dict(zip(plan.rids, plan.widths.tolist(), strict=True))


def lens_of(batch: ArrayBatch) -> list[list[int]]:
    ends = batch.ready.cumsum().tolist()
    return [batch.ctx[e - r:e].tolist() for e, r in zip(ends, batch.ready.tolist(), strict=True)]


def composition(batch: ArrayBatch, w: dict[str, int]) -> tuple[int, int]:
    rows = sum(w.values())
    ctx = sum(sum(c[: w[rid]]) for rid, c in zip(batch.rids, lens_of(batch), strict=True))
    return rows, ctx


def reference(batch: ArrayBatch, model: LinearLatencyModel, budget: float, utility: Utility, prune: bool) -> dict:
    """Algorithm 1 as written: heap of each request's next row keyed by cost / marginal utility.

    prune=True: a misfit drops only that request (the paper); False: the first misfit ends the step.
    """
    lens, rids, weights = lens_of(batch), list(batch.rids), batch.weight.tolist()
    w = dict.fromkeys(rids, 1)
    t = model.predict(len(rids), sum(c[0] for c in lens))
    if t > budget:
        return w

    def head(i: int):
        k = w[rids[i]]  # index of the next row = opportunistic rank k
        cost = model.c_seq + model.c_ctx * lens[i][k]
        gain = utility.gain(k) * (weights[i] if utility.weighted else 1.0)
        return (cost / gain, i, cost)

    heap = [head(i) for i in range(len(rids)) if len(lens[i]) > 1]
    heapq.heapify(heap)
    while heap:
        _, i, cost = heapq.heappop(heap)
        if t + cost > budget + EPS:
            if prune:
                continue
            break
        t += cost
        w[rids[i]] += 1
        if w[rids[i]] < len(lens[i]):
            heapq.heappush(heap, head(i))
    return w


ctx_len = st.integers(1, 8000)
request = st.lists(ctx_len, min_size=1, max_size=6).map(tuple)
batches = st.lists(request, min_size=1, max_size=12)
utilities = st.sampled_from([LINEAR, CONCAVE, PRIORITY])
models = st.builds(LinearLatencyModel, c0=st.floats(0, 0.02), c_seq=st.floats(0, 1e-3), c_ctx=st.floats(0, 1e-6))


@st.composite
def distinct_batches(draw):
    """Batches whose rows all have different context lengths: no cost ties, so the greedy order is unique."""
    sizes = draw(st.lists(st.integers(1, 6), min_size=1, max_size=10))
    pool = draw(st.lists(ctx_len, min_size=sum(sizes), max_size=sum(sizes), unique=True))
    out, i = [], 0
    for s in sizes:
        out.append(tuple(pool[i:i + s]))
        i += s
    return out


@settings(max_examples=50, deadline=None)
@given(batches, models, st.floats(-0.01, 0.1), utilities)
def test_protected_always_runs_and_plan_fits_budget(lens, model, budget, utility):
    batch = batch_of(lens, [1.0 + (i % 3) for i in range(len(lens))])
    plan = plan_step(batch, model, budget, PlanOptions(utility))
    assert list(plan.rids) == list(batch.rids)
    assert ((1 <= plan.widths) & (plan.widths <= batch.ready)).all()
    t0 = model.predict(len(lens), sum(c[0] for c in lens))
    rows, ctx = composition(batch, width(plan))
    assert math.isclose(plan.predicted_s, model.predict(rows, ctx), rel_tol=1e-9, abs_tol=1e-12)
    if t0 <= budget:
        assert model.predict(rows, ctx) <= budget + EPS
    else:
        assert width(plan) == dict.fromkeys(batch.rids, 1)


@settings(max_examples=50, deadline=None)
@given(batches, models, st.floats(-0.01, 0.1), st.floats(0, 0.05), utilities)
def test_plan_is_monotone_in_budget(lens, model, budget, more, utility):
    batch = batch_of(lens, [0.5 + (i % 4) for i in range(len(lens))])
    small = width(plan_step(batch, model, budget, PlanOptions(utility)))
    big = width(plan_step(batch, model, budget + more, PlanOptions(utility)))
    assert all(big[rid] >= w for rid, w in small.items())


@settings(max_examples=50, deadline=None)
@given(distinct_batches(), st.floats(0, 0.06), utilities, st.booleans())
def test_matches_algorithm_1_reference(lens, budget, utility, prune):
    batch = batch_of(lens, [1.0 + 0.37 * (i % 5) for i in range(len(lens))])
    plan = plan_step(batch, MODEL, budget, PlanOptions(utility, fill=prune))
    assert width(plan) == reference(batch, MODEL, budget, utility, prune)


@settings(max_examples=50, deadline=None)
@given(batches, models, st.floats(0, 0.06), utilities)
def test_fill_only_adds_rows(lens, model, budget, utility):
    batch = batch_of(lens)
    stop = width(plan_step(batch, model, budget, PlanOptions(utility)))
    fill = plan_step(batch, model, budget, PlanOptions(utility, fill=True))
    assert all(width(fill)[rid] >= w for rid, w in stop.items())
    assert fill.predicted_s <= budget + EPS or width(fill) == dict.fromkeys(stop, 1)


def test_fill_is_not_monotone_in_budget():
    # Why the default stops at the first misfit: with Algorithm 1's pruning rule a bigger budget can
    # admit an expensive high-priority row that crowds out a cheap one, narrowing another request.
    model = LinearLatencyModel(c0=0.0, c_seq=0.0, c_ctx=1e-7)
    batch = batch_of([(1, 5000), (1, 1000)], weights=[10.0, 1.0])  # a row costs 5e-4, b row 1e-4
    t0 = 2e-7
    assert width(plan_step(batch, model, t0 + 4e-4, PlanOptions(PRIORITY, fill=True))) == {"r0": 1, "r1": 2}
    assert width(plan_step(batch, model, t0 + 5.5e-4, PlanOptions(PRIORITY, fill=True))) == {"r0": 2, "r1": 1}
    assert width(plan_step(batch, model, t0 + 4e-4, PlanOptions(PRIORITY))) == {"r0": 1, "r1": 1}
    assert width(plan_step(batch, model, t0 + 5.5e-4, PlanOptions(PRIORITY))) == {"r0": 2, "r1": 1}


def test_cheap_rows_first_and_a_row_waits_for_its_predecessor():
    # r0's second row is cheap but sits behind an expensive first opportunistic row.
    batch = batch_of([(100, 8000, 10), (100, 500), (100, 600)])
    t0 = MODEL.predict(3, 300)
    row = MODEL.row_costs
    budget = t0 + float(row(500)) + float(row(600)) + 1e-9
    assert width(plan_step(batch, MODEL, budget)) == {"r0": 1, "r1": 2, "r2": 2}
    budget += float(row(8000)) + float(row(10))
    assert width(plan_step(batch, MODEL, budget)) == {"r0": 3, "r1": 2, "r2": 2}


def test_concave_spreads_width_and_priority_follows_weight():
    lens = [(1000,) * 5, (1000,) * 5]
    t0 = MODEL.predict(2, 2000)
    budget = t0 + 2 * float(MODEL.row_costs(1000)) + 1e-9  # room for exactly two rows
    assert width(plan_step(batch_of(lens), MODEL, budget, PlanOptions(LINEAR))) == {"r0": 3, "r1": 1}  # ties: earlier
    assert width(plan_step(batch_of(lens), MODEL, budget, PlanOptions(CONCAVE))) == {"r0": 2, "r1": 2}
    assert width(plan_step(batch_of(lens, [1.0, 3.0]), MODEL, budget, PlanOptions(PRIORITY))) == {"r0": 1, "r1": 3}


def test_fast_paths_and_empty_batch():
    batch = batch_of([(10, 20, 30), (40,)])
    assert width(plan_step(batch, MODEL, -1.0)) == {"r0": 1, "r1": 1}
    assert width(plan_step(batch, MODEL, float("inf"))) == {"r0": 3, "r1": 1}
    empty = plan_step(batch_of([]), MODEL, 0.01)
    assert width(empty) == {} and empty.rows == 0 and empty.budget_s == 0.01


def test_nan_budget_runs_the_protected_composition_only():
    batch = batch_of([(10, 20, 30), (40,)])
    assert width(plan_step(batch, MODEL, float("nan"))) == {"r0": 1, "r1": 1}


def test_extra_prefill_tokens_are_part_of_the_step():
    model = LinearLatencyModel(c0=0.0, c_seq=1e-3, c_ctx=0.0, c_tok=1e-4)
    lens = [(10, 10, 10)]
    no_prefill = batch_of(lens)
    with_prefill = batch_of(lens, extra_tokens=10)
    assert width(plan_step(no_prefill, model, 2.5e-3)) == {"r0": 2}
    assert width(plan_step(with_prefill, model, 2.5e-3)) == {"r0": 1}  # 1e-3 prefill leaves room for none


def test_pinned_widths_are_held_even_over_budget():
    batch = batch_of([(10, 10, 10, 10), (10, 10, 10), (10, 10)], fixed=[3, 0, 5])
    loose = width(plan_step(batch, MODEL, 1.0, PlanOptions(pinned=True)))
    assert loose == {"r0": 3, "r1": 3, "r2": 2}
    tight = plan_step(batch, MODEL, 0.0, PlanOptions(pinned=True))
    assert width(tight) == {"r0": 3, "r1": 1, "r2": 2}
    assert tight.predicted_s == MODEL.predict(6, 60)
    assert width(plan_step(batch, MODEL, 0.0)) == {"r0": 1, "r1": 1, "r2": 1}  # without pinning: protected


def test_constant_model_is_all_or_nothing():
    batch = batch_of([(10, 20, 30), (40, 50)])
    assert width(plan_step(batch, ConstantLatencyModel(0.03), 0.029)) == {"r0": 1, "r1": 1}
    plan = plan_step(batch, ConstantLatencyModel(0.03), 0.03)
    assert width(plan) == {"r0": 3, "r1": 2} and plan.predicted_s == 0.03


def test_batches_past_the_row_index_table_plan_alike_and_leave_it_unchanged():
    """The planner slices a read-only table of row indices; a bigger step builds its own."""
    from branchwise.taper import planner

    table = planner._ROWS.copy()
    assert not planner._ROWS.flags.writeable
    n = len(table) // 2 + 1  # 2 rows each: past the table
    lens = [(100, 200 + i % 7) for i in range(n)]
    t0 = MODEL.predict(n, 100 * n)
    budget = t0 + 100 * float(MODEL.row_costs(200)) + 1e-12  # room for the 100 cheapest branch rows
    plan = plan_step(batch_of(lens), MODEL, budget)
    cheapest = [i for i, c in enumerate(lens) if c[1] == 200][:100]  # equal costs: earlier rows first
    assert plan.rows == n + 100 and np.flatnonzero(plan.widths == 2).tolist() == cheapest
    assert np.array_equal(planner._ROWS, table)


def greedy_order_reference(price: list[float], seg: list[int]) -> list[int]:
    """greedy_order in plain Python: each row keyed by the running max of its request's quantized
    prices (a price's float bits without the low 20, as the planner ties them), then its index."""
    keys, running = [], {}
    for row, (cost, req) in enumerate(zip(price, seg, strict=True)):
        quantized = int(np.float64(cost).view(np.int64)) >> 20
        running[req] = max(running.get(req, quantized), quantized)
        keys.append((running[req], row))
    return [row for _, row in sorted(keys)]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.lists(st.floats(0.0, 1e-2) | st.sampled_from([0.0, 1e-4, 1e-4 * (1 + 1e-12)]),
                         min_size=1, max_size=9), min_size=1, max_size=12))
def test_the_packed_greedy_order_is_the_plain_sort(requests):
    price = [p for rows in requests for p in rows]
    seg = [i for i, rows in enumerate(requests) for _ in rows]
    got = greedy_order(np.array(price, dtype=np.float64), np.array(seg, dtype=np.int64))
    assert got.tolist() == greedy_order_reference(price, seg)
