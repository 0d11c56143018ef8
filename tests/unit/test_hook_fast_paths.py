"""Always-on hooks stay out of the way of batches that do not use Branchwise (issue 5: their cost).

Serial-only batches skip TAPER's per-row work (and resume the serial rows' delivery clocks when a
phase row joins), the output-stream filter does not scan rows before any request is tracked, and
server-side fork's per-token hook sits on the tracked Req instances only.
"""

from __future__ import annotations

import os
from array import array
from types import SimpleNamespace

import pytest

from branchwise import request_meta, runtime
from branchwise import scheduler_hook as sh
from branchwise.config import BranchwiseConfig
from branchwise.fork import hooks as fork
from branchwise.fork import lifecycle
from branchwise.taper.controller import StepController
from branchwise.taper.policies import parse_policy
from branchwise.taper.predictor import LinearLatencyModel, OnlineRefit

MODEL = LinearLatencyModel(c0=2e-3, c_seq=1e-3, c_ctx=0.0)


def req(rid: str, phase: str | None = None, branch: int = 0, ctx: int = 100) -> SimpleNamespace:
    meta = request_meta.RequestMeta(phase=phase, branch=branch, fanout=4) if phase else request_meta.SERIAL
    return SimpleNamespace(rid=rid, bw_meta=meta, kv=SimpleNamespace(kv_committed_len=ctx), to_finish=None,
                           finished=lambda: False)


def decode_batch(reqs: list, it: int) -> SimpleNamespace:
    """No sampling_info: a hook that reaches deferral's per-batch checks fails loudly."""
    return SimpleNamespace(reqs=reqs, forward_mode=SimpleNamespace(is_decode=lambda: True, is_mixed=lambda: False),
                           forward_iter=it, launch_ts=0.01 * it, is_empty=lambda: not reqs)


def scheduler(policy: str = "taper") -> SimpleNamespace:
    cfg = BranchwiseConfig(branch_policy=policy)
    policy_ = parse_policy(policy, model=MODEL)
    st = sh.BranchwiseState(config=cfg, controller=StepController(policy_, OnlineRefit(policy_.model)))
    return SimpleNamespace(branchwise=runtime.Branchwise(config=st.config, state=st))


def test_serial_batches_skip_per_row_bookkeeping_but_count_rows():
    s = scheduler()
    st, ctl = s.branchwise.state, s.branchwise.state.controller
    for it in range(3):
        sh.after_process_batch_result(None, s, decode_batch([req("a"), req("b")], it))
    assert ctl.trackers == {}  # no per-request state for serial-only steps
    assert ctl.stats.rows_run == 6
    assert st.last_step is not None and st.last_step.ctx == 200  # the refit still sees the steps


def test_serial_batches_pass_update_running_batch_through_untouched():
    s = scheduler()
    calls = []

    def orig(self, batch):
        calls.append(batch)
        return batch

    b = decode_batch([req("a"), req("b")], 0)
    assert sh.around_update_running_batch(orig, s, b) is b and calls == [b]
    s.branchwise.state.phases_seen = True  # a phase request exists elsewhere; this batch is still serial
    assert sh.around_update_running_batch(orig, s, b) is b and len(calls) == 2


def test_phase_rows_restart_bookkeeping_and_serial_clocks_resume_at_the_last_quiet_step():
    s = scheduler()
    st, ctl = s.branchwise.state, s.branchwise.state.controller
    st.phases_seen = True
    mixed = [req("a"), req("p/0", "ph", 0), req("p/1", "ph", 1)]
    sh.after_process_batch_result(None, s, decode_batch(mixed, 0))
    assert set(ctl.trackers) == {"rid:a", "phase:ph"} and ctl.trackers["phase:ph"].phase_tokens == 2
    # the phase leaves the batch: serial clocks would go stale, so they are dropped; the phase's kept
    sh.after_process_batch_result(None, s, decode_batch([req("a"), req("b")], 1))
    assert set(ctl.trackers) == {"phase:ph"} and ctl.quiet_ts is not None
    quiet = ctl.quiet_ts
    sh.after_process_batch_result(None, s, decode_batch([req("a"), req("b")], 2))
    assert ctl.quiet_ts > quiet
    quiet = ctl.quiet_ts
    # a phase rejoins: the plan sees the serial rows as delivered at the last quiet step
    rows = [sh._row(r, st.config) for r in [req("a"), req("q/0", "q", 0), req("q/1", "q", 1)]]
    active = sh._decide(st, None, rows)
    assert ctl.trackers["rid:a"].last_token_s == quiet and ctl.quiet_ts is None
    assert 0 in active  # the serial row is protected


