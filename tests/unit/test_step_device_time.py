"""TAPER's refit takes each decode step's own device time with that step's own composition, under
SGLang's overlap loop (step k+1 is launched before step k's result is processed). No SGLang: the
loop is driven by hand with the real hook bodies (emulated_device / device_time / scheduler_hook)
against a known pipelined clock: the emulated device's, and a fake CUDA stream's timing events."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np
import pytest

from branchwise import device_time as dt
from branchwise import emulated_device as ed
from branchwise import request_meta, runtime
from branchwise import scheduler_hook as sh
from branchwise.config import BranchwiseConfig
from branchwise.device_model import Composition, DevicePreset, DeviceStream
from branchwise.taper.controller import StepController
from branchwise.taper.policies import parse_policy
from branchwise.taper.predictor import LinearLatencyModel

PRESET = DevicePreset(name="test", floor_s=0.05, row_s=1e-3, context_token_s=1e-6, prefill_token_s=2e-5,
                      graph_batch_sizes=(1, 2, 4, 8))
# (rows, context tokens per row, rows deferred): every step a different composition and time
STEPS = [(3, 40, 0), (8, 41, 2), (5, 60, 0), (1, 200, 3), (12, 10, 0), (6, 70, 1), (2, 90, 0)]


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def decode_mode() -> SimpleNamespace:
    return SimpleNamespace(is_decode=lambda: True, is_mixed=lambda: False, is_extend=lambda: False)


def prefill_mode() -> SimpleNamespace:
    return SimpleNamespace(is_decode=lambda: False, is_mixed=lambda: False, is_extend=lambda: True)


def rows_of(step: int, rows: int, ctx: int) -> list[SimpleNamespace]:
    meta = request_meta.RequestMeta(phase=f"ph{step}", branch=0, fanout=16)
    return [SimpleNamespace(rid=f"s{step}r{i}", bw_meta=meta, kv=SimpleNamespace(kv_committed_len=ctx),
                            to_finish=None, finished=lambda: False) for i in range(rows)]


def batch_of(reqs: list[SimpleNamespace], ctx: int) -> SimpleNamespace:
    return SimpleNamespace(reqs=reqs, forward_mode=decode_mode(), batch_size=lambda: len(reqs),
                           seq_lens_cpu=np.full(len(reqs), ctx), is_empty=lambda: not reqs)


def copy_of(batch: SimpleNamespace) -> SimpleNamespace:
    """ScheduleBatch.copy(): forward_iter and reqs survive, attributes of ours do not."""
    return SimpleNamespace(reqs=batch.reqs, forward_mode=batch.forward_mode, forward_iter=batch.forward_iter,
                           launch_ts=batch.launch_ts)


@dataclass
class Booked:
    calls: list[tuple[int, int, float, int]] = field(default_factory=list)

    def on_latency(self, n_rows: int, ctx_tokens: int, latency_s: float, deferred: int = 0) -> None:
        self.calls.append((n_rows, ctx_tokens, latency_s, deferred))


def scheduler(source: str, clock: Clock, device: DeviceStream | None = None) -> SimpleNamespace:
    model = LinearLatencyModel(c0=1e-3, c_seq=1e-4, c_ctx=0.0)
    state = sh.BranchwiseState(config=BranchwiseConfig(branch_policy="eager"),
                               controller=StepController(parse_policy("eager", model=model)))
    state.phases_seen = True
    state.device_times = dt.StepDeviceTimes(source)
    booked = Booked()
    state.controller.on_latency = booked.on_latency
    bw = runtime.Branchwise(config=state.config, state=state, device=device)
    return SimpleNamespace(branchwise=bw, forward_ct=0, waiting_queue=[], running_batch=None, booked=booked,
                           clock=clock, enable_overlap=True)


def run_batch(sched: SimpleNamespace, batch: SimpleNamespace) -> SimpleNamespace:
    """SGLang's run_batch as the hooks see it: it numbers the forward and returns its result."""
    sched.forward_ct += 1
    batch.forward_iter, batch.launch_ts = sched.forward_ct, sched.clock()
    return SimpleNamespace(copy_done=None, delay_sample_func=None)


