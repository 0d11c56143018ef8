"""CPU forward thread (Albireo): one FIFO worker thread plays SGLang's forward stream on CPU.

Opt-in (env BRANCHWISE_FORWARD_THREAD=1, --async-output on CPU): docs/design/albireo-forward-thread.md.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import logging
import os
import queue
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from sglang.srt.managers.overlap_utils import FutureMap
    from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.managers.tp_worker import TpModelWorker
    from sglang.srt.managers.utils import GenerationBatchResult
    from sglang.srt.mem_cache.radix_cache import RadixCache
    from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo

    from branchwise.config import BranchwiseConfig
    from branchwise.step_timer import StepTimer

Hook = Callable[..., Any]

logger = logging.getLogger("branchwise")
ENV = "BRANCHWISE_FORWARD_THREAD"  # "1": on where --async-output qualifies
SWITCH_ENV = "BRANCHWISE_FORWARD_SWITCH_MS"  # GIL switch interval while it runs
TIMEOUT_ENV = "BRANCHWISE_FORWARD_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 600.0
_POLL_S = 1.0
_STOP = object()
# placeholder fields the scheduler thread sets itself before it synchronises
_SCHEDULER_OWNED = frozenset({"copy_done", "delay_sample_func", "future_indices", "extra_keep_alive_refs",
                              "extend_input_len_per_req", "extend_logprob_start_len_per_req"})


class ForwardThreadError(RuntimeError):
    """The forward thread failed, died or did not finish a job in time (raised on the scheduler thread)."""


class HostEvent:
    """Drop-in `copy_done`, set when the job completes; synchronize() re-raises its failure or timeout."""

    __slots__ = ("_done", "error", "_worker")

    def __init__(self) -> None:
        self._done = threading.Event()
        self.error: BaseException | None = None
        self._worker: ForwardExecutor | None = None

    def record(self, stream: object = None) -> None:
        return None

    def set(self) -> None:
        self._done.set()

    def query(self) -> bool:
        return self._done.is_set()

    def synchronize(self) -> None:
        if not self._done.is_set():
            self._wait()
        if self.error is not None:
            raise ForwardThreadError("Branchwise forward thread: the forward failed") from self.error

    def _wait(self) -> None:
        executor = self._worker
        limit = executor.timeout_s if executor is not None else DEFAULT_TIMEOUT_S
        deadline = time.monotonic() + limit
        while not self._done.wait(max(0.0, min(_POLL_S, deadline - time.monotonic()))):
            if executor is not None:
                executor.check_alive()
            if time.monotonic() >= deadline:
                stack = executor.worker_stack() if executor is not None else "(not submitted to a worker)"
                raise ForwardThreadError(f"Branchwise forward thread: no result after {limit:g} s "
                                         f"({TIMEOUT_ENV}); the worker is at:\n{stack}")

    def wait(self, stream: object = None) -> None:
        self.synchronize()


@dataclass(slots=True, kw_only=True)
class ForwardJob:
    """One launched batch on its way through the worker (one job, or two with delayed sampling)."""

    snapshot: ScheduleBatch
    placeholder: GenerationBatchResult  # what the scheduler holds; filled in before `done` is set
    run: Callable[[ScheduleBatch], GenerationBatchResult]
    done: HostEvent
    rows: int
    # delayed sampling (grammar): a second job samples once the scheduler thread built the mask
    forwarded: HostEvent | None = None
    unsampled: GenerationBatchResult | None = None


@dataclass
class ForwardStats:
    jobs: int = 0
    samples: int = 0  # sampling jobs of delayed (grammar) forwards
    inline: int = 0  # batches run on the scheduler thread after a drain
    busy_s: float = 0.0
    idle_s: float = 0.0  # gaps between consecutive worker forwards
    reasons: dict[str, int] = field(default_factory=dict)  # "<mode>: <why>" -> inline batches
    modes: dict[str, int] = field(default_factory=dict)
    features: dict[str, int] = field(default_factory=dict)
    checkpoint_drains: int = 0  # radix checkpoints that rewrote a row while a forward was queued or running

    def count(self, table: dict[str, int], key: str) -> None:
        table[key] = table.get(key, 0) + 1


class ForwardExecutor:
    """The CPU "forward stream": one worker thread running jobs in submission order."""

    def __init__(self, scheduler: Scheduler | None, name: str = "branchwise-forward",
                 timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.scheduler = scheduler
        self.timeout_s = timeout_s
        self.fatal: BaseException | None = None  # why the worker thread stopped
        self.queue: queue.SimpleQueue[tuple[ForwardJob, bool] | object] = queue.SimpleQueue()
        self.enabled = True  # follows --async-output's runtime switch
        self.launching: ScheduleBatch | None = None
        self.job: ForwardJob | None = None
        self.last: HostEvent | None = None  # the newest job's event: set => the worker is idle
        self.last_end: float | None = None
        self.stats = ForwardStats()
        self.timer: StepTimer | None = None  # set by the step timer's build (bench)
        # chunked prefill on the worker needs every checkpoint to pass through around_checkpoint
        self.checkpoint_guarded = _guarded_checkpoint(scheduler)
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    # ---- scheduler thread
    def submit(self, job: ForwardJob, sample: bool = False) -> None:
        """Queue `job`'s forward, or with `sample` the sampling half of a delayed job."""
        self.check_alive()
        for event in (job.done, job.forwarded):
            if event is not None:
                event._worker = self
        self.last = job.forwarded if job.forwarded is not None and not sample else job.done
        self.queue.put((job, sample))

    def check_alive(self) -> None:
        """Raise (chained to the worker's exception) if the worker thread has stopped."""
        if self.thread.is_alive():
            return
        if self.fatal is not None:
            raise ForwardThreadError("Branchwise forward thread: the worker thread died") from self.fatal
        raise ForwardThreadError("Branchwise forward thread: the worker thread is not running")

    def worker_stack(self) -> str:
        frame = sys._current_frames().get(self.thread.ident or -1)
        return "".join(traceback.format_stack(frame)) if frame is not None else "(not running)"

    def drain(self) -> None:
        """Wait for every submitted job (FIFO: the newest done => all done)."""
        if self.last is not None:
            self.last.synchronize()

    def busy(self) -> bool:
        return self.last is not None and not self.last.query()

    def report(self) -> dict[str, Any]:
        """`/server_info` internal_states[i]["branchwise_forward_thread"]."""
        return {**dataclasses.asdict(self.stats), "enabled": self.enabled}

    def close(self) -> None:
        self.queue.put(_STOP)
        self.thread.join(timeout=10)

    # ---- worker thread
    def _run(self) -> None:
        # any failure, start-up included, ends in `fatal`: a waiting scheduler thread raises with it
        try:
            # grad mode is per thread: the scheduler loop's
            from sglang.srt.utils.common import DynamicGradMode

            if self.scheduler is not None:
                bind_worker_threads()
            with DynamicGradMode():
                self._loop()
        except BaseException as e:  # noqa: BLE001 - handed to the scheduler thread
            logger.exception("Branchwise forward thread: the worker thread stopped")
            self.fatal = e

    def _loop(self) -> None:
        while (item := self.queue.get()) is not _STOP:
            job, sample = item
            start = time.perf_counter()
            if self.last_end is not None:
                self.stats.idle_s += start - self.last_end
                if self.timer is not None:
                    self.timer.add_forward_idle(start - self.last_end)
            sampling_next = False
            try:
                sampling_next = bool(self._execute(job, sample))
            except BaseException as e:  # noqa: BLE001 - handed to the scheduler thread
                logger.exception("Branchwise forward thread: forward failed")
                job.done.error = e
            end = time.perf_counter()
            if sample:
                self.stats.samples += 1
            else:
                self.stats.jobs += 1
            self.stats.busy_s += end - start
            self.last_end = end
            if job.forwarded is not None:
                job.forwarded.set()
            if not sampling_next:
                job.done.set()  # last: after it the scheduler may touch anything this job used

    def _execute(self, job: ForwardJob, sample: bool = False) -> bool:
        """Run one job; True when it was a delayed job's forward, whose sampling is queued later."""
        from sglang.srt.managers import overlap_utils

        scheduler, snap = self.scheduler, job.snapshot
        if sample:  # the mask is built (_launch_sampling); the forward job left its logits here
            if job.unsampled is None:  # the forward failed: `done` already carries its error
                return False
            result, job.unsampled = job.unsampled, None
            result.delay_sample_func()
            result.delay_sample_func = None
        else:
            # gather step n-1's stashed tokens
            overlap_utils.resolve_forward_inputs(snap, scheduler.future_map)
            result = job.run(snap)
            if (result.delay_sample_func is not None) != (job.forwarded is not None):
                raise RuntimeError("Branchwise forward thread: the forward's delayed sampling does not match "
                                   "the launch's prediction (samples_later)")
            if job.forwarded is not None:
                job.unsampled = result
                return True
        result.copy_done = scheduler.device_module.Event()  # copy_to_cpu records it (a no-op event on CPU)
        scheduler._relay_forward_payload(snap, snap.req_pool_indices, result)  # stash for step n+1
        result.copy_to_cpu(return_logprob=snap.return_logprob, return_hidden_states=snap.return_hidden_states)
        if sample and result.logits_output is not None:  # as launch_batch_sample_if_needed, after the copy
            result.logits_output.next_token_logits = None
        for fld in dataclasses.fields(result):
            if fld.name not in _SCHEDULER_OWNED:
                setattr(job.placeholder, fld.name, getattr(result, fld.name))
        return False


