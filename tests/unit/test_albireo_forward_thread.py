"""CPU forward thread: FIFO order, completion events, error hand-off, per-thread step timing, and
the overhead bench's exposed time with a forward thread (pure parts; the SGLang path is covered by
tests/integration/test_albireo.py)."""

from __future__ import annotations

import json
import threading
import time

import pytest

from bench.overhead import summarize
from branchwise.albireo import step_timer
from branchwise.albireo.forward_thread import ForwardExecutor, ForwardJob, HostEvent


class _Recording(ForwardExecutor):
    """The executor with its SGLang part replaced: a job appends its id (after an optional gate)."""

    def __init__(self) -> None:
        self.order: list[int] = []
        super().__init__(scheduler=None)

    def _execute(self, job: ForwardJob) -> None:
        gate = job.snapshot.get("gate")
        if gate is not None:
            assert gate.wait(5)
        if job.snapshot.get("fail"):
            raise ValueError("boom")
        self.order.append(job.snapshot["id"])


def _job(i: int, **kw) -> ForwardJob:
    return ForwardJob({"id": i, **kw}, placeholder=None, run=lambda b: None, done=HostEvent(), bs=1)


def test_jobs_run_in_submission_order_and_drain_waits_for_all():
    ex = _Recording()
    gate = threading.Event()
    jobs = [_job(0, gate=gate)] + [_job(i) for i in range(1, 6)]
    for j in jobs:
        ex.submit(j)
    assert not any(j.done.query() for j in jobs)  # the first one blocks the stream
    gate.set()
    ex.drain()
    assert ex.order == [0, 1, 2, 3, 4, 5]
    assert all(j.done.query() for j in jobs)
    assert ex.stats.jobs == 6
    ex.close()


def test_failed_job_raises_on_the_waiting_thread_and_later_jobs_still_complete():
    ex = _Recording()
    bad, good = _job(0, fail=True), _job(1)
    ex.submit(bad)
    ex.submit(good)
    with pytest.raises(RuntimeError, match="forward failed") as e:
        bad.done.synchronize()
    assert isinstance(e.value.__cause__, ValueError)
    good.done.synchronize()
    assert ex.order == [1]
    ex.close()


def test_host_event_is_a_copy_done_drop_in():
    ev = HostEvent()
    ev.record()  # SGLang's copy_to_cpu records it: a no-op, only the worker sets it
    assert not ev.query()
    threading.Timer(0.01, ev.set).start()
    ev.synchronize()
    assert ev.query()


def test_drain_with_nothing_submitted_returns():
    ex = _Recording()
    ex.drain()
    ex.close()


def test_forward_thread_spans_do_not_touch_the_scheduler_threads_span_stack(tmp_path):
    path = tmp_path / "steps.jsonl"
    t = step_timer.StepTimer(str(path))  # owner: this thread (the "scheduler")
    step_timer._TIMER = t
    try:
        t.begin_iteration(time.perf_counter())
        t.run = t.res = ["decode", 2]
        t.enter("result")  # the scheduler thread is inside a span while the worker runs the forward

        def worker() -> None:
            t.add_forward_idle(0.004)
            step_timer._timed("forward", time.sleep, 0.02)
            step_timer._timed("sample", lambda: None)

        th = threading.Thread(target=worker)
        th.start()
        th.join()
        t.exit()
        t.begin_iteration(time.perf_counter())
        t.begin_iteration(time.perf_counter())  # idle: flushes
    finally:
        step_timer._TIMER = None
    busy = json.loads(path.read_text().splitlines()[0])
    assert busy["forward"] >= 0.02 and busy["fthread"] == {"idle": 0.004, "jobs": 1}
    assert busy["result"] >= 0.02  # the worker's forward did not end the scheduler's span early


def test_summary_exposed_is_the_forward_threads_idle_time():
    def rec(fidle=None):
        spans = {"recv": 0.0, "sched": 0.002, "prep": 0.001, "forward": 0.010, "sample": 0.001,
                 "result": 0.003, "stream": 0.0, "worker": 0.0}
        r = {**spans, "wall": 0.012, "run": ["decode", 4], "res": ["decode", 4], "cpu": {**spans, "wall": 0.012}}
        return r | ({"fthread": {"idle": fidle, "jobs": 1}} if fidle is not None else {})

    _, med, _ = summarize([rec(0.0005), rec(0.0007), rec(0.0006)], 4)
    assert abs(med["exposed"] - 0.6) < 1e-9  # not wall - forward (= 2 ms): T1/T5 overlapped the forward
    assert abs(med["other"] - (12.0 - 2.0 - 1.0 - 3.0)) < 1e-9
    _, med, _ = summarize([rec(), rec()], 4)
    assert abs(med["exposed"] - 2.0) < 1e-9  # no forward thread: wall - forward, as before


def test_snapshot_keeps_the_launched_rows_when_the_batch_is_merged_or_rebound_later():
    from dataclasses import dataclass, field

    import torch

    from branchwise.albireo.forward_thread import snapshot

    @dataclass
    class Batch:
        reqs: list = field(default_factory=lambda: ["a", "b"])
        top_logprobs_nums: list = field(default_factory=lambda: [0, 0])
        seq_lens: torch.Tensor = field(default_factory=lambda: torch.tensor([5, 7]))

    b = Batch()
    snap = snapshot(b)
    b.reqs.extend(["c"])  # merge_batch extends in place
    b.top_logprobs_nums.append(3)
    b.seq_lens = b.seq_lens + 1  # prepare_for_decode rebinds out of place
    assert snap.reqs == ["a", "b"] and snap.top_logprobs_nums == [0, 0]
    assert snap.seq_lens.tolist() == [5, 7]
