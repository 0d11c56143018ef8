"""The park/spawn/join lifecycle of a server-side fork: what happens to SGLang requests and KV as a
phase goes FORKING -> PARALLEL -> REDUCE -> DONE (docs/design/server-fork.md).
"""

from __future__ import annotations

import functools
from array import array
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from branchwise import request_meta
from branchwise.fork.grammars import BranchClosed, Detector, GrammarError, PhaseClosed, PhaseOpened
from branchwise.fork.manager import ForkManager, Track
from branchwise.fork.phases import (
    ParallelPhase,
    PhaseError,
    Stage,
    TextStream,
    branch_budget,
    branch_seed,
    needs_close,
)
from branchwise.request_meta import RequestMeta
from branchwise.scheduler_hook import note_phase_requests

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import BaseFinishReason, Req
    from sglang.srt.managers.scheduler import Scheduler


def start_tracking(mgr: ForkManager, req: Req, det: Detector | None, grammar: str, branch: bool = False) -> Track:
    """Start tracking a sequence's text: its `Track` at `req.bw_fork` and the per-token hook."""
    tracked = Track(mgr=mgr, req=req, det=det, text=TextStream(mgr.decode), grammar=grammar, branch=branch)
    req.bw_fork = tracked
    hook_tracked_request(req)
    mgr.tracking = True
    return tracked


def hook_tracked_request(req: Req) -> None:
    """Per-request hook on `Req.update_finish_state`, set on each tracked instance; hot path: a
    class-level hook would run for every row of every batch."""
    cls_fn = type(req).update_finish_state
    req.update_finish_state = functools.partial(around_update_finish_state, cls_fn, req)


def around_update_finish_state(orig: Callable[..., None], req: Req, *args: Any, **kwargs: Any) -> None:
    """Runs right after SGLang appended a step's tokens and checked stops, before KV release and
    streaming: a close tag finishes a branch like a stop string, a fork cuts the parent."""
    out = orig(req, *args, **kwargs)
    tracked = getattr(req, "bw_fork", None)
    if tracked is not None:
        on_tokens(tracked.mgr, tracked)
    return out


# ---- per token (Req.update_finish_state) ----------------------------------------------------------
def on_tokens(mgr: ForkManager, track: Track) -> None:
    req, phase = track.req, track.phase
    if phase is not None and phase.waiting:
        if req.finished():  # ended while it waits at the fork: the phase goes with it
            end(mgr, track)
        else:  # a stale in-flight token past the fork point: drop it
            del req.output_ids[phase.keep :]
        return
    aborted = req.finished() and is_abort(req.finished_reason)
    if track.det is not None and not aborted:
        ids = req.output_ids_through_stop
        try:
            events = track.det.feed(track.text.feed(ids)) if len(ids) > track.text.fed else []
        except GrammarError as err:
            track.fail(f"grammar: {err}")
            events = []
        for event in events:
            if isinstance(event, PhaseOpened):
                _on_fork(mgr, track, event)
            elif (isinstance(event, BranchClosed) and track.branch and track.det is not None
                  and track.det.done):
                _on_close_tag(track, event)  # its own close tag (inner ones leave it running)
            elif (isinstance(event, PhaseClosed) and (phase := track.phase) is not None
                  and phase.state is Stage.REDUCE):
                release(mgr, phase.phase_id)
    if req.finished():
        end(mgr, track)


def _on_fork(mgr: ForkManager, track: Track, event: PhaseOpened) -> None:
    req, det = track.req, track.det
    assert det is not None
    if req.finished() or req.to_finish is not None:
        track.fail("stream ended at a fork")
        return
    keep, leftover = track.text.split(event.at, det.text)
    headers = [mgr.encode(leftover + header) for header in event.headers]
    grants = [branch_budget(req.sampling_params.max_new_tokens, keep, len(ids)) for ids in headers]
    if min(grants) < 1:
        track.fail(f"fork at token {keep}: no max_new_tokens budget left for branches")
        return
    if (why := mgr.limits.refusal(mgr.reg, track.rid, grants)) is not None:
        mgr.stats["over_limit_forks"] += 1
        track.fail(why)
        return
    if keep < req.send_token_offset:  # cannot happen while `undecided` holds streaming back
        track.fail("fork point already streamed")
        return
    try:
        mgr.reg.open(track.rid, event.headers, event.labels, prefix_text=det.text,
                     prefix_len=len(req.origin_input_ids) + keep, header=event.header, fmt=det.fmt, keep=keep,
                     leftover=leftover, header_ids=headers, grants=grants, owner=track)
    except PhaseError as err:
        track.fail(str(err))
        return
    del req.output_ids[keep:]
    track.text.truncate(keep, event.at)


