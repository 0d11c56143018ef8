"""Server-side fork/join of parallel phases (Multiverse, SPRINT): the SGLang glue.

A grammar detector (branchwise.grammars) watches a request's generated text through a TextStream;
the phase it opens lives in a PhaseRegistry and goes through one lifecycle (branchwise.phases:
FORKING -> PARALLEL -> REDUCE -> DONE). This module moves SGLang requests and KV along it:

  fork   (-> FORKING) the parent's output is cut at the fork point (`PhaseOpened.at`) before
         anything past it is streamed.
  park   (-> PARALLEL, at the next scheduling point) the parent is parked like a retraction: its KV
         goes into the radix tree with `release_kv_cache(checkpoint=True)`, a tree lock pins that
         prefix, and the Req leaves running_batch/last_batch and holds no KV row. One real Req per
         branch (rid f"{parent}/p{n}/b{i}", input = parent ids up to the fork + header_i) goes to the
         waiting queue; its prefill matches the pinned prefix, so only the header is computed
         (`cached_tokens` >= the shared prefix). Branches decode as ordinary running rows tagged with
         `bw_meta = RequestMeta(phase, branch, fanout, slo, weight)` for the TAPER planner.
  close  a branch ends at its own close tag (finished like a stop string, so SGLang releases and
         caches its KV itself), or by EOS / max_new_tokens / abort (the reduce appends the close tag).
  join   (-> REDUCE) when all branches of a phase are closed, their ids are appended to the parent's
         output in canonical (branch-index) order and the parent is re-queued as a retracted request
         (`_add_request_to_queue(is_retracted=True)`): its prefill matches prefix + branch 0 in the
         radix tree and computes the rest, then it continues decoding. The phase is released (DONE)
         when the parent's grammar closes it, or with its request.
  nest   a branch whose own text opens a phase is parked and joined exactly like a root parent.

Where: detection runs per sequence right after SGLang appends a step's tokens (a hook on
Req.update_finish_state, before KV release and streaming, installed on the tracked Req instances
only, so the rows of every other request pay nothing per step); parking, spawning and joining
run at the top of the next loop iteration (AFTER Scheduler.ingest_requests), the scheduling point
where SGLang itself changes queues, so get_next_batch_to_run always sees a consistent state.
A grammar error stops branching for that sequence (it continues serial, already joined text kept);
the request's finish_reason then carries `branchwise_error` with the detector's message (HTTP 200).
Limits (one request must not take the server): a fork of more than --branch-max-fanout branches, or
one whose branches would together be granted more than --branch-max-branch-tokens decode tokens
(counting the request's live branches of all its phases, nested ones included), is not taken: the
request continues serially and its finish_reason says why in `branchwise_error`. Under
--branch-grammar-clients deny a request naming a grammar other than "none" or the server's own
--branch-grammar is rejected with HTTP 400.

Overlap scheduling: the fork is seen while processing step k-1, when the parent may already sit in
the in-flight batch k. Nothing is done to batch k: parking sets `is_retracted`, so SGLang drops that
row's result as it does for rows retracted or preempted while in flight; FutureMap slots are keyed
by req_pool_idx and a reused slot is rewritten by its new owner's prefill before being read. Tokens
past the fork point are cut before `stream_output` runs and parents are not streamed while a fork is
undecided, so the client never sees them. The in-flight step also wrote the KV of the fork token, so
the branches' prefill hits the whole prefix; without overlap that token's KV does not exist yet and
the hit is one token shorter.

Budget (max_new_tokens): the parent's max_new_tokens bounds the whole response, joined branch text
included. Each branch may use the budget left at the fork (parent max - kept tokens - header); a
join that reaches the parent's budget finishes the request with finish_reason length, truncated at
max_new_tokens tokens, i.e. exactly where a serial writer of the same text would have been cut.

Tensor parallelism: every rank runs these hooks on identical token ids with the same tokenizer, and
every decision (fork, cut, budget, join, abort by rid prefix) depends only on token ids, request
ids and the order of events within a step, never on wall clocks, so all ranks spawn, park and join
the same requests in the same iteration.

Not branched (the request runs serial): return_logprob, hidden states, constrained decoding
(json/regex/ebnf), input embeds, multimodal, sessions, LoRA, beam search, client-side branches;
and the whole feature is off under disaggregation, PP, speculative decoding, DP attention, dLLM,
hisparse and mamba caches.
"""