def overlap_loop(sched: SimpleNamespace, launch, steps=STEPS, prefill_after: int = 2) -> list[tuple]:
    """event_loop_overlap: launch step k, then process step k-1's result (its copy); a prefill is
    launched after step `prefill_after`. Returns what each decode step's own time must be."""
    queue: list[tuple[SimpleNamespace, SimpleNamespace]] = []
    expected = []
    for step, (rows, ctx, deferred) in enumerate(steps):
        batch = batch_of(rows_of(step, rows, ctx), ctx)
        result, device_s = launch(sched, batch)
        if deferred:  # decode_step's record of a deferring sub-batch, under the iteration it runs as
            sched.branchwise.state.planned[batch.forward_iter] = sh.PlannedStep(rows=rows, deferred=deferred)
        queue.append((copy_of(batch), result))
        expected.append((rows, rows * ctx, device_s, deferred))
        if step == prefill_after:  # a non-decode forward in between: no time of it reaches the refit
            prefill = SimpleNamespace(reqs=[], forward_mode=prefill_mode(), prefix_lens=[0], extend_lens=[30])
            queue.append((copy_of_prefill(launch_prefill(sched, prefill)), None))
        while len(queue) > 1:  # the previous batch's result is processed after this launch
            done, res = queue.pop(0)
            process(sched, done, res)
        sched.clock.sleep(0.001)  # the scheduler's own work between iterations
    for done, res in queue:
        process(sched, done, res)
    return expected


def launch_prefill(sched: SimpleNamespace, batch: SimpleNamespace) -> SimpleNamespace:
    ed.around_run_batch(lambda s, b: run_batch(s, b), sched, batch)
    return batch


def copy_of_prefill(batch: SimpleNamespace) -> SimpleNamespace:
    return SimpleNamespace(reqs=[], forward_mode=batch.forward_mode, forward_iter=batch.forward_iter)


def process(sched: SimpleNamespace, batch: SimpleNamespace, result: SimpleNamespace | None) -> None:
    """process_batch_result: wait on the result's copy_done (the device), then the after-hook."""
    if result is not None and result.copy_done is not None:
        result.copy_done.synchronize()
    sh.after_process_batch_result(None, sched, batch)


def test_the_refit_gets_each_emulated_step_own_modeled_time_and_composition():
    clock = Clock()
    stream = DeviceStream(PRESET, clock=clock, sleep=clock.sleep)
    sched = scheduler(dt.EMULATED, clock, stream)

    def launch(s, batch):
        result = ed.around_run_batch(lambda s_, b: run_batch(s_, b), s, batch)
        rows, ctx = batch.batch_size(), int(batch.seq_lens_cpu.sum())
        return result, PRESET.t_device(Composition(decode_rows=rows, context_tokens=ctx))

    expected = overlap_loop(sched, launch)
    got = sched.booked.calls
    assert [c[:2] + c[3:] for c in got] == [e[:2] + e[3:] for e in expected]
    assert [c[2] for c in got] == pytest.approx([e[2] for e in expected], rel=1e-12)
    # padded: 3 and 4 rows cost alike; 12 rows are past the largest graph (unpadded)
    assert got[0][2] == pytest.approx(0.05 + 4e-3 + 120e-6)
    assert got[4][2] == pytest.approx(0.05 + 12e-3 + 120e-6)
    state = sched.branchwise.state
    assert state.device_times.pending == {} and state.device_times.dropped == 0
    assert state.planned == {} and "device_time_missing" not in state.counters


def test_the_launch_gap_tracks_an_earlier_step():
    """Why the refit must not take the launch gap here: on this pipelined clock the gap from decode
    launch k to launch k+1 is step k-1's device time (k+1 is launched once k-1's result is
    processed), not step k's, so booking gaps by launch order pairs times with other steps."""
    clock = Clock()
    stream = DeviceStream(PRESET, clock=clock, sleep=clock.sleep)
    sched = scheduler(dt.EMULATED, clock, stream)
    launches: list[float] = []

    def launch(s, batch):
        result = ed.around_run_batch(lambda s_, b: run_batch(s_, b), s, batch)
        launches.append(batch.launch_ts)
        return result, PRESET.t_device(Composition(batch.batch_size(), int(batch.seq_lens_cpu.sum())))

    expected = overlap_loop(sched, launch, prefill_after=len(STEPS))
    own = [e[2] for e in expected]
    gaps = [b - a for a, b in zip(launches, launches[1:], strict=False)]
    assert gaps[1:] == pytest.approx(own[:len(gaps) - 1], rel=1e-9)
    assert all(abs(gap - t) > 1e-5 for gap, t in zip(gaps[1:], own[1:], strict=False))
    assert [c[2] for c in sched.booked.calls] == pytest.approx(own, rel=1e-12)


