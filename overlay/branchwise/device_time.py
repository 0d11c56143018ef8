"""Each decode step's device time, keyed by forward_iter, for TAPER's refit (scheduler_hook.report_step).

The sources (emulated, cuda; none on CPU) and why by key, never by order: docs/design/code-notes.md.
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
        """Device seconds of the step launched as `forward_iter` (None if none); older pending steps leave."""
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
    """Where this scheduler's step times come from; None: the launch gap (CPU, or an untimed device)."""
    if emulated:
        return EMULATED
    device = str(getattr(scheduler, "device", "") or getattr(scheduler.server_args, "device", ""))
    return CUDA if device.startswith("cuda") else None


def captured_batch_sizes(scheduler: Scheduler) -> tuple[int, ...]:
    """Decode batch sizes SGLang captured as CUDA graphs; () where none were (CPU, --disable-cuda-graph)."""
    runner = getattr(getattr(scheduler, "tp_worker", None), "model_runner", None)
    sizes = getattr(runner, "decode_cuda_graph_capture_bs", None) or ()
    return tuple(sorted({int(size) for size in sizes}))


# ---------------------------------------------------------------- hook body (target in plugin.py)
def around_run_batch(orig: Callable[..., Any], scheduler: Scheduler, batch: ScheduleBatch,
                     *args: Any, **kwargs: Any) -> Any:
    """A real GPU's decode step, timed by events on the stream its forward runs on (TP rank 0)."""
    bw = getattr(scheduler, "branchwise", None)
    state = bw.state if bw is not None else None
    book = state.device_times if state is not None else None
    if book is None or book.source != CUDA or not batch.forward_mode.is_decode():
        return orig(scheduler, batch, *args, **kwargs)
    module = scheduler.device_module
    stream = scheduler.forward_stream if scheduler.enable_overlap else module.current_stream()
    pair = EventPair(module.Event(enable_timing=True), module.Event(enable_timing=True))
    pair.start.record(stream)
    result = orig(scheduler, batch, *args, **kwargs)
    pair.end.record(stream)
    forward_iter = getattr(batch, "forward_iter", None)
    if forward_iter is not None:
        book.put(forward_iter, pair)
    return result
