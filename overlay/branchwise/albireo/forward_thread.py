"""Asynchronous forward executor for CPU: make SGLang's overlap loop overlap for real (Albireo §3).

SGLang's overlap loop (`event_loop_overlap`) launches step n on the forward stream, then processes
step n-1's result and plans step n+1 while step n runs. On CPU the streams are synchronous: the
forward runs inline on the scheduler thread and nothing overlaps. With `--async-output` on a CPU
device this module gives the forward stream a thread: for an eligible decode batch, `run_batch`
hands everything SGLang would have queued on the forward stream to one FIFO worker thread

    resolve_forward_inputs (FutureMap gather) -> TpModelWorker.forward_batch_generation
    (ForwardBatch build, forward, sample) -> _relay_forward_payload (FutureMap stash) -> copy_to_cpu

and returns a placeholder result whose `copy_done` is a `HostEvent` set when the job is done, so
SGLang's own `copy_done.synchronize()` in result processing is the only wait, as on a GPU. Torch ops
release the GIL, so the model's kernels run while the scheduler thread does Python work.

Why this is race-free (checked against SGLang 0.5.23, map §2):
* One FIFO thread = one stream: step n+1's gather runs after step n's stash (resolve-after-stash).
* The worker reads a shallow snapshot of the ScheduleBatch taken at launch on the scheduler thread;
  SGLang rebinds the batch's per-row tensors out of place afterwards (prepare_for_decode:
  `seq_lens = seq_lens + 1`, filter: `t[keep]`; Branchwise's deferral clones before index_copy_),
  so the snapshot keeps the launch-time tensors. Sampling reads the forward-only sampling_info copy
  SGLang's `_forward_isolation` made for this launch.
* Shared pools: planning step n+1 writes req_to_token only at column seq_len (step n reads columns
  below it), KV slots freed while step n is in flight are rewritten only by later forwards (FIFO),
  and a request slot reused by a new request belonged to a row step n computes and SGLang discards
  (finished / retracted rows are skipped in result processing), the same sharing as on a GPU.
* Everything else runs inline after draining the worker (prefill, mixed, idle, speculative, grammar
  and custom-logit-processor batches (their sampling reads live Req state), penalties (their
  accumulator is updated in place at the next launch), delayed sampling), so no forward ever runs
  concurrently with another.

Measured here (bench.overhead --ab, tiny model, 2 cores): the worker's idle time between decode
forwards (the exposed time) is 0.06-0.10 ms vs 1.4-4.5 ms stock, but decode throughput is 0.84x /
0.96x / 1.00x of stock at bs 1 / 32 / 128: this model's forward is mostly GIL-held Python
(torch_native attention loops over rows), so the scheduler thread's Python still serialises with it
and the forward gets slower by about what it no longer waits for. Models whose kernels run longer
than their Python (anything not tiny) overlap for real; a smaller GIL switch interval was worse.

Enabled with --async-output on a CPU device, overlap on, tp = pp = 1, no speculative decoding / PD
disaggregation / PDMux / unified memory, and only when env BRANCHWISE_FORWARD_THREAD=1 opts in: on this
box it lowers decode throughput (figures above), so it is not on by default. The --async-output
runtime switch turns it off with the rest. Under TP it stays off (the forward's
collectives would share a worker thread with none of the other ranks' decisions checked yet).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
import queue
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from branchwise.albireo import step_timer

logger = logging.getLogger("branchwise")
ENV = "BRANCHWISE_FORWARD_THREAD"  # "1" = on where --async-output qualifies (opt-in: costs throughput on tiny CPU models)
# GIL switch interval (ms) while the forward thread runs: the worker and the scheduler thread share
# one GIL, and a thread that gives it up inside a torch op waits up to this long for the other's
# Python to hand it back (CPython's default is 5 ms). Unset = leave CPython's default.
SWITCH_ENV = "BRANCHWISE_FORWARD_SWITCH_MS"
_STOP = object()
# fields the scheduler thread itself sets on the placeholder before it synchronises
_SCHEDULER_OWNED = frozenset({"copy_done", "delay_sample_func", "future_indices", "extra_keep_alive_refs"})


class HostEvent:
    """Drop-in for a `copy_done` device event: set by the worker when the job is complete.

    `synchronize()` re-raises a failure of the job on the scheduler thread (SGLang would have
    raised in place), so a broken forward still stops the scheduler.
    """

    __slots__ = ("_done", "error")

    def __init__(self) -> None:
        self._done = threading.Event()
        self.error: BaseException | None = None

    def record(self, stream: Any = None) -> None:  # the worker sets it; recording is a no-op
        return None

    def set(self) -> None:
        self._done.set()

    def query(self) -> bool:
        return self._done.is_set()

    def synchronize(self) -> None:
        self._done.wait()
        if self.error is not None:
            raise RuntimeError("Branchwise forward thread: the forward failed") from self.error

    def wait(self, stream: Any = None) -> None:
        self.synchronize()


@dataclass(slots=True)
class ForwardJob:
    snapshot: Any  # shallow copy of the ScheduleBatch at launch
    placeholder: Any  # GenerationBatchResult the scheduler holds; filled before `done` is set
    run: Callable[[Any], Any]  # forward_batch_generation(snapshot) -> GenerationBatchResult
    done: HostEvent
    bs: int


@dataclass
class ForwardStats:
    jobs: int = 0
    inline: int = 0  # batches run on the scheduler thread after draining the worker
    busy_s: float = 0.0
    idle_s: float = 0.0  # gaps between consecutive decode forwards of the worker
    reasons: dict[str, int] = field(default_factory=dict)  # why a decode batch ran inline


class ForwardExecutor:
    """The CPU "forward stream": one worker thread running jobs in submission order."""

    def __init__(self, scheduler: Any, name: str = "branchwise-forward") -> None:
        self.scheduler = scheduler
        self.q: queue.SimpleQueue = queue.SimpleQueue()
        self.enabled = True  # runtime switch (follows --async-output's)
        self.launching: Any = None  # the ScheduleBatch being launched by run_batch (scheduler thread)
        self.job: ForwardJob | None = None  # the job run_batch is launching
        self.last: HostEvent | None = None  # the newest job's event: set => the worker is idle
        self.last_end: float | None = None  # when the previous decode job ended (None: no decode before)
        self.stats = ForwardStats()
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    # ---- scheduler thread
    def submit(self, job: ForwardJob) -> None:
        self.last = job.done
        self.q.put(job)

    def drain(self) -> None:
        """Wait for every submitted job (FIFO: the newest done => all done)."""
        if self.last is not None:
            self.last.synchronize()

    def close(self) -> None:
        self.q.put(_STOP)
        self.thread.join(timeout=10)

    # ---- worker thread
    def _run(self) -> None:
        while (job := self.q.get()) is not _STOP:
            t0 = time.perf_counter()
            if self.last_end is not None:
                self.stats.idle_s += t0 - self.last_end
                if (t := step_timer.timer()) is not None:
                    t.add_forward_idle(t0 - self.last_end)
            try:
                self._execute(job)
            except BaseException as e:  # noqa: BLE001 - handed to the scheduler thread
                logger.exception("Branchwise forward thread: forward failed")
                job.done.error = e
            t1 = time.perf_counter()
            self.stats.jobs += 1
            self.stats.busy_s += t1 - t0
            self.last_end = t1
            job.done.set()  # last: after it the scheduler may touch anything this job used

    def _execute(self, job: ForwardJob) -> None:
        from sglang.srt.managers import overlap_utils

        s, b = self.scheduler, job.snapshot
        overlap_utils.resolve_forward_inputs(b, s.future_map)  # gather step n-1's stashed tokens
        real = job.run(b)
        real.copy_done = s.device_module.Event()  # copy_to_cpu records it (a no-op event on CPU)
        s._relay_forward_payload(b, b.req_pool_indices, real)  # stash for step n+1
        real.copy_to_cpu(return_logprob=b.return_logprob, return_hidden_states=b.return_hidden_states)
        ph = job.placeholder
        for f in dataclasses.fields(real):
            if f.name not in _SCHEDULER_OWNED:
                setattr(ph, f.name, getattr(real, f.name))


_EX: ForwardExecutor | None = None


def executor() -> ForwardExecutor | None:
    return _EX


def static_reason(scheduler: Any) -> str | None:
    """Why the forward thread cannot run on this server, or None. A function of the config only."""
    from sglang.srt.runtime_context import get_parallel

    p = get_parallel()
    checks = [
        (os.environ.get(ENV, "0").strip() != "1", f"{ENV} is not 1 (opt-in)"),
        (str(scheduler.device) != "cpu", "not a CPU device (GPU streams already overlap)"),
        (not scheduler.enable_overlap, "overlap schedule disabled"),
        (p.tp_size != 1 or p.pp_size != 1, "tp or pp > 1"),
        (not scheduler.spec_algorithm.is_none(), "speculative decoding"),
        (getattr(scheduler, "enable_unified_memory", False), "unified memory"),
        (getattr(scheduler, "enable_pdmux", False), "PDMux"),
        (scheduler.disaggregation_mode.name != "NULL", "PD disaggregation"),
        (getattr(scheduler, "_confidence_budget_prepare", None) is not None, "confidence relay"),
        (getattr(scheduler, "enable_async_d2h_copy", False), "async D2H copy worker"),
    ]
    return next((why for bad, why in checks if bad), None)


def batch_reason(batch: Any, scheduler: Any = None) -> str | None:
    """Why this batch runs inline (None: it goes to the worker). A function of the batch only."""
    from sglang.srt.environ import envs

    if not batch.forward_mode.is_decode():
        return "not decode"
    si = batch.sampling_info
    checks = [
        (not batch.spec_algorithm.is_none(), "speculative"),
        (batch.input_ids is not None or batch.prefill_input_ids_cpu is not None, "inputs staged"),
        (batch.has_grammar, "grammar"),
        (batch.beam_tail is not None
         or getattr(getattr(scheduler, "beam_coordinator", None), "_num_live_groups", 0), "beam search"),
        (si is None, "no sampling info"),
        (si is not None and si.has_custom_logit_processor, "custom logit processor"),
        (si is not None and _penalties(si.penalizer_orchestrator), "penalties"),
        (envs.SGLANG_ENABLE_DELAY_SAMPLE.get(), "delayed sampling"),
    ]
    return next((why for bad, why in checks if bad), None)


def snapshot(batch: Any) -> Any:
    """The batch as launched: a shallow copy whose lists are copied too (merge_batch extends
    `reqs` and the logprob lists in place; tensors are rebound out of place, see the module doc)."""
    snap = copy.copy(batch)
    for name, value in vars(snap).items():
        if type(value) is list:
            setattr(snap, name, list(value))
    return snap


def _penalties(orch: Any) -> bool:
    """SGLang has two orchestrators: `is_required` is an attribute on one, a method on the other."""
    if orch is None:
        return False
    req = orch.is_required
    return bool(req() if callable(req) else req)


def install(scheduler: Any) -> ForwardExecutor | None:
    global _EX
    why = static_reason(scheduler)
    if why is not None:
        logger.info("Branchwise forward thread off: %s", why)
        return None
    switch = os.environ.get(SWITCH_ENV, "").strip()
    if switch:
        ms = float(switch)
        if not 0 < ms <= 100:
            raise ValueError(f"{SWITCH_ENV} must be in (0, 100] ms, got {switch!r}")
        sys.setswitchinterval(ms / 1e3)
    _EX = ForwardExecutor(scheduler)
    logger.info("Branchwise forward thread on (torch intra-op threads: %d, GIL switch interval %.2f ms)",
                _torch_threads(), 1e3 * sys.getswitchinterval())
    return _EX


def _torch_threads() -> int:
    import torch

    return torch.get_num_threads()


# ---------------------------------------------------------------- hook bodies (targets in plugin.py)

def after_scheduler_init(result: None, self: Any, *args: Any, **kwargs: Any) -> None:
    from branchwise.config import BranchwiseConfig

    if BranchwiseConfig.from_server_args(self.server_args).async_output:
        install(self)


def around_run_batch(orig: Any, self: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
    ex = _EX
    if ex is None:
        return orig(self, batch, *args, **kwargs)
    why = "switched off" if not ex.enabled else batch_reason(batch, self)
    if why is not None:
        ex.drain()  # an inline forward must come after every queued one (one stream)
        ex.stats.inline += 1
        if batch.forward_mode.is_decode():
            ex.stats.reasons[why] = ex.stats.reasons.get(why, 0) + 1
        ex.last_end = None  # the next decode gap is not a decode-to-decode gap
        return orig(self, batch, *args, **kwargs)
    ex.launching = batch
    try:
        result = orig(self, batch, *args, **kwargs)
    finally:
        ex.launching = None
    if ex.job is not None:  # SGLang took another path than its overlap forward: its result has no event
        job, ex.job = ex.job, None
        raise RuntimeError(f"Branchwise forward thread: the {job.bs}-row job's result copy was not reached")
    return result


def around_resolve_forward_inputs(orig: Any, batch: Any, future_map: Any, *args: Any, **kwargs: Any) -> Any:
    ex = _EX
    if ex is not None and batch is ex.launching:
        return None  # deferred to the worker: it must follow the previous step's stash
    return orig(batch, future_map, *args, **kwargs)


def around_forward_batch_generation(orig: Any, self: Any, batch: Any = None, *args: Any, **kwargs: Any) -> Any:
    ex = _EX
    if ex is None or batch is None or batch is not ex.launching or args or kwargs:
        return orig(self, batch, *args, **kwargs)
    from sglang.srt.managers.utils import GenerationBatchResult

    placeholder = GenerationBatchResult()
    placeholder._bw_job = True  # _relay_forward_payload / _copy_result_to_cpu: the worker does them
    job = ForwardJob(snapshot(batch), placeholder, lambda b: orig(self, b), HostEvent(), len(batch.seq_lens))
    ex.job = job
    ex.submit(job)  # the snapshot is complete: _forward_isolation already swapped in the forward-only sampling_info
    return placeholder


def around_relay_forward_payload(orig: Any, self: Any, batch: Any, future_indices: Any, result: Any,
                                 *args: Any, **kwargs: Any) -> Any:
    if getattr(result, "_bw_job", False):
        return None
    return orig(self, batch, future_indices, result, *args, **kwargs)


def around_copy_result_to_cpu(orig: Any, self: Any, result: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
    ex = _EX
    if ex is None or not getattr(result, "_bw_job", False):
        return orig(self, result, batch, *args, **kwargs)
    job, ex.job = ex.job, None
    if job is None or job.placeholder is not result:
        raise RuntimeError("Branchwise forward thread: result copy without its launched job")
    result.copy_done = job.done  # SGLang's result processing synchronises on it
    return None


def after_get_internal_state(result: Any, self: Any, *args: Any, **kwargs: Any) -> Any:
    ex = _EX
    if ex is not None and isinstance(getattr(result, "internal_state", None), dict):
        result.internal_state["branchwise_forward_thread"] = {
            **dataclasses.asdict(ex.stats), "enabled": ex.enabled}
    return result


def set_enabled(on: bool) -> None:
    """Runtime switch (with --async-output's): takes effect at the next launch; queued jobs finish."""
    if _EX is not None:
        _EX.enabled = on
