"""Per-iteration time split of the SGLang scheduler loop: a diagnostics instrument (benchmarks only).
Design: docs/design/step-timer.md."""

from __future__ import annotations

import json
import os
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.managers.scheduler_components.output_streamer import SchedulerOutputStreamer
    from sglang.srt.model_executor.model_runner import ModelRunner

    from branchwise.config import BranchwiseConfig

# Branchwise's own per-step work, carved out of the SGLang span it runs in (PARENT)
TAPER_SPANS = ("taper_rows", "taper_plan", "taper_planner", "taper_subset", "taper_deliver")
PARENT = MappingProxyType({"taper_rows": "sched", "taper_plan": "sched", "taper_planner": "sched",
                          "taper_subset": "sched", "taper_deliver": "result"})
SPANS = ("recv", "sched", "prep", "forward", "sample", "result", "stream", *TAPER_SPANS)
ENV = "BRANCHWISE_STEP_TIMER"
FILE_ENV = "BRANCHWISE_STEP_TIMER_FILE"
PROFILE_ENV = "BRANCHWISE_STEP_TIMER_PROFILE"  # a path: cProfile busy iterations, dump there when idle
FLUSH_EVERY = 2048


def enabled() -> str | None:
    """None, "1" (with Branchwise), "stock" (timer only) or "albireo" (timer + Albireo's hooks)."""
    value = os.environ.get(ENV, "").strip().lower()
    return value if value in ("1", "stock", "albireo") else None


def records_path(port: int | str, tp_rank: int = 0) -> str:
    """Where a server's scheduler (TP rank `tp_rank`) writes; FILE_ENV overrides the directory."""
    folder = os.environ.get(FILE_ENV) or tempfile.gettempdir()
    return os.path.join(folder, f"branchwise-steps-{port}-tp{tp_rank}.jsonl")


def _batch_key(batch: ScheduleBatch | None) -> list[Any] | None:
    if batch is None:
        return None
    return [batch.forward_mode.name.lower(), batch.batch_size()]


