"""Replay a trace schedule against a live Branchwise server: goodput and SLO attainment per policy.

    python -m bench.replay --url URL --schedule rate:6 --duration-s 60 --out DIR [--policy-label taper]
    python -m bench.replay --launch --model models/tiny --compare --policies off,eager,taper --out runs/bench

Every scheduled arrival (bench.workload: the trace's arrival pattern, the composer's phase structure)
becomes a client-side program shaped like an SGLang frontend fork/join program: a serial stage is one
streamed /generate on the sequence so far; a parallel phase forks one streamed /generate per branch on
the shared prefix plus a branch header (stamped with phase id, branch, fanout and SLO; structured
rids) and joins them in branch order before the next serial stage. Programs send token ids rather
than text so that every shared prefix is exactly what sits in the radix cache. Token delivery times
come from the stream; bench.metrics turns them into goodput, SLO attainment and per-class P99 TPOT
(a stage's TPOT runs from the previous stage's last token, so the client-side fork/join cost counts;
results.json reports those gaps). The step-latency and admission series come from /metrics.

Lengths are scaled to what the server can serve (--output-scale and the caps); decoding is greedy with
ignore_eos, so every stage has a fixed length. The operating point is measured, not assumed: by
default a probe of the first server (decode step latency at 1..32 serial streams of short and long
prompts, fitted as T(S) = c0 + c_seq rows + c_ctx context tokens) sets the SLO to T(--slo-rows rows of
--slo-context tokens) (at least --slo-floor x T(1 row)) and the arrival rate so that the mean demand
is --load x the decode rate at that composition; taper servers get the fit as their --latency-model.
Every server is probed before its run, so a change in the shared box's speed shows in the table.

`run_point` runs one policy at one stationary load on a running server and returns that point's
metrics: the live points of `python -m bench.sweep` (make bench, load sweeps) and of
`python -m bench.capacity --engine replay`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import shlex
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
from tqdm import tqdm

from bench.metrics import RequestRecord, StepLog, headline_cells, headline_head, summarize
from bench.probe import Probe, probe
from bench.workload import (
    PRESETS,
    Regime,
    RequestSpec,
    Schedule,
    TraceError,
    build_schedule,
    compose,
    load_trace,
    stationary_schedule,
    workload_stats,
)
from branchwise import client
from branchwise.client import GenerateError, Generation
from branchwise.launch import LocalServer, ServerError, branchwise_report
from branchwise.taper.predictor import load_model

DEFAULT_TRACE = str(Path(__file__).parent / "data" / "AzureLLMInferenceTrace_conv.csv")
GenerateFn = Callable[..., Awaitable[Generation]]


# ------------------------------------------------------------------------- schedule -> programs
@dataclass(frozen=True, slots=True)
class Scaling:
    """Trace token counts -> what the served model can do: n -> clamp(round(n * scale), 1, cap)."""

    output_scale: float = 0.3
    max_stage_tokens: int = 128  # per serial stage and per branch
    prompt_scale: float = 0.05
    max_prompt_tokens: int = 64
    max_program_tokens: int = 1536  # all stages of one program: the joined context must fit the model

    def __post_init__(self) -> None:
        if not (self.output_scale > 0 and self.prompt_scale > 0 and self.max_stage_tokens >= 1
                and self.max_prompt_tokens >= 1 and self.max_program_tokens >= 1):
            raise ValueError(f"scales must be > 0 and caps >= 1, got {self}")


_DEF = Scaling()


def _scaled(n: int, scale: float, cap: int) -> int:
    return int(min(max(round(n * scale), 1), cap))


def scale_spec(spec: RequestSpec, s: Scaling) -> RequestSpec:
    """The same program with every serial stage and branch length (and the prompt) scaled and capped."""
    def scaled(f: float, cap: int) -> tuple[int | tuple[int, ...], ...]:
        def one(n: int) -> int:
            return _scaled(n, f, cap)

        return tuple(tuple(one(b) for b in st) if isinstance(st, tuple) else one(st) for st in spec.stages)

    f = s.output_scale
    stages = scaled(f, s.max_stage_tokens)
    while (total := RequestSpec("", 0.0, 0, stages).output_tokens) > s.max_program_tokens:
        f *= 0.95 * s.max_program_tokens / total  # shrink the whole program, keeping its shape
        stages = scaled(f, s.max_stage_tokens)
    prompt = _scaled(spec.prompt_tokens, s.prompt_scale, s.max_prompt_tokens)
    return RequestSpec(spec.rid, spec.arrival_s, prompt, stages)


def fit_schedule(trace: Any, spec: str, duration_s: float, rate_scale: float = 1.0) -> Schedule:
    """bench.workload's schedule compressed to `duration_s`, its arrival rates times `rate_scale`.

    The workload's `compress` keeps every rate and shortens the run; a rate scale k then squeezes the
    arrivals k-fold in time, so the paper's regimes keep their shape at k times the paper's req/s."""
    if duration_s <= 0 or rate_scale <= 0:
        raise ValueError(f"duration and rate scale must be > 0, got {duration_s}, {rate_scale}")
    natural = build_schedule(trace, spec).duration_s
    compress = natural / (duration_s * rate_scale)
    if compress < 1.0:
        raise ValueError(f"schedule {spec!r} lasts {natural:.0f} s at its own rate: it cannot fill "
                         f"{duration_s:g} s x rate scale {rate_scale:g}; shorten --duration-s or lower --rate-scale")
    s = build_schedule(trace, spec, compress)
    k = 1.0 / rate_scale
    regimes = tuple(Regime(g.name, g.start_s * k, g.end_s * k) for g in s.regimes)
    name = spec if rate_scale == 1.0 else f"{spec} x{rate_scale:g}"
    return Schedule(s.arrival_s * k, s.row, s.duration_s * k, regimes, name)


def build_programs(trace: Any, schedule: Schedule, preset: str, seed: int, scaling: Scaling) -> list[RequestSpec]:
    return [scale_spec(s, scaling) for s in compose(trace, schedule, preset, seed)]


def prompt_ids(rid: str, tokens: int, seed: int, vocab: int = 400) -> list[int]:
    """A deterministic prompt of random token ids. Programs send token ids, not text, so every
    shared prefix is exactly the tokens in the radix cache (text would be re-tokenized at each seam)."""
    rng = random.Random(f"{seed}:{rid}")
    return [rng.randrange(10, vocab) for _ in range(tokens)]


SEP_ID = 11  # a plain token (ids below 10 may be special): opens a branch header and closes the join


def branch_head(i: int, vocab: int = 400) -> list[int]:
    """The tokens that open branch i after the shared prefix (its header, as in `forks[i] += ...`)."""
    return [SEP_ID, 12 + i % (vocab - 12)]


# ----------------------------------------------------------------------------------- live replay
class RequestFailed(RuntimeError):
    """The server finished a request abnormally (aborted); the program counts as failed."""


@dataclass(slots=True)
class Outcome:
    """One program's deliveries so far: [(parallel, token times since the run start)] per stage."""

    spec: RequestSpec
    stages: list[tuple[bool, list[float]]] = field(default_factory=list)
    started: bool = False
    finished: bool = False
    error: str | None = None

    def record(self) -> RequestRecord:
        return RequestRecord.from_token_times(self.spec.rid, self.spec.arrival_s, self.stages, self.finished)


