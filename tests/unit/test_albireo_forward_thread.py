"""CPU forward thread: FIFO order, completion events, error hand-off, per-thread step timing, and
the overhead bench's exposed time with a forward thread (pure parts; the SGLang path is covered by
tests/integration/test_albireo.py)."""

from __future__ import annotations

import json
import threading
import time
import traceback
from types import SimpleNamespace

import pytest

from bench.overhead import summarize
from branchwise import step_timer
from branchwise.albireo import forward_thread
from branchwise.albireo.forward_thread import ForwardExecutor, ForwardJob, ForwardThreadError, HostEvent


class _Recording(ForwardExecutor):
    """The executor with its SGLang part replaced: a job appends its id (after an optional gate)."""

    def __init__(self) -> None:
        self.order: list[int] = []
        super().__init__(scheduler=None)

    def _execute(self, job: ForwardJob, sample: bool = False) -> None:
        gate = job.snapshot.get("gate")
        if gate is not None:
            assert gate.wait(5)
        if job.snapshot.get("fail"):
            raise ValueError("boom")
        self.order.append(job.snapshot["id"])


def _job(i: int, **kw) -> ForwardJob:
    return ForwardJob(snapshot={"id": i, **kw}, placeholder=None, run=lambda snap: None, done=HostEvent(), rows=1)


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


def _frames(exc: BaseException) -> list[str]:
    return [f.name for f in traceback.extract_tb(exc.__traceback__)]


def test_a_failed_job_raises_with_the_workers_traceback():
    ex = _Recording()
    bad = _job(0, fail=True)
    ex.submit(bad)
    with pytest.raises(ForwardThreadError, match="forward failed") as e:
        bad.done.synchronize()
    assert isinstance(e.value.__cause__, ValueError) and "_execute" in _frames(e.value.__cause__)
    ex.close()


def test_a_worker_that_fails_to_start_fails_the_waiter_and_later_submits(monkeypatch):
    def broken_binding() -> None:
        raise OSError("no such CPU set")

    monkeypatch.setattr(forward_thread, "bind_worker_threads", broken_binding)
    ex = ForwardExecutor(scheduler=SimpleNamespace(), timeout_s=30)  # the worker binds its threads first
    job = _job(0)
    ex.thread.join(timeout=10)  # it stopped at start-up, before its loop
    assert not ex.thread.is_alive() and isinstance(ex.fatal, OSError)
    with pytest.raises(ForwardThreadError, match="died") as e:
        ex.submit(job)  # nothing is queued on a dead worker
    assert e.value.__cause__ is ex.fatal and "broken_binding" in _frames(e.value.__cause__)


def test_a_waiter_raises_when_the_worker_dies_after_the_submit(monkeypatch):
    gate = threading.Event()

    class Dies(ForwardExecutor):
        def _loop(self) -> None:
            assert gate.wait(10)
            raise ImportError("worker start-up failed late")

    ex = Dies(scheduler=None, timeout_s=30)
    job = _job(0)
    ex.submit(job)  # accepted: the worker is alive
    gate.set()
    with pytest.raises(ForwardThreadError, match="died") as e:
        job.done.synchronize()  # the worker never runs it: raise at once, not after the 30 s timeout
    assert isinstance(e.value.__cause__, ImportError) and "_loop" in _frames(e.value.__cause__)
    with pytest.raises(ForwardThreadError):
        ex.drain()


def test_a_hung_job_raises_after_the_timeout_with_the_workers_stack():
    ex = _Recording()
    ex.timeout_s = 0.2
    stuck = threading.Event()
    job = _job(0, gate=stuck)
    ex.submit(job)
    with pytest.raises(ForwardThreadError, match="no result after 0.2 s") as e:
        job.done.synchronize()
    assert "gate.wait(5)" in str(e.value) and "_execute" in str(e.value)  # where the worker is stuck
    stuck.set()
    ex.drain()
    ex.close()


def test_the_timeout_comes_from_the_environment(monkeypatch):
    monkeypatch.delenv(forward_thread.TIMEOUT_ENV, raising=False)
    assert forward_thread._timeout_s() == forward_thread.DEFAULT_TIMEOUT_S
    monkeypatch.setenv(forward_thread.TIMEOUT_ENV, "42.5")
    assert forward_thread._timeout_s() == 42.5
    for bad in ("0", "-1", "nan", "inf"):
        monkeypatch.setenv(forward_thread.TIMEOUT_ENV, bad)
        with pytest.raises(ValueError, match=forward_thread.TIMEOUT_ENV):
            forward_thread._timeout_s()


