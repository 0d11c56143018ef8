"""Penalised branch rows that sit out steps under --branch-policy serial equal runs alone.

Under policy serial a phase decodes one branch per step (width 1), so its other branches are deferred
while the first decodes and resume later. SGLang's overlap rule feeds the penalizers the newest
processed token, which for a row that sat out the previous step is a token it already counted
(deferral._pinned_cumulate). Each branch here, decoded with its siblings, must produce the tokens
the same prompt and sampling parameters produce alone (greedy).
"""

from __future__ import annotations

from typing import Any

from branchwise.request_meta import stamp
from branchwise.tools.launch import branchwise_report, post_json

FANOUT = 3
PENALTIES = [{"frequency_penalty": 1.5}, {"presence_penalty": 1.5},
             {"frequency_penalty": 0.8, "presence_penalty": 0.8, "repetition_penalty": 1.3}]
BASE = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}


def prompt(b: int) -> str:
    return f"program {b}: the plan then"


def alone(url: str, b: int, penalties: bool = True) -> list[int]:
    sp = BASE | (PENALTIES[b] if penalties else {})
    return post_json(url + "/generate", {"text": prompt(b), "sampling_params": sp})["output_ids"]


def siblings(url: str) -> list[list[int]]:
    """One phase of FANOUT branches in one batch (one prefill); each branch its own penalties."""
    sps = [stamp(BASE | PENALTIES[b], phase="pin0", branch=b, fanout=FANOUT) for b in range(FANOUT)]
    outs = post_json(url + "/generate", {"text": [prompt(b) for b in range(FANOUT)],
                                         "rid": [f"pin0/b{b}" for b in range(FANOUT)], "sampling_params": sps})
    return [o["output_ids"] for o in outs]


def deferred_rows(url: str) -> int:
    rep: dict[str, Any] = branchwise_report(url)
    assert rep["config"]["branch_policy"] == "serial"
    return rep["taper"]["rows_deferred"]


def test_deferred_penalised_branches_equal_their_serial_runs(servers):
    srv = servers.get("--branch-policy", "serial")  # overlap scheduling on (the default); test_client_fork's server
    url = srv.url
    serial = [alone(url, b) for b in range(FANOUT)]
    before = deferred_rows(url)
    got = siblings(url)
    # every step ran one branch of the phase: the others sat out, each for at least 24 steps
    assert deferred_rows(url) - before >= (FANOUT - 1) * BASE["max_new_tokens"]
    assert got == serial
    # the penalties act (else the comparison could not fail on them); a penalty changes a greedy
    # output only where the model would repeat a token, so not necessarily in every branch
    assert any(s != alone(url, b, penalties=False) for b, s in enumerate(serial))
