"""bench.replay against a real TAPER server: a short trace replay completes and writes results.json."""

from __future__ import annotations

import json

from bench import replay


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
