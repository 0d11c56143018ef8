"""Glue into SGLang's Scheduler: per-scheduler Branchwise state and the hook bodies.

The per-step hook bodies are registered by plugin.py and receive the Scheduler as `self`; they find
this module's state at `self.branchwise.taper` (runtime.py builds it with `build`).
Under tensor parallelism every rank runs the same hooks on identical batches; wall-clock driven
decisions (TAPER's slack) are made on TP rank 0 and broadcast, so all ranks run the same rows.
"""

from __future__ import annotations

import logging
import math
import operator
import os
import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from branchwise import deferral, request_meta, step_timer
from branchwise.config import BranchwiseConfig
from branchwise.metrics import BranchwiseMetrics
from branchwise.taper.controller import Delivery, Row, StepController
from branchwise.taper.policies import parse_policy
from branchwise.taper.predictor import OnlineRefit, default_model, load_model

logger = logging.getLogger("branchwise")
SUMMARY_EVERY_S = 30.0
_KV_LEN = operator.attrgetter("kv.kv_committed_len")  # map() in C: no Python frame per row


def _proctitle() -> str:
    try:
        import setproctitle

        return setproctitle.getproctitle()
    except ImportError:  # pragma: no cover - setproctitle ships with the sglang closure
        return ""


@dataclass(slots=True)
class LastStep:
    forward_iter: int
    launch_ts: float
    rows: int
    ctx: int
    deferred: int = 0  # rows of the running batch this step did not run (the refit's deferral price)


@dataclass(slots=True)
class BranchwiseState:
    """What Branchwise keeps per scheduler process."""

    config: BranchwiseConfig
    controller: StepController | None = None  # None: pass-through (unsupported mode)
    tp_rank: int = 0
    tp_size: int = 1
    disabled_reason: str | None = None
    metrics: BranchwiseMetrics | None = None
    pid: int = field(default_factory=os.getpid)
    proctitle: str = field(default_factory=_proctitle)
    counters: dict[str, int] = field(default_factory=dict)
    last_step: LastStep | None = None
    last_summary: float = field(default_factory=time.monotonic)
    # False until this scheduler creates its first phase (branch) request: until then no batch
    # can defer a row or need per-row bookkeeping, and the per-step hooks exit in O(1).
    phases_seen: bool = False
    # Time of the last decode step whose batch had no phase rows (per-row bookkeeping skipped);
    # None while steps with phase rows keep the serial rows' delivery clocks current.
    quiet_ts: float | None = None
    kept: deferral.KeptSubset = field(default_factory=deferral.KeptSubset)  # the last step's sub-batch

    def bump(self, name: str, n: int = 1) -> None:
        self.counters[name] = self.counters.get(name, 0) + n

    def report(self) -> dict[str, Any]:
        rep: dict[str, Any] = {"config": self.config.as_dict(), "pid": self.pid, "proctitle": self.proctitle,
                               "counters": dict(self.counters), "disabled_reason": self.disabled_reason}
        ctl = self.controller
        if ctl is not None:
            s = ctl.stats
            rep["taper"] = {
                "policy": ctl.policy.name, "steps": s.steps, "planned_steps": s.planned_steps,
                "rows_run": s.rows_run, "rows_deferred": s.rows_deferred, "candidates": s.candidates,
                "admitted": s.admitted, "admission_rate": s.admission_rate,
                "planner_ms_mean": 1e3 * s.planner_s / max(s.planned_steps, 1),
                "last_budget_s": s.last_budget_s if math.isfinite(s.last_budget_s) else None,
                "last_predicted_s": s.last_predicted_s, "bubble_steps": s.bubble_steps,
                "planner_errors": s.planner_errors, "terms": dict(s.terms),
                "model": ctl.policy.model.to_json() if ctl.policy.model is not None else None,
            }
            rep["sizes"] = {"trackers": len(ctl.trackers), "fixed": len(ctl.fixed)}  # leak checks (soak)
        return rep


