"""The composition root: one `Branchwise` per SGLang Scheduler, at `scheduler.branchwise`.

Build order, which hooks live here, and the step timer's bench modes: docs/design/code-notes.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from branchwise import emulated_device, metrics, scheduler_hook, step_timer, support
from branchwise.albireo import async_output, forward_thread, sp_sampler_hook
from branchwise.config import BranchwiseConfig
from branchwise.fork import hooks as fork
from branchwise.ingress import dp_dispatch

if TYPE_CHECKING:
    from sglang.srt.managers.io_struct import GetInternalStateReqOutput, TokenizedGenerateReqInput
    from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
    from sglang.srt.managers.scheduler import Scheduler

    from branchwise.albireo.async_output import AsyncOutput
    from branchwise.albireo.forward_thread import ForwardExecutor
    from branchwise.albireo.sp_sampler_hook import SPState
    from branchwise.device_model import DeviceStream
    from branchwise.fork.manager import ForkManager
    from branchwise.ingress.dp_dispatch import SchedulerDp
    from branchwise.scheduler_hook import BranchwiseState
    from branchwise.step_timer import StepTimer


@dataclass(slots=True, eq=False, kw_only=True)
class Branchwise:
    """Everything Branchwise keeps for one scheduler; a None field is a component that is off."""

    config: BranchwiseConfig
    state: BranchwiseState | None = None  # per-step branch admission (scheduler_hook)
    fork: ForkManager | None = None
    dp: SchedulerDp | None = None
    async_output: AsyncOutput | None = None  # Albireo: result processing off the critical path
    forward: ForwardExecutor | None = None  # Albireo: forwards on a worker thread (CPU)
    sampler: SPState | None = None
    timer: StepTimer | None = None
    device: DeviceStream | None = None  # --emulate-device: forwards complete at a modeled GPU's time

    def report(self) -> dict[str, Any]:
        """/server_info's internal_state entries, under the keys each component has always used."""
        rep: dict[str, Any] = {}
        if self.state is not None:
            rep["branchwise"] = self.state.report()
            if self.dp is not None:
                rep["branchwise"].update(self.dp.report())
        for key, part in (("branchwise_fork", self.fork), ("branchwise_async_output", self.async_output),
                          ("branchwise_forward_thread", self.forward),
                          ("branchwise_parallel_sampling", self.sampler), ("emulated_device", self.device)):
            if part is not None:
                rep[key] = part.report()
        return rep


def of(scheduler: Scheduler) -> Branchwise | None:
    return getattr(scheduler, "branchwise", None)


def build(scheduler: Scheduler) -> Branchwise:
    """Parse the settings once and build the components, in this order (each may read the earlier)."""
    mode = step_timer.enabled()
    bw = Branchwise(config=BranchwiseConfig.from_server_args(scheduler.server_args))
    scheduler.branchwise = bw  # first: a component may read the ones built before it there
    bw.device = emulated_device.build(scheduler, bw.config)  # in every mode: the device under them all
    if mode not in ("stock", "albireo"):
        support.guard_scheduler(scheduler, bw.config)
        bw.state = scheduler_hook.build(scheduler, bw.config)
        bw.fork = fork.build(scheduler, bw.config)
        bw.dp = dp_dispatch.build(scheduler, bw.config)
    if mode != "stock":
        bw.async_output = async_output.build(scheduler, bw.config)
        bw.forward = forward_thread.build(scheduler, bw.config)
        bw.sampler = sp_sampler_hook.build(scheduler, bw.config)
    if mode:  # last: it hands itself to the async output sender and the forward thread
        bw.timer = step_timer.build(scheduler, bw.config)
    return bw


def after_scheduler_init(result: None, scheduler: Scheduler, *args: Any, **kwargs: Any) -> None:
    build(scheduler)


def after_get_internal_state(result: GetInternalStateReqOutput, scheduler: Scheduler,
                             *args: Any, **kwargs: Any) -> GetInternalStateReqOutput:
    bw = of(scheduler)
    state = getattr(result, "internal_state", None)
    if bw is not None and isinstance(state, dict):
        state.update(bw.report())
    return result


def after_create_generation_req(req: Req, scheduler: Scheduler, recv_req: TokenizedGenerateReqInput,
                                *args: Any, **kwargs: Any) -> Req:
    """A new client request: taper parses `req.bw_meta` first; fork and dp then read it."""
    bw = of(scheduler)
    if bw is None or bw.state is None:
        return req
    scheduler_hook.on_request_created(bw.state, req)
    fork.after_create_generation_req(req, scheduler, recv_req, *args, **kwargs)
    if bw.dp is not None:
        bw.dp.on_request_created(req)
    return req


def after_add_request_to_queue(result: None, scheduler: Scheduler, req: Req, *args: Any, **kwargs: Any) -> None:
    """A request entered the waiting queue: the metrics count it and follow it to its SLO verdict."""
    bw = of(scheduler)
    if bw is not None and bw.state is not None and bw.state.metrics is not None:
        metrics.on_queued(bw.state.metrics, req, bw.config)
    return result


def after_process_batch_result(result: object, scheduler: Scheduler, batch: ScheduleBatch,
                               *args: Any, **kwargs: Any) -> object:
    """TAPER's deliveries and refit (scheduler_hook), then the per-step series of every policy."""
    result = scheduler_hook.after_process_batch_result(result, scheduler, batch, *args, **kwargs)
    state = scheduler_hook.state_of(scheduler)
    if state is not None and state.metrics is not None:
        metrics.observe_batch(state.metrics, batch, state.controller is not None)
    return result
