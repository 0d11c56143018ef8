"""bench.confidence and the verdict it feeds: bootstrap intervals over a live point's requests,
three-valued comparisons (PASS / FAIL / UNDECIDED), repeats pooled, and the sweep's refinement plan."""

from __future__ import annotations

import numpy as np
import pytest

from bench import confidence as ci
from bench.capacity import Engine, capacity_range, hold_outcome, measure, verdict

RATE = 0.4


def _point(decomp_s, serial_s, good=None) -> dict:
    """A live point's figures from its requests: decomposable then serial end to end (None:
    unfinished), all meeting the SLO unless `good` says otherwise."""
    n_dec, n_ser = len(decomp_s), len(serial_s)
    samples = {"key": [f"d{i}" for i in range(n_dec)] + [f"s{i}" for i in range(n_ser)],
               "good": list(good) if good is not None else [True] * (n_dec + n_ser),
               "decomp": [True] * n_dec + [False] * n_ser,
               "e2e_s": [None if v is None else float(v) for v in (*decomp_s, *serial_s)]}
    point = {"rate": RATE, "goodput_tok_s": 100.0, "samples": samples}
    reqs = ci.Requests.of(point)
    assert reqs is not None
    return point | ci.request_figures(reqs)


def _judge(points: dict[str, dict]):
    """The sweep's path: the points through bench.capacity.measure (intervals annotated) to the verdict."""
    engine = Engine("fake", lambda policy, rate, seed: points[policy], 1.0)
    res = measure(engine, list(points), [0], log=lambda _: None, rates=[RATE], bisect_steps=0)
    result = verdict(res["capacity"])
    assert result is not None
    return result, res


def _eager(n: int = 40) -> np.ndarray:
    return np.linspace(2.0, 10.0, n)


def _taper(factor: float, wobble: float, n: int = 40) -> np.ndarray:
    """taper's end to end per request: eager's times `factor`, each off by up to +-wobble."""
    rng = np.random.default_rng(7)
    return _eager(n) * factor * (1 + rng.uniform(-wobble, wobble, n))


SERIAL = [1.0] * 10


@pytest.mark.parametrize(("factor", "outcome"), [(1.0, ci.PASS), (1.3, ci.FAIL), (1.05, ci.UNDECIDED)])
def test_the_latency_check_passes_fails_or_cannot_decide_by_its_paired_interval(factor, outcome):
    """The same 40 decomposable requests under eager and taper: taper within 1.05x on every resample
    passes, 1.3x on every resample fails, and a ratio whose interval contains 1.05 is UNDECIDED."""
    points = {"serial": _point(_eager() * 1.6, SERIAL), "eager": _point(_eager(), SERIAL),
              "taper": _point(_taper(factor, 0.02), SERIAL)}
    result, res = _judge(points)
    check = result.latency[0]
    assert check.applies and check.outcome == outcome and result.outcome == outcome
    assert check.versus == "eager" and check.ratio[1] <= check.ratio[0] <= check.ratio[2]
    if outcome == ci.UNDECIDED:
        assert check.ratio[1] < 1.05 < check.ratio[2]
        assert result.undecided == [f"latency at {RATE:.3f}"] and not result.passed
    point = res["capacity"]["policies"]["taper"]["points"][0]
    assert point["attainment_ci"] == [1.0, 1.0] and hold_outcome(point) == ci.PASS
    lo, hi = point["decomp_e2e_p50_s_ci"]
    assert lo < point["decomp_e2e_p50_s"] < hi
    assert point["p50_ratio"]["eager"] == pytest.approx(list(check.ratio))
    assert f"{check.outcome}" in check.line("taper") and "[" in check.line("taper")