@dataclass(slots=True)
class Target:
    url: str
    slo_tpot_ms: float
    seed: int = 0
    stream_interval: int = 8  # chunk every n tokens; stage TPOT is exact either way (stage ends are sent at once)
    read_timeout_s: float = 300.0
    vocab: int = 400  # prompt and header token ids are drawn below this
    run_id: str = field(default_factory=lambda: "rp" + uuid.uuid4().hex[:6])
    generate: GenerateFn = client.generate


@dataclass(slots=True)
class Run:
    """One replay against one server, filled in as it goes: an interrupted run keeps what it has."""

    label: str
    outcomes: list[Outcome]
    steps: StepLog = field(default_factory=StepLog)
    t0: float = 0.0
    t_stop: float | None = None  # seconds after t0 when the run ended early (error, Ctrl-C)
    t_end: float | None = None  # seconds after t0 when observation ended (all done, deadline or early stop)
    error: str | None = None  # the run ended early: dead server, Ctrl-C
    warning: str | None = None  # it ran to the end but some programs did not finish in time
    interrupted: bool = False
    report_before: dict | None = None
    report_after: dict | None = None
    loop_lag_s: list[tuple[float, float]] = field(default_factory=list)  # (when, how late) per 50 ms tick

    @property
    def records(self) -> list[RequestRecord]:
        """Every program, started or not: metrics count the ones that arrived in the window, and one
        that never got a token is a miss like any other unfinished one."""
        return [o.record() for o in self.outcomes]


def _sp(tokens: int, tg: Target) -> dict[str, Any]:
    sp: dict[str, Any] = {"max_new_tokens": tokens, "temperature": 0.0, "ignore_eos": True}
    if tg.stream_interval > 1:
        sp["stream_interval"] = tg.stream_interval
    return sp


def token_times(g: Generation, t0: float) -> list[float]:
    """Delivery time of each generated token (a chunk's tokens arrive together), relative to t0."""
    out = [t - t0 for t, n in zip(g.chunk_times, g.chunk_tokens, strict=True) for _ in range(n)]
    return out + [g.end - t0] * max(g.completion_tokens - len(out), 0)


async def _gen(tg: Target, session: Any, ids: list[int], sp: dict, rid: str, tokens: int) -> Generation:
    g = await tg.generate(tg.url, None, sp, rid, True, input_ids=ids, session=session)
    if g.aborted or g.completion_tokens != tokens:
        raise RequestFailed(f"{rid}: {g.completion_tokens}/{tokens} tokens, finish {g.finish_reason}")
    return g


async def run_program(o: Outcome, tg: Target, session: Any, t0: float) -> None:
    """serial stage -> fork(n branches on the shared prefix) -> join (branch order) -> serial stage ..."""
    spec = o.spec
    ids = prompt_ids(spec.rid, spec.prompt_tokens, tg.seed, tg.vocab)
    for k, stage in enumerate(spec.stages):
        if isinstance(stage, int):
            sp = client.stamp_serial(_sp(stage, tg), tg.slo_tpot_ms)
            g = await _gen(tg, session, ids, sp, f"{tg.run_id}-{spec.rid}-s{k}", stage)
            o.stages.append((False, token_times(g, t0)))
            ids = ids + g.output_ids
            continue
        n = len(stage)
        group = client.new_group(f"{tg.run_id}-{spec.rid}-p{k}")
        heads = [branch_head(i, tg.vocab) for i in range(n)]
        tasks = [asyncio.ensure_future(_gen(
            tg, session, ids + heads[i], client.stamp_branch(_sp(m, tg), group, i, n, tg.slo_tpot_ms),
            client.branch_rid(group, i), m)) for i, m in enumerate(stage)]
        try:
            gens = await asyncio.gather(*tasks)
        except BaseException:  # one branch failed or we were cancelled: don't leave siblings running
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        o.stages.append((True, [x for g in gens for x in token_times(g, t0)]))
        ids = ids + [x for h, g in zip(heads, gens, strict=True) for x in h + g.output_ids] + [SEP_ID]
    o.finished = True


