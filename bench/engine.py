"""The simulator's engine: continuous-batching decode steps driving the server's TAPER controller.

Engine model (SGLang-like, one server):
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

`Simulator.run` is one loop: arrivals, admission, the partition into serial and phase rows (rebuilt
only when some request's rows changed), the step's composition (`_compose`), how many identical steps
run at once (`_window`), and running them (`_execute`). Several steps run in one go when no step in
between can differ: no row finishes, no arrival can be admitted, the pool cannot overflow. For off,
cap:K and eager the widths depend on ready-row counts only, so one `select` serves the window. For
slack-driven policies a window also needs: an arrival cannot fall inside it (a controller input may
count the queue), every key already has its delivery clock, no refit falls inside it, and either no
phase has a second ready row (nothing to plan) or the controller admitted every ready row now and a
probe controller sharing its clocks also admits every row of the window's worst case (contexts of its
last step, today's slack; T is monotone and slack never shrinks while steps stay within the SLO).
Step times inside a window are exact (T grows linearly with context); only the latency noise is drawn
once per window. `macro_steps=False` steps one by one, and the unit tests hold both modes to the same
deliveries.
"""

from __future__ import annotations

import heapq
import math
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from bench.metrics import RequestRecord, StageRecord, StepLog
from bench.workload import RequestSpec
from branchwise.taper import POLICY_NAMES, LinearLatencyModel, OnlineRefit, Policy, parse_policy
from branchwise.taper.controller import Delivery, Row, StepController

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
class Cost:
    """Host time of one event: fixed_s + row_s x the rows it concerns (seconds)."""

    fixed_s: float = 0.0
    row_s: float = 0.0

    def __call__(self, rows: int) -> float:
        return self.fixed_s + self.row_s * rows

    def __bool__(self) -> bool:
        return bool(self.fixed_s or self.row_s)


@dataclass(frozen=True, slots=True)
class HostCosts:
    """Scheduler-side time per step that the latency model does not hold (all 0: the default regime).

    A probed T(S) (bench.probe: serial streams, no phases) already holds SGLang's own per-step work
    at the probe's batches; these are what a live workload and Branchwise add to it. Each is charged
    to the step it happens in, so every row of that step waits for it."""

    step: Cost = Cost()  # every decode step, rows = rows run (output processing, other processes)
    plan: Cost = Cost()  # a decode step whose widths a budget rule planned, rows = live rows (snapshot, plan)
    subset: Cost = Cost()  # a step that defers rows, its active set changed since the last step; rows = deferred
    same_subset: Cost = Cost()  # a step that defers rows with the last step's active set; rows = deferred
    prefill: Cost = Cost()  # a prefill forward beyond T(0, 0, tokens), rows = its requests (arrivals, branches, joins)


@dataclass(frozen=True, slots=True)
class EngineConfig:
    slo_s: float = 0.050
    kv_tokens: int = 1_500_000  # KV pool (Qwen3-32B, 8xA100-80GB, ~62% of memory; TAPER D)
    max_running: int = 0  # running requests incl. branches (SGLang --max-running-requests); 0: SGLang's default
    context_len: int = CONTEXT_LEN  # the served model's context length (SGLang's default limit uses it)
    admit_kv_frac: float = 0.9  # admit only while the pool is below this (headroom for decode growth)
    chunk_tokens: int = 8192  # chunked-prefill tokens per step (SGLang default for 80 GB GPUs)
    noise: float = 0.02  # lognormal sigma of realized vs modelled step latency
    drain_s: float = 600.0  # keep stepping this long after the schedule ends
    macro_steps: bool = True  # run provably identical steps in one go (exact; False for checking)
    # False: prefill chunks ride in decode steps (mixed batches). True: a prefill runs as a forward of
    # its own before the next decode step, as SGLang does by default: T(requests, 0, tokens).
    prefill_steps: bool = False
    # True: programs are client-side fork/join (bench.client, the live sweep's): a phase's branches
    # and the join after it are new requests sent by the client client_gap_s after the stage that
    # precedes them; a branch prefills its 2-token header on the cached prefix, the join the tokens
    # that are not in the radix cache (every branch but the first, headers, the separator).
    client_programs: bool = False
    client_gap_s: float = 0.0
    host: HostCosts = HostCosts()

    @property
    def running_cap(self) -> int:
        return self.max_running if self.max_running > 0 else sglang_max_running(self.kv_tokens, self.context_len)


_DEF = EngineConfig()
HEADER = 2  # tokens that open a client-side branch (bench.programs.branch_head)