def _on_close_tag(track: Track, event: BranchClosed) -> None:
    req = track.req
    assert track.det is not None
    keep, leftover = track.text.split(event.at, track.det.text)
    track.close_at, track.close_keep, track.close_leftover = event.at, keep, leftover
    if not is_abort(req.finished_reason):  # SGLang then caches and frees it like a stop string
        from sglang.srt.managers.schedule_batch import FINISH_MATCHED_STR

        req.finished_reason = FINISH_MATCHED_STR(matched=track.det.fmt.close.strip())
        req.finished_len = keep


# ---- end of a sequence ------------------------------------------------------------------------------
def end(mgr: ForkManager, track: Track) -> None:
    """The sequence ended (any reason; its finished_reason is set). It consumes what the sequence
    still holds: its open phases and their pins, its open place in its phase, its detector, its
    unreported error; so a second call finds nothing left to do."""
    req = track.req
    drop(mgr, track.rid)  # its own phases (nested ones too) die with it
    if track.branch:
        _close_branch(mgr, track)
        track.det = None
        return
    if track.det is not None and natural_end(req.finished_reason):  # cut text is incomplete anyway
        try:
            track.det.finish()
        except GrammarError as err:
            track.fail(f"grammar: {err}")
    track.det = None
    if track.error is not None:
        mgr.stats["grammar_errors"] += 1
        if not is_abort(req.finished_reason):
            req.finished_reason = annotate(req.finished_reason, track.error)
        track.error = None


def _close_branch(mgr: ForkManager, branch_track: Track) -> None:
    """Record an ended branch's output in its phase; the join waits for the scheduling point."""
    hit = mgr.reg.of_branch(branch_track.rid)
    if hit is None or hit[0].state is not Stage.PARALLEL or hit[1].finished:
        return  # its phase was dropped (parent aborted or finished), or it closed before
    phase, branch = hit
    ids, text, reason = _branch_output(mgr, branch_track)
    phase.close_branch(branch.index, text, ids, reason)
    mgr.stats[f"branch_close_{reason}"] += 1
    rec = mgr.record(phase)
    rec["cached_tokens"][branch.index] = branch_track.req.cached_tokens
    rec["reasons"][branch.index] = reason
    parent = phase.owner
    if branch_track.error is not None and parent.error is None:
        parent.error = f"branch {branch_track.rid}: {branch_track.error}"


def _branch_output(mgr: ForkManager, branch_track: Track) -> tuple[list[int], str, str]:
    req = branch_track.req
    if branch_track.close_at is not None:
        ids = list(req.output_ids[: branch_track.close_keep]) + mgr.encode(branch_track.close_leftover)
        return ids, mgr.decode(req.output_ids[: branch_track.close_keep]) + branch_track.close_leftover, "tag"
    from sglang.srt.managers.schedule_batch import FINISH_LENGTH, FINISH_MATCHED_TOKEN

    ids = list(req.output_ids_through_stop)
    finish = req.finished_reason
    if isinstance(finish, FINISH_MATCHED_TOKEN) and ids:
        ids.pop()  # EOS / stop token: not part of the branch's text
        reason = "eos"
    else:
        reason = "length" if isinstance(finish, FINISH_LENGTH) else "abort" if is_abort(finish) else "stop"
    return ids, mgr.decode(ids), reason


def drop(mgr: ForkManager, rid: str) -> None:
    """Release the phases `rid` opened (and those nested in them), with what holds their prefixes."""
    for phase in mgr.reg.drop_request(rid):
        _unpin(mgr, phase)


