"""Two Branchwise servers behind an smg router (branchwise.tools.launch.LocalRouter, the flags of make
serve-cluster): unchanged frontend fork/join programs give the outputs of one server, every branch
request reaches a worker stamped, each phase's rows are on one worker, the fork prefix is cached
where its branches run, n > 1 and a malformed stamp pass through unchanged."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from collections import defaultdict

import pytest

from branchwise import client, frontend_hook
from branchwise.tools.launch import (
    LocalRouter,
    LocalServer,
    branchwise_report,
    get_json,
    post_json,
    router_workers,
    scheduler_states,
)
from frontends import fork_join
from frontends.common import prefix_hits
from tests.integration import prometheus_live as pl

WORKER_ARGS = ["--branch-policy", "taper", "--enable-metrics"]
PROGRAMS, FANOUT = 4, 4


def run_programs(url: str) -> list[fork_join.ForkJoinResult]:
    return fork_join.run_batch(url, PROGRAMS, fanout=FANOUT, head_tokens=16, branch_tokens=16,
                               tail_tokens=8, seed=500)


def phase_rows(url: str) -> dict[str, dict[str, int]]:
    """Client phase -> {worker: rows it created there}, over every scheduler behind the router."""
    out: dict[str, dict[str, int]] = defaultdict(dict)
    for st in scheduler_states(url):
        for phase, rows in st["branchwise"]["phase_rows"].items():
            out[phase][st["worker"]] = out[phase].get(st["worker"], 0) + rows
    return dict(out)


@pytest.fixture(scope="module")
def cluster(servers):
    servers.close()  # the box holds two servers: these two
    frontend_hook.install()
    workers = [LocalServer(servers.model, WORKER_ARGS) for _ in range(2)]
    try:
        for w in workers:
            w.start()
        with LocalRouter([w.url for w in workers]) as router:
            yield router, workers
    finally:
        for w in workers:
            w.stop()


@pytest.fixture(scope="module")
def runs(cluster) -> dict:
    router, workers = cluster
    before = branchwise_report(router.url)["counters"].get("branch_requests", 0)
    routed = run_programs(router.url)
    out = {"routed": routed, "hits": prefix_hits(router.url, routed), "phase_rows": phase_rows(router.url),
           "branch_requests": branchwise_report(router.url)["counters"]["branch_requests"] - before}
    out["one"] = run_programs(workers[0].url)  # one server, after: its phases are not counted above
    return out


def test_router_lists_its_workers(cluster):
    router, workers = cluster
    assert sorted(router_workers(router.url)) == sorted(w.url for w in workers)
    assert router_workers(workers[0].url) is None  # a server is no router
    assert {st["worker"] for st in scheduler_states(router.url)} == {w.url for w in workers}


def test_programs_through_the_router_match_one_server(runs):
    assert [(r.text, r.branch_texts) for r in runs["routed"]] == [(r.text, r.branch_texts) for r in runs["one"]]
    assert runs["hits"] == (PROGRAMS * FANOUT, PROGRAMS * FANOUT)  # the prefix ran where its branches did


def test_workers_count_every_branch_and_keep_each_phase_on_one(runs):
    assert runs["branch_requests"] == PROGRAMS * FANOUT
    phases = runs["phase_rows"]
    assert len(phases) == PROGRAMS, phases
    assert all(len(per_worker) == 1 and sum(per_worker.values()) == FANOUT for per_worker in phases.values()), phases


def test_engine_metrics_carry_each_workers_branchwise_series(cluster, runs):
    router, workers = cluster
    text = urllib.request.urlopen(router.url + "/engine_metrics", timeout=30).read().decode()
    for w in workers:
        assert f'branchwise:realized_step_seconds_count{{dp_rank="0",worker_addr="{w.url}"}}' in text


def test_prometheus_reads_every_dashboard_panel_of_the_cluster(cluster, tmp_path):
    """Debian's prometheus with the repo's scrape config on these workers and the router's
    --prometheus-port: with the worker menu on All, every expression of the dashboard, the smg
    router's panels included, returns a number after programs through the router."""
    router, workers = cluster
    hosts = [pl.hostport(w.url) for w in workers]
    with pl.Prometheus(tmp_path, hosts, router=f"127.0.0.1:{router.metrics_port}") as prom:
        prom.wait(lambda: len(prom.targets_up()) == 3, "both workers and the router scraped (targets up)")
        pl.prime(prom, [w.url for w in workers])
        run_programs(router.url)
        asyncio.run(pl.streamed(router.url, FANOUT))
        prom.wait_live([pl.for_workers(e, ".*") for p in pl.panels() for e in p.exprs])
        routed = {s["metric"]["worker"] for s in prom.query("smg_worker_requests_total")}
        assert {w.url for w in workers} <= routed, routed  # the router's series name its workers


def test_n_samples_reach_one_worker_whole(cluster):
    router, _ = cluster
    out = post_json(router.url + "/generate", {"text": "count:", "sampling_params": {
        "n": 3, "max_new_tokens": 4, "temperature": 0.8, "ignore_eos": True}})
    assert isinstance(out, list) and len(out) == 3 and all(o["meta_info"]["completion_tokens"] == 4 for o in out)


def test_malformed_stamp_through_the_router_is_a_client_error(cluster):
    router, _ = cluster
    with pytest.raises(client.GenerateError) as e:
        client.generate_sync(router.url, "x", {"max_new_tokens": 2, "custom_params": {
            "branchwise": {"phase": "p", "branch": 5, "fanout": 2}}}, check=False)
    assert 400 <= e.value.status < 500 and "branch" in e.value.message
    body = json.dumps({"text": "x", "sampling_params": {"custom_params": {"branchwise": {"fanout": "four"}}}})
    req = urllib.request.Request(router.url + "/generate", data=body.encode(),
                                 headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as raw:
        urllib.request.urlopen(req, timeout=60)
    assert 400 <= raw.value.code < 500
    assert get_json(router.url + "/workers")["total"] == 2  # a client's error takes no worker out
