"""branchwise.launch without servers: merging several schedulers' reports, and the router flags."""

from __future__ import annotations

import re
from pathlib import Path

from branchwise.launch import ROUTER_ARGS, merge_reports

ROOT = Path(__file__).resolve().parents[2]


def test_merge_sums_counts_joins_lists_and_keeps_settings():
    a = {"config": {"branch_max_fanout": 16}, "pid": 11, "dp_rank": 0, "counters": {"branch_requests": 3},
         "taper": {"admitted": 1, "candidates": 4, "admission_rate": 0.25, "planner_ms_mean": 1.0,
                   "last_budget_s": None, "policy": "taper"},
         "recent": [{"parent": "a"}], "phase_rows": {"p": 4}, "enabled": True, "disabled_reason": None}
    b = {"config": {"branch_max_fanout": 16}, "pid": 12, "dp_rank": 1, "counters": {"branch_requests": 5, "x": 1},
         "taper": {"admitted": 3, "candidates": 4, "admission_rate": 0.75, "planner_ms_mean": 3.0,
                   "last_budget_s": 0.02, "policy": "taper"},
         "recent": [{"parent": "b"}], "phase_rows": {"p": 1, "q": 2}, "enabled": True, "disabled_reason": "why"}
    m = merge_reports([a, b])
    assert m["config"] == {"branch_max_fanout": 16} and (m["pid"], m["dp_rank"]) == (11, 0)  # kept, not summed
    assert m["counters"] == {"branch_requests": 8, "x": 1}
    assert m["taper"]["admission_rate"] == 0.5  # recomputed from the summed counts, not averaged
    assert m["taper"]["planner_ms_mean"] == 2.0 and m["taper"]["last_budget_s"] == 0.02  # a None is no value
    assert m["taper"]["policy"] == "taper" and m["enabled"] is True and m["disabled_reason"] == "why"
    assert m["recent"] == [{"parent": "a"}, {"parent": "b"}] and m["phase_rows"] == {"p": 5, "q": 2}
    assert merge_reports([a]) == a and merge_reports([{"pid": None}]) == {"pid": None}
    idle = {"admitted": 0, "candidates": 0, "admission_rate": 1.0}  # nothing offered: nothing refused
    assert merge_reports([idle, idle]) == idle


def test_makefile_serve_cluster_uses_the_router_flags_of_launch():
    text = (ROOT / "Makefile").read_text().replace("\\\n", " ")
    (line,) = re.findall(r"^ROUTER_ARGS := (.*)$", text, re.M)
    assert tuple(line.split()) == ROUTER_ARGS
    assert "$(ROUTER_ARGS)" in text and "-m smg launch" in text


def test_cluster_rows_per_scheduler_and_split_phases():
    from bench.cluster import cluster_rows

    def st(worker: str, rank: int, branch: int, phases: dict[str, int]) -> dict:
        return {"worker": worker, "branchwise": {"dp_rank": rank, "counters": {"branch_requests": branch},
                                                 "taper": {"rows_deferred": 2}, "phase_rows": phases}}

    rows, phases = cluster_rows([st("w1", 0, 4, {"a": 4}), st("w2", 0, 6, {"b": 4, "c": 1}),
                                 st("w2", 1, 1, {"c": 1}), {"worker": "w3"}])
    assert list(rows) == ["w1 dp=0", "w2 dp=0", "w2 dp=1", "cluster"]
    assert rows["cluster"]["branch_req"] == 11 and rows["cluster"]["deferred"] == 6
    assert rows["w2 dp=0"]["phases"] == 2 and rows["cluster"]["phases"] == 3
    assert phases == {"phases": 3, "split": 1}  # phase c reached two ranks
