"""The park/spawn/join lifecycle of a server-side fork: what happens to SGLang requests and KV as a
phase goes FORKING -> PARALLEL -> REDUCE -> DONE (the overview is fork.py's docstring).

Per token (`on_tokens`, from Req.update_finish_state): a fork cuts the parent (FORKING), a close tag
finishes a branch. When a sequence ends (`end`, whatever ended it) it leaves its phase: a branch's
output is recorded in its phase at once, a sequence's own phases are released with their pins. At
the scheduling point (`reconcile`, after Scheduler.ingest_requests) every phase whose state asks for
it is parked and spawned, or joined. Nothing is queued between these steps: the work of a
scheduling point is read off the phases, so an abort that ends a sequence anywhere in between
simply leaves nothing to do.
"""

from __future__ import annotations

from array import array
from typing import TYPE_CHECKING, Any

from branchwise.grammars import BranchClosed, GrammarError, PhaseClosed, PhaseOpened
from branchwise.phases import ParallelPhase, PhaseError, Stage, branch_budget, branch_seed, needs_close
from branchwise.request_meta import RequestMeta

if TYPE_CHECKING:
    from branchwise.fork_state import ForkManager, Track


# ---- per token (Req.update_finish_state) ----------------------------------------------------------
def on_tokens(mgr: ForkManager, t: Track) -> None:
    req, ph = t.req, t.phase
    if ph is not None and ph.waiting:
        if req.finished():  # ended while it waits at the fork: the phase goes with it
            end(mgr, t)
        else:  # a stale in-flight token past the fork point: drop it
            del req.output_ids[ph.keep :]
        return
    aborted = req.finished() and is_abort(req.finished_reason)
    if t.det is not None and not aborted:
        ids = req.output_ids_through_stop
        try:
            events = t.det.feed(t.text.feed(ids)) if len(ids) > t.text.fed else []
        except GrammarError as e:
            t.fail(f"grammar: {e}")
            events = []
        for ev in events:
            if isinstance(ev, PhaseOpened):
                _on_fork(mgr, t, ev)
            elif isinstance(ev, BranchClosed) and t.branch and t.det is not None and t.det.done:
                _on_close_tag(t, ev)  # its own close tag (inner ones leave it running)
            elif isinstance(ev, PhaseClosed) and (ph := t.phase) is not None and ph.state is Stage.REDUCE:
                release(mgr, ph.phase_id)
    if req.finished():
        end(mgr, t)


def _on_fork(mgr: ForkManager, t: Track, ev: PhaseOpened) -> None:
    req, det = t.req, t.det
    assert det is not None
    if req.finished() or req.to_finish is not None:
        t.fail("stream ended at a fork")
        return
    keep, leftover = t.text.split(ev.at, det.text)
    headers = [mgr.encode(leftover + h) for h in ev.headers]
    grants = [branch_budget(req.sampling_params.max_new_tokens, keep, len(h)) for h in headers]
    if min(grants) < 1:
        t.fail(f"fork at token {keep}: no max_new_tokens budget left for branches")
        return
    if (why := mgr.limits.refusal(mgr.reg, t.rid, grants)) is not None:
        mgr.stats["over_limit_forks"] += 1
        t.fail(why)
        return
    if keep < req.send_token_offset:  # cannot happen while `undecided` holds streaming back
        t.fail("fork point already streamed")
        return
    try:
        mgr.reg.open(t.rid, ev.headers, ev.labels, prefix_text=det.text,
                     prefix_len=len(req.origin_input_ids) + keep, header=ev.header, fmt=det.fmt, keep=keep,
                     leftover=leftover, header_ids=headers, grants=grants, owner=t)
    except PhaseError as e:
        t.fail(str(e))
        return
    del req.output_ids[keep:]
    t.text.truncate(keep, ev.at)


def _on_close_tag(t: Track, ev: BranchClosed) -> None:
    req = t.req
    assert t.det is not None
    keep, leftover = t.text.split(ev.at, t.det.text)
    t.close_at, t.close_keep, t.close_leftover = ev.at, keep, leftover
    if not is_abort(req.finished_reason):  # SGLang then caches and frees it like a stop string
        from sglang.srt.managers.schedule_batch import FINISH_MATCHED_STR

        req.finished_reason = FINISH_MATCHED_STR(matched=t.det.fmt.close.strip())
        req.finished_len = keep


# ---- end of a sequence ------------------------------------------------------------------------------
def end(mgr: ForkManager, t: Track) -> None:
    """The sequence ended (any reason; its finished_reason is set). It consumes what the sequence
    still holds: its open phases and their pins, its open place in its phase, its detector, its
    unreported error; so a second call finds nothing left to do."""
    req = t.req
    drop(mgr, t.rid)  # its own phases (nested ones too) die with it
    if t.branch:
        _close_branch(mgr, t)
        t.det = None
        return
    if t.det is not None and natural_end(req.finished_reason):  # cut text is incomplete anyway
        try:
            t.det.finish()
        except GrammarError as e:
            t.fail(f"grammar: {e}")
    t.det = None
    if t.error is not None:
        mgr.stats["grammar_errors"] += 1
        if not is_abort(req.finished_reason):
            req.finished_reason = annotate(req.finished_reason, t.error)
        t.error = None


