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
from typing import Any

from branchwise import deferral, request_meta
from branchwise.config import BranchwiseConfig
from branchwise.metrics import BranchwiseMetrics
from branchwise.taper.controller import Row, StepController
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
    if policy.model is not None and cfg.latency_model:
        # a calibrated model keeps its slopes; its intercept follows the box's drift and the per-step
        # work a pure-decode calibration does not see (arrivals, streaming), over the last ~1 s of steps
        refit = OnlineRefit(policy.model, window=64, every=16, slopes_fixed=True)
    elif policy.model is not None:
        refit = OnlineRefit(policy.model)
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
    else:
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


def _row(req: Any, cfg: BranchwiseConfig) -> Row:
    m = _meta(req)
    return Row(_key(req), m.branch, req.kv.kv_committed_len, cfg.slo_s(m.slo_tpot_ms), cfg.weight(m.weight),
               m.is_branch, m.fanout, req.to_finish is not None)


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


def around_update_running_batch(orig: Any, self: Any, batch: Any) -> Any:
    st = state_of(self)
    if (st is None or st.controller is None or batch.is_empty() or not _has_phase_rows(st, batch.reqs)
            or deferral.batch_needs_full_step(batch)):
        return orig(self, batch)  # serial rows only: one row per request, nothing to defer
    finishing = self._reqs_finishing_inflight(batch)
    excluded = set(finishing)
    live = [r for r in batch.reqs if r not in excluded and not r.finished()]
    keys = [_key(r) for r in live]
    if len(set(keys)) == len(keys):  # one row per request: nothing to defer (rank-invariant test)
        return orig(self, batch)
    active = _decide(st, self, [_row(r, st.config) for r in live])
    if len(active) == len(live):
        return orig(self, batch)
    sub = deferral.run_subset(self, batch, {live[i] for i in active}, finishing)
    if sub is None:  # the subset does not fit: SGLang's own retract path over the full batch
        st.bump("fallback_retract")
        return orig(self, batch)
    st.bump("subset_steps")
    return sub


def _deliveries(st: BranchwiseState, reqs: list[Any]) -> tuple[dict[str, tuple[int, float, bool]], int]:
    """Tokens delivered per key this step -> (tokens, slo_s, in a phase), and the context sum."""
    cfg = st.config
    delivered: dict[str, tuple[int, float, bool]] = {}
    ctx = 0
    for req in reqs:
        key = _key(req)
        got = delivered.get(key)
        if got is None:
            m = _meta(req)
            delivered[key] = (1, cfg.slo_s(m.slo_tpot_ms), m.is_branch)
        else:
            delivered[key] = (got[0] + 1, got[1], got[2])
        ctx += req.kv.kv_committed_len
    return delivered, ctx


def _release_finished(ctl: StepController, scheduler: Any, reqs: list[Any]) -> None:
    """Keys whose last row finished or was aborted in this step leave the controller (a reused
    phase id or rid must not inherit their clock). Deferred rows stay in the running batch, so a
    key with any unfinished request there keeps its state."""
    keys = {_key(r) for r in reqs if r.finished()}
    keys = {k for k in keys if k in ctl.trackers or k in ctl.fixed}
    if not keys:
        return
    running = getattr(scheduler, "running_batch", None)
    left = {_key(r) for r in running.reqs if not r.finished()} if running is not None else set()
    ctl.on_finished(keys - left)


def _resume_serial_clocks(st: BranchwiseState, rows: list[Row]) -> None:
    """First plan after steps without phase rows, whose bookkeeping was skipped: every serial row
    of those steps delivered a token at the last of them (`quiet_ts`), which is what per-step
    bookkeeping would have recorded. A serial row that joined later (prefill) gets that time too,
    which understates its slack by at most that prefill step (conservative: defers more)."""
    ctl = st.controller
    assert ctl is not None and st.quiet_ts is not None
    fresh = {r.key: (0, r.slo_s, False) for r in rows if not r.phase and r.key not in ctl.trackers}
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
    now = time.monotonic()
    ctl = st.controller
    reqs = batch.reqs
    if _has_phase_rows(st, reqs):
        delivered, ctx = _deliveries(st, reqs)
        ctl.on_step_done(delivered, now, len(reqs))
        st.quiet_ts = None
        _release_finished(ctl, self, reqs)  # quiet steps: serial clocks go below, no phase row left
    else:  # serial rows only: their clocks matter only once a phase row joins (_resume_serial_clocks)
        ctl.on_step_done({}, now, len(reqs))
        if st.quiet_ts is None:
            ctl.forget({k for k, tr in ctl.trackers.items() if tr.in_phase})  # serial clocks go stale
        st.quiet_ts = now
        ctx = sum(map(_KV_LEN, reqs))
    prev = st.last_step
    fi, ts = getattr(batch, "forward_iter", None), getattr(batch, "launch_ts", None)
    if prev is not None and fi is not None and fi == prev.forward_iter + 1:
        # consecutive decode launches: their gap is the realized latency of the previous step
        latency = ts - prev.launch_ts
        ctl.on_latency(prev.rows, prev.ctx, latency)
        if st.metrics:
            st.metrics.observe_step(latency, ctl.stats, st.counters)
    st.last_step = LastStep(fi, ts, len(reqs), ctx) if fi is not None and ts is not None else None
    if now - st.last_summary >= SUMMARY_EVERY_S:
        st.last_summary = now
        s = ctl.stats
        logger.info("Branchwise %s: steps=%d planned=%d deferred_rows=%d admission=%.1f%% "
                    "budget=%.1fms predicted=%.1fms planner=%.3fms", ctl.policy.name, s.steps,
                    s.planned_steps, s.rows_deferred, 100 * s.admission_rate, 1e3 * s.last_budget_s,
                    1e3 * s.last_predicted_s, 1e3 * s.planner_s / max(s.planned_steps, 1))
    return result