def bind_worker_threads() -> None:
    """Bind this thread's OpenMP team as SGLang binds the scheduler thread's (a team is per thread)."""
    import torch
    from sglang.srt.distributed import bootstrap

    if not (bootstrap._is_cpu_amx_available or bootstrap._is_cpu_arm64):
        return
    from sglang.srt.runtime_context import get_device, get_parallel
    from sglang.srt.utils import numa_utils

    par = get_parallel()
    cpuid = numa_utils.init_threads_binding(numa_index=get_device().gpu_id,
                                            world_size=par.dp_size * par.tp_size * par.pp_size)
    torch.ops.sgl_kernel.init_cpu_threads_env(cpuid)


def static_reason(scheduler: Scheduler) -> str | None:
    """Why the forward thread cannot run on this server, or None. A function of the config only."""
    from sglang.srt.environ import envs
    from sglang.srt.runtime_context import get_parallel

    par = get_parallel()
    checks = [
        (os.environ.get(ENV, "0").strip() != "1", f"{ENV} is not 1 (opt-in)"),
        (str(scheduler.device) != "cpu", "not a CPU device (GPU streams already overlap)"),
        (not scheduler.enable_overlap, "overlap schedule disabled"),
        (par.pp_size != 1, "pp > 1"),
        # ranks would plan different batches (idle, grammar) and gather on the forward's group
        (scheduler.require_mlp_sync, "attention DP or batches synced across ranks"),
        # the prefill delayer's all-gather would run on the forward's device_group from this thread
        (par.tp_size > 1 and envs.SGLANG_NCCL_ALL_GATHER_IN_OVERLAP_SCHEDULER_SYNC_BATCH.get(),
         "SGLANG_NCCL_ALL_GATHER_IN_OVERLAP_SCHEDULER_SYNC_BATCH"),
        (not scheduler.spec_algorithm.is_none(), "speculative decoding"),
        (getattr(scheduler, "enable_unified_memory", False), "unified memory"),
        (getattr(scheduler, "enable_pdmux", False), "PDMux"),
        (scheduler.disaggregation_mode.name != "NULL", "PD disaggregation"),
        (getattr(scheduler, "_confidence_budget_prepare", None) is not None, "confidence relay"),
        (getattr(scheduler, "enable_async_d2h_copy", False), "async D2H copy worker"),
        # adapter loads/unloads run on the scheduler thread while the worker's forward would use them
        (getattr(scheduler, "enable_lora", False), "LoRA"),
    ]
    return next((why for bad, why in checks if bad), None)


