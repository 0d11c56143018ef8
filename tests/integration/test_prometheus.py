"""A live Prometheus scrapes a `stock` and a `taper` server with the repo's scrape config, and after a
fork/join load every series the Grafana dashboard's Branchwise and SGLang panels use is there with a
value for each of them (under stock, all but TAPER's planner's): the expressions are the dashboard's
own, evaluated through Prometheus's HTTP API. The smg router's panels run in test_router.py."""

from __future__ import annotations

import asyncio
import threading

import pytest

from frontends import fork_join
from tests.integration import prometheus_live as pl

SLO_MS = 40  # stock's: its step histogram's bounds follow it (1.1 x 40 ms is a bound)
POLICIES = {"stock": ("--branch-policy", "stock", "--enable-metrics", "--branch-slo-tpot-ms", str(SLO_MS)),
            "taper": ("--branch-policy", "taper", "--enable-metrics")}
PROGRAMS, FANOUT = 3, 4  # fork/join programs: head -> 4 branches -> tail
STREAMED_FANOUT = 3  # one streamed client phase beside them, and one streamed serial request
ROWS = ("Branchwise per worker and DP rank", "SGLang per worker and DP rank")
# TAPER's planner: its predicted step, slack budget and planner time. Under stock nothing is planned,
# and these series are absent rather than a made-up value.
PLANNER = ("branchwise:predicted_step_seconds", "branchwise:slack_budget_seconds", "branchwise:planner_seconds_mean")


def load(url: str, errors: list[BaseException]) -> None:
    try:
        fork_join.run_batch(url, PROGRAMS, fanout=FANOUT, head_tokens=12, branch_tokens=16, tail_tokens=8, seed=700)
        asyncio.run(pl.streamed(url, STREAMED_FANOUT))
    except BaseException as e:  # noqa: BLE001 - reported by the fixture's thread join
        errors.append(e)


@pytest.fixture(scope="module")
def scraped(servers, tmp_path_factory):
    pl.binary()  # before any server starts: fail (CI) or skip here
    live = {name: servers.get(*args) for name, args in POLICIES.items()}
    instances = {name: pl.hostport(server.url) for name, server in live.items()}
    with pl.Prometheus(tmp_path_factory.mktemp("prometheus"), list(instances.values())) as prom:
        prom.wait(lambda: prom.targets_up() == set(instances.values()), "both servers scraped (target up)")
        pl.prime(prom, [server.url for server in live.values()])
        errors: list[BaseException] = []
        threads = [threading.Thread(target=load, args=(server.url, errors)) for server in live.values()]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        yield prom, instances


@pytest.mark.parametrize("policy", POLICIES)
def test_every_dashboard_series_is_live(scraped, policy):
    prom, instances = scraped
    exprs = [pl.for_instance(e, instances[policy]) for p in pl.panels() if p.row in ROWS for e in p.exprs]
    assert len(exprs) >= 20  # the rows are found: titles unchanged
    planned = [e for e in exprs if any(name in e for name in PLANNER)]
    assert len(planned) == len(PLANNER)
    prom.wait_live(exprs if policy != "stock" else [e for e in exprs if e not in planned])
    if policy == "stock":
        assert all(prom.query(e) == [] for e in planned)
    listed = {s["metric"]["instance"] for s in prom.query(pl.worker_variable_query())}
    assert set(instances.values()) <= listed  # the dashboard's worker menu lists the server


@pytest.mark.parametrize("policy", POLICIES)
def test_branch_requests_phases_and_slo_verdicts_are_counted(scraped, policy):
    """Under every policy: each branch request and phase once, a TPOT SLO verdict for every phase
    and for the serial requests (the programs' heads and tails, the streamed serial one)."""
    prom, instances = scraped
    branches, phases = PROGRAMS * FANOUT + STREAMED_FANOUT, PROGRAMS + 1

    def total(name: str, **labels: str) -> float:
        sel = ",".join(f'{k}="{v}"' for k, v in {"instance": instances[policy], **labels}.items())
        return sum(prom.values(f"{name}{{{sel}}}"))

    def counted() -> bool:
        verdicts = {k: total("branchwise:slo_met_total", kind=k) + total("branchwise:slo_missed_total", kind=k)
                    for k in ("phase", "request")}
        return (total("branchwise:branch_requests_total") == branches and total("branchwise:phases_total") == phases
                and verdicts["phase"] == phases and verdicts["request"] >= 2 * PROGRAMS + 1)

    prom.wait(counted, f"{branches} branch requests, {phases} phases and their verdicts scraped ({policy})")
    assert total("branchwise:realized_step_seconds_count") > 0
    assert total("branchwise:candidate_branches_total") > 0  # branch rows decoded side by side
    if policy == "stock":  # SGLang's schedule: every ready row runs
        assert total("branchwise:admitted_branches_total") == total("branchwise:candidate_branches_total")
        assert total("branchwise:deferred_branches_total") == 0


def test_the_step_histogram_is_dense_around_the_configured_slo(scraped):
    prom, instances = scraped
    les = {s["metric"]["le"] for s in prom.query(
        f'branchwise:realized_step_seconds_bucket{{instance="{instances["stock"]}"}}')}
    assert {"0.004", "0.036", "0.04", "0.044", "0.06", "0.4"} <= les, sorted(les, key=float)