def _close_branch(mgr: ForkManager, bt: Track) -> None:
    """Record an ended branch's output in its phase; the join waits for the scheduling point."""
    hit = mgr.reg.of_branch(bt.rid)
    if hit is None or hit[0].state is not Stage.PARALLEL or hit[1].finished:
        return  # its phase was dropped (parent aborted or finished), or it closed before
    ph, b = hit
    ids, text, reason = _branch_output(mgr, bt)
    ph.close_branch(b.index, text, ids, reason)
    mgr.stats[f"branch_close_{reason}"] += 1
    rec = mgr.record(ph)
    rec["cached_tokens"][b.index] = bt.req.cached_tokens
    rec["reasons"][b.index] = reason
    parent = ph.owner
    if bt.error is not None and parent.error is None:
        parent.error = f"branch {bt.rid}: {bt.error}"


def _branch_output(mgr: ForkManager, bt: Track) -> tuple[list[int], str, str]:
    req = bt.req
    if bt.close_at is not None:
        ids = list(req.output_ids[: bt.close_keep]) + mgr.encode(bt.close_leftover)
        return ids, mgr.decode(req.output_ids[: bt.close_keep]) + bt.close_leftover, "tag"
    from sglang.srt.managers.schedule_batch import FINISH_LENGTH, FINISH_MATCHED_TOKEN

    ids = list(req.output_ids_through_stop)
    fr = req.finished_reason
    if isinstance(fr, FINISH_MATCHED_TOKEN) and ids:
        ids.pop()  # EOS / stop token: not part of the branch's text
        reason = "eos"
    else:
        reason = "length" if isinstance(fr, FINISH_LENGTH) else "abort" if is_abort(fr) else "stop"
    return ids, mgr.decode(ids), reason


def drop(mgr: ForkManager, rid: str) -> None:
    """Release the phases `rid` opened (and those nested in them), with what holds their prefixes."""
    for ph in mgr.reg.drop_request(rid):
        _unpin(mgr, ph)


def release(mgr: ForkManager, phase_id: str) -> None:
    for ph in mgr.reg.release(phase_id):
        _unpin(mgr, ph)


def _unpin(mgr: ForkManager, ph: ParallelPhase) -> None:
    if ph.pin is not None:
        mgr.sched.tree_cache.unlock(ph.pin)
        ph.pin = None


def finish_outside_batch(mgr: ForkManager, t: Track) -> None:
    """A parked request ends without running again (abort, orphan, or budget spent at its join)."""
    end(mgr, t)
    if not t.branch:
        t.req.time_stats.set_completion_time()
        mgr.sched.output_streamer.stream_output([t.req], False)


# ---- scheduling point (after Scheduler.ingest_requests) ---------------------------------------------
def reconcile(mgr: ForkManager) -> None:
    """Park and spawn every phase cut at a fork, join every phase whose branches all closed."""
    for ph in [p for p in mgr.reg.phases.values() if p.pending]:
        t = ph.owner
        if ph.state is Stage.FORKING:
            if t.req.finished():  # cannot wait at a fork: the phase goes with it
                end(mgr, t)
                continue
            _park(mgr, t, ph)
            if t.req.to_finish is not None:  # aborted between the fork and now: end it parked
                t.req.finished_reason, t.req.to_finish = t.req.to_finish, None
                finish_outside_batch(mgr, t)
            else:
                _spawn(mgr, t, ph)
        elif ph.pending:  # still PARALLEL with every branch closed (not dropped by an earlier one)
            _join(mgr, ph)


def _park(mgr: ForkManager, t: Track, ph: ParallelPhase) -> None:
    """FORKING -> PARALLEL: the parent's prefix KV goes into the radix tree (pinned there), and
    the Req leaves every batch and holds no KV row, like a retracted request."""
    from sglang.srt.mem_cache.common import release_kv_cache

    sched, req = mgr.sched, t.req
    _evict(sched, req)
    tree = sched.tree_cache
    if req.kv.holds_kv:
        ph.shared = min(req.kv.kv_committed_len, len(req.origin_input_ids) + ph.keep)
        req.full_untruncated_fill_ids = array("q")  # output_ids shrank: rebuild, not extend
        release_kv_cache(req, tree, checkpoint=True)
        if tree.supports_prefix_sharing() and req.last_node is not None:
            ph.pin = tree.lock(req.last_node)  # keep the prefix until the branches match it
    n_retract = req.retraction_count
    req.reset_for_retract()
    req.retraction_count = n_retract  # a park is not a retraction
    ph.park()


