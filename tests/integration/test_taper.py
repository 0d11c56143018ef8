"""TAPER inside the real scheduler: per-step deferral of branch rows, identical outputs, aborts, TP."""

from __future__ import annotations

import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from branchwise.launch import branchwise_report, get_json, post_json
from branchwise.request_meta import stamp

TIGHT = ("--branch-policy", "taper", "--branch-slo-tpot-ms", "2", "--enable-metrics")
EAGER = ("--branch-policy", "eager")


def gen(url: str, i: int, branch: int | None, n: int = 24, fanout: int = 4, **extra) -> dict:
    sp = {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}
    if branch is not None:
        sp = stamp(sp, phase=f"ph{i}", branch=branch, fanout=fanout)
    rid = f"t{i}" if branch is None else f"ph{i}/b{branch}"
    return post_json(url + "/generate", {"text": f"program {i}: the plan then", "sampling_params": sp,
                                         "rid": rid, **extra})


def workload(url: str, phases: int = 5, fanout: int = 4, serial: int = 4, **extra) -> dict[str, dict]:
    jobs = [(i, b) for i in range(phases) for b in range(fanout)] + [(100 + i, None) for i in range(serial)]
    with ThreadPoolExecutor(len(jobs)) as pool:
        outs = list(pool.map(lambda j: gen(url, j[0], j[1], fanout=fanout, **extra), jobs))
    return {o["meta_info"]["id"]: o for o in outs}


def used_tokens(url: str) -> int:
    return get_json(url + "/v1/loads")["loads"][0]["num_used_tokens"]


def wait_idle(url: str, timeout_s: float = 30) -> int:
    deadline = time.monotonic() + timeout_s
    while (used := used_tokens(url)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return used


def test_taper_defers_under_tight_slo_eager_admits_all_outputs_identical(servers):
    eager = servers.get(*EAGER)
    ref = workload(eager.url)
    tight = servers.get(*TIGHT)
    got = workload(tight.url)
    assert {k: v["output_ids"] for k, v in got.items()} == {k: v["output_ids"] for k, v in ref.items()}

    t = branchwise_report(tight.url)["taper"]
    assert t["rows_deferred"] > 0 and t["admission_rate"] < 1.0
    e = branchwise_report(eager.url)["taper"]
    assert e["candidates"] > 0 and e["admitted"] == e["candidates"] and e["rows_deferred"] == 0

    with urllib.request.urlopen(tight.url + "/metrics", timeout=30) as r:
        metrics = r.read().decode()
    assert "branchwise:admission_rate" in metrics and "branchwise:deferred_branches_total" in metrics


def test_logprobs_with_deferral_match_eager(servers):
    extra = {"return_logprob": True, "top_logprobs_num": 2}
    ref = workload(servers.get(*EAGER).url, phases=2, serial=2, **extra)
    got = workload(servers.get(*TIGHT).url, phases=2, serial=2, **extra)
    for rid, out in got.items():
        a, b = out["meta_info"]["output_token_logprobs"], ref[rid]["meta_info"]["output_token_logprobs"]
        assert [x[1] for x in a] == [x[1] for x in b]
        assert max(abs(x[0] - y[0]) for x, y in zip(a, b, strict=True)) < 1e-4


def penalty_run(url: str, penalties: bool = True) -> list[list[int]]:
    """2 phases x 3 branches sent as one batch (one prefill); each row its own penalty mix."""
    def sp(p: int, b: int) -> dict:
        pen = {"frequency_penalty": 0.3 * b, "repetition_penalty": 1.0 + 0.2 * p,
               "presence_penalty": 0.4 * (1 - p), "min_new_tokens": 8 * p} if penalties else {}
        return stamp({"max_new_tokens": 20, "temperature": 0, "ignore_eos": True, **pen},
                     phase=f"pen{p}", branch=b, fanout=3)

    jobs = [(p, b) for p in range(2) for b in range(3)]
    outs = post_json(url + "/generate", {"text": [f"program {p}: the plan" for p, _ in jobs],
                                         "rid": [f"pen{p}/b{b}" for p, b in jobs],
                                         "sampling_params": [sp(p, b) for p, b in jobs]})
    return [o["output_ids"] for o in outs]


def test_penalties_with_deferral_match_eager(servers):
    """Deferred rows keep their penalty state; rows that ran get theirs updated (sliced penalizers)."""
    tight = servers.get(*TIGHT)
    before = branchwise_report(tight.url)["taper"]["rows_deferred"]
    got = penalty_run(tight.url)
    assert branchwise_report(tight.url)["taper"]["rows_deferred"] > before
    eager = servers.get(*EAGER)
    assert got == penalty_run(eager.url)
    assert got != penalty_run(eager.url, penalties=False)  # the penalties do change the outputs


def test_abort_of_a_deferred_branch_frees_its_kv(servers):
    srv = servers.get(*TIGHT)
    assert wait_idle(srv.url) == 0

    def long_branch(b):
        sp = stamp({"max_new_tokens": 1500, "temperature": 0, "ignore_eos": True}, phase="ab", branch=b, fanout=3)
        return post_json(srv.url + "/generate", {"text": "abort test", "rid": f"ab/b{b}", "sampling_params": sp})

    with ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(long_branch, b) for b in range(3)]
        time.sleep(1.0)  # let all three start decoding; under a 2 ms SLO at most one runs per step
        for b in (2, 1, 0):  # the HTTP server only forwards aborts of rids it knows: one per branch
            post_json(srv.url + "/abort_request", {"rid": f"ab/b{b}"})
        outs = [f.result(timeout=120) for f in futures]
    for out in outs:
        assert out["meta_info"]["finish_reason"]["type"] == "abort"
        assert out["meta_info"]["completion_tokens"] < 1500
    assert wait_idle(srv.url) == 0


def test_tp2_decides_on_rank0_and_matches_tp1(servers):
    ref = workload(servers.get(*EAGER).url, phases=2, fanout=3, serial=1)
    tp2 = servers.get(*TIGHT, tp=2)
    got = workload(tp2.url, phases=2, fanout=3, serial=1)
    assert {k: v["output_ids"] for k, v in got.items()} == {k: v["output_ids"] for k, v in ref.items()}
    assert branchwise_report(tp2.url)["taper"]["rows_deferred"] > 0
