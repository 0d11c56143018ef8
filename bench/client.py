"""The live client: runs programs (bench.programs) on a server at their arrival times and stamps
every token.

A serial stage is one streamed /generate on the sequence so far; a parallel phase forks one streamed
/generate per branch on the shared prefix plus a branch header (stamped with phase id, branch,
fanout and SLO; structured rids) and joins them in branch order before the next serial stage.
Decoding is greedy with ignore_eos, so every stage has a fixed length. Each token's delivery time
comes from the stream (a chunk's tokens arrive together). A `Run` is filled in as it goes, so a run
that ends early (a dead server, Ctrl-C) keeps what completed.

Alongside the programs two helpers run: a /metrics poller that turns the server's cumulative step
series into `StepLog` rows (steps, mean realized latency, offered and admitted branch rows), and a
watch on the client's own event loop (token times are only as good as the loop that stamps them).
"""

from __future__ import annotations

import asyncio
import re
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from tqdm import tqdm

from bench.metrics import RequestRecord, StepLog
from bench.programs import SEP_ID, branch_head, prompt_ids
from bench.workload import RequestSpec
from branchwise import client as bw
from branchwise.client import GenerateError, Generation
from branchwise.tools.launch import branchwise_report, metrics_url

GenerateFn = Callable[..., Awaitable[Generation]]
SamplesFn = Callable[..., Awaitable[list[Generation]]]


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
    # chunk every n tokens; stage TPOT is exact either way (stage ends are sent at once)
    stream_interval: int = 8
    read_timeout_s: float = 300.0
    vocab: int = 400  # prompt and header token ids are drawn below this
    run_id: str = field(default_factory=lambda: "rp" + uuid.uuid4().hex[:6])
    generate: GenerateFn = bw.generate
    samples: SamplesFn = bw.generate_samples  # best-of-n programs: one request with n samples


@dataclass(slots=True)
class Run:
    """One replay against one server, filled in as it goes: an interrupted run keeps what it has."""

    label: str
    outcomes: list[Outcome]
    steps: StepLog = field(default_factory=StepLog)
    t0: float = 0.0
    t_stop: float | None = None  # seconds after t0 when the run ended early (error, Ctrl-C)
    # seconds after t0 when observation ended (all done, deadline or early stop)
    t_end: float | None = None
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
        return [outcome.record() for outcome in self.outcomes]


# ------------------------------------------------------------------------------------ one program
def _sp(tokens: int, target: Target) -> dict[str, Any]:
    sampling: dict[str, Any] = {"max_new_tokens": tokens, "temperature": 0.0, "ignore_eos": True}
    if target.stream_interval > 1:
        sampling["stream_interval"] = target.stream_interval
    return sampling


def token_times(gen: Generation, run_start: float) -> list[float]:
    """Delivery time of each generated token (a chunk's tokens arrive together), relative to
    run_start (the run's perf_counter origin)."""
    out = [chunk_t - run_start for chunk_t, count in zip(gen.chunk_times, gen.chunk_tokens, strict=True)
           for _ in range(count)]
    return out + [gen.end - run_start] * max(gen.completion_tokens - len(out), 0)


async def _gen(target: Target, session: Any, ids: list[int], sampling: dict, rid: str,
               tokens: int, route: str) -> Generation:
    """One streamed stage or branch; `route`: its program's router key (every request of a program
    reaches one worker behind a router, where its prefix is cached)."""
    gen = await target.generate(target.url, None, sampling, rid, True, input_ids=ids, session=session,
                                routing_key=route)
    if gen.aborted or gen.completion_tokens != tokens:
        raise RequestFailed(f"{rid}: {gen.completion_tokens}/{tokens} tokens, finish {gen.finish_reason}")
    return gen


async def _fork_join(target: Target, session: Any, ids: list[int], group: str, lengths: tuple[int, ...],
                     route: str) -> tuple[list[Generation], list[list[int]]]:
    """One parallel phase: a stamped request per branch on the shared prefix, gathered in branch order."""
    fanout = len(lengths)
    heads = [branch_head(i, target.vocab) for i in range(fanout)]
    tasks = [asyncio.ensure_future(_gen(
        target, session, ids + heads[i], bw.stamp_branch(_sp(length, target), group, i, fanout,
                                                         target.slo_tpot_ms),
        bw.branch_rid(group, i), length, route)) for i, length in enumerate(lengths)]
    try:
        return list(await asyncio.gather(*tasks)), heads
    except BaseException:  # one branch failed or we were cancelled: don't leave siblings running
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