def state_of(scheduler: Any) -> BranchwiseState | None:
    bw = getattr(scheduler, "branchwise", None)  # runtime.Branchwise
    return bw.taper if bw is not None else None


def _build_controller(cfg: BranchwiseConfig) -> StepController:
    model = load_model(cfg.latency_model) if cfg.latency_model else default_model()
    policy = parse_policy(cfg.branch_policy, model=model, rho=cfg.taper_rho, utility=cfg.taper_utility)
    refit = None
    learn_price = policy.terms.defer_cost  # the refit learns what deferring itself costs (policies.py)
    if policy.model is not None and cfg.latency_model:
        # a calibrated model keeps its slopes; its intercept follows the box's drift and the per-step
        # work a pure-decode calibration does not see (arrivals, streaming), over the last ~1 s of steps
        refit = OnlineRefit(policy.model, window=64, every=16, slopes_fixed=True, deferral=learn_price)
    elif policy.model is not None:
        refit = OnlineRefit(policy.model, deferral=learn_price)
    return StepController(policy, refit)


def build(scheduler: Any, cfg: BranchwiseConfig) -> BranchwiseState:
    """This scheduler's TAPER state (runtime.build calls it first, with the parsed settings)."""
    from sglang.srt.runtime_context import get_parallel

    par = get_parallel()
    st = BranchwiseState(cfg, tp_rank=par.tp_rank, tp_size=par.tp_size)
    st.disabled_reason = deferral.why_unsupported(scheduler)
    if st.disabled_reason:
        logger.warning("Branchwise: per-step branch admission is not supported with %s; "
                       "every row runs every step (SGLang's schedule)", st.disabled_reason)
    elif cfg.step_controller:  # policy stock: no controller, SGLang's schedule (phases still counted)
        st.controller = _build_controller(cfg)
    # Branch rows can sit out steps under every policy (off runs one branch per phase per step), so
    # their penalty tokens are pinned wherever a controller runs (deferral.py); a row that ran in the
    # previous step feeds the penalizers what SGLang's own rule feeds them.
    if st.controller is not None and scheduler.enable_overlap:
        deferral.pin_penalty_tokens(scheduler)
    if getattr(scheduler.server_args, "enable_metrics", False) and st.tp_rank == 0:
        st.metrics = BranchwiseMetrics()
    logger.info("%s (pid %d, %s)", cfg.log_line(), os.getpid(), st.proctitle)
    return st


def on_request_created(st: BranchwiseState, req: Any) -> None:
    """Attach the parsed custom_params.branchwise as `req.bw_meta`; malformed input ends with HTTP 400.
    Called by runtime's _create_generation_req hook, before fork and dp read `bw_meta`."""
    st.bump("requests_created")
    try:
        req.bw_meta = request_meta.parse(getattr(req.sampling_params, "custom_params", None))
    except Exception as e:  # nothing a client sends may raise inside the scheduler loop
        req.bw_meta = request_meta.SERIAL
        if isinstance(e, request_meta.MetaError):
            msg = str(e)
        else:  # a parse bug: the request still ends with a 400, the server keeps serving
            msg = f"custom_params not understood ({type(e).__name__})"
            if not st.counters.get("meta_parse_bugs"):
                logger.exception("Branchwise: custom_params parsing raised; such requests get HTTP 400")
            st.bump("meta_parse_bugs")
        if req.to_finish is None:  # keep SGLang's own error if it already rejected the request
            req.set_finish_with_abort(f"Branchwise: {msg}")
        st.bump("bad_requests")
    if req.bw_meta.is_branch:
        st.bump("branch_requests")
        st.phases_seen = True


def note_phase_requests(scheduler: Any) -> None:
    """Server-side fork created branch requests (they bypass _create_generation_req)."""
    st = state_of(scheduler)
    if st is not None:
        st.phases_seen = True


def _has_phase_rows(st: BranchwiseState, reqs: list[Any]) -> bool:
    """Whether a row belongs to a parallel phase: only then can a step defer rows, and only then
    does TAPER need per-row bookkeeping. A function of batch composition, so TP ranks agree."""
    serial = request_meta.SERIAL
    return st.phases_seen and any(getattr(r, "bw_meta", serial).phase is not None for r in reqs)