from __future__ import annotations

import functools
import logging
from array import array
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from branchwise.config import BranchwiseConfig
from branchwise.grammars import (
    BranchClosed,
    Detector,
    GrammarError,
    PhaseClosed,
    PhaseOpened,
    get_detector,
)
from branchwise.phases import (
    ParallelPhase,
    PhaseError,
    PhaseRegistry,
    Stage,
    TextStream,
    branch_budget,
    branch_seed,
    fork_limit_error,
    needs_close,
)
from branchwise.request_meta import RequestMeta

logger = logging.getLogger("branchwise.fork")

MAX_DEPTH = 3  # phases nested deeper than this are a grammar error (detector and registry agree)
RECENT = 64  # phase records kept for /server_info
ENC_CACHE = 4096  # encoded texts kept (headers carry client text: the cache must not grow per request)
WAITING = (Stage.FORKING, Stage.PARALLEL)  # a parent in these stages does not decode


@dataclass(slots=True, eq=False)
class Track:
    """Branchwise state of one sequence (a client request or a server-side branch)."""

    mgr: ForkManager
    req: Any  # sglang Req
    det: Detector | None  # None: structure tracking stopped (grammar error) or never started
    text: TextStream
    grammar: str
    branch: bool = False  # a server-side branch (internal rid, never streamed to the client)
    phase: ParallelPhase | None = None  # the phase this sequence opened last (its stage says where it is)
    finished: bool = False  # the sequence ended (any reason); its phases are dropped
    pin: Any = None  # radix tree lock on the parked prefix
    close_at: int | None = None  # branch closed by its tag: output text ends here
    close_keep: int = 0
    close_leftover: str = ""
    error: str | None = None
    root: Track | None = None  # a branch's client request (charged for its branch tokens)
    grant: int = 0  # a branch: decode tokens granted at its fork
    held: int = 0  # a client request: tokens granted to its live branches (and forks about to spawn)
    reserved: int = 0  # a forking sequence: its fork's grants, charged to the root until spawned

    @property
    def rid(self) -> str:
        return self.req.rid

    def fail(self, msg: str) -> None:
        """Stop structure tracking; the sequence continues as plain serial text."""
        if self.error is None:
            self.error = msg
        self.det = None

    @property
    def waiting(self) -> bool:
        """A parent between its fork and its join: it does not decode."""
        return self.phase is not None and self.phase.state in WAITING

    def undecided(self) -> bool:
        """True while text already decoded may still be cut (a fork, or one waiting for its next char)."""
        return self.waiting or (self.det is not None and self.det.deciding)


# ------------------------------------------------------------------------------------------------
# Per-scheduler manager


