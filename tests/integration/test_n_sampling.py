"""SGLang's own n > 1 samples as one phase (n_sampling.py) on a real server: stamped, counted,
regulated by taper with the outputs of the default (stock) server, streamed, aborted, validated.

Two servers, both with --parallel-sampling --random-seed 0, so an unseeded sample's seed is a
function of its rid (derived from the client's rid) and sampled outputs compare across servers:
  stock  the default policy: SGLang's own schedule (the reference, and the default's counting)
  taper  taper with a latency model and an SLO whose budget lies between the protected rows and
         every row (test_taper.budget_between), so its plans admit some sample rows and defer others
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
import urllib.error
import urllib.request
from typing import Any

import pytest

from branchwise.ingress.validate import MAX_N
from branchwise.request_meta import KEY
from branchwise.tools.launch import branchwise_report, get_json, post_json
from tests.integration.test_albireo import stream
from tests.integration.test_taper import budget_between

COMMON = ("--parallel-sampling", "--random-seed", "0")
PROMPTS = [f"sample {i}: the plan then" for i in range(6)]
N, PHASES = 6, 4  # 6 prompts x 6 samples; the last 2 prompts opt out (12 serial rows bind the budget)
RHO = 0.8
GREEDY = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}
SAMPLED = {"max_new_tokens": 24, "temperature": 1.0, "ignore_eos": True}


def generate(url: str, body: dict) -> Any:
    return post_json(url + "/generate", body)


def n_batch(url: str, sp: dict, tag: str) -> list[tuple[str, list[int]]]:
    """One request: PROMPTS with n = N each, the last len(PROMPTS) - PHASES opted out of the phase
    (their samples keep SGLang's uuid rids). (rid, output ids) of each sample, prompt by prompt."""
    sps = [sp | {"n": N}] * PHASES + [sp | {"n": N, "custom_params": {KEY: {"phase": None}}}] * (len(PROMPTS) - PHASES)
    outs = generate(url, {"text": PROMPTS, "sampling_params": sps, "rid": [f"{tag}{i}" for i in range(len(PROMPTS))]})
    return [(o["meta_info"]["id"], o["output_ids"]) for o in outs]


def load(url: str) -> dict:
    return get_json(url + "/v1/loads")["loads"][0]


def wait_until(cond, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def idle(url: str) -> bool:
    ld = load(url)
    return not (ld["num_used_tokens"] or ld["num_running_reqs"] or ld["num_waiting_reqs"])


@pytest.fixture(scope="module")
def runs(servers, tmp_path_factory) -> dict[str, Any]:
    stock = servers.get(*COMMON)
    got: dict[str, Any] = {"stock": stock, "ref": {
        "greedy": n_batch(stock.url, GREEDY, "g"), "sampled": n_batch(stock.url, SAMPLED, "s")}}
    protected, everything = PHASES + (len(PROMPTS) - PHASES) * N, len(PROMPTS) * N
    path = tmp_path_factory.mktemp("n_sampling") / "model.json"
    slo_ms = budget_between(path, protected, everything, RHO)
    taper = servers.get("--branch-policy", "taper", "--branch-slo-tpot-ms", str(slo_ms), "--taper-rho", str(RHO),
                        "--latency-model", str(path), *COMMON)
    before = branchwise_report(taper.url)
    got |= {"taper": taper, "before": before, "got": {
        "greedy": n_batch(taper.url, GREEDY, "g"), "sampled": n_batch(taper.url, SAMPLED, "s")},
        "after": branchwise_report(taper.url)}
    return got


def test_taper_admits_some_sample_rows_and_outputs_equal_stock(runs):
    got, ref = runs["got"], runs["ref"]
    assert [ids for _, ids in got["greedy"]] == [ids for _, ids in ref["greedy"]]
    assert [rid for rid, _ in got["greedy"][:PHASES * N]] == [f"g{i}/b{j}/0" for i in range(PHASES) for j in range(N)]
    # unseeded samples draw with seeds keyed by their rids: the phase samples' rids follow the client's
    assert got["sampled"][:PHASES * N] == ref["sampled"][:PHASES * N]
    assert len({tuple(ids) for _, ids in got["sampled"][:N]}) == N  # n distinct draws of one prompt
    t = runs["after"]["taper"]
    assert t["policy"] == "taper" and t["planner_errors"] == 0
    assert 0 < t["admitted"] < t["candidates"], t
    assert t["rows_deferred"] > 0


def test_each_prompt_is_one_phase_of_n_branch_requests(runs):
    before, after = runs["before"], runs["after"]
    assert after["counters"]["branch_requests"] - before["counters"].get("branch_requests", 0) == 2 * PHASES * N
    ours = {f"{tag}{i}" for tag in "gs" for i in range(len(PROMPTS))}
    rows = {p: r for p, r in after["phase_rows"].items() if p in ours}
    assert rows == {f"{tag}{i}": N for tag in "gs" for i in range(PHASES)}  # opted-out prompts are no phase


def test_default_server_runs_samples_as_sglang_and_counts_them(runs):
    url = runs["stock"].url
    rep = branchwise_report(url)
    assert rep["config"]["branch_policy"] == "stock" and "taper" not in rep  # no step controller
    before = rep["counters"].get("branch_requests", 0)
    outs = generate(url, {"text": PROMPTS[0], "sampling_params": GREEDY | {"n": 4}, "rid": "one"})
    assert [o["meta_info"]["id"] for o in outs] == [f"one_0/b{i}/0" for i in range(4)]
    assert len({tuple(o["output_ids"]) for o in outs}) == 1  # greedy: n copies of one text
    rep = branchwise_report(url)
    assert rep["counters"]["branch_requests"] - before == 4 and rep["phase_rows"]["one_0"] == 4
    # the prefix pass cached the prompt for every sample (all but the last token, recomputed)
    assert {o["meta_info"]["cached_tokens"] - o["meta_info"]["prompt_tokens"] for o in outs} == {-1}


def test_a_stamped_request_keeps_its_phase_on_every_sample(runs):
    url = runs["taper"].url
    sp = GREEDY | {"n": 2, "custom_params": {KEY: {"phase": "own-phase", "branch": 0, "fanout": 2}}}
    generate(url, {"text": PROMPTS[1], "sampling_params": sp, "rid": "own"})
    rows = branchwise_report(url)["phase_rows"]
    assert rows["own-phase"] == 2 and "own_0" not in rows


def test_streaming_keeps_sglangs_index_per_choice(runs):
    url = runs["taper"].url
    whole = generate(url, {"text": PROMPTS[2], "sampling_params": GREEDY | {"n": 3}, "rid": "whole"})
    chunks = stream(url, {"text": PROMPTS[2], "sampling_params": GREEDY | {"n": 3}, "rid": "str"})
    last = {c["index"]: c for c in chunks}
    assert sorted(last) == [0, 1, 2] and len(chunks) > 3
    assert [last[i]["meta_info"]["id"] for i in range(3)] == [f"str_0/b{i}/0" for i in range(3)]
    assert [last[i]["output_ids"] for i in range(3)] == [o["output_ids"] for o in whole]


def test_aborting_the_request_or_dropping_its_stream_ends_every_sample(runs):
    url = runs["taper"].url
    wait_until(lambda: idle(url), "not idle before the abort test")
    long = {"max_new_tokens": 1500, "ignore_eos": True, "n": 3}
    res: dict[str, Any] = {}
    worker = threading.Thread(target=lambda: res.update(out=generate(url, {"text": PROMPTS[3], "rid": "abo",
                                                                           "sampling_params": long})))
    worker.start()
    wait_until(lambda: load(url)["num_running_reqs"] >= 3, "the samples never started decoding")
    post_json(url + "/abort_request", {"rid": "abo"})  # the client's rid: SGLang knows only the samples'
    worker.join(120)
    assert [o["meta_info"]["finish_reason"]["type"] for o in res["out"]] == ["abort"] * 3
    assert all(o["meta_info"]["completion_tokens"] < 1500 for o in res["out"])
    wait_until(lambda: idle(url), "KV not idle after the abort")

    conn = http.client.HTTPConnection("127.0.0.1", runs["taper"].port, timeout=60)
    conn.request("POST", "/generate", json.dumps({"text": PROMPTS[4], "rid": "drop", "stream": True,
                                                  "sampling_params": long}), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    while b"data:" not in resp.fp.readline():
        pass
    wait_until(lambda: load(url)["num_running_reqs"] >= 3, "the streamed samples never started decoding")
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    wait_until(lambda: idle(url), "KV not idle after the stream was dropped")


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_openai_n_gives_n_choices_of_one_phase(runs, route):
    url = runs["taper"].url
    body = {"model": "default", "max_tokens": 6, "n": 3, "temperature": 0, "rid": f"oai{len(route)}"}
    body |= {"prompt": PROMPTS[5]} if route == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]}
    out = post_json(url + route, body)
    assert sorted(c["index"] for c in out["choices"]) == [0, 1, 2]
    assert branchwise_report(url)["phase_rows"][f"oai{len(route)}_0"] == 3


def status(url: str, route: str, body: dict) -> tuple[int, str]:
    req = urllib.request.Request(url + route, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


@pytest.mark.parametrize("n", [0, -2, MAX_N + 1, 2**40, 2.5, "3", [2], True, None])
def test_bad_n_is_a_400(runs, n):
    url = runs["taper"].url
    code, text = status(url, "/generate", {"text": "x", "sampling_params": {"n": n, "max_new_tokens": 2}})
    assert code == 400, (n, code, text)
    if isinstance(n, int) and not isinstance(n, bool):
        assert "sampling_params.n must be an integer in [1, 128]" in text
        code, text = status(url, "/v1/completions", {"model": "default", "prompt": "x", "max_tokens": 2, "n": n})
        assert code == 400 and "sampling_params.n must be an integer" in text, (n, code, text)
    assert idle(url)