def _meta(req: Any) -> request_meta.RequestMeta:
    return getattr(req, "bw_meta", request_meta.SERIAL)


def _key(req: Any) -> str:
    """TAPER's grouping key, the one derivation every per-row path uses: rows of one phase share
    it, a serial request has its own. Request ids, client phase ids and server-side fork phases
    are all client-chosen strings, so each gets its own prefix: no rid or phase id a client picks
    can group with another request's rows."""
    m = _meta(req)
    if m.phase is None:
        return "rid:" + req.rid
    t = getattr(req, "bw_fork", None)
    return ("fork:" if t is not None and t.branch else "phase:") + m.phase


@dataclass(frozen=True, slots=True)
class RowFields:
    """A request's row fields that do not change while it decodes, derived once and kept on the
    request (`req.bw_row`); derived again when its metadata, fork track or config is not the one
    they came from."""

    meta: request_meta.RequestMeta
    fork: Any
    config: BranchwiseConfig
    key: str
    slo_s: float
    weight: float


def _fields(req: Any, cfg: BranchwiseConfig) -> RowFields:
    f = getattr(req, "bw_row", None)
    meta, fork = getattr(req, "bw_meta", request_meta.SERIAL), getattr(req, "bw_fork", None)
    if f is None or f.meta is not meta or f.fork is not fork or f.config is not cfg:
        f = RowFields(meta=meta, fork=fork, config=cfg, key=_key(req), slo_s=cfg.slo_s(meta.slo_tpot_ms),
                      weight=cfg.weight(meta.weight))
        req.bw_row = f
    return f


def _row(req: Any, cfg: BranchwiseConfig) -> Row:
    f = _fields(req, cfg)
    return Row(key=f.key, order=f.meta.branch, ctx=req.kv.kv_committed_len, slo_s=f.slo_s, weight=f.weight,
               phase=f.meta.is_branch, forced=req.to_finish is not None)


def _pipeline_bubble(scheduler: Any) -> bool:
    """Under overlap scheduling the token a row receives next comes from the batch in flight
    (scheduler.last_batch, processed after this step's forward). When that batch is a prefill,
    the running rows get nothing from it: their next token arrives only after this step and the
    next one, so this step's plan must leave room for the next (the replay's TAPER misses were
    marginal serial ones right after arrivals and joins)."""
    last = getattr(scheduler, "last_batch", None)
    if not getattr(scheduler, "enable_overlap", False) or last is None:
        return False
    mode = last.forward_mode
    return bool(mode.is_extend() and not mode.is_mixed())


def _decide(st: BranchwiseState, self: Any, rows: list[Row]) -> list[int]:
    """Rank 0 plans; other TP ranks receive the same active set (never act on their own clocks)."""
    active: list[int] = []
    if st.tp_rank == 0:
        try:
            if st.quiet_ts is not None:
                _resume_serial_clocks(st, rows)
            active = st.controller.select(rows, time.monotonic(), _pipeline_bubble(self),
                                          waiting=len(getattr(self, "waiting_queue", ())))
        except Exception:  # noqa: BLE001 - the other ranks wait in the broadcast below
            st.bump("decide_errors")
            if st.counters["decide_errors"] == 1:
                logger.exception("Branchwise: branch admission failed; running every row (logged once)")
            active = list(range(len(rows)))
    if st.tp_size == 1:
        return active
    import torch
    import torch.distributed as dist

    mask = torch.zeros(len(rows), dtype=torch.uint8)
    mask[active] = 1
    dist.broadcast(mask, src=self.tp_group.ranks[0], group=self.tp_cpu_group)
    return mask.nonzero().flatten().tolist()