async def _program_at(o: Outcome, tg: Target, session: Any, t0: float, bar: tqdm) -> None:
    delay = o.spec.arrival_s - (time.perf_counter() - t0)
    if delay > 0:
        await asyncio.sleep(delay)
    o.started = True
    try:
        await run_program(o, tg, session, t0)
    except (GenerateError, RequestFailed) as e:  # this request's problem: the run goes on
        o.error = str(e)
    except ConnectionError as e:  # a dead server ends the run; a dropped connection only this program
        if not await _alive(tg.url, session):
            raise
        o.error = str(e)
    bar.update()


async def _alive(url: str, session: Any) -> bool:
    try:
        async with session.get(url.rstrip("/") + "/health", timeout=aiohttp.ClientTimeout(total=30)) as r:
            return r.status == 200
    except (aiohttp.ClientError, TimeoutError):
        return False


_METRIC = re.compile(r"^(branchwise:[a-z_]+)(?:\{[^}]*\})?\s+(\S+)$", re.M)
STEP_SERIES = {"count": "branchwise:realized_step_seconds_count", "sum": "branchwise:realized_step_seconds_sum",
               "eligible": "branchwise:candidate_branches_total", "admitted": "branchwise:admitted_branches_total"}


def parse_step_series(text: str) -> dict[str, float] | None:
    """The cumulative Branchwise step series of a /metrics page; None when the server exports none."""
    vals: dict[str, float] = {}
    for name, value in _METRIC.findall(text):
        vals[name] = vals.get(name, 0.0) + float(value)
    if STEP_SERIES["count"] not in vals:
        return None
    return {k: vals.get(name, 0.0) for k, name in STEP_SERIES.items()}


async def poll_steps(run: Run, url: str, session: Any, every_s: float) -> None:
    """Turn /metrics deltas into StepLog rows: steps, mean realized latency, offered/admitted branch rows."""
    prev, t_prev = None, 0.0
    while True:
        try:
            async with session.get(url + "/metrics") as r:
                cur = parse_step_series(await r.text()) if r.status == 200 else None
        except (aiohttp.ClientError, TimeoutError):
            cur = None  # no series (no --enable-metrics) or no server: the step log just stays empty
        now = time.perf_counter() - run.t0
        if cur is not None and prev is not None and cur["count"] > prev["count"]:
            d = {k: cur[k] - prev[k] for k in cur}
            mean = d["sum"] / d["count"]
            run.steps.add(t_prev, int(d["count"]), d["sum"], mean, int(d["eligible"]), int(d["admitted"]))
        if cur is not None:
            prev, t_prev = cur, now
        await asyncio.sleep(every_s)


async def watch_loop(run: Run, every_s: float = 0.05) -> None:
    """The client's own event-loop lag: token times are only as good as the loop that stamps them."""
    while True:
        t = time.perf_counter()
        await asyncio.sleep(every_s)
        run.loop_lag_s.append((t - run.t0, time.perf_counter() - t - every_s))


async def replay(run: Run, tg: Target, deadline_s: float, poll_s: float = 1.0, progress: bool = True) -> None:
    """Start every program at its arrival time; stop at the first dead-server error or at the deadline."""
    run.t0 = t0 = time.perf_counter()
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=tg.read_timeout_s)
    bar = tqdm(total=len(run.outcomes), desc=run.label, unit="req", disable=not progress, leave=False)
    # force_close: no keep-alive reuse, whose race with the server closing an idle connection shows up
    # as "connection reset" on a healthy server (seen with uvicorn under load)
    conn = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(timeout=timeout, connector=conn) as session:
        tasks = [asyncio.create_task(_program_at(o, tg, session, t0, bar)) for o in run.outcomes]
        helpers = [asyncio.create_task(watch_loop(run))]
        if poll_s > 0:
            helpers.append(asyncio.create_task(poll_steps(run, tg.url.rstrip("/"), session, poll_s)))
        try:
            done, pending = await asyncio.wait(tasks, timeout=deadline_s, return_when=asyncio.FIRST_EXCEPTION)
            failed = [t.exception() for t in done if not t.cancelled() and t.exception() is not None]
            if failed:
                run.error = f"{type(failed[0]).__name__}: {failed[0]}"
                run.t_stop = time.perf_counter() - t0
            elif pending:
                run.warning = (f"{len(pending)} of {len(tasks)} programs unfinished {deadline_s:.0f} s after the "
                             f"start: the server is overloaded at this load (lower --load or --rate-scale)")
        except asyncio.CancelledError:  # Ctrl-C: asyncio.run cancels us, then raises KeyboardInterrupt
            run.interrupted, run.t_stop = True, time.perf_counter() - t0
            raise
        finally:
            run.t_end = time.perf_counter() - t0
            for t in [*tasks, *helpers]:
                t.cancel()
            await asyncio.gather(*tasks, *helpers, return_exceptions=True)
            bar.close()


def execute(run: Run, tg: Target, deadline_s: float, poll_s: float = 1.0, progress: bool = True) -> Run:
    """Run `replay` to its end; Ctrl-C ends it early with run.interrupted set and what completed kept."""
    run.report_before = _report(tg.url)
    try:
        asyncio.run(replay(run, tg, deadline_s, poll_s, progress))
    except KeyboardInterrupt:
        run.interrupted = True
        if run.t_stop is None:
            run.t_stop = time.perf_counter() - run.t0
        run.error = run.error or "interrupted (Ctrl-C)"
    run.report_after = _report(tg.url)
    return run


def _report(url: str) -> dict | None:
    try:
        return branchwise_report(url).get("taper")
    except Exception:  # noqa: BLE001 - no server, stock SGLang or no controller: the report is optional
        return None


