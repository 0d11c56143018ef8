"""TAPER inside the real scheduler: per-step deferral of branch rows, identical outputs, aborts, TP."""

from __future__ import annotations

import json
import re
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from branchwise.request_meta import stamp
from branchwise.taper.predictor import LinearLatencyModel
from branchwise.tools.launch import branchwise_report, get_json, merged_state, post_json

# An SLO no step can meet: taper-paper's budget is below every step, so it runs one row per phase
# (deferral in every step with a choice). taper would widen the late phases instead (policies.py);
# test_partial_admission_on_a_set_budget_matches_eager covers it.
TIGHT = ("--branch-policy", "taper-paper", "--branch-slo-tpot-ms", "2", "--enable-metrics")
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


def test_the_refit_sees_every_deferring_step_under_the_overlap_loop(servers):
    """SGLang's default overlap loop reports a copy of each batch (ScheduleBatch.copy keeps
    forward_iter, drops our attributes): every sub-batch step whose result came back must reach the
    refit with its deferred rows, unless no decode launch followed it to time it."""
    tight = servers.get(*TIGHT)
    workload(tight.url, phases=3, serial=2)
    assert wait_idle(tight.url) == 0
    rep = branchwise_report(tight.url)
    refit, counters = rep["taper"]["refit"], rep["counters"]
    assert counters["subset_steps"] > 0 and counters["subset_results"] == counters["subset_steps"]
    assert refit["deferring_steps"] > 0
    timed = counters["subset_results"] - counters.get("deferring_unmeasured", 0) - refit["pending_deferring"]
    assert refit["deferring_steps"] == timed
    assert counters.get("planned_mismatch", 0) == 0 and rep["sizes"]["planned"] == 0


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


def batch_gen(url: str, jobs: list[tuple[int, int | None]], n: int, fanout: int = 4, tag: str = "",
              **sp_extra) -> dict[str, dict]:
    """One batched /generate (one message to the scheduler) for phase rows (p, b) and serial (i, None)."""
    def sp(p: int, b: int | None) -> dict:
        base = {"max_new_tokens": n, "temperature": 0, "ignore_eos": True, **sp_extra}
        return base if b is None else stamp(base, phase=f"{tag}{p}", branch=b, fanout=fanout)

    outs = post_json(url + "/generate", {
        "text": [f"program {p}: the plan then" for p, _ in jobs],
        "rid": [f"{tag}{p}/b{b}" if b is not None else f"{tag}s{p}" for p, b in jobs],
        "sampling_params": [sp(p, b) for p, b in jobs]})
    return {o["meta_info"]["id"]: o for o in outs}


def test_grammar_constrained_rows_with_deferral_match_eager(servers):
    """Deferred rows keep their grammar state (each Req owns its matcher; the sub's mask is built
    from the sub's rows), so constrained outputs equal eager's and stay valid."""
    regex = r"(yes|no), [a-z]{2,6}( [a-z]{2,6}){1,3}\."
    schema = {"type": "object", "properties": {"v": {"enum": ["up", "down"]}, "n": {"enum": [1, 2, 3]}},
              "required": ["v", "n"], "additionalProperties": False}

    # xgrammar allows any JSON whitespace, where this random model can loop until max_new_tokens:
    # without it, every output must be a prefix of a valid document (a whole one if it stopped).
    docs = {json.dumps(d, separators=(",", ":")) for v in ("up", "down") for n in (1, 2, 3)
            for d in ({"v": v, "n": n}, {"n": n, "v": v})}

    def run(url: str) -> dict[str, tuple[str, str]]:
        outs = batch_gen(url, [(0, b) for b in range(3)], 48, fanout=3, tag="gre", regex=regex)
        outs |= batch_gen(url, [(1, b) for b in range(3)], 48, fanout=3, tag="gjs",
                          json_schema=json.dumps(schema))
        return {rid: (o["text"], o["meta_info"]["finish_reason"]["type"]) for rid, o in outs.items()}

    tight = servers.get(*TIGHT)
    before = branchwise_report(tight.url)["taper"]["rows_deferred"]
    got = run(tight.url)
    assert branchwise_report(tight.url)["taper"]["rows_deferred"] > before
    assert got == run(servers.get(*EAGER).url)
    for rid, (text, finish) in got.items():
        if rid.startswith("gre"):
            assert re.fullmatch(regex, text), (rid, text)
        else:
            compact = re.sub(r"\s", "", text)
            assert any(d.startswith(compact) for d in docs) and (finish != "stop" or compact in docs), (rid, text)


