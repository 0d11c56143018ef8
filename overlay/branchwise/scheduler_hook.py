"""Glue into SGLang's Scheduler: per-scheduler Branchwise state and the hook bodies.

Hot path: per-row code uses map()/attrgetter and positional records (docs/design/code-notes.md).
"""

from __future__ import annotations

import logging
import math
import operator
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any

from branchwise import deferral, device_time, prefill_hook, request_meta, step_timer
from branchwise.config import BranchwiseConfig
from branchwise.metrics import BranchwiseMetrics
from branchwise.taper.controller import Delivery, Row, StepController
from branchwise.taper.policies import parse_policy
from branchwise.taper.predictor import LinearLatencyModel, OnlineRefit, default_model, load_model

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
    from sglang.srt.managers.scheduler import Scheduler

    from branchwise.fork.manager import Track
    from branchwise.step_timer import StepTimer

logger = logging.getLogger("branchwise")
SUMMARY_EVERY_S = 30.0
_KV_LEN = operator.attrgetter("kv.kv_committed_len")


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
    deferred: int = 0  # live rows TAPER deferred this step (the refit's deferral price)


@dataclass(slots=True, frozen=True)
class PlannedStep:
    """A deferring step as decode_step left it, by forward_iter (SGLang's batch.copy() drops ours)."""

    rows: int  # rows of the sub-batch (a check that the result is the step planned)
    deferred: int  # live rows left out of it (not counting rows finishing in flight)


@dataclass(slots=True, kw_only=True)
class BranchwiseState:
    """What Branchwise keeps per scheduler process."""

    config: BranchwiseConfig
    controller: StepController | None = None  # None: policy stock (SGLang's own schedule)
    tp_rank: int = 0
    tp_size: int = 1
    metrics: BranchwiseMetrics | None = None
    pid: int = field(default_factory=os.getpid)
    proctitle: str = field(default_factory=_proctitle)
    counters: dict[str, int] = field(default_factory=dict)
    last_step: LastStep | None = None
    last_summary: float = field(default_factory=time.monotonic)
    # False until the first phase request: until then the per-step hooks exit in O(1)
    phases_seen: bool = False
    kept: deferral.KeptSubset = field(default_factory=deferral.KeptSubset)
    # forward_iter -> the deferring step launched as it (rank 0; at most two under overlap)
    planned: dict[int, PlannedStep] = field(default_factory=dict)
    # decode step device times by forward_iter, for the refit (device_time.py); None on CPU
    device_times: device_time.StepDeviceTimes | None = None
    prefill: prefill_hook.PrefillBudget | None = None  # the prefill budget (config.PREFILL_ENV)

    def bump(self, name: str, n: int = 1) -> None:
        self.counters[name] = self.counters.get(name, 0) + n

    def report(self) -> dict[str, Any]:
        rep: dict[str, Any] = {"config": self.config.as_dict(), "pid": self.pid, "proctitle": self.proctitle,
                               "counters": dict(self.counters)}
        ctl = self.controller
        if ctl is not None:
            stats = ctl.stats
            rep["taper"] = {
                "policy": ctl.policy.name, "steps": stats.steps, "planned_steps": stats.planned_steps,
                "unpriced_steps": stats.unpriced_steps, "fit_steps": stats.fit_steps,
                "rows_run": stats.rows_run, "rows_deferred": stats.rows_deferred,
                "candidates": stats.candidates, "admitted": stats.admitted,
                "admission_rate": stats.admission_rate,
                "planner_ms_mean": 1e3 * stats.planner_s / max(stats.planned_steps, 1),
                "last_budget_s": stats.last_budget_s if math.isfinite(stats.last_budget_s) else None,
                "last_predicted_s": stats.last_predicted_s, "bubble_steps": stats.bubble_steps,
                "planner_errors": stats.planner_errors, "terms": dict(stats.terms),
                "model": ctl.policy.model.to_json() if ctl.policy.model is not None else None,
                "graph_batch_sizes": list(getattr(ctl.policy.model, "graph_batch_sizes", ())),
            }
            rep["taper"]["refit"] = self._refit_report()
            rep["taper"]["prefill"] = self.prefill.report() if self.prefill is not None else None
            rep["sizes"] = {"trackers": len(ctl.trackers), "fixed": len(ctl.fixed),  # leak checks (soak)
                            "planned": len(self.planned)}
        return rep

    def _refit_report(self) -> dict[str, Any] | None:
        """What the online refit has taken in: steps, deferring steps, believed price, pending."""
        ctl = self.controller
        refit = ctl.refit if ctl is not None else None
        if refit is None:
            return None
        c_defer, c_deferred = refit.model.deferral()
        last = self.last_step
        book = self.device_times
        return {"steps": refit.steps, "deferring_steps": refit.deferring_steps,
                "price_ms": [1e3 * c_defer, 1e3 * c_deferred],
                "pending_deferring": int(last is not None and last.deferred > 0),
                "latency": book.report() if book is not None else {"source": "launch gap"}}