# ------------------------------------------------------------------------------- one live point
@dataclass(frozen=True, slots=True)
class PointSetup:
    """What every live point of a sweep shares: the workload, the SLO and how long a point runs."""

    trace: Any
    slo_tpot_ms: float
    scaling: Scaling = Scaling(output_scale=1.0, max_stage_tokens=256)
    duration_s: float = 40.0
    drain_s: float = 20.0  # after the last arrival; whatever is unfinished then is a miss
    preset: str = "multiverse"
    slo_ttft_s: float | None = None
    stream_interval: int = 8
    vocab: int = 400
    poll_s: float = 1.0
    generate: GenerateFn = client.generate

    def programs(self, rate: float, seed: int) -> tuple[Schedule, list[RequestSpec]]:
        schedule = stationary_schedule(self.trace, rate, self.duration_s, seed)
        return schedule, build_programs(self.trace, schedule, self.preset, seed, self.scaling)


def flush_cache(url: str, wait_s: float = 120.0) -> bool:
    """Empty the server's radix cache once it is idle (the previous point's aborted requests may
    still be leaving), so that no point starts with another point's prefixes cached. False when it
    stayed busy for `wait_s` or has no such endpoint."""
    end = time.monotonic() + wait_s
    while True:
        try:
            with urllib.request.urlopen(urllib.request.Request(url.rstrip("/") + "/flush_cache", method="POST"),
                                        timeout=30):
                return True
        except urllib.error.HTTPError as e:
            if e.code != 400 or time.monotonic() > end:  # 400: requests still running
                return False
        except (urllib.error.URLError, TimeoutError, ConnectionError):
            return False
        time.sleep(0.5)


def abort_all(url: str) -> None:
    """Ask the server to abort every request (best effort: SGLang also aborts a request whose client
    went away, only later)."""
    req = urllib.request.Request(url.rstrip("/") + "/abort_request", data=b'{"abort_all": true}',
                                 headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=30):
            pass
    except (urllib.error.URLError, TimeoutError, ConnectionError):
        pass


def run_point(url: str, policy: str, rate: float, seed: int, setup: PointSetup,
              progress: bool = False) -> tuple[dict[str, Any], Run]:
    """One policy at one stationary load on a running server: flush its cache, replay `rate` req/s for
    setup.duration_s (+ drain), wait until the server is idle again, and return the point's metrics (bench.capacity's point keys first:
    rate, goodput, attainment over all arrivals, finished fraction, P99 TTFT) and the run."""
    flushed = flush_cache(url)
    schedule, specs = setup.programs(rate, seed)
    run = Run(policy, [Outcome(s) for s in specs])
    tg = Target(url, setup.slo_tpot_ms, seed, setup.stream_interval, vocab=setup.vocab, generate=setup.generate)
    execute(run, tg, schedule.duration_s + setup.drain_s, setup.poll_s, progress)
    # the server drops the abandoned requests (on a shared box its leftover work would slow whatever
    # runs next); the flush then waits until it is idle
    if any(o.started and not o.finished for o in run.outcomes):
        abort_all(url)
    idle = flush_cache(url) if not run.interrupted else False
    res = summarize_run(run, setup.slo_tpot_ms / 1e3, schedule, setup.slo_ttft_s)
    m = point_metrics(rate, res, specs, schedule.duration_s) | {"cache_flushed": flushed, "left_idle": idle}
    if setup.stream_interval > 1:  # a delivery carries n tokens: the per-gap reading does not apply
        m["slo_attainment_gap"] = m["max_gap_p99_ms"] = None
    return m, run


def capacity_engine(a: argparse.Namespace) -> Any:
    """bench.capacity's `--engine replay` (live servers, points from run_point): bench.sweep builds it."""
    from bench.sweep import capacity_engine as live

    return live(a)


POINT_KEYS = ("raw_throughput_tok_s", "slo_attainment_gap", "p99_tpot_serial_ms", "p99_tpot_parallel_ms",
              "max_gap_p99_ms", "ttft_p50_s", "step_latency_mean_ms", "admission_rate")


def point_metrics(rate: float, res: dict[str, Any], specs: list[RequestSpec], duration_s: float) -> dict[str, Any]:
    run = res.get("run", {})
    return {"rate": rate, "goodput_tok_s": res.get("goodput_tok_s"), "attainment": res.get("slo_attainment"),
            "finished_frac": res.get("finished_frac"), "p99_ttft_s": res.get("ttft_p99_s"),
            "requests": res.get("requests", len(specs)), "demand_tok_s": mean_demand_tok_s(specs, duration_s)} | {
        k: res.get(k) for k in POINT_KEYS} | {
        "error": run.get("error"), "warning": run.get("warning"), "server": run.get("server"),
        "client_stalls": run.get("client_stalls")}


# --------------------------------------------------------------------------------- calibration
def mean_demand_tok_s(specs: list[RequestSpec], duration_s: float) -> float:
    return sum(s.output_tokens for s in specs) / duration_s


# ------------------------------------------------------------------------------------- results
def server_delta(before: dict | None, after: dict | None) -> dict[str, Any] | None:
    """The scheduler's TAPER counters over this run (the server may have served other work before)."""
    if not after:
        return None
    b = before or {}
    keys = ("steps", "planned_steps", "rows_run", "rows_deferred", "candidates", "admitted")
    d: dict[str, Any] = {k: after.get(k, 0) - b.get(k, 0) for k in keys}
    d["admission_rate"] = d["admitted"] / d["candidates"] if d["candidates"] else None
    d["policy"], d["planner_ms_mean"], d["model"] = after.get("policy"), after.get("planner_ms_mean"), after.get("model")
    return d