def release(mgr: ForkManager, phase_id: str) -> None:
    for phase in mgr.reg.release(phase_id):
        _unpin(mgr, phase)


def _unpin(mgr: ForkManager, phase: ParallelPhase) -> None:
    if phase.pin is not None:
        mgr.sched.tree_cache.unlock(phase.pin)
        phase.pin = None


def finish_outside_batch(mgr: ForkManager, track: Track) -> None:
    """A parked request ends without running again (abort, orphan, or budget spent at its join)."""
    end(mgr, track)
    if not track.branch:
        track.req.time_stats.set_completion_time()
        mgr.sched.output_streamer.stream_output([track.req], False)


# ---- scheduling point (after Scheduler.ingest_requests) ---------------------------------------------
def reconcile(mgr: ForkManager) -> None:
    """Park and spawn every phase cut at a fork, join every phase whose branches all closed."""
    for phase in [phase for phase in mgr.reg.phases.values() if phase.pending]:
        track = phase.owner
        if phase.state is Stage.FORKING:
            if track.req.finished():  # cannot wait at a fork: the phase goes with it
                end(mgr, track)
                continue
            _park(mgr, track, phase)
            if track.req.to_finish is not None:  # aborted between the fork and now: end it parked
                track.req.finished_reason, track.req.to_finish = track.req.to_finish, None
                finish_outside_batch(mgr, track)
            else:
                _spawn(mgr, track, phase)
        elif phase.pending:  # still PARALLEL with every branch closed (not dropped by an earlier one)
            _join(mgr, phase)


def _park(mgr: ForkManager, track: Track, phase: ParallelPhase) -> None:
    """FORKING -> PARALLEL: the parent's prefix KV goes into the radix tree (pinned there), and
    the Req leaves every batch and holds no KV row, like a retracted request."""
    from sglang.srt.mem_cache.common import release_kv_cache

    sched, req = mgr.sched, track.req
    _evict(sched, req)
    tree = sched.tree_cache
    if req.kv.holds_kv:
        phase.shared = min(req.kv.kv_committed_len, len(req.origin_input_ids) + phase.keep)
        req.full_untruncated_fill_ids = array("q")  # output_ids shrank: rebuild, not extend
        release_kv_cache(req, tree, checkpoint=True)
        if tree.supports_prefix_sharing() and req.last_node is not None:
            phase.pin = tree.lock(req.last_node)  # keep the prefix until the branches match it
    n_retract = req.retraction_count
    req.reset_for_retract()
    req.retraction_count = n_retract  # a park is not a retraction
    phase.park()


def _spawn(mgr: ForkManager, track: Track, phase: ParallelPhase) -> None:
    """One Req per branch (input: the shared prefix and its own header) into the waiting queue."""
    sched, req = mgr.sched, track.req
    prefix = array("q", req.origin_input_ids) + array("q", req.output_ids[: phase.keep])
    parent_meta = request_meta.of(req)
    note_phase_requests(sched)  # before they can reach a batch: TAPER must see their phase
    for branch in phase.branches:
        i = branch.index
        branch_req = _make_branch(req, branch.rid, phase.branch_input(i, prefix),
                                  phase.keep + len(phase.header_ids[i]))
        branch_req.bw_meta = RequestMeta(phase=phase.phase_id, branch=i, fanout=phase.fanout,
                                         slo_tpot_ms=parent_meta.slo_tpot_ms, weight=parent_meta.weight,
                                         grammar=track.grammar)
        branch_det = track.det.branch(i, branch.label, phase.depth) if track.det is not None else None
        start_tracking(mgr, branch_req, branch_det, track.grammar, branch=True)
        sched.init_req_max_new_tokens(branch_req)
        sched._add_request_to_queue(branch_req)
    mgr.record(phase)
    mgr.stats["forks"] += 1
    mgr.stats["branches"] += phase.fanout