def _spawn(mgr: ForkManager, t: Track, ph: ParallelPhase) -> None:
    """One Req per branch (input: the shared prefix and its own header) into the waiting queue."""
    from branchwise.scheduler_hook import note_phase_requests

    sched, req = mgr.sched, t.req
    prefix = array("q", req.origin_input_ids) + array("q", req.output_ids[: ph.keep])
    parent_meta: RequestMeta = getattr(req, "bw_meta", None) or RequestMeta()
    note_phase_requests(sched)  # before they can reach a batch: TAPER must see their phase
    for b in ph.branches:
        i = b.index
        br = _make_branch(req, b.rid, ph.branch_input(i, prefix), ph.keep + len(ph.header_ids[i]))
        br.bw_meta = RequestMeta(phase=ph.phase_id, branch=i, fanout=ph.fanout,
                                 slo_tpot_ms=parent_meta.slo_tpot_ms, weight=parent_meta.weight,
                                 grammar=t.grammar)
        bdet = t.det.branch(i, b.label, ph.depth) if t.det is not None else None
        mgr.track(br, bdet, t.grammar, branch=True)
        sched.init_req_max_new_tokens(br)
        sched._add_request_to_queue(br)
    mgr.record(ph)
    mgr.stats["forks"] += 1
    mgr.stats["branches"] += ph.fanout


def _make_branch(parent: Any, rid: str, input_ids: array, used: int) -> Any:
    import msgspec
    from sglang.srt.managers.schedule_batch import Req

    sp = parent.sampling_params
    cp = sp.custom_params
    if isinstance(cp, dict):
        cp = {k: v for k, v in cp.items() if k != "__req__"}  # Req() adds the branch's own
    seed = branch_seed(sp.sampling_seed, rid) if sp.sampling_seed is not None else None
    bsp = msgspec.structs.replace(sp, max_new_tokens=sp.max_new_tokens - used, sampling_seed=seed,
                                  custom_params=cp)
    br = Req(rid, "", input_ids, bsp, stream=False, custom_logit_processor=parent.custom_logit_processor,
             eos_token_ids=parent.eos_token_ids, vocab_size=parent.vocab_size, priority=parent.priority,
             metrics_collector=parent.metrics_collector, extra_key=parent.extra_key,
             cache_salt=parent.cache_salt, routing_key=parent.routing_key, http_worker_ipc=parent.http_worker_ipc)
    br.tokenizer = parent.tokenizer
    return br


def _join(mgr: ForkManager, ph: ParallelPhase) -> None:
    """PARALLEL -> REDUCE: the branches' ids in branch order go onto the parent's output, the prefix
    is unpinned, and the parent is re-queued as a retracted request (or ends, its budget spent)."""
    t = ph.owner
    req, fmt = t.req, ph.fmt
    ids = mgr.encode(ph.leftover)
    for b in ph.branches:
        ids += mgr.encode(b.header) + b.output_ids
        if needs_close(b.output_text, fmt.close):
            ids += mgr.encode(fmt.close)
        ids += mgr.encode(fmt.sep)
    ids += mgr.encode(fmt.suffix)
    red = ph.join()
    _unpin(mgr, ph)
    if t.det is not None:
        try:
            for ev in t.det.join(red):
                if isinstance(ev, PhaseClosed):
                    release(mgr, ph.phase_id)
        except GrammarError as e:
            t.fail(f"grammar: {e}")
    if t.det is None and ph.phase_id in mgr.reg.phases:
        release(mgr, ph.phase_id)  # no detector left to see the phase end
    req.output_ids.extend(ids)
    t.text.skip(len(ids), t.det.pos if t.det is not None else t.text.pos)
    mgr.record(ph)["joined_tokens"] = len(ids)
    mgr.stats["joins"] += 1
    max_new = req.sampling_params.max_new_tokens
    if len(req.output_ids) >= max_new:  # the response's budget is spent by the branches
        from sglang.srt.managers.schedule_batch import FINISH_LENGTH

        req.finished_reason, req.finished_len = FINISH_LENGTH(length=max_new), max_new
        finish_outside_batch(mgr, t)
    else:
        mgr.sched._add_request_to_queue(req, is_retracted=True)


# ---- SGLang glue ----------------------------------------------------------------------------------
def is_abort(fr: Any) -> bool:
    return fr is not None and fr.to_json().get("type") == "abort"


def natural_end(fr: Any) -> bool:
    """EOS or a stop: the text claims to be complete (not cut by length or abort)."""
    return fr is not None and fr.to_json().get("type") == "stop"


def annotate(fr: Any, msg: str) -> Any:
    """The request's own finish reason plus `branchwise_error`: HTTP 200, text kept, cause stated."""
    from sglang.srt.managers.schedule_batch import BaseFinishReason

    class BranchwiseFinish(BaseFinishReason):
        def to_json(self) -> dict[str, Any]:
            return {**fr.to_json(), "branchwise_error": msg}

    return BranchwiseFinish()


def _evict(sched: Any, req: Any) -> None:
    """Take a parked request out of the batches that still list it (filter_batch frees nothing).

    running_batch may be the in-flight batch (overlap): SGLang filters it in place every step too;
    the result queue holds a shallow copy. last_batch may be an extend batch not merged yet."""
    seen: set[int] = set()
    for b in (sched.running_batch, sched.last_batch):
        if b is None or id(b) in seen or req not in b.reqs:
            continue
        seen.add(id(b))
        b.filter_batch(keep_indices=[i for i, r in enumerate(b.reqs) if r is not req])
        b.batch_is_full = False