class FakeStream:
    """An in-order device stream on a fake clock: work starts when the stream is free and it is
    enqueued; an event completes when the stream reaches it."""

    def __init__(self, clock: Clock) -> None:
        self.clock, self.tail = clock, -1.0

    def enqueue(self, seconds: float) -> None:
        self.tail = max(self.tail, self.clock()) + seconds


class FakeEvent:
    def __init__(self, enable_timing: bool = False) -> None:
        assert enable_timing
        self.at: float | None = None

    def record(self, stream: FakeStream | None = None) -> None:
        self.at = max(stream.tail, stream.clock())

    def synchronize(self) -> None:
        assert self.at is not None

    def elapsed_time(self, end: FakeEvent) -> float:
        return 1e3 * (end.at - self.at)


def test_the_refit_gets_each_cuda_step_own_event_time_and_composition():
    """CUDA: events on the forward stream around run_batch; step k+1 is queued behind step k, so its
    start event fires when step k ends and the pair spans exactly step k+1's device time."""
    clock = Clock()
    stream = FakeStream(clock)
    sched = scheduler(dt.CUDA, clock)
    sched.device_module = SimpleNamespace(Event=FakeEvent, current_stream=lambda: stream)
    sched.forward_stream = stream

    def launch(s, batch):
        rows, ctx = batch.batch_size(), int(batch.seq_lens_cpu.sum())
        device_s = PRESET.t_device(Composition(rows, ctx))  # any known duration per step

        def forward(s_, b):
            result = run_batch(s_, b)
            stream.enqueue(device_s)
            clock.sleep(2e-4)  # the launch's own CPU time
            return result

        return dt.around_run_batch(forward, s, batch), device_s

    expected = overlap_loop(sched, launch, prefill_after=len(STEPS))
    got = sched.booked.calls
    assert [c[:2] + c[3:] for c in got] == [e[:2] + e[3:] for e in expected]
    # the first step found the device idle: its span starts at its launch, the others queue behind
    assert [c[2] for c in got] == pytest.approx([e[2] for e in expected], rel=1e-9)


def test_the_book_drops_steps_whose_result_never_came_back():
    book = dt.StepDeviceTimes(dt.EMULATED)
    for it in range(1, 5):
        book.put(it, 0.01 * it)
    assert book.take(3) == pytest.approx(0.03)
    assert book.pending == {4: pytest.approx(0.04)} and book.dropped == 2
    assert book.take(9) is None and book.pending == {} and book.take(None) is None
    for it in range(dt.MAX_PENDING + 5):
        book.put(it + 100, 0.0)
    assert len(book.pending) == dt.MAX_PENDING


def test_where_step_times_come_from():
    cpu = SimpleNamespace(device="cpu", server_args=SimpleNamespace(device="cpu"))
    gpu = SimpleNamespace(device="cuda", server_args=SimpleNamespace(device="cuda"))
    assert dt.source_of(cpu, emulated=False) is None  # CPU: the launch gap, as before
    assert dt.source_of(cpu, emulated=True) == dt.EMULATED
    assert dt.source_of(gpu, emulated=False) == dt.CUDA
    runner = SimpleNamespace(decode_cuda_graph_capture_bs=[8, 1, 4, 2, 16])
    assert dt.captured_batch_sizes(SimpleNamespace(tp_worker=SimpleNamespace(model_runner=runner))) == (1, 2, 4, 8, 16)
    assert dt.captured_batch_sizes(cpu) == ()


def test_the_cpu_books_the_launch_gap_to_the_previous_step():
    """No device times (CPU): report_step keeps today's measure."""
    clock = Clock()
    sched = scheduler(dt.EMULATED, clock)
    sched.branchwise.state.device_times = None
    for it, rows in ((1, 3), (2, 5), (3, 2)):
        batch = SimpleNamespace(reqs=rows_of(it, rows, 10), forward_mode=decode_mode(), forward_iter=it,
                                launch_ts=0.1 * it)
        sh.after_process_batch_result(None, sched, batch)
    assert [(c[0], c[1]) for c in sched.booked.calls] == [(3, 30), (5, 50)]
    assert [c[2] for c in sched.booked.calls] == pytest.approx([0.1, 0.1])
