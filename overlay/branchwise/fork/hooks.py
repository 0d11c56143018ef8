"""Server-side fork/join of parallel phases (Multiverse, SPRINT): the hook bodies and `build`.

A grammar detector watches a tracked request's text; the phase it opens goes FORKING -> PARALLEL ->
REDUCE -> DONE (branchwise.phases). These bodies move SGLang requests and KV along it: detection
runs on each tracked Req instance right after SGLang appends a step's tokens (`hook_tracked_request`),
parking, spawning and joining run at the scheduling point (AFTER Scheduler.ingest_requests), and
abort, idle and streaming hooks keep parked parents and branches out of SGLang's way. The state
is in fork_state.py, the transitions in fork_lifecycle.py, aborts and the leak check in
fork_aborts.py, which requests branch in fork_limits.py. Every decision depends on token ids,
rids and event order only, so all TP ranks agree without a broadcast. The lifecycle, overlap
scheduling, budgets and what is not branched: docs/design/server-fork.md.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from branchwise.config import BranchwiseConfig
from branchwise.fork_limits import grammar_for
from branchwise.fork_state import ForkManager
from branchwise.grammars import get_detector

if TYPE_CHECKING:
    from sglang.srt.managers.io_struct import AbortReq, TokenizedGenerateReqInput
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.managers.scheduler_components.output_streamer import SchedulerOutputStreamer

logger = logging.getLogger("branchwise.fork")


def _plain_mode(sched: Scheduler) -> str | None:
    """Why server-side branching is off in this scheduler, or None when it is on."""
    from sglang.srt.disaggregation.utils import DisaggregationMode

    checks = (
        (sched.disaggregation_mode != DisaggregationMode.NULL, "disaggregation"),
        (getattr(sched.server_args, "pp_size", 1) > 1, "pipeline parallelism"),
        (not sched.spec_algorithm.is_none(), "speculative decoding"),
        (sched.require_mlp_sync, "DP attention"),
        (sched.dllm_config is not None, "dLLM"),
        (sched.enable_hisparse, "hisparse"),
        (not sched.is_generation, "not a generation model"),
        (sched.tokenizer is None, "no tokenizer (skip_tokenizer_init)"),
        (sched.tree_cache.supports_mamba(), "mamba cache"),
    )
    return next((why for bad, why in checks if bad), None)


def build(scheduler: Scheduler, config: BranchwiseConfig) -> ForkManager | None:
    """The scheduler's fork manager, or None where server-side branching cannot run. It counts freed
    orphans in taper's Prometheus series (under --enable-metrics). The scheduler's tree cache, which
    the output streamer shares, gets a reference to it for the stream_output hook."""
    why = _plain_mode(scheduler)
    if why is not None:
        logger.info("Branchwise server-side fork/join off: %s", why)
        return None
    mgr = ForkManager(scheduler, config)
    taper = getattr(getattr(scheduler, "branchwise", None), "taper", None)  # built before fork (runtime.py)
    mgr.metrics = getattr(taper, "metrics", None)  # one set of Prometheus series per scheduler
    scheduler.tree_cache._branchwise_fork = mgr  # the output streamer's handle (it is a slots dataclass)
    return mgr


# Hook bodies (registered in plugin.py; after_create_generation_req is called by runtime.py). Scheduler
# hooks find the manager at `self.branchwise.fork`.


def after_create_generation_req(req: Req, self: Scheduler, recv_req: TokenizedGenerateReqInput,
                                *args: Any, **kwargs: Any) -> Req:
    """A new client request (runtime calls it after taper has set `req.bw_meta`): a grammar the
    server refuses ends it with HTTP 400; a grammar it serves starts tracking its text."""
    bw = self.branchwise
    meta = getattr(req, "bw_meta", None)
    if meta is not None and meta.grammar is not None and req.to_finish is None:
        why = bw.config.client_grammar_error(meta.grammar)
        if why is not None:  # --branch-grammar-clients deny: HTTP 400, as for any malformed stamp
            req.set_finish_with_abort(f"Branchwise: {why}")
            if bw.taper is not None:
                bw.taper.bump("bad_requests")
            return req
    mgr = bw.fork
    grammar = grammar_for(mgr.cfg.branch_grammar, req, recv_req, mgr.stats) if mgr is not None else None
    if grammar is not None:
        mgr.track(req, get_detector(grammar), grammar)
    return req


def hook_tracked_request(req: Req) -> None:
    """Per-request hook on `Req.update_finish_state`, set on the instance of each tracked request.
    Not a HookRegistry target on purpose: a class-level AROUND runs for every row of every batch
    (~1 us per row per step on CPU), this runs only for tracked rows. It wraps the class's method
    as resolved then (class-level hooks of plugins are applied before any Req exists, so they stay
    inside)."""
    cls_fn = type(req).update_finish_state
    req.update_finish_state = functools.partial(around_update_finish_state, cls_fn, req)


def around_update_finish_state(orig: Callable[..., None], req: Req, *args: Any, **kwargs: Any) -> None:
    """Runs right after SGLang appended a step's tokens and checked stops, before KV release and
    streaming: a close tag finishes a branch like a stop string, a fork cuts the parent."""
    out = orig(req, *args, **kwargs)
    track = getattr(req, "bw_fork", None)
    if track is not None:
        track.mgr.on_tokens(track)
    return out


def after_ingest_requests(result: list, self: Scheduler, *args: Any, **kwargs: Any) -> list:
    """The scheduling point: park and spawn the phases cut at a fork, join those whose branches closed."""
    mgr = self.branchwise.fork
    if mgr is not None and mgr.reg.phases and mgr.pending():
        mgr.reconcile()
    return result


def after_abort_request(result: None, self: Scheduler, recv_req: AbortReq, *args: Any, **kwargs: Any) -> None:
    mgr = self.branchwise.fork
    if mgr is not None and mgr.reg.phases:
        mgr.abort(recv_req)
    return result


def around_send_abort_output(orig: Callable[..., None], self: Scheduler, abort_req: AbortReq,
                             req: Req) -> None:
    """Requests SGLang ends outside the output stream (aborted while queued, retraction OOM)."""
    track = getattr(req, "bw_fork", None)
    mgr = self.branchwise.fork
    if track is None or mgr is None:
        return orig(self, abort_req, req)
    if req.finished_reason is None:
        from sglang.srt.managers.schedule_batch import FINISH_ABORT

        req.finished_reason = req.to_finish or FINISH_ABORT()
    mgr.end(track)
    if track.branch:
        return None  # internal rid: the tokenizer manager never heard of it
    return orig(self, abort_req, req)


def around_stream_output(orig: Callable[..., None], self: SchedulerOutputStreamer, reqs: list[Req],
                         *args: Any, **kwargs: Any) -> None:
    """Branch rows never reach the detokenizer; a parent is held back while a fork may cut it.
    Until the manager tracks a first request no row can need filtering: no per-row scan."""
    mgr = getattr(getattr(self, "tree_cache", None), "_branchwise_fork", None)
    if mgr is not None and mgr.tracking and any(getattr(req, "bw_fork", None) is not None for req in reqs):
        reqs = [req for req in reqs if _streamable(req)]
    return orig(self, reqs, *args, **kwargs)


def _streamable(req: Req) -> bool:
    track = getattr(req, "bw_fork", None)
    if track is None:
        return True
    if track.branch:
        return False
    return req.finished() or not track.undecided()


def after_is_fully_idle(result: bool, self: Scheduler, *args: Any, **kwargs: Any) -> bool:
    """Not idle while a request is parked or a fork/join waits for the next scheduling point: the
    idle sleeper would otherwise wait for a new request before joining. When SGLang itself is fully
    idle (a plain call: nothing running, waiting or in flight), this is where the leak check runs
    (fork_aborts.idle): a parked request that nothing can resume is freed and counted."""
    mgr = self.branchwise.fork
    if not result or mgr is None or not mgr.reg.phases:
        return result
    if args or any(kwargs.values()):  # health-check / ignore-waiting variants: no leak check
        return not mgr.busy()
    return mgr.idle()