class Exit(Enum):
    """How a decode step leaves the TAPER driver (`decode_step`)."""

    SERIAL = "serial"  # no row is in a parallel phase: SGLang's own step
    FULL_STEP = "full step"  # a per-step condition (deferral.batch_needs_full_step) runs every row
    ONE_ROW_PER_KEY = "one row per key"  # every request has one live row: nothing to defer
    ALL_ADMITTED = "all admitted"  # the plan runs every row
    NO_FIT = "no fit"  # the subset does not fit the KV pool: SGLang's retract path, every row
    SUBSET = "subset"  # the chosen rows run; the rest wait in the running batch


def around_update_running_batch(orig: Any, self: Any, batch: Any) -> Any:
    st = state_of(self)
    if st is None or st.controller is None or not st.phases_seen or batch.is_empty():
        return orig(self, batch)  # no phase request yet: nothing to defer
    t = self.branchwise.timer  # None unless env BRANCHWISE_STEP_TIMER (bench)
    try:
        how, sub = decode_step(st, self, batch, t)
    finally:
        step_timer.switch(t, None)
    if how is Exit.SUBSET:
        st.bump("subset_steps")
        return sub
    if st.kept.batch is not None:  # the batch is prepared in full: a kept sub-batch no longer fits it
        st.kept.clear()
    if how is Exit.NO_FIT:
        st.bump("fallback_retract")
    return orig(self, batch)


def decode_step(st: BranchwiseState, scheduler: Any, batch: Any, t: Any = None) -> tuple[Exit, Any]:
    """The TAPER decode step up to the forward, top to bottom: the rows of the batch, the decision,
    the chosen subset prepared (the sub-batch to run with Exit.SUBSET; every other exit runs the
    whole batch through SGLang). The step's deliveries are reported when its result comes back
    (`after_process_batch_result` -> `report_step`). `t`: the step timer (bench only)."""
    step_timer.switch(t, "taper_rows")
    if not _has_phase_rows(st, batch.reqs):
        return Exit.SERIAL, None
    step_timer.tag(t, "phase_rows")
    if deferral.batch_needs_full_step(batch):
        return Exit.FULL_STEP, None
    finishing = scheduler._reqs_finishing_inflight(batch)
    excluded = set(finishing)
    live = [r for r in batch.reqs if r not in excluded and not r.finished()]
    rows = [_row(r, st.config) for r in live]
    if len({r.key for r in rows}) == len(rows):  # a function of composition: every TP rank agrees
        return Exit.ONE_ROW_PER_KEY, None

    step_timer.switch(t, "taper_plan")
    planned_s = st.controller.stats.planner_s
    active = _decide(st, scheduler, rows)
    step_timer.carve(t, "taper_planner", st.controller.stats.planner_s - planned_s)
    if len(active) == len(live):
        return Exit.ALL_ADMITTED, None

    step_timer.switch(t, "taper_subset")
    sub = deferral.run_subset(scheduler, batch, {live[i] for i in active}, finishing, st.kept)
    if sub is None:
        return Exit.NO_FIT, None
    step_timer.tag(t, "deferred", len(live) - len(active))
    return Exit.SUBSET, sub


def _deliveries(st: BranchwiseState, reqs: list[Any]) -> tuple[dict[str, Delivery], int]:
    """Tokens delivered per key this step (one per row that ran), and the context sum."""
    cfg = st.config
    counts: dict[str, list[Any]] = {}  # key -> [rows, the key's first row's fields (its clock's SLO)]
    for req in reqs:
        f = _fields(req, cfg)
        c = counts.get(f.key)
        if c is None:
            counts[f.key] = [1, f]
        else:
            c[0] += 1
    ctx = sum(map(_KV_LEN, reqs))
    return {k: Delivery(n, f.slo_s, f.meta.is_branch) for k, (n, f) in counts.items()}, ctx


def _release_finished(st: BranchwiseState, scheduler: Any, reqs: list[Any]) -> None:
    """Keys whose last row finished or was aborted in this step leave the controller (a reused
    phase id or rid must not inherit their clock). Deferred rows stay in the running batch, so a
    key with any unfinished request there keeps its state."""
    ctl, cfg = st.controller, st.config
    keys = {_fields(r, cfg).key for r in reqs if r.finished()}
    keys = {k for k in keys if k in ctl.trackers or k in ctl.fixed}
    if not keys:
        return
    running = getattr(scheduler, "running_batch", None)
    left = {_fields(r, cfg).key for r in running.reqs if not r.finished()} if running is not None else set()
    ctl.on_finished(keys - left)


