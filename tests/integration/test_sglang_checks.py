"""Branchwise under SGLang's own debug checks: one taper server with SGLANG_IS_IN_CI=1 (the overlap
FutureMap's read-once poison: a token slot read twice, or read before it was stored, fails an
assert) and SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY (the KV pool is audited after every
step: a leaked or double-counted slot fails an assert). Either kills the scheduler, so after each
scenario the server must still be up, and end idle with no KV in use.

Scenarios: a load whose budget defers branch rows, a server-side fork, a client fork/join, n > 1."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from transformers import AutoTokenizer

from bench.structure_driver import request, spec
from branchwise.fork.grammars import parse
from branchwise.request_meta import stamp
from branchwise.tools.launch import branchwise_report, get_json, merged_state, post_json
from frontends import fork_join
from tests.integration.test_taper import budget_between, wait_idle

# level 2: the same audit as 1, and its line logged every step (so the test sees that it ran);
# SGLANG_CHECK_KV_PAGE_INVARIANTS adds to it: no request row past its allocation, no page both owned
# and free, no page freed twice
CHECKS = {"SGLANG_IS_IN_CI": "1", "SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY": "2",
          "SGLANG_CHECK_KV_PAGE_INVARIANTS": "1"}
PHASES, FANOUT, SERIAL, RHO = 4, 4, 2, 0.8
TOKENS = 16


@pytest.fixture(scope="module")
def srv(servers, tmp_path_factory):
    path = tmp_path_factory.mktemp("checks") / "model.json"
    slo_ms = budget_between(path, PHASES + SERIAL, PHASES * FANOUT + SERIAL, RHO)
    return servers.get("--branch-policy", "taper", "--branch-slo-tpot-ms", str(slo_ms), "--taper-rho", str(RHO),
                       "--latency-model", str(path), "--enable-custom-logit-processor", env=CHECKS)


def healthy(srv) -> None:
    """The scheduler survived every check so far and the step ended with nothing held."""
    assert srv.proc.poll() is None, srv.log_tail()
    assert get_json(srv.url + "/health", timeout=10) is not None
    assert wait_idle(srv.url) == 0, "KV still in use after the scenario"
    log = srv.log_path.read_text(errors="replace")
    assert "[Mem Check (BUSY)]" in log  # the audit ran
    assert "Mem Leak Detected" not in log and "Traceback" not in log, srv.log_tail()


def gen(url: str, text: str, sp: dict, rid: str) -> dict:
    return post_json(url + "/generate", {"text": text, "sampling_params": sp, "rid": rid}, timeout=300)


def test_a_deferring_load(srv):
    sp = {"max_new_tokens": TOKENS, "temperature": 0, "ignore_eos": True}
    jobs = [(f"ph{p}/b{b}", f"program {p}: the plan then", stamp(sp, phase=f"ph{p}", branch=b, fanout=FANOUT))
            for p in range(PHASES) for b in range(FANOUT)]
    jobs += [(f"s{i}", f"serial {i}: the plan then", sp) for i in range(SERIAL)]
    before = branchwise_report(srv.url)["taper"]["rows_deferred"]
    with ThreadPoolExecutor(len(jobs)) as pool:
        outs = {rid: o["output_ids"] for rid, o in
                zip([j[0] for j in jobs], pool.map(lambda j: gen(srv.url, j[1], j[2], j[0]), jobs), strict=True)}
    assert all(len(ids) == TOKENS for ids in outs.values())
    for p in range(PHASES):  # a phase's branches share one prompt: greedy, deferred or not, one output
        assert len({tuple(outs[f"ph{p}/b{b}"]) for b in range(FANOUT)}) == 1
    assert branchwise_report(srv.url)["taper"]["rows_deferred"] > before
    healthy(srv)


def test_a_server_side_fork(srv, tiny_model):
    tok = AutoTokenizer.from_pretrained(tiny_model)
    prompt = tok.encode("the plan is", add_special_tokens=False)
    out = post_json(srv.url + "/generate", request(prompt, spec("multiverse", 3, [3, 6, 4]), grammar="multiverse",
                                                   rid="mv", max_new_tokens=300), timeout=300)
    assert out["meta_info"]["finish_reason"]["type"] == "stop"
    assert "branchwise_error" not in out["meta_info"]["finish_reason"]
    (par,) = list(parse("multiverse", out["text"]).iter("Parallel"))
    assert [p.label for p in par.kids("Path")] == ["1", "2", "3"]
    assert any(p["parent"] == "mv" for p in merged_state(srv.url)["branchwise_fork"]["recent"])
    healthy(srv)


def test_a_client_fork_join(srv):
    results = fork_join.run_batch(srv.url, 2, fanout=3, head_tokens=12, branch_tokens=12, tail_tokens=4, seed=5)
    for res in results:
        assert len(res.branch_texts) == 3 and res.text.startswith(res.fork_text)
        assert [r.completion_tokens for r in res.branches] == [12] * 3
    healthy(srv)


def test_n_samples(srv):
    sp = {"max_new_tokens": TOKENS, "temperature": 0, "ignore_eos": True, "n": 4}
    outs = post_json(srv.url + "/generate", {"text": "sample: the plan then", "sampling_params": sp}, timeout=300)
    assert len(outs) == 4 and len({tuple(o["output_ids"]) for o in outs}) == 1  # greedy samples agree
    assert all(len(o["output_ids"]) == TOKENS for o in outs)
    healthy(srv)