def stage_gaps_ms(outcomes: list[Outcome]) -> dict[str, float | None]:
    """Client-side fork/join cost: previous stage's last token -> a stage's first token (HTTP round
    trip, queueing, prefill of the branch headers or of the joined text). Chained into stage TPOT."""
    gaps: dict[bool, list[float]] = {True: [], False: []}
    for o in outcomes:
        prev = None
        for par, ts in o.stages:
            if ts:
                if prev is not None:
                    gaps[par].append(min(ts) - prev)
                prev = max(ts)
    out: dict[str, float | None] = {}
    for name, par in (("fork", True), ("join", False)):
        g = np.asarray(gaps[par])
        for q in (50, 99):
            out[f"{name}_gap_p{q}_ms"] = float(np.percentile(g, q) * 1e3) if len(g) else None
    return out


def client_stalls(lags: list[tuple[float, float]], over_s: float = 0.1) -> dict[str, float | int]:
    """How long this process's event loop could not stamp deliveries: a starved client (a busy shared
    box) delays every chunk it reads, and the stages in flight absorb the delay into their TPOT."""
    late = [d for _, d in lags if d > over_s]
    return {"max_ms": 1e3 * max((d for _, d in lags), default=0.0), "over_100ms": len(late),
            "stalled_s": sum(late)}


def summarize_run(run: Run, slo_s: float, schedule: Schedule, slo_ttft_s: float | None = None) -> dict[str, Any]:
    """The simulator's per-policy results (bench.metrics.summarize) plus the replay's bookkeeping."""
    end = schedule.duration_s if run.t_stop is None else min(schedule.duration_s, run.t_stop)
    window = (0.0, max(end, 1e-9))
    regimes = [(g.name, g.start_s, min(g.end_s, end)) for g in schedule.regimes if g.start_s < end]
    recs = run.records
    horizon = run.t_end if run.t_end is not None else window[1]
    out = (summarize(recs, slo_s, window, regimes, run.steps, slo_ttft_s=slo_ttft_s, horizon_s=horizon)
           if recs else _empty(regimes))
    srv = server_delta(run.report_before, run.report_after)
    out["admission_rate"] = srv["admission_rate"] if srv else out.get("admission_rate")
    started = [o for o in run.outcomes if o.started]
    errors = [o.error for o in started if o.error]
    out["run"] = {
        "programs": len(run.outcomes), "started": len(started),
        "finished": sum(o.finished for o in started), "failed": len(errors),
        "first_failure": errors[0] if errors else None, "error": run.error, "warning": run.warning,
        "interrupted": run.interrupted,
        "window_s": window[1], "server": srv, "stage_gaps": stage_gaps_ms(started),
        "client_stalls": client_stalls(run.loop_lag_s),
    }
    out["partial"] = run.interrupted or run.t_stop is not None
    return out


def _empty(regimes: list[tuple[str, float, float]]) -> dict[str, Any]:
    keys = ("goodput_tok_s", "raw_throughput_tok_s", "slo_attainment", "p99_tpot_serial_ms", "p99_tpot_parallel_ms")
    return {k: None for k in keys} | {"per_regime": {g: {} for g, _, _ in regimes}}


@dataclass(slots=True)
class _Plotted:  # what bench.plots reads from a run
    records: list[RequestRecord]
    steps: StepLog


def write_results(out: Path, results: dict[str, dict], config: dict, partial: bool, wall_s: float) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    doc = {"policies": results, "config": config, "partial": partial, "wall_s": wall_s}
    path = out / "results.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, indent=1, default=float))
    tmp.replace(path)  # a Ctrl-C mid-write never leaves a truncated results.json
    return path


def write_records(out: Path, runs: dict[str, Run]) -> Path:
    """Raw per-program token delivery times (seconds from the run start), for offline analysis."""
    doc = {k: {"programs": [{"rid": o.spec.rid, "arrival_s": o.spec.arrival_s, "stages_spec": o.spec.stages,
                             "finished": o.finished, "error": o.error,
                             "stages": [[par, [round(t, 6) for t in ts]] for par, ts in o.stages]}
                            for o in r.outcomes if o.started],
               "client_stalls": [[round(t, 3), round(d, 4)] for t, d in r.loop_lag_s if d > 0.1],
               "steps": {k2: list(v) for k2, v in r.steps.arrays().items()}} for k, r in runs.items()}
    out.mkdir(parents=True, exist_ok=True)
    path = out / "records.json"
    path.write_text(json.dumps(doc))
    return path


def _fmt(x: float | None, pct: bool = False, nd: int = 1) -> str:
    if x is None:
        return "-"
    return f"{100 * x:.{nd}f}%" if pct else f"{x:.{nd}f}"


def _ratio(r: dict, base: dict | None) -> float | None:
    g, b = r.get("goodput_tok_s"), (base or {}).get("goodput_tok_s")
    return g / b if g is not None and b else None


def table(results: dict[str, dict]) -> str:
    off, eager = results.get("off"), results.get("eager")
    head = (f"{'policy':<10}{'goodput':>9}{'x off':>7}{'x eager':>8}{'raw tok/s':>10}{headline_head()}"
            f"{'P99 ser':>8}{'P99 par':>8}{'step ms':>8}{'admit':>7}{'done':>9}{'probe ms':>9}")
    lines = [head, "-" * len(head)]
    for k, r in results.items():
        run = r.get("run", {})
        done = f"{run.get('finished', 0)}/{run.get('started', 0)}"
        lines.append(
            f"{k:<10}{_fmt(r.get('goodput_tok_s')):>9}{_fmt(_ratio(r, off), nd=2):>7}"
            f"{_fmt(_ratio(r, eager), nd=2):>8}{_fmt(r.get('raw_throughput_tok_s')):>10}"
            f"{headline_cells(r)}{_fmt(r.get('p99_tpot_serial_ms')):>8}"
            f"{_fmt(r.get('p99_tpot_parallel_ms')):>8}{_fmt(r.get('step_latency_mean_ms')):>8}"
            f"{_fmt(r.get('admission_rate'), True, 0):>7}{done:>9}"
            f"{_fmt((run.get('probe') or {}).get('at_slo_rows_ms')):>9}")
    return "\n".join(lines)