async def _samples(outcome: Outcome, target: Target, session: Any, ids: list[int], run_start: float) -> None:
    """A best-of-n program (spec.samples: stages (1, (m,) * n)): one streamed request with n samples of
    1 + m tokens each, which the server makes one phase; its tokens are the program's one parallel stage."""
    (first, phase) = outcome.spec.stages
    tokens = first + phase[0]
    sampling = bw.stamp_serial(_sp(tokens, target), target.slo_tpot_ms) | {"n": len(phase)}
    gens = await target.samples(target.url, None, sampling, f"{target.run_id}-{outcome.spec.rid}",
                                input_ids=ids, session=session)
    for gen in gens:
        if gen.aborted or gen.completion_tokens != tokens:
            raise RequestFailed(f"{gen.rid}: {gen.completion_tokens}/{tokens} tokens, "
                                f"finish {gen.finish_reason}")
    outcome.stages.append((True, [t_s for gen in gens for t_s in token_times(gen, run_start)]))
    outcome.finished = True


async def run_program(outcome: Outcome, target: Target, session: Any, run_start: float) -> None:
    """serial stage -> fork(n branches on the shared prefix) -> join (branch order) -> serial stage ...
    (or, for a best-of-n spec, one request with n samples)."""
    spec = outcome.spec
    ids = prompt_ids(spec.rid, spec.prompt_tokens, target.seed, target.vocab)
    if spec.samples:
        return await _samples(outcome, target, session, ids, run_start)
    route = f"{target.run_id}-{spec.rid}"
    for stage_no, stage in enumerate(spec.stages):
        if isinstance(stage, int):
            sampling = bw.stamp_serial(_sp(stage, target), target.slo_tpot_ms)
            gen = await _gen(target, session, ids, sampling, f"{route}-s{stage_no}", stage, route)
            outcome.stages.append((False, token_times(gen, run_start)))
            ids = ids + gen.output_ids
            continue
        group = bw.new_group(f"{route}-p{stage_no}")
        gens, heads = await _fork_join(target, session, ids, group, stage, route)
        outcome.stages.append((True, [t_s for gen in gens for t_s in token_times(gen, run_start)]))
        joined = [tok for head, gen in zip(heads, gens, strict=True) for tok in head + gen.output_ids]
        ids = ids + joined + [SEP_ID]
    outcome.finished = True


async def _program_at(outcome: Outcome, target: Target, session: Any, run_start: float, bar: tqdm) -> None:
    delay = outcome.spec.arrival_s - (time.perf_counter() - run_start)
    if delay > 0:
        await asyncio.sleep(delay)
    outcome.started = True
    try:
        await run_program(outcome, target, session, run_start)
    except (GenerateError, RequestFailed) as err:  # this request's problem: the run goes on
        outcome.error = str(err)
    except ConnectionError as err:  # a dead server ends the run; a dropped connection only this program
        if not await _alive(target.url, session):
            raise
        outcome.error = str(err)
    bar.update()


async def _alive(url: str, session: Any) -> bool:
    try:
        async with session.get(url.rstrip("/") + "/health", timeout=aiohttp.ClientTimeout(total=30)) as resp:
            return resp.status == 200
    except (aiohttp.ClientError, TimeoutError):
        return False


# ----------------------------------------------------------------------------- /metrics and loop
_METRIC = re.compile(r"^(branchwise:[a-z_]+)(?:\{[^}]*\})?\s+(\S+)$", re.M)
STEP_SERIES = {"count": "branchwise:realized_step_seconds_count",
               "sum": "branchwise:realized_step_seconds_sum",
               "eligible": "branchwise:candidate_branches_total",
               "admitted": "branchwise:admitted_branches_total"}


def parse_step_series(text: str) -> dict[str, float] | None:
    """The cumulative Branchwise step series of a /metrics page; None when the server exports none."""
    vals: dict[str, float] = {}
    for name, value in _METRIC.findall(text):
        vals[name] = vals.get(name, 0.0) + float(value)
    if STEP_SERIES["count"] not in vals:
        return None
    return {key: vals.get(name, 0.0) for key, name in STEP_SERIES.items()}


async def poll_steps(run: Run, url: str, session: Any, every_s: float) -> None:
    """Turn /metrics deltas into StepLog rows: steps, mean realized latency, offered/admitted branch rows."""
    prev, t_prev = None, 0.0
    url = await asyncio.to_thread(metrics_url, url)  # a router's: every worker's series
    while True:
        try:
            async with session.get(url) as resp:
                cur = parse_step_series(await resp.text()) if resp.status == 200 else None
        except (aiohttp.ClientError, TimeoutError):
            cur = None  # no series (no --enable-metrics) or no server: the step log just stays empty
        now = time.perf_counter() - run.t0
        if cur is not None and prev is not None and cur["count"] > prev["count"]:
            delta = {key: cur[key] - prev[key] for key in cur}
            mean = delta["sum"] / delta["count"]
            run.steps.add(t_prev, int(delta["count"]), delta["sum"], mean, int(delta["eligible"]),
                          int(delta["admitted"]))
        if cur is not None:
            prev, t_prev = cur, now
        await asyncio.sleep(every_s)