def state_of(scheduler: Scheduler) -> BranchwiseState | None:
    bw = getattr(scheduler, "branchwise", None)
    return bw.state if bw is not None else None


def _build_controller(cfg: BranchwiseConfig) -> StepController:
    model = load_model(cfg.latency_model) if cfg.latency_model else default_model()
    policy = parse_policy(cfg.branch_policy, model=model, rho=cfg.taper_rho, utility=cfg.taper_utility)
    refit = None
    learn_price = policy.terms.defer_cost  # the refit learns what deferring itself costs (policies.py)
    if policy.model is not None and cfg.latency_model:
        # a calibrated model keeps its slopes; its intercept tracks drift over the last ~1 s
        refit = OnlineRefit(policy.model, window=64, every=16, slopes_fixed=True, deferral=learn_price)
    elif policy.model is not None:
        refit = OnlineRefit(policy.model, deferral=learn_price)
    return StepController(policy, refit)


def build(scheduler: Scheduler, cfg: BranchwiseConfig) -> BranchwiseState:
    """This scheduler's TAPER state (runtime.build calls it first, with the parsed settings)."""
    from sglang.srt.runtime_context import get_parallel

    parallel = get_parallel()
    state = BranchwiseState(config=cfg, tp_rank=parallel.tp_rank, tp_size=parallel.tp_size)
    if cfg.step_controller:  # stock: no controller, SGLang's schedule (phases still counted)
        state.controller = _build_controller(cfg)
        bw = getattr(scheduler, "branchwise", None)  # runtime.build: the emulated device is built first
        device = getattr(bw, "device", None)
        source = device_time.source_of(scheduler, emulated=device is not None)
        if source is not None and state.controller.refit is not None and state.tp_rank == 0:
            state.device_times = device_time.StepDeviceTimes(source)
        model = state.controller.policy.model
        if isinstance(model, LinearLatencyModel):  # T(S) pads decode rows as the device does (none on CPU)
            model.graph_batch_sizes = (device.preset.graph_batch_sizes if device is not None
                                       else device_time.captured_batch_sizes(scheduler) if source else ())
        if cfg.prefill_budget:
            state.prefill = prefill_hook.build(scheduler, cfg, state.controller)
    # branch rows can sit out steps under every policy: pin their penalty tokens (deferral.py)
    if state.controller is not None and scheduler.enable_overlap:
        deferral.pin_penalty_tokens(scheduler)
    if getattr(scheduler.server_args, "enable_metrics", False) and state.tp_rank == 0:
        state.metrics = BranchwiseMetrics(slo_s=cfg.slo_s(None))
    logger.info("%s (pid %d, %s)", cfg.log_line(), os.getpid(), state.proctitle)
    return state


def on_request_created(state: BranchwiseState, req: Req) -> None:
    """Attach custom_params.branchwise as `req.bw_meta` before fork/dp read it; bad input: HTTP 400."""
    state.bump("requests_created")
    try:
        req.bw_meta = request_meta.parse(getattr(req.sampling_params, "custom_params", None))
    except Exception as err:  # nothing a client sends may raise inside the scheduler loop
        req.bw_meta = request_meta.SERIAL
        if isinstance(err, request_meta.MetaError):
            msg = str(err)
        else:  # a parse bug: the request still ends with a 400, the server keeps serving
            msg = f"custom_params not understood ({type(err).__name__})"
            if not state.counters.get("meta_parse_bugs"):
                logger.exception("Branchwise: custom_params parsing raised; such requests get HTTP 400")
            state.bump("meta_parse_bugs")
        if req.to_finish is None:  # keep SGLang's own error if it already rejected the request
            req.set_finish_with_abort(f"Branchwise: {msg}")
        state.bump("bad_requests")
    if req.bw_meta.is_branch:
        state.bump("branch_requests")
        state.phases_seen = True


