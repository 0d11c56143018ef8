"""bench.capacity: the grid rule, bisection, capacity.json's schema, the acceptance verdict."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import bench.capacity as cap
from bench.capacity import Engine, bracket, fluid_bound, grid, measure, verdict
from bench.workload import compose, load_trace, stationary_schedule
from branchwise.taper import default_model

AZURE = Path(__file__).resolve().parents[2] / "bench" / "data" / "AzureLLMInferenceTrace_conv.csv"


def _fake(capacity: dict[str, float], calls: list | None = None) -> Engine:
    """Attainment 1.0 below a policy's capacity (seed 1 a little lower), 0.5 above."""

    def point(policy: str, rate: float, seed: int) -> dict:
        if calls is not None:
            calls.append((policy, rate, seed))
        c = capacity[policy] - 0.05 * seed
        ok = rate <= c
        return {"rate": rate, "goodput_tok_s": 1000 * rate if ok else 100.0, "attainment": 1.0 if ok else 0.5,
                "finished_frac": 1.0, "p99_ttft_s": 0.2}

    return Engine("fake", point, 1.0)


def test_bracket_needs_every_rate_below_to_hold() -> None:
    assert bracket([1, 2, 3], [1.0, 0.96, 0.5]) == (2, 3)
    assert bracket([1, 2, 3], [1.0, 0.9, 1.0]) == (1, 2)  # a later recovery does not count
    assert bracket([1, 2, 3], [0.5, 1.0, 1.0]) == (0.0, 1)
    assert bracket([1, 2, 3], [1.0, 1.0, 0.95]) == (3, None)
    assert bracket([1, 2], [None, 1.0]) == (0.0, 1)  # no arrivals measured: not held


def test_capacity_by_bisection_per_seed_and_the_exact_schema() -> None:
    calls: list = []
    res = measure(_fake({"off": 0.62, "taper": 0.81}, calls), ["off", "taper"], [0, 1], log=lambda _: None)
    doc = res["capacity"]
    assert set(doc) == {"policies"} and set(doc["policies"]) == {"off", "taper"}
    step = (cap.GRID[1] - cap.GRID[0]) / 2 ** cap.BISECT_STEPS  # bisection resolution at base 1.0
    for pol, c in (("off", 0.62), ("taper", 0.81)):
        v = doc["policies"][pol]
        assert set(v) == {"capacity_rps", "capacity_spread", "points"}
        assert [p["rate"] for p in v["points"]] == grid(1.0)
        assert all(set(p) == set(cap.POINT_KEYS) for p in v["points"])
        per_seed = res["detail"][pol]["capacity_per_seed"]
        for seed, got in per_seed.items():
            true = c - 0.05 * int(seed)
            assert true - step - 1e-9 <= got <= true  # within one bisection step below the truth
        assert v["capacity_spread"] == pytest.approx(max(per_seed.values()) - min(per_seed.values()))
    assert len(calls) == 2 * 2 * len(cap.GRID) + 2 * 2 * cap.BISECT_STEPS


def test_verdict_compares_taper_with_every_policy_and_the_best_fixed_one() -> None:
    doc = measure(_fake({"off": 0.62, "eager": 0.5, "taper": 0.81}), ["off", "eager", "taper"], [0],
                  log=lambda _: None)["capacity"]
    lines = verdict(doc)
    assert lines[0].startswith("capacity: taper") and "PASS" in lines[0]
    assert len(lines) == 1 + len(cap.GRID) and all("PASS" in x for x in lines[1:])
    doc["policies"]["off"]["points"][0]["goodput_tok_s"] *= 2  # off far ahead at the first rate
    doc["policies"]["off"]["capacity_rps"] = 0.9
    lines = verdict(doc)
    assert "FAIL (below off)" in lines[0] and "FAIL" in lines[1]


def test_fluid_bound_fills_steps_of_exactly_the_slo() -> None:
    m, slo = default_model(), 0.05
    trace = load_trace(AZURE)
    specs = compose(trace, stationary_schedule(trace, 1.0, 1800.0, 0), "multiverse", 0)
    lam = fluid_bound(m, slo, specs)
    out = sum(s.output_tokens for s in specs) / len(specs)
    prompt = sum(s.prompt_tokens for s in specs) / len(specs)
    rows = lam * out * slo  # decode rows per step at T = slo
    t = m.c0 + rows * (m.c_seq + m.c_ctx * (prompt + out / 2)) + lam * prompt * slo * m.c_tok
    assert t == pytest.approx(slo)
    assert 0.3 < lam < 2.0


def test_cli_rejects_what_no_engine_can_run(tmp_path: Path, capsys) -> None:
    assert cap.main(["--trace", str(AZURE), "--engine", "replay", "--url", "http://x", "--out", str(tmp_path)]) == 2
    assert "one policy" in capsys.readouterr().err  # a running server has one policy
    assert cap.main(["--trace", str(AZURE), "--engine", "replay", "--out", str(tmp_path)]) == 2
    assert "needs --launch or --url" in capsys.readouterr().err
    assert cap.main(["--trace", str(AZURE), "--policies", "off,wide", "--out", str(tmp_path)]) == 2


def test_cli_on_the_simulator(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.setattr(cap, "GRID", (0.3, 1.3))
    monkeypatch.setattr(cap, "BISECT_STEPS", 1)
    monkeypatch.setattr(cap, "WARMUP_S", 30.0)
    monkeypatch.setattr(cap, "WINDOW_S", 60.0)
    monkeypatch.setattr(cap, "DRAIN_S", 60.0)
    rc = cap.main(["--trace", str(AZURE), "--policies", "off,eager,taper", "--seeds", "0", "--jobs", "1",
                   "--out", str(tmp_path)])
    assert rc == 0
    doc = json.loads((tmp_path / "capacity.json").read_text())
    assert list(doc) == ["policies"] and list(doc["policies"]) == ["off", "eager", "taper"]
    for v in doc["policies"].values():
        lo, hi = (p["attainment"] for p in v["points"])
        assert lo > hi and hi < 0.95  # 1.3x the fluid bound overloads every policy
        assert 0 <= v["capacity_rps"] < v["points"][1]["rate"]
    detail = json.loads((tmp_path / "capacity_detail.json").read_text())
    assert detail["config"]["fluid_bound_rps"] > 0 and detail["config"]["running_cap"] == 4096
    assert (tmp_path / "capacity.png").stat().st_size > 10_000
    assert "capacity: taper" in capsys.readouterr().out
