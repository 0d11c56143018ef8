"""Which token a decode row feeds SGLang's penalizers when rows can sit out steps (deferral.py).

Plain stand-ins for Req/ScheduleBatch carry exactly the fields the rule reads; the end-to-end
check (outputs with penalties identical to eager while rows are deferred) is in
tests/integration/test_taper.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

from branchwise import deferral


@dataclass
class FakeReq:
    origin_input_ids: list[int]
    output_ids: list[int] = field(default_factory=list)
    decoded: int = 0  # decode steps run: each commits the KV of one input token

    @property
    def kv(self) -> SimpleNamespace:
        return SimpleNamespace(kv_committed_len=len(self.origin_input_ids) + self.decoded)


class Orchestrator:
    def __init__(self) -> None:
        self.fed: list[list[int]] = []

    def cumulate_output_tokens(self, ids) -> None:
        self.fed.append(ids.tolist())


def batch_of(*reqs: FakeReq, pool: SimpleNamespace | None = None) -> SimpleNamespace:
    return SimpleNamespace(reqs=list(reqs), device="cpu", req_to_token_pool=pool or SimpleNamespace(),
                           sampling_info=SimpleNamespace(penalizer_orchestrator=Orchestrator()))


def overlap_schedule(runs: list[bool], pinned: bool) -> list[int]:
    """One row under the overlap loop: at step s the results of steps <= s-2 are processed.
    runs[s]: whether the row runs at decode step s. Its k-th token is 100 + k (the prefill's is
    100), so rows with different schedules are comparable token by token."""
    req = FakeReq([7, 8, 9])
    produced: list[tuple[int, int]] = [(0, 100)]  # (step, token); the prefill runs at step 0
    fed: list[int] = []
    scheduler = SimpleNamespace(req_to_token_pool=SimpleNamespace())  # every batch of a scheduler shares it
    if pinned:
        deferral.pin_penalty_tokens(scheduler)
    for s, run in enumerate(runs, start=1):
        req.output_ids = [t for step, t in produced if step <= s - 2]
        if not run:
            continue
        b = batch_of(req, pool=scheduler.req_to_token_pool)
        deferral.around_cumulate_penalty_output_tokens(lambda b: stock_rule(b), b)
        fed += b.sampling_info.penalizer_orchestrator.fed[0]
        req.decoded += 1
        produced.append((s, 100 + len(produced)))
    return fed


def stock_rule(batch) -> None:
    """SGLang's ScheduleBatch.cumulate_penalty_output_tokens."""
    import torch

    last = [r.output_ids[-1] if r.output_ids else r.origin_input_ids[-1] for r in batch.reqs]
    batch.sampling_info.penalizer_orchestrator.cumulate_output_tokens(torch.tensor(last))


def test_eager_rows_feed_what_sglang_feeds():
    assert overlap_schedule([True] * 5, pinned=True) == overlap_schedule([True] * 5, pinned=False)


@pytest.mark.parametrize("runs", [[True, True, False, True, True, True],
                                  [False, True, False, False, True, True, False, True],
                                  [True, False, True, False, True, False, True]])
def test_a_deferred_row_feeds_the_same_sequence_as_an_eager_one(runs):
    eager = overlap_schedule([True] * sum(runs), pinned=False)
    assert overlap_schedule(runs, pinned=True) == eager  # one token per run, in order
    assert overlap_schedule(runs, pinned=False) != eager  # SGLang's rule double-counts after a gap


def test_without_pinning_sglangs_rule_runs():
    req = FakeReq([7, 8, 9], output_ids=[100, 101, 102], decoded=2)  # non-overlap: all processed
    b = batch_of(req)
    deferral.around_cumulate_penalty_output_tokens(stock_rule, b)
    assert b.sampling_info.penalizer_orchestrator.fed == [[102]]


def test_pinning_belongs_to_the_scheduler_whose_batch_it_is():
    """The switch sits on a scheduler's ReqToTokenPool, which every batch of that scheduler shares:
    pinning one scheduler leaves another's batches on SGLang's rule."""
    pinned, plain = SimpleNamespace(req_to_token_pool=SimpleNamespace()), SimpleNamespace(req_to_token_pool=SimpleNamespace())
    deferral.pin_penalty_tokens(pinned)
    fed = {}
    for name, sched in (("pinned", pinned), ("plain", plain)):
        b = batch_of(FakeReq([7, 8, 9], output_ids=[100, 101, 102], decoded=2), pool=sched.req_to_token_pool)
        deferral.around_cumulate_penalty_output_tokens(stock_rule, b)
        fed[name] = b.sampling_info.penalizer_orchestrator.fed
    assert fed == {"pinned": [[101]], "plain": [[102]]}  # a row that sat out its previous step