def note_phase_requests(scheduler: Scheduler) -> None:
    """Server-side fork created branch requests (they bypass _create_generation_req)."""
    state = state_of(scheduler)
    if state is not None:
        state.phases_seen = True


def _has_phase_rows(state: BranchwiseState, reqs: list[Req]) -> bool:
    """Whether a row is in a parallel phase (only then can it be deferred); TP ranks agree."""
    return state.phases_seen and any(request_meta.of(req).phase is not None for req in reqs)


def _key(req: Req) -> str:
    """TAPER's grouping key: one per phase, one per serial request; prefixes keep client ids apart."""
    meta = request_meta.of(req)
    if meta.phase is None:
        return "rid:" + req.rid
    track = getattr(req, "bw_fork", None)
    return ("fork:" if track is not None and track.branch else "phase:") + meta.phase


@dataclass(frozen=True, slots=True)
class RowFields:
    """A request's fixed row fields, kept on `req.bw_row`; rederived when meta, track or config change."""

    meta: request_meta.RequestMeta
    fork: Track | None
    config: BranchwiseConfig
    key: str
    slo_s: float
    weight: float


def _fields(req: Req, cfg: BranchwiseConfig) -> RowFields:
    fields = getattr(req, "bw_row", None)
    meta, fork = request_meta.of(req), getattr(req, "bw_fork", None)
    if fields is None or fields.meta is not meta or fields.fork is not fork or fields.config is not cfg:
        fields = RowFields(meta=meta, fork=fork, config=cfg, key=_key(req), slo_s=cfg.slo_s(meta.slo_tpot_ms),
                           weight=cfg.weight(meta.weight))
        req.bw_row = fields
    return fields


def _row(req: Req, cfg: BranchwiseConfig) -> Row:
    fields = _fields(req, cfg)
    return Row(key=fields.key, order=fields.meta.branch, ctx=req.kv.kv_committed_len, slo_s=fields.slo_s,
               weight=fields.weight, in_phase=fields.meta.is_branch, forced=req.to_finish is not None)


def _pipeline_bubble(scheduler: Scheduler) -> bool:
    """Overlap: after an in-flight prefill the running rows' next token is two steps away; plan for it."""
    last = getattr(scheduler, "last_batch", None)
    if not getattr(scheduler, "enable_overlap", False) or last is None:
        return False
    mode = last.forward_mode
    return bool(mode.is_extend() and not mode.is_mixed())


def _decide(state: BranchwiseState, scheduler: Scheduler, rows: list[Row]) -> list[int]:
    """Rank 0 plans; other TP ranks receive the same active set (never act on their own clocks)."""
    active: list[int] = []
    if state.tp_rank == 0:
        try:
            state.controller.resume_serial_clocks(rows)
            active = state.controller.select(rows, time.monotonic(), _pipeline_bubble(scheduler),
                                             waiting=len(getattr(scheduler, "waiting_queue", ())))
        except Exception:  # noqa: BLE001 - the other ranks wait in the broadcast below
            state.bump("decide_errors")
            if state.counters["decide_errors"] == 1:
                logger.exception("Branchwise: branch admission failed; running every row (logged once)")
            active = list(range(len(rows)))
    if state.tp_size == 1:
        return active
    import torch
    import torch.distributed as dist

    mask = torch.zeros(len(rows), dtype=torch.uint8)
    mask[active] = 1
    dist.broadcast(mask, src=scheduler.tp_group.ranks[0], group=scheduler.tp_cpu_group)
    return mask.nonzero().flatten().tolist()


class Exit(Enum):
    """How a decode step leaves the TAPER driver (`decode_step`)."""

    SERIAL = "serial"  # no row is in a parallel phase: SGLang's own step
    FULL_STEP = "full step"  # a per-step condition (deferral.batch_needs_full_step) runs every row
    ONE_ROW_PER_KEY = "one row per key"  # every request has one live row: nothing to defer
    ALL_ADMITTED = "all admitted"  # the plan runs every row
    NO_FIT = "no fit"  # the subset does not fit the KV pool: SGLang's retract path, every row
    SUBSET = "subset"  # the chosen rows run; the rest wait in the running batch