def test_worker_runs_under_the_scheduler_loops_grad_mode():
    import torch

    seen = []

    class Probe(ForwardExecutor):
        def _execute(self, job: ForwardJob, sample: bool = False) -> None:
            seen.append(torch.is_grad_enabled())

    assert torch.is_grad_enabled()  # this thread, like a fresh one, records autograd by default
    ex = Probe(scheduler=None)
    ex.submit(_job(0))
    ex.drain()
    ex.close()
    assert seen == [False]


def test_host_event_is_a_copy_done_drop_in():
    ev = HostEvent()
    ev.record()  # SGLang's copy_to_cpu records it: a no-op, only the worker sets it
    assert not ev.query()
    threading.Timer(0.01, ev.set).start()
    ev.synchronize()
    assert ev.query()


def test_drain_with_nothing_submitted_returns():
    """drain() before any job returns at once (there is nothing to wait for), leaves the worker
    running, and the executor still takes and runs the next job; close() stops the worker."""
    ex = _Recording()
    assert ex.last is None and not ex.busy()
    ex.drain()  # would block on a job that never comes if it waited for one (the suite's timeout ends it)
    assert ex.order == [] and ex.thread.is_alive()
    ex.submit(_job(7))
    ex.drain()
    assert ex.order == [7] and not ex.busy()
    ex.close()
    assert not ex.thread.is_alive()


def test_forward_thread_spans_do_not_touch_the_scheduler_threads_span_stack(tmp_path):
    path = tmp_path / "steps.jsonl"
    t = step_timer.StepTimer(str(path))  # owner: this thread (the "scheduler")
    runner = SimpleNamespace(**{step_timer.ATTR: t})  # the model runner, as the timer's build leaves it
    t.begin_iteration(time.perf_counter())
    t.run = t.res = ["decode", 2]
    t.enter("result")  # the scheduler thread is inside a span while the worker runs the forward

    def worker() -> None:
        t.add_forward_idle(0.004)
        step_timer.around_forward(lambda r, s: time.sleep(s), runner, 0.02)
        step_timer.around_sample(lambda r: None, runner)

    th = threading.Thread(target=worker)
    th.start()
    th.join()
    t.exit()
    t.begin_iteration(time.perf_counter())
    t.begin_iteration(time.perf_counter())  # idle: flushes
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


# ---------------------------------------------------------------- which batches go to the worker

def _stub_batch(mode: str = "DECODE", **kw):
    from types import SimpleNamespace

    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    class _Spec:
        def is_none(self) -> bool:
            return True

    si = SimpleNamespace(has_custom_logit_processor=False, custom_params=None, grammars=None,
                         acc_additive_penalties=None, acc_scaling_penalties=None)
    fields = dict(forward_mode=ForwardMode[mode], spec_algorithm=_Spec(), input_ids=None,
                  prefill_input_ids_cpu=None if mode == "DECODE" else [1, 2, 3], chunked_req=None,
                  input_embeds=None, replace_embeds=None, multimodal_inputs=[None, None],
                  hicache_consumer_index=-1, model_config=SimpleNamespace(is_encoder_decoder=False),
                  has_grammar=False, beam_tail=None, sampling_info=si, reqs=["r0", "r1"], return_logprob=False,
                  is_prefill_only=False)
    return SimpleNamespace(**(fields | kw))


def test_prefill_and_mixed_batches_staged_on_the_host_go_to_the_worker():
    from branchwise.albireo.forward_thread import batch_reason

    assert batch_reason(_stub_batch("DECODE")) is None
    assert batch_reason(_stub_batch("EXTEND")) is None
    assert batch_reason(_stub_batch("MIXED")) is None
    assert batch_reason(_stub_batch("IDLE")) == "idle batch"
    assert batch_reason(_stub_batch("EXTEND", chunked_req="r1")) == "chunked prefill"
    assert batch_reason(_stub_batch("MIXED", chunked_req="r1")) == "chunked prefill"
    # a tree cache whose checkpoints around_checkpoint guards lets chunks run on the worker
    assert batch_reason(_stub_batch("EXTEND", chunked_req="r1"), checkpoint_guarded=True) is None
    assert batch_reason(_stub_batch("EXTEND", prefill_input_ids_cpu=None)) == "prefill ids not staged on the host"
    assert batch_reason(_stub_batch("DECODE", input_ids=[5])) == "inputs staged"
    assert batch_reason(_stub_batch("EXTEND", multimodal_inputs=[None, object()])) == "multimodal or embedding inputs"
    assert batch_reason(_stub_batch("EXTEND", has_grammar=True)) is None  # sampled in a second job


