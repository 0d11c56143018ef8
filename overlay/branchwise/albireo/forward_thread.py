"""Asynchronous forward executor for CPU: make SGLang's overlap loop overlap for real (Albireo).

SGLang's overlap loop (`event_loop_overlap`) launches step n on the forward stream, then processes
step n-1's result and plans step n+1 while step n runs. On CPU the streams are synchronous: the
forward runs inline on the scheduler thread and nothing overlaps. With `--async-output` on a CPU
device this module gives the forward stream a thread: for an eligible batch, `run_batch` hands
everything SGLang would have queued on the forward stream to one FIFO worker thread

    resolve_forward_inputs (prefill ids from the host staging; decode / mixed-in running rows:
    FutureMap gather) -> TpModelWorker.forward_batch_generation (ForwardBatch build, forward,
    sample) -> _relay_forward_payload (FutureMap stash) -> copy_to_cpu

and returns a placeholder result whose `copy_done` is a `HostEvent` set when the job is done, so
SGLang's own `copy_done.synchronize()` in result processing is the only wait, as on a GPU. Torch ops
release the GIL, so the model's kernels run while the scheduler thread does Python work.

What runs where (stats: `/server_info` internal_states[0]["branchwise_forward_thread"]: `modes` =
worker jobs per forward mode, `features` = worker jobs with penalties / custom processors /
logprobs, `reasons` = inline batches by "<mode>: <why>"):
* worker: decode, extend (prefill: new arrivals, Branchwise fork's branch spawns and joins,
  retraction re-prefills) and mixed batches, with or without penalties, custom logit processors
  or (input) logprobs. Albireo's early feedback is SGLang's own split, run in the right order: the
  scheduler thread builds every input of step n+1 but the last sampled tokens (prefill ids on the
  host, seq_lens, out_cache_loc, req_to_token, sampling tensors, penalty accumulators), and the
  worker fills those in (`output_tokens_buf[req_pool_indices]`, or for a mixed batch's running rows
  `output_tokens_buf[mix_running_indices]`) after step n's stash, so no step waits for the previous
  one's result to be processed.
* worker, in two jobs: grammar-constrained batches (and any batch under SGLANG_ENABLE_DELAY_SAMPLE),
  SGLang's delayed-sampling path. Their mask needs the grammars' FSMs advanced by step n-1's
  tokens, which happens in step n-1's result processing, so stock launches the forward, processes
  step n-1, then samples (`launch_batch_sample_if_needed`). Here the forward job runs while the
  scheduler thread processes step n-1; the placeholder's `delay_sample_func` (`_launch_sampling`)
  then builds the vocab mask on the scheduler thread, as stock does, and queues the sampling job
  (sample, FutureMap stash, copy_to_cpu), which the worker runs before step n+1's forward.
* inline, after draining the worker (`batch_reason`): idle, speculative, beam search, multimodal /
  embedding inputs, hierarchical-cache loads, encoder-decoder, and unfinished prefill chunks where
  the tree cache is not RadixCache (below). An inline forward runs after every queued one, so no
  forward ever runs concurrently with another.

Why this is race-free (checked against SGLang 0.5.23's scheduler, overlap loop and radix caches):
* One FIFO thread = one stream: step n+1's gather runs after step n's stash (resolve-after-stash),
  and every KV write of a forward precedes the forwards launched after it (a prefix matched by a
  later prefill, e.g. a branch spawn over its parked parent, was written by an earlier job).
* The worker reads a shallow snapshot of the ScheduleBatch taken at launch on the scheduler thread
  (its lists copied: prefix_lens, extend_lens, logprob lists, reqs, decoding_reqs); SGLang rebinds
  the batch's per-row tensors out of place afterwards (prepare_for_decode: `seq_lens = seq_lens + 1`,
  filter: `t[keep]`, merge: `torch.cat`; Branchwise's deferral clones before index_copy_), so the
  snapshot keeps the launch-time tensors. The prefill staging (`prefill_input_ids_cpu`, pinned,
  never written after prepare_for_extend; `mix_running_indices`) moves into the snapshot and is
  cleared on the live batch at launch, as stock resolve_forward_inputs would have, so the merged
  running batch's next decode gathers from the FutureMap. Sampling reads the forward-only
  sampling_info copy SGLang's `_forward_isolation` made for this launch.
* Shared pools: prepare_for_extend wrote the rows' req_to_token columns [prefix, seq_len) and
  allocated out_cache_loc before launch; planning step n+1 writes req_to_token only at column
  seq_len of running rows (prepare_for_decode, also after merging a prefill batch) and whole rows
  of newly allocated request slots (a later chunk rewrites its prefix columns with their own
  values). The exception is the tree's checkpoint (UnifiedRadixCache, SGLang's default, and
  RadixCache: `checkpoint_into_tree` / `checkpoint`): after inserting a request's KV it rewrites the
  request's row below seq_len with the tree's indices when another request inserted the same tokens
  first (and frees the duplicates). It runs in result processing for every prefilled request
  (while the next decode step, which reads that row, may be queued) and at the next planning for
  an unfinished chunk (`stash_chunked_request`, while the chunk itself may be queued). On a GPU
  SGLang's WAR barrier makes that write wait for the forward's reads; here `around_checkpoint`
  compares the write with the row and drains the worker first when it changes anything
  (stats: `checkpoint_drains`); the duplicate slots it freed are reallocated only after it
  returns. Prefixes matched at planning stay locked until the request
  releases or checkpoints them, eviction frees only unlocked nodes, and KV slots freed while a step
  is in flight (finished / retracted / parked rows) are rewritten only by later forwards (FIFO).
  A request slot reused by a new request belonged to a row step n computes and SGLang discards
  (finished / retracted / parked rows are skipped in result processing), the same sharing as on a
  GPU.
* Live Req state read on the worker: ForwardBatch.init_new reads rid / lora_id (constant) and
  extend_end / full_untruncated_fill_ids only for `contains_last_prefill_chunk`, which only PP
  reads (pp = 1 here). run_batch sets the input-logprob bookkeeping (extend_input_len_per_req,
  extend_logprob_start_len_per_req) on the placeholder itself; the worker leaves those fields alone.
  SGLANG_DISABLE_CONSECUTIVE_PREFILL_OVERLAP (is_disable_overlap_for_batch) only processes the
  previous result before the launch; that waits on its HostEvent.
* Penalties: `copy_for_forward` (at launch, scheduler thread) materialises the accumulated
  penalties into buffers owned by this launch's forward copy (acc_additive: a fresh tensor,
  acc_scaling: a clone) and drops the orchestrator from it, so the worker never reads the
  penalizers. The next planning's cumulate_output_tokens (prepare_for_decode; TAPER's pinned rule
  in deferral.py) mutates the orchestrator's tensors, never those. Under overlap SGLang cumulates
  `output_ids[-1]`, a token already processed on the host, not the in-flight one, so there is
  nothing to backfill: feeding it the in-flight token on the worker would change SGLang's overlap
  penalty semantics (one token of lag), and with it outputs vs stock and TAPER's pinned sequence.
* Custom logit processors read their Req (`custom_params[i]["__req__"]`) when they sample: at
  launch in stock, later on the worker. They get a launch-time view (`req_view`: a shallow copy with
  output_ids, origin_input_ids and kv copied). A processor that reads other mutable Req state would
  see it later than stock; SGLang's own (thinking budget, n-gram) and bench.structure_driver read
  only those.

What it costs: the worker and the scheduler thread share one GIL, so the scheduler thread's
Python does not overlap the worker's, and every hand-off of the GIL costs the worker time
(`python -m bench.gil_handoff` measures it). The worker's idle time before a decode forward (the
exposed time, `python -m bench.overhead --ab`) drops, but decode throughput on CPU does not rise
(docs/benchmarks.md, "Per-step overhead").

Tensor parallelism: every rank runs its own worker, and the jobs, their order and which batches
run inline are functions of the batches, which every rank plans identically (decide once,
broadcast), so the ranks' forwards meet in the same collectives in the same order. Two gloo
groups keep the threads apart: the forward (model all-reduce / all-gather, SGLang's token-id sync,
--parallel-sampling's all-to-all and id gather) uses the TP group's device_group, the scheduler
thread (request broadcast, TAPER's row plan) its cpu_group; a checkpoint drain only waits locally.

Failures stop the scheduler, never hang it: a job's exception is re-raised where the scheduler
thread waits for it (`HostEvent.synchronize`); if the worker thread itself dies (start-up included:
imports, thread binding) every wait and every later submit raises, chained to the worker's traceback;
a job that does not finish within env BRANCHWISE_FORWARD_TIMEOUT_S (default 600 s) raises with the
worker's current stack.

Enabled with --async-output on a CPU device, overlap on, pp = 1, no speculative decoding / PD
disaggregation / PDMux / unified memory / LoRA / DP attention (`static_reason`), and only when env
BRANCHWISE_FORWARD_THREAD=1 opts in (it does not pay off on CPU, above). The --async-output
runtime switch turns it off with the rest.

`build` attaches the executor, as `_branchwise_forward`, to the SGLang objects its non-Scheduler
hooks receive (the TP worker, the FutureMap, a guarded tree cache); the Scheduler hooks read
`scheduler.branchwise.forward`.
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
from typing import Any

logger = logging.getLogger("branchwise")
ENV = "BRANCHWISE_FORWARD_THREAD"  # "1" = on where --async-output qualifies (opt-in: costs throughput on tiny CPU models)
# GIL switch interval (ms) while the forward thread runs: the worker and the scheduler thread share
# one GIL, and a thread that gives it up inside a torch op waits up to this long for the other's
# Python to hand it back (CPython's default is 5 ms). Unset = leave CPython's default.
SWITCH_ENV = "BRANCHWISE_FORWARD_SWITCH_MS"
# Longest wait for one job (seconds): a forward that takes longer, or a worker that hangs (e.g. in
# a collective whose peer died), stops the scheduler with the worker's stack instead of hanging it.
TIMEOUT_ENV = "BRANCHWISE_FORWARD_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 600.0
_POLL_S = 1.0  # how often a waiting scheduler thread checks that the worker is still alive
_STOP = object()
# fields the scheduler thread itself sets on the placeholder before it synchronises
# (run_batch sets the extend_* lists after forward_batch_generation returns; the worker's result has None)
_SCHEDULER_OWNED = frozenset({"copy_done", "delay_sample_func", "future_indices", "extra_keep_alive_refs",
                              "extend_input_len_per_req", "extend_logprob_start_len_per_req"})


class ForwardThreadError(RuntimeError):
    """The forward thread failed, died or did not finish a job in time (raised on the scheduler thread)."""


class HostEvent:
    """Drop-in for a `copy_done` device event: set by the worker when the job is complete.

    `synchronize()` re-raises a failure of the job on the scheduler thread (SGLang would have
    raised in place), so a broken forward still stops the scheduler. It never waits forever: it
    raises as soon as the worker thread it was submitted to is dead (chained to the worker's own
    exception and traceback), and after the executor's timeout with the worker's current stack.
    """

    __slots__ = ("_done", "error", "_worker")

    def __init__(self) -> None:
        self._done = threading.Event()
        self.error: BaseException | None = None
        self._worker: ForwardExecutor | None = None  # bound at submit

    def record(self, stream: Any = None) -> None:  # the worker sets it; recording is a no-op
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
        ex = self._worker
        limit = ex.timeout_s if ex is not None else DEFAULT_TIMEOUT_S
        deadline = time.monotonic() + limit
        while not self._done.wait(max(0.0, min(_POLL_S, deadline - time.monotonic()))):
            if ex is not None:
                ex.check_alive()
            if time.monotonic() >= deadline:
                stack = ex.worker_stack() if ex is not None else "(not submitted to a worker)"
                raise ForwardThreadError(f"Branchwise forward thread: no result after {limit:g} s "
                                         f"({TIMEOUT_ENV}); the worker is at:\n{stack}")

    def wait(self, stream: Any = None) -> None:
        self.synchronize()


@dataclass(slots=True)
class ForwardJob:
    snapshot: Any  # shallow copy of the ScheduleBatch at launch
    placeholder: Any  # GenerationBatchResult the scheduler holds; filled before `done` is set
    run: Callable[[Any], Any]  # forward_batch_generation(snapshot) -> GenerationBatchResult
    done: HostEvent
    bs: int
    # delayed sampling (grammar): the forward job stops before sampling and sets `forwarded`; a
    # second job, queued by _launch_sampling once the mask is built, samples and sets `done`
    forwarded: HostEvent | None = None
    real: Any = None  # the worker's result between the two jobs


@dataclass
class ForwardStats:
    jobs: int = 0  # forward jobs
    samples: int = 0  # sampling jobs of delayed-sampling (grammar) forwards
    inline: int = 0  # batches run on the scheduler thread after draining the worker
    busy_s: float = 0.0
    idle_s: float = 0.0  # gaps between consecutive forwards of the worker (reset by an inline batch)
    reasons: dict[str, int] = field(default_factory=dict)  # "<mode>: <why>" -> inline batches
    modes: dict[str, int] = field(default_factory=dict)  # worker jobs by forward mode (decode/extend/mixed)
    features: dict[str, int] = field(default_factory=dict)  # "<mode>: <feature>" -> worker jobs (penalties, ...)
    checkpoint_drains: int = 0  # radix checkpoints that rewrote a row while a forward was queued or running

    def count(self, table: dict[str, int], key: str) -> None:
        table[key] = table.get(key, 0) + 1


class ForwardExecutor:
    """The CPU "forward stream": one worker thread running jobs in submission order."""

    def __init__(self, scheduler: Any, name: str = "branchwise-forward",
                 timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.scheduler = scheduler
        self.timeout_s = timeout_s  # longest wait for one job (HostEvent.synchronize)
        self.fatal: BaseException | None = None  # why the worker thread stopped (it runs no more jobs)
        self.q: queue.SimpleQueue = queue.SimpleQueue()
        self.enabled = True  # runtime switch (follows --async-output's)
        self.launching: Any = None  # the ScheduleBatch being launched by run_batch (scheduler thread)
        self.job: ForwardJob | None = None  # the job run_batch is launching
        self.last: HostEvent | None = None  # the newest job's event: set => the worker is idle
        self.last_end: float | None = None  # when the previous job ended (None: after an inline batch)
        self.stats = ForwardStats()
        self.timer: Any = None  # the step timer (bench), set by its build
        # chunked prefill on the worker needs every checkpoint of this tree cache to pass through
        # around_checkpoint (RadixCache's own; other caches keep chunked batches inline)
        self.checkpoint_guarded = _guarded_checkpoint(scheduler)
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    # ---- scheduler thread
    def submit(self, job: ForwardJob, sample: bool = False) -> None:
        """Queue `job`'s forward, or with `sample` the sampling half of a delayed job."""
        self.check_alive()
        for ev in (job.done, job.forwarded):
            if ev is not None:
                ev._worker = self
        self.last = job.forwarded if job.forwarded is not None and not sample else job.done
        self.q.put((job, sample))

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
        self.q.put(_STOP)
        self.thread.join(timeout=10)

    # ---- worker thread
    def _run(self) -> None:
        # Everything in here, start-up included, ends in `fatal`: a waiting scheduler thread then
        # raises with this traceback (check_alive) instead of waiting for a job that never runs.
        try:
            # grad mode is per thread: run under the scheduler loop's (no_grad, or inference_mode with
            # SGLANG_ENABLE_TORCH_INFERENCE_MODE, whose tensors cannot be written in place outside it)
            from sglang.srt.utils.common import DynamicGradMode

            if self.scheduler is not None:
                bind_worker_threads()
            with DynamicGradMode():
                self._loop()
        except BaseException as e:  # noqa: BLE001 - handed to the scheduler thread
            logger.exception("Branchwise forward thread: the worker thread stopped")
            self.fatal = e

    def _loop(self) -> None:
        while (item := self.q.get()) is not _STOP:
            job, sample = item
            t0 = time.perf_counter()
            if self.last_end is not None:
                self.stats.idle_s += t0 - self.last_end
                if self.timer is not None:
                    self.timer.add_forward_idle(t0 - self.last_end)
            sampling_next = False
            try:
                sampling_next = bool(self._execute(job, sample))
            except BaseException as e:  # noqa: BLE001 - handed to the scheduler thread
                logger.exception("Branchwise forward thread: forward failed")
                job.done.error = e
            t1 = time.perf_counter()
            if sample:
                self.stats.samples += 1
            else:
                self.stats.jobs += 1
            self.stats.busy_s += t1 - t0
            self.last_end = t1
            if job.forwarded is not None:
                job.forwarded.set()
            if not sampling_next:
                job.done.set()  # last: after it the scheduler may touch anything this job used

    def _execute(self, job: ForwardJob, sample: bool = False) -> bool:
        """Run one job; True when it was a delayed job's forward, whose sampling is queued later."""
        from sglang.srt.managers import overlap_utils

        s, b = self.scheduler, job.snapshot
        if sample:  # the mask is built (_launch_sampling); the forward job left its logits here
            if job.real is None:  # the forward failed: `done` already carries its error
                return False
            real, job.real = job.real, None
            real.delay_sample_func()
            real.delay_sample_func = None
        else:
            overlap_utils.resolve_forward_inputs(b, s.future_map)  # gather step n-1's stashed tokens
            real = job.run(b)
            if (real.delay_sample_func is not None) != (job.forwarded is not None):
                raise RuntimeError("Branchwise forward thread: the forward's delayed sampling does not match "
                                   "the launch's prediction (samples_later)")
            if job.forwarded is not None:
                job.real = real
                return True
        real.copy_done = s.device_module.Event()  # copy_to_cpu records it (a no-op event on CPU)
        s._relay_forward_payload(b, b.req_pool_indices, real)  # stash for step n+1
        real.copy_to_cpu(return_logprob=b.return_logprob, return_hidden_states=b.return_hidden_states)
        ph = job.placeholder
        if sample and real.logits_output is not None:  # as launch_batch_sample_if_needed, after the copy
            real.logits_output.next_token_logits = None
        for f in dataclasses.fields(real):
            if f.name not in _SCHEDULER_OWNED:
                setattr(ph, f.name, getattr(real, f.name))
        return False