def _resume_serial_clocks(st: BranchwiseState, rows: list[Row]) -> None:
    """First plan after steps without phase rows, whose bookkeeping was skipped: every serial row
    of those steps delivered a token at the last of them (`quiet_ts`), which is what per-step
    bookkeeping would have recorded. A serial row that joined later (prefill) gets that time too,
    which understates its slack by at most that prefill step (conservative: defers more)."""
    ctl = st.controller
    assert ctl is not None and st.quiet_ts is not None
    fresh = {r.key: Delivery(0, r.slo_s, False) for r in rows if not r.phase and r.key not in ctl.trackers}
    ctl.on_step_done(fresh, st.quiet_ts, 0)
    st.quiet_ts = None


def after_process_batch_result(result: Any, self: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
    st = state_of(self)
    if st is None:
        return result
    st.bump("batch_results")
    if batch.forward_mode.is_mixed():  # mixed chunked prefill: every decode row ran (no deferral)
        st.bump("mixed_steps")
    if st.controller is None or st.tp_rank != 0 or not batch.forward_mode.is_decode():
        st.last_step = None
        return result
    t = self.branchwise.timer  # None unless env BRANCHWISE_STEP_TIMER (bench)
    if t is None:
        report_step(st, self, batch)
        return result
    step_timer.switch(t, "taper_deliver")
    try:
        report_step(st, self, batch)
    finally:
        step_timer.switch(t, None)
    return result


def report_step(st: BranchwiseState, scheduler: Any, batch: Any) -> None:
    """The end of a TAPER decode step (rank 0): the rows that ran delivered a token each, keys whose
    last row finished leave, and the gap between consecutive decode launches is the realized
    latency of the previous step."""
    now = time.monotonic()
    ctl = st.controller
    reqs = batch.reqs
    if _has_phase_rows(st, reqs):
        delivered, ctx = _deliveries(st, reqs)
        ctl.on_step_done(delivered, now, len(reqs))
        st.quiet_ts = None
        _release_finished(st, scheduler, reqs)  # quiet steps: serial clocks go below, no phase row left
    else:  # serial rows only: their clocks matter only once a phase row joins (_resume_serial_clocks)
        ctl.on_step_done({}, now, len(reqs))
        if st.quiet_ts is None:
            ctl.forget({k for k, tr in ctl.trackers.items() if tr.in_phase})  # serial clocks go stale
        st.quiet_ts = now
        ctx = sum(map(_KV_LEN, reqs))
    prev = st.last_step
    fi, ts = getattr(batch, "forward_iter", None), getattr(batch, "launch_ts", None)
    if prev is not None and fi is not None and fi == prev.forward_iter + 1:
        latency = ts - prev.launch_ts
        ctl.on_latency(prev.rows, prev.ctx, latency, prev.deferred)
        if st.metrics:
            st.metrics.observe_step(latency, ctl.stats, st.counters)
    full = getattr(scheduler, "running_batch", None)
    deferred = max(len(full.reqs) - len(reqs), 0) if full is not None and full is not batch else 0
    st.last_step = LastStep(fi, ts, len(reqs), ctx, deferred) if fi is not None and ts is not None else None
    if now - st.last_summary >= SUMMARY_EVERY_S:
        st.last_summary = now
        s = ctl.stats
        logger.info("Branchwise %s: steps=%d planned=%d deferred_rows=%d admission=%.1f%% "
                    "budget=%.1fms predicted=%.1fms planner=%.3fms", ctl.policy.name, s.steps,
                    s.planned_steps, s.rows_deferred, 100 * s.admission_rate, 1e3 * s.last_budget_s,
                    1e3 * s.last_predicted_s, 1e3 * s.planner_s / max(s.planned_steps, 1))
