"""Client-side fork/join on a real SGLang server: stamps reach the scheduler, branch prompts hit the
parent's radix prefix, malformed stamps are rejected with HTTP 400."""

from __future__ import annotations

import pytest

from branchwise import client, frontend_hook
from branchwise.fork.grammars import parse
from branchwise.tools.launch import branchwise_report, get_json
from frontends import fork_join, multiverse, sprint
from frontends.common import prefix_hits, sgl

POLICY = ("--branch-policy", "serial")  # one shared server config for the whole suite


@pytest.fixture(scope="module")
def url(servers) -> str:
    frontend_hook.install()
    return servers.get(*POLICY).url


def counters(url: str) -> dict[str, int]:
    return branchwise_report(url)["counters"]


@sgl.function
def plain_fork(s, question):  # unchanged SGLang frontend code: no Branchwise call anywhere
    s += question
    s += sgl.gen("head", max_tokens=8, temperature=0, ignore_eos=True)
    forks = s.fork(4)
    for i in range(4):
        forks[i] += f" step {i}:"
        forks[i] += sgl.gen("b", max_tokens=8, temperature=0, ignore_eos=True)
    forks.join()
    s += sgl.gen("tail", max_tokens=4, temperature=0, ignore_eos=True)
    return forks


def test_unchanged_program_stamps_every_branch(url):
    before = counters(url)
    state = plain_fork.run(question="the plan is to compute the sum of", backend=sgl.RuntimeEndpoint(url))
    assert state.error() is None
    after = counters(url)
    # head + prefix hint + 4 branches + tail reached the scheduler; exactly the 4 branches parsed as
    # branch requests (request_meta on the server), none rejected
    assert after["requests_created"] - before["requests_created"] == 7
    assert after["branch_requests"] - before.get("branch_requests", 0) == 4
    assert after.get("bad_requests", 0) == before.get("bad_requests", 0)
    rids = [f.get_meta_info("b")["id"] for f in state.ret_value.states]  # echoed by the server
    group = rids[0].split("/")[0]
    assert rids == [client.branch_rid(group, i) for i in range(4)]
    assert "/" not in state.get_meta_info("head")["id"] and "/" not in state.get_meta_info("tail")["id"]


def test_sixteen_programs_branch_prompts_hit_the_radix_cache(url, record_property):
    # 16 programs: gen 64 -> fork(4) x gen 64 -> join; stock SGLang measured separately (see report)
    results = fork_join.run_batch(url, 16, fanout=4, head_tokens=64, branch_tokens=64, tail_tokens=0, seed=100)
    hits, total = prefix_hits(url, results)
    record_property("hooked_prefix_hit_rate", hits / total)
    print(f"hooked: {hits}/{total} branch prompts with the whole fork prefix cached")
    assert total == 64 and hits / total >= 0.9
    for res in results:
        assert len(res.branch_texts) == 4 and res.text.startswith(res.fork_text)
        assert [r.completion_tokens for r in res.branches] == [64] * 4


def test_multiverse_and_sprint_branches_reuse_the_parent_prefix(url):
    mv = multiverse.run(url, paths=3, seed=7)
    sp = sprint.run(url, rounds=2, tasks=2, seed=8)
    for res, n in ((mv, 3), (sp, 4)):
        assert len(res.branches) == n
        assert prefix_hits(url, [res]) == (n, n)  # every branch prompt: whole parent prefix cached
        for r in res.branches:  # the prefix includes generated text, not only the question
            assert r.cached_tokens > res.requests[0].prompt_tokens
    par = next(parse("multiverse", mv.text[mv.text.index("<Think>"):]).iter("Parallel"))  # well formed
    assert [p.label for p in par.kids("Path")] == ["1", "2", "3"]
    assert "".join(f"<Path>\n{k + 1}: {p}\n</Path>\n" for k, p in enumerate(mv.paths)) in mv.text  # outline order
    gen = sp.text[sp.text.index("<Plan>"):]
    assert len(list(parse("sprint", gen).iter("Execution"))) == 4
    rids = [r.rid for r in sp.branches]
    assert len({r.rsplit("/", 2)[0] for r in rids}) == 2  # two rounds, two phases


def test_server_side_grammar_mode_returns_text(url):
    res = multiverse.run(url, mode="server", paths=2, think_tokens=4, outline_tokens=4, path_tokens=8,
                         conclusion_tokens=4, seed=3)
    assert res.mode == "server" and res.requests[0].completion_tokens > 0 and "<Think>" in res.text


def test_malformed_stamp_is_http_400_and_server_stays_healthy(url):
    before = counters(url)
    bad = {"max_new_tokens": 4, "custom_params": {"branchwise": {"phase": "g", "branch": 5, "fanout": 2}}}
    for stream in (False, True):
        with pytest.raises(client.GenerateError) as e:
            client.generate_sync(url, "hello", bad, stream=stream, check=False)
        assert e.value.status == 400
        assert "custom_params.branchwise.branch 5 must be < fanout 2" in e.value.message
    with pytest.raises(client.GenerateError, match="unknown custom_params.branchwise keys"):
        client.generate_sync(url, "hello", {"custom_params": {"branchwise": {"group": 1}}}, check=False)
    after = counters(url)  # refused in the HTTP server (validate.py): the scheduler never saw them
    for name in ("bad_requests", "requests_created"):
        assert after.get(name, 0) == before.get(name, 0)
    assert get_json(url + "/health") == {}
    ok = client.generate_sync(url, "hello", client.stamp_branch({"max_new_tokens": 3, "ignore_eos": True},
                                                                "g", 1, 2), rid="g/b1/0")
    assert ok.completion_tokens == 3 and ok.rid == "g/b1/0"
