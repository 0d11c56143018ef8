"""Albireo in SGLang: --async-output and --parallel-sampling leave every output byte-identical.

Three servers, each started once and stopped before the next (one alive at a time):
  stock   tp=1, Branchwise flags off (the reference)
  async   tp=1, --async-output --parallel-sampling and env BRANCHWISE_FORWARD_THREAD=1: on CPU decode
          forwards run on the forward thread (albireo/forward_thread.py), so every comparison covers it
  sp2     tp=2, --parallel-sampling --disable-overlap-schedule (async output off)
Seeded sampling means per-request `sampling_seed`: SGLang honours it only under
--enable-deterministic-inference (unavailable on CPU), --parallel-sampling always does, so seeded
outputs are compared between the two parallel-sampling servers: async output on vs off, tp=1 vs
tp=2 at once. Unseeded sampling draws from SGLang's global RNG, whose consumption depends on step
timing, so it is not compared across servers.
"""

from __future__ import annotations

import json
import time
import urllib.request
from typing import Any

import pytest

from branchwise.launch import get_json, post_json

PROMPTS = [f"request {i}: the plan is to" for i in range(6)]
GREEDY = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}
SERVERS = {  # name: (args, tp)
    "stock": ((), 1),
    "async": (("--async-output", "--parallel-sampling"), 1),
    "sp2": (("--parallel-sampling", "--disable-overlap-schedule"), 2),
}


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
    return get_json(url + "/server_info")["internal_states"][0]


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
    out["idle"] = wait_idle(url)  # rows that finished while the next step was planned freed their KV
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
    plain = {"max_new_tokens": 24, "temperature": 1.0, "ignore_eos": True}  # no seed given: SGLang's 42
    return {
        "greedy": [r["output_ids"] for r in gen(url, PROMPTS, GREEDY)],
        "seeded": [r["output_ids"] for r in gen(url, PROMPTS, seeded)],
        "seeded_alone": gen(url, PROMPTS[2], seeded[2])["output_ids"],
        "other_seeds": [r["output_ids"] for r in gen(url, PROMPTS, other)],
        "default_seed": [r["output_ids"] for r in gen(url, PROMPTS[:3], plain)],
        "logprobs": gen(url, PROMPTS[:2], GREEDY | {"max_new_tokens": 8}, return_logprob=True),
    }


@pytest.fixture(scope="module")
def runs(servers) -> dict[str, dict[str, Any]]:
    """Each server answers its workload once, then stops (at most one of these alive at a time)."""
    got: dict[str, dict[str, Any]] = {}
    for name, (args, tp) in SERVERS.items():
        env = {"BRANCHWISE_FORWARD_THREAD": "1"} if name == "async" else None  # opt-in CPU forward thread
        srv = servers.get("--random-seed", "0", *args, env=env, tp=tp)
        try:
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
    ft = fast["internal"]["branchwise_forward_thread"]  # decode forwards really ran on the thread
    assert ft["enabled"] and ft["jobs"] > 20 and ft["inline"] > 0  # prefills run inline
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
    assert two["default_seed"] == one["default_seed"]
    assert two["seeded_alone"] == two["seeded"][2]  # a row's draw does not depend on its batch
    assert two["other_seeds"] != two["seeded"]
    assert len({tuple(x) for x in two["default_seed"]}) == 3  # same seed, different prompts
    assert [r["output_ids"] for r in two["logprobs"]] == [g[:8] for g in two["greedy"][:2]]
    for name in ("async", "sp2"):
        rep = runs[name]["internal"]["branchwise_parallel_sampling"]
        assert rep["sp_steps"] > 0 and rep["fallbacks"].get("logprobs requested", 0) > 0
    assert runs["sp2"]["internal"]["branchwise_parallel_sampling"]["tp_size"] == 2
    assert "branchwise_async_output" not in runs["sp2"]["internal"]