# A KV pool too small for the workload, admission that reserves one token of decode growth per
# request (SGLang's estimation clip; ignore_eos requests otherwise reserve all of max_new_tokens),
# so SGLang must retract; retracted and late requests re-enter as chunked prefills. (Mixed chunked
# prefill is refused with a step controller: tests/integration/test_refused_modes.py.)
PRESSURE = ("--chunked-prefill-size", "256")
PRESSURE_ENV = {"SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION": "1"}
POOL_TOKENS = 256


def retractions(server) -> int:
    return server.log_path.read_text(errors="replace").count("KV cache pool is full. Retract requests.")


def pressure_then_late_arrivals(url: str) -> dict[str, dict]:
    """5 phases x 3 branches x 64 tokens into a 256-token pool: even TAPER's protected composition
    (one row per phase, 5 x 64 new tokens) outgrows it, so the subset check fails while the other
    rows are deferred. Serial requests arrive while those decode (mixed steps)."""
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(batch_gen, url, [(p, b) for p in range(5) for b in range(3)], 64, fanout=3,
                            tag="mem")
        deadline = time.monotonic() + 60
        while get_json(url + "/v1/loads")["loads"][0]["num_running_reqs"] == 0 and not first.done():
            assert time.monotonic() < deadline, "the phase rows never started decoding"
            time.sleep(0.02)  # poll interval while waiting for the decode to start
        late = batch_gen(url, [(i, None) for i in range(3)], 16, tag="late")
        return first.result(timeout=300) | late


def test_deferral_and_grammar_rows_on_the_forward_thread_match_eager(servers):
    """TAPER's deferral with the CPU forward thread (--async-output, opt-in env): decode, prefill and
    grammar forwards (sampled in a second worker job) run on the worker while branch rows are
    deferred and resumed; outputs equal eager's."""
    regex = r"(yes|no), [a-z]{2,6}( [a-z]{2,6}){1,3}\."

    def run(url: str) -> dict[str, list[int]]:
        outs = workload(url) | batch_gen(url, [(0, b) for b in range(3)] + [(1, None)], 48, fanout=3,
                                         tag="gre", regex=regex)
        return {rid: o["output_ids"] for rid, o in outs.items()}

    ref = run(servers.get(*EAGER).url)
    fast = servers.get(*TIGHT, "--async-output", env={"BRANCHWISE_FORWARD_THREAD": "1"})
    assert run(fast.url) == ref
    assert branchwise_report(fast.url)["taper"]["rows_deferred"] > 0
    ft = merged_state(fast.url)["branchwise_forward_thread"]
    assert ft["modes"].get("decode", 0) > 20 and ft["features"].get("decode: grammar", 0) > 0, ft
    assert ft["samples"] > 0 and ft["inline"] == 0 and ft["reasons"] == {}, ft