@dataclass(slots=True)
class StepTimer:
    path: str
    t0: float = 0.0
    spans: dict[str, float] = field(default_factory=lambda: dict.fromkeys(SPANS, 0.0))
    cpu0: float = 0.0
    cpu: dict[str, float] = field(default_factory=lambda: dict.fromkeys(SPANS, 0.0))
    stack: list[list[Any]] = field(default_factory=list)  # [name, start, child, cpu start, cpu child]
    run: list[Any] | None = None
    res: list[Any] | None = None
    worker_s: float = 0.0
    fwd: dict[str, float] = field(default_factory=dict)  # forward-thread spans + idle ("fidle"), "fjobs"
    owner: int = field(default_factory=threading.get_ident)  # the scheduler thread
    lock: threading.Lock = field(default_factory=threading.Lock)
    buf: list[str] = field(default_factory=list)
    profile: Any = None
    profiled: bool = False
    launch: list[Any] | None = None
    tags: dict[str, Any] = field(default_factory=dict)
    schedstat: int | None = None  # fd of the scheduler thread's /proc/thread-self/schedstat
    runq0: int = 0

    def __post_init__(self) -> None:
        if os.environ.get(PROFILE_ENV):
            import cProfile

            self.profile = cProfile.Profile()
        try:
            self.schedstat = os.open("/proc/thread-self/schedstat", os.O_RDONLY)
        except OSError:  # not Linux: no run-queue figure
            self.schedstat = None

    def _runq_ns(self) -> int:
        """The thread's total wait on a run queue (ns): time it was ready but another task had the core."""
        if self.schedstat is None:
            return 0
        return int(os.pread(self.schedstat, 64, 0).split()[1])

    def begin_iteration(self, now: float) -> None:
        cpu_now, runq_now = time.thread_time(), self._runq_ns()
        if self.t0:
            rec = {"wall": now - self.t0, **self.spans, "run": self.run, "res": self.res,
                   "cpu": {**self.cpu, "wall": cpu_now - self.cpu0}, "runq": 1e-9 * (runq_now - self.runq0),
                   "launch": self.launch, "tags": self.tags}
            with self.lock:
                rec["worker"], self.worker_s = self.worker_s, 0.0
                fwd, self.fwd = self.fwd, {}
            if fwd:
                rec["forward"] += fwd.get("forward", 0.0)
                rec["sample"] += fwd.get("sample", 0.0)
                rec["fthread"] = {"idle": fwd.get("fidle", 0.0), "jobs": fwd.get("fjobs", 0)}
            self.buf.append(json.dumps(rec))
            idle = self.run is None and self.res is None
            if len(self.buf) >= FLUSH_EVERY or idle:
                self.flush()  # idle iterations cost nothing to the measured steps
            if self.profile is not None:
                self._profile(idle)
        self.t0, self.cpu0, self.runq0 = now, cpu_now, runq_now
        self.spans = dict.fromkeys(SPANS, 0.0)
        self.cpu = dict.fromkeys(SPANS, 0.0)
        self.run = self.res = self.launch = None
        self.tags = {}

    def _profile(self, idle: bool) -> None:
        self.profile.disable()
        if not idle:
            self.profile.enable()
            self.profiled = True
        elif self.profiled:  # one dump per busy period (a write-then-rename: readers never see half)
            path = os.environ[PROFILE_ENV]
            self.profile.dump_stats(path + ".tmp")
            os.replace(path + ".tmp", path)
            self.profiled = False

    def enter(self, name: str) -> None:
        self.stack.append([name, time.perf_counter(), 0.0, time.thread_time(), 0.0])

    def exit(self) -> None:
        name, start, child, cpu_start, cpu_child = self.stack.pop()
        dt, dcpu = time.perf_counter() - start, time.thread_time() - cpu_start
        self.spans[name] += dt - child
        self.cpu[name] += dcpu - cpu_child
        if self.stack:
            self.stack[-1][2] += dt
            self.stack[-1][4] += dcpu

    def carve(self, name: str, dt: float) -> None:
        """Move `dt` seconds of the innermost open span to `name` (a sub-interval timed elsewhere,
        e.g. the controller's own planner clock; its CPU share is taken as equal to its wall)."""
        if not self.t0 or not self.stack:
            return
        self.spans[name] += dt
        self.cpu[name] += dt
        self.stack[-1][2] += dt
        self.stack[-1][4] += dt

    def tag(self, name: str, n: int = 1) -> None:
        self.tags[name] = self.tags.get(name, 0) + n

    def add_worker(self, dt: float) -> None:
        with self.lock:
            self.worker_s += dt

    def add_forward(self, name: str, dt: float) -> None:
        """A span measured on the forward thread (counted in the iteration in progress)."""
        with self.lock:
            self.fwd[name] = self.fwd.get(name, 0.0) + dt

    def add_forward_idle(self, dt: float) -> None:
        with self.lock:
            self.fwd["fidle"] = self.fwd.get("fidle", 0.0) + dt
            self.fwd["fjobs"] = self.fwd.get("fjobs", 0) + 1

    def report(self) -> dict[str, Any]:
        """Nothing for `/server_info`: the records go to `path` (bench.overhead reads them)."""
        return {}

    def flush(self) -> None:
        if self.buf:
            with open(self.path, "a") as records:
                records.write("\n".join(self.buf) + "\n")
            self.buf.clear()


# Module-level helpers for Branchwise's own code: each is a no-op without a timer (normal serving).
def switch(timer: StepTimer | None, name: str | None) -> None:
    """Close the TAPER span open on top of the stack (if any) and open `name` (None: only close)."""
    if timer is None or not timer.t0:
        return
    if timer.stack and timer.stack[-1][0] in TAPER_SPANS:
        timer.exit()
    if name is not None:
        timer.enter(name)


def carve(timer: StepTimer | None, name: str, dt: float) -> None:
    if timer is not None:
        timer.carve(name, dt)