def around_update_running_batch(orig: Callable[..., ScheduleBatch | None], scheduler: Scheduler,
                                batch: ScheduleBatch) -> ScheduleBatch | None:
    state = state_of(scheduler)
    if state is None or state.controller is None or not state.phases_seen or batch.is_empty():
        return orig(scheduler, batch)  # no phase request yet: nothing to defer
    timer = scheduler.branchwise.timer
    try:
        how, sub = decode_step(state, scheduler, batch, timer)
    finally:
        step_timer.switch(timer, None)
    if how is Exit.SUBSET:
        state.bump("subset_steps")
        return sub
    if state.kept.batch is not None:  # the batch is prepared in full: a kept sub-batch no longer fits it
        state.kept.clear()
    if how is Exit.NO_FIT:
        state.bump("fallback_retract")
    return orig(scheduler, batch)


def decode_step(state: BranchwiseState, scheduler: Scheduler, batch: ScheduleBatch,
                timer: StepTimer | None = None) -> tuple[Exit, ScheduleBatch | None]:
    """The TAPER decode step up to the forward: rows, decision, the subset prepared (Exit.SUBSET)."""
    step_timer.switch(timer, "taper_rows")
    if not _has_phase_rows(state, batch.reqs):
        return Exit.SERIAL, None
    step_timer.tag(timer, "phase_rows")
    if deferral.batch_needs_full_step(batch):
        return Exit.FULL_STEP, None
    finishing = scheduler._reqs_finishing_inflight(batch)
    excluded = set(finishing)
    live = [req for req in batch.reqs if req not in excluded and not req.finished()]
    rows = [_row(req, state.config) for req in live]
    if len({row.key for row in rows}) == len(rows):  # a function of composition: every TP rank agrees
        return Exit.ONE_ROW_PER_KEY, None

    step_timer.switch(timer, "taper_plan")
    planned_s = state.controller.stats.planner_s
    active = _decide(state, scheduler, rows)
    step_timer.carve(timer, "taper_planner", state.controller.stats.planner_s - planned_s)
    if len(active) == len(live):
        return Exit.ALL_ADMITTED, None

    step_timer.switch(timer, "taper_subset")
    sub = deferral.run_subset(scheduler, batch, {live[i] for i in active}, finishing, state.kept)
    if sub is None:
        return Exit.NO_FIT, None
    deferred = len(live) - len(active)
    if state.tp_rank == 0:  # only rank 0 reports steps; run_batch numbers this one forward_ct + 1
        state.planned[scheduler.forward_ct + 1] = PlannedStep(rows=len(sub.reqs), deferred=deferred)
    step_timer.tag(timer, "deferred", deferred)
    return Exit.SUBSET, sub


def _deliveries(state: BranchwiseState, reqs: list[Req]) -> tuple[dict[str, Delivery], int]:
    """Tokens delivered per key this step (one per row that ran), and the context sum."""
    cfg = state.config
    counts: dict[str, list[Any]] = {}  # key -> [rows, the key's first row's fields (its clock's SLO)]
    for req in reqs:
        fields = _fields(req, cfg)
        count = counts.get(fields.key)
        if count is None:
            counts[fields.key] = [1, fields]
        else:
            count[0] += 1
    ctx = sum(map(_KV_LEN, reqs))
    return {key: Delivery(rows, fields.slo_s, fields.meta.is_branch)
            for key, (rows, fields) in counts.items()}, ctx


def _release_finished(state: BranchwiseState, scheduler: Scheduler, reqs: list[Req]) -> None:
    """Keys whose last row finished leave the controller (a reused id must not inherit their clock)."""
    ctl, cfg = state.controller, state.config
    keys = {_fields(req, cfg).key for req in reqs if req.finished()}
    keys = {key for key in keys if key in ctl.trackers or key in ctl.fixed}
    if not keys:
        return
    running = getattr(scheduler, "running_batch", None)
    left = ({_fields(req, cfg).key for req in running.reqs if not req.finished()} if running is not None
            else set())
    ctl.on_finished(keys - left)


