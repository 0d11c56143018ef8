"""Hostile input against a real server: arbitrary JSON in custom_params, in sampling_params and as
the whole /generate body. Every answer is 2xx or 4xx, /health stays OK after each request, and KV
usage returns to idle after each. Examples are derandomized and bounded (a fixed set, ~1-2 min on 2 cores);
shrinking is off because each shrink step is a server round trip."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import pytest
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

from branchwise.ingress.validate import MAX_N
from branchwise.request_meta import KEY, MetaError, parse
from branchwise.tools.launch import branchwise_report, get_json

ARGS = ("--branch-policy", "taper")
TIMEOUT_S = 60  # every HTTP call; a tame request takes well under a second
IDLE_DEADLINE_S = 60.0
MAX_NEW = 4
HYP = settings(deadline=None, derandomize=True, database=None, phases=(Phase.explicit, Phase.generate),
               suppress_health_check=list(HealthCheck))

SP_FIELDS = ("max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k", "min_p",
             "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n", "json_schema",
             "regex", "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens", "no_stop_trim",
             "stream_interval", "logit_bias", "sampling_seed", "custom_params", "beam_width", "watermark", "choice")
BODY_FIELDS = ("rid", "text", "input_ids", "stream", "sampling_params", "return_logprob", "logprob_start_len",
               "top_logprobs_num", "token_ids_logprob", "return_hidden_states", "return_text_in_logprobs",
               "image_data", "extra_key", "priority", "cache_salt", "lora_path", "session_params", "routing_key",
               "max_thinking_tokens", "session_id", "custom_logit_processor", "custom_labels",
               "return_prompt_token_ids", "return_sampling_mask", "routed_dp_rank", "input_embeds")
BW_FIELDS = ("phase", "branch", "fanout", "slo_tpot_ms", "weight", "grammar")
EDGE = [0, 1, -1, 2, 0.5, -0.5, 1e-3, 2**31 - 1, 2**31, 2**63 - 1, 2**63, 2**64, -(2**63) - 1, 10**30, 10**300,
        1e308, -1e308, "", "multiverse", "sprint", [], {}, [0], [-1], None, True, False]
# Standard JSON only: NaN/inf and integers past 1e308 are refused by the server's JSON parser
# before any of this code runs (a 400 too, covered by the unit test of request_meta.parse).
scalars = (st.none() | st.booleans() | st.integers(-(10**20), 10**20) | st.floats(allow_nan=False, allow_infinity=False)
           | st.text(max_size=8) | st.sampled_from(EDGE))
json_values = st.recursive(scalars, lambda k: st.lists(k, max_size=3) | st.dictionaries(st.text(max_size=6), k, max_size=3),
                           max_leaves=8)
bw_stamps = st.dictionaries(st.sampled_from(BW_FIELDS) | st.text(max_size=4), json_values, max_size=5)
custom_params = json_values | st.dictionaries(st.sampled_from((KEY, "x")), bw_stamps | json_values, max_size=2)
sampling_params = st.dictionaries(st.sampled_from(SP_FIELDS) | st.text(max_size=5), json_values | custom_params,
                                  max_size=5)
bodies = st.dictionaries(st.sampled_from(BODY_FIELDS) | st.text(max_size=5), json_values | sampling_params,
                         max_size=5)


def tame(sp):
    """Keep generation short: a positive or missing max_new_tokens becomes MAX_NEW, an n the server
    accepts at most 4. Wrong types, negative and too large values pass through (they must be refused)."""
    if not isinstance(sp, dict):
        return sp
    sp = dict(sp)
    m = sp.get("max_new_tokens")
    if m is None or (isinstance(m, int | float) and not isinstance(m, bool) and m > MAX_NEW):
        sp["max_new_tokens"] = MAX_NEW
    n = sp.get("n")
    if isinstance(n, int | float) and not isinstance(n, bool) and 4 < n <= MAX_N:
        sp["n"] = 4
    return sp


def tame_body(body: dict) -> dict:
    body = dict(body)
    sp = body.get("sampling_params")
    body["sampling_params"] = [tame(s) for s in sp] if isinstance(sp, list) else tame(sp if sp is not None else {})
    if isinstance(body.get("text"), list) and len(body["text"]) > 4:  # a batch of at most 4
        body["text"] = body["text"][:4]
    return body


def post(url: str, body: dict) -> tuple[int, str]:
    req = urllib.request.Request(url + "/generate", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=TIMEOUT_S) as r:
            return r.status, r.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")


def check(url: str, body: dict) -> tuple[int, str]:
    """Post one request: 2xx or 4xx, then the server is healthy and its KV back to idle."""
    status, text = post(url, body)
    assert 200 <= status < 300 or 400 <= status < 500, (status, text[:300], body)
    with urllib.request.urlopen(url + "/health", timeout=TIMEOUT_S) as r:
        assert r.status == 200, body
    wait_idle(url)
    return status, text


def wait_idle(url: str) -> dict:
    deadline = time.monotonic() + IDLE_DEADLINE_S
    while True:
        load = get_json(url + "/v1/loads", timeout=TIMEOUT_S)["loads"][0]
        busy = (load["num_used_tokens"], load["num_running_reqs"], load["num_waiting_reqs"])
        if not any(busy):
            return load
        assert time.monotonic() < deadline, f"KV not back to idle after {IDLE_DEADLINE_S:.0f} s: {load}"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def srv(servers):
    server = servers.get(*ARGS)
    yield server
    rep = branchwise_report(server.url)
    assert rep["counters"].get("meta_parse_bugs", 0) == 0, rep["counters"]


@settings(HYP, max_examples=30)
@given(cp=custom_params)
@example(cp=[1, 2])
@example(cp=["branchwise"])  # crashed the scheduler: TypeError in parse
@example(cp="xbranchwisey")  # crashed the scheduler: TypeError in parse
@example(cp=7)
@example(cp={KEY: {"fanout": 10**300}})
@example(cp={KEY: {"weight": 10**300, "slo_tpot_ms": 1e308}})
@example(cp={KEY: {"phase": "p", "branch": 2**31 - 2, "fanout": 2**31 - 1, "slo_tpot_ms": 1e-3, "weight": 0}})
@example(cp={KEY: {"grammar": "multiverse", "slo_tpot_ms": 1e9}})
def test_custom_params(srv, cp):
    """The answer follows request_meta.parse exactly: 400 with its message naming the field, else 200."""
    try:
        parse(cp)
        expected = None
    except MetaError as e:
        expected = str(e)
    status, text = check(srv.url, {"text": "hi", "sampling_params": {"max_new_tokens": MAX_NEW, "custom_params": cp}})
    if expected is None:
        assert status == 200, (status, text[:300], cp)
    else:
        # the field's part of the message: the server's JSON parser may print the value differently
        # (an integer past 64 bits arrives as a float)
        field = expected.split(", got ")[0]
        assert status == 400 and field in json.loads(text)["error"]["message"], (status, text[:300], expected)


@settings(HYP, max_examples=30)
@given(sp=sampling_params)
@example(sp={"choice": None})  # stock: SamplingParams() has no 'choice' (the API contract does): HTTP 500
@example(sp={"choice": ["a", "b"]})
@example(sp={"n": 2, "custom_params": {KEY: {"phase": "g", "fanout": 2}}})
@example(sp={"custom_params": {KEY: "x"}, "temperature": 0})
@example(sp={"stop_regex": "("})  # stock: re.error while normalizing: HTTP 500
@example(sp={"regex": "(a"})
@example(sp={"json_schema": "{"})
@example(sp={"ebnf": "root ::= ("})
@example(sp={"logit_bias": {"5": 1e308}})  # inf in the float32 logits
@example(sp={"logit_bias": {"5": 1e308, "6": -1e308}, "temperature": 0.5})
@example(sp={"logit_bias": {"7": 1e30}, "temperature": 2e-6})
@example(sp={"logit_bias": {"5": 3e38}, "temperature": 0.5})
@example(sp={"repetition_penalty": 1e-300, "ignore_eos": True})  # logit / ~0 = inf for a seen token
@example(sp={"repetition_penalty": 1e-40, "ignore_eos": True, "temperature": 1e-5})
@example(sp={"top_k": 2**62, "top_p": 1e-300, "min_p": 1.0})  # stock: int32 top_k tensor crashed the scheduler
@example(sp={"top_k": 2**31})
@example(sp={"min_new_tokens": 2**31, "max_new_tokens": None})
@example(sp={"stop_token_ids": [10**6], "min_new_tokens": 2})  # stock: penalizer scatter past the vocab
@example(sp={"stop_token_ids": [-1], "min_new_tokens": 2})
@example(sp={"n": 0})
@example(sp={"n": -1})
@example(sp={"n": 2**40})  # stock: a 2**40-element list of prompts (MemoryError)
@example(sp={"stop": [""], "min_new_tokens": 2})
def test_sampling_params(srv, sp):
    check(srv.url, {"text": "hi", "sampling_params": tame(sp)})


@settings(HYP, max_examples=30)
@given(body=bodies)
@example(body={"text": ["a", "b"], "sampling_params": [{"custom_params": {KEY: 1}}, {}]})
@example(body={"text": "hi", "stream": True, "sampling_params": {"custom_params": ["branchwise"]}})  # abort task
@example(body={"text": "hi", "session_params": {"bogus": 1}})  # stock: TypeError, HTTP 500
@example(body={"text": "hi", "session_params": {"id": "nope"}})
@example(body={"text": "hi", "return_logprob": True, "top_logprobs_num": 2**40})  # stock: topk past the vocab
@example(body={"text": "hi", "return_logprob": True, "logprob_start_len": -5})
@example(body={"text": "hi", "return_logprob": True, "logprob_start_len": 10**6, "token_ids_logprob": [1, 2]})
@example(body={"input_ids": [10**6]})
@example(body={"input_ids": [-1]})
@example(body={"input_ids": []})
@example(body={"text": ""})  # stock: no tokens (no BOS), a zero-length prefill crashed the scheduler
@example(body={"text": "hi", "rid": ["a", "b"]})
@example(body={"text": ["a", "a"], "rid": ["dup", "dup"]})
@example(body={"text": "hi", "lora_path": "nope"})
@example(body={"text": "hi", "custom_logit_processor": "not a processor"})
@example(body={"text": "hi", "return_hidden_states": True})
@example(body={"text": "hi", "priority": 2**70})
@example(body={"text": "hi", "max_thinking_tokens": -1})
@example(body={"text": "hi", "image_data": "not-an-image"})
@example(body={"text": "hi", "stream": True, "sampling_params": {"n": 2, "stop_regex": "("}})
@example(body={"text": "hi", "routed_dp_rank": 5})
def test_whole_body(srv, body):
    check(srv.url, tame_body(body))


@pytest.mark.parametrize("cp", [{KEY: {"fanout": 0}}, {KEY: "x"}, {KEY: {"weight": 10**300}}])
def test_openai_completions_route_names_the_field(srv, cp):
    """The OpenAI route builds the same GenerateReqInput: the same 400 before the scheduler."""
    req = urllib.request.Request(srv.url + "/v1/completions", data=json.dumps(
        {"prompt": "hi", "max_tokens": MAX_NEW, "custom_params": cp}).encode(),
        headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=TIMEOUT_S)
    assert e.value.code == 400
    assert "custom_params.branchwise" in e.value.read().decode()
    wait_idle(srv.url)