WORKER_MODES = frozenset({"DECODE", "EXTEND", "MIXED"})


def mode_name(batch: ScheduleBatch) -> str:
    return batch.forward_mode.name.lower()


def batch_reason(batch: ScheduleBatch, scheduler: Scheduler | None = None,
                 checkpoint_guarded: bool = False) -> str | None:
    """Why this batch runs inline (None: it goes to the worker). A function of the batch only."""
    mode = batch.forward_mode.name
    if mode not in WORKER_MODES:
        return f"{mode.lower()} batch"
    decode = mode == "DECODE"
    info = batch.sampling_info
    checks = [
        (not batch.spec_algorithm.is_none(), "speculative"),
        (decode and (batch.input_ids is not None or batch.prefill_input_ids_cpu is not None),
         "inputs staged"),
        # the worker's resolve_forward_inputs copies the prefill ids from the host staging
        (not decode and (batch.input_ids is not None or batch.prefill_input_ids_cpu is None),
         "prefill ids not staged on the host"),
        # radix dedup may rewrite a chunked request's row: only a guarded checkpoint waits for it
        (not decode and batch.chunked_req is not None and not checkpoint_guarded,
         "chunked prefill"),
        (not decode and _embeds(batch), "multimodal or embedding inputs"),
        (getattr(batch, "hicache_consumer_index", -1) >= 0, "hierarchical cache load"),
        (getattr(getattr(batch, "model_config", None), "is_encoder_decoder", False), "encoder-decoder"),
        (batch.beam_tail is not None
         or getattr(getattr(scheduler, "beam_coordinator", None), "_num_live_groups", 0), "beam search"),
        (info is None, "no sampling info"),
        (info is not None and info.has_custom_logit_processor
         and (info.custom_params is None or len(info.custom_params) != len(batch.reqs)),
         "custom logit processor"),
    ]
    return next((why for bad, why in checks if bad), None)