def _stream(url: str, payload: dict, chunks: list[dict]) -> None:
    """POST a streamed /generate and collect its chunks (the caller watches them arrive)."""
    req = urllib.request.Request(url + "/generate", data=json.dumps(dict(payload, stream=True)).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        for line in r:
            text = line.decode().strip()
            if text.startswith("data:") and text != "data: [DONE]":
                chunks.append(json.loads(text[len("data:"):]))


def until(cond, what: str, timeout_s: float = 120.0) -> None:
    """Poll a condition on the server's state (what the test waits for, not a duration)."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"not reached within {timeout_s:.0f} s: {what}"
        time.sleep(0.05)


def test_abort_of_a_deferred_branch_frees_its_kv(servers):
    """Three long branches of one phase under an SLO that runs one row per step: once all three hold
    KV (each streamed a token) and TAPER deferred rows among them, aborting them ends each with an
    abort and frees every KV token, deferred rows included."""
    srv = servers.get(*TIGHT)
    assert wait_idle(srv.url) == 0
    chunks: list[list[dict]] = [[], [], []]
    sp = {"max_new_tokens": 1500, "temperature": 0, "ignore_eos": True}
    payloads = [{"text": "abort test", "rid": f"ab/b{b}", "sampling_params": stamp(sp, phase="ab", branch=b, fanout=3)}
                for b in range(3)]
    with ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(_stream, srv.url, p, c) for p, c in zip(payloads, chunks, strict=True)]
        until(lambda: all(chunks) or any(f.done() for f in futures), "all three branches decoding")
        deferred = branchwise_report(srv.url)["taper"]["rows_deferred"]
        until(lambda: branchwise_report(srv.url)["taper"]["rows_deferred"] > deferred,
              "rows of the three decoding branches deferred")
        assert not any(f.done() for f in futures)  # none finished: every abort hits a live (deferred) row
        for b in (2, 1, 0):  # the HTTP server only forwards aborts of rids it knows: one per branch
            post_json(srv.url + "/abort_request", {"rid": f"ab/b{b}"})
        for f in futures:
            f.result(timeout=120)
    for c in chunks:
        fr = c[-1]["meta_info"]["finish_reason"]
        assert fr["type"] == "abort", fr
        assert c[-1]["meta_info"]["completion_tokens"] < 1500
    assert wait_idle(srv.url) == 0


def test_tp2_decides_on_rank0_and_matches_tp1(servers):
    ref = workload(servers.get(*EAGER).url, phases=2, fanout=3, serial=1)
    tp2 = servers.get(*TIGHT, tp=2)
    got = workload(tp2.url, phases=2, fanout=3, serial=1)
    assert {k: v["output_ids"] for k, v in got.items()} == {k: v["output_ids"] for k, v in ref.items()}
    assert branchwise_report(tp2.url)["taper"]["rows_deferred"] > 0


def test_memory_pressure_retraction_with_deferral(servers):
    """Retraction while branch rows are deferred (the subset no longer fits -> SGLang's own retract
    path over the full batch, deferred rows included), and late requests prefilled between
    deferring steps. Outputs equal eager's under the same pool, and the KV pool drains back to idle."""
    eager = servers.get(*EAGER, *PRESSURE, env=PRESSURE_ENV, max_total_tokens=POOL_TOKENS)
    ref = pressure_then_late_arrivals(eager.url)
    assert retractions(eager) > 0 and wait_idle(eager.url) == 0
    tight = servers.get(*TIGHT, *PRESSURE, env=PRESSURE_ENV, max_total_tokens=POOL_TOKENS)
    got = pressure_then_late_arrivals(tight.url)
    assert {k: v["output_ids"] for k, v in got.items()} == {k: v["output_ids"] for k, v in ref.items()}
    assert all(v["meta_info"]["finish_reason"]["type"] == "length" for v in got.values())
    rep = branchwise_report(tight.url)
    assert rep["taper"]["rows_deferred"] > 0
    assert rep["counters"].get("fallback_retract", 0) > 0 and retractions(tight) > 0
    assert wait_idle(tight.url) == 0


# The latency model of the partial-admission tests: the tiny model's range on a 2-core CPU box.
# TAPER plans with a --latency-model as given until its refit has 32 steps (and then moves only
# the intercept), so a budget between two of its compositions defers rows in the first plans on a
# machine of any speed or load. (A probe of the box does not: under load a measured T(40 rows)
# can come out below T(10 rows).)
PLAN_MODEL = LinearLatencyModel(c0=2e-3, c_seq=1e-4, c_ctx=0.0)


def budget_between(path: Path, protected: int, everything: int, rho: float) -> float:
    """Write PLAN_MODEL to `path` and return the SLO (ms) at which rho x SLO lies halfway between
    its T(protected rows) and T(every row): the first plans admit some rows and defer others."""
    path.write_text(PLAN_MODEL.to_json())
    t_lo, t_hi = PLAN_MODEL.predict(protected, 0), PLAN_MODEL.predict(everything, 0)
    return round(1e3 * (t_lo + t_hi) / 2 / rho, 3)


def test_partial_admission_on_a_set_budget_matches_eager(servers, tmp_path):
    """A budget between the protected composition and the whole batch (budget_between): rho x SLO
    halfway between T(10 rows) and T(40 rows). 6 phases x 6 branches + 4 serial requests in one
    message: the first plans (every clock fresh, slack = SLO) admit some branch rows and defer
    others; as the requests bank slack, taper widens. Greedy outputs equal eager's."""
    phases, fanout, serial, rho = 6, 6, 4, 0.8
    protected, everything = phases + serial, phases * fanout + serial
    eager = servers.get(*EAGER)
    slo_ms = budget_between(tmp_path / "model.json", protected, everything, rho)

    jobs = [(p, b) for p in range(phases) for b in range(fanout)] + [(i, None) for i in range(serial)]
    ref = batch_gen(eager.url, jobs, 24, fanout=fanout, tag="part")
    srv = servers.get("--branch-policy", "taper", "--branch-slo-tpot-ms", str(slo_ms), "--taper-rho", str(rho),
                      "--latency-model", str(tmp_path / "model.json"))
    got = batch_gen(srv.url, jobs, 24, fanout=fanout, tag="part")
    assert {k: v["output_ids"] for k, v in got.items()} == {k: v["output_ids"] for k, v in ref.items()}
    t = branchwise_report(srv.url)["taper"]
    assert t["policy"] == "taper" and t["planner_errors"] == 0
    assert 0 < t["admitted"] < t["candidates"], t