def test_the_issues_light_point_is_undecided_not_failed():
    """The FAIL of the issue: every policy at 100%, taper deferred nothing, decomposable P50 5.45 s
    against eager's 5.0 s (1.09x) over seven decomposable requests. Per request taper is ahead on some
    and behind on others: one run cannot tell 9% apart, so the point is UNDECIDED, never a PASS."""
    eager = [3.1, 4.2, 5.0, 5.0, 6.3, 7.7, 9.0]
    taper = [3.6, 3.9, 5.45, 4.6, 7.4, 7.0, 9.8]
    points = {"serial": _point([v * 1.5 for v in eager], SERIAL), "eager": _point(eager, SERIAL),
              "taper": _point(taper, SERIAL)}
    assert points["taper"]["decomp_e2e_p50_s"] / points["eager"]["decomp_e2e_p50_s"] == pytest.approx(1.09)
    result, _ = _judge(points)
    check = result.latency[0]
    assert check.ratio[0] == pytest.approx(1.09)
    assert check.ratio[1] < 1.0 and check.ratio[2] > 1.05  # wide
    assert check.outcome == ci.UNDECIDED and result.outcome == ci.UNDECIDED and not result.passed
    assert result.capacity_outcome == ci.PASS  # everyone holds at the only rate: a tie decided
    assert "UNDECIDED (undecided: latency at 0.400)" in result.lines(1.0)[-1]
    # read without intervals (the point values alone), the same figures FAIL
    bare = {policy: {k: v for k, v in point.items() if k != "samples"} for policy, point in points.items()}
    assert _judge(bare)[0].outcome == ci.FAIL


