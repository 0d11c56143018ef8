"""Albireo in SGLang: --async-output and --parallel-sampling leave every output byte-identical.

Six servers, each started once and stopped before the next (one alive at a time):
  stock   tp=1, Albireo flags off (the reference)
  async   tp=1, --async-output --parallel-sampling and env BRANCHWISE_FORWARD_THREAD=1: on CPU decode,
          prefill and mixed forwards run on the forward thread (albireo/forward_thread.py), so every
          comparison covers it
  sp2     tp=2, --parallel-sampling --disable-overlap-schedule (async output off)
  sp2-async  tp=2, --parallel-sampling --async-output and the forward thread on every rank
  stock-mixed / async-mixed   stock / async with --enable-mixed-chunk and 64-token prefill chunks
The first tp=1 pair runs --branch-policy eager (see CLP: penalties comparable across runs) and takes
custom logit processors (a server-side Multiverse fork is driven by one). The mixed pair runs policy
stock (a step controller is refused with mixed chunked prefill), so its requests carry no penalty.
Requests arriving while others decode, penalties, the input-logprob path, fork spawns and joins,
mixed steps: each comparison also checks, from the server's forward-thread stats, that those
batches ran on the worker thread rather than inline.
Seeded sampling means per-request `sampling_seed`: SGLang honours it only under
--enable-deterministic-inference (unavailable on CPU), --parallel-sampling always does, so seeded
outputs are compared between the two parallel-sampling servers: async output on vs off, tp=1 vs
tp=2 at once. Without --parallel-sampling unseeded sampling draws from SGLang's global RNG, whose
consumption depends on step timing, so it is not compared across servers; with it an unseeded row's
seed follows --random-seed and its rid, so unseeded rows with client rids are compared too.
"""

from __future__ import annotations

import json
import re
import threading
import time
import urllib.request
from typing import Any

import pytest

from bench.structure_driver import request as driven_request
from bench.structure_driver import spec
from branchwise.tools.launch import get_json, merged_state, post_json

PROMPTS = [f"request {i}: the plan is to" for i in range(6)]
GREEDY = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}
# eager: Branchwise pins which token a penalised row cumulates each step (deferral._pinned_cumulate).
# SGLang's own overlap rule takes output_ids[-1], which double-counts a token whenever a prefill step
# interleaves (a function of arrival timing), so penalised outputs would differ between two runs of
# stock itself; pinned, they are a function of the tokens and comparable across servers.
CLP = ("--branch-policy", "eager", "--enable-custom-logit-processor")
MIXED = ("--branch-policy", "stock", "--enable-mixed-chunk", "--chunked-prefill-size", "64")
SERVERS = {  # name: (args, tp)
    "stock": (CLP, 1),
    "async": (CLP + ("--async-output", "--parallel-sampling"), 1),
    "sp2": (("--parallel-sampling", "--disable-overlap-schedule"), 2),
    "sp2-async": (("--parallel-sampling", "--async-output"), 2),
    "stock-mixed": (MIXED, 1),
    "async-mixed": (MIXED + ("--async-output",), 1),
}
FORWARD_THREAD = {"async", "async-mixed", "sp2-async"}  # servers that opt in to the CPU forward thread
PENALTIES = [GREEDY | {"frequency_penalty": 1.5}, GREEDY | {"presence_penalty": 1.5},
             GREEDY | {"repetition_penalty": 1.8},
             {"max_new_tokens": 32, "temperature": 0, "min_new_tokens": 28},
             GREEDY | {"frequency_penalty": 0.5, "presence_penalty": 0.5, "repetition_penalty": 1.2,
                       "min_new_tokens": 8}]
LONG_PROMPT = " ".join(PROMPTS) * 3  # > 64 tokens: chunked prefill on the mixed servers
REGEX = r"(yes|no), [a-z]{2,6}( [a-z]{2,6}){1,3}\."
SCHEMA = json.dumps({"type": "object", "properties": {"v": {"enum": ["up", "down"]}, "n": {"enum": [1, 2, 3]}},
                     "required": ["v", "n"], "additionalProperties": False})
GRAMMAR = [{"max_new_tokens": 48, "temperature": 0, "regex": REGEX},
           {"max_new_tokens": 48, "temperature": 0, "json_schema": SCHEMA}]


