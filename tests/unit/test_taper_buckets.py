"""T(S) with captured CUDA-graph batch sizes: a decode step's rows cost as the next captured size up,
so the planner gains nothing by deferring rows that cross no bucket boundary, and the refit fits
the padded rows. Without graph sizes (CPU) the model and the plans are the linear ones."""

from __future__ import annotations

import numpy as np
import pytest

from branchwise.taper.planner import ArrayBatch, PlanOptions, plan_step
from branchwise.taper.policies import parse_policy
from branchwise.taper.predictor import LinearLatencyModel, OnlineRefit

SIZES = (1, 2, 4, 8, 16)


def model(sizes: tuple[int, ...] = SIZES, c_ctx: float = 0.0) -> LinearLatencyModel:
    return LinearLatencyModel(c0=10e-3, c_seq=1e-3, c_ctx=c_ctx, graph_batch_sizes=sizes)


def batch(ready: list[int], ctx: int = 100, slack_s: float = 0.0) -> ArrayBatch:
    count = len(ready)
    return ArrayBatch(rids=[f"r{i}" for i in range(count)], ready=np.array(ready, dtype=np.int64),
                      ctx=np.full(sum(ready), ctx, dtype=np.int64), slack_s=np.full(count, slack_s))


def test_predict_pads_decode_rows_to_the_next_captured_size():
    padded = model()
    assert padded.predict(5, 0) == pytest.approx(10e-3 + 8e-3)
    assert padded.predict(8, 0) == padded.predict(5, 0)
    assert padded.predict(17, 0) == pytest.approx(10e-3 + 17e-3)  # past the largest: eager, unpadded
    assert padded.predict(5, 0, extra_tokens=30) == pytest.approx(10e-3 + 5e-3)  # mixed: no graph
    assert model(sizes=()).predict(5, 0) == pytest.approx(15e-3)  # CPU: linear in rows


def test_rows_inside_one_bucket_are_not_deferred():
    """5 requests, 7 ready rows: the protected 5 and all 7 both replay the 8-row graph (18 ms), so
    deferring saves nothing and every row runs, though the budget is below the step; linear T (15 ms
    protected, 1 ms a row) defers."""
    step = batch([2, 2, 1, 1, 1])
    budget = 15.5e-3
    for options in (PlanOptions(), PlanOptions(fill=True)):
        plan = plan_step(step, model(), budget, options)
        assert plan.widths.tolist() == [2, 2, 1, 1, 1] and plan.predicted_s == pytest.approx(18e-3)
        assert plan_step(step, model(sizes=()), budget, options).rows == 5


def test_rows_across_a_bucket_boundary_are_deferred():
    """4 requests, 12 ready rows replay the 16-row graph (26 ms); 8 rows fill the 8-row graph
    (18 ms): a 20 ms budget runs those 8 and defers the 4 that would cross to the next graph."""
    step = batch([3, 3, 3, 3])
    for options in (PlanOptions(), PlanOptions(fill=True)):
        plan = plan_step(step, model(), 20e-3, options)
        assert plan.rows == 8 and plan.predicted_s == pytest.approx(18e-3)
        assert plan_step(step, model(), 26e-3, options).rows == 12
        assert plan_step(step, model(), 17e-3, options).rows == 4  # 5..8 rows cost 18 ms: over 17
    # over budget, the rows that add no predicted time still run: 3 protected replay the 4-row graph
    assert plan_step(batch([3, 3, 3]), model(), 12e-3).rows == 4


def test_inside_a_bucket_a_row_costs_its_context():
    """With a context cost a row inside the bucket adds its context time only: the budget decides."""
    step = batch([2, 2, 1, 1, 1], ctx=1000)  # 1 ms of context per row at 1 us/token
    padded = model(c_ctx=1e-6)
    assert plan_step(step, padded, 24.5e-3).rows == 6  # protected 23 ms (10 + 8 + 5), then 1 ms a row
    assert plan_step(step, padded, 25e-3 + 1e-12).rows == 7


def test_the_budget_rule_under_graph_sizes():
    """taper-paper (Policy.plan): its budget below the step, every row in the protected bucket runs."""
    policy = parse_policy("taper-paper", model=model())
    plan = policy.plan(batch([2, 2, 1, 1, 1], slack_s=15.5e-3 / 0.8))
    assert plan.rows == 7 and plan.budget_s == pytest.approx(15.5e-3)
    assert parse_policy("taper-paper", model=model(sizes=())).plan(batch([2, 2, 1, 1, 1], slack_s=15.5e-3 / 0.8)).rows == 5


def test_the_refit_fits_padded_rows():
    """Steps timed as floor + per_row x padded rows: the refit recovers both (blend 1, exact data)."""
    padded = LinearLatencyModel(c0=1e-3, c_seq=1e-4, c_ctx=0.0, graph_batch_sizes=(1, 2, 4, 8, 12, 16))
    refit = OnlineRefit(padded, window=64, every=8, blend=1.0, min_samples=8)
    truth = LinearLatencyModel(c0=50e-3, c_seq=1e-3, c_ctx=2e-7, graph_batch_sizes=padded.graph_batch_sizes)
    rng = np.random.default_rng(0)
    for _ in range(64):
        rows = int(rng.integers(1, 20))
        ctx = int(rows * rng.integers(50, 500))
        refit.observe(rows, ctx, truth.predict(rows, ctx))
    assert padded.c0 == pytest.approx(50e-3, rel=1e-6) and padded.c_seq == pytest.approx(1e-3, rel=1e-6)
    assert padded.c_ctx == pytest.approx(2e-7, rel=1e-4) and padded.graph_batch_sizes == truth.graph_batch_sizes


def test_a_padded_plan_predicts_what_the_model_predicts_for_its_rows():
    """Random batches and budgets: the plan's predicted time is T(S) of the rows it runs (padded), and
    it is within budget unless the protected rows alone are over it and nothing it added costs time."""
    rng = np.random.default_rng(1)
    padded = model(c_ctx=2e-7)
    for _ in range(300):
        ready = rng.integers(1, 5, size=int(rng.integers(1, 8))).tolist()
        step = ArrayBatch(rids=[f"r{i}" for i in range(len(ready))], ready=np.array(ready, dtype=np.int64),
                          ctx=rng.integers(10, 3000, size=sum(ready)).astype(np.int64), slack_s=np.zeros(len(ready)))
        budget = float(rng.uniform(10e-3, 30e-3))
        for options in (PlanOptions(), PlanOptions(fill=True)):
            plan = plan_step(step, padded, budget, options)
            keep = np.arange(len(step.ctx)) < (step.starts + plan.widths).repeat(step.ready)
            assert plan.predicted_s == pytest.approx(padded.predict(plan.rows, int(step.ctx[keep].sum())), rel=1e-9)
            protected_s = padded.predict(len(ready), step.protected_ctx)
            assert plan.predicted_s <= max(budget, protected_s) * (1 + 1e-9)
