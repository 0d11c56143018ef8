"""Planner properties (TAPER Algorithm 1) against a literal heap implementation."""

from __future__ import annotations

import heapq
import math

from hypothesis import given, settings
from hypothesis import strategies as st

from branchwise.taper.planner import plan_step
from branchwise.taper.predictor import ConstantLatencyModel, LinearLatencyModel
from branchwise.taper.state import BatchView, RequestView
from branchwise.taper.utility import CONCAVE, LINEAR, PRIORITY, Utility

EPS = 1e-12
MODEL = LinearLatencyModel(c0=10e-3, c_seq=2e-4, c_ctx=1e-7)


def batch_of(lens: list[tuple[int, ...]], weights: list[float] | None = None, slack: float = 1.0) -> BatchView:
    w = weights or [1.0] * len(lens)
    return BatchView(tuple(RequestView(f"r{i}", c, slack, weight=w[i], phase_id=f"p{i}" if len(c) > 1 else None)
                           for i, c in enumerate(lens)))


def composition(batch: BatchView, width: dict[str, int]) -> tuple[int, int]:
    rows = sum(width.values())
    ctx = sum(sum(r.context_lens[: width[r.rid]]) for r in batch.requests)
    return rows, ctx


def reference(batch: BatchView, model: LinearLatencyModel, budget: float, utility: Utility, prune: bool) -> dict:
    """Algorithm 1 as written: heap of each request's next row keyed by cost / marginal utility.

    prune=True: a misfit drops only that request (the paper); False: the first misfit ends the step.
    """
    reqs = batch.requests
    width = {r.rid: 1 for r in reqs}
    t = model.predict(len(reqs), sum(r.context_lens[0] for r in reqs))
    if t > budget:
        return width

    def head(i: int, r: RequestView):
        k = width[r.rid]  # index of the next row = opportunistic rank k
        cost = model.c_seq + model.c_ctx * r.context_lens[k]
        gain = utility.gain(k) * (r.weight if utility.weighted else 1.0)
        return (cost / gain, i, cost)

    heap = [head(i, r) for i, r in enumerate(reqs) if r.ready > 1]
    heapq.heapify(heap)
    while heap:
        _, i, cost = heapq.heappop(heap)
        r = reqs[i]
        if t + cost > budget + EPS:
            if prune:
                continue
            break
        t += cost
        width[r.rid] += 1
        if width[r.rid] < r.ready:
            heapq.heappush(heap, head(i, r))
    return width


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
    plan = plan_step(batch, model, budget, utility)
    assert set(plan.width) == {r.rid for r in batch.requests}
    for r in batch.requests:
        assert 1 <= plan.width[r.rid] <= r.ready
    t0 = model.predict(len(lens), sum(c[0] for c in lens))
    rows, ctx = composition(batch, plan.width)
    assert math.isclose(plan.predicted_s, model.predict(rows, ctx), rel_tol=1e-9, abs_tol=1e-12)
    if t0 <= budget:
        assert model.predict(rows, ctx) <= budget + EPS
    else:
        assert plan.width == {r.rid: 1 for r in batch.requests}


@settings(max_examples=50, deadline=None)
@given(batches, models, st.floats(-0.01, 0.1), st.floats(0, 0.05), utilities)
def test_plan_is_monotone_in_budget(lens, model, budget, more, utility):
    batch = batch_of(lens, [0.5 + (i % 4) for i in range(len(lens))])
    small = plan_step(batch, model, budget, utility).width
    big = plan_step(batch, model, budget + more, utility).width
    assert all(big[rid] >= w for rid, w in small.items())


@settings(max_examples=50, deadline=None)
@given(distinct_batches(), st.floats(0, 0.06), utilities, st.booleans())
def test_matches_algorithm_1_reference(lens, budget, utility, prune):
    batch = batch_of(lens, [1.0 + 0.37 * (i % 5) for i in range(len(lens))])
    plan = plan_step(batch, MODEL, budget, utility, fill=prune)
    assert plan.width == reference(batch, MODEL, budget, utility, prune)


@settings(max_examples=50, deadline=None)
@given(batches, models, st.floats(0, 0.06), utilities)
def test_fill_only_adds_rows(lens, model, budget, utility):
    batch = batch_of(lens)
    stop = plan_step(batch, model, budget, utility).width
    fill = plan_step(batch, model, budget, utility, fill=True)
    assert all(fill.width[rid] >= w for rid, w in stop.items())
    assert fill.predicted_s <= budget + EPS or fill.width == dict.fromkeys(stop, 1)