def stall_note(results: dict[str, dict], worst_s: float = 0.25) -> str | None:
    st = {k: r.get("run", {}).get("client_stalls") or {} for k, r in results.items()}
    bad = {k: v for k, v in st.items() if v.get("max_ms", 0) > 1e3 * worst_s}
    if not bad:
        return None
    return ("note: the client was starved of CPU (" + ", ".join(
        f"{k}: {v['over_100ms']} stalls > 100 ms, worst {v['max_ms']:.0f} ms" for k, v in bad.items()) +
        "): deliveries in flight were stamped late, which inflates those stages' TPOT")


def drift_note(results: dict[str, dict], tolerance: float = 0.3) -> str | None:
    """Policies run one after another: say so when the machine's speed moved in between."""
    t = {k: (r.get("run", {}).get("probe") or {}).get("at_slo_rows_ms") for k, r in results.items()}
    t = {k: v for k, v in t.items() if v}
    if len(t) > 1 and max(t.values()) > (1 + tolerance) * min(t.values()):
        return ("note: the probed step latency moved between policy runs (" +
                ", ".join(f"{k} {v:.1f} ms" for k, v in t.items()) + "): the box's load changed; compare with care")
    return None


def regime_table(results: dict[str, dict]) -> str:
    names = list(dict.fromkeys(g for r in results.values() for g in r.get("per_regime", {})))
    if len(names) < 2:
        return ""
    head = f"{'attain':<10}" + "".join(f"{g:>12}" for g in names)
    rows = [f"{k:<10}" + "".join(f"{_fmt(r['per_regime'].get(g, {}).get('slo_attainment'), True):>12}"
                                 for g in names) for k, r in results.items()]
    return "\n".join([head, "-" * len(head), *rows])


# ------------------------------------------------------------------------------------------- CLI
@dataclass(slots=True)
class Point:
    """The operating point: SLO and arrival-rate scale, given or calibrated from a probe."""

    slo_tpot_ms: float
    rate_scale: float
    latency_model: str | None = None  # T(S) JSON passed to --launch servers
    probe: Probe | None = None


def solve_rate_scale(target: float, demand: Callable[[float], float], tries: int = 16) -> float:
    """The rate scale whose schedule demands closest to `target` tok/s. Demand is only roughly linear in
    the scale (each scale draws other programs and lengths), so iterate and keep the best."""
    k, best = 1.0, (float("inf"), 1.0)
    for _ in range(tries):
        d = demand(k)
        best = min(best, (abs(d - target), k))
        if best[0] <= 0.02 * target:
            break
        k *= (target / max(d, 1e-9)) ** 0.8  # damped: a jump can land on a run of long programs
    return best[1]


def calibrate(a: argparse.Namespace, trace: Any, scaling: Scaling, p: Probe, out: Path) -> Point:
    """Fill every `auto` from the probe: SLO = T(slo_rows), but at least slo_floor x T(1) (a stage's
    TPOT also carries per-forward costs that do not grow with rows: prefills of arriving requests,
    scheduling); rate scale such that the mean demanded token rate is `load` x the tokens/s the
    server delivers at slo_rows rows; T(S) = the probe's line."""
    t_slo = p.at(a.slo_rows, a.slo_context)
    slo_ms = a.slo_tpot_ms if a.slo_tpot_ms is not None else 1e3 * p.auto_slo_s(a.slo_rows, a.slo_context, a.slo_floor)
    rs = a.rate_scale
    if rs is None:
        rs = solve_rate_scale(a.load * a.slo_rows / t_slo, lambda k: mean_demand_tok_s(
            build_programs(trace, fit_schedule(trace, a.schedule, a.duration_s, k), a.preset, a.seed, scaling),
            a.duration_s))
    model = a.latency_model if a.launch and a.latency_model not in ("auto", "none") else None
    if a.launch and a.latency_model == "auto":
        out.mkdir(parents=True, exist_ok=True)
        model = str(out / "latency_model.json")
        p.model.save(model)
    return Point(slo_ms, rs, model, p)


def _auto_float(text: str) -> float | None:
    if text == "auto":
        return None
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or 'auto', got {text!r}") from None
    if not v > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text!r}")
    return v


def server_args(policy: str, a: argparse.Namespace, pt: Point | None) -> list[str]:
    args = ["--branch-policy", policy, "--taper-rho", f"{a.taper_rho:g}", "--enable-metrics"]
    if pt is not None:  # requests carry their SLO stamp anyway; the flag covers unstamped ones
        args += ["--branch-slo-tpot-ms", f"{pt.slo_tpot_ms:.6g}"]
        if pt.latency_model:
            args += ["--latency-model", pt.latency_model]
    return args + shlex.split(a.server_args)


