"""The simulator's engine: continuous-batching decode steps driving the server's TAPER controller.

One SGLang-like server: every step runs the decoding requests' chosen rows plus chunked prefill, at
the latency model's T(rows, context tokens, prefill tokens) times lognormal noise; requests are
admitted FCFS under a running limit and a KV-pool bound; a parallel phase forks its branches on the
parent's KV and reduces for free; an overflowing pool retracts the newest request. The widths come
from the server's own `StepController`, driven by `HookDriver` as scheduler_hook.py drives it.

`Simulator.run` is one loop: arrive, admit, repartition, compose a step (`_compose`), choose how
many provably identical steps run at once (`_window`), run them (`_execute`). `macro_steps=False`
steps one by one; the unit tests hold both modes to the same deliveries. The engine model, host
costs and the window rule are in docs/design/simulator.md.
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
from branchwise.taper.prefill_budget import (
    PrefillRule,
    PrefillStep,
    least_slack,
    prefill_tokens,
    stage_slack,
    ttft_due,
)

_BIG = 1 << 62
# Steps in the noise table: step k of a run draws entry k mod this, however the steps are grouped
# into windows, so a window is exact under noise and every policy's k-th step sees the same draw.
_NOISE_STEPS = 1 << 16
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

    # every decode step, rows = rows run (output processing, other processes)
    step: Cost = Cost()
    # a decode step whose widths a budget rule planned, rows = live rows (snapshot, plan)
    plan: Cost = Cost()
    # a step that defers rows, its active set changed since the last step; rows = deferred
    subset: Cost = Cost()
    # a step that defers rows with the last step's active set; rows = deferred
    same_subset: Cost = Cost()
    # a prefill forward beyond T(0, 0, tokens), rows = its requests (arrivals, branches, joins)
    prefill: Cost = Cost()


@dataclass(frozen=True, slots=True)
class EngineConfig:
    slo_s: float = 0.050
    kv_tokens: int = 1_500_000  # KV pool (Qwen3-32B, 8xA100-80GB, ~62% of memory; TAPER D)
    # running requests incl. branches (SGLang --max-running-requests); 0: SGLang's default
    max_running: int = 0
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
    # None: every step's prefill chunk is chunk_tokens (stock). A rule: each step's chunk is sized by
    # the decoding requests' slack (branchwise.taper.prefill_budget; its chunk_max caps the chunk)
    prefill_rule: PrefillRule | None = None

    @property
    def running_cap(self) -> int:
        if self.max_running > 0:
            return self.max_running
        return sglang_max_running(self.kv_tokens, self.context_len)


_DEF = EngineConfig()
HEADER = 2  # tokens that open a client-side branch (bench.programs.branch_head)


def build_controller(policy: str, model: LinearLatencyModel, rho: float = 0.8, calibrated: bool = False,
                     **kw) -> StepController:
    """The controller scheduler_hook._build_controller builds: the policy over a copy of the engine's
    model (its graph sizes too), refit online (a calibrated --latency-model keeps its slopes and refits
    the intercept over the last 64 steps every 16; the default model is fully refit over 200 every 50)."""
    own = LinearLatencyModel(*model.coefs(), graph_batch_sizes=model.graph_batch_sizes)
    pol = parse_policy(policy, model=own, rho=rho, **kw)
    if pol.model is None:
        return StepController(pol)
    learn = pol.terms.defer_cost  # the policy prices deferral: the refit learns its price
    if calibrated:
        refit = OnlineRefit(pol.model, window=64, every=16, slopes_fixed=True, deferral=learn)
        return StepController(pol, refit)
    return StepController(pol, OnlineRefit(pol.model, deferral=learn))


class _Req:
    """Mutable per-request simulation state."""

    __slots__ = (
        "spec", "rid", "key", "phase_key", "fanout", "prefill_left", "ctx", "saved_ctx", "stage",
        "serial_left", "done", "stage_start", "stage_tok", "last_tok", "branch_left", "branch_ctx",
        "branch_index", "phase_start", "phase_tok", "record", "gone_s", "phase_extra", "prefill_kind",
        "prefill_reqs", "gated",
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
        # between a client's stages: from a stage's end until the next request's prefill
        self.gated = False

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

    __slots__ = ("ctl", "slo_s", "selects", "subset_steps")

    def __init__(self, ctl: StepController, slo_s: float) -> None:
        self.ctl, self.slo_s = ctl, slo_s
        self.selects = self.subset_steps = 0

    def rows(self, par: list[_Req], ser: list[_Req], lag: int, grow: int = 0) -> list[Row]:
        """The hook's `_row` for every live row: phase rows request-major in branch order, then serial."""
        slo = self.slo_s
        out = [Row(key=req.phase_key, order=order, ctx=ctx + grow, slo_s=slo, in_phase=True)
               for req in par for order, ctx in zip(req.branch_index, req.branch_ctx, strict=True)]
        out += [Row(key=req.key, ctx=req.ctx + lag + grow, slo_s=slo) for req in ser]
        return out

    def select(self, rows: list[Row], now: float, waiting: int = 0) -> list[int]:
        """around_update_running_batch + _decide: active row indices (the caller checked that some
        key has two rows); `waiting`: requests queued for admission."""
        ctl = self.ctl
        ctl.resume_serial_clocks(rows)
        self.selects += 1
        active = ctl.select(rows, now, waiting=waiting)
        self.subset_steps += len(active) < len(rows)
        return active

    def forget(self, live: list[_Req]) -> None:
        """Drop the clocks of keys whose rows left the batch. The hook drops a key once its last row
        finishes (_release_finished) and the controller's planned steps drop keys absent from their
        rows; here it happens at every change of composition, so windowed and single steps agree. A
        parent that resumes after its phase's reduce starts a fresh serial clock either way."""
        keys = {req.phase_key if req.branch_left else req.key for req in live}
        if len(self.ctl.trackers) > len(keys) or any(key not in keys for key in self.ctl.trackers):
            self.ctl.forget(keys)

    def would_admit_all(self, rows: list[Row], now: float, waiting: int = 0) -> bool:
        """Whether the controller would run every row of `rows` now, without changing it: a probe
        controller over the same policy, the same delivery clocks and a copy of the pins."""
        ctl = self.ctl
        probe = StepController(ctl.policy, None, ctl.trackers, dict(ctl.fixed))
        return len(probe.select(rows, now, waiting=waiting)) == len(rows)

    def delivered(self, par: list[_Req], widths: list[int] | None, ser: list[_Req], n_steps: int,
                  end_s: float, n_rows: int) -> None:
        """after_process_batch_result for n_steps identical steps, the last ending at end_s."""
        ctl = self.ctl
        if par:
            slo = self.slo_s
            deliveries = {req.key: Delivery(n_steps, slo, False) for req in ser}
            if widths is None:
                deliveries.update((req.phase_key, Delivery(n_steps, slo, True)) for req in par)
            else:
                deliveries.update((req.phase_key, Delivery(width * n_steps, slo, True))
                                  for req, width in zip(par, widths, strict=True))
            ctl.on_phase_step(deliveries, end_s, n_rows * n_steps)
        else:
            ctl.on_quiet_step(end_s, n_rows * n_steps)