def test_penalties_and_aligned_custom_processors_are_no_reason_to_drain():
    from types import SimpleNamespace

    from branchwise.albireo.forward_thread import batch_reason

    pen = SimpleNamespace(has_custom_logit_processor=False, custom_params=None,
                          penalizer_orchestrator=SimpleNamespace(is_required=True))
    assert batch_reason(_stub_batch("DECODE", sampling_info=pen)) is None
    clp = SimpleNamespace(has_custom_logit_processor=True, custom_params=[None, {"k": 1}])
    assert batch_reason(_stub_batch("EXTEND", sampling_info=clp)) is None
    bad = SimpleNamespace(has_custom_logit_processor=True, custom_params=[None])  # rows and params disagree
    assert batch_reason(_stub_batch("DECODE", sampling_info=bad)) == "custom logit processor"


def test_custom_processors_read_the_request_as_it_was_at_launch():
    from types import SimpleNamespace

    from branchwise.albireo.forward_thread import snapshot

    class Req:  # the state StructureDriver and SGLang's processors read
        def __init__(self) -> None:
            self.origin_input_ids, self.output_ids = [1, 2, 3], [7, 8]
            self.kv = SimpleNamespace(kv_committed_len=5)

    live, plain = Req(), Req()
    shared = {"bw_structure": "{}", "__req__": live}
    params = [shared, None]
    si = SimpleNamespace(has_custom_logit_processor=True, custom_params=params)
    batch = _stub_batch("DECODE", sampling_info=si, reqs=[live, plain])
    snap = snapshot(batch)
    live.output_ids.append(9)  # the scheduler thread moves on after launch
    live.kv.kv_committed_len = 6
    view = snap.sampling_info.custom_params[0]["__req__"]
    assert view.output_ids == [7, 8] and view.kv.kv_committed_len == 5 and view.origin_input_ids == [1, 2, 3]
    assert snap.sampling_info.custom_params[1] is None and snap.sampling_info.custom_params[0]["bw_structure"] == "{}"
    assert batch.sampling_info.custom_params is params and shared["__req__"] is live  # the live batch untouched


def test_launch_hands_the_prefill_staging_to_the_worker_and_clears_it_on_the_live_batch():
    from branchwise.albireo import forward_thread as ft

    class Gated(ForwardExecutor):  # the worker holds the job until the test has looked at the live batch
        def _execute(self, job: ForwardJob, sample: bool = False) -> None:
            assert job.snapshot.gate.wait(5)

    ex = Gated(scheduler=None)
    gate = threading.Event()
    batch = _stub_batch("MIXED", prefill_input_ids_cpu=[4, 5], mix_running_indices=[3], seq_lens=[1, 1], gate=gate)
    ex.launching = batch
    try:
        placeholder = ft.around_forward_batch_generation(lambda *a: None, _worker(ex), batch)
        job = ex.job
        assert job.placeholder is placeholder and placeholder._branchwise_job
        assert batch.prefill_input_ids_cpu is None and batch.mix_running_indices is None
        assert job.snapshot.prefill_input_ids_cpu == [4, 5] and job.snapshot.mix_running_indices == [3]
        assert ex.stats.modes == {"mixed": 1} and ex.stats.features == {}
        gate.set()
        ex.drain()
    finally:
        ex.close()


def _worker(ex: ForwardExecutor | None) -> SimpleNamespace:
    """TpModelWorker as samples_later reads it, with the executor forward_thread.build attaches."""
    return SimpleNamespace(enable_overlap=True, enable_spec=False, **{forward_thread.ATTR: ex})


