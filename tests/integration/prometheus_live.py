"""A real Prometheus (Debian's `prometheus` binary) for the integration tests: it scrapes live servers
with a copy of bench/monitoring/prometheus.yaml (targets and scrape interval replaced), and the
Grafana dashboard's panel expressions are evaluated through its HTTP API, as Grafana would."""

from __future__ import annotations

import asyncio
import json
import math
import os
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from branchwise import client

ROOT = Path(__file__).resolve().parents[2]
MON = ROOT / "bench" / "monitoring"
DASHBOARD = MON / "grafana" / "dashboards" / "json" / "branchwise.json"
WAIT_S = 60.0  # a series that a working server exports shows within seconds of the load
WINDOW = "5m"  # $__rate_interval: rates over the whole test, whenever it is evaluated
# SGLang creates its request histograms at a server's first request; a rate needs a scraped sample
# before an increase, so `prime` makes and scrapes them before the load
CREATED_AT_FIRST_REQUEST = ("sglang:time_to_first_token_seconds_count", "sglang:inter_token_latency_seconds_count")
SAMPLING = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}


def binary() -> str:
    """The prometheus binary. Missing: a failure under CI (CI set), a skip that says how elsewhere."""
    path = shutil.which("prometheus")
    if path is None:
        msg = ("prometheus not found on PATH: `make test` installs Debian's package when run as root, "
               "or apt-get install prometheus")
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(msg)
        pytest.skip(msg)
    return path


@dataclass(frozen=True)
class Panel:
    row: str  # the title of the row the panel sits under
    title: str
    exprs: tuple[str, ...]


def panels() -> list[Panel]:
    """Every graph panel of the dashboard with its targets' expressions, in dashboard order."""
    out, row = [], ""
    for p in json.loads(DASHBOARD.read_text())["panels"]:
        if p["type"] == "row":
            row = p["title"]
        else:
            out.append(Panel(row, p["title"], tuple(t["expr"] for t in p["targets"])))
    return out


def worker_variable_query() -> str:
    """The series the dashboard's `worker` variable lists instances from (label_values(series, instance))."""
    (var,) = [v for v in json.loads(DASHBOARD.read_text())["templating"]["list"] if v["name"] == "worker"]
    query = var["query"]
    assert query.startswith("label_values(") and query.endswith(", instance)"), query
    return query[len("label_values("):-len(", instance)")]


def for_workers(expr: str, regex: str) -> str:
    """A panel expression as Grafana sends it with `worker` matching `regex` (".*": All)."""
    return expr.replace("$worker", regex).replace("$__rate_interval", WINDOW)


def for_instance(expr: str, instance: str) -> str:
    return for_workers(expr, instance.replace(".", "\\\\."))


def hostport(url: str) -> str:
    return urllib.parse.urlsplit(url).netloc


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def render_config(dest: Path, workers: list[str], router: str | None, interval: str = "1s") -> Path:
    """The repo's scrape config with these targets (host:port) and a short interval; a job whose
    target is not given here (the router's, in a one-server test) is left out."""
    cfg = yaml.safe_load((MON / "prometheus.yaml").read_text())
    cfg["global"]["scrape_interval"] = cfg["global"]["evaluation_interval"] = interval
    targets = {"branchwise-workers": workers, "smg-router": [router] if router else []}
    jobs = []
    for job in cfg["scrape_configs"]:
        assert job["job_name"] in targets, f"a scrape job the test does not know: {job['job_name']}"
        if targets[job["job_name"]]:
            job["static_configs"] = [{"targets": targets[job["job_name"]]}]
            jobs.append(job)
    cfg["scrape_configs"] = jobs
    dest.write_text(yaml.safe_dump(cfg))
    return dest


@dataclass
class Prometheus:
    """prometheus on a free port with its own storage under `workdir`; a context manager."""

    workdir: Path
    workers: list[str]  # host:port
    router: str | None = None
    port: int = field(default_factory=_free_port)
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> Prometheus:
        config = render_config(self.workdir / "prometheus.yaml", self.workers, self.router)
        self.log = self.workdir / "prometheus.log"
        with self.log.open("wb") as log:
            self.proc = subprocess.Popen(
                [binary(), f"--config.file={config}", f"--storage.tsdb.path={self.workdir / 'data'}",
                 f"--web.listen-address=127.0.0.1:{self.port}"], stdout=log, stderr=subprocess.STDOUT)
        self.wait(lambda: self._get("/-/ready") is not None, "prometheus ready")
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def _get(self, path: str) -> Any:
        try:
            with urllib.request.urlopen(self.url + path, timeout=5) as r:
                body = r.read().decode()
        except OSError:
            return None
        return json.loads(body) if path.startswith("/api/") else body

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant query's vector (an API error fails: a dashboard expression must parse)."""
        got = self._get("/api/v1/query?" + urllib.parse.urlencode({"query": expr}))
        assert got is not None and got["status"] == "success", (expr, got)
        return got["data"]["result"]

    def values(self, expr: str) -> list[float]:
        return [float(sample["value"][1]) for sample in self.query(expr)]

    def targets_up(self) -> set[str]:
        got = self._get("/api/v1/targets") or {"data": {"activeTargets": []}}
        return {t["labels"]["instance"] for t in got["data"]["activeTargets"] if t["health"] == "up"}

    def wait(self, ready: Any, what: str, timeout_s: float = WAIT_S) -> None:
        """Poll a condition until it holds; past the deadline, fail with what was awaited."""
        deadline = time.monotonic() + timeout_s
        while not ready():
            if self.proc is not None and self.proc.poll() is not None:
                pytest.fail(f"prometheus exited ({self.proc.returncode}): {self.log.read_text()[-2000:]}")
            if time.monotonic() > deadline:
                pytest.fail(f"not within {timeout_s:.0f} s: {what}")
            time.sleep(0.25)

    def wait_live(self, exprs: list[str]) -> dict[str, list[float]]:
        """Wait until every expression returns a non-empty vector with a number in it (not NaN: a
        ratio or quantile over series that never moved); the values of each."""
        got: dict[str, list[float]] = {}

        def live() -> bool:
            for expr in exprs:
                if expr not in got or not any(math.isfinite(v) for v in got[expr]):
                    got[expr] = self.values(expr)
            return all(any(math.isfinite(v) for v in got[e]) for e in exprs)

        try:
            self.wait(live, "every expression live")
        except pytest.fail.Exception:
            dead = {e: got.get(e) for e in exprs if not any(math.isfinite(v) for v in got.get(e, []))}
            pytest.fail(f"dashboard expressions empty or NaN after {WAIT_S:.0f} s: {dead}")
        return got


async def streamed(url: str, fanout: int) -> None:
    """A streamed client phase and a streamed serial request: SGLang observes inter-token latency
    per streamed chunk only."""
    await asyncio.gather(client.fork(url, [f"stream branch {i}:" for i in range(fanout)], SAMPLING, stream=True),
                         client.generate(url, "stream serial:", SAMPLING, stream=True))


def prime(prom: Prometheus, urls: list[str]) -> None:
    """One streamed request per server, then wait until Prometheus holds its request histograms."""
    async def warm_up() -> None:
        await asyncio.gather(*(client.generate(url, "warm up:", dict(SAMPLING, max_new_tokens=4), stream=True)
                               for url in urls))

    asyncio.run(warm_up())
    prom.wait(lambda: all(prom.values(f'{name}{{instance="{hostport(url)}"}}') for url in urls
                          for name in CREATED_AT_FIRST_REQUEST), "the request histograms scraped")