def after_process_batch_result(result: object, scheduler: Scheduler, batch: ScheduleBatch,
                               *args: Any, **kwargs: Any) -> object:
    state = state_of(scheduler)
    if state is None:
        return result
    state.bump("batch_results")
    if batch.forward_mode.is_mixed():  # mixed chunked prefill: every decode row ran (no deferral)
        state.bump("mixed_steps")
    if state.controller is None or state.tp_rank != 0 or not batch.forward_mode.is_decode():
        if state.last_step is not None and state.last_step.deferred:
            state.bump("deferring_unmeasured")
        state.last_step = None
        return result
    timer = scheduler.branchwise.timer
    if timer is None:
        report_step(state, scheduler, batch)
        return result
    step_timer.switch(timer, "taper_deliver")
    try:
        report_step(state, scheduler, batch)
    finally:
        step_timer.switch(timer, None)
    return result


def _planned_deferred(state: BranchwiseState, forward_iter: int | None, rows: int) -> int:
    """Rows the step launched as `forward_iter` deferred (0 unless planned); older records leave."""
    planned = state.planned
    if not planned or forward_iter is None:
        return 0
    step = planned.pop(forward_iter, None)
    for old in [it for it in planned if it < forward_iter]:
        del planned[old]
    if step is None:
        return 0
    state.bump("subset_results")
    if step.rows != rows:  # not the batch decode_step planned: never credit a deferral to it
        state.bump("planned_mismatch")
        return 0
    return step.deferred


def report_step(state: BranchwiseState, scheduler: Scheduler, batch: ScheduleBatch) -> None:
    """End of a TAPER decode step (rank 0): deliveries, finished keys leave, the refit books a latency."""
    now = time.monotonic()
    ctl = state.controller
    reqs = batch.reqs
    if _has_phase_rows(state, reqs):
        delivered, ctx = _deliveries(state, reqs)
        ctl.on_phase_step(delivered, now, len(reqs))
        _release_finished(state, scheduler, reqs)
    else:  # serial rows only: their clocks matter only once a phase row joins (resume_serial_clocks)
        ctl.on_quiet_step(now, len(reqs))
        ctx = sum(map(_KV_LEN, reqs))
    forward_iter, launch_ts = getattr(batch, "forward_iter", None), getattr(batch, "launch_ts", None)
    if state.device_times is not None:
        _book_device_time(state, forward_iter, len(reqs), ctx)
    else:
        _book_launch_gap(state, forward_iter, launch_ts, len(reqs), ctx)
    if now - state.last_summary >= SUMMARY_EVERY_S:
        state.last_summary = now
        stats = ctl.stats
        logger.info("Branchwise %s: steps=%d planned=%d deferred_rows=%d admission=%.1f%% "
                    "budget=%.1fms predicted=%.1fms planner=%.3fms", ctl.policy.name, stats.steps,
                    stats.planned_steps, stats.rows_deferred, 100 * stats.admission_rate,
                    1e3 * stats.last_budget_s, 1e3 * stats.last_predicted_s,
                    1e3 * stats.planner_s / max(stats.planned_steps, 1))


def _book_device_time(state: BranchwiseState, forward_iter: int | None, rows: int, ctx: int) -> None:
    """This step's own device time (device_time.py), booked with its rows, context and deferred rows."""
    deferred = _planned_deferred(state, forward_iter, rows)
    latency = state.device_times.take(forward_iter)
    if latency is None:
        state.bump("device_time_missing")
        return
    ctl = state.controller
    ctl.on_latency(rows, ctx, latency, deferred)
    if state.metrics:
        state.metrics.observe_taper(ctl.stats)


def _book_launch_gap(state: BranchwiseState, forward_iter: int | None, launch_ts: float | None, rows: int,
                     ctx: int) -> None:
    """CPU: the gap from the previous decode launch to this one is the previous step's latency."""
    ctl = state.controller
    prev = state.last_step
    if prev is not None and forward_iter is not None and forward_iter == prev.forward_iter + 1:
        latency = launch_ts - prev.launch_ts
        ctl.on_latency(prev.rows, prev.ctx, latency, prev.deferred)
        if state.metrics:
            state.metrics.observe_taper(ctl.stats)
    elif prev is not None and prev.deferred:
        state.bump("deferring_unmeasured")  # the next launch was no decode step: no latency to book
    deferred = _planned_deferred(state, forward_iter, rows)
    state.last_step = (LastStep(forward_iter, launch_ts, rows, ctx, deferred)
                       if forward_iter is not None and launch_ts is not None else None)
