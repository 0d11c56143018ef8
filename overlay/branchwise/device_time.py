"""Each decode step's device time, paired with that step, for TAPER's refit (scheduler_hook.report_step).

The refit learns T(S) from realized steps, so each latency it takes must be the time the device spent
on one step, booked with that step's own composition. SGLang's overlap loop launches step k+1 before
it processes step k's result, so a step's time is kept under its key, `batch.forward_iter` (set by
run_batch, kept by the `batch.copy()` the loop processes), and taken by that key: never by order.
Where the time comes from (`source_of`):
- `emulated` (--emulate-device): the forward's modeled duration, known at launch; emulated_device.py
  puts it here.
- `cuda` (a real GPU): two timing events on the stream the forward runs on, recorded around
  run_batch (`around_run_batch`, TP rank 0); they are read when the result is processed, after
  SGLang's copy-done wait, so reading them does not stall the loop. The span is the device's, from
  the previous forward's end (or this launch, if the device idled) to this step's output copy.
- none (CPU): report_step keeps the gap between two decode launches. The forward runs inline in
  run_batch on the scheduler thread, so that gap is the step's forward plus the scheduler's own
  work for it, which a CPU cannot overlap: nothing else is the step's time there.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.managers.scheduler import Scheduler

EMULATED = "emulated"
CUDA = "cuda"
MAX_PENDING = 64  # steps in flight are 2 under overlap: more means results that never come back


class TimingEvent(Protocol):
    """What `around_run_batch` needs of a device event (torch.cuda.Event with enable_timing)."""

    def record(self, stream: Any = None) -> None: ...

    def synchronize(self) -> None: ...

    def elapsed_time(self, end: Any) -> float: ...  # milliseconds from self to end


@dataclass(slots=True, frozen=True)
class EventPair:
    start: TimingEvent
    end: TimingEvent

    def seconds(self) -> float:
        self.end.synchronize()  # done already: SGLang waited on the copy recorded just before it
        return self.start.elapsed_time(self.end) / 1e3


@dataclass(slots=True)
class StepDeviceTimes:
    """Device time per launched decode step, by forward_iter, until that step's result is processed."""

    source: str
    pending: dict[int, float | EventPair] = field(default_factory=dict)
    dropped: int = 0  # steps whose result never came back (or came back before a step's time was put)

    def put(self, forward_iter: int, seconds: float | EventPair) -> None:
        if len(self.pending) >= MAX_PENDING:
            del self.pending[min(self.pending)]
            self.dropped += 1
        self.pending[forward_iter] = seconds

    def take(self, forward_iter: int | None) -> float | None:
        """The device seconds of the step launched as `forward_iter` (None if none was put); older
        steps still pending leave too (their results were processed without a decode report)."""
        if forward_iter is None:
            return None
        got = self.pending.pop(forward_iter, None)
        stale = [it for it in self.pending if it < forward_iter]
        for it in stale:
            del self.pending[it]
        self.dropped += len(stale)
        if got is None:
            return None
        return got.seconds() if isinstance(got, EventPair) else got

    def report(self) -> dict[str, Any]:
        return {"source": self.source, "pending": len(self.pending), "dropped": self.dropped}


def source_of(scheduler: Scheduler, emulated: bool) -> str | None:
    """Where this scheduler's step times come from; None: the launch gap (CPU, or a device whose
    events are not known to time a forward here)."""
    if emulated:
        return EMULATED
    device = str(getattr(scheduler, "device", "") or getattr(scheduler.server_args, "device", ""))
    return CUDA if device.startswith("cuda") else None


def captured_batch_sizes(scheduler: Scheduler) -> tuple[int, ...]:
    """The decode batch sizes SGLang captured as CUDA graphs (a decode step replays at the next one
    up; past the largest it runs eagerly); () where none were captured (CPU, --disable-cuda-graph)."""
    runner = getattr(getattr(scheduler, "tp_worker", None), "model_runner", None)
    sizes = getattr(runner, "decode_cuda_graph_capture_bs", None) or ()
    return tuple(sorted({int(size) for size in sizes}))


# ---------------------------------------------------------------- hook body (target in plugin.py)
def around_run_batch(orig: Callable[..., Any], self: Scheduler, batch: ScheduleBatch,
                     *args: Any, **kwargs: Any) -> Any:
    """A real GPU's decode step, timed by events on the stream its forward runs on (TP rank 0)."""
    bw = getattr(self, "branchwise", None)
    taper = bw.taper if bw is not None else None
    book = taper.device_times if taper is not None else None
    if book is None or book.source != CUDA or not batch.forward_mode.is_decode():
        return orig(self, batch, *args, **kwargs)
    module = self.device_module
    stream = self.forward_stream if self.enable_overlap else module.current_stream()
    pair = EventPair(module.Event(enable_timing=True), module.Event(enable_timing=True))
    pair.start.record(stream)
    result = orig(self, batch, *args, **kwargs)
    pair.end.record(stream)
    forward_iter = getattr(batch, "forward_iter", None)
    if forward_iter is not None:
        book.put(forward_iter, pair)
    return result