class ForkManager:
    """Server-side fork/join of one scheduler: its open phases, parked parents and live branches."""

    def __init__(self, sched: Any, cfg: BranchwiseConfig) -> None:
        self.sched = sched
        self.cfg = cfg
        self.reg = PhaseRegistry(max_depth=MAX_DEPTH)
        self.forking: list[Track] = []
        self.closed: list[Track] = []
        self.parked: dict[str, Track] = {}
        self.stats: Counter[str] = Counter()
        self.recent: deque[dict[str, Any]] = deque(maxlen=RECENT)
        self.branch_tracks: dict[str, Track] = {}  # live server-side branches by rid
        # Set by the first track() and never reset: until then no output row can need filtering,
        # later a finished branch may still sit in an in-flight batch whose output must be dropped.
        self.tracking = False
        self._tok = sched.tokenizer
        # headers, close tags, separators: bounded, since headers carry each request's own text
        self._enc = functools.lru_cache(maxsize=ENC_CACHE)(self._encode_uncached)
        # auto: a request's branches may not claim more decode tokens than the whole KV pool holds
        self.max_branch_tokens: int = (self.cfg.branch_max_branch_tokens
                                       or getattr(sched, "max_total_num_tokens", None) or 1 << 62)

    # ---- text --------------------------------------------------------------------------------
    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)

    def encode(self, text: str) -> list[int]:
        return list(self._enc(text)) if text else []

    def _encode_uncached(self, text: str) -> tuple[int, ...]:
        return tuple(self._tok.encode(text, add_special_tokens=False))

    # ---- request admission ---------------------------------------------------------------------
    def grammar_for(self, req: Any, recv_req: Any) -> str | None:
        """The grammar to watch this client request with, or None (serial)."""
        meta = getattr(req, "bw_meta", None)
        if meta is None or meta.is_branch or req.to_finish is not None:
            return None
        g = meta.grammar if meta.grammar is not None else self.cfg.branch_grammar
        if g in (None, "none"):
            return None
        sp = req.sampling_params
        if (req.return_logprob or req.return_hidden_states or req.input_embeds is not None
                or getattr(recv_req, "mm_inputs", None) is not None or req.session is not None
                or req.lora_id
                or sp.json_schema or sp.regex or sp.ebnf or sp.structural_tag
                or (sp.beam_width or 1) > 1):
            self.stats["not_branched_unsupported"] += 1
            return None
        return g

    def track(self, req: Any, det: Detector | None, grammar: str, branch: bool = False) -> Track:
        t = Track(self, req, det, TextStream(self.decode), grammar, branch)
        req.bw_fork = t
        hook_tracked_request(req)
        self.tracking = True
        return t

    # ---- per token (Req.update_finish_state) ----------------------------------------------------
    def on_tokens(self, t: Track) -> None:
        req = t.req
        if t.finished:
            return
        if t.waiting:  # a stale in-flight token past the fork point: drop it
            if not req.finished():
                del req.output_ids[t.phase.keep :]
            return
        aborted = req.finished() and _is_abort(req.finished_reason)
        if t.det is not None and not aborted:
            ids = req.output_ids_through_stop
            try:
                events = t.det.feed(t.text.feed(ids)) if len(ids) > t.text.fed else []
            except GrammarError as e:
                t.fail(f"grammar: {e}")
                events = []
            for ev in events:
                if isinstance(ev, PhaseOpened):
                    self._on_fork(t, ev)
                elif isinstance(ev, BranchClosed) and t.branch and t.det is not None and t.det.done:
                    self._on_close_tag(t, ev)  # its own close tag (inner ones leave it running)
                elif isinstance(ev, PhaseClosed) and t.phase is not None and t.phase.state is Stage.REDUCE:
                    self.reg.release(t.phase.phase_id)
        if req.finished():
            self.on_finished(t)

    def _on_fork(self, t: Track, ev: PhaseOpened) -> None:
        req, det = t.req, t.det
        assert det is not None
        if req.finished() or req.to_finish is not None:
            t.fail("stream ended at a fork")
            return
        keep, leftover = t.text.split(ev.at, det.text)
        headers = [self.encode(leftover + h) for h in ev.headers]
        grants = [branch_budget(req.sampling_params.max_new_tokens, keep, len(h)) for h in headers]
        if min(grants) < 1:
            t.fail(f"fork at token {keep}: no max_new_tokens budget left for branches")
            return
        root = t.root or t
        why = fork_limit_error(len(headers), grants, root.held, self.cfg.branch_max_fanout,
                               self.max_branch_tokens)
        if why is not None:
            self.stats["over_limit_forks"] += 1
            t.fail(why)
            return
        if keep < req.send_token_offset:  # cannot happen while `undecided` holds streaming back
            t.fail("fork point already streamed")
            return
        try:
            t.phase = self.reg.open(t.rid, ev.headers, ev.labels, prefix_text=det.text,
                                    prefix_len=len(req.origin_input_ids) + keep, header=ev.header,
                                    fmt=det.fmt, keep=keep, leftover=leftover, header_ids=headers)
        except PhaseError as e:
            t.fail(str(e))
            return
        t.reserved = sum(grants)
        root.held += t.reserved
        del req.output_ids[keep:]
        t.text.truncate(keep, ev.at)
        self.forking.append(t)

    def _on_close_tag(self, t: Track, ev: BranchClosed) -> None:
        req = t.req
        assert t.det is not None
        keep, leftover = t.text.split(ev.at, t.det.text)
        t.close_at, t.close_keep, t.close_leftover = ev.at, keep, leftover
        if not _is_abort(req.finished_reason):  # SGLang then caches and frees it like a stop string
            from sglang.srt.managers.schedule_batch import FINISH_MATCHED_STR

            req.finished_reason = FINISH_MATCHED_STR(matched=t.det.fmt.close.strip())
            req.finished_len = keep

    # ---- end of a sequence ------------------------------------------------------------------------
    def on_finished(self, t: Track) -> None:
        """The sequence ended (any reason). Branches are closed at the next scheduling point."""
        if t.finished:
            return
        req = t.req
        stage = t.phase.state if t.phase is not None else None
        if stage is Stage.FORKING:
            self.forking.remove(t)
        if stage is Stage.PARALLEL:
            self.parked.pop(t.rid, None)
            self._unpin(t)
        t.finished = True
        root = t.root or t
        root.held -= t.grant + t.reserved  # a fork that never spawned gives its reservation back
        t.grant = t.reserved = 0
        self.reg.drop_request(t.rid)  # its own (nested) phases die with it
        if t.branch:
            self.branch_tracks.pop(t.rid, None)
            self.closed.append(t)
            return
        if t.det is not None and _natural_end(req.finished_reason):  # cut text is incomplete anyway
            try:
                t.det.finish()
            except GrammarError as e:
                t.fail(f"grammar: {e}")
        if t.error is not None:
            self.stats["grammar_errors"] += 1
            if not _is_abort(req.finished_reason):
                req.finished_reason = _annotate(req.finished_reason, t.error)

    # ---- scheduling point (after Scheduler.ingest_requests) ---------------------------------------
    def reconcile(self) -> None:
        while self.forking:
            t = self.forking.pop(0)
            self._park(t)
            if t.req.to_finish is not None:  # aborted between the fork and now: end it parked
                t.req.finished_reason, t.req.to_finish = t.req.to_finish, None
                self._finish_outside_batch(t)
            else:
                self._spawn(t)
        while self.closed:
            self._close(self.closed.pop(0))

    def _park(self, t: Track) -> None:
        """FORKING -> PARALLEL: the parent's prefix KV goes into the radix tree (pinned there), and
        the Req leaves every batch and holds no KV row, like a retracted request."""
        from sglang.srt.mem_cache.common import release_kv_cache

        sched, req, ph = self.sched, t.req, t.phase
        assert ph is not None and ph.state is Stage.FORKING and not req.finished()
        _evict(sched, req)
        tree = sched.tree_cache
        if req.kv.holds_kv:
            ph.shared = min(req.kv.kv_committed_len, len(req.origin_input_ids) + ph.keep)
            req.full_untruncated_fill_ids = array("q")  # output_ids shrank: rebuild, not extend
            release_kv_cache(req, tree, checkpoint=True)
            if tree.supports_prefix_sharing() and req.last_node is not None:
                t.pin = tree.lock(req.last_node)  # keep the prefix until the branches match it
        n_retract = req.retraction_count
        req.reset_for_retract()
        req.retraction_count = n_retract  # a park is not a retraction
        ph.park()
        self.parked[t.rid] = t

    def _spawn(self, t: Track) -> None:
        """One Req per branch (input: the shared prefix and its own header) into the waiting queue."""
        sched, req, ph = self.sched, t.req, t.phase
        assert ph is not None
        prefix = array("q", req.origin_input_ids) + array("q", req.output_ids[: ph.keep])
        parent_meta: RequestMeta = getattr(req, "bw_meta", None) or RequestMeta()
        from branchwise.scheduler_hook import note_phase_requests

        note_phase_requests(sched)  # before they can reach a batch: TAPER must see their phase
        for b in ph.branches:
            i = b.index
            br = self._make_branch(req, b.rid, ph.branch_input(i, prefix), ph.keep + len(ph.header_ids[i]))
            br.bw_meta = RequestMeta(ph.phase_id, i, ph.fanout, parent_meta.slo_tpot_ms,
                                     parent_meta.weight, t.grammar)
            bdet = t.det.branch(i, b.label, ph.depth) if t.det is not None else None
            bt = self.track(br, bdet, t.grammar, branch=True)
            bt.root, bt.grant = t.root or t, br.sampling_params.max_new_tokens
            self.branch_tracks[b.rid] = bt
            sched.init_req_max_new_tokens(br)
            sched._add_request_to_queue(br)
        t.reserved = 0  # now held by the branches (released as each one ends)
        self._record(ph)
        self.stats["forks"] += 1
        self.stats["branches"] += ph.fanout
        logger.debug("fork %s: %d branches on %d shared tokens", ph.phase_id, ph.fanout, ph.shared)

    def _make_branch(self, parent: Any, rid: str, input_ids: array, used: int) -> Any:
        import msgspec
        from sglang.srt.managers.schedule_batch import Req

        sp = parent.sampling_params
        cp = sp.custom_params
        if isinstance(cp, dict):
            cp = {k: v for k, v in cp.items() if k != "__req__"}  # Req() adds the branch's own
        seed = branch_seed(sp.sampling_seed, rid) if sp.sampling_seed is not None else None
        bsp = msgspec.structs.replace(sp, max_new_tokens=sp.max_new_tokens - used,
                                      sampling_seed=seed, custom_params=cp)
        br = Req(rid, "", input_ids, bsp, stream=False,
                 custom_logit_processor=parent.custom_logit_processor,
                 eos_token_ids=parent.eos_token_ids, vocab_size=parent.vocab_size,
                 priority=parent.priority, metrics_collector=parent.metrics_collector,
                 extra_key=parent.extra_key, cache_salt=parent.cache_salt,
                 routing_key=parent.routing_key, http_worker_ipc=parent.http_worker_ipc)
        br.tokenizer = parent.tokenizer
        return br

    def _close(self, bt: Track) -> None:
        hit = self.reg.of_branch(bt.rid)
        if hit is None or hit[0].state is not Stage.PARALLEL or hit[1].finished:
            return  # its phase was dropped (parent aborted or finished)
        ph, b = hit
        ids, text, reason = self._branch_output(bt)
        ph.close_branch(b.index, text, ids, reason)
        self.stats[f"branch_close_{reason}"] += 1
        parent = self.parked.get(ph.parent_rid)
        if parent is not None:
            rec = self._record(ph)
            rec["cached_tokens"][b.index] = bt.req.cached_tokens
            rec["reasons"][b.index] = reason
            if bt.error is not None and parent.error is None:
                parent.error = f"branch {bt.rid}: {bt.error}"
        if ph.all_closed:
            self._join(ph)

    def _branch_output(self, bt: Track) -> tuple[list[int], str, str]:
        req = bt.req
        if bt.close_at is not None:
            ids = list(req.output_ids[: bt.close_keep]) + self.encode(bt.close_leftover)
            return ids, self.decode(req.output_ids[: bt.close_keep]) + bt.close_leftover, "tag"
        from sglang.srt.managers.schedule_batch import FINISH_LENGTH, FINISH_MATCHED_TOKEN

        ids = list(req.output_ids_through_stop)
        fr = req.finished_reason
        if isinstance(fr, FINISH_MATCHED_TOKEN) and ids:
            ids.pop()  # EOS / stop token: not part of the branch's text
            reason = "eos"
        else:
            reason = "length" if isinstance(fr, FINISH_LENGTH) else "abort" if _is_abort(fr) else "stop"
        return ids, self.decode(ids), reason

    def _record(self, ph: ParallelPhase) -> dict[str, Any]:
        for rec in reversed(self.recent):
            if rec["phase"] == ph.phase_id:
                return rec
        rec = {"phase": ph.phase_id, "parent": ph.parent_rid, "fanout": ph.fanout, "depth": ph.depth,
               "prefix_tokens": ph.prefix_len, "shared_tokens": ph.shared,
               "cached_tokens": [None] * ph.fanout, "reasons": [None] * ph.fanout, "joined_tokens": None}
        self.recent.append(rec)
        return rec

    def _join(self, ph: ParallelPhase) -> None:
        t = self.parked.pop(ph.parent_rid)
        req, fmt = t.req, ph.fmt
        ids = self.encode(ph.leftover)
        for b in ph.branches:
            ids += self.encode(b.header) + b.output_ids
            if needs_close(b.output_text, fmt.close):
                ids += self.encode(fmt.close)
            ids += self.encode(fmt.sep)
        ids += self.encode(fmt.suffix)
        red = ph.join()
        if t.det is not None:
            try:
                for ev in t.det.join(red):
                    if isinstance(ev, PhaseClosed):
                        self.reg.release(ph.phase_id)
            except GrammarError as e:
                t.fail(f"grammar: {e}")
        if t.det is None and ph.phase_id in self.reg.phases:
            self.reg.release(ph.phase_id)  # no detector left to see the phase end
        req.output_ids.extend(ids)
        t.text.skip(len(ids), t.det.pos if t.det is not None else t.text.pos)
        self._unpin(t)
        self._record(ph)["joined_tokens"] = len(ids)
        self.stats["joins"] += 1
        max_new = req.sampling_params.max_new_tokens
        if len(req.output_ids) >= max_new:  # the response's budget is spent by the branches
            from sglang.srt.managers.schedule_batch import FINISH_LENGTH

            req.finished_reason, req.finished_len = FINISH_LENGTH(length=max_new), max_new
            self._finish_outside_batch(t)
        else:
            self.sched._add_request_to_queue(req, is_retracted=True)

    def _finish_outside_batch(self, t: Track) -> None:
        """A parked request ends without running again (abort, or budget spent at its join)."""
        self.on_finished(t)
        if not t.branch:
            t.req.time_stats.set_completion_time()
            self.sched.output_streamer.stream_output([t.req], False)

    def _unpin(self, t: Track) -> None:
        if t.pin is not None:
            self.sched.tree_cache.unlock(t.pin)
            t.pin = None

    # ---- aborts -------------------------------------------------------------------------------
    def abort_parked(self, recv_req: Any) -> None:
        """SGLang aborts by rid prefix over its queues and batches; parked requests are in neither."""
        from http import HTTPStatus

        from sglang.srt.managers.schedule_batch import FINISH_ABORT

        for rid, t in list(self.parked.items()):
            if recv_req.abort_all or rid.startswith(recv_req.rid):
                msg = recv_req.abort_message
                t.req.finished_reason = (FINISH_ABORT(msg, HTTPStatus.SERVICE_UNAVAILABLE) if msg
                                         else FINISH_ABORT())
                self.stats["parked_aborted"] += 1
                self._finish_outside_batch(t)

    # ---- report -------------------------------------------------------------------------------
    def report(self) -> dict[str, Any]:
        reg = self.reg
        sizes = {"forking": len(self.forking), "closed": len(self.closed), "by_branch": len(reg.by_branch),
                 "by_parent": len(reg.by_parent), "phase_counts": len(reg.counts),
                 "enc_cache": self._enc.cache_info().currsize}
        return {"counters": dict(self.stats), "parked": len(self.parked), "open_phases": len(self.reg),
                "live_branches": len(self.branch_tracks), "sizes": sizes, "recent": list(self.recent),
                "limits": {"max_fanout": self.cfg.branch_max_fanout, "max_branch_tokens": self.max_branch_tokens}}