def _make_branch(parent: Req, rid: str, input_ids: array, used: int) -> Req:
    import msgspec
    from sglang.srt.managers.schedule_batch import Req

    params = parent.sampling_params
    custom = params.custom_params
    if isinstance(custom, dict):  # Req() adds the branch's own "__req__"
        custom = {key: value for key, value in custom.items() if key != "__req__"}
    seed = branch_seed(params.sampling_seed, rid) if params.sampling_seed is not None else None
    branch_params = msgspec.structs.replace(params, max_new_tokens=params.max_new_tokens - used,
                                            sampling_seed=seed, custom_params=custom)
    branch_req = Req(rid, "", input_ids, branch_params, stream=False,
                     custom_logit_processor=parent.custom_logit_processor, eos_token_ids=parent.eos_token_ids,
                     vocab_size=parent.vocab_size, priority=parent.priority,
                     metrics_collector=parent.metrics_collector, extra_key=parent.extra_key,
                     cache_salt=parent.cache_salt, routing_key=parent.routing_key,
                     http_worker_ipc=parent.http_worker_ipc)
    branch_req.tokenizer = parent.tokenizer
    return branch_req


def _join(mgr: ForkManager, phase: ParallelPhase) -> None:
    """PARALLEL -> REDUCE: the branches' ids in branch order go onto the parent's output, the prefix
    is unpinned, and the parent is re-queued as a retracted request (or ends, its budget spent)."""
    track = phase.owner
    req, fmt = track.req, phase.fmt
    ids = mgr.encode(phase.leftover)
    for branch in phase.branches:
        ids += mgr.encode(branch.header) + branch.output_ids
        if needs_close(branch.output_text, fmt.close):
            ids += mgr.encode(fmt.close)
        ids += mgr.encode(fmt.sep)
    ids += mgr.encode(fmt.suffix)
    reduced = phase.join()
    _unpin(mgr, phase)
    if track.det is not None:
        try:
            for event in track.det.join(reduced):
                if isinstance(event, PhaseClosed):
                    release(mgr, phase.phase_id)
        except GrammarError as err:
            track.fail(f"grammar: {err}")
    if track.det is None and phase.phase_id in mgr.reg.phases:
        release(mgr, phase.phase_id)  # no detector left to see the phase end
    req.output_ids.extend(ids)
    track.text.skip(len(ids), track.det.pos if track.det is not None else track.text.pos)
    mgr.record(phase)["joined_tokens"] = len(ids)
    mgr.stats["joins"] += 1
    max_new = req.sampling_params.max_new_tokens
    if len(req.output_ids) >= max_new:  # the response's budget is spent by the branches
        from sglang.srt.managers.schedule_batch import FINISH_LENGTH

        req.finished_reason, req.finished_len = FINISH_LENGTH(length=max_new), max_new
        finish_outside_batch(mgr, track)
    else:
        mgr.sched._add_request_to_queue(req, is_retracted=True)


# ---- SGLang glue ----------------------------------------------------------------------------------
def is_abort(reason: BaseFinishReason | None) -> bool:
    return reason is not None and reason.to_json().get("type") == "abort"


def natural_end(reason: BaseFinishReason | None) -> bool:
    """EOS or a stop: the text claims to be complete (not cut by length or abort)."""
    return reason is not None and reason.to_json().get("type") == "stop"


def annotate(reason: BaseFinishReason, msg: str) -> BaseFinishReason:
    """The request's own finish reason plus `branchwise_error`: HTTP 200, text kept, cause stated."""
    from sglang.srt.managers.schedule_batch import BaseFinishReason

    class BranchwiseFinish(BaseFinishReason):
        def to_json(self) -> dict[str, Any]:
            return {**reason.to_json(), "branchwise_error": msg}

    return BranchwiseFinish()


def _evict(sched: Scheduler, req: Req) -> None:
    """Take a parked request out of the batches that still list it (filter_batch frees nothing)."""
    seen: set[int] = set()
    for batch in (sched.running_batch, sched.last_batch):
        if batch is None or id(batch) in seen or req not in batch.reqs:
            continue
        seen.add(id(batch))
        batch.filter_batch(keep_indices=[i for i, other in enumerate(batch.reqs) if other is not req])
        batch.batch_is_full = False
