"""bench/monitoring's files on their own (tests/integration/test_prometheus.py and test_router.py run
them against a live Prometheus): the scrape config targets make serve-cluster's ports and restores
the exported names, and every dashboard expression names a series that is exported (Branchwise's
from metrics.py, SGLang's from the installed sglang, smg's from the installed smg)."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
MON = ROOT / "bench" / "monitoring"
SERIES = re.compile(r"\b(?:branchwise:|sglang:|smg_)[a-z_:]+")
SUFFIXES = {"Counter": ("_total",), "Gauge": ("",), "Histogram": ("_bucket", "_sum", "_count")}


def make_default(name: str) -> str:
    (value,) = re.findall(rf"^{name} \?= (.*)$", (ROOT / "Makefile").read_text(), re.M)
    return value


def branchwise_series() -> set[str]:
    src = (ROOT / "overlay" / "branchwise" / "metrics.py").read_text()
    found = re.findall(r'labeled\((Counter|Gauge|Histogram), "(branchwise:[a-z_]+)"', src)
    assert len(found) >= 8
    return {name + sfx for kind, name in found for sfx in SUFFIXES[kind]}


def unexported(names: set[str]) -> list[str]:
    def package(name: str) -> Path:  # found, not imported (importing sglang takes seconds)
        return Path(importlib.util.find_spec(name).origin).parent

    sgl_src = (package("sglang") / "srt" / "observability" / "metrics_collector.py").read_text()
    smg_lib = next(package("smg").glob("smg_rs*.so")).read_bytes()  # smg is Rust: its names

    def exported(name: str) -> bool:
        if name.startswith("branchwise:"):
            return name in branchwise_series()
        if name.startswith("sglang:"):
            return f'name="{re.sub(r"_(bucket|sum|count|total)$", "", name)}"' in sgl_src
        return name.encode() in smg_lib

    return sorted(n for n in names if not exported(n))


def dashboard() -> dict:
    return json.loads((MON / "grafana" / "dashboards" / "json" / "branchwise.json").read_text())


def test_prometheus_scrapes_the_workers_and_the_router_of_serve_cluster():
    cfg = yaml.safe_load((MON / "prometheus.yaml").read_text())
    jobs = {j["job_name"]: [t for sc in j["static_configs"] for t in sc["targets"]] for j in cfg["scrape_configs"]}
    host = make_default("HOST")
    assert jobs["branchwise-workers"] == [f"{host}:{p}" for p in make_default("WORKER_PORTS").split()]
    assert jobs["smg-router"] == [f"{host}:{make_default('ROUTER_METRICS_PORT')}"]
    assert cfg["global"]["scrape_interval"]


def test_every_dashboard_expression_names_exported_series():
    targets = [t for p in dashboard()["panels"] if p["type"] != "row" for t in p["targets"]]
    exprs = [t["expr"] for t in targets]
    names = {n for e in exprs for n in SERIES.findall(e)}
    assert unexported(names) == []
    assert {"branchwise:realized_step_seconds_bucket", "branchwise:admission_rate", "branchwise:deferred_branches_total",
            "branchwise:branch_requests_total"} <= names  # step latency, admission, deferred rows, phases
    assert all(SERIES.search(e) and e.count("(") == e.count(")") for e in exprs)
    per_rank = [t["legendFormat"] for t in targets if "branchwise:" in t["expr"] and t["legendFormat"] != "cluster"]
    assert per_rank and all("{{instance}}" in f and "{{dp_rank}}" in f for f in per_rank)  # per worker, per rank


def test_dashboard_layout_and_provisioning_fit_together():
    dash = dashboard()
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    for p in dash["panels"]:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24 and g["h"] > 0
    ds = yaml.safe_load((MON / "grafana" / "datasources" / "datasource.yaml").read_text())["datasources"][0]
    uids = {t["datasource"]["uid"] for p in dash["panels"] if p["type"] != "row" for t in p["targets"]}
    assert uids == {ds["uid"]} and ds["type"] == "prometheus"
    compose = yaml.safe_load((MON / "docker-compose.yaml").read_text())
    for svc in compose["services"].values():
        for vol in svc.get("volumes", []):
            assert (MON / vol.split(":")[0]).exists(), vol
    provider = yaml.safe_load((MON / "grafana" / "dashboards" / "config" / "dashboard.yaml").read_text())
    mounts = [v.split(":")[1] for v in compose["services"]["grafana"]["volumes"]]
    assert provider["providers"][0]["options"]["path"] in mounts


def test_the_scrape_config_restores_the_names_prometheus_2_gets_escaped():
    """prometheus_client answers Prometheus 2's OpenMetrics request with ':' written as '_'; the
    relabel rule (a fully anchored RE2 regex, as Prometheus applies it) maps them back, and leaves
    intact names and smg's own alone."""
    cfg = yaml.safe_load((MON / "prometheus.yaml").read_text())
    (job,) = [j for j in cfg["scrape_configs"] if j["job_name"] == "branchwise-workers"]
    (rule,) = job["metric_relabel_configs"]
    assert rule["source_labels"] == ["__name__"] and rule["target_label"] == "__name__"

    def relabel(name: str) -> str:
        m = re.fullmatch(rule["regex"], name)
        return re.sub(r"\$(\d)", lambda g: m.group(int(g.group(1))), rule["replacement"]) if m else name

    assert relabel("branchwise_slo_met_total") == "branchwise:slo_met_total"
    assert relabel("sglang_time_to_first_token_seconds_bucket") == "sglang:time_to_first_token_seconds_bucket"
    for intact in ("branchwise:slo_met_total", "sglang:num_running_reqs", "smg_worker_requests_total", "up"):
        assert relabel(intact) == intact