# ------------------------------------------------------------------------------------------------
# SGLang glue


def _is_abort(fr: Any) -> bool:
    return fr is not None and fr.to_json().get("type") == "abort"


def _natural_end(fr: Any) -> bool:
    """EOS or a stop: the text claims to be complete (not cut by length or abort)."""
    return fr is not None and fr.to_json().get("type") == "stop"


def _annotate(fr: Any, msg: str) -> Any:
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


def _plain_mode(sched: Any) -> str | None:
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


def build(scheduler: Any, config: BranchwiseConfig) -> ForkManager | None:
    """The scheduler's fork manager, or None where server-side branching cannot run. The scheduler's
    tree cache, which the output streamer shares, gets a reference to it for the stream_output hook."""
    why = _plain_mode(scheduler)
    if why is not None:
        logger.info("Branchwise server-side fork/join off: %s", why)
        return None
    mgr = ForkManager(scheduler, config)
    scheduler.tree_cache._branchwise_fork = mgr  # the output streamer's handle (it is a slots dataclass)
    return mgr


# Hook bodies (registered in plugin.py; after_create_generation_req is called by runtime.py). Scheduler
# hooks find the manager at `self.branchwise.fork`.


def after_create_generation_req(req: Any, self: Any, recv_req: Any, *args: Any, **kwargs: Any) -> Any:
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
    if mgr is not None and (g := mgr.grammar_for(req, recv_req)) is not None:
        mgr.track(req, get_detector(g), g)
    return req