def test_stream_filter_does_not_scan_before_anything_is_tracked():
    mgr = SimpleNamespace(tracking=False)  # fork.build hangs the manager on the shared tree cache
    streamer = SimpleNamespace(tree_cache=SimpleNamespace(_branchwise_fork=mgr))
    seen = []
    reqs = [SimpleNamespace(bw_fork=SimpleNamespace(branch=True))]  # would be filtered if scanned

    def orig(self, rs, *args):
        seen.append(rs)

    fork.around_stream_output(orig, streamer, reqs)
    assert seen[-1] is reqs
    mgr.tracking = True
    fork.around_stream_output(orig, streamer, reqs)
    assert seen[-1] == []  # a branch row never reaches the detokenizer


@pytest.fixture(scope="module")
def sglang_req():
    os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    def make(rid: str) -> Req:
        sp = SamplingParams(max_new_tokens=2, ignore_eos=True)
        sp.normalize(None)  # stop lists as SGLang's tokenizer manager leaves them
        return Req(rid, "x", array("q", [1, 2, 3]), sp, vocab_size=100)

    return make


def test_fork_token_hook_runs_on_tracked_requests_only(sglang_req, monkeypatch):
    tracked, plain = sglang_req("t"), sglang_req("p")
    seen = []
    monkeypatch.setattr(lifecycle, "on_tokens",
                        lambda mgr, t: seen.append((len(t.req.output_ids), t.req.finished())))
    tracked.bw_fork = SimpleNamespace(mgr=SimpleNamespace(), req=tracked)
    lifecycle.hook_tracked_request(tracked)
    for r in (tracked, plain):
        for tok in (7, 8):
            r.output_ids.append(tok)
            r.update_finish_state(1)
    # after SGLang's own check on every step (finished by length at the 2nd token), tracked only
    assert seen == [(1, False), (2, True)]
    assert plain.finished() and "update_finish_state" not in vars(plain)


def test_the_refit_sees_the_rows_taper_deferred_not_the_rows_that_left():
    """A deferring step's record is keyed by its forward iteration, not carried on the batch (the
    overlap loop reports a copy of it); rows finishing in flight (in the running batch, not in the
    sub-batch) are not deferred rows."""
    s = scheduler()
    st = s.branchwise.state
    st.phases_seen = True
    rows = [req("a"), req("p/0", "ph", 0), req("p/1", "ph", 1), req("p/2", "ph", 2), req("done")]
    s.running_batch = decode_batch(rows, 0)
    st.planned[1] = sh.PlannedStep(rows=2, deferred=2)  # p/1 and p/2; "done" was finishing
    sh.after_process_batch_result(None, s, decode_batch(rows[:2], 1))  # a fresh object, as copy() gives
    assert st.last_step is not None and st.last_step.deferred == 2 and st.planned == {}
    sh.after_process_batch_result(None, s, decode_batch(s.running_batch.reqs, 2))  # nothing deferred
    assert st.last_step.deferred == 0
    assert st.counters["subset_results"] == 1
    refit = st.report()["taper"]["refit"]
    assert refit["steps"] == 1 and refit["deferring_steps"] == 1  # the deferring step's latency came in


def _one_phase() -> tuple[SimpleNamespace, sh.BranchwiseState, list[SimpleNamespace]]:
    """A taper scheduler that has seen phases, and the two rows of one phase."""
    s = scheduler()
    s.branchwise.state.phases_seen = True
    return s, s.branchwise.state, [req("p/0", "ph", 0), req("p/1", "ph", 1)]


def test_a_deferring_step_without_a_decode_launch_after_it_is_counted_unmeasured():
    s, st, rows = _one_phase()
    st.planned[3] = sh.PlannedStep(rows=1, deferred=1)
    sh.after_process_batch_result(None, s, decode_batch(rows[:1], 3))
    assert st.report()["taper"]["refit"]["pending_deferring"] == 1
    prefill = decode_batch(rows, 4)
    prefill.forward_mode = SimpleNamespace(is_decode=lambda: False, is_mixed=lambda: False)
    sh.after_process_batch_result(None, s, prefill)
    assert st.counters["deferring_unmeasured"] == 1 and st.last_step is None


def test_a_planned_record_never_credits_another_batch():
    s, st, rows = _one_phase()
    st.planned[5] = sh.PlannedStep(rows=1, deferred=1)
    st.planned[2] = sh.PlannedStep(rows=1, deferred=1)  # a step whose result never came back
    sh.after_process_batch_result(None, s, decode_batch(rows, 5))  # two rows: not the planned step
    assert st.last_step.deferred == 0 and st.counters["planned_mismatch"] == 1 and st.planned == {}