def samples_later(worker: TpModelWorker, batch: ScheduleBatch) -> bool:
    """Whether the TP worker will leave this batch's sampling for later (`delay_sample_func`)."""
    from sglang.srt.environ import envs

    # ForwardBatch.init_new sets sampling_info.grammars from has_grammar, which the worker then tests
    return bool(worker.enable_overlap and not worker.enable_spec
                and (batch.has_grammar
                     or (envs.SGLANG_ENABLE_DELAY_SAMPLE.get() and not batch.is_prefill_only)))


def _embeds(batch: ScheduleBatch) -> bool:
    multimodal = batch.multimodal_inputs
    return (batch.input_embeds is not None or batch.replace_embeds is not None
            or (multimodal is not None and any(item is not None for item in multimodal)))


def snapshot(batch: ScheduleBatch) -> ScheduleBatch:
    """The batch as launched: a shallow copy with its lists copied (merge_batch extends them in place)."""
    snap = copy.copy(batch)
    for name, value in vars(snap).items():
        if type(value) is list:
            setattr(snap, name, list(value))
    info = getattr(snap, "sampling_info", None)
    if info is not None and info.has_custom_logit_processor and info.custom_params is not None:
        # the launch's forward-only copy; leave the shared list alone
        snap.sampling_info = info = copy.copy(info)
        info.custom_params = [_frozen_params(params, req)
                              for params, req in zip(info.custom_params, snap.reqs, strict=True)]
    return snap


def _frozen_params(params: dict[str, Any] | None, req: Req) -> dict[str, Any] | None:
    if not params or "__req__" not in params:
        return params
    return {**params, "__req__": req_view(req)}


def req_view(req: Req) -> Req:
    """A shallow copy of a Req with its in-place per-step state (output_ids, kv) copied."""
    view = copy.copy(req)
    for name in ("output_ids", "origin_input_ids"):
        if (value := getattr(req, name, None)) is not None:
            setattr(view, name, copy.copy(value))
    if getattr(req, "kv", None) is not None:
        view.kv = copy.copy(req.kv)
    return view


ATTR = "_branchwise_forward"  # on the TP worker, the FutureMap and (guarded) the tree cache


def build(scheduler: Scheduler, config: BranchwiseConfig) -> ForwardExecutor | None:
    """The scheduler's CPU forward thread, attached as ATTR (None unless --async-output qualifies)."""
    if not config.async_output:
        return None
    why = static_reason(scheduler)
    if why is not None:
        logger.info("Branchwise forward thread off: %s", why)
        return None
    switch = os.environ.get(SWITCH_ENV, "").strip()
    if switch:
        switch_ms = float(switch)
        if not 0 < switch_ms <= 100:
            raise ValueError(f"{SWITCH_ENV} must be in (0, 100] ms, got {switch!r}")
        sys.setswitchinterval(switch_ms / 1e3)
    executor = ForwardExecutor(scheduler, timeout_s=_timeout_s())
    setattr(scheduler.tp_worker, ATTR, executor)
    setattr(scheduler.future_map, ATTR, executor)
    if executor.checkpoint_guarded:
        setattr(scheduler.tree_cache, ATTR, executor)
    logger.info("Branchwise forward thread on (torch intra-op threads: %d, GIL switch interval %.2f ms)",
                _torch_threads(), 1e3 * sys.getswitchinterval())
    return executor


