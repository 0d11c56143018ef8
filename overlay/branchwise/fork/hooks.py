"""Server-side fork/join of parallel phases (Multiverse, SPRINT): the top of the fork package,
with the hook bodies and `build` (docs/design/server-fork.md).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from branchwise import request_meta
from branchwise.config import BranchwiseConfig
from branchwise.fork import aborts, lifecycle
from branchwise.fork.grammars import get_detector
from branchwise.fork.limits import grammar_for
from branchwise.fork.manager import ForkManager

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
    """The scheduler's fork manager (None where server-side branching cannot run), also hung on the
    tree cache, which the output streamer shares, for the stream_output hook."""
    why = _plain_mode(scheduler)
    if why is not None:
        logger.info("Branchwise server-side fork/join off: %s", why)
        return None
    mgr = ForkManager(scheduler, config)
    state = getattr(getattr(scheduler, "branchwise", None), "state", None)  # built before fork (runtime.py)
    mgr.metrics = getattr(state, "metrics", None)  # one set of Prometheus series per scheduler
    scheduler.tree_cache._branchwise_fork = mgr  # the output streamer's handle (it is a slots dataclass)
    return mgr


# Hook bodies (registered in plugin.py; after_create_generation_req is called by runtime.py). Scheduler
# hooks find the manager at `scheduler.branchwise.fork`.


def after_create_generation_req(req: Req, scheduler: Scheduler, recv_req: TokenizedGenerateReqInput,
                                *args: Any, **kwargs: Any) -> Req:
    """A new client request (runtime calls it after taper has set `req.bw_meta`): a grammar the
    server refuses ends it with HTTP 400; a grammar it serves starts tracking its text."""
    bw = scheduler.branchwise
    asked = request_meta.of(req).grammar
    if asked is not None and req.to_finish is None:
        why = bw.config.client_grammar_error(asked)
        if why is not None:  # --branch-grammar-clients deny: HTTP 400, as for any malformed stamp
            req.set_finish_with_abort(f"Branchwise: {why}")
            if bw.state is not None:
                bw.state.bump("bad_requests")
            return req
    mgr = bw.fork
    grammar = grammar_for(mgr.cfg.branch_grammar, req, recv_req, mgr.stats) if mgr is not None else None
    if grammar is not None:
        lifecycle.start_tracking(mgr, req, get_detector(grammar), grammar)
    return req


def after_ingest_requests(result: list, scheduler: Scheduler, *args: Any, **kwargs: Any) -> list:
    """The scheduling point: park and spawn the phases cut at a fork, join those whose branches closed."""
    mgr = scheduler.branchwise.fork
    if mgr is not None and mgr.reg.phases and mgr.pending():
        lifecycle.reconcile(mgr)
    return result


def after_abort_request(result: None, scheduler: Scheduler, recv_req: AbortReq,
                        *args: Any, **kwargs: Any) -> None:
    mgr = scheduler.branchwise.fork
    if mgr is not None and mgr.reg.phases:
        aborts.abort_parked(mgr, recv_req)
    return result


def around_send_abort_output(orig: Callable[..., None], scheduler: Scheduler, abort_req: AbortReq,
                             req: Req) -> None:
    """Requests SGLang ends outside the output stream (aborted while queued, retraction OOM)."""
    track = getattr(req, "bw_fork", None)
    mgr = scheduler.branchwise.fork
    if track is None or mgr is None:
        return orig(scheduler, abort_req, req)
    if req.finished_reason is None:
        from sglang.srt.managers.schedule_batch import FINISH_ABORT

        req.finished_reason = req.to_finish or FINISH_ABORT()
    lifecycle.end(mgr, track)
    if track.branch:
        return None  # internal rid: the tokenizer manager never heard of it
    return orig(scheduler, abort_req, req)


def around_stream_output(orig: Callable[..., None], streamer: SchedulerOutputStreamer, reqs: list[Req],
                         *args: Any, **kwargs: Any) -> None:
    """Branch rows never reach the detokenizer; a parent is held back while a fork may cut it.
    Until the manager tracks a first request no row can need filtering: no per-row scan."""
    mgr = getattr(getattr(streamer, "tree_cache", None), "_branchwise_fork", None)
    if mgr is not None and mgr.tracking and any(getattr(req, "bw_fork", None) is not None for req in reqs):
        reqs = [req for req in reqs if _streamable(req)]
    return orig(streamer, reqs, *args, **kwargs)


def _streamable(req: Req) -> bool:
    track = getattr(req, "bw_fork", None)
    if track is None:
        return True
    if track.branch:
        return False
    return req.finished() or not track.undecided()


def after_is_fully_idle(result: bool, scheduler: Scheduler, *args: Any, **kwargs: Any) -> bool:
    """Not idle while a request is parked or a fork/join is pending (the idle sleeper would not join);
    when SGLang itself is fully idle, the leak check runs (aborts.idle)."""
    mgr = scheduler.branchwise.fork
    if not result or mgr is None or not mgr.reg.phases:
        return result
    if args or any(kwargs.values()):  # health-check / ignore-waiting variants: no leak check
        return not mgr.busy()
    return aborts.idle(mgr)