def gen(url: str, text: Any, sp: Any, **extra: Any) -> Any:
    return post_json(url + "/generate", {"text": text, "sampling_params": sp, **extra})


def stream(url: str, payload: dict, on_chunk=None) -> list[dict]:
    """Chunks of a streaming /generate, in arrival order; on_chunk(i, chunk) runs as they arrive."""
    req = urllib.request.Request(url + "/generate", data=json.dumps(payload | {"stream": True}).encode(),
                                 headers={"Content-Type": "application/json"})
    chunks = []
    with urllib.request.urlopen(req, timeout=300) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunks.append(json.loads(line[5:]))
            if on_chunk is not None:
                on_chunk(len(chunks) - 1, chunks[-1])
    return chunks


def load(url: str) -> dict:
    return get_json(url + "/v1/loads")["loads"][0]


def wait_idle(url: str, timeout_s: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        ld = load(url)
        if not (ld["num_used_tokens"] or ld["num_running_reqs"] or ld["num_waiting_reqs"]):
            return ld
        assert time.monotonic() < deadline, f"KV not back to idle after {timeout_s:.0f} s: {ld}"
        time.sleep(0.1)


def internal(url: str) -> dict:
    return merged_state(url)


def ft_stats(url: str) -> dict | None:
    return internal(url).get("branchwise_forward_thread")


def arrivals(url: str, long_sp: dict, late: list[tuple[Any, dict]], at: tuple[int, ...] = (2, 5, 8)) -> dict:
    """A long streaming request decodes; each late request is sent from its own thread once the long
    one has streamed at[k] chunks, so its prefill (or mixed step) is planned while decode steps run.
    The late requests keep decoding while the next ones arrive."""
    got: dict[int, Any] = {}
    threads: list[threading.Thread] = []

    def send(k: int) -> None:
        text, sp = late[k]
        got[k] = gen(url, text, sp)["output_ids"]

    def on_chunk(i: int, _chunk: dict) -> None:
        while len(threads) < len(late) and i >= at[len(threads)]:
            threads.append(threading.Thread(target=send, args=(len(threads),), daemon=True))
            threads[-1].start()

    chunks = stream(url, {"text": PROMPTS[0], "sampling_params": long_sp}, on_chunk)
    on_chunk(max(at), {})  # the HTTP layer may merge chunks: whatever was not sent yet goes now
    for th in threads:
        th.join(300)
        assert not th.is_alive()
    return {"long": chunks[-1]["output_ids"], "late": [got[k] for k in range(len(late))]}


def fork_outputs(url: str) -> dict[str, Any]:
    """A server-side Multiverse fork (3 branches) driven by bench.structure_driver's custom logit
    processor; forward-thread stats taken around it show where its spawns and joins ran."""
    before = ft_stats(url)
    out = post_json(url + "/generate", driven_request("the plan is", spec("multiverse", 3, [3, 6, 4]),
                                                      grammar="multiverse", rid="albireo-mv3", max_new_tokens=300),
                    timeout=300)
    phases = [p for p in internal(url)["branchwise_fork"]["recent"] if p["parent"] == "albireo-mv3"]
    return {"ids": out["output_ids"], "finish": out["meta_info"]["finish_reason"],
            "fanouts": [p["fanout"] for p in phases], "ft": (before, ft_stats(url))}


def outputs(url: str) -> dict[str, Any]:
    """The request mix every tp=1 server answers (greedy, EOS, stop strings and tokens, streaming)."""
    out: dict[str, Any] = {"greedy": [r["output_ids"] for r in gen(url, PROMPTS, GREEDY)]}
    eos = gen(url, PROMPTS, {"max_new_tokens": 48, "temperature": 0})
    out["eos"] = [(r["output_ids"], r["meta_info"]["finish_reason"]) for r in eos]
    stops = gen(url, PROMPTS, {"max_new_tokens": 40, "temperature": 0, "stop": ["e", " t", "ou"]})
    out["stop_str"] = [(r["output_ids"], r["text"], r["meta_info"]["finish_reason"]) for r in stops]
    tok = out["greedy"][0][5]  # a stop token the greedy continuation is known to reach
    st = gen(url, PROMPTS[0], {"max_new_tokens": 40, "temperature": 0, "stop_token_ids": [tok]})
    out["stop_tok"] = (st["output_ids"], st["meta_info"]["finish_reason"])
    # rows finish at different steps while the next step is already in flight (overlap + forward thread)
    mixed = [GREEDY | {"max_new_tokens": n} for n in (3, 17, 9, 24, 1, 12)]
    out["mixed"] = [r["output_ids"] for r in gen(url, PROMPTS, mixed)]
    chunks = stream(url, {"text": PROMPTS[1], "sampling_params": GREEDY})
    out["stream"] = [(c["text"], c["output_ids"], c["meta_info"]["finish_reason"]) for c in chunks]
    out["penalties"] = [r["output_ids"] for r in gen(url, PROMPTS[: len(PENALTIES)], PENALTIES)]
    long_sp = GREEDY | {"max_new_tokens": 64}
    out["arrivals"] = arrivals(url, long_sp, [(PROMPTS[k], GREEDY) for k in (1, 2, 3)])
    out["penalty_arrivals"] = arrivals(url, long_sp, [(PROMPTS[k], PENALTIES[k]) for k in (1, 2, 4)])
    out["fork"] = fork_outputs(url)
    # grammar-constrained rows (SGLang's delayed sampling), alone, beside plain rows, and arriving under load
    gr = gen(url, PROMPTS[:4], [GRAMMAR[k % 2] for k in range(4)])
    out["grammar"] = [(r["output_ids"], r["text"], r["meta_info"]["finish_reason"]) for r in gr]
    out["grammar_mixed"] = [r["output_ids"] for r in gen(url, PROMPTS[:4], [GRAMMAR[0], GREEDY, GRAMMAR[1], GREEDY])]
    out["grammar_arrivals"] = arrivals(url, GRAMMAR[0] | {"max_new_tokens": 64},
                                       [(PROMPTS[1], GRAMMAR[1]), (PROMPTS[2], GREEDY), (PROMPTS[3], GRAMMAR[0])])
    out["idle"] = wait_idle(url)  # rows that finished while the next step was planned freed their KV
    return out


def mixed_outputs(url: str) -> dict[str, Any]:
    """--enable-mixed-chunk: late short prompts mix with the running decode rows; a long one is chunked."""
    long_sp = GREEDY | {"max_new_tokens": 64}
    # greedy only: under stock a penalised row's cumulated tokens depend on arrival timing (see CLP)
    late = [(PROMPTS[1], GREEDY), (LONG_PROMPT, GREEDY), (PROMPTS[2], GREEDY | {"max_new_tokens": 20}),
            (PROMPTS[3], GREEDY)]
    out = {"arrivals": arrivals(url, long_sp, late, at=(2, 4, 6, 8))}
    out["again"] = arrivals(url, long_sp, late[::-1], at=(1, 3, 5, 7))
    # the prefill's input-logprob path
    lp = gen(url, PROMPTS[:2], GREEDY | {"max_new_tokens": 4}, return_logprob=True, logprob_start_len=0,
             top_logprobs_num=2)
    out["input_logprobs"] = [(r["output_ids"], r["meta_info"]["input_token_logprobs"],
                              r["meta_info"]["output_token_logprobs"], r["meta_info"]["input_top_logprobs"])
                             for r in lp]
    out["idle"] = wait_idle(url)
    return out


def abort_mid_stream(url: str) -> dict[str, Any]:
    """Abort a long streaming request after a few chunks; the stream must end and KV go back to idle."""
    wait_idle(url)

    def abort_at_third(i: int, _chunk: dict) -> None:
        if i == 2:
            post_json(url + "/abort_request", {"rid": "albireo-abort"})

    sp = {"max_new_tokens": 1500, "temperature": 0, "ignore_eos": True}
    chunks = stream(url, {"text": PROMPTS[0], "sampling_params": sp, "rid": "albireo-abort"}, abort_at_third)
    return {"chunks": len(chunks), "finish": chunks[-1]["meta_info"]["finish_reason"],
            "tokens": len(chunks[-1]["output_ids"]), "idle": wait_idle(url)}


def sp_outputs(url: str) -> dict[str, Any]:
    seeded = [{"max_new_tokens": 24, "temperature": 0.9, "top_p": 0.95, "top_k": 50, "ignore_eos": True,
               "sampling_seed": 1000 + i} for i in range(len(PROMPTS))]
    other = [sp | {"sampling_seed": 2000 + i} for i, sp in enumerate(seeded)]
    # no seed given: the row's seed follows --random-seed (0 on every server here) and its rid
    plain = {"max_new_tokens": 24, "temperature": 1.0, "ignore_eos": True}
    return {
        "greedy": [r["output_ids"] for r in gen(url, PROMPTS, GREEDY)],
        "seeded": [r["output_ids"] for r in gen(url, PROMPTS, seeded)],
        # seeded requests arriving while a seeded one decodes (prefills under load on the async server)
        "seeded_arrivals": arrivals(url, seeded[0] | {"max_new_tokens": 48}, [(PROMPTS[k], seeded[k]) for k in (1, 2, 3)]),
        "seeded_alone": gen(url, PROMPTS[2], seeded[2])["output_ids"],
        "other_seeds": [r["output_ids"] for r in gen(url, PROMPTS, other)],
        "unseeded": [r["output_ids"] for r in gen(url, PROMPTS[:3], plain, rid=[f"albireo-u{i}" for i in range(3)])],
        "logprobs": gen(url, PROMPTS[:2], GREEDY | {"max_new_tokens": 8}, return_logprob=True),
        "grammar": [r["output_ids"] for r in gen(url, PROMPTS[:2], GRAMMAR)],
    }


@pytest.fixture(scope="module")
def runs(servers) -> dict[str, dict[str, Any]]:
    """Each server answers its workload once, then stops (at most one of these alive at a time)."""
    got: dict[str, dict[str, Any]] = {}
    for name, (args, tp) in SERVERS.items():
        env = {"BRANCHWISE_FORWARD_THREAD": "1"} if name in FORWARD_THREAD else None  # opt-in CPU forward thread
        srv = servers.get("--random-seed", "0", *args, env=env, tp=tp)
        try:
            if "--enable-mixed-chunk" in args:
                res = mixed_outputs(srv.url)
            else:
                res = outputs(srv.url) if tp == 1 else {}
            if name == "async":
                res["abort"] = abort_mid_stream(srv.url)
            if "--parallel-sampling" in args:
                res |= {"sp": sp_outputs(srv.url)}
            res["internal"] = internal(srv.url)
            got[name] = res
        finally:
            servers.stop(srv)
    return got


def test_async_output_outputs_byte_identical_to_stock(runs):
    stock, fast = runs["stock"], runs["async"]
    # unseeded sampled outputs are not compared: SGLang's global RNG consumption depends on step timing
    for key in ("greedy", "eos", "stop_str", "stop_tok", "mixed"):
        assert fast[key] == stock[key], key
    assert [len(x) for x in stock["mixed"]] == [3, 17, 9, 24, 1, 12]
    # the HTTP layer may merge chunks that arrive together: compare states, not chunk boundaries
    by_len = {len(ids): (text, ids, fin) for text, ids, fin in stock["stream"]}
    assert fast["stream"][-1] == stock["stream"][-1]
    assert all(by_len.get(len(ids), c) == c for c in fast["stream"] for _, ids, _ in [c])
    assert {f["type"] for _, f in stock["eos"]} >= {"length"}
    assert all(f["type"] == "stop" for _, _, f in stock["stop_str"])
    assert stock["stop_tok"][1] == {"type": "stop", "matched": stock["greedy"][0][5]}
    assert fast["idle"]["num_used_tokens"] == stock["idle"]["num_used_tokens"] == 0
    rep = fast["internal"]["branchwise_async_output"]
    assert rep["fast"] > 0 and rep["sent"] > 0 and rep["table"] is True  # the fast paths really ran
    assert "branchwise_async_output" not in stock["internal"]
    ft = fast["internal"]["branchwise_forward_thread"]  # decode and prefill forwards really ran on the thread
    assert ft["enabled"] and ft["modes"]["decode"] > 20 and ft["modes"]["extend"] > 10
    assert ft["jobs"] == sum(ft["modes"].values())
    assert ft["inline"] == 0 and ft["reasons"] == {}, ft["reasons"]  # no drain on this workload
    assert "branchwise_forward_thread" not in stock["internal"]


def _entry(x: Any) -> bool:
    return (isinstance(x, list) and len(x) == 3 and (x[0] is None or isinstance(x[0], float))
            and isinstance(x[1], int) and (x[2] is None or isinstance(x[2], str)))


def _logprob_ids(x: Any) -> Any:
    """Token ids of nested logprob entries [logprob, token_id, text]: these must be identical."""
    if _entry(x):
        return x[1]
    return [_logprob_ids(y) for y in x] if isinstance(x, (list, tuple)) else x


def _logprob_values(x: Any) -> list:
    if _entry(x):
        return [x[0]]
    return [v for y in x for v in _logprob_values(y)] if isinstance(x, (list, tuple)) else []


def _close(a: list, b: list, tol: float = 1e-5) -> bool:
    """Logprob floats depend on how requests were batched (two prompts in one prefill or two), which
    varies from run to run in stock SGLang too, in the last bits: the ids above are exact, values close."""
    return len(a) == len(b) and all((x is None and y is None) or (x is not None and y is not None and abs(x - y) <= tol)
                                    for x, y in zip(a, b, strict=True))


def _diff(after: dict, before: dict) -> dict:
    return {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}


def test_prefill_under_load_and_penalties_on_the_forward_thread_equal_stock(runs):
    stock, fast = runs["stock"], runs["async"]
    for key in ("penalties", "arrivals", "penalty_arrivals"):
        assert fast[key] == stock[key], key
    # the penalties really act (else the comparison could not fail on them)
    assert all(p != g for p, g in zip(stock["penalties"][:3], stock["greedy"][:3], strict=True))
    assert len(stock["penalties"][3]) >= 28  # min_new_tokens held EOS back
    assert stock["arrivals"]["late"] == [stock["greedy"][k] for k in (1, 2, 3)]  # batch-invariant greedy
    ft = fast["internal"]["branchwise_forward_thread"]
    assert ft["features"].get("decode: penalties", 0) > 10 and ft["features"].get("extend: penalties", 0) > 0


def test_grammar_rows_sample_on_the_forward_thread_and_equal_stock(runs):
    stock, fast = runs["stock"], runs["async"]
    for key in ("grammar", "grammar_mixed", "grammar_arrivals"):
        assert fast[key] == stock[key], key
    for _, text, _ in stock["grammar"][::2]:  # the regex really constrained the output
        assert re.fullmatch(REGEX, text), text
    assert stock["grammar_mixed"][1] == stock["greedy"][1]
    assert stock["grammar_mixed"][0] == stock["grammar"][0][0]  # a grammar row does not depend on its batch
    ft = fast["internal"]["branchwise_forward_thread"]
    # forward and sampling on the worker, mask built on the scheduler thread: nothing drained for grammar
    assert ft["features"].get("decode: grammar", 0) > 10 and ft["features"].get("extend: grammar", 0) > 0, ft
    assert ft["samples"] == sum(n for k, n in ft["features"].items() if k.endswith(": grammar")), ft
    assert ft["reasons"] == {}, ft["reasons"]


def test_server_fork_spawns_and_joins_run_on_the_forward_thread(runs):
    stock, fast = runs["stock"]["fork"], runs["async"]["fork"]
    assert stock["finish"]["type"] == "stop" and stock["fanouts"] == [3]
    assert fast["ids"] == stock["ids"] and fast["finish"] == stock["finish"] and fast["fanouts"] == [3]
    before, after = fast["ft"]
    feats, reasons = _diff(after["features"], before["features"]), _diff(after["reasons"], before["reasons"])
    # parent prefill, the branches' spawn prefill(s) and the join prefill, driven by the custom processor
    assert feats.get("extend: custom logit processor", 0) >= 3, feats
    assert feats.get("decode: custom logit processor", 0) > 10, feats
    assert reasons == {}, reasons  # nothing of the fork ran inline
    assert stock["ft"] == (None, None)


def test_mixed_chunked_prefill_on_the_forward_thread_equals_stock(runs):
    stock, fast = runs["stock-mixed"], runs["async-mixed"]
    assert fast["arrivals"] == stock["arrivals"] and fast["again"] == stock["again"]
    assert _logprob_ids(fast["input_logprobs"]) == _logprob_ids(stock["input_logprobs"])
    assert _close(_logprob_values(fast["input_logprobs"]), _logprob_values(stock["input_logprobs"]))
    lp = stock["input_logprobs"][0][1]
    assert len(lp) > 3 and lp[0][0] is None and all(isinstance(x[0], float) for x in lp[1:])
    assert stock["arrivals"]["late"][0] == stock["again"]["late"][3]  # same prompt, other arrival order
    assert fast["idle"]["num_used_tokens"] == stock["idle"]["num_used_tokens"] == 0
    ft = fast["internal"]["branchwise_forward_thread"]
    assert ft["modes"].get("mixed", 0) > 0, ft  # running rows took their last token on the worker
    assert ft["features"].get("extend: logprobs", 0) > 0
    # unfinished chunks ran on the worker too (their checkpoint at the next planning is guarded)
    assert ft["features"].get("extend: chunked prefill", 0) + ft["features"].get("mixed: chunked prefill", 0) > 0
    assert ft["inline"] == 0 and ft["reasons"] == {}, ft["reasons"]
    assert "branchwise_forward_thread" not in stock["internal"]


def test_streaming_order_preserved_with_async_output(runs):
    chunks = runs["async"]["stream"]
    assert len(chunks) > 2
    lens = [len(ids) for _, ids, _ in chunks]
    assert lens == sorted(lens) and lens[-1] == GREEDY["max_new_tokens"]
    texts = [t for t, _, _ in chunks]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:], strict=False))
    assert chunks[-1][1] == runs["stock"]["greedy"][1]  # the stream ends where the batch request did
    assert [f for _, _, f in chunks[:-1]] == [None] * (len(chunks) - 1) and chunks[-1][2]["type"] == "length"