def _timeout_s() -> float:
    raw = os.environ.get(TIMEOUT_ENV, "").strip()
    if not raw:
        return DEFAULT_TIMEOUT_S
    seconds = float(raw)
    if not 0 < seconds < float("inf"):
        raise ValueError(f"{TIMEOUT_ENV} must be a positive number of seconds, got {raw!r}")
    return seconds


def _torch_threads() -> int:
    import torch

    return torch.get_num_threads()


# ---------------------------------------------------------------- hook bodies (targets in plugin.py)

def around_run_batch(orig: Hook, scheduler: Scheduler, batch: ScheduleBatch, *args: Any, **kwargs: Any) -> Any:
    executor = scheduler.branchwise.forward
    if executor is None:
        return orig(scheduler, batch, *args, **kwargs)
    why = "switched off" if not executor.enabled else batch_reason(batch, scheduler, executor.checkpoint_guarded)
    if why is not None:
        executor.drain()  # an inline forward must come after every queued one (one stream)
        executor.stats.inline += 1
        executor.stats.count(executor.stats.reasons, f"{mode_name(batch)}: {why}")
        executor.last_end = None  # the next decode gap is not a decode-to-decode gap
        return orig(scheduler, batch, *args, **kwargs)
    executor.launching = batch
    try:
        result = orig(scheduler, batch, *args, **kwargs)
    finally:
        executor.launching = None
    if executor.job is not None:  # SGLang took another path than its overlap forward: its result has no event
        job, executor.job = executor.job, None
        raise RuntimeError(f"Branchwise forward thread: the {job.rows}-row job's result copy was not reached")
    return result


def around_resolve_forward_inputs(orig: Hook, batch: ScheduleBatch, future_map: FutureMap,
                                  *args: Any, **kwargs: Any) -> None:
    executor = getattr(future_map, ATTR, None)
    if executor is not None and batch is executor.launching:
        return None  # deferred to the worker: it must follow the previous step's stash
    return orig(batch, future_map, *args, **kwargs)


def around_forward_batch_generation(orig: Hook, worker: TpModelWorker, batch: ScheduleBatch | None = None,
                                    *args: Any, **kwargs: Any) -> GenerationBatchResult:
    executor = getattr(worker, ATTR, None)
    if executor is None or batch is None or batch is not executor.launching or args or kwargs:
        return orig(worker, batch, *args, **kwargs)
    from sglang.srt.managers.utils import GenerationBatchResult

    placeholder = GenerationBatchResult()
    placeholder._branchwise_job = True  # _relay_forward_payload / _copy_result_to_cpu: the worker does them
    delayed = samples_later(worker, batch)
    job = ForwardJob(snapshot=snapshot(batch), placeholder=placeholder, run=lambda snap: orig(worker, snap),
                     done=HostEvent(), rows=len(batch.seq_lens), forwarded=HostEvent() if delayed else None)
    # the worker consumes the snapshot's prefill staging: clear the live batch's as stock would
    batch.prefill_input_ids_cpu = None
    batch.mix_running_indices = None
    if delayed:  # run_batch then skips relay and copy; launch_batch_sample_if_needed calls this
        placeholder.delay_sample_func = functools.partial(_launch_sampling, executor, job)
        # what ForwardBatch.init_new will set on the worker; the mask may be built first
        if batch.has_grammar:
            job.snapshot.sampling_info.grammars = [req.grammar for req in batch.reqs]
    else:
        executor.job = job
    _count_job(executor.stats, batch)
    # the snapshot is complete: _forward_isolation already swapped in the forward-only sampling_info
    executor.submit(job)
    return placeholder