def build_controller(policy: str, model: LinearLatencyModel, rho: float = 0.8, calibrated: bool = False,
                     **kw) -> StepController:
    """The controller scheduler_hook._build_controller builds: the policy over a copy of the engine's
    model, refit online (a calibrated --latency-model keeps its slopes and refits the intercept over
    the last 64 steps every 16; the default model is fully refit over 200 every 50)."""
    pol = parse_policy(policy, model=LinearLatencyModel(*model.coefs()), rho=rho, **kw)
    if pol.model is None:
        return StepController(pol)
    learn = pol.terms.defer_cost  # the policy prices deferral: the refit learns its price
    if calibrated:
        return StepController(pol, OnlineRefit(pol.model, window=64, every=16, slopes_fixed=True, deferral=learn))
    return StepController(pol, OnlineRefit(pol.model, deferral=learn))


class _Req:
    """Mutable per-request simulation state."""

    __slots__ = (
        "spec", "rid", "key", "phase_key", "fanout", "prefill_left", "ctx", "saved_ctx", "stage", "serial_left",
        "done", "stage_start", "stage_tok", "last_tok", "branch_left", "branch_ctx", "branch_index", "phase_start",
        "phase_tok", "record", "gone_s", "phase_extra", "prefill_kind", "prefill_reqs", "gated",
    )

    def __init__(self, spec: RequestSpec) -> None:
        self.spec, self.rid = spec, spec.rid
        self.key = "rid:" + spec.rid  # the hook's grouping key of a serial request
        self.phase_key, self.fanout = "", 1  # the open phase's key and announced fanout
        self.prefill_left = spec.prompt_tokens
        self.ctx = 0  # parent KV tokens: prompt + serial output + reduced branches
        self.saved_ctx = -1  # >= 0 while re-prefilling after a retraction
        self.stage = -1  # stage index; -1 before the first token
        self.serial_left = 0  # tokens left in the serial stage
        self.done = False
        self.stage_start = self.last_tok = 0.0
        self.stage_tok = 0
        # the open phase's unfinished branches, in branch order: tokens left, context length, index
        self.branch_left: list[int] = []  # empty outside a phase
        self.branch_ctx: list[int] = []
        self.branch_index: list[int] = []
        self.phase_start, self.phase_tok = 0.0, 0
        self.record = RequestRecord(spec.rid, spec.arrival_s, decomposable=spec.decomposable)
        self.gone_s = 0.0  # last delivery before a retraction
        self.phase_extra = 0  # KV of the open phase beyond its tokens: client-side branch headers
        # what the pending prefill is: "prompt" (the arrival), "fork" (a client phase's branch
        # headers, one request per branch) or "join" (a client join: compute only, its KV is the
        # branches'); a retracted request re-prefills what it held (saved_ctx >= 0) whatever this says
        self.prefill_kind = "prompt"
        self.prefill_reqs = 1  # SGLang requests the pending prefill stands for
        self.gated = False  # between a client's stages: from a stage's end until the next request's prefill

    @property
    def kv(self) -> int:
        return self.ctx + self.phase_tok + self.phase_extra if self.branch_left else self.ctx