def test_a_hold_is_decided_only_where_the_attainment_interval_is_clear_of_the_target():
    n = 40
    assert hold_outcome(_point([5.0] * 10, [1.0] * (n - 10))) == ci.PASS  # 100%: [1, 1]
    half = [True, False] * (n // 2)
    point = _point([5.0] * 10, [1.0] * (n - 10), good=half)
    point["attainment_ci"] = list(ci.attainment_interval([ci.Requests.of(point)]))
    assert point["attainment_ci"][1] < 0.95 and hold_outcome(point) == ci.FAIL
    near = [i != 3 for i in range(n)]  # 97.5%: the interval straddles 95%
    point = _point([5.0] * 10, [1.0] * (n - 10), good=near)
    point["attainment_ci"] = list(ci.attainment_interval([ci.Requests.of(point)]))
    assert point["attainment_ci"][0] < 0.95 < point["attainment_ci"][1] and hold_outcome(point) == ci.UNDECIDED
    # capacity range: held, undecided, failed -> [first rate, second rate]
    held = {"rate": 1.0, "attainment": 1.0}
    failed = {"rate": 3.0, "attainment": 0.5}
    assert capacity_range([held, point | {"rate": 2.0}, failed]) == [1.0, 2.0]


def test_overlapping_capacity_ranges_leave_the_capacity_axis_undecided():
    """taper holds for sure at the first rate and maybe at the second; eager holds for sure at both."""
    sure, maybe, fails = (_point([5.0] * 10, [1.0] * 30, good=good)
                          for good in ([True] * 40, [i != 3 for i in range(40)], [i % 2 == 0 for i in range(40)]))
    pts = {("taper", 1.0): sure, ("taper", 2.0): maybe, ("taper", 3.0): fails,
           ("eager", 1.0): sure, ("eager", 2.0): sure, ("eager", 3.0): fails}
    engine = Engine("fake", lambda policy, rate, seed: pts[(policy, rate)] | {"rate": rate}, 1.0)
    res = measure(engine, ["eager", "taper"], [0], log=lambda _: None, rates=[1.0, 2.0, 3.0], bisect_steps=0)
    assert res["capacity"]["policies"]["taper"]["capacity_range_rps"] == [1.0, 2.0]
    result = verdict(res["capacity"])
    assert result.capacity_outcome == ci.UNDECIDED and dict(result.capacity_vs) == {"eager": ci.UNDECIDED}
    assert "capacity" in result.undecided and result.outcome == ci.UNDECIDED


def test_intervals_are_reproducible_and_seeds_are_strata():
    a = ci.Requests.of(_point(_eager(), SERIAL))
    b = ci.Requests.of(_point(_taper(1.0, 0.1), SERIAL))
    assert ci.p50_ratio([(b, a)]) == ci.p50_ratio([(b, a)])  # fixed RNG seed: the same report twice
    one = ci.p50_interval([a])
    two = ci.p50_interval([a, a])  # two seeds of the same requests: the mean's interval is narrower
    assert two[0] > one[0] and two[1] < one[1]
    assert ci.p50_interval([a, ci.Requests.of(_point([None] * 3, SERIAL))]) == pytest.approx(one, rel=0.05)


def test_repeats_pool_their_requests_and_pair_run_by_run():
    run0 = _point([4.0, 6.0], SERIAL) | {"goodput_tok_s": 100.0}
    run1 = _point([8.0, None], SERIAL, good=[True, False] + [True] * 10) | {"goodput_tok_s": 50.0}
    pooled = ci.pool([run0, run1])
    assert pooled["repeats"] == 2 and pooled["goodput_tok_s"] == 75.0  # other figures: the mean of runs
    assert pooled["samples"]["key"][:2] == ["0/d0", "0/d1"] and pooled["samples"]["key"][12] == "1/d0"
    assert pooled["decomp_e2e_p50_s"] == 6.0 and pooled["attainment"] == pytest.approx(23 / 24)
    assert pooled["decomp_finished_frac"] == 0.75 and len(pooled["per_repeat"]) == 2
    other = _point([5.0, 7.0], SERIAL)
    single = ci.pool([other])
    assert single["samples"]["key"][0] == "0/d0" and single["decomp_e2e_p50_s"] == other["decomp_e2e_p50_s"]
    # a policy with one run pairs with the first run of one with two: 5.0 against 6.0, not 6.0 (all three)
    ratio = ci.p50_ratio([(ci.Requests.of(pooled), ci.Requests.of(single))])
    assert ratio is not None and ratio.value == pytest.approx(5.0 / 6.0)


def test_kleene_outcomes():
    assert ci.decide(0.96, 1.0, 0.95, above_ok=True) == ci.PASS
    assert ci.decide(0.9, 0.94, 0.95, above_ok=True) == ci.FAIL
    assert ci.decide(1.0, 1.06, 1.05, above_ok=False) == ci.UNDECIDED
    assert ci.all_of([ci.PASS, ci.UNDECIDED]) == ci.UNDECIDED and ci.all_of([ci.UNDECIDED, ci.FAIL]) == ci.FAIL
    assert ci.any_of([ci.FAIL, ci.UNDECIDED]) == ci.UNDECIDED and ci.any_of([ci.UNDECIDED, ci.PASS]) == ci.PASS
    assert ci.negate(ci.UNDECIDED) == ci.UNDECIDED and ci.negate(ci.PASS) == ci.FAIL


def test_the_sweep_runs_again_only_the_points_it_cannot_decide_within_its_budget():
    from bench import sweep

    eager = [3.1, 4.2, 5.0, 5.0, 6.3, 7.7, 9.0]
    light = {"serial": _point([v * 1.5 for v in eager], SERIAL), "eager": _point(eager, SERIAL),
             "taper": _point([3.6, 3.9, 5.45, 4.6, 7.4, 7.0, 9.8], SERIAL)}
    clear = {"serial": _point(_eager() * 1.6, SERIAL), "eager": _point(_eager(), SERIAL),
             "taper": _point(_taper(1.0, 0.02), SERIAL)}
    by_rate = {0.2: light, 0.4: clear, 0.8: light}
    engine = Engine("fake", lambda policy, rate, seed: by_rate[rate][policy] | {"rate": rate}, 1.0)
    res = measure(engine, list(light), [0, 1], log=lambda _: None, rates=list(by_rate), bisect_steps=0)
    # taper against eager is what one run cannot decide at the light points; against serial it can
    assert sweep.undecided(res) == {(rate, seed): ["eager", "taper"] for rate in (0.2, 0.8) for seed in (0, 1)}
    walls = {(policy, rate, seed): [10.0 * rate] for policy in light for rate in by_rate for seed in (0, 1)}
    plan = sweep.refine_plan(res, walls, budget_s=9.0)  # 4 s per (rate, seed) at 0.2, 16 s at 0.8
    assert plan == [((0.2, 0), ["eager", "taper"], pytest.approx(4.0)),
                    ((0.2, 1), ["eager", "taper"], pytest.approx(4.0))]


def test_a_points_samples_give_back_its_own_figures():
    """bench.metrics.request_samples, recomputed by bench.confidence, agrees with bench.metrics.summarize."""
    from bench.metrics import RequestRecord, request_samples, summarize

    recs = [RequestRecord.from_token_times(f"r{i}", float(i), [(False, [i + 0.5, i + 1.0]), (True, [i + 2.0 + i % 3])],
                                           finished=i != 4)
            for i in range(8)]
    recs.append(RequestRecord.from_token_times("serial", 1.0, [(False, [1.5, 2.5])]))
    recs.append(RequestRecord.from_token_times("late", 20.0, [(True, [21.0, 22.0])]))  # after the window
    samples = request_samples(recs, 1.5, (0.0, 10.0))  # a branch stage's TPOT is 1, 2 or 3 s
    assert samples["key"][-1] == "serial" and "late" not in samples["key"]
    assert samples["e2e_s"][4] is None and samples["decomp"][:8] == [True] * 8
    want = summarize(recs, 1.5, (0.0, 10.0))
    assert 0 < want["slo_attainment"] < 1
    got = ci.request_figures(ci.Requests.of({"samples": samples}))
    for name, src in (("attainment", "slo_attainment"), ("decomp_e2e_p50_s", "decomp_e2e_p50_s"),
                      ("decomp_finished_frac", "decomp_finished_frac"), ("serial_e2e_p50_s", "serial_e2e_p50_s")):
        assert got[name] == pytest.approx(want[src]), name


def test_live_points_interleave_repeats_and_run_only_the_missing_ones(monkeypatch):
    from bench import live
    from bench.client import Run

    ran: list = []

    def run_point(url, policy, rate, seed, setup, progress=False):
        ran.append((policy, rate))
        return _point([4.0 + len(ran), 5.0], SERIAL) | {"rate": rate}, Run(policy, [])

    monkeypatch.setattr(live, "run_point", run_point)
    points = live.LivePoints(live.Servers(urls={"serial": "a", "eager": "b", "taper": "c"}), None, 1.0, repeats=2)
    jobs = [("serial", 0.1, 0), ("eager", 0.1, 0), ("taper", 0.1, 0)]
    got = points.batch(jobs)
    assert [policy for policy, _ in ran] == ["serial", "eager", "taper", "eager", "taper", "serial"]
    assert all(point["repeats"] == 2 for point in got) and len(points.done) == 6
    points.extra[("taper", 0.1, 0)] = 1
    again = points.batch(jobs)
    assert [policy for policy, _ in ran[6:]] == ["taper"]  # only the repeat it lacks
    assert [point["repeats"] for point in again] == [2, 2, 3] and len(points.walls[("taper", 0.1, 0)]) == 3


def test_too_few_requests_decide_nothing():
    """Three decomposable requests, each 20% slower under taper: a bootstrap over three says 1.2x for
    sure, but three on one side is 1 in 8 by chance, so the comparison stays UNDECIDED; three
    arrivals, all on time, leave the hold undecided the same way."""
    eager = [3.0, 5.0, 7.0]
    few = {"serial": _point([v * 1.5 for v in eager], SERIAL), "eager": _point(eager, SERIAL),
           "taper": _point([v * 1.2 for v in eager], SERIAL)}
    check = _judge(few)[0].latency[0]
    assert check.ratio[0] == pytest.approx(1.2) and check.ratio[2] == float("inf")
    assert check.outcome == ci.UNDECIDED
    six = {policy: _point([*point["samples"]["e2e_s"][:3]] * 2, SERIAL) for policy, point in few.items()}
    assert _judge(six)[0].latency[0].outcome == ci.FAIL  # six pairs all 1.2x: decided
    tiny = _point([5.0], [1.0, 1.0])
    tiny["attainment_ci"] = list(ci.attainment_interval([ci.Requests.of(tiny)]))
    assert tiny["attainment_ci"] == [0.0, 1.0] and hold_outcome(tiny) == ci.UNDECIDED