@dataclass(slots=True)
class SimResult:
    policy: str
    records: list[RequestRecord]
    steps: StepLog
    wall_s: float
    stats: dict = field(default_factory=dict)


@dataclass(slots=True)
class _Step:
    """One iteration: n_steps identical steps of `rows` rows over `ctx` context tokens (the first
    one also prefills `chunk` tokens); latency (base + growth * j) * noise for the j-th of them."""

    chunk: int
    filled: list[_Req]  # requests whose prefill this step completes
    rows: int
    ctx: int
    n_steps: int  # steps until some row ends its stage (then cut by `_window`)
    widths: list[int] | None = None  # rows run per phase; None: one each (no choice)
    eligible: int = 0  # opportunistic rows offered to the controller
    admitted: int = 0  # ... and run
    row_list: list[Row] | None = None  # the rows the controller saw, and the indices it ran
    active: list[int] | None = None
    all_in: bool = True
    planned: bool = True  # the controller planned the widths (not a static or unpriced step)
    base: float = 0.0
    growth: float = 0.0
    noise: float = 1.0
    first_extra: float = 0.0  # host time only the first of the steps pays (its active set changed)
    prefill_only: bool = False  # a prefill forward of its own (EngineConfig.prefill_steps)
    host: float = 0.0  # host seconds in `base` (HostCosts)
    subset: bool = False  # some live row is deferred (set only where HostCosts charge for it)
    changed: bool = False  # ... and the active set differs from the last step's


