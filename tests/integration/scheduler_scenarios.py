"""Scenarios on a real SGLang scheduler in a child process (bench.deferral_cost.scheduler): the
tiny model, overlap scheduling, Branchwise's hooks. A process holds one scheduler and SGLang's
runtime context is process-wide, so tests run each scenario in its own process:

    python -m tests.integration.scheduler_scenarios SCENARIO [--no-kept]

prints one JSON line with what the scenario observed. --no-kept: a kept sub-batch never serves
(deferral.KeptSubset.serves is False), so every deferring step cuts a new one.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from bench.deferral_cost import add_request, iterate, scheduler
from branchwise import deferral
from branchwise.request_meta import SERIAL, RequestMeta

MODEL = os.environ.get("BRANCHWISE_TEST_MODEL", "models/tiny")


def _prompt(seed: int, n: int = 24) -> list[int]:
    return [1 + (seed * 37 + i * 11) % 400 for i in range(n)]


def admission(kept: bool) -> dict[str, Any]:
    """A running limit of 3 is full (a phase of 3 branches) and a serial request waits for a slot.
    Policy serial runs one branch per step; the first finishes while its siblings still defer, so it
    leaves the batch inside a deferring step. Reports the iterations from that branch's end to the
    waiting request's admission (SGLang admits it as soon as a slot is free)."""
    s = scheduler(MODEL, 8192, "serial", max_running_requests=3)
    branches = [add_request(s, f"ph/b{b}", _prompt(b), RequestMeta(phase="ph", branch=b, fanout=3),
                            max_new_tokens=24 if b == 0 else 400) for b in range(3)]
    for _ in range(4):  # the three prefill and decode: the phase fills the limit
        iterate(s)
    waiting = add_request(s, "serial", _prompt(9), SERIAL, max_new_tokens=8)
    for _ in range(4):
        iterate(s)
    out = {"full_before": bool(s.running_batch.batch_is_full), "queued_before": waiting in s.waiting_queue,
           "after_finish": None}
    since = None
    for it in range(200):
        iterate(s)
        if since is None and branches[0].finished():
            since = it
        if waiting in s.running_batch.reqs or waiting.finished():
            out["after_finish"] = None if since is None else it - since
            break
    out["deferred_steps"] = s.branchwise.state.counters.get("subset_steps", 0)
    out["siblings_left"] = sum(not b.finished() for b in branches[1:])
    return out


def _watch_full_batch() -> dict[str, Any]:
    """Marks `touched` when SGLang changes the tracked batch (`watch["batch"]`) on its own: rows
    leave or join (filter, merge, retraction) or it is prepared in full."""
    from sglang.srt.managers.schedule_batch import ScheduleBatch

    watch: dict[str, Any] = {"batch": None, "touched": False}

    def wrap(name: str) -> None:
        orig = getattr(ScheduleBatch, name)

        def method(self: Any, *a: Any, **kw: Any) -> Any:
            before = len(self.reqs)
            out = orig(self, *a, **kw)
            if self is watch["batch"] and (name != "filter_batch" or len(self.reqs) != before):
                watch["touched"] = True
            return out

        setattr(ScheduleBatch, name, method)

    for name in ("filter_batch", "merge_batch", "prepare_for_decode", "retract_decode"):
        wrap(name)
    return watch


def kept_subset(kept: bool) -> dict[str, Any]:
    """Deferring steps through every change a batch goes through: the same rows for a while,
    requests that arrive (merge), branches that finish, a deferred branch aborted (it must run),
    widths that change (policy switches), steps that run every row, a penalised row. Reports every
    request's tokens (they must not depend on whether a kept sub-batch served), how many steps a
    kept sub-batch served, and how many of those came after SGLang had changed the batch since
    the last deferring step (must be none)."""
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    from branchwise.taper.controller import StepController
    from branchwise.taper.policies import parse_policy

    s = scheduler(MODEL, 16384, "cap:2")
    st = s.branchwise.state
    reqs = [add_request(s, f"a/b{b}", _prompt(b), RequestMeta(phase="a", branch=b, fanout=4),
                        max_new_tokens=[80, 12, 60, 60][b], frequency_penalty=0.7 if b == 2 else 0.0)
            for b in range(4)]
    reqs += [add_request(s, f"c/b{b}", _prompt(10 + b), RequestMeta(phase="c", branch=b, fanout=3),
                         max_new_tokens=50) for b in range(3)]
    reqs.append(add_request(s, "s0", _prompt(20), SERIAL, max_new_tokens=30))
    watch = _watch_full_batch()
    seen = {"served": 0, "stale": 0}
    serves, run_subset = deferral.KeptSubset.serves, deferral.run_subset

    def spy(self: Any, batch: Any, idx: list[int]) -> bool:
        ok = kept and serves(self, batch, idx)
        if ok:
            seen["served"] += 1
            seen["stale"] += batch is not watch["batch"] or watch["touched"]
        return ok

    def tracked(scheduler_: Any, batch: Any, *a: Any) -> Any:
        sub = run_subset(scheduler_, batch, *a)
        watch["batch"], watch["touched"] = (batch if sub is not None else None), False
        return sub

    deferral.KeptSubset.serves, deferral.run_subset = spy, tracked
    switches = {30: "cap:3", 36: "eager", 38: "cap:2", 60: "cap:1", 70: "cap:2"}
    for it in range(600):
        if it == 10:
            reqs += [add_request(s, f"late/b{b}", _prompt(30 + b), RequestMeta(phase="late", branch=b, fanout=2),
                                 max_new_tokens=20) for b in range(2)]
        if it == 20:
            reqs[3].to_finish = FINISH_ABORT("test: abort a deferred branch")
        if it in switches:
            st.controller = StepController(parse_policy(switches[it]))
        if all(r.finished() for r in reqs) and s.running_batch.is_empty() and s.last_batch is None:
            break
        iterate(s)
    return {"tokens": {r.rid: list(r.output_ids) for r in reqs}, **seen,
            "finished": sum(r.finished() for r in reqs), "requests": len(reqs),
            "subset_steps": st.counters.get("subset_steps", 0)}


SCENARIOS = {"admission": admission, "kept_subset": kept_subset}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("scenario", choices=sorted(SCENARIOS))
    ap.add_argument("--no-kept", action="store_true")
    a = ap.parse_args()
    out = SCENARIOS[a.scenario](not a.no_kept)
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