def _launch_sampling(executor: ForwardExecutor, job: ForwardJob) -> GenerationBatchResult:
    """delay_sample_func: build the vocab mask here, as stock does; queue the sampling on the worker."""
    info = job.snapshot.sampling_info  # the launch's forward-only copy, which the worker samples with
    info.update_regex_vocab_mask()
    info._branchwise_mask_ready = True  # around_update_regex_vocab_mask: the worker's sample keeps this mask
    executor.job = job
    executor.submit(job, sample=True)
    return job.placeholder


def around_update_regex_vocab_mask(orig: Hook, info: SamplingBatchInfo, *args: Any, **kwargs: Any) -> None:
    """Keep the mask _launch_sampling built: the worker must not read the advancing grammars."""
    if info.__dict__.pop("_branchwise_mask_ready", False):
        return None
    return orig(info, *args, **kwargs)


def _count_job(stats: ForwardStats, batch: ScheduleBatch) -> None:
    mode = mode_name(batch)
    stats.count(stats.modes, mode)
    info = batch.sampling_info  # the forward-only copy: penalties show as its materialised accumulators
    for on, feature in ((info.acc_additive_penalties is not None or info.acc_scaling_penalties is not None,
                         "penalties"),
                        (info.has_custom_logit_processor, "custom logit processor"),
                        (batch.return_logprob, "logprobs"),
                        (batch.has_grammar, "grammar"),
                        (batch.chunked_req is not None, "chunked prefill")):
        if on:
            stats.count(stats.features, f"{mode}: {feature}")


def around_relay_forward_payload(orig: Hook, scheduler: Scheduler, batch: ScheduleBatch,
                                 future_indices: torch.Tensor, result: GenerationBatchResult,
                                 *args: Any, **kwargs: Any) -> None:
    if getattr(result, "_branchwise_job", False):
        return None
    return orig(scheduler, batch, future_indices, result, *args, **kwargs)


def around_copy_result_to_cpu(orig: Hook, scheduler: Scheduler, result: GenerationBatchResult,
                              batch: ScheduleBatch, *args: Any, **kwargs: Any) -> None:
    executor = scheduler.branchwise.forward
    if executor is None or not getattr(result, "_branchwise_job", False):
        return orig(scheduler, result, batch, *args, **kwargs)
    job, executor.job = executor.job, None
    if job is None or job.placeholder is not result:
        raise RuntimeError("Branchwise forward thread: result copy without its launched job")
    result.copy_done = job.done  # SGLang's result processing synchronises on it
    return None


def _guarded_checkpoint(scheduler: Scheduler | None) -> bool:
    tree_cache = getattr(scheduler, "tree_cache", None)
    if tree_cache is None:
        return False
    from sglang.srt.mem_cache.radix_cache import RadixCache
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    # the classes whose checkpoint plugin.py wraps with around_checkpoint (UnifiedRadixCache is the default)
    return type(tree_cache).checkpoint in (RadixCache.checkpoint, UnifiedRadixCache.checkpoint)


def around_checkpoint(orig: Hook, cache: RadixCache, req: Req, *args: Any, **kwargs: Any) -> None:
    """(Unified)RadixCache.checkpoint: drain the worker before a write that changes a queued row."""
    executor = getattr(cache, ATTR, None)
    if executor is None or not executor.busy():
        return orig(cache, req, *args, **kwargs)
    pool = cache.req_to_token_pool
    # instance attribute for this call only
    pool.write = _CheckedWrite(executor, type(pool).write.__get__(pool))
    try:
        return orig(cache, req, *args, **kwargs)
    finally:
        del pool.write


class _CheckedWrite:
    """ReqToTokenPool.write for one checkpoint: drain the worker before a write that changes a row."""

    __slots__ = ("executor", "write")

    def __init__(self, executor: ForwardExecutor,
                 write: Callable[[torch.Tensor, torch.Tensor], None]) -> None:
        self.executor, self.write = executor, write

    def __call__(self, indices: torch.Tensor | slice, values: torch.Tensor | list[int]) -> None:
        import torch

        table = self.write.__self__.req_to_token
        current = table[indices]
        new = values if isinstance(values, torch.Tensor) else torch.as_tensor(values)
        if current.shape != new.shape or not torch.equal(current, new.to(current.dtype)):
            self.executor.stats.checkpoint_drains += 1
            self.executor.drain()
        self.write(indices, values)