def test_abort_mid_stream_with_async_output_frees_kv(runs):
    ab = runs["async"]["abort"]
    assert ab["finish"]["type"] == "abort"
    assert 3 <= ab["tokens"] < 1500
    assert ab["idle"]["num_used_tokens"] == 0


def test_parallel_sampling_tp2_equals_single_rank_and_async_output_on_off(runs):
    one, two = runs["async"]["sp"], runs["sp2"]["sp"]
    assert two["greedy"] == one["greedy"] == runs["stock"]["greedy"]
    assert two["seeded"] == one["seeded"]
    assert two["seeded_arrivals"] == one["seeded_arrivals"]
    assert two["seeded_arrivals"]["late"][0] == two["seeded"][1]  # a row's draw does not depend on when it came
    assert two["unseeded"] == one["unseeded"]
    assert two["seeded_alone"] == two["seeded"][2]  # a row's draw does not depend on its batch
    assert two["other_seeds"] != two["seeded"]
    assert len({tuple(x) for x in two["unseeded"]}) == 3
    assert [r["output_ids"] for r in two["logprobs"]] == [g[:8] for g in two["greedy"][:2]]
    for name in ("async", "sp2"):
        rep = runs[name]["internal"]["branchwise_parallel_sampling"]
        assert rep["sp_steps"] > 0 and rep["fallbacks"].get("logprobs requested", 0) > 0
    assert runs["sp2"]["internal"]["branchwise_parallel_sampling"]["tp_size"] == 2
    assert "branchwise_async_output" not in runs["sp2"]["internal"]
    assert two["grammar"] == one["grammar"] == [g[0] for g in runs["stock"]["grammar"][:2]]


def test_forward_thread_under_tp2_equals_single_rank(runs):
    """Every rank runs its forwards (and the sampler's all-to-all) on its own worker thread."""
    one, two = runs["async"]["sp"], runs["sp2-async"]["sp"]
    for key in ("greedy", "seeded", "seeded_arrivals", "seeded_alone", "other_seeds", "unseeded", "grammar"):
        assert two[key] == one[key], key
    assert [r["output_ids"] for r in two["logprobs"]] == [r["output_ids"] for r in one["logprobs"]]
    internal = runs["sp2-async"]["internal"]
    ft = internal["branchwise_forward_thread"]
    assert ft["enabled"] and ft["modes"]["decode"] > 20 and ft["modes"]["extend"] > 5, ft
    assert ft["samples"] > 0 and ft["inline"] == 0 and ft["reasons"] == {}, ft
    rep = internal["branchwise_parallel_sampling"]
    assert rep["tp_size"] == 2 and rep["a2a_steps"] > 0, rep
