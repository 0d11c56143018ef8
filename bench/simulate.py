"""Discrete-event simulator of continuous-batching decode steps driving the server's TAPER controller.

    python -m bench.simulate --trace CSV --schedule paper-3regime --policies off,cap:2,cap:5,eager,taper \
        --slo-tpot-ms 50 --rho 0.8 --seed 0 --out DIR [--ablations] [--preset multiverse|sprint] \
        [--compress F] [--latency-model model.json] [--trace-outputs] [--max-running sglang|slo|N]

Engine model (SGLang-like, one server, see bench/README.md "Simulator"):
* every step runs all decoding requests' chosen rows plus up to `chunk_tokens` of chunked prefill
  (mixed batch); its latency is the latency model's T(rows, context tokens, prefill tokens) times
  lognormal noise;
* a request is admitted FCFS while the running requests (a live branch is a request, as in SGLang's
  running_batch) are fewer than `max_running` (SGLang's default for the pool unless set) and its
  prompt fits the KV pool below `admit_kv_frac`;
* a parallel phase forks all its branches at once; a branch shares the parent's KV prefix and owns
  only its generated tokens; deferred branches keep their KV; the reduce is free and the parent
  resumes with every branch's tokens in its context; when the pool overflows the newest request is
  retracted (KV freed, recomputed on re-admission);
* the widths come from the server's own `StepController` (taper/controller.py), driven by `HookDriver`
  exactly as overlay/branchwise/scheduler_hook.py drives it: `Row`s for the live rows, `select` only
  when some phase has more than one ready row, deliveries per key after each step (the quiet-step
  rule for batches without phase rows included), realized pure-decode latencies to its refit.

Several steps run in one go when no step in between can differ: no row finishes, no arrival can
be admitted, the pool cannot overflow. For off, cap:K and eager the widths depend on ready-row
counts only, so one `select` serves the window. For slack-driven policies a window also needs: an
arrival cannot fall inside it (a controller input may count the queue), every key already has its
delivery clock, no refit falls inside it, and either no phase has a second ready row (nothing to
plan) or the controller admitted every ready row now and a probe controller sharing its clocks also
admits every row of the window's worst case (contexts of its last step, today's slack; T is
monotone and slack never shrinks while steps stay within the SLO). Step times inside a window are
exact (T grows linearly with context); only the latency noise is drawn once per window.
`macro_steps=False` steps one by one, and the unit tests hold both modes to the same deliveries.
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import os
import sys
import time
from collections import deque
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from bench.metrics import RequestRecord, StageRecord, StepLog, fmt, headline_cells, headline_head, summarize
from bench.workload import PRESETS, RequestSpec, build_schedule, compose, load_trace, workload_stats
from branchwise.taper import (
    POLICY_NAMES,
    LinearLatencyModel,
    OnlineRefit,
    Policy,
    default_model,
    load_model,
    parse_policy,
)
from branchwise.taper.controller import Row, StepController

_BIG = 1 << 62
# Slack-driven policies whose "everything fits" is monotone (budget rho * min slack, T monotone), so
# a window's worst case proves its middle; any other rule steps one by one while it has a choice.
_PROVABLE = {"taper-paper", "taper-no-slack", "taper-const-predictor"} | \
    ({"taper"} if "taper-paper" not in POLICY_NAMES else set())
# SGLang derives --max-running-requests from the KV pool and the model's context length when it is
# unset; the modelled server is Qwen3-32B (max_position_embeddings 40960).
CONTEXT_LEN = 40960


def sglang_max_running(kv_tokens: int, context_len: int = CONTEXT_LEN) -> int:
    """SGLang 0.5.23's running-request limit when --max-running-requests is unset
    (KVCacheConfigurator.resolve_max_num_reqs): pool / context_len * 512 clamped to [2048, 4096],
    at most pool // 2."""
    est = max(min(int(kv_tokens / context_len * 512), 4096), 2048)
    return min(est, kv_tokens // 2)


@dataclass(frozen=True, slots=True)
class EngineConfig:
    slo_s: float = 0.050
    kv_tokens: int = 1_500_000  # KV pool (Qwen3-32B, 8xA100-80GB, ~62% of memory; TAPER D)
    max_running: int = 0  # running requests incl. branches (SGLang --max-running-requests); 0: SGLang's default
    admit_kv_frac: float = 0.9  # admit only while the pool is below this (headroom for decode growth)
    chunk_tokens: int = 8192  # chunked-prefill tokens per step (SGLang default for 80 GB GPUs)
    noise: float = 0.02  # lognormal sigma of realized vs modelled step latency
    drain_s: float = 600.0  # keep stepping this long after the schedule ends
    macro_steps: bool = True  # run provably identical steps in one go (exact; False for checking)

    @property
    def running_cap(self) -> int:
        return self.max_running if self.max_running > 0 else sglang_max_running(self.kv_tokens)


_DEF = EngineConfig()


def build_controller(policy: str, model: LinearLatencyModel, rho: float = 0.8, calibrated: bool = False,
                     **kw) -> StepController:
    """The controller scheduler_hook._build_controller builds: the policy over a copy of the engine's
    model, refit online (a calibrated --latency-model keeps its slopes and refits the intercept over
    the last 64 steps every 16; the default model is fully refit over 200 every 50)."""
    pol = parse_policy(policy, model=LinearLatencyModel(*model.coefs()), rho=rho, **kw)
    if pol.model is None:
        return StepController(pol)
    if calibrated:
        return StepController(pol, OnlineRefit(pol.model, window=64, every=16, slopes_fixed=True))
    return StepController(pol, OnlineRefit(pol.model))


class _Req:
    """Mutable per-request simulation state."""

    __slots__ = (
        "spec", "rid", "key", "pkey", "fan", "prefill_left", "ctx", "saved_ctx", "si", "left", "done",
        "stage_start", "stage_tok", "last_tok", "br_left", "cl", "bi", "phase_start", "phase_tok", "rec",
        "gone_s",
    )

    def __init__(self, spec: RequestSpec) -> None:
        self.spec, self.rid = spec, spec.rid
        self.key = "rid:" + spec.rid  # the hook's grouping key of a serial request
        self.pkey, self.fan = "", 1  # the open phase's key and announced fanout
        self.prefill_left = spec.prompt_tokens
        self.ctx = 0  # parent KV tokens: prompt + serial output + reduced branches
        self.saved_ctx = -1  # >= 0 while re-prefilling after a retraction
        self.si = -1  # stage index; -1 before the first token
        self.left = 0  # tokens left in the serial stage
        self.done = False
        self.stage_start = self.last_tok = 0.0
        self.stage_tok = 0
        # the open phase's unfinished branches, in branch order: tokens left, context length, index
        self.br_left: list[int] = []  # empty outside a phase
        self.cl: list[int] = []
        self.bi: list[int] = []
        self.phase_start, self.phase_tok = 0.0, 0
        self.rec = RequestRecord(spec.rid, spec.arrival_s, decomposable=spec.decomposable)
        self.gone_s = 0.0  # last delivery before a retraction

    @property
    def kv(self) -> int:
        return self.ctx + self.phase_tok if self.br_left else self.ctx


class HookDriver:
    """Drives a StepController the way scheduler_hook.py drives it (around_update_running_batch,
    after_process_batch_result), from simulator requests instead of SGLang Reqs.

    Differences, both forced by the engine model: the simulator's steps may carry a prefill chunk
    (mixed batch) and their decode rows deliver, so every step reports deliveries (the hook hears
    decode steps only, SGLang's default runs prefill in steps of its own); there is no overlap
    scheduling, so `select` never reserves a pipeline bubble."""

    __slots__ = ("ctl", "slo_s", "quiet_ts", "selects", "subset_steps", "takes_waiting")

    def __init__(self, ctl: StepController, slo_s: float) -> None:
        self.ctl, self.slo_s = ctl, slo_s
        self.quiet_ts: float | None = None  # the hook's quiet_ts: last step without phase rows
        self.selects = self.subset_steps = 0
        self.takes_waiting = "waiting" in inspect.signature(ctl.select).parameters

    def rows(self, par: list[_Req], ser: list[_Req], lag: int, grow: int = 0) -> list[Row]:
        """The hook's `_row` for every live row: phase rows request-major in branch order, then serial."""
        slo = self.slo_s
        out = [Row(r.pkey, b, c + grow, slo, 1.0, True, r.fan) for r in par for b, c in zip(r.bi, r.cl, strict=True)]
        out += [Row(r.key, 0, r.ctx + lag + grow, slo) for r in ser]
        return out

    def select(self, rows: list[Row], now: float, waiting: int = 0) -> list[int]:
        """around_update_running_batch + _decide: active row indices (the caller checked that some
        key has two rows); `waiting`: requests queued for admission."""
        ctl = self.ctl
        if self.quiet_ts is not None:  # _resume_serial_clocks
            fresh = {r.key: (0, r.slo_s, False) for r in rows if not r.phase and r.key not in ctl.trackers}
            ctl.on_step_done(fresh, self.quiet_ts, 0)
            self.quiet_ts = None
        self.selects += 1
        active = ctl.select(rows, now, waiting=waiting) if self.takes_waiting else ctl.select(rows, now)
        self.subset_steps += len(active) < len(rows)
        return active

    def forget(self, live: list[_Req]) -> None:
        """Drop the clocks of keys whose rows left the batch (the hook does this every 64 planned
        steps; here at every change of composition, so windowed and single steps agree). A parent
        that resumes after its phase's reduce starts a fresh serial clock either way."""
        keys = {r.pkey if r.br_left else r.key for r in live}
        if len(self.ctl.trackers) > len(keys) or any(k not in keys for k in self.ctl.trackers):
            self.ctl.forget(keys)

    def would_admit_all(self, rows: list[Row], now: float, waiting: int = 0) -> bool:
        """Whether the controller would run every row of `rows` now, without changing it: a probe
        controller over the same policy, the same delivery clocks and a copy of the pins."""
        ctl = self.ctl
        probe = StepController(ctl.policy, None, ctl.trackers, dict(ctl.fixed))
        kw = {"waiting": waiting} if self.takes_waiting else {}
        return len(probe.select(rows, now, **kw)) == len(rows)

    def delivered(self, par: list[_Req], widths: list[int] | None, ser: list[_Req], k: int, t: float,
                  n_rows: int) -> None:
        """after_process_batch_result for k identical steps, the last ending at t."""
        ctl = self.ctl
        if par:
            slo = self.slo_s
            d = {r.key: (k, slo, False) for r in ser}
            if widths is None:
                d.update((r.pkey, (k, slo, True)) for r in par)
            else:
                d.update((r.pkey, (w * k, slo, True)) for r, w in zip(par, widths, strict=True))
            ctl.on_step_done(d, t, n_rows * k)
            self.quiet_ts = None
        else:
            ctl.on_step_done({}, t, n_rows * k)
            if self.quiet_ts is None:  # serial clocks go stale while no phase row runs
                ctl.forget({key for key, tr in ctl.trackers.items() if tr.in_phase})
            self.quiet_ts = t


@dataclass(slots=True)
class SimResult:
    policy: str
    records: list[RequestRecord]
    steps: StepLog
    wall_s: float
    stats: dict = field(default_factory=dict)


class Simulator:
    def __init__(self, specs: list[RequestSpec], controller: StepController | Policy, model: LinearLatencyModel,
                 cfg: EngineConfig, t_end: float, seed: int = 0) -> None:
        self.specs = sorted(specs, key=lambda s: s.arrival_s)
        if not isinstance(controller, StepController):  # a bare policy: the hook's controller around it
            controller = StepController(controller)
        self.ctl, self.model, self.cfg = controller, model, cfg
        self.policy = controller.policy
        self.driver = HookDriver(controller, cfg.slo_s)
        self.t_end = t_end
        # off, cap:K, eager: the plan is a function of ready-row counts (and the model only fills
        # predicted_s), so deliveries and latencies need not reach the controller
        self.static = self.policy.static
        self.provable = self.policy.name in _PROVABLE
        rng = np.random.default_rng(seed + 7919)
        sig = cfg.noise
        self.noise = np.exp(rng.normal(-sig * sig / 2, sig, 1 << 16)).tolist() if sig > 0 else [1.0]
        self.log = StepLog()
        self.slots = self.kv = 0
        self.retractions = 0
        self.dirty = True  # decode set or some request's stage changed: rebuild partitions
        # set to [] to record (start, end, live rows, active rows or None, queued) of every iteration
        self.trace: list[tuple[float, float, list[Row], list[int] | None, int]] | None = None
        self._obs = self._since = 0  # the refit's observation count and count since its last refit

    # ----------------------------------------------------------------------------- stage machine
    def _next_stage(self, r: _Req, t: float) -> None:
        """Open stage r.si + 1 at time t, or finish the request."""
        self.dirty = True
        r.si += 1
        stages = r.spec.stages
        if r.si == len(stages):
            r.done = r.rec.finished = True
            self.slots -= 1
            self.kv -= r.ctx
            return
        st = stages[r.si]
        r.stage_start, r.stage_tok = t, 0
        if isinstance(st, tuple):
            n = len(st)
            r.br_left, r.cl, r.bi = list(st), [r.ctx] * n, list(range(n))
            r.pkey, r.fan = f"phase:{r.rid}.{r.si}", n
            r.phase_start, r.phase_tok = t, 0
            self.slots += n - 1
        else:
            r.left = st
            r.last_tok = t

    def _prefilled(self, r: _Req, t: float) -> None:
        """Prefill done at t: first token (or, after a retraction, resume where it was)."""
        self.dirty = True
        if r.saved_ctx >= 0:
            r.ctx, r.saved_ctx = r.saved_ctx, -1
            gap = t - r.gone_s  # no delivery while retracted (a lower bound: the next step adds to it)
            r.rec.max_gap_s = gap if not r.rec.max_gap_s >= gap else r.rec.max_gap_s
            return
        r.rec.first_token_s = t
        r.ctx += 1
        self.kv += 1
        r.si = 0
        r.stage_start, r.stage_tok, r.last_tok = t, 0, t
        r.left = r.spec.stages[0] - 1
        if r.left == 0:
            self._next_stage(r, t)

    def _close_serial(self, r: _Req, t: float) -> None:
        r.rec.stages.append(StageRecord(False, r.stage_start, t, r.stage_tok))
        self._next_stage(r, t)

    def _advance_phase(self, r: _Req, w: int, k: int, t: float) -> bool:
        """k steps of the first w ready branches of r, the last ending at t; False once it reduced."""
        left, cl = r.br_left, r.cl
        finished = 0
        for j in range(w):
            left[j] -= k
            cl[j] += k
            finished += left[j] == 0
        r.phase_tok += w * k
        r.last_tok = t
        if not finished:
            return True
        self.dirty = True
        keep = [j for j in range(len(left)) if left[j] > 0]
        if keep:
            r.br_left, r.cl, r.bi = [left[j] for j in keep], [cl[j] for j in keep], [r.bi[j] for j in keep]
            self.slots -= finished
            return True
        self.slots -= finished - 1  # the parent keeps one slot after the reduce
        r.rec.stages.append(StageRecord(True, r.phase_start, t, r.phase_tok))
        r.ctx += r.phase_tok  # the reduce: every branch's tokens join the parent's context
        r.br_left, r.cl, r.bi = [], [], []
        self._next_stage(r, t)
        return False

    # ------------------------------------------------------------------------------------ loop
    def _until_refit(self) -> int:
        """Observations until the controller's refit next runs (OnlineRefit's counting rule)."""
        rf = self.ctl.refit
        if rf is None or self.static:
            return _BIG
        return max(rf.every - self._since, rf.min_samples - min(self._obs, rf.window), 1)

    def _observe(self, rows: int, ctx: int, base: float, d: float, f: float, k: int) -> None:
        """Realized latencies of k pure-decode steps (rows fixed, context growing by rows per step)."""
        rf = self.ctl.refit
        if rf is None or self.static:
            return
        for j in range(k):
            self.ctl.on_latency(rows, ctx + j * rows, (base + d * j) * f)
            self._obs += 1
            self._since += 1
            if self._since >= rf.every and min(self._obs, rf.window) >= rf.min_samples:
                self._since = 0

    def run(self) -> SimResult:
        t_wall, t_cpu = time.perf_counter(), time.process_time()
        cfg, m, drv = self.cfg, self.model, self.driver
        c0, cs, cc, ct = m.c0, m.c_seq, m.c_ctx, m.c_tok
        cap, chunk_max = cfg.running_cap, cfg.chunk_tokens
        specs, n_specs, nxt = self.specs, len(self.specs), 0
        wait: deque[_Req] = deque()
        pre: list[_Req] = []
        dec: list[_Req] = []
        ser: list[_Req] = []
        par: list[_Req] = []
        everyone: list[_Req] = []
        noise, nz, nmask = self.noise, 0, len(self.noise) - 1
        kv_admit = cfg.kv_tokens * cfg.admit_kv_frac
        log_add = self.log.add
        static, macro = self.static, cfg.macro_steps
        pinning = getattr(self.policy, "replan", True) is False
        tracing = self.trace is not None
        fresh, wide, ser_ctx, ser_k = True, False, 0, _BIG
        widths: list[int] | None = None
        cached: list[int] | None = None  # a static policy's widths for the current composition
        # serial rows all run every step: while none of them closes its stage they advance lazily, by
        # `lag` tokens since the layout was built (last at t_lag); _catch_up writes it into them
        lag, t_lag = 0, 0.0
        now = 0.0
        while now < self.t_end:
            while nxt < n_specs and specs[nxt].arrival_s <= now:
                r = _Req(specs[nxt])
                wait.append(r)
                everyone.append(r)
                nxt += 1
            while wait and self.slots < cap and self.kv + wait[0].prefill_left <= kv_admit:
                r = wait.popleft()
                pre.append(r)
                self.slots += max(len(r.br_left), 1)
            if self.dirty:  # composition changed: rebuild partitions
                if lag:
                    lag = _catch_up(ser, lag, t_lag)
                dec = [r for r in dec if not r.done]
                ser = [r for r in dec if not r.br_left]
                par = [r for r in dec if r.br_left]
                ser_ctx, ser_k = 0, _BIG
                for r in ser:
                    ser_ctx += r.ctx
                    ser_k = min(ser_k, r.left)
                wide = any(len(r.cl) > 1 for r in par)
                if not static:
                    drv.forget(dec)
                self.dirty, fresh, cached = False, True, None
            if not dec and not pre:
                if nxt >= n_specs:
                    break
                now = max(now, specs[nxt].arrival_s)
                continue
            # chunked prefill rides in this step
            chunk, filled = 0, []
            for r in pre:
                take = min(r.prefill_left, chunk_max - chunk)
                r.prefill_left -= take
                r.ctx += take
                chunk += take
                if r.prefill_left == 0:
                    filled.append(r)
                if chunk >= chunk_max:
                    break
            self.kv += chunk
            # step composition: serial rows always run; the controller sets the phase widths
            rows, ctx, k = len(ser), ser_ctx, ser_k
            elig = adm = 0
            widths, rowlist, active, all_in = None, None, None, True
            if wide:  # otherwise every width is 1 and the hook never calls select
                if cached is not None:
                    widths = cached
                else:
                    rowlist = drv.rows(par, ser, lag)
                    active = drv.select(rowlist, now, len(wait))
                    owner = np.repeat(np.arange(len(par)), [len(r.cl) for r in par])
                    a = np.asarray(active)
                    widths = np.bincount(owner[a[a < len(owner)]], minlength=len(par)).tolist()
                    all_in = len(active) == len(rowlist)
                    if static and not tracing:
                        cached = widths
                need_k = macro
                for r, w in zip(par, widths, strict=True):
                    cl = r.cl
                    elig += len(cl)
                    rows += w
                    if w == 1:
                        ctx += cl[0]
                        if need_k and r.br_left[0] < k:
                            k = r.br_left[0]
                    else:
                        ctx += sum(cl[:w])
                        if need_k:
                            k = min(k, min(r.br_left[:w]))
                adm = rows - len(ser) - len(par)
                elig -= len(par)
            else:
                for r in par:
                    ctx += r.cl[0]
                    k = min(k, r.br_left[0])
                rows += len(par)
            base = c0 + cs * rows + cc * ctx + ct * chunk
            d = cc * rows  # every run row's context grows by one per step
            f = noise[nz]
            nz = (nz + 1) & nmask
            # several steps at once when nothing can change the plan in between (module docstring)
            if k > 1 and macro and not pre and not (wait and self.slots < cap):
                k = min(k, max(1, (cfg.kv_tokens - self.kv) // max(rows, 1)))
                nxt_t = specs[nxt].arrival_s if nxt < n_specs else math.inf
                horizon = self.t_end if (static and wait) or nxt >= n_specs else min(self.t_end, nxt_t)
                k = min(k, _steps_until(base, d, horizon - now))
                if not static:
                    if fresh or pinning and wide:
                        k = 1  # a new key's clock starts at its first step; pins change step by step
                    else:
                        k = min(k, self._until_refit())
                    if k > 1 and wide:
                        fits = all_in and self.provable
                        k = self._all_fit_steps(par, ser, lag, now, k, base, d, f, len(wait)) if fits else 1
            else:
                k = 1
            fresh = False
            total = (k * base + d * k * (k - 1) / 2) * f
            t = now + total
            log_add(now, k, total, (base + d * (k - 1)) * f, elig * k, adm * k)
            if tracing:
                self.trace.append((now, t, rowlist or drv.rows(par, ser, lag), active, len(wait)))
            if not static:
                drv.delivered(par, widths, ser, k, t, rows)
                if chunk == 0:
                    self._observe(rows, ctx, base, d, f, k)
            self.kv += rows * k
            # advance every row k tokens; a request whose rows change (a branch ends, a stage
            # closes) sets dirty, and the partitions are rebuilt
            if k < ser_k:  # no serial stage closes: move the serial rows on lazily
                lag, t_lag = lag + k, t
                ser_ctx += k * len(ser)
                if ser:
                    ser_k -= k
            else:
                kk, lag = k + lag, 0
                ser_ctx, ser_k = 0, _BIG
                for r in ser:
                    r.stage_tok += kk
                    r.last_tok = t
                    left = r.left = r.left - kk
                    c = r.ctx = r.ctx + kk
                    if left == 0:
                        self._close_serial(r, t)
                        continue
                    ser_ctx += c
                    if left < ser_k:
                        ser_k = left
            for j, r in enumerate(par):
                w = widths[j] if widths else 1
                left = r.br_left
                if w == 1 and left[0] > k:  # the common case, inlined: no branch ends
                    left[0] -= k
                    r.cl[0] += k
                    r.phase_tok += k
                    r.last_tok = t
                else:
                    self._advance_phase(r, w, k, t)
            for r in filled:
                self._prefilled(r, t)
                dec.append(r)
            if filled:
                pre = [r for r in pre if r.prefill_left > 0]
            now = t
            if self.kv > cfg.kv_tokens:
                if lag:
                    lag = _catch_up(ser, lag, t_lag)
                self._retract(dec, wait)
        if lag:
            _catch_up(ser, lag, t_lag)
        ctl = self.ctl
        stats = {"retractions": self.retractions, "unadmitted": len(wait) + (n_specs - nxt),
                 "iterations": len(self.log.t_s), "selects": drv.selects, "subset_steps": drv.subset_steps,
                 "max_running": cap, "wall_s": time.perf_counter() - t_wall,
                 "cpu_s": time.process_time() - t_cpu}
        if ctl.refit is not None and not static:
            stats["refits"] = ctl.refit.refits
            pm = self.policy.model
            stats["model_after"] = list(pm.coefs()) if hasattr(pm, "coefs") else pm.value_s
        recs = [r.rec for r in everyone]
        set_max_gaps(recs, self.log, now)
        return SimResult(self.policy.name, recs, self.log, stats["wall_s"], stats)

    def _all_fit_steps(self, par: list[_Req], ser: list[_Req], lag: int, now: float, k: int, base: float,
                       d: float, f: float, waiting: int) -> int:
        """k if the controller provably admits every ready row in each of the next k steps, else 1.

        It admitted everything now; the probe asks whether it admits everything on the window's worst
        case (contexts of step k, today's slack). T is monotone in context and slack never shrinks
        inside the window (serial rows deliver every step; a phase gains >= slo - T per step, so we
        need every step within the SLO), so each step in between has a cheaper composition and at
        least this budget, and "everything fits" holds for it too."""
        slo = self.cfg.slo_s
        if (base + d * (k - 1)) * f > slo:  # keep every step within the SLO
            k = int((slo / f - base) / d) + 1 if d > 0 and base * f <= slo else 1
            if k <= 1:
                return 1
        return k if self.driver.would_admit_all(self.driver.rows(par, ser, lag, k - 1), now, waiting) else 1

    def _retract(self, dec: list[_Req], wait: deque[_Req]) -> None:
        """Free the newest requests' KV until the pool fits; they re-prefill what they held."""
        live = [r for r in dec if not r.done]
        while self.kv > self.cfg.kv_tokens and len(live) > 1:
            r = live.pop()
            dec.remove(r)
            self.retractions += 1
            r.gone_s = r.last_tok
            kv = r.kv
            self.kv -= kv
            self.slots -= max(len(r.br_left), 1)
            r.prefill_left, r.saved_ctx, r.ctx = kv, r.ctx, 0
            wait.appendleft(r)
        self.dirty = True


def set_max_gaps(recs: list[RequestRecord], log: StepLog, t_end: float) -> None:
    """Each request's largest delivery gap (metrics.RequestRecord.max_gap_s): every decoding request
    gets a token from every step (its serial row or its phase's protected row), so it is the longest
    step that started between its first token and its last, or a retraction gap set on the way."""
    t = np.asarray(log.t_s, float)
    mx = np.append(np.asarray(log.max_latency_s, float), 0.0)
    if not len(recs):
        return
    first = np.array([r.first_token_s for r in recs], float)
    last = np.array([r.stages[-1].end_s if r.stages else r.first_token_s for r in recs], float)
    last = np.where([r.finished for r in recs], last, t_end)
    lo = np.searchsorted(t, np.nan_to_num(first, nan=np.inf), side="left")
    hi = np.searchsorted(t, last, side="left")
    idx = np.empty(2 * len(recs), np.int64)
    idx[0::2], idx[1::2] = np.minimum(lo, len(t)), np.minimum(hi, len(t))
    step_max = np.maximum.reduceat(mx, idx)[0::2]
    for r, a, b, g in zip(recs, lo, hi, step_max.tolist(), strict=True):
        if r.first_token_s != r.first_token_s:
            continue
        g = g if b > a else 0.0
        r.max_gap_s = g if not r.max_gap_s >= g else r.max_gap_s


def _catch_up(ser: list[_Req], lag: int, t: float) -> int:
    """Write `lag` tokens, the last delivered at t, into serial requests that advanced lazily; 0."""
    for r in ser:
        r.stage_tok += lag
        r.last_tok = t
        r.left -= lag
        r.ctx += lag
    return 0


def _steps_until(base: float, d: float, span: float) -> int:
    """Fewest steps (>= 1) whose summed latency base, base+d, ... reaches span."""
    if span <= base:
        return 1
    if d <= 0:
        return max(1, math.ceil(span / base))
    # k*base + d*k*(k-1)/2 >= span
    b = base - d / 2
    return max(1, math.ceil((-b + math.sqrt(b * b + 2 * d * span)) / d))


# ---------------------------------------------------------------------------------------- driver


def slo_sized_cap(model: LinearLatencyModel, slo_s: float, specs: list[RequestSpec]) -> int:
    """The operator's sizing rule for --max-running-requests: the most sequences whose step, each at
    a finished request's context (mean prompt + mean output), still meets the TPOT SLO."""
    ctx = np.mean([s.prompt_tokens + s.output_tokens for s in specs]) if specs else 0.0
    per_row = model.c_seq + model.c_ctx * ctx
    return max(1, int((slo_s - model.c0) / per_row)) if per_row > 0 else 1 << 20


def resolve_max_running(spec: str, model: LinearLatencyModel, slo_s: float, specs: list[RequestSpec]) -> int:
    """--max-running: `sglang` (0: SGLang's default for the pool), `slo` (the SLO-sized sensitivity
    cap) or an integer."""
    if spec == "sglang":
        return 0
    if spec == "slo":
        return slo_sized_cap(model, slo_s, specs)
    try:
        n = int(spec)
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError(f"--max-running must be sglang, slo or an integer >= 1, got {spec!r}")
    return n


@dataclass(frozen=True, slots=True)
class Job:
    key: str  # name in results.json
    policy: str
    rho: float
    calibrated: bool = False  # the latency model came from --latency-model (the hook's refit differs)


def _run_job(job: Job, specs: list[RequestSpec], model: LinearLatencyModel, cfg: EngineConfig,
             duration: float, seed: int) -> SimResult:
    ctl = build_controller(job.policy, model, job.rho, job.calibrated)
    res = Simulator(specs, ctl, model, cfg, duration + cfg.drain_s, seed).run()
    res.policy = job.key
    return res


def run_jobs(jobs: list[Job], specs: list[RequestSpec], model: LinearLatencyModel, cfg: EngineConfig,
             duration: float, seed: int, workers: int = 1) -> dict[str, SimResult]:
    # slowest first: per-step policies dominate the wall time
    order = sorted(jobs, key=lambda j: not j.policy.startswith("taper"))
    if workers <= 1 or len(jobs) == 1:
        done = {j.key: _run_job(j, specs, model, cfg, duration, seed) for j in order}
    else:
        with ProcessPoolExecutor(workers) as ex:
            futs = {j.key: ex.submit(_run_job, j, specs, model, cfg, duration, seed) for j in order}
            done = {k: f.result() for k, f in futs.items()}
    return {j.key: done[j.key] for j in jobs}


def job_list(policies: list[str], rho: float, ablations: bool, calibrated: bool = False) -> list[Job]:
    jobs = [Job(p, p, rho, calibrated) for p in policies]
    if ablations:
        names = {j.key for j in jobs}
        abl = ("taper-no-mean", "taper-no-overload", "taper-no-backlog", "taper-no-slack", "taper-no-replan",
               "taper-const-predictor")
        jobs += [Job(p, p, rho, calibrated) for p in abl if p in POLICY_NAMES and p not in names]
        jobs += [Job(f"taper(rho={r:g})", "taper", r, calibrated) for r in (0.5, 0.8, 1.0) if r != rho]
    return jobs


def _n(x: float | None) -> str:
    """A number in a table cell: one decimal below 100, none above."""
    return fmt(x, nd=1 if x is None or abs(x) < 100 else 0)


def table(results: dict[str, dict], baseline: str = "off") -> str:
    """One row per policy: attainment over all arrivals, finished fraction and P99 TTFT first."""
    base = results.get(baseline, {}).get("goodput_tok_s")
    head = (f"{'policy':<24}{'goodput':>9}{'x off':>7}{headline_head()}{'att-high':>9}{'att-gap':>8}"
            f"{'raw tok/s':>10}{'P99 ser':>9}{'P99 par':>9}{'P99 gap':>9}{'step ms':>8}{'admit':>7}")
    lines = [head, "-" * len(head)]
    for k, r in results.items():
        hi = r.get("per_regime", {}).get("high", {})
        ratio = r["goodput_tok_s"] / base if base else None
        lines.append(
            f"{k:<24}{fmt(r['goodput_tok_s']):>9}{fmt(ratio, nd=2):>7}{headline_cells(r)}"
            f"{fmt(hi.get('slo_attainment'), True):>9}{fmt(r.get('slo_attainment_gap'), True):>8}"
            f"{fmt(r['raw_throughput_tok_s']):>10}{_n(r['p99_tpot_serial_ms']):>9}"
            f"{_n(r['p99_tpot_parallel_ms']):>9}{_n(r.get('max_gap_p99_ms')):>9}"
            f"{fmt(r.get('step_latency_mean_ms')):>8}{fmt(r.get('admission_rate'), True, 0):>7}")
    return "\n".join(lines)


def regime_table(results: dict[str, dict]) -> str:
    regimes = [g for g in ("low", "high", "moderate") if any(g in r["per_regime"] for r in results.values())]
    if not regimes:
        return ""
    cols = ("step", "att", "done", "TTFT99", "adm")
    head = f"{'policy':<24}" + "".join(f"{g[:4] + ' ' + c:>12}" for g in regimes for c in cols)
    lines = [head, "-" * len(head)]
    for k, r in results.items():
        cells = ""
        for g in regimes:
            x = r["per_regime"].get(g, {})
            cells += f"{fmt(x.get('step_latency_mean_ms')):>12}{fmt(x.get('slo_attainment'), True):>12}"
            cells += f"{fmt(x.get('finished_frac'), True):>12}{_n(x.get('ttft_p99_s')):>12}"
            cells += f"{fmt(x.get('admission_rate'), True, 0):>12}"
        lines.append(f"{k:<24}{cells}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.simulate", description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", required=True)
    ap.add_argument("--schedule", default="paper-3regime", help="unscaled | rate:X | paper-3regime")
    ap.add_argument("--policies", default="off,cap:2,cap:5,eager,taper")
    ap.add_argument("--slo-tpot-ms", type=float, default=50.0)
    ap.add_argument("--slo-ttft-s", type=float, default=None,
                    help="TTFT target that attainment and goodput also require (default: none)")
    ap.add_argument("--rho", type=float, default=0.8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True)
    ap.add_argument("--latency-model", help="JSON latency model (predictor.py format); default: calibrated")
    ap.add_argument("--ablations", action="store_true",
                    help="add taper's terms off one at a time (no-mean, no-overload, no-backlog), the paper's "
                         "ablations (no-slack, no-replan, const-predictor) and taper at rho 0.5 / 1.0")
    ap.add_argument("--preset", default="multiverse", choices=sorted(PRESETS))
    ap.add_argument("--compress", type=float, default=1.0, help="run F times shorter at the same load")
    ap.add_argument("--trace-outputs", action="store_true", help="output lengths from the trace")
    ap.add_argument("--max-running", default="sglang",
                    help="running-request limit (branches count): sglang (SGLang's default for the pool), "
                         "slo (sensitivity: the largest batch whose T stays within the SLO) or N")
    ap.add_argument("--kv-tokens", type=int, default=_DEF.kv_tokens)
    ap.add_argument("--chunk-tokens", type=int, default=_DEF.chunk_tokens)
    ap.add_argument("--noise", type=float, default=_DEF.noise)
    ap.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1))
    ap.add_argument("--no-plots", action="store_true")
    a = ap.parse_args(argv)

    t0 = time.perf_counter()
    try:
        trace = load_trace(a.trace)
        model = load_model(a.latency_model) if a.latency_model else default_model()
        sched = build_schedule(trace, a.schedule, a.compress)
        policies = [p.strip() for p in a.policies.split(",") if p.strip()]
        for p in policies:
            parse_policy(p)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not isinstance(model, LinearLatencyModel):
        print("error: the engine needs a linear latency model", file=sys.stderr)
        return 2
    specs = compose(trace, sched, a.preset, a.seed, trace_outputs=a.trace_outputs)
    phase_s = {"workload": time.perf_counter() - t0}
    slo_s = a.slo_tpot_ms / 1e3
    try:
        cap = resolve_max_running(a.max_running, model, slo_s, specs)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    cfg = EngineConfig(slo_s=slo_s, max_running=cap, kv_tokens=a.kv_tokens,
                       chunk_tokens=a.chunk_tokens, noise=a.noise, drain_s=600.0 / a.compress)
    jobs = job_list(policies, a.rho, a.ablations, calibrated=bool(a.latency_model))
    sims = run_jobs(jobs, specs, model, cfg, sched.duration_s, a.seed, a.jobs)
    phase_s["simulate"] = time.perf_counter() - t0 - sum(phase_s.values())
    window = (0.0, sched.duration_s)
    regimes = [(g.name, g.start_s, g.end_s) for g in sched.regimes]
    horizon = sched.duration_s + cfg.drain_s
    results = {k: summarize(s.records, cfg.slo_s, window, regimes, s.steps, a.slo_ttft_s, horizon)
               | {"sim": s.stats} for k, s in sims.items()}
    phase_s["metrics"] = time.perf_counter() - t0 - sum(phase_s.values())
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    doc = {
        "policies": results,
        "config": {
            "trace": a.trace, "schedule": a.schedule, "compress": a.compress, "preset": a.preset,
            "trace_outputs": a.trace_outputs, "seed": a.seed, "rho": a.rho, "slo_ttft_s": a.slo_ttft_s,
            "engine": asdict(cfg),
            "latency_model": dict(zip(("c0", "c_seq", "c_ctx", "c_tok"), model.coefs(), strict=True)),
            "workload": workload_stats(specs), "duration_s": sched.duration_s,
        },
        "phase_s": phase_s,
    }
    if not a.no_plots:
        from bench.plots import plot_run

        plot_run(sims, sched, cfg.slo_s, out)
        phase_s["plots"] = time.perf_counter() - t0 - sum(phase_s.values())
    doc["wall_s"] = time.perf_counter() - t0
    (out / "results.json").write_text(json.dumps(doc, indent=1))
    print(table(results))
    print()
    print(regime_table(results))
    print(f"\n{len(specs)} requests, {sched.duration_s / 60:.0f} min simulated, wall {time.perf_counter() - t0:.1f}s"
          f" -> {out / 'results.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