class Simulator:
    def __init__(self, specs: list[RequestSpec], controller: StepController | Policy,
                 model: LinearLatencyModel, cfg: EngineConfig, t_end: float, seed: int = 0) -> None:
        self.specs = sorted(specs, key=lambda spec: spec.arrival_s)
        if not isinstance(controller, StepController):  # a bare policy: the hook's controller around it
            controller = StepController(controller)
        self.ctl, self.model, self.cfg = controller, model, cfg
        self.policy = controller.policy
        self.driver = HookDriver(controller, cfg.slo_s)
        self.t_end = t_end
        # serial, cap:K, eager: the plan is a function of ready-row counts (and the model only fills
        # predicted_s), so deliveries and latencies need not reach the controller
        self.static = self.policy.static
        self.provable = self.policy.name in _PROVABLE
        rng = np.random.default_rng(seed + 7919)
        sig = cfg.noise
        draws = np.exp(rng.normal(-sig * sig / 2, sig, _NOISE_STEPS)) if sig > 0 else np.ones(_NOISE_STEPS)
        self.noise = np.concatenate([draws, draws])  # doubled: a window's draws are one slice
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
        self.noise_at = 0  # the next step's entry in the noise table
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
        # the last step's subset, if any
        self.last_subset: tuple[int, tuple[int, ...] | None] | None = None
        self.host = cfg.host
        self.tally = {"decode_steps": 0, "decode_s": 0.0, "rows_run": 0, "rows_deferred": 0,
                      "prefill_steps": 0, "prefill_s": 0.0, "host_s": 0.0, "subset_steps": 0,
                      "changed_subsets": 0}

    # ----------------------------------------------------------------------------- stage machine
    def _next_stage(self, req: _Req, t_s: float) -> None:
        """Open stage req.stage + 1 at time t_s, or finish the request. Client-side programs: the
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
        req.stage_start, req.stage_tok = t_s, 0
        if isinstance(stage, tuple):
            fanout = len(stage)
            req.branch_left, req.branch_ctx = list(stage), [req.ctx] * fanout
            req.branch_index = list(range(fanout))
            req.phase_key, req.fanout = f"phase:{req.rid}.{req.stage}", fanout
            req.phase_start, req.phase_tok = t_s, 0
            if client:
                req.branch_ctx, req.phase_extra = [req.ctx + HEADER] * fanout, HEADER * fanout
                self._gate(req, "fork", HEADER * fanout, t_s)
            else:
                self.slots += fanout - 1
        else:
            req.serial_left = stage
            req.last_tok = t_s
            if client:  # the join: every branch but the first is new to the radix cache, and a separator
                join_tokens = sum(HEADER + branch for branch in stages[req.stage - 1][1:]) + 1
                self._gate(req, "join", join_tokens, t_s)

    def _prefilled(self, req: _Req, t_s: float) -> bool:
        """Prefill done at t_s: first token (or, after a retraction, resume where it was); a client
        fork's branches get their first tokens, a client join the first token of its stage. True
        while the request decodes on."""
        self.dirty = True
        if req.saved_ctx >= 0:
            req.ctx, req.saved_ctx = req.saved_ctx, -1
            gap = t_s - req.gone_s  # no delivery while retracted (a lower bound: the next step adds to it)
            req.record.max_gap_s = gap if not req.record.max_gap_s >= gap else req.record.max_gap_s
            return True
        kind, req.prefill_kind, req.prefill_reqs, req.gated = req.prefill_kind, "prompt", 1, False
        if kind == "fork":
            self.kv += len(req.branch_left)
            self._advance_phase(req, len(req.branch_left), 1, t_s)
            return not (req.done or req.gated)
        req.ctx += 1
        self.kv += 1
        req.last_tok = t_s
        if kind == "join":
            req.stage_tok, req.serial_left = 1, req.serial_left - 1
            if req.serial_left == 0:
                self._close_serial(req, t_s)
            return not (req.done or req.gated)
        req.record.first_token_s = t_s
        req.stage = 0
        req.stage_start, req.stage_tok = t_s, 0
        req.serial_left = req.spec.stages[0] - 1
        if req.serial_left == 0:
            self._next_stage(req, t_s)
        return not (req.done or req.gated)

    def _close_serial(self, req: _Req, t_s: float) -> None:
        req.record.stages.append(StageRecord(False, req.stage_start, t_s, req.stage_tok))
        self._next_stage(req, t_s)

    def _advance_phase(self, req: _Req, width: int, n_steps: int, end_s: float) -> bool:
        """n_steps steps of the first `width` ready branches of req, the last ending at end_s; False
        once it reduced."""
        left, ctxs = req.branch_left, req.branch_ctx
        finished = 0
        for j in range(width):
            left[j] -= n_steps
            ctxs[j] += n_steps
            finished += left[j] == 0
        req.phase_tok += width * n_steps
        req.last_tok = end_s
        if not finished:
            return True
        self.dirty = True
        keep = [j for j in range(len(left)) if left[j] > 0]
        if keep:
            req.branch_left = [left[j] for j in keep]
            req.branch_ctx = [ctxs[j] for j in keep]
            req.branch_index = [req.branch_index[j] for j in keep]
            self.slots -= finished
            return True
        self.slots -= finished - 1  # the parent keeps one slot after the reduce
        req.record.stages.append(StageRecord(True, req.phase_start, end_s, req.phase_tok))
        # the reduce: every branch's tokens join the parent's context
        req.ctx += req.phase_tok + req.phase_extra
        req.branch_left, req.branch_ctx, req.branch_index, req.phase_extra = [], [], [], 0
        self._next_stage(req, end_s)
        return False

    # ----------------------------------------------------------------------------------- refit
    def _until_refit(self) -> int:
        """Observations until the controller's refit next runs (OnlineRefit's counting rule)."""
        refit = self.ctl.refit
        if refit is None or self.static:
            return _BIG
        return max(refit.every - self._since, refit.min_samples - min(self._obs, refit.window), 1)

    def _observe(self, rows: int, ctx: int, latencies: np.ndarray, deferred: int = 0) -> None:
        """Realized latencies of pure-decode steps (rows fixed, context growing by rows per step),
        each with the rows it deferred. Straight to the refit, as StepController.on_latency forwards
        them."""
        refit = self.ctl.refit
        if refit is None or self.static:
            return
        for j, latency_s in enumerate(latencies.tolist()):
            refit.observe(rows, ctx + j * rows, latency_s, deferred=deferred)
            self._obs += 1
            self._since += 1
            if self._since >= refit.every and min(self._obs, refit.window) >= refit.min_samples:
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

    def _gate(self, req: _Req, kind: str, tokens: int, t_s: float) -> None:
        """A client-side program's next request (a fork's branches or a join), sent when the stage
        before it ended at t_s: it reaches the server client_gap_s later and prefills `tokens`."""
        req.prefill_kind, req.prefill_left, req.gated = kind, tokens, True
        req.prefill_reqs = len(req.branch_left) if kind == "fork" else 1
        self.kv -= req.ctx  # the radix cache keeps it, evictable, until the next request matches it
        self.gate_seq += 1
        heapq.heappush(self.gated, (t_s + self.cfg.client_gap_s, self.gate_seq, req))

    def _admit(self) -> None:
        """FCFS admission while the running limit and the KV pool allow (docs/design/simulator.md)."""
        wait, cap, kv_admit = self.waiting, self.running_cap, self.kv_admit
        while wait and self.slots < cap:
            head = wait[0]
            if self.kv + head.prefill_left + (head.ctx if head.gated else 0) > kv_admit:
                break
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
        ser_ctx, ser_steps = 0, _BIG
        for req in ser:
            ser_ctx += req.ctx
            ser_steps = min(ser_steps, req.serial_left)
        self.serial_ctx, self.serial_steps = ser_ctx, ser_steps
        self.wide = any(len(req.branch_ctx) > 1 for req in self.phased)
        if not self.static:
            self.driver.forget(dec)
        self.dirty, self.fresh, self.cached_widths = False, True, None
        self.gen += 1

    def _chunk_limit(self, rows: int, ctx: int, host_s: float = 0.0) -> int:
        """The most prefill tokens this step may carry: chunk_tokens, or under a prefill rule what
        the decoding requests' least slack leaves above T(rows, ctx) (prefill_budget)."""
        rule = self.cfg.prefill_rule
        if rule is None or not self.prefilling:
            return self.cfg.chunk_tokens
        model = self.policy.model if isinstance(self.policy.model, LinearLatencyModel) else self.model
        now, slo = self.now, self.cfg.slo_s
        lag = self.lag
        slacks = [stage_slack(slo, req.stage_tok + lag, now - req.stage_start) for req in self.serial]
        slacks += [stage_slack(slo, req.phase_tok, now - req.phase_start) for req in self.phased]
        head = self.prefilling[0]
        due = (head.prefill_kind == "prompt" and head.saved_ctx < 0
               and ttft_due(rule.ttft_slo_s, now - head.spec.arrival_s, head.prefill_left, model.c_tok))
        return prefill_tokens(rule, model, PrefillStep(rows, ctx, least_slack(slacks), due, host_s))

    def _prefill_chunk(self, chunk_max: int | None = None) -> tuple[int, list[_Req], int]:
        """The chunked prefill of this step (at most chunk_max tokens, default chunk_tokens): its
        tokens, the requests it completes and how many SGLang requests it touches. A prompt (or a
        retracted request's KV) goes into the request's context, a fork's headers into its
        branches' (set when the phase opened), a join's tokens replace KV the branches already hold."""
        chunk_max = self.cfg.chunk_tokens if chunk_max is None else chunk_max
        chunk, new_kv, reqs, filled = 0, 0, 0, []
        for req in self.prefilling:
            take = min(req.prefill_left, chunk_max - chunk)
            req.prefill_left -= take
            resume = req.saved_ctx >= 0
            if resume or req.prefill_kind == "prompt":
                req.ctx += take
            if resume or req.prefill_kind != "join":
                new_kv += take
            chunk += take
            reqs += req.prefill_reqs
            if req.prefill_left == 0:
                filled.append(req)
            if chunk >= chunk_max:
                break
        self.kv += new_kv
        return chunk, filled, reqs

    def _compose(self) -> _Step:
        """This step's batch: every serial row, the controller's widths for the phases, the prefill
        chunk (or, with prefill_steps, a prefill forward alone); its latency T plus the host costs,
        and growth per further step; n_steps = steps until some row ends its stage."""
        model, host = self.model, self.host
        if self.cfg.prefill_steps and self.prefilling:
            # a prefill forward of its own delays every decoding request by its whole time
            chunk, filled, reqs = self._prefill_chunk(self._chunk_limit(0, 0))
            step = _Step(chunk, filled, 0, 0, 1, prefill_only=True)
            step.host = host.prefill(reqs)
            step.base = model.predict(0, 0, chunk) + step.host
        else:
            step = _Step(0, [], len(self.serial), self.serial_ctx, self.serial_steps)
            if self.wide:  # otherwise every width is 1 and the hook never calls select
                self._plan_phases(step)
            else:
                for req in self.phased:
                    step.ctx += req.branch_ctx[0]
                    step.n_steps = min(step.n_steps, req.branch_left[0])
                step.rows += len(self.phased)
            decode_host = self._host_s(step)
            # the rows first (the SLO protects them), then the chunk in what their budget leaves
            chunk, filled, reqs = self._prefill_chunk(self._chunk_limit(step.rows, step.ctx, decode_host))
            step.chunk, step.filled = chunk, filled
            prefill_host = host.prefill(reqs) - host.prefill.fixed_s if chunk else 0.0
            step.host = decode_host + prefill_host
            step.base = model.predict(step.rows, step.ctx, chunk) + step.host
            step.growth = model.c_ctx * step.rows  # every run row's context grows by one per step
        return step

    def _draws(self, n_steps: int) -> np.ndarray:
        """The noise of the next n_steps steps (at most _NOISE_STEPS)."""
        return self.noise[self.noise_at:self.noise_at + n_steps]

    def _latencies(self, step: _Step, n_steps: int) -> np.ndarray:
        """Realized latency of each of the step's next n_steps steps: (base + growth * j) times the
        j-th step's noise, the first one first_extra longer."""
        lat = step.base + step.growth * np.arange(n_steps)
        lat[0] += step.first_extra
        return lat * self._draws(n_steps)

    def _host_s(self, step: _Step) -> float:
        """HostCosts of a decode step (each of its n_steps steps; `first_extra` for the first alone)."""
        host = self.host
        if not (host.step or host.plan or host.subset or host.same_subset):
            return 0.0
        live = len(self.serial) + sum(len(req.branch_ctx) for req in self.phased)
        extra = host.step(step.rows)
        if self.wide and not self.static and step.planned:
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
            planned = self.driver.ctl.stats.planned_steps
            step.active = self.driver.select(step.row_list, self.now, len(self.waiting))
            step.planned = self.driver.ctl.stats.planned_steps > planned
            owner = np.repeat(np.arange(len(par)), [len(req.branch_ctx) for req in par])
            active = np.asarray(step.active)
            widths = np.bincount(owner[active[active < len(owner)]], minlength=len(par)).tolist()
            step.all_in = len(step.active) == len(step.row_list)
            if self.static and self.trace is None:
                self.cached_widths = widths
        step.widths = widths
        need_steps = self.cfg.macro_steps
        rows, ctx, n_steps, elig = step.rows, step.ctx, step.n_steps, 0
        for req, width in zip(par, widths, strict=True):
            ctxs = req.branch_ctx
            elig += len(ctxs)
            rows += width
            if width == 1:
                ctx += ctxs[0]
                if need_steps and req.branch_left[0] < n_steps:
                    n_steps = req.branch_left[0]
            else:
                ctx += sum(ctxs[:width])
                if need_steps:
                    n_steps = min(n_steps, min(req.branch_left[:width]))
        step.rows, step.ctx, step.n_steps = rows, ctx, n_steps
        step.admitted = rows - len(ser) - len(par)
        step.eligible = elig - len(par)

    def _window(self, step: _Step) -> None:
        """How many identical steps run at once: step.n_steps, cut to what provably cannot change the
        plan, or 1 (the window rule: docs/design/simulator.md)."""
        if step.prefill_only:
            return  # n_steps = 1; the next decode step is the one a new key's clock starts at
        n_steps, cap = step.n_steps, self.running_cap
        can_admit = self.waiting and self.slots < cap
        if not (n_steps > 1 and self.cfg.macro_steps and not self.prefilling and not can_admit):
            step.n_steps, self.fresh = 1, False
            return
        n_steps = min(n_steps, max(1, (self.cfg.kv_tokens - self.kv) // max(step.rows, 1)))
        n_specs = len(self.specs)
        nxt_t = self.specs[self.next_arrival].arrival_s if self.next_arrival < n_specs else math.inf
        static = self.static
        if (static and self.waiting) or self.next_arrival >= n_specs:
            horizon = self.t_end
        else:
            horizon = min(self.t_end, nxt_t)
        if self.gated:  # a client's next request reaches the server
            horizon = min(horizon, self.gated[0][0])
        n_steps = self._steps_until(step, min(n_steps, _NOISE_STEPS), horizon - self.now)
        if not static:
            if self.fresh or self.pinning and self.wide:
                n_steps = 1  # a new key's clock starts at its first step; pins change step by step
            else:
                n_steps = min(n_steps, self._until_refit())
            if n_steps > 1 and self.wide:
                n_steps = self._all_fit_steps(step, n_steps) if step.all_in and self.provable else 1
        step.n_steps, self.fresh = n_steps, False

    def _execute(self, step: _Step) -> None:
        """Run step.n_steps steps: log them, tell the controller, advance every row, handle an overflow."""
        n_steps = step.n_steps
        lat = self._latencies(step, n_steps)
        total = float(lat.sum())
        end_s = self.now + total
        longest = float(lat.max())
        self.log.add(self.now, n_steps, total, longest, step.eligible * n_steps, step.admitted * n_steps)
        self._count(step, total)
        self.noise_at = (self.noise_at + n_steps) % _NOISE_STEPS
        if self.trace is not None:
            rows = step.row_list or self.driver.rows(self.phased, self.serial, self.lag)
            self.trace.append((self.now, end_s, rows, step.active, len(self.waiting)))
        if not step.prefill_only:
            if not self.static:
                self.driver.delivered(self.phased, step.widths, self.serial, n_steps, end_s, step.rows)
                if step.chunk == 0:
                    self._observe(step.rows, step.ctx, lat, step.eligible - step.admitted)
            self.kv += step.rows * n_steps
            # a request whose rows change (a branch ends, a stage closes) sets dirty: partitions are rebuilt
            self._advance_serial(n_steps, end_s)
            self._advance_phases(step.widths, n_steps, end_s)
        for req in step.filled:
            if self._prefilled(req, end_s):
                self.decoding.append(req)
        if step.filled:
            self.prefilling = [req for req in self.prefilling if req.prefill_left > 0]
        self.now = end_s
        if self.kv > self.cfg.kv_tokens:
            self._catch_up()
            self._retract()

    def _count(self, step: _Step, total: float) -> None:
        """The run's tallies (SimResult.stats): decode and prefill steps, rows, host time."""
        tally, n_steps = self.tally, step.n_steps
        draws = self._draws(n_steps)
        tally["host_s"] += step.host * float(draws.sum()) + step.first_extra * float(draws[0])
        if step.prefill_only:
            tally["prefill_steps"] += 1
            tally["prefill_s"] += total
            return
        tally["decode_steps"] += n_steps
        tally["decode_s"] += total
        tally["rows_run"] += step.rows * n_steps
        tally["rows_deferred"] += (step.eligible - step.admitted) * n_steps
        tally["subset_steps"] += step.subset * n_steps
        tally["changed_subsets"] += step.changed

    def _advance_serial(self, n_steps: int, end_s: float) -> None:
        """n_steps tokens for every serial row, the last at end_s. While no serial stage closes they
        advance lazily (`lag` tokens since the partition was built, the last at `lag_t`)."""
        ser = self.serial
        if n_steps < self.serial_steps:
            self.lag, self.lag_t = self.lag + n_steps, end_s
            self.serial_ctx += n_steps * len(ser)
            if ser:
                self.serial_steps -= n_steps
            return
        tokens, self.lag = n_steps + self.lag, 0
        ser_ctx, ser_steps = 0, _BIG
        for req in ser:
            req.stage_tok += tokens
            req.last_tok = end_s
            left = req.serial_left = req.serial_left - tokens
            ctx = req.ctx = req.ctx + tokens
            if left == 0:
                self._close_serial(req, end_s)
                continue
            ser_ctx += ctx
            if left < ser_steps:
                ser_steps = left
        self.serial_ctx, self.serial_steps = ser_ctx, ser_steps

    def _advance_phases(self, widths: list[int] | None, n_steps: int, end_s: float) -> None:
        """n_steps steps of each phase's first `width` branches, the last at end_s."""
        for j, req in enumerate(self.phased):
            width = widths[j] if widths else 1
            left = req.branch_left
            if width == 1 and left[0] > n_steps:  # the common case, inlined: no branch ends
                left[0] -= n_steps
                req.branch_ctx[0] += n_steps
                req.phase_tok += n_steps
                req.last_tok = end_s
            else:
                self._advance_phase(req, width, n_steps, end_s)

    def _catch_up(self) -> None:
        """Write the lazily advanced serial tokens into the serial requests."""
        lag, lag_t = self.lag, self.lag_t
        if not lag:
            return
        for req in self.serial:
            req.stage_tok += lag
            req.last_tok = lag_t
            req.serial_left -= lag
            req.ctx += lag
        self.lag = 0

    def _result(self, t_wall: float, t_cpu: float) -> SimResult:
        ctl, drv = self.ctl, self.driver
        stats = {"retractions": self.retractions,
                 "unadmitted": len(self.waiting) + (len(self.specs) - self.next_arrival),
                 "iterations": len(self.log.t_s), "selects": drv.selects,
                 "subset_steps": drv.subset_steps, "max_running": self.running_cap,
                 "wall_s": time.perf_counter() - t_wall, **self.tally,
                 "cpu_s": time.process_time() - t_cpu}
        if ctl.refit is not None and not self.static:
            stats["refits"] = ctl.refit.refits
            model = self.policy.model
            stats["model_after"] = list(model.coefs()) if hasattr(model, "coefs") else model.value_s
        recs = [req.record for req in self.everyone]
        set_max_gaps(recs, self.log, self.now)
        return SimResult(self.policy.name, recs, self.log, stats["wall_s"], stats)

    def _steps_until(self, step: _Step, n_steps: int, span: float) -> int:
        """Fewest of the step's next n_steps steps (>= 1) whose realized latencies add up to span, or
        n_steps: where stepping one by one would first pass it."""
        reached = np.cumsum(self._latencies(step, n_steps)) >= span
        return int(reached.argmax()) + 1 if reached[-1] else n_steps

    def _all_fit_steps(self, step: _Step, n_steps: int) -> int:
        """n_steps if the controller provably admits every ready row in each of the next n_steps
        steps, else 1.

        It admitted everything now; the probe asks whether it admits everything on the window's worst
        case (contexts of the window's last step, today's slack). T is monotone in context and slack
        never shrinks inside the window (serial rows deliver every step; a phase gains >= slo - T per
        step, so we need every step within the SLO), so each step in between has a cheaper
        composition and at least this budget, and "everything fits" holds for it too."""
        over = np.flatnonzero(self._latencies(step, n_steps) > self.cfg.slo_s)
        if len(over):  # keep every step within the SLO
            n_steps = int(over[0])
            if n_steps <= 1:
                return 1
        rows = self.driver.rows(self.phased, self.serial, self.lag, n_steps - 1)
        return n_steps if self.driver.would_admit_all(rows, self.now, len(self.waiting)) else 1

    def _retract(self) -> None:
        """Free the newest requests' KV until the pool fits; they re-prefill what they held."""
        dec, wait = self.decoding, self.waiting
        live = [req for req in dec if not (req.done or req.gated)]
        while self.kv > self.cfg.kv_tokens and len(live) > 1:
            req = live.pop()
            dec.remove(req)
            self.retractions += 1
            req.gone_s = req.last_tok
            held = req.kv
            self.kv -= held
            self.slots -= max(len(req.branch_left), 1)
            req.prefill_left, req.saved_ctx, req.ctx = held, req.ctx, 0
            req.prefill_reqs = max(len(req.branch_left), 1)
            wait.appendleft(req)
        self.dirty = True


def set_max_gaps(recs: list[RequestRecord], log: StepLog, t_end: float) -> None:
    """Each request's largest delivery gap (metrics.RequestRecord.max_gap_s): every decoding request
    gets a token from every step (its serial row or its phase's protected row), so it is the longest
    step that started between its first token and its last, or a retraction gap set on the way."""
    step_t = np.asarray(log.t_s, float)
    step_max_s = np.append(np.asarray(log.max_latency_s, float), 0.0)
    if not len(recs):
        return
    first = np.array([rec.first_token_s for rec in recs], float)
    last = np.array([rec.stages[-1].end_s if rec.stages else rec.first_token_s for rec in recs], float)
    last = np.where([rec.finished for rec in recs], last, t_end)
    start_idx = np.searchsorted(step_t, np.nan_to_num(first, nan=np.inf), side="left")
    end_idx = np.searchsorted(step_t, last, side="left")
    idx = np.empty(2 * len(recs), np.int64)
    idx[0::2], idx[1::2] = np.minimum(start_idx, len(step_t)), np.minimum(end_idx, len(step_t))
    step_max = np.maximum.reduceat(step_max_s, idx)[0::2]
    for rec, start, end, gap in zip(recs, start_idx, end_idx, step_max.tolist(), strict=True):
        if rec.first_token_s != rec.first_token_s:
            continue
        gap = gap if end > start else 0.0
        rec.max_gap_s = gap if not rec.max_gap_s >= gap else rec.max_gap_s


def slo_sized_cap(model: LinearLatencyModel, slo_s: float, specs: list[RequestSpec]) -> int:
    """The operator's sizing rule for --max-running-requests: the most sequences whose step, each at
    a finished request's context (mean prompt + mean output), still meets the TPOT SLO."""
    ctx = np.mean([spec.prompt_tokens + spec.output_tokens for spec in specs]) if specs else 0.0
    per_row = model.c_seq + model.c_ctx * ctx
    return max(1, int((slo_s - model.c0) / per_row)) if per_row > 0 else 1 << 20


def resolve_max_running(spec: str, model: LinearLatencyModel, slo_s: float,
                        specs: list[RequestSpec]) -> int:
    """--max-running: `sglang` (0: SGLang's default for the pool), `slo` (the SLO-sized sensitivity
    cap) or an integer."""
    if spec == "sglang":
        return 0
    if spec == "slo":
        return slo_sized_cap(model, slo_s, specs)
    try:
        cap = int(spec)
    except ValueError:
        cap = 0
    if cap < 1:
        raise ValueError(f"--max-running must be sglang, slo or an integer >= 1, got {spec!r}")
    return cap
