"""bench.replay against a real TAPER server: a short trace replay completes and writes results.json."""

from __future__ import annotations

import json

from bench import point, replay
from bench.programs import Scaling
from bench.workload import DEFAULT_TRACE, load_trace


def test_short_replay_against_taper_server(servers, tmp_path):
    srv = servers.get("--branch-policy", "taper")
    out = tmp_path / "replay"
    rc = replay.main(["--url", srv.url, "--schedule", "rate:3", "--duration-s", "20", "--rate-scale", "1",
                      "--slo-tpot-ms", "50", "--output-scale", "0.05", "--max-stage-tokens", "8",
                      "--max-prompt-tokens", "32", "--drain-s", "240", "--out", str(out), "--no-progress"])
    assert rc == 0
    doc = json.loads((out / "results.json").read_text())
    assert doc["partial"] is False and set(doc["policies"]) == {"taper"}  # labelled by the server's policy
    r = doc["policies"]["taper"]
    assert {"goodput_tok_s", "raw_throughput_tok_s", "slo_attainment", "p99_tpot_serial_ms",
            "p99_tpot_parallel_ms", "admission_rate", "per_regime"} <= set(r)
    run = r["run"]
    assert run["programs"] == run["started"] == run["finished"] > 0 and run["failed"] == 0
    assert run["error"] is None and run["warning"] is None
    assert doc["config"]["workload"]["pdr"] > 0 and r["p99_tpot_parallel_ms"] is not None  # forks ran
    assert run["server"]["policy"] == "taper" and run["server"]["candidates"] > 0
    assert r["raw_throughput_tok_s"] > 0 and 0.0 <= r["slo_attainment"] <= 1.0
    records = json.loads((out / "records.json").read_text())["taper"]["programs"]
    assert len(records) == run["programs"] and all(x["finished"] for x in records)
    assert (out / "figure2.png").exists()


def test_one_live_point_leaves_the_server_idle_and_flushed(servers):
    """bench.point.run_point (what bench.sweep and bench.capacity's replay engine run) on a real server:
    every arrival is counted, the cache is flushed before and the server is idle after."""
    srv = servers.get("--branch-policy", "taper")
    setup = point.PointSetup(load_trace(DEFAULT_TRACE), 50.0, Scaling(output_scale=0.05, max_stage_tokens=8),
                             duration_s=8.0, drain_s=120.0, poll_s=0)
    m, run = point.run_point(srv.url, "taper", 2.0, 0, setup)
    assert m["cache_flushed"] and m["left_idle"] and m["error"] is None
    assert m["requests"] == len(run.outcomes) > 5 and m["finished_frac"] == 1.0
    assert 0.0 <= m["attainment"] <= 1.0 and m["goodput_delivered_tok_s"] <= m["raw_throughput_tok_s"]
    assert m["goodput_tok_s"] > 0 and m["decomp_e2e_p50_s"] > 0 and m["decomp_finished_frac"] == 1.0
    assert m["p99_ttft_s"] > 0 and m["server"]["policy"] == "taper"