class HookDriver:
    """Drives a StepController the way scheduler_hook.py drives it (around_update_running_batch,
    after_process_batch_result), from simulator requests instead of SGLang Reqs.

    Differences, both forced by the engine model: the simulator's steps may carry a prefill chunk
    (mixed batch) and their decode rows deliver, so every step reports deliveries (the hook hears
    decode steps only, SGLang's default runs prefill in steps of its own); there is no overlap
    scheduling, so `select` never reserves a pipeline bubble."""

    __slots__ = ("ctl", "slo_s", "quiet_ts", "selects", "subset_steps")

    def __init__(self, ctl: StepController, slo_s: float) -> None:
        self.ctl, self.slo_s = ctl, slo_s
        self.quiet_ts: float | None = None  # the hook's quiet_ts: last step without phase rows
        self.selects = self.subset_steps = 0

    def rows(self, par: list[_Req], ser: list[_Req], lag: int, grow: int = 0) -> list[Row]:
        """The hook's `_row` for every live row: phase rows request-major in branch order, then serial."""
        slo = self.slo_s
        out = [Row(key=req.phase_key, order=b, ctx=c + grow, slo_s=slo, phase=True)
               for req in par for b, c in zip(req.branch_index, req.branch_ctx, strict=True)]
        out += [Row(key=req.key, ctx=req.ctx + lag + grow, slo_s=slo) for req in ser]
        return out

    def select(self, rows: list[Row], now: float, waiting: int = 0) -> list[int]:
        """around_update_running_batch + _decide: active row indices (the caller checked that some
        key has two rows); `waiting`: requests queued for admission."""
        ctl = self.ctl
        if self.quiet_ts is not None:  # _resume_serial_clocks
            fresh = {row.key: Delivery(0, row.slo_s, False) for row in rows
                     if not row.phase and row.key not in ctl.trackers}
            ctl.on_step_done(fresh, self.quiet_ts, 0)
            self.quiet_ts = None
        self.selects += 1
        active = ctl.select(rows, now, waiting=waiting)
        self.subset_steps += len(active) < len(rows)
        return active

    def forget(self, live: list[_Req]) -> None:
        """Drop the clocks of keys whose rows left the batch (the hook does this every 64 planned
        steps; here at every change of composition, so windowed and single steps agree). A parent
        that resumes after its phase's reduce starts a fresh serial clock either way."""
        keys = {req.phase_key if req.branch_left else req.key for req in live}
        if len(self.ctl.trackers) > len(keys) or any(k not in keys for k in self.ctl.trackers):
            self.ctl.forget(keys)

    def would_admit_all(self, rows: list[Row], now: float, waiting: int = 0) -> bool:
        """Whether the controller would run every row of `rows` now, without changing it: a probe
        controller over the same policy, the same delivery clocks and a copy of the pins."""
        ctl = self.ctl
        probe = StepController(ctl.policy, None, ctl.trackers, dict(ctl.fixed))
        return len(probe.select(rows, now, waiting=waiting)) == len(rows)

    def delivered(self, par: list[_Req], widths: list[int] | None, ser: list[_Req], k: int, t: float,
                  n_rows: int) -> None:
        """after_process_batch_result for k identical steps, the last ending at t."""
        ctl = self.ctl
        if par:
            slo = self.slo_s
            deliveries = {req.key: Delivery(k, slo, False) for req in ser}
            if widths is None:
                deliveries.update((req.phase_key, Delivery(k, slo, True)) for req in par)
            else:
                deliveries.update((req.phase_key, Delivery(w * k, slo, True))
                                  for req, w in zip(par, widths, strict=True))
            ctl.on_step_done(deliveries, t, n_rows * k)
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