def hook_tracked_request(req: Any) -> None:
    """Per-request hook on `Req.update_finish_state`, set on the instance of each tracked request.
    Not a HookRegistry target on purpose: a class-level AROUND runs for every row of every batch
    (~1 us per row per step on CPU), this runs only for tracked rows. It wraps the class's method
    as resolved then (class-level hooks of plugins are applied before any Req exists, so they stay
    inside)."""
    cls_fn = type(req).update_finish_state
    req.update_finish_state = functools.partial(around_update_finish_state, cls_fn, req)


def around_update_finish_state(orig: Callable[..., Any], req: Any, *args: Any, **kwargs: Any) -> Any:
    """Runs right after SGLang appended a step's tokens and checked stops, before KV release and
    streaming: a close tag finishes a branch like a stop string, a fork cuts the parent."""
    out = orig(req, *args, **kwargs)
    t = getattr(req, "bw_fork", None)
    if t is not None:
        t.mgr.on_tokens(t)
    return out


def after_ingest_requests(result: Any, self: Any, *args: Any, **kwargs: Any) -> Any:
    mgr = self.branchwise.fork
    if mgr is not None and (mgr.forking or mgr.closed):
        mgr.reconcile()
    return result


def after_abort_request(result: Any, self: Any, recv_req: Any, *args: Any, **kwargs: Any) -> Any:
    mgr = self.branchwise.fork
    if mgr is not None and mgr.parked:
        mgr.abort_parked(recv_req)
    return result


