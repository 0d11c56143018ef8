"""Data parallelism (`--dp-size 2`) on a real SGLang server: client-side phases under taper keep to
one DP rank (dp_dispatch), give the outputs of `--dp-size 1`, and their branch prompts hit the
prefix cache as on one rank; /server_info and /metrics report Branchwise per DP rank."""

from __future__ import annotations

import asyncio
import urllib.request

import pytest

from branchwise import client, frontend_hook
from branchwise.tools.launch import branchwise_reports, cpu_env, post_json
from frontends import fork_join
from frontends.common import prefix_hits

POLICY = ("--branch-policy", "taper", "--enable-metrics")
PROGRAMS, FANOUT = 8, 4
DP_ENV = cpu_env(2)  # two single-threaded scheduler processes, one core each (docs/design/scale-out.md)


def run_programs(url: str) -> list[fork_join.ForkJoinResult]:
    return fork_join.run_batch(url, PROGRAMS, fanout=FANOUT, head_tokens=24, branch_tokens=24,
                               tail_tokens=8, seed=300)


def client_phases(url: str) -> list[list[str]]:
    """Client-side phases (branchwise.client.fork: stamped siblings sent together), one per prompt."""
    async def go() -> list[list[client.Generation]]:
        prompts = [f"phase {k}: the list of steps is" for k in range(4)]
        return await asyncio.gather(*[
            client.fork(url, [f"{p} branch {i}:" for i in range(FANOUT)],
                        {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}) for p in prompts])
    return [[g.text for g in phase] for phase in asyncio.run(go())]


@pytest.fixture(scope="module")
def runs(servers) -> dict[str, dict]:
    frontend_hook.install()
    out: dict[str, dict] = {}
    for name, args, env in (("dp1", POLICY, {}), ("dp2", (*POLICY, "--dp-size", "2"), DP_ENV)):
        server = servers.get(*args, env=env)
        results = run_programs(server.url)
        out[name] = {"url": server.url, "results": results, "hits": prefix_hits(server.url, results),
                     "phases": client_phases(server.url), "reports": branchwise_reports(server.url),
                     "metrics": urllib.request.urlopen(server.url + "/metrics", timeout=30).read().decode()}
        if name == "dp1":
            servers.stop(server)  # two servers at once would each get half the machine
    return out


def test_outputs_equal_dp_size_1(runs):
    one, two = runs["dp1"], runs["dp2"]
    assert [r.text for r in two["results"]] == [r.text for r in one["results"]]
    assert [r.branch_texts for r in two["results"]] == [r.branch_texts for r in one["results"]]
    assert two["phases"] == one["phases"]


def test_every_phase_runs_on_one_rank(runs):
    reports = runs["dp2"]["reports"]
    assert sorted(reports) == [0, 1]
    seen: dict[str, list[int]] = {}
    for rank, rep in reports.items():
        for phase, rows in rep["phase_rows"].items():
            seen.setdefault(phase, []).append(rank)
            assert rows == FANOUT, (phase, rank, rows)  # all of the phase's rows on this rank
    assert len(seen) == PROGRAMS + 4
    assert all(len(ranks) == 1 for ranks in seen.values()), seen
    # the same placement as the responses say (meta_info.dp_rank of every branch)
    assert fork_join.one_rank_phases(runs["dp2"]["results"]) == (PROGRAMS, PROGRAMS)
    total = sum(rep["counters"].get("branch_requests", 0) for rep in reports.values())
    assert total == (PROGRAMS + 4) * FANOUT


def test_branch_prompts_hit_the_prefix_cache_as_on_one_rank(runs):
    hits1, total1 = runs["dp1"]["hits"]
    hits2, total2 = runs["dp2"]["hits"]
    assert total1 == total2 == PROGRAMS * FANOUT
    assert hits2 == hits1 == total1


def test_metrics_carry_the_dp_rank(runs):
    text = runs["dp2"]["metrics"]
    for rank in (0, 1):
        assert f'branchwise:candidate_branches_total{{dp_rank="{rank}"}}' in text
    assert 'branchwise:candidate_branches_total{dp_rank="0"}' in runs["dp1"]["metrics"]


def test_n_samples_of_a_request_share_one_rank_and_its_cached_prompt(servers, runs):
    """sampling_params.n = 4: the prefix pass and the 4 samples of each request go to one DP rank
    (n_sampling.py gives them one routing key), so every sample's prompt comes from the prefix
    cache (all but its last token, which SGLang always recomputes)."""
    url = servers.get(*POLICY, "--dp-size", "2", env=DP_ENV).url  # the dp2 server of `runs`
    sp = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True, "n": FANOUT}
    outs = {k: post_json(url + "/generate", {"text": f"n-sample {k}: the list of steps is", "rid": f"dpn{k}",
                                           "sampling_params": sp}) for k in range(6)}
    for k, samples in outs.items():
        assert len(samples) == FANOUT
        assert len({o["meta_info"]["dp_rank"] for o in samples}) == 1, k
        assert all(o["meta_info"]["cached_tokens"] == o["meta_info"]["prompt_tokens"] - 1 for o in samples), k
    reports = branchwise_reports(url)
    for k in outs:
        assert sorted(rep["phase_rows"].get(f"dpn{k}_0", 0) for rep in reports.values()) == [0, FANOUT], k