def test_grammar_batch_forwards_at_launch_and_samples_after_the_mask_is_built(monkeypatch):
    """SGLang's delayed sampling, split over the worker: the forward runs while the scheduler thread
    processes the previous step; the mask is built on the scheduler thread (delay_sample_func); the
    sampling job runs on the worker after it and before the next launch's forward."""
    from sglang.srt.managers import overlap_utils
    from sglang.srt.managers.utils import GenerationBatchResult

    from branchwise.albireo import forward_thread as ft

    log: list[tuple[str, str]] = []
    here = threading.current_thread().name
    monkeypatch.setattr(overlap_utils, "resolve_forward_inputs", lambda b, fm: log.append(("resolve", b.tag)))

    class Mask:  # SamplingBatchInfo.update_regex_vocab_mask as the hook sees it
        def __init__(self) -> None:
            self.grammars = None  # ForwardBatch.init_new fills it in on the worker; the launch does first
            self.built = 0
            self.has_custom_logit_processor = False
            self.acc_additive_penalties = self.acc_scaling_penalties = None

        def update_regex_vocab_mask(self) -> None:
            self.built += 1
            log.append(("mask", threading.current_thread().name))

    class Result(GenerationBatchResult):
        def copy_to_cpu(self, **kw) -> None:
            log.append(("copy", self.tag))

    gate = threading.Event()

    def forward(worker, b):  # TpModelWorker.forward_batch_generation under overlap
        assert gate.wait(5)
        log.append(("forward", b.tag))
        res = Result(can_run_cuda_graph=True)
        res.tag = b.tag

        def sample() -> Result:  # model_runner.sample: _preprocess_logits rebuilds the mask (hooked)
            ft.around_update_regex_vocab_mask(Mask.update_regex_vocab_mask, b.sampling_info)
            log.append(("sample", b.tag))
            res.next_token_ids = [7]
            return res

        if b.has_grammar:
            res.delay_sample_func = sample
        else:
            res.next_token_ids = [8]
        return res

    sched = SimpleNamespace(future_map=None, device_module=SimpleNamespace(Event=lambda: None),
                            _relay_forward_payload=lambda b, idx, r: log.append(("relay", b.tag)))
    ex = ForwardExecutor(sched)
    sched.branchwise = SimpleNamespace(forward=ex)
    worker = _worker(ex)
    try:
        gb = _stub_batch("DECODE", sampling_info=Mask(), tag="g", seq_lens=[1], req_pool_indices=[0], has_grammar=True,
                         reqs=[SimpleNamespace(grammar="fsm")],
                         return_hidden_states=False)
        ex.launching = gb
        ph = ft.around_forward_batch_generation(forward, worker, gb)
        assert ph.delay_sample_func is not None and ex.job is None  # run_batch skips relay and copy
        assert gb.sampling_info.grammars == ["fsm"]  # the requests' grammars, for the mask
        assert ex.stats.features == {"decode: grammar": 1}
        gate.set()
        ex.last.synchronize()  # what a drain during the previous step's processing waits for: the forward only
        assert [k for k, _ in log] == ["resolve", "forward"] and not ph.copy_done
        assert ph.delay_sample_func() is ph  # launch_batch_sample_if_needed, after the previous step's processing
        assert log[2] == ("mask", here) and gb.sampling_info.built == 1  # the FSMs are read on the scheduler thread
        ft.around_copy_result_to_cpu(None, sched, ph, gb)  # SGLang's _copy_result_to_cpu: copy_done = done
        nb = _stub_batch("DECODE", tag="n", seq_lens=[1], req_pool_indices=[0], return_hidden_states=False)  # the next step, no grammar
        ex.launching = nb
        nxt = ft.around_forward_batch_generation(forward, worker, nb)
        ft.around_copy_result_to_cpu(None, sched, nxt, nb)
        ph.copy_done.synchronize()
        assert ph.next_token_ids == [7] and gb.sampling_info.built == 1  # the worker kept the scheduler's mask
        nxt.copy_done.synchronize()
        assert [k for k, _ in log[3:]] == ["sample", "relay", "copy", "resolve", "forward", "relay", "copy"]
        assert [t for k, t in log[3:6]] == ["g"] * 3 and nxt.next_token_ids == [8]
        assert (ex.stats.jobs, ex.stats.samples) == (2, 1)
    finally:
        ex.launching = None
        ex.close()


