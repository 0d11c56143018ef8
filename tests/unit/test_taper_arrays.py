"""ArrayBatch (the planner's flat-array input) plans exactly like the tuple-based BatchView."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from branchwise.taper.policies import parse_policy
from branchwise.taper.predictor import LinearLatencyModel
from branchwise.taper.state import ArrayBatch, BatchView, RequestView, StepPlan

MODEL = LinearLatencyModel(c0=10e-3, c_seq=2e-4, c_ctx=1e-7)
POLICIES = ["off", "cap:2", "eager", "taper", "taper-no-slack", "taper-no-replan", "taper-const-predictor"]

request = st.tuples(st.lists(st.integers(1, 8000), min_size=1, max_size=6).map(tuple),
                    st.floats(-0.01, 0.05), st.sampled_from([0.5, 1.0, 3.0]), st.integers(0, 4))


def arrays_by_hand(reqs: list[tuple]) -> ArrayBatch:
    """Built the way the scheduler hook does: straight from per-row numbers, no RequestView."""
    ctx = [c for lens, *_ in reqs for c in lens]
    fixed = np.array([f if len(lens) > 1 else 0 for lens, _, _, f in reqs], dtype=np.int64)
    return ArrayBatch([f"r{i}" for i in range(len(reqs))], np.array([len(r[0]) for r in reqs], dtype=np.int64),
                      np.array(ctx, dtype=np.int64), np.array([r[1] for r in reqs], dtype=np.float64),
                      np.array([r[2] for r in reqs], dtype=np.float64),
                      np.array([len(r[0]) > 1 for r in reqs]), fixed if fixed.any() else None, 7)


def view_of(reqs: list[tuple]) -> BatchView:
    return BatchView(tuple(RequestView(f"r{i}", lens, slack, w, f"p{i}" if len(lens) > 1 else None, len(lens),
                                       (f or None) if len(lens) > 1 else None)
                           for i, (lens, slack, w, f) in enumerate(reqs)), 7)


@settings(max_examples=150, deadline=None)
@given(st.lists(request, min_size=1, max_size=10), st.sampled_from(POLICIES),
       st.sampled_from(["linear", "concave", "priority"]))
def test_array_batch_plans_like_batch_view(reqs, name, utility):
    pol = parse_policy(name, model=MODEL, utility=utility, rho=0.8)
    view, arr = view_of(reqs), arrays_by_hand(reqs)
    a, b = pol.plan(view), pol.plan(arr)
    assert a.width == b.width
    assert a.predicted_s == pytest.approx(b.predicted_s, rel=1e-12, abs=1e-15)
    assert pol.pins(view, a) == pol.pins(arr, b)


def test_from_view_round_trips_every_field():
    reqs = [((5, 6, 7), 0.02, 2.0, 2), ((9,), 0.01, 1.0, 0)]
    a, b = ArrayBatch.from_view(view_of(reqs)), arrays_by_hand(reqs)
    assert list(a.rids) == list(b.rids) and a.extra_tokens == b.extra_tokens
    for f in ("ready", "ctx", "slack_s", "weight", "phase", "fixed_width"):
        assert np.array_equal(getattr(a, f), getattr(b, f)), f


@pytest.mark.parametrize("kw, msg", [
    ({"ready": np.array([1], dtype=np.int64)}, "one entry per request"),
    ({"ready": np.array([0, 1], dtype=np.int64), "ctx": np.array([5], dtype=np.int64)}, "at least one ready row"),
    ({"ctx": np.array([5], dtype=np.int64)}, "one entry per ready row"),
    ({"weight": np.ones(3)}, "weight needs one entry per request"),
])
def test_bad_array_batch_is_rejected(kw, msg):
    base = {"rids": ["a", "b"], "ready": np.array([1, 2], dtype=np.int64),
            "ctx": np.array([5, 6, 7], dtype=np.int64), "slack_s": np.zeros(2)}
    with pytest.raises(ValueError, match=msg):
        ArrayBatch(**{**base, **kw})


def test_step_plan_from_arrays_builds_its_dict_on_demand():
    p = StepPlan(rids=["a", "b"], widths=np.array([2, 1]), predicted_s=0.5)
    assert p.rows == 3 and p.widths(["b", "a"]) == [1, 2] and p.width == {"a": 2, "b": 1}
    assert p == StepPlan({"a": 2, "b": 1}, 0.5)
    with pytest.raises(ValueError, match="either width"):
        StepPlan()
    with pytest.raises(ValueError, match="either width"):
        StepPlan({"a": 1}, widths=np.array([1]), rids=["a"])
