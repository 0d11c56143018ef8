"""--parallel-sampling at tp=2: decode logits come through the all-to-all, outputs equal tp=1.

Two servers, one alive at a time:
  ref  tp=1, --parallel-sampling (no collective at all; logprobs requests take SGLang's sampler)
  a2a  tp=2, --parallel-sampling (overlap scheduling on): each rank receives full-vocab logits for
       its ceil(bs/2) rows only, samples them and all-gathers the ids
Greedy rows at tp=2 are compared with SGLang's own sampler at tp=1 (the reference's greedy requests
carry return_logprob, which routes them to the stock sampler). Seeded rows are compared with the
tp=1 parallel sampler: SGLang itself honours per-request seeds only under
--enable-deterministic-inference, which CPU attention does not support. Batch sizes 5 and 1 are
not multiples of t (padding rows; at bs=1 rank 1 samples padding only). Penalty and logit_bias
batches also come through the all-to-all (each rank applies them to its own rows) and equal tp=1,
where they are applied to full rows by SGLang itself. Unseeded requests draw independently (each
gets a seed from its rid and a nonce shared by the ranks): the n samples of an n = 4 request differ,
and so do two identical requests; with the same --random-seed and client rids, tp=2 equals tp=1.
"""

from __future__ import annotations

from typing import Any

import pytest

from branchwise.tools.launch import merged_state, post_json

# eager pins which token a penalised row cumulates each step (deferral._pinned_cumulate): under overlap
# SGLang's own rule takes output_ids[-1], whose lag shifts when a prefill step lands between decode
# steps, so penalised outputs would depend on arrival timing. Without penalties eager runs SGLang's
# own paths.
PIN = ("--branch-policy", "eager")
PROMPTS = [f"row {i}: the answer is" for i in range(5)]
GREEDY = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}
# one batch mixing every sampling path: greedy, plain temperature, top-k, top-p, min-p, all three
KINDS = [{"temperature": 0}, {"temperature": 1.0}, {"temperature": 0.8, "top_k": 20},
         {"temperature": 0.9, "top_p": 0.8}, {"temperature": 1.1, "min_p": 0.05, "top_k": 40, "top_p": 0.95}]
SEEDED = [k | {"max_new_tokens": 16, "ignore_eos": True, "sampling_seed": 500 + i} for i, k in enumerate(KINDS)]
# penalties and logit_bias go through the all-to-all too: each rank applies them to its own rows
PENALTY = GREEDY | {"frequency_penalty": 1.5, "logit_bias": {"441": -30.0}}
# the seeded mixed batch again, every row with a different penalty (one row none); bs 5 pads rank 1
PENALTIES = [{"repetition_penalty": 1.3}, {"presence_penalty": 0.8, "frequency_penalty": 0.3},
             {"min_new_tokens": 12, "repetition_penalty": 0.9}, {"logit_bias": {"441": 8.0, "17": -5.0}}, {}]
PENALTY_MIXED = [s | pen for s, pen in zip(SEEDED, PENALTIES, strict=True)]
UNSEEDED = [k | {"max_new_tokens": 16, "ignore_eos": True} for k in KINDS]
N4 = UNSEEDED[1] | {"n": 4}  # temperature 1


def gen(url: str, text: Any, sp: Any, **extra: Any) -> Any:
    return post_json(url + "/generate", {"text": text, "sampling_params": sp, **extra})


def ids(res: Any) -> list[list[int]]:
    return [r["output_ids"] for r in res]


def sp_report(url: str) -> dict[str, Any]:
    return merged_state(url)["branchwise_parallel_sampling"]