def test_fill_is_not_monotone_in_budget():
    # Why the default stops at the first misfit: with Algorithm 1's pruning rule a bigger budget can
    # admit an expensive high-priority row that crowds out a cheap one, narrowing another request.
    model = LinearLatencyModel(c0=0.0, c_seq=0.0, c_ctx=1e-7)
    batch = batch_of([(1, 5000), (1, 1000)], weights=[10.0, 1.0])  # a row costs 5e-4, b row 1e-4
    t0 = 2e-7
    assert plan_step(batch, model, t0 + 4e-4, PRIORITY, fill=True).width == {"r0": 1, "r1": 2}
    assert plan_step(batch, model, t0 + 5.5e-4, PRIORITY, fill=True).width == {"r0": 2, "r1": 1}
    assert plan_step(batch, model, t0 + 4e-4, PRIORITY).width == {"r0": 1, "r1": 1}
    assert plan_step(batch, model, t0 + 5.5e-4, PRIORITY).width == {"r0": 2, "r1": 1}


def test_cheap_rows_first_and_a_row_waits_for_its_predecessor():
    # r0's second row is cheap but sits behind an expensive first opportunistic row.
    batch = batch_of([(100, 8000, 10), (100, 500), (100, 600)])
    t0 = MODEL.predict(3, 300)
    row = MODEL.row_costs
    budget = t0 + float(row(500)) + float(row(600)) + 1e-9
    assert plan_step(batch, MODEL, budget).width == {"r0": 1, "r1": 2, "r2": 2}
    budget += float(row(8000)) + float(row(10))
    assert plan_step(batch, MODEL, budget).width == {"r0": 3, "r1": 2, "r2": 2}


def test_concave_spreads_width_and_priority_follows_weight():
    lens = [(1000,) * 5, (1000,) * 5]
    t0 = MODEL.predict(2, 2000)
    budget = t0 + 2 * float(MODEL.row_costs(1000)) + 1e-9  # room for exactly two rows
    assert plan_step(batch_of(lens), MODEL, budget, LINEAR).width == {"r0": 3, "r1": 1}  # ties: earlier
    assert plan_step(batch_of(lens), MODEL, budget, CONCAVE).width == {"r0": 2, "r1": 2}
    assert plan_step(batch_of(lens, [1.0, 3.0]), MODEL, budget, PRIORITY).width == {"r0": 1, "r1": 3}


def test_fast_paths_and_empty_batch():
    batch = batch_of([(10, 20, 30), (40,)])
    assert plan_step(batch, MODEL, -1.0).width == {"r0": 1, "r1": 1}
    assert plan_step(batch, MODEL, float("inf")).width == {"r0": 3, "r1": 1}
    empty = plan_step(BatchView(()), MODEL, 0.01)
    assert empty.width == {} and empty.rows == 0


def test_nan_budget_runs_the_protected_composition_only():
    batch = batch_of([(10, 20, 30), (40,)])
    assert plan_step(batch, MODEL, float("nan")).width == {"r0": 1, "r1": 1}


def test_extra_prefill_tokens_are_part_of_the_step():
    model = LinearLatencyModel(c0=0.0, c_seq=1e-3, c_ctx=0.0, c_tok=1e-4)
    lens = ((10, 10, 10),)
    no_prefill = BatchView((RequestView("a", lens[0], 1.0),))
    with_prefill = BatchView((RequestView("a", lens[0], 1.0),), extra_tokens=10)
    assert plan_step(no_prefill, model, 2.5e-3).width == {"a": 2}
    assert plan_step(with_prefill, model, 2.5e-3).width == {"a": 1}  # 1e-3 prefill leaves room for none


def test_pinned_widths_are_held_even_over_budget():
    reqs = (RequestView("a", (10, 10, 10, 10), 1.0, phase_id="p", fixed_width=3),
            RequestView("b", (10, 10, 10), 1.0, phase_id="q"),
            RequestView("c", (10, 10), 1.0, phase_id="s", fixed_width=5))
    batch = BatchView(reqs)
    loose = plan_step(batch, MODEL, 1.0, pinned=True).width
    assert loose == {"a": 3, "b": 3, "c": 2}
    tight = plan_step(batch, MODEL, 0.0, pinned=True)
    assert tight.width == {"a": 3, "b": 1, "c": 2}
    assert tight.predicted_s == MODEL.predict(6, 60)
    assert plan_step(batch, MODEL, 0.0).width == {"a": 1, "b": 1, "c": 1}  # without pinning: protected


def test_constant_model_is_all_or_nothing():
    batch = batch_of([(10, 20, 30), (40, 50)])
    assert plan_step(batch, ConstantLatencyModel(0.03), 0.029).width == {"r0": 1, "r1": 1}
    plan = plan_step(batch, ConstantLatencyModel(0.03), 0.03)
    assert plan.width == {"r0": 3, "r1": 2} and plan.predicted_s == 0.03
