"""Server-side fork/join on a real SGLang server: one response per request, branches on the shared
radix prefix, schedule invariance against the client-side equivalent, streaming, faults, aborts.

The tiny model never writes tags itself: bench.structure_driver forces the skeleton while the free
text stays the model's own (greedy)."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request

import pytest
from transformers import AutoTokenizer

from bench import fork_oracle
from bench.structure_driver import request, spec
from branchwise.fork.grammars import parse
from branchwise.tools.launch import get_json, merged_state, post_json

ARGS = ("--branch-policy", "serial", "--enable-custom-logit-processor")
PROMPT = "the plan is"
IDLE_DEADLINE_S = 60.0


@pytest.fixture(scope="module")
def srv(servers):
    return servers.get(*ARGS)


@pytest.fixture(scope="module")
def tok(tiny_model):
    return AutoTokenizer.from_pretrained(tiny_model)


def gen(url: str, payload: dict) -> dict:
    return post_json(url + "/generate", payload, timeout=300)


def fork_report(url: str) -> dict:
    return merged_state(url)["branchwise_fork"]


def phases_of(url: str, rid: str) -> list[dict]:
    return [p for p in fork_report(url)["recent"] if p["parent"] == rid or p["parent"].startswith(rid + "/")]


def wait_idle(url: str) -> dict:
    """Poll until no KV is used and nothing is parked (aborted rows need one more step to free)."""
    deadline = time.monotonic() + IDLE_DEADLINE_S
    while True:
        load = get_json(url + "/v1/loads")["loads"][0]
        rep = fork_report(url)
        busy = (load["num_used_tokens"], load["num_running_reqs"], load["num_waiting_reqs"], rep["parked"],
                rep["live_branches"], rep["open_phases"])
        if not any(busy):
            return rep
        assert time.monotonic() < deadline, f"not idle after {IDLE_DEADLINE_S}s: {busy}"
        time.sleep(0.05)


def test_multiverse_fanout3_one_response_shared_prefix_invariant(srv, tok):
    prompt = tok.encode(PROMPT, add_special_tokens=False)
    sj = spec("multiverse", 3, [3, 6, 4])
    out = gen(srv.url, request(prompt, sj, grammar="multiverse", rid="mv3", max_new_tokens=300))
    assert out["meta_info"]["finish_reason"]["type"] == "stop"
    assert "branchwise_error" not in out["meta_info"]["finish_reason"]
    root = parse("multiverse", out["text"])
    (par,) = list(root.iter("Parallel"))
    paths = par.kids("Path")
    assert [p.label for p in paths] == ["1", "2", "3"]
    assert [p.text.split(":")[0].strip() for p in paths] == ["1", "2", "3"]  # canonical order
    assert len(par.kids("Conclusion")) == 1

    (ph,) = phases_of(srv.url, "mv3")
    assert ph["fanout"] == 3 and ph["reasons"] == ["tag", "tag", "tag"]
    # the branches' prefill reused the parent's KV: at least the shared prefix was a cache hit
    assert ph["shared_tokens"] >= ph["prefix_tokens"] - 1  # -1: non-overlap never fed the fork token
    assert all(c >= ph["shared_tokens"] for c in ph["cached_tokens"]), ph

    again = gen(srv.url, request(prompt, sj, grammar="multiverse", max_new_tokens=300))
    assert again["output_ids"] == out["output_ids"]
    bad = fork_oracle.check(lambda p: gen(srv.url, p), tok, prompt, out["output_ids"], sj, "multiverse")
    assert bad == []  # every branch and parent segment equals its serial client-side equivalent
    assert "Received output for" not in srv.log_path.read_text()  # no branch row reached the client
    wait_idle(srv.url)


def test_sprint_two_rounds_fanout2(srv, tok):
    prompt = tok.encode(PROMPT, add_special_tokens=False)
    sj = spec("sprint", 2, [5, 3], rounds=2)
    out = gen(srv.url, request(prompt, sj, grammar="sprint", rid="sp2", max_new_tokens=400))
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": tok.eos_token_id}
    root = parse("sprint", out["text"])
    assert [e.label for e in root.kids("Execution")] == ["1", "2", "1", "2"]
    assert len(root.kids("Plan")) == 2 and len(root.kids("Answer")) == 1
    rounds = phases_of(srv.url, "sp2")
    assert [p["phase"] for p in rounds] == ["sp2/p0", "sp2/p1"]
    assert rounds[1]["shared_tokens"] > rounds[0]["shared_tokens"]  # round 2 shares all of round 1
    assert all(c >= p["shared_tokens"] for p in rounds for c in p["cached_tokens"])
    bad = fork_oracle.check(lambda p: gen(srv.url, p), tok, prompt, out["output_ids"], sj, "sprint")
    assert bad == []
    wait_idle(srv.url)


def test_streaming_one_stream_whole_text(srv, tok):
    payload = request(PROMPT, spec("multiverse", 2, [4, 3]), grammar="multiverse", max_new_tokens=300)
    whole = gen(srv.url, payload)
    body = json.dumps(dict(payload, stream=True)).encode()
    http = urllib.request.Request(srv.url + "/generate", data=body, headers={"Content-Type": "application/json"})
    chunks = []
    with urllib.request.urlopen(http, timeout=300) as r:
        for line in r:
            line = line.decode().strip()
            if line.startswith("data:") and line != "data: [DONE]":
                chunks.append(json.loads(line[len("data:"):]))
    assert len(chunks) > 2
    assert len({c["meta_info"]["id"] for c in chunks}) == 1  # one stream, the client's own rid
    texts = [c["text"] for c in chunks]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:], strict=False))  # nothing taken back
    assert texts[-1] == whole["text"]
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "stop"
    wait_idle(srv.url)


FAULTS = {
    # name: (spec, grammar, max_new_tokens, expected finish type, substring of branchwise_error or None)
    "unclosed_parallel": (spec("multiverse", 2, [3], fault="unclosed"), "multiverse", 300, "stop",
                          "unclosed <Parallel> at end of stream"),
    "path_count_mismatch": (spec("multiverse", 2, [3], fault="extra_path"), "multiverse", 300, "stop",
                            "<Path> after <Conclusion>"),
    "exec_count_mismatch": (spec("sprint", 2, [3], fault="extra_exec"), "sprint", 300, "stop",
                            "more executions than tasks"),
    "branch_max_new_tokens": (spec("multiverse", 2, [60, 3]), "multiverse", 70, "length", None),
    "nesting_too_deep": (spec("multiverse", 1, [2], nest=4), "multiverse", 400, "stop",
                         "nested 4 deep exceeds max_depth 3"),
}


@pytest.mark.parametrize("name", list(FAULTS))
def test_faults_end_cleanly(srv, name):
    sj, grammar, max_new, finish, err = FAULTS[name]
    out = gen(srv.url, request(PROMPT, sj, grammar=grammar, rid=f"fault-{name}", max_new_tokens=max_new))
    fr = out["meta_info"]["finish_reason"]
    assert fr["type"] == finish, fr
    if err is None:
        assert "branchwise_error" not in fr
    else:
        assert err in fr["branchwise_error"], fr
    if name == "branch_max_new_tokens":  # the branch ran out of budget; the response is cut there
        assert fr["length"] == max_new and len(out["output_ids"]) == max_new
        (ph,) = phases_of(srv.url, f"fault-{name}")
        assert ph["reasons"] == ["length", "tag"]
    if name == "nesting_too_deep":  # three nested forks happened before the limit
        assert len(phases_of(srv.url, f"fault-{name}")) == 3
    wait_idle(srv.url)


def test_client_abort_mid_phase_frees_branches(srv):
    payload = request(PROMPT, spec("multiverse", 3, [1000]), grammar="multiverse", rid="abort-me",
                      max_new_tokens=1500)
    res: dict = {}
    th = threading.Thread(target=lambda: res.update(out=gen(srv.url, payload)), daemon=True)
    th.start()
    deadline = time.monotonic() + 120
    while not fork_report(srv.url)["parked"]:  # wait until the parent is parked, branches running
        assert th.is_alive() and time.monotonic() < deadline
        time.sleep(0.05)
    post_json(srv.url + "/abort_request", {"rid": "abort-me"})
    th.join(120)
    assert not th.is_alive()
    assert res["out"]["meta_info"]["finish_reason"]["type"] == "abort"
    rep = wait_idle(srv.url)
    assert rep["counters"]["parked_aborted"] >= 1


def test_request_without_grammar_stays_serial(srv):
    before = fork_report(srv.url)["counters"].get("forks", 0)
    out = gen(srv.url, request(PROMPT, spec("multiverse", 2, [3]), max_new_tokens=300))
    assert out["text"].count("<Path>") == 2  # the whole skeleton, written serially
    assert fork_report(srv.url)["counters"].get("forks", 0) == before


def test_invariance_cli_concurrent_vs_one_at_a_time(srv):
    """bench.invariance on one server: serial, client-fork and server-fork programs give the same
    greedy output run together and one at a time, and server forks equal their client-side
    equivalent. (The per-policy sweep, --launch, restarts servers and is a bench, not a test.)"""
    from bench import invariance

    assert invariance.main(["--url", srv.url, "--programs", "4"]) == 0


# ---- one client must not hurt the others: fork limits and --branch-grammar-clients deny

LIMITS_ARGS = (*ARGS, "--branch-grammar", "sprint", "--branch-grammar-clients", "deny",
               "--branch-max-branch-tokens", "7000")


def serial_with_error(url: str, payload: dict, needle: str, tag: str, count: int) -> dict:
    """The request ran serially (no new fork, the whole skeleton in its text) and says why."""
    before = fork_report(url)["counters"]
    out = gen(url, payload)
    fr = out["meta_info"]["finish_reason"]
    assert fr["type"] == "stop" and needle in fr.get("branchwise_error", ""), fr
    assert out["text"].count(tag) == count
    after = fork_report(url)["counters"]
    assert after.get("forks", 0) == before.get("forks", 0)
    assert after["over_limit_forks"] == before.get("over_limit_forks", 0) + 1
    wait_idle(url)
    return out


def test_fork_over_max_fanout_runs_serially(srv):
    payload = request(PROMPT, spec("multiverse", 17, [2]), grammar="multiverse", rid="wide", max_new_tokens=600)
    serial_with_error(srv.url, payload, "fork of 17 branches exceeds --branch-max-fanout 16", "<Path>", 17)
    assert phases_of(srv.url, "wide") == []
    ok = gen(srv.url, request(PROMPT, spec("multiverse", 16, [2]), grammar="multiverse", rid="wide16",
                              max_new_tokens=600))
    assert "branchwise_error" not in ok["meta_info"]["finish_reason"]
    assert [p["fanout"] for p in phases_of(srv.url, "wide16")] == [16]  # at the limit: forked
    wait_idle(srv.url)


def test_fork_over_branch_tokens_auto_kv_pool_runs_serially(srv):
    """auto: the KV pool (--max-total-tokens 16384 here); 9 branches of ~1990 tokens would claim more."""
    payload = request(PROMPT, spec("multiverse", 9, [2]), grammar="multiverse", max_new_tokens=2000)
    out = serial_with_error(srv.url, payload, "over --branch-max-branch-tokens ", "<Path>", 9)
    err = out["meta_info"]["finish_reason"]["branchwise_error"]
    assert "fork of 9 branches would grant" in err
    pool = fork_report(srv.url)["limits"]["max_branch_tokens"]  # resolved from the scheduler's pool
    assert err.endswith(f"--branch-max-branch-tokens {pool}; continued serially") and 16000 <= pool <= 16384


@pytest.fixture(scope="module")
def limits(servers):
    return servers.get(*LIMITS_ARGS)


def test_branch_tokens_limit_and_release_between_rounds(limits):
    # 4 x ~1990 tokens > 7000: serial
    serial_with_error(limits.url, request(PROMPT, spec("sprint", 4, [2]), max_new_tokens=2000),
                      "over --branch-max-branch-tokens 7000", "<Execution", 4)
    # 3 x ~1990 fit; round 2 forks after round 1's branches ended and gave their grants back
    # (without the release round 2 would need ~11900 tokens)
    out = gen(limits.url, request(PROMPT, spec("sprint", 3, [2], rounds=2), rid="rounds", max_new_tokens=2000))
    fr = out["meta_info"]["finish_reason"]
    assert fr["type"] == "stop" and "branchwise_error" not in fr, fr
    assert [p["fanout"] for p in phases_of(limits.url, "rounds")] == [3, 3]
    wait_idle(limits.url)


def test_grammar_clients_deny(limits):
    sj = spec("sprint", 2, [3])
    # a grammar the operator did not configure: HTTP 400, nothing runs
    with pytest.raises(urllib.error.HTTPError) as e:
        gen(limits.url, request(PROMPT, spec("multiverse", 2, [3]), grammar="multiverse", max_new_tokens=300))
    assert e.value.code == 400
    assert "--branch-grammar-clients deny" in e.value.read().decode()
    # the server's own grammar applies to every request; naming it, or opting out, is allowed
    before = fork_report(limits.url)["counters"].get("forks", 0)
    for grammar, forks in ((None, 1), ("sprint", 1), ("none", 0)):
        out = gen(limits.url, request(PROMPT, sj, grammar=grammar, max_new_tokens=300))
        assert "branchwise_error" not in out["meta_info"]["finish_reason"]
        assert out["text"].count("<Execution") == 2
        after = fork_report(limits.url)["counters"].get("forks", 0)
        assert after == before + forks, grammar
        before = after
    assert get_json(limits.url + "/health") == {}
    wait_idle(limits.url)
