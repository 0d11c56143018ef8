"""The scheduler hook's controller wiring (no SGLang): keys leave the controller with their last row,
the queue length reaches select, and a failure on rank 0 still yields a decision (every row)."""

from __future__ import annotations

from types import SimpleNamespace

from branchwise import request_meta, runtime
from branchwise import scheduler_hook as sh
from branchwise.config import BranchwiseConfig
from branchwise.taper.controller import StepController
from branchwise.taper.policies import parse_policy
from branchwise.taper.predictor import LinearLatencyModel

MODEL = LinearLatencyModel(c0=2e-3, c_seq=1e-3, c_ctx=0.0)


def req(rid: str, phase: str | None = None, branch: int = 0, done: bool = False) -> SimpleNamespace:
    meta = request_meta.RequestMeta(phase=phase, branch=branch, fanout=2) if phase else request_meta.SERIAL
    return SimpleNamespace(rid=rid, bw_meta=meta, kv=SimpleNamespace(kv_committed_len=50), to_finish=None,
                           finished=lambda: done)


def decode_batch(reqs: list, it: int) -> SimpleNamespace:
    return SimpleNamespace(reqs=reqs, forward_mode=SimpleNamespace(is_decode=lambda: True, is_mixed=lambda: False),
                           forward_iter=it, launch_ts=0.01 * it, is_empty=lambda: not reqs)


def scheduler(policy: str = "eager") -> SimpleNamespace:
    st = sh.BranchwiseState(config=BranchwiseConfig(branch_policy=policy),
                            controller=StepController(parse_policy(policy, model=MODEL)))
    st.phases_seen = True
    return SimpleNamespace(branchwise=runtime.Branchwise(config=st.config, state=st), waiting_queue=[], running_batch=None)


def test_keys_leave_the_controller_with_their_last_row():
    """Under eager nothing is ever deferred; 2,000 short phases (one id reused) and serial requests
    leave no tracker behind. A branch that finishes while its sibling still runs keeps the key."""
    s = scheduler()
    ctl = s.branchwise.state.controller
    it = 0
    for p in range(2_000):
        rows = [req(f"p{p}/0", f"ph{p % 7}", 0), req(f"p{p}/1", f"ph{p % 7}", 1), req(f"r{p}")]
        s.running_batch = SimpleNamespace(reqs=rows)
        for _ in range(2):
            assert sh._decide(s.branchwise.state, s, [sh._row(r, s.branchwise.state.config) for r in rows]) == [0, 1, 2]
            sh.after_process_batch_result(None, s, decode_batch(rows, it))
            it += 1
        first_done = [req(f"p{p}/0", f"ph{p % 7}", 0, done=True), rows[1], rows[2]]
        s.running_batch = SimpleNamespace(reqs=first_done)
        sh.after_process_batch_result(None, s, decode_batch(first_done, it))
        it += 1
        assert sh._key(rows[1]) in ctl.trackers  # its sibling is still running
        done = [req(f"p{p}/1", f"ph{p % 7}", 1, done=True), req(f"r{p}", done=True)]
        s.running_batch = SimpleNamespace(reqs=done)
        sh.after_process_batch_result(None, s, decode_batch(done, it))
        it += 1
        assert ctl.trackers == {} and ctl.fixed == {}


def test_queue_length_reaches_the_controller():
    s = scheduler("taper")
    seen = []
    select = s.branchwise.state.controller.select

    def spy(rows, now, bubble=False, *, waiting=0):
        seen.append(waiting)
        return select(rows, now, bubble, waiting=waiting)

    s.branchwise.state.controller.select = spy
    s.waiting_queue = [object()] * 3
    rows = [req("a/0", "ph", 0), req("a/1", "ph", 1), req("s")]
    sh._decide(s.branchwise.state, s, [sh._row(r, s.branchwise.state.config) for r in rows])
    assert seen == [3]


def test_a_failure_on_rank0_runs_every_row_and_counts_it(caplog):
    s = scheduler("taper")
    st = s.branchwise.state
    st.controller.quiet_ts = 1.0

    def broken(*args, **kwargs):
        raise RuntimeError("clock bug")

    st.controller.on_step_done = broken  # resume_serial_clocks raises before select
    rows = [sh._row(r, st.config) for r in (req("a/0", "ph", 0), req("a/1", "ph", 1), req("s"))]
    with caplog.at_level("ERROR", logger="branchwise"):
        assert sh._decide(st, s, rows) == [0, 1, 2]
        assert sh._decide(st, s, rows) == [0, 1, 2]
    assert st.counters["decide_errors"] == 2
    assert sum("branch admission failed" in r.getMessage() for r in caplog.records) == 1