def _server(a: argparse.Namespace, args: list[str]) -> LocalServer:
    # torch's OpenMP threads spin at barriers: on a box shared with other servers and the client,
    # more threads than free cores makes every step many times slower (measured: 8x at 64 rows)
    env = {"OMP_NUM_THREADS": str(a.server_threads)} if a.server_threads else {}
    return LocalServer(a.model, args, env=env, max_total_tokens=a.max_total_tokens)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.replay", description=__doc__.split("\n\n")[0])
    where = ap.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", help="a running server (its --branch-policy is fixed)")
    where.add_argument("--launch", action="store_true", help="start a server per policy (branchwise.launch)")
    ap.add_argument("--model", default="models/tiny", help="with --launch")
    ap.add_argument("--compare", action="store_true", help="run the schedule once per --policies")
    ap.add_argument("--policies", default="off,eager,taper")
    ap.add_argument("--policy-label", help="name of a single --url run (default: the server's policy)")
    ap.add_argument("--trace", default=DEFAULT_TRACE)
    ap.add_argument("--schedule", default="paper-3regime", help="unscaled | rate:X | paper-3regime")
    ap.add_argument("--duration-s", type=float, default=60.0, help="the schedule is compressed to this")
    ap.add_argument("--drain-s", type=float, default=30.0, help="wait this long after the schedule for stragglers")
    ap.add_argument("--preset", default="multiverse", choices=sorted(PRESETS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--output-scale", type=float, default=_DEF.output_scale)
    ap.add_argument("--max-stage-tokens", type=int, default=_DEF.max_stage_tokens)
    ap.add_argument("--prompt-scale", type=float, default=_DEF.prompt_scale)
    ap.add_argument("--max-prompt-tokens", type=int, default=_DEF.max_prompt_tokens)
    ap.add_argument("--max-program-tokens", type=int, default=_DEF.max_program_tokens)
    g = ap.add_argument_group("operating point (auto: calibrated from a probe of the first server)")
    g.add_argument("--slo-tpot-ms", type=_auto_float, default=None, help="ms | auto: the probed step latency at --slo-rows")
    g.add_argument("--rate-scale", type=_auto_float, default=None,
                   help="arrival rates x this | auto: mean demand = --load x the probed tokens/s at --slo-rows")
    g.add_argument("--slo-rows", type=float, default=32.0)
    g.add_argument("--slo-context", type=float, default=256.0,
                   help="KV tokens per row for the auto SLO (the default workload decodes at 250-310 on average)")
    g.add_argument("--slo-floor", type=float, default=2.5, help="auto SLO >= this x the probed T(1)")
    g.add_argument("--load", type=_auto_float, default=0.35,
                   help="mean demanded tok/s as a fraction of the probed decode rate at the SLO composition "
                        "(the 3-regime schedule peaks at ~2x its mean); load sweeps: python -m bench.sweep")
    g.add_argument("--latency-model", default="auto",
                   help="T(S) JSON for --launch servers | auto: the probe's fit | none: server default, refit online")
    ap.add_argument("--taper-rho", type=float, default=0.8, help="with --launch")
    ap.add_argument("--server-args", default="", help="extra flags for --launch servers")
    ap.add_argument("--max-total-tokens", type=int, default=65536,
                    help="KV pool of --launch servers: room for every live prefix, so no policy pays re-prefills")
    ap.add_argument("--vocab", type=int, default=400, help="prompt token ids are drawn below this")
    ap.add_argument("--server-threads", type=int, default=1, help="OMP threads of --launch servers; 0: torch's default")
    ap.add_argument("--stream-interval", type=int, default=8,
                    help="chunk every n tokens: 8x less detokenize/HTTP work; stage TPOT stays exact")
    ap.add_argument("--out", required=True)
    ap.add_argument("--poll-s", type=float, default=1.0, help="server /metrics poll period; 0: no step series")
    ap.add_argument("--no-plots", action="store_true")
    ap.add_argument("--no-progress", action="store_true")
    a = ap.parse_args(argv)
    if a.load is None:
        ap.error("--load takes a number > 0")
    return a


def _needs_probe(a: argparse.Namespace) -> bool:
    return a.slo_tpot_ms is None or a.rate_scale is None or (a.launch and a.latency_model == "auto")


def _probe_url(url: str) -> Probe:
    p = asyncio.run(probe(url))
    print(f"probe {url}: {p.line()}", flush=True)
    return p


@dataclass(slots=True)
class Bench:
    """One invocation: the operating point once known, and what each policy's run produced."""

    a: argparse.Namespace
    trace: Any
    scaling: Scaling
    out: Path
    pt: Point | None = None
    schedule: Schedule | None = None
    specs: list[RequestSpec] = field(default_factory=list)
    config: dict[str, Any] = field(default_factory=dict)
    results: dict[str, dict] = field(default_factory=dict)
    runs: dict[str, Run] = field(default_factory=dict)
    t_wall: float = field(default_factory=time.perf_counter)

    def point(self, p: Probe | None) -> Point:
        if self.pt is None:
            self.pt = calibrate(self.a, self.trace, self.scaling, p, self.out)
        if self.schedule is None:
            self.schedule, self.specs, self.config = _prepare(self.a, self.trace, self.scaling, self.pt)
        return self.pt

    def run_policy(self, policy: str) -> bool:
        """Start (or reuse) the server, probe it, replay; False when the whole bench must stop."""
        a = self.a
        server = _server(a, server_args(policy, a, self.pt)) if a.launch else None
        stop = False
        try:
            url = server.start().url if server else a.url
            p = _probe_url(url) if a.launch else (self.pt.probe if self.pt else None)
            pt = self.point(p)  # the first (non-taper) server calibrates the operating point
            policy = policy or (_report(url) or {}).get("policy") or "server"  # --url: the server's own
            run = Run(policy, [Outcome(s) for s in self.specs])
            tg = Target(url, pt.slo_tpot_ms, a.seed, a.stream_interval, vocab=a.vocab)
            execute(run, tg, self.schedule.duration_s + a.drain_s, a.poll_s, progress=not a.no_progress)
            res = summarize_run(run, pt.slo_tpot_ms / 1e3, self.schedule)
            res["run"]["probe"] = p.as_dict() | {"at_slo_rows_ms": 1e3 * p.at(a.slo_rows, a.slo_context)} if p else None
            self.runs[policy], self.results[policy] = run, res
            stop = run.interrupted or (run.error is not None and not a.launch)
            if run.warning:
                print(f"{policy}: warning: {run.warning}", file=sys.stderr)
        except (ServerError, ConnectionError, RuntimeError) as e:  # start, probe or a bug in between
            self.results[policy] = {"run": {"error": f"{type(e).__name__}: {e}"}, "partial": True}
        except KeyboardInterrupt:  # during a server start or probe
            self.results[policy] = {"run": {"error": "interrupted (Ctrl-C)", "interrupted": True}, "partial": True}
            stop = True
        finally:
            if server is not None:
                server.stop()
        if err := self.results[policy].get("run", {}).get("error"):
            print(f"{policy}: {err}", file=sys.stderr)
        return not stop

    def save(self, expected: int, stopped: bool) -> None:
        if self.schedule is None:
            return
        partial = stopped or any(r.get("partial") for r in self.results.values()) or len(self.results) < expected
        write_results(self.out, self.results, self.config, partial, time.perf_counter() - self.t_wall)
        write_records(self.out, self.runs)

    def report(self, plots: bool) -> None:
        if plots and self.runs:
            from bench.plots import plot_run

            plot_run({k: _Plotted(r.records, r.steps) for k, r in self.runs.items()}, self.schedule,
                     self.pt.slo_tpot_ms / 1e3, self.out)
        print(table(self.results))
        for extra in (regime_table(self.results), drift_note(self.results), stall_note(self.results)):
            if extra:
                print("\n" + extra)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    try:
        trace = load_trace(a.trace)
        fit_schedule(trace, a.schedule, a.duration_s, a.rate_scale or 1.0)  # a bad schedule fails now
        scaling = Scaling(a.output_scale, a.max_stage_tokens, a.prompt_scale, a.max_prompt_tokens,
                          a.max_program_tokens)
        if a.latency_model not in ("auto", "none"):
            load_model(a.latency_model)
    except (TraceError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    policies = [p.strip() for p in a.policies.split(",") if p.strip()] if a.compare else [a.policy_label or ""]
    if a.url and a.compare:
        pol = (_report(a.url) or {}).get("policy") or "unknown"
        print(f"note: --url {a.url}: the server's policy is fixed ({pol}); running once as {pol!r}. "
              f"Use --launch to compare policies.")
        policies = [a.policy_label or pol]
    b = Bench(a, trace, scaling, Path(a.out))
    try:  # taper's server needs the T(S) fit at start: calibrate on an off server first
        if not _needs_probe(a):
            b.pt = Point(a.slo_tpot_ms, a.rate_scale, a.latency_model if a.launch and a.latency_model != "none" else None)
        elif a.launch and policies[0].startswith("taper"):
            with _server(a, ["--branch-policy", "off"]) as srv:
                b.point(_probe_url(srv.url))
        elif a.url:
            b.point(_probe_url(a.url))
    except (ServerError, ConnectionError, RuntimeError) as e:
        print(f"error: calibration failed: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted during calibration; nothing measured", file=sys.stderr)
        return 130
    return run_bench(b, policies)


def run_bench(b: Bench, policies: list[str]) -> int:
    """Every policy at one operating point; partial results are saved after each. Exit code."""
    stopped = False
    for policy in policies:
        stopped = not b.run_policy(policy)
        b.save(len(policies), stopped)
        if stopped:
            break
    if b.schedule is None:
        print("error: no run started", file=sys.stderr)
        return 1
    b.report(not b.a.no_plots)
    failed = any(r.get("run", {}).get("error") for r in b.results.values())
    print(f"\nwall {time.perf_counter() - b.t_wall:.0f} s -> {b.out / 'results.json'}"
          + (" (PARTIAL)" if failed or stopped else ""))
    if stopped and any(r.get("run", {}).get("interrupted") for r in b.results.values()):
        return 130
    return 1 if failed else 0


def _prepare(a: argparse.Namespace, trace: Any, scaling: Scaling,
             pt: Point) -> tuple[Schedule, list[RequestSpec], dict[str, Any]]:
    schedule = fit_schedule(trace, a.schedule, a.duration_s, pt.rate_scale)
    specs = build_programs(trace, schedule, a.preset, a.seed, scaling)
    wl = workload_stats(specs)
    config = {
        "trace": a.trace, "schedule": schedule.name, "duration_s": schedule.duration_s,
        "rate_scale": pt.rate_scale, "preset": a.preset, "seed": a.seed, "scaling": asdict(scaling),
        "slo_tpot_ms": pt.slo_tpot_ms, "slo_rows": a.slo_rows if a.slo_tpot_ms is None else None,
        "slo_floor": a.slo_floor if a.slo_tpot_ms is None else None,
        "slo_context": a.slo_context if a.slo_tpot_ms is None else None,
        "load": a.load if a.rate_scale is None else None, "demand_tok_s": mean_demand_tok_s(specs, schedule.duration_s),
        "taper_rho": a.taper_rho if a.launch else None, "latency_model": pt.latency_model,
        "calibration_probe": pt.probe.as_dict() if pt.probe else None,
        "server": ("launch " + a.model) if a.launch else a.url, "server_threads": a.server_threads if a.launch else None,
        "stream_interval": a.stream_interval, "workload": wl,
        "step_series": "server /metrics deltas, polled every 1 s",
    }
    print(f"{len(specs)} programs over {schedule.duration_s:.0f} s ({schedule.name}), "
          f"{config['demand_tok_s']:.0f} tok/s demanded, SLO {pt.slo_tpot_ms:.1f} ms, "
          f"{wl['pdr']:.0%} decomposable, ABF {wl['abf']:.1f}", flush=True)
    return schedule, specs, config


if __name__ == "__main__":
    raise SystemExit(main())