@dataclass(slots=True)
class _Step:
    """One iteration: k identical steps of `rows` rows over `ctx` context tokens (the first one also
    prefills `chunk` tokens); latency (base + growth * j) * noise for the j-th of them."""

    chunk: int
    filled: list[_Req]  # requests whose prefill this step completes
    rows: int
    ctx: int
    k: int  # steps until some row ends its stage (then cut by `_window`)
    widths: list[int] | None = None  # rows run per phase; None: one each (no choice)
    eligible: int = 0  # opportunistic rows offered to the controller
    admitted: int = 0  # ... and run
    row_list: list[Row] | None = None  # the rows the controller saw, and the indices it ran
    active: list[int] | None = None
    all_in: bool = True
    base: float = 0.0
    growth: float = 0.0
    noise: float = 1.0
    first_extra: float = 0.0  # host time only the first of the k steps pays (its active set changed)
    prefill_only: bool = False  # a prefill forward of its own (EngineConfig.prefill_steps)
    host: float = 0.0  # host seconds in `base` (HostCosts)
    subset: bool = False  # some live row is deferred (set only where HostCosts charge for it)
    changed: bool = False  # ... and the active set differs from the last step's


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
        self.running_cap = cfg.running_cap
        self.kv_admit = cfg.kv_tokens * cfg.admit_kv_frac
        self.pinning = getattr(self.policy, "replan", True) is False  # pins change step by step
        self.noise_at = 0
        # where every request is: queued, prefilling, decoding (split into serial and phase rows)
        self.now = 0.0
        self.next_arrival = 0  # index into specs of the next request to arrive
        self.everyone: list[_Req] = []
        self.waiting: deque[_Req] = deque()
        self.prefilling: list[_Req] = []
        self.decoding: list[_Req] = []
        self.serial: list[_Req] = []
        self.phased: list[_Req] = []
        self.wide = False  # some phase has a second ready row: the controller chooses widths
        self.fresh = True  # the partition was just rebuilt: a new key's clock starts at its first step
        self.cached_widths: list[int] | None = None  # a static policy's widths for this partition
        # serial rows all run every step: while none of them closes its stage they advance lazily,
        # by `lag` tokens since the partition was built (the last at lag_t); _catch_up writes them
        self.lag, self.lag_t = 0, 0.0
        self.serial_ctx = 0  # context tokens over the serial rows, lag included
        self.serial_steps = _BIG  # steps until the first serial row closes its stage
        # client-side programs: (time the next request reaches the server, seq, request)
        self.gated: list[tuple[float, int, _Req]] = []
        self.gate_seq = 0
        self.gen = 0  # partition generation: the active set can only be the same within one
        self.last_subset: tuple[int, tuple[int, ...] | None] | None = None  # the last step's subset, if any
        self.host = cfg.host
        self.tally = {"decode_steps": 0, "decode_s": 0.0, "rows_run": 0, "rows_deferred": 0,
                      "prefill_steps": 0, "prefill_s": 0.0, "host_s": 0.0, "subset_steps": 0,
                      "changed_subsets": 0}

    # ----------------------------------------------------------------------------- stage machine
    def _next_stage(self, req: _Req, t: float) -> None:
        """Open stage req.stage + 1 at time t, or finish the request. Client-side programs: the
        request that ran the stage ends here and the client sends the next one (`_gate`)."""
        self.dirty = True
        req.stage += 1
        stages = req.spec.stages
        client = self.cfg.client_programs
        if client:
            self.slots -= 1  # the stage's request (a phase's last branch) ends
        if req.stage == len(stages):
            req.done = req.record.finished = True
            if not client:
                self.slots -= 1
            self.kv -= req.ctx
            return
        stage = stages[req.stage]
        req.stage_start, req.stage_tok = t, 0
        if isinstance(stage, tuple):
            n = len(stage)
            req.branch_left, req.branch_ctx, req.branch_index = list(stage), [req.ctx] * n, list(range(n))
            req.phase_key, req.fanout = f"phase:{req.rid}.{req.stage}", n
            req.phase_start, req.phase_tok = t, 0
            if client:
                req.branch_ctx, req.phase_extra = [req.ctx + HEADER] * n, HEADER * n
                self._gate(req, "fork", HEADER * n, t)
            else:
                self.slots += n - 1
        else:
            req.serial_left = stage
            req.last_tok = t
            if client:  # the join: every branch but the first is new to the radix cache, and a separator
                self._gate(req, "join", sum(HEADER + b for b in stages[req.stage - 1][1:]) + 1, t)

    def _prefilled(self, req: _Req, t: float) -> bool:
        """Prefill done at t: first token (or, after a retraction, resume where it was); a client
        fork's branches get their first tokens, a client join the first token of its stage. True
        while the request decodes on."""
        self.dirty = True
        if req.saved_ctx >= 0:
            req.ctx, req.saved_ctx = req.saved_ctx, -1
            gap = t - req.gone_s  # no delivery while retracted (a lower bound: the next step adds to it)
            req.record.max_gap_s = gap if not req.record.max_gap_s >= gap else req.record.max_gap_s
            return True
        kind, req.prefill_kind, req.prefill_reqs, req.gated = req.prefill_kind, "prompt", 1, False
        if kind == "fork":
            self.kv += len(req.branch_left)
            self._advance_phase(req, len(req.branch_left), 1, t)
            return not (req.done or req.gated)
        req.ctx += 1
        self.kv += 1
        req.last_tok = t
        if kind == "join":
            req.stage_tok, req.serial_left = 1, req.serial_left - 1
            if req.serial_left == 0:
                self._close_serial(req, t)
            return not (req.done or req.gated)
        req.record.first_token_s = t
        req.stage = 0
        req.stage_start, req.stage_tok = t, 0
        req.serial_left = req.spec.stages[0] - 1
        if req.serial_left == 0:
            self._next_stage(req, t)
        return not (req.done or req.gated)

    def _close_serial(self, req: _Req, t: float) -> None:
        req.record.stages.append(StageRecord(False, req.stage_start, t, req.stage_tok))
        self._next_stage(req, t)

    def _advance_phase(self, req: _Req, w: int, k: int, t: float) -> bool:
        """k steps of the first w ready branches of req, the last ending at t; False once it reduced."""
        left, cl = req.branch_left, req.branch_ctx
        finished = 0
        for j in range(w):
            left[j] -= k
            cl[j] += k
            finished += left[j] == 0
        req.phase_tok += w * k
        req.last_tok = t
        if not finished:
            return True
        self.dirty = True
        keep = [j for j in range(len(left)) if left[j] > 0]
        if keep:
            req.branch_left, req.branch_ctx, req.branch_index = ([left[j] for j in keep], [cl[j] for j in keep],
                                                                  [req.branch_index[j] for j in keep])
            self.slots -= finished
            return True
        self.slots -= finished - 1  # the parent keeps one slot after the reduce
        req.record.stages.append(StageRecord(True, req.phase_start, t, req.phase_tok))
        # the reduce: every branch's tokens join the parent's context
        req.ctx += req.phase_tok + req.phase_extra
        req.branch_left, req.branch_ctx, req.branch_index, req.phase_extra = [], [], [], 0
        self._next_stage(req, t)
        return False

    # ----------------------------------------------------------------------------------- refit
    def _until_refit(self) -> int:
        """Observations until the controller's refit next runs (OnlineRefit's counting rule)."""
        rf = self.ctl.refit
        if rf is None or self.static:
            return _BIG
        return max(rf.every - self._since, rf.min_samples - min(self._obs, rf.window), 1)

    def _observe(self, rows: int, ctx: int, base: float, d: float, f: float, k: int, first: float = 0.0,
                 deferred: int = 0) -> None:
        """Realized latencies of k pure-decode steps (rows fixed, context growing by rows per step;
        the first one `first` longer), each with the rows it deferred. Straight to the refit, as
        StepController.on_latency forwards them."""
        rf = self.ctl.refit
        if rf is None or self.static:
            return
        for j in range(k):
            rf.observe(rows, ctx + j * rows, (base + d * j + (first if j == 0 else 0.0)) * f, deferred=deferred)
            self._obs += 1
            self._since += 1
            if self._since >= rf.every and min(self._obs, rf.window) >= rf.min_samples:
                self._since = 0

    # ------------------------------------------------------------------------------------ loop
    def run(self) -> SimResult:
        """Step until t_end (or until every request finished): admit, compose a step, pick how many
        identical steps run at once, run them, advance every row."""
        t_wall, t_cpu = time.perf_counter(), time.process_time()
        while self.now < self.t_end:
            self._arrive()
            self._admit()
            if self.dirty:
                self._repartition()
            if not self.decoding and not self.prefilling:
                nxt = self._next_event()
                if nxt == math.inf:
                    break
                self.now = max(self.now, nxt)
                continue
            step = self._compose()
            self._window(step)
            self._execute(step)
        self._catch_up()
        return self._result(t_wall, t_cpu)

    def _arrive(self) -> None:
        """Queue every request that has arrived by now, and every client request that has reached
        the server."""
        specs, now = self.specs, self.now
        while self.next_arrival < len(specs) and specs[self.next_arrival].arrival_s <= now:
            req = _Req(specs[self.next_arrival])
            self.waiting.append(req)
            self.everyone.append(req)
            self.next_arrival += 1
        gated = self.gated
        while gated and gated[0][0] <= now:
            self.waiting.append(heapq.heappop(gated)[2])

    def _next_event(self) -> float:
        """When the next request reaches the server (an arrival or a client's next stage)."""
        nxt = self.specs[self.next_arrival].arrival_s if self.next_arrival < len(self.specs) else math.inf
        return min(nxt, self.gated[0][0]) if self.gated else nxt

    def _gate(self, req: _Req, kind: str, tokens: int, t: float) -> None:
        """A client-side program's next request (a fork's branches or a join), sent when the stage
        before it ended at t: it reaches the server client_gap_s later and prefills `tokens`."""
        req.prefill_kind, req.prefill_left, req.gated = kind, tokens, True
        req.prefill_reqs = len(req.branch_left) if kind == "fork" else 1
        self.kv -= req.ctx  # the radix cache keeps it, evictable, until the next request matches it
        self.gate_seq += 1
        heapq.heappush(self.gated, (t + self.cfg.client_gap_s, self.gate_seq, req))

    def _admit(self) -> None:
        """FCFS admission while the running limit and the KV pool allow (module docstring)."""
        wait, cap, kv_admit = self.waiting, self.running_cap, self.kv_admit
        while wait and self.slots < cap and self.kv + wait[0].prefill_left + (wait[0].ctx if wait[0].gated else 0) <= kv_admit:
            req = wait.popleft()
            self.prefilling.append(req)
            self.slots += max(len(req.branch_left), 1)
            if req.gated:  # a client's next request: its prefix comes back from the cache (not recomputed)
                self.kv += req.ctx

    def _repartition(self) -> None:
        """The decode set or some request's stage changed: rebuild the serial and phase partitions."""
        self._catch_up()
        dec = self.decoding = [req for req in self.decoding if not (req.done or req.gated)]
        ser = self.serial = [req for req in dec if not req.branch_left]
        self.phased = [req for req in dec if req.branch_left]
        ser_ctx, ser_k = 0, _BIG
        for req in ser:
            ser_ctx += req.ctx
            ser_k = min(ser_k, req.serial_left)
        self.serial_ctx, self.serial_steps = ser_ctx, ser_k
        self.wide = any(len(req.branch_ctx) > 1 for req in self.phased)
        if not self.static:
            self.driver.forget(dec)
        self.dirty, self.fresh, self.cached_widths = False, True, None
        self.gen += 1

    def _prefill_chunk(self) -> tuple[int, list[_Req], int]:
        """The chunked prefill of this step: its tokens, the requests it completes and how many
        SGLang requests it touches. A prompt (or a retracted request's KV) goes into the request's
        context, a fork's headers into its branches' (set when the phase opened), a join's tokens
        replace KV the branches already hold."""
        chunk_max = self.cfg.chunk_tokens
        chunk, kv, reqs, filled = 0, 0, 0, []
        for req in self.prefilling:
            take = min(req.prefill_left, chunk_max - chunk)
            req.prefill_left -= take
            resume = req.saved_ctx >= 0
            if resume or req.prefill_kind == "prompt":
                req.ctx += take
            if resume or req.prefill_kind != "join":
                kv += take
            chunk += take
            reqs += req.prefill_reqs
            if req.prefill_left == 0:
                filled.append(req)
            if chunk >= chunk_max:
                break
        self.kv += kv
        return chunk, filled, reqs

    def _compose(self) -> _Step:
        """This step's batch: every serial row, the controller's widths for the phases, the prefill
        chunk (or, with prefill_steps, a prefill forward alone); its latency T plus the host costs,
        and growth per further step; k = steps until some row ends its stage."""
        m, host = self.model, self.host
        if self.cfg.prefill_steps and self.prefilling:
            chunk, filled, reqs = self._prefill_chunk()
            step = _Step(chunk, filled, 0, 0, 1, prefill_only=True)
            step.host = host.prefill(reqs)
            step.base = m.predict(0, 0, chunk) + step.host
        else:
            chunk, filled, reqs = self._prefill_chunk()
            step = _Step(chunk, filled, len(self.serial), self.serial_ctx, self.serial_steps)
            if self.wide:  # otherwise every width is 1 and the hook never calls select
                self._plan_phases(step)
            else:
                for req in self.phased:
                    step.ctx += req.branch_ctx[0]
                    step.k = min(step.k, req.branch_left[0])
                step.rows += len(self.phased)
            step.host = self._host_s(step) + (host.prefill(reqs) - host.prefill.fixed_s if chunk else 0.0)
            step.base = m.predict(step.rows, step.ctx, chunk) + step.host
            step.growth = m.c_ctx * step.rows  # every run row's context grows by one per step
        step.noise = self.noise[self.noise_at]
        self.noise_at = (self.noise_at + 1) & (len(self.noise) - 1)
        return step

    def _host_s(self, step: _Step) -> float:
        """HostCosts of a decode step (each of its k steps; `first_extra` for the first alone)."""
        host = self.host
        if not (host.step or host.plan or host.subset or host.same_subset):
            return 0.0
        live = len(self.serial) + sum(len(req.branch_ctx) for req in self.phased)
        extra = host.step(step.rows)
        if self.wide and not self.static:
            extra += host.plan(live)
        if step.rows < live:
            sub = (self.gen, tuple(step.widths) if step.widths is not None else None)
            changed = sub != self.last_subset
            self.last_subset = sub
            same = host.same_subset(live - step.rows)
            extra += same
            step.first_extra = host.subset(live - step.rows) - same if changed else 0.0
            step.subset, step.changed = True, changed
        else:
            self.last_subset = None
        return extra

    def _plan_phases(self, step: _Step) -> None:
        """The controller's widths (or a static policy's cached ones) and what they add to the step."""
        par, ser = self.phased, self.serial
        if self.cached_widths is not None:
            widths = self.cached_widths
        else:
            step.row_list = self.driver.rows(par, ser, self.lag)
            step.active = self.driver.select(step.row_list, self.now, len(self.waiting))
            owner = np.repeat(np.arange(len(par)), [len(req.branch_ctx) for req in par])
            a = np.asarray(step.active)
            widths = np.bincount(owner[a[a < len(owner)]], minlength=len(par)).tolist()
            step.all_in = len(step.active) == len(step.row_list)
            if self.static and self.trace is None:
                self.cached_widths = widths
        step.widths = widths
        need_k = self.cfg.macro_steps
        rows, ctx, k, elig = step.rows, step.ctx, step.k, 0
        for req, w in zip(par, widths, strict=True):
            cl = req.branch_ctx
            elig += len(cl)
            rows += w
            if w == 1:
                ctx += cl[0]
                if need_k and req.branch_left[0] < k:
                    k = req.branch_left[0]
            else:
                ctx += sum(cl[:w])
                if need_k:
                    k = min(k, min(req.branch_left[:w]))
        step.rows, step.ctx, step.k = rows, ctx, k
        step.admitted = rows - len(ser) - len(par)
        step.eligible = elig - len(par)

    def _window(self, step: _Step) -> None:
        """How many identical steps run at once (module docstring): step.k, cut to what provably
        cannot change the plan, or 1."""
        if step.prefill_only:
            return  # k = 1; the next decode step is the one a new key's clock starts at
        k, cap = step.k, self.running_cap
        if not (k > 1 and self.cfg.macro_steps and not self.prefilling and not (self.waiting and self.slots < cap)):
            step.k, self.fresh = 1, False
            return
        k = min(k, max(1, (self.cfg.kv_tokens - self.kv) // max(step.rows, 1)))
        n_specs = len(self.specs)
        nxt_t = self.specs[self.next_arrival].arrival_s if self.next_arrival < n_specs else math.inf
        static = self.static
        horizon = self.t_end if (static and self.waiting) or self.next_arrival >= n_specs else min(self.t_end, nxt_t)
        if self.gated:  # a client's next request reaches the server
            horizon = min(horizon, self.gated[0][0])
        k = min(k, _steps_until(step.base, step.growth, horizon - self.now))
        if not static:
            if self.fresh or self.pinning and self.wide:
                k = 1  # a new key's clock starts at its first step; pins change step by step
            else:
                k = min(k, self._until_refit())
            if k > 1 and self.wide:
                k = self._all_fit_steps(step, k) if step.all_in and self.provable else 1
        step.k, self.fresh = k, False

    def _execute(self, step: _Step) -> None:
        """Run step.k steps: log them, tell the controller, advance every row, handle an overflow."""
        k, base, d, f = step.k, step.base, step.growth, step.noise
        total = (k * base + d * k * (k - 1) / 2 + step.first_extra) * f
        t = self.now + total
        self.log.add(self.now, k, total, max(base + step.first_extra, base + d * (k - 1)) * f,
                     step.eligible * k, step.admitted * k)
        self._count(step, total)
        if self.trace is not None:
            self.trace.append((self.now, t, step.row_list or self.driver.rows(self.phased, self.serial, self.lag),
                               step.active, len(self.waiting)))
        if not step.prefill_only:
            if not self.static:
                self.driver.delivered(self.phased, step.widths, self.serial, k, t, step.rows)
                if step.chunk == 0:
                    self._observe(step.rows, step.ctx, base, d, f, k, step.first_extra,
                                  step.eligible - step.admitted)
            self.kv += step.rows * k
            # a request whose rows change (a branch ends, a stage closes) sets dirty: partitions are rebuilt
            self._advance_serial(k, t)
            self._advance_phases(step.widths, k, t)
        for req in step.filled:
            if self._prefilled(req, t):
                self.decoding.append(req)
        if step.filled:
            self.prefilling = [req for req in self.prefilling if req.prefill_left > 0]
        self.now = t
        if self.kv > self.cfg.kv_tokens:
            self._catch_up()
            self._retract()

    def _count(self, step: _Step, total: float) -> None:
        """The run's tallies (SimResult.stats): decode and prefill steps, rows, host time."""
        c, k = self.tally, step.k
        c["host_s"] += (k * step.host + step.first_extra) * step.noise
        if step.prefill_only:
            c["prefill_steps"] += 1
            c["prefill_s"] += total
            return
        c["decode_steps"] += k
        c["decode_s"] += total
        c["rows_run"] += step.rows * k
        c["rows_deferred"] += (step.eligible - step.admitted) * k
        c["subset_steps"] += step.subset * k
        c["changed_subsets"] += step.changed

    def _advance_serial(self, k: int, t: float) -> None:
        """k tokens for every serial row, the last at t. While no serial stage closes they advance
        lazily (`lag` tokens since the partition was built, the last at `lag_t`)."""
        ser = self.serial
        if k < self.serial_steps:
            self.lag, self.lag_t = self.lag + k, t
            self.serial_ctx += k * len(ser)
            if ser:
                self.serial_steps -= k
            return
        kk, self.lag = k + self.lag, 0
        ser_ctx, ser_k = 0, _BIG
        for req in ser:
            req.stage_tok += kk
            req.last_tok = t
            left = req.serial_left = req.serial_left - kk
            c = req.ctx = req.ctx + kk
            if left == 0:
                self._close_serial(req, t)
                continue
            ser_ctx += c
            if left < ser_k:
                ser_k = left
        self.serial_ctx, self.serial_steps = ser_ctx, ser_k

    def _advance_phases(self, widths: list[int] | None, k: int, t: float) -> None:
        """k steps of each phase's first `width` branches, the last at t."""
        for j, req in enumerate(self.phased):
            w = widths[j] if widths else 1
            left = req.branch_left
            if w == 1 and left[0] > k:  # the common case, inlined: no branch ends
                left[0] -= k
                req.branch_ctx[0] += k
                req.phase_tok += k
                req.last_tok = t
            else:
                self._advance_phase(req, w, k, t)

    def _catch_up(self) -> None:
        """Write the lazily advanced serial tokens into the serial requests."""
        lag, t = self.lag, self.lag_t
        if not lag:
            return
        for req in self.serial:
            req.stage_tok += lag
            req.last_tok = t
            req.serial_left -= lag
            req.ctx += lag
        self.lag = 0

    def _result(self, t_wall: float, t_cpu: float) -> SimResult:
        ctl, drv = self.ctl, self.driver
        stats = {"retractions": self.retractions,
                 "unadmitted": len(self.waiting) + (len(self.specs) - self.next_arrival),
                 "iterations": len(self.log.t_s), "selects": drv.selects, "subset_steps": drv.subset_steps,
                 "max_running": self.running_cap, "wall_s": time.perf_counter() - t_wall, **self.tally,
                 "cpu_s": time.process_time() - t_cpu}
        if ctl.refit is not None and not self.static:
            stats["refits"] = ctl.refit.refits
            pm = self.policy.model
            stats["model_after"] = list(pm.coefs()) if hasattr(pm, "coefs") else pm.value_s
        recs = [req.record for req in self.everyone]
        set_max_gaps(recs, self.log, self.now)
        return SimResult(self.policy.name, recs, self.log, stats["wall_s"], stats)

    def _all_fit_steps(self, step: _Step, k: int) -> int:
        """k if the controller provably admits every ready row in each of the next k steps, else 1.

        It admitted everything now; the probe asks whether it admits everything on the window's worst
        case (contexts of step k, today's slack). T is monotone in context and slack never shrinks
        inside the window (serial rows deliver every step; a phase gains >= slo - T per step, so we
        need every step within the SLO), so each step in between has a cheaper composition and at
        least this budget, and "everything fits" holds for it too."""
        slo, base, d, f = self.cfg.slo_s, step.base, step.growth, step.noise
        if (base + d * (k - 1)) * f > slo:  # keep every step within the SLO
            k = int((slo / f - base) / d) + 1 if d > 0 and base * f <= slo else 1
            if k <= 1:
                return 1
        rows = self.driver.rows(self.phased, self.serial, self.lag, k - 1)
        return k if self.driver.would_admit_all(rows, self.now, len(self.waiting)) else 1

    def _retract(self) -> None:
        """Free the newest requests' KV until the pool fits; they re-prefill what they held."""
        dec, wait = self.decoding, self.waiting
        live = [req for req in dec if not (req.done or req.gated)]
        while self.kv > self.cfg.kv_tokens and len(live) > 1:
            req = live.pop()
            dec.remove(req)
            self.retractions += 1
            req.gone_s = req.last_tok
            kv = req.kv
            self.kv -= kv
            self.slots -= max(len(req.branch_left), 1)
            req.prefill_left, req.saved_ctx, req.ctx = kv, req.ctx, 0
            req.prefill_reqs = max(len(req.branch_left), 1)
            wait.appendleft(req)
        self.dirty = True


def set_max_gaps(recs: list[RequestRecord], log: StepLog, t_end: float) -> None:
    """Each request's largest delivery gap (metrics.RequestRecord.max_gap_s): every decoding request
    gets a token from every step (its serial row or its phase's protected row), so it is the longest
    step that started between its first token and its last, or a retraction gap set on the way."""
    t = np.asarray(log.t_s, float)
    mx = np.append(np.asarray(log.max_latency_s, float), 0.0)
    if not len(recs):
        return
    first = np.array([rec.first_token_s for rec in recs], float)
    last = np.array([rec.stages[-1].end_s if rec.stages else rec.first_token_s for rec in recs], float)
    last = np.where([rec.finished for rec in recs], last, t_end)
    lo = np.searchsorted(t, np.nan_to_num(first, nan=np.inf), side="left")
    hi = np.searchsorted(t, last, side="left")
    idx = np.empty(2 * len(recs), np.int64)
    idx[0::2], idx[1::2] = np.minimum(lo, len(t)), np.minimum(hi, len(t))
    step_max = np.maximum.reduceat(mx, idx)[0::2]
    for rec, a, b, gap in zip(recs, lo, hi, step_max.tolist(), strict=True):
        if rec.first_token_s != rec.first_token_s:
            continue
        gap = gap if b > a else 0.0
        rec.max_gap_s = gap if not rec.max_gap_s >= gap else rec.max_gap_s


def _steps_until(base: float, d: float, span: float) -> int:
    """Fewest steps (>= 1) whose summed latency base, base+d, ... reaches span."""
    if span <= base:
        return 1
    if d <= 0:
        return max(1, math.ceil(span / base))
    # k*base + d*k*(k-1)/2 >= span
    b = base - d / 2
    return max(1, math.ceil((-b + math.sqrt(b * b + 2 * d * span)) / d))




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