def bind_worker_threads() -> None:
    """On AMX / arm64 CPUs SGLang binds the rank's OpenMP threads to its cores from the scheduler
    thread at start-up (bootstrap._init_cpu_threads_env). A thread team belongs to the thread that
    starts it, and this thread inherited the scheduler thread's one-core affinity: bind its team the
    same way, else all its compute threads share one core. Elsewhere SGLang binds nothing."""
    import torch
    from sglang.srt.distributed import bootstrap

    if not (bootstrap._is_cpu_amx_available or bootstrap._is_cpu_arm64):
        return
    from sglang.srt.runtime_context import get_device, get_parallel
    from sglang.srt.utils import numa_utils

    p = get_parallel()
    cpuid = numa_utils.init_threads_binding(numa_index=get_device().gpu_id,
                                            world_size=p.dp_size * p.tp_size * p.pp_size)
    torch.ops.sgl_kernel.init_cpu_threads_env(cpuid)


def static_reason(scheduler: Any) -> str | None:
    """Why the forward thread cannot run on this server, or None. A function of the config only."""
    from sglang.srt.environ import envs
    from sglang.srt.runtime_context import get_parallel

    p = get_parallel()
    checks = [
        (os.environ.get(ENV, "0").strip() != "1", f"{ENV} is not 1 (opt-in)"),
        (str(scheduler.device) != "cpu", "not a CPU device (GPU streams already overlap)"),
        (not scheduler.enable_overlap, "overlap schedule disabled"),
        (p.pp_size != 1, "pp > 1"),
        # ranks would plan different batches (idle, grammar) and gather on the forward's group
        (getattr(scheduler.server_args, "enable_dp_attention", False), "DP attention"),
        # the prefill delayer's all-gather would run on the forward's device_group from this thread
        (p.tp_size > 1 and envs.SGLANG_NCCL_ALL_GATHER_IN_OVERLAP_SCHEDULER_SYNC_BATCH.get(),
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


def mode_name(batch: Any) -> str:
    return batch.forward_mode.name.lower()


def batch_reason(batch: Any, scheduler: Any = None, checkpoint_guarded: bool = False) -> str | None:
    """Why this batch runs inline (None: it goes to the worker). A function of the batch only.

    Penalties are not a reason (see the module doc: the forward reads only the accumulators that
    copy_for_forward materialised at launch). Custom logit processors are not one either: the worker
    hands them a launch-time view of their Req (`snapshot`). Nor is a grammar: its sampling is a
    second job (`samples_later`)."""
    mode = batch.forward_mode.name
    if mode not in WORKER_MODES:
        return f"{mode.lower()} batch"
    decode = mode == "DECODE"
    si = batch.sampling_info
    checks = [
        (not batch.spec_algorithm.is_none(), "speculative"),
        (decode and (batch.input_ids is not None or batch.prefill_input_ids_cpu is not None), "inputs staged"),
        # the worker's resolve_forward_inputs copies the prefill ids from the host staging
        (not decode and (batch.input_ids is not None or batch.prefill_input_ids_cpu is None),
         "prefill ids not staged on the host"),
        # the next planning checkpoints the chunked request (radix dedup may rewrite its req_to_token
        # row below seq_len); only a guarded checkpoint (around_checkpoint) waits for this forward
        (not decode and batch.chunked_req is not None and not checkpoint_guarded,
         "chunked prefill"),
        (not decode and _embeds(batch), "multimodal or embedding inputs"),
        (getattr(batch, "hicache_consumer_index", -1) >= 0, "hierarchical cache load"),
        (getattr(getattr(batch, "model_config", None), "is_encoder_decoder", False), "encoder-decoder"),
        (batch.beam_tail is not None
         or getattr(getattr(scheduler, "beam_coordinator", None), "_num_live_groups", 0), "beam search"),
        (si is None, "no sampling info"),
        (si is not None and si.has_custom_logit_processor
         and (si.custom_params is None or len(si.custom_params) != len(batch.reqs)), "custom logit processor"),
    ]
    return next((why for bad, why in checks if bad), None)


def samples_later(worker: Any, batch: Any) -> bool:
    """Whether TpModelWorker.forward_batch_generation will leave this batch's sampling for later
    (`delay_sample_func`): its condition for a non-speculative overlap launch, read at launch."""
    from sglang.srt.environ import envs

    # ForwardBatch.init_new sets sampling_info.grammars from has_grammar, which the worker then tests
    return bool(worker.enable_overlap and not worker.enable_spec
                and (batch.has_grammar or (envs.SGLANG_ENABLE_DELAY_SAMPLE.get() and not batch.is_prefill_only)))


def _embeds(batch: Any) -> bool:
    mm = batch.multimodal_inputs
    return (batch.input_embeds is not None or batch.replace_embeds is not None
            or (mm is not None and any(x is not None for x in mm)))


def snapshot(batch: Any) -> Any:
    """The batch as launched: a shallow copy whose lists are copied too (merge_batch extends
    `reqs` and the logprob lists in place; tensors are rebound out of place, see the module doc).

    Custom logit processors read their request through `custom_params[i]["__req__"]` when they
    sample; stock samples at launch, the worker later, after the scheduler thread has moved on. They
    get a view of the Req as it was at launch instead (`req_view`)."""
    snap = copy.copy(batch)
    for name, value in vars(snap).items():
        if type(value) is list:
            setattr(snap, name, list(value))
    si = getattr(snap, "sampling_info", None)
    if si is not None and si.has_custom_logit_processor and si.custom_params is not None:
        snap.sampling_info = si = copy.copy(si)  # the launch's forward-only copy; leave the shared list alone
        si.custom_params = [_frozen_params(p, r) for p, r in zip(si.custom_params, snap.reqs, strict=True)]
    return snap


def _frozen_params(params: Any, req: Any) -> Any:
    if not params or "__req__" not in params:
        return params
    return {**params, "__req__": req_view(req)}


def req_view(req: Any) -> Any:
    """A shallow copy of a Req with its per-step state copied: what a processor reads at launch.

    The scheduler thread appends to output_ids and advances kv (kv_committed_len, ...) in place
    after launch; scalar attributes are rebound, so the shallow copy already keeps their values."""
    view = copy.copy(req)
    for name in ("output_ids", "origin_input_ids"):
        if (v := getattr(req, name, None)) is not None:
            setattr(view, name, copy.copy(v))
    if getattr(req, "kv", None) is not None:
        view.kv = copy.copy(req.kv)
    return view


ATTR = "_branchwise_forward"  # on the TP worker, the FutureMap and (guarded) the tree cache


def build(scheduler: Any, config: Any) -> ForwardExecutor | None:
    """The scheduler's CPU forward thread (None unless --async-output is on and it qualifies here).

    Its hooks on the TP worker, `resolve_forward_inputs` (which receives the FutureMap) and the
    tree cache's checkpoint find it there, as `_branchwise_forward`."""
    if not config.async_output:
        return None
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
    ex = ForwardExecutor(scheduler, timeout_s=_timeout_s())
    setattr(scheduler.tp_worker, ATTR, ex)
    setattr(scheduler.future_map, ATTR, ex)
    if ex.checkpoint_guarded:
        setattr(scheduler.tree_cache, ATTR, ex)
    logger.info("Branchwise forward thread on (torch intra-op threads: %d, GIL switch interval %.2f ms)",
                _torch_threads(), 1e3 * sys.getswitchinterval())
    return ex


def _timeout_s() -> float:
    raw = os.environ.get(TIMEOUT_ENV, "").strip()
    if not raw:
        return DEFAULT_TIMEOUT_S
    t = float(raw)
    if not 0 < t < float("inf"):
        raise ValueError(f"{TIMEOUT_ENV} must be a positive number of seconds, got {raw!r}")
    return t


def _torch_threads() -> int:
    import torch

    return torch.get_num_threads()


# ---------------------------------------------------------------- hook bodies (targets in plugin.py)

def around_run_batch(orig: Any, self: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
    ex = self.branchwise.forward
    if ex is None:
        return orig(self, batch, *args, **kwargs)
    why = "switched off" if not ex.enabled else batch_reason(batch, self, ex.checkpoint_guarded)
    if why is not None:
        ex.drain()  # an inline forward must come after every queued one (one stream)
        ex.stats.inline += 1
        ex.stats.count(ex.stats.reasons, f"{mode_name(batch)}: {why}")
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
    ex = getattr(future_map, ATTR, None)
    if ex is not None and batch is ex.launching:
        return None  # deferred to the worker: it must follow the previous step's stash
    return orig(batch, future_map, *args, **kwargs)


def around_forward_batch_generation(orig: Any, self: Any, batch: Any = None, *args: Any, **kwargs: Any) -> Any:
    ex = getattr(self, ATTR, None)
    if ex is None or batch is None or batch is not ex.launching or args or kwargs:
        return orig(self, batch, *args, **kwargs)
    from sglang.srt.managers.utils import GenerationBatchResult

    placeholder = GenerationBatchResult()
    placeholder._branchwise_job = True  # _relay_forward_payload / _copy_result_to_cpu: the worker does them
    delayed = samples_later(self, batch)
    job = ForwardJob(snapshot(batch), placeholder, lambda b: orig(self, b), HostEvent(), len(batch.seq_lens),
                     forwarded=HostEvent() if delayed else None)
    # Stock resolve_forward_inputs consumes the prefill staging on the launched batch; the worker
    # consumes the snapshot's, so clear the live batch's as stock would have (it is merged into
    # running_batch next step, whose decode must gather from the FutureMap, not re-read prompts).
    batch.prefill_input_ids_cpu = None
    batch.mix_running_indices = None
    if delayed:  # run_batch then skips relay and copy; launch_batch_sample_if_needed calls this
        placeholder.delay_sample_func = functools.partial(_launch_sampling, ex, job)
        if batch.has_grammar:  # what ForwardBatch.init_new will set on the worker; the mask may be built first
            job.snapshot.sampling_info.grammars = [req.grammar for req in batch.reqs]
    else:
        ex.job = job
    _count_job(ex.stats, batch)
    ex.submit(job)  # the snapshot is complete: _forward_isolation already swapped in the forward-only sampling_info
    return placeholder


def _launch_sampling(ex: ForwardExecutor, job: ForwardJob) -> Any:
    """The placeholder's delay_sample_func (scheduler thread, after step n-1's result processing
    advanced the grammars): build the vocab mask here, as stock does in this call, and queue the
    sampling behind the forward on the worker. SGLang's launch_batch_sample_if_needed then calls
    _relay_forward_payload and _copy_result_to_cpu, which hand `copy_done` = `done` to result processing."""
    si = job.snapshot.sampling_info  # the launch's forward-only copy, which the worker samples with
    si.update_regex_vocab_mask()
    si._branchwise_mask_ready = True  # around_update_regex_vocab_mask: the worker's sample keeps this mask
    ex.job = job
    ex.submit(job, sample=True)
    return job.placeholder


def around_update_regex_vocab_mask(orig: Any, self: Any, *args: Any, **kwargs: Any) -> Any:
    """SamplingBatchInfo.update_regex_vocab_mask: keep a mask _launch_sampling built on the scheduler
    thread (the worker must not read the grammars, which the scheduler thread advances)."""
    if self.__dict__.pop("_branchwise_mask_ready", False):
        return None
    return orig(self, *args, **kwargs)


def _count_job(stats: ForwardStats, batch: Any) -> None:
    mode = mode_name(batch)
    stats.count(stats.modes, mode)
    si = batch.sampling_info  # the forward-only copy: penalties show as its materialised accumulators
    for on, feature in ((si.acc_additive_penalties is not None or si.acc_scaling_penalties is not None,
                         "penalties"),
                        (si.has_custom_logit_processor, "custom logit processor"),
                        (batch.return_logprob, "logprobs"),
                        (batch.has_grammar, "grammar"),
                        (batch.chunked_req is not None, "chunked prefill")):
        if on:
            stats.count(stats.features, f"{mode}: {feature}")


def around_relay_forward_payload(orig: Any, self: Any, batch: Any, future_indices: Any, result: Any,
                                 *args: Any, **kwargs: Any) -> Any:
    if getattr(result, "_branchwise_job", False):
        return None
    return orig(self, batch, future_indices, result, *args, **kwargs)


def around_copy_result_to_cpu(orig: Any, self: Any, result: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
    ex = self.branchwise.forward
    if ex is None or not getattr(result, "_branchwise_job", False):
        return orig(self, result, batch, *args, **kwargs)
    job, ex.job = ex.job, None
    if job is None or job.placeholder is not result:
        raise RuntimeError("Branchwise forward thread: result copy without its launched job")
    result.copy_done = job.done  # SGLang's result processing synchronises on it
    return None


def _guarded_checkpoint(scheduler: Any) -> bool:
    tc = getattr(scheduler, "tree_cache", None)
    if tc is None:
        return False
    from sglang.srt.mem_cache.radix_cache import RadixCache
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    # the classes whose checkpoint plugin.py wraps with around_checkpoint (UnifiedRadixCache is the default)
    return type(tc).checkpoint in (RadixCache.checkpoint, UnifiedRadixCache.checkpoint)


def around_checkpoint(orig: Any, self: Any, req: Any, *args: Any, **kwargs: Any) -> Any:
    """(Unified)RadixCache.checkpoint: after inserting a request's KV it rewrites the request's req_to_token
    row with the tree's indices (radix dedup: another request inserted the same tokens first). On a
    GPU that write waits for the in-flight forward's reads (SGLang's WAR barrier on the schedule
    stream); here it runs at once on the scheduler thread, so a queued or running forward that still
    reads the row (the next decode step of a just-prefilled row, or the chunk in flight) would see
    the other request's slots. The write is checked instead: if it changes the row while the worker
    is busy, drain first. Unchanged rows (the common case) cost a compare, no wait."""
    ex = getattr(self, ATTR, None)
    if ex is None or not ex.busy():
        return orig(self, req, *args, **kwargs)
    pool = self.req_to_token_pool
    pool.write = _CheckedWrite(ex, type(pool).write.__get__(pool))  # instance attribute for this call only
    try:
        return orig(self, req, *args, **kwargs)
    finally:
        del pool.write


class _CheckedWrite:
    __slots__ = ("ex", "write")

    def __init__(self, ex: ForwardExecutor, write: Any) -> None:
        self.ex, self.write = ex, write

    def __call__(self, indices: Any, values: Any) -> Any:
        import torch

        table = self.write.__self__.req_to_token
        cur = table[indices]
        new = values if isinstance(values, torch.Tensor) else torch.as_tensor(values)
        if cur.shape != new.shape or not torch.equal(cur, new.to(cur.dtype)):
            self.ex.stats.checkpoint_drains += 1
            self.ex.drain()
        return self.write(indices, values)