def around_send_abort_output(orig: Callable[..., Any], self: Any, abort_req: Any, req: Any) -> Any:
    """Requests SGLang ends outside the output stream (aborted while queued, retraction OOM)."""
    t = getattr(req, "bw_fork", None)
    mgr = self.branchwise.fork
    if t is None or mgr is None:
        return orig(self, abort_req, req)
    if req.finished_reason is None:
        from sglang.srt.managers.schedule_batch import FINISH_ABORT

        req.finished_reason = req.to_finish or FINISH_ABORT()
    mgr.on_finished(t)
    if t.branch:
        return None  # internal rid: the tokenizer manager never heard of it
    return orig(self, abort_req, req)


def around_stream_output(orig: Callable[..., Any], self: Any, reqs: list, *args: Any, **kwargs: Any) -> Any:
    """Branch rows never reach the detokenizer; a parent is held back while a fork may cut it.
    Until the manager tracks a first request no row can need filtering: no per-row scan."""
    mgr = getattr(getattr(self, "tree_cache", None), "_branchwise_fork", None)
    if mgr is not None and mgr.tracking and any(getattr(r, "bw_fork", None) is not None for r in reqs):
        reqs = [r for r in reqs if _streamable(r)]
    return orig(self, reqs, *args, **kwargs)


def _streamable(req: Any) -> bool:
    t = getattr(req, "bw_fork", None)
    if t is None:
        return True
    if t.branch:
        return False
    return req.finished() or not t.undecided()


def after_is_fully_idle(result: bool, self: Any, *args: Any, **kwargs: Any) -> bool:
    """Not idle while a request is parked or a fork/join waits for the next scheduling point:
    the idle sleeper would otherwise wait for a new request before joining, and the idle leak
    check would count the parked prefix's tree lock."""
    mgr = self.branchwise.fork
    if result and mgr is not None and (mgr.parked or mgr.forking or mgr.closed):
        return False
    return result