def test_checkpoint_rewrite_of_a_row_waits_for_the_forward_in_flight_only_when_it_changes():
    import torch

    from branchwise.albireo import forward_thread as ft

    class Pool:
        def __init__(self) -> None:
            self.req_to_token = torch.arange(12, dtype=torch.int32).reshape(2, 6)

        def write(self, indices, values) -> None:
            self.req_to_token[indices] = values

    class Tree:  # RadixCache.checkpoint's req_to_token write, reduced to the call around_checkpoint wraps
        def __init__(self) -> None:
            self.req_to_token_pool = Pool()

        def checkpoint(self, req, *, up_to: int) -> None:
            self.req_to_token_pool.write((req, slice(0, up_to)), self.new[:up_to])

    seen: list[list[int]] = []

    class Gated(ForwardExecutor):  # the "forward" reads the row once it may run
        def _execute(self, job: ForwardJob, sample: bool = False) -> None:
            assert job.snapshot.wait(5)
            seen.append(tree.req_to_token_pool.req_to_token[0, :4].tolist())

    ex, gate, tree = Gated(scheduler=None), threading.Event(), Tree()
    setattr(tree, ft.ATTR, ex)  # as build attaches it to a tree cache whose checkpoint is guarded
    try:
        tree.new = torch.tensor([0, 1, 2, 3], dtype=torch.int64)  # the tree's indices == the row's: no wait
        ex.submit(ForwardJob(snapshot=gate, placeholder=None, run=lambda snap: None, done=HostEvent(), rows=1))
        ft.around_checkpoint(Tree.checkpoint, tree, 0, up_to=4)
        assert ex.busy() and ex.stats.checkpoint_drains == 0
        assert "write" not in vars(tree.req_to_token_pool)  # the checked write is gone after the call
        tree.new = torch.tensor([9, 8, 7], dtype=torch.int64)  # dedup: another request's slots
        threading.Timer(0.05, gate.set).start()  # the worker finishes; the rewrite must wait for it
        ft.around_checkpoint(Tree.checkpoint, tree, 0, up_to=3)
        assert not ex.busy() and ex.stats.checkpoint_drains == 1
        assert seen == [[0, 1, 2, 3]]  # the forward read the row before the rewrite, whenever the gate opened
        assert tree.req_to_token_pool.req_to_token[0, :4].tolist() == [9, 8, 7, 3]
    finally:
        ex.close()


def test_worker_binds_its_own_openmp_team_where_sglang_binds_the_schedulers(monkeypatch):
    """AMX / arm64: SGLang pins the scheduler thread's OpenMP team to the rank's cores at start-up;
    the worker's team must be bound the same way, from the worker thread."""
    import torch
    from sglang.srt import runtime_context
    from sglang.srt.distributed import bootstrap
    from sglang.srt.utils import numa_utils

    from branchwise.albireo.forward_thread import bind_worker_threads

    calls: list[tuple[str, str]] = []
    monkeypatch.setattr(runtime_context, "get_parallel", lambda: SimpleNamespace(dp_size=1, tp_size=2, pp_size=1))
    monkeypatch.setattr(runtime_context, "get_device", lambda: SimpleNamespace(gpu_id=1))
    monkeypatch.setattr(numa_utils, "init_threads_binding",
                        lambda numa_index, world_size: f"cores of rank {numa_index} of {world_size}")
    monkeypatch.setattr(torch.ops.sgl_kernel, "init_cpu_threads_env",
                        lambda cpuid: calls.append((cpuid, threading.current_thread().name)), raising=False)
    monkeypatch.setattr(bootstrap, "_is_cpu_amx_available", False)
    monkeypatch.setattr(bootstrap, "_is_cpu_arm64", False)
    bind_worker_threads()
    assert calls == []  # SGLang bound nothing on this CPU: neither does the worker
    monkeypatch.setattr(bootstrap, "_is_cpu_amx_available", True)
    th = threading.Thread(target=bind_worker_threads, name="worker")
    th.start()
    th.join(5)
    assert calls == [("cores of rank 1 of 2", "worker")]


def test_samples_later_follows_the_workers_delayed_sampling_condition(monkeypatch):
    """tp_worker delays sampling under overlap, non-speculative, for grammar batches, or for every
    non-prefill-only batch with SGLANG_ENABLE_DELAY_SAMPLE; the launch must predict the same."""
    from branchwise.albireo.forward_thread import samples_later

    monkeypatch.delenv("SGLANG_ENABLE_DELAY_SAMPLE", raising=False)
    spec = SimpleNamespace(enable_overlap=True, enable_spec=True)
    no_overlap = SimpleNamespace(enable_overlap=False, enable_spec=False)
    assert samples_later(_worker(None), _stub_batch("DECODE", has_grammar=True))
    assert not samples_later(_worker(None), _stub_batch("DECODE"))
    assert not samples_later(spec, _stub_batch("DECODE", has_grammar=True))
    assert not samples_later(no_overlap, _stub_batch("EXTEND", has_grammar=True))
    monkeypatch.setenv("SGLANG_ENABLE_DELAY_SAMPLE", "1")
    assert samples_later(_worker(None), _stub_batch("DECODE")) and samples_later(_worker(None), _stub_batch("EXTEND"))
    assert not samples_later(_worker(None), _stub_batch("EXTEND", is_prefill_only=True))