def workload(url: str, stock_greedy: bool) -> dict[str, Any]:
    logprob = {"return_logprob": True} if stock_greedy else {}
    out: dict[str, Any] = {
        "greedy": ids(gen(url, PROMPTS, GREEDY, **logprob)),
        "greedy1": gen(url, PROMPTS[3], GREEDY, **logprob)["output_ids"],
        "seeded": ids(gen(url, PROMPTS, SEEDED)),
        "seeded1": gen(url, PROMPTS[4], SEEDED[4])["output_ids"],
        "penalty": ids(gen(url, PROMPTS[:3], PENALTY)),
        "penalty_mixed": ids(gen(url, PROMPTS, PENALTY_MIXED)),
        "n4": ids(gen(url, PROMPTS[1], N4)),
        "seeded_n4": ids(gen(url, PROMPTS[1], N4 | {"sampling_seed": 7})),
        "twice": [gen(url, PROMPTS[2], UNSEEDED[1])["output_ids"] for _ in range(2)],
        "unseeded_rids": ids(gen(url, PROMPTS, UNSEEDED, rid=[f"u{i}" for i in range(len(PROMPTS))])),
    }
    out["before_logprobs"] = sp_report(url)
    out["logprobs"] = ids(gen(url, PROMPTS[:3], GREEDY, return_logprob=True))
    out["after"] = sp_report(url)
    return out


@pytest.fixture(scope="module")
def runs(servers) -> dict[str, dict[str, Any]]:
    got: dict[str, dict[str, Any]] = {}
    for name, tp in (("ref", 1), ("a2a", 2)):
        srv = servers.get("--random-seed", "0", "--parallel-sampling", *PIN, tp=tp)
        try:
            got[name] = workload(srv.url, stock_greedy=tp == 1)
        finally:
            servers.stop(srv)
    return got


def test_tp2_all_to_all_outputs_equal_tp1(runs):
    ref, a2a = runs["ref"], runs["a2a"]
    assert a2a["greedy"] == ref["greedy"]  # ref: SGLang's own sampler (logprobs requested)
    assert a2a["greedy1"] == ref["greedy1"] == ref["greedy"][3]
    assert a2a["seeded"] == ref["seeded"]
    assert a2a["seeded1"] == ref["seeded1"] == ref["seeded"][4]  # a row's draw does not depend on its batch
    assert a2a["seeded"][0] == ref["greedy"][0]  # the temperature-0 row of the mixed batch is greedy
    assert len({tuple(x) for x in a2a["seeded"]}) == len(SEEDED)
    assert a2a["penalty"] == ref["penalty"] and a2a["penalty"] != ref["greedy"][:3]
    assert a2a["penalty_mixed"] == ref["penalty_mixed"] and a2a["penalty_mixed"] != ref["seeded"]
    assert a2a["penalty_mixed"][4] == ref["seeded"][4]  # the row without penalties: its own draw
    assert a2a["logprobs"] == ref["greedy"][:3]


@pytest.mark.parametrize("name", ["ref", "a2a"])
def test_unseeded_samples_are_independent_seeded_ones_reproducible(runs, name):
    run = runs[name]
    assert len(run["n4"]) == 4 and len({tuple(x) for x in run["n4"]}) == 4  # n = 4, temperature 1
    assert run["twice"][0] != run["twice"][1]  # the same unseeded request twice
    assert len({tuple(x) for x in run["seeded_n4"]}) == 1  # one seed, one text
    assert run["seeded_n4"][0] not in run["n4"]


def test_unseeded_rows_get_the_same_seed_on_every_rank(runs):
    # the seed is a function of (--random-seed, rid) only: rank 1 samples its rows with rank 0's nonce
    assert runs["a2a"]["unseeded_rids"] == runs["ref"]["unseeded_rids"]
    assert runs["a2a"]["seeded_n4"] == runs["ref"]["seeded_n4"]


def test_tp2_counters_show_all_to_all_and_fallbacks(runs):
    before, after = runs["a2a"]["before_logprobs"], runs["a2a"]["after"]
    assert before["tp_size"] == 2
    # greedy, seeded, penalties: 2 + 2 + 2 batched requests x 15 decode steps each, all through the
    # all-to-all; the 2 penalty batches with penalties/bias applied to each rank's rows
    assert before["a2a_steps"] >= 6 * 15
    assert before["a2a_transform_steps"] >= 2 * 15
    assert not any("penalt" in why for why in before["gathered"]), before["gathered"]
    # a logprobs request: SGLang's sampler on all-gathered logits, never the all-to-all
    assert after["a2a_steps"] == before["a2a_steps"]
    got = after["fallbacks"].get("logprobs requested", 0) - before["fallbacks"].get("logprobs requested", 0)
    assert got >= 15
    ref = runs["ref"]["after"]
    assert ref["tp_size"] == 1 and ref["a2a_steps"] == ref["a2a_transform_steps"] == 0 and ref["gathered"] == {}