def tag(timer: StepTimer | None, name: str, n: int = 1) -> None:
    if timer is not None:
        timer.tag(name, n)


def _timed(timer: StepTimer | None, name: str, orig: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    if timer is None or not timer.t0:
        return orig(*args, **kwargs)
    if threading.get_ident() != timer.owner:  # the forward thread: its own clock, no shared span stack
        t0 = time.perf_counter()
        try:
            return orig(*args, **kwargs)
        finally:
            timer.add_forward(name, time.perf_counter() - t0)
    timer.enter(name)
    try:
        return orig(*args, **kwargs)
    finally:
        timer.exit()


ATTR = "_branchwise_step_timer"  # on the model runner and the tree cache


def build(scheduler: Scheduler, config: BranchwiseConfig | None) -> StepTimer | None:
    """The scheduler's step timer (None unless env BRANCHWISE_STEP_TIMER is set), with a fresh records
    file and the server's settings beside it (`path + ".meta.json"`)."""
    from sglang.srt.runtime_context import get_parallel

    if enabled() is None:
        return None
    path = records_path(scheduler.server_args.port, get_parallel().tp_rank)
    open(path, "w").close()
    with open(path + ".meta.json", "w") as meta_file:
        json.dump({"port": scheduler.server_args.port,
                   "config": config.as_dict() if config is not None else None}, meta_file)
    timer = StepTimer(path)
    setattr(scheduler.tp_worker.model_runner, ATTR, timer)
    setattr(scheduler.tree_cache, ATTR, timer)
    bw = scheduler.branchwise
    for part in (getattr(bw.async_output, "sender", None), bw.forward):  # Albireo's worker threads
        if part is not None:
            part.timer = timer
    return timer


# ---- hook bodies (targets named in plugin.py) ----

def around_ingest(orig: Callable[..., Any], scheduler: Scheduler, *args: Any, **kwargs: Any) -> Any:
    timer = scheduler.branchwise.timer
    if timer is not None:
        timer.begin_iteration(time.perf_counter())
    return _timed(timer, "recv", orig, scheduler, *args, **kwargs)


def around_get_next_batch(orig: Callable[..., Any], scheduler: Scheduler, *args: Any, **kwargs: Any) -> Any:
    return _timed(scheduler.branchwise.timer, "sched", orig, scheduler, *args, **kwargs)


def around_run_batch(orig: Callable[..., Any], scheduler: Scheduler, batch: ScheduleBatch,
                     *args: Any, **kwargs: Any) -> Any:
    timer = scheduler.branchwise.timer
    if timer is None:
        return orig(scheduler, batch, *args, **kwargs)
    timer.run = _batch_key(batch)
    try:
        return _timed(timer, "prep", orig, scheduler, batch, *args, **kwargs)
    finally:
        timer.launch = [getattr(batch, "forward_iter", None), getattr(batch, "launch_ts", None)]


def around_forward(orig: Callable[..., Any], runner: ModelRunner, *args: Any, **kwargs: Any) -> Any:
    return _timed(getattr(runner, ATTR, None), "forward", orig, runner, *args, **kwargs)


def around_sample(orig: Callable[..., Any], runner: ModelRunner, *args: Any, **kwargs: Any) -> Any:
    return _timed(getattr(runner, ATTR, None), "sample", orig, runner, *args, **kwargs)


def around_process_batch_result(orig: Callable[..., Any], scheduler: Scheduler, batch: ScheduleBatch,
                                *args: Any, **kwargs: Any) -> Any:
    timer = scheduler.branchwise.timer
    if timer is not None:
        timer.res = _batch_key(batch)
    return _timed(timer, "result", orig, scheduler, batch, *args, **kwargs)


def around_stream_output(orig: Callable[..., Any], streamer: SchedulerOutputStreamer,
                         *args: Any, **kwargs: Any) -> Any:
    return _timed(getattr(streamer.tree_cache, ATTR, None), "stream", orig, streamer, *args, **kwargs)