async def watch_loop(run: Run, every_s: float = 0.05) -> None:
    """The client's own event-loop lag: token times are only as good as the loop that stamps them."""
    while True:
        tick = time.perf_counter()
        await asyncio.sleep(every_s)
        run.loop_lag_s.append((tick - run.t0, time.perf_counter() - tick - every_s))


# ----------------------------------------------------------------------------------- one replay
async def _await_programs(run: Run, tasks: list[asyncio.Task], deadline_s: float) -> None:
    """Wait for every program until the deadline; the first exception (a dead server) ends the run."""
    done, pending = await asyncio.wait(tasks, timeout=deadline_s, return_when=asyncio.FIRST_EXCEPTION)
    failed = [task.exception() for task in done if not task.cancelled() and task.exception() is not None]
    if failed:
        run.error = f"{type(failed[0]).__name__}: {failed[0]}"
        run.t_stop = time.perf_counter() - run.t0
    elif pending:
        run.warning = (f"{len(pending)} of {len(tasks)} programs unfinished {deadline_s:.0f} s after the "
                       f"start: the server is overloaded at this load (lower --load or --rate-scale)")


async def replay(run: Run, target: Target, deadline_s: float, poll_s: float = 1.0,
                 progress: bool = True) -> None:
    """Start every program at its arrival time; stop at the first dead-server error or at the deadline."""
    run.t0 = run_start = time.perf_counter()
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=target.read_timeout_s)
    bar = tqdm(total=len(run.outcomes), desc=run.label, unit="req", disable=not progress, leave=False)
    # force_close: no keep-alive reuse, whose race with the server closing an idle connection shows up
    # as "connection reset" on a healthy server (seen with uvicorn under load)
    conn = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(timeout=timeout, connector=conn) as session:
        tasks = [asyncio.create_task(_program_at(outcome, target, session, run_start, bar))
                 for outcome in run.outcomes]
        helpers = [asyncio.create_task(watch_loop(run))]
        if poll_s > 0:
            helpers.append(asyncio.create_task(poll_steps(run, target.url.rstrip("/"), session, poll_s)))
        try:
            await _await_programs(run, tasks, deadline_s)
        except asyncio.CancelledError:  # Ctrl-C: asyncio.run cancels us, then raises KeyboardInterrupt
            run.interrupted, run.t_stop = True, time.perf_counter() - run_start
            raise
        finally:
            run.t_end = time.perf_counter() - run_start
            for task in [*tasks, *helpers]:
                task.cancel()
            await asyncio.gather(*tasks, *helpers, return_exceptions=True)
            bar.close()


def execute(run: Run, target: Target, deadline_s: float, poll_s: float = 1.0, progress: bool = True) -> Run:
    """Run `replay` to its end; Ctrl-C ends it early with run.interrupted set and what completed kept."""
    run.report_before = server_report(target.url)
    try:
        asyncio.run(replay(run, target, deadline_s, poll_s, progress))
    except KeyboardInterrupt:
        run.interrupted = True
        if run.t_stop is None:
            run.t_stop = time.perf_counter() - run.t0
        run.error = run.error or "interrupted (Ctrl-C)"
    run.report_after = server_report(target.url)
    return run


# ------------------------------------------------------------------------------ server controls
def server_report(url: str) -> dict | None:
    """The server's TAPER counters (/server_info); None without a server or a controller."""
    try:
        return branchwise_report(url).get("taper")
    except Exception:  # noqa: BLE001 - no server, stock SGLang or no controller: the report is optional
        return None


def flush_cache(url: str, wait_s: float = 120.0) -> bool:
    """Empty the server's radix cache once it is idle (the previous point's aborted requests may
    still be leaving), so that no point starts with another point's prefixes cached. False when it
    stayed busy for `wait_s` or has no such endpoint."""
    end = time.monotonic() + wait_s
    while True:
        try:
            req = urllib.request.Request(url.rstrip("/") + "/flush_cache", method="POST")
            with urllib.request.urlopen(req, timeout=30):
                return True
        except urllib.error.HTTPError as err:
            if err.code != 400 or time.monotonic() > end:  # 400: requests still running
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
