"""Phase-affine data-parallel dispatch: every request of one phase goes to one DP rank.
Design: docs/design/dp-dispatch.md."""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Container
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from branchwise import request_meta
from branchwise.request_meta import affinity_key

if TYPE_CHECKING:
    from sglang.srt.managers.data_parallel_controller import DataParallelController
    from sglang.srt.managers.io_struct import TokenizedGenerateReqInput
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.managers.scheduler import Scheduler

    from branchwise.config import BranchwiseConfig

logger = logging.getLogger(__name__)

MAX_PHASES = 4096  # keys remembered by the controller (oldest evicted)
MAX_REPORTED = 256  # phases a scheduler lists in /server_info (its most recent)


# ---- pure logic ----------------------------------------------------------------------------------
@dataclass
class PhaseRanks:
    """Affinity key -> DP rank, least recently used evicted past `capacity`."""

    capacity: int = MAX_PHASES
    ranks: OrderedDict[str, int] = field(default_factory=OrderedDict)
    routed: int = 0  # requests sent to their key's remembered rank
    placed: int = 0  # first requests of a key, placed by the configured method
    evicted: int = 0
    replaced: int = 0  # remembered rank no longer active: placed afresh

    def __post_init__(self) -> None:
        if self.capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {self.capacity}")

    def lookup(self, key: str, active: Container[int]) -> int | None:
        """The remembered rank of `key` if it is still in `active`, else None (and forget it)."""
        rank = self.ranks.get(key)
        if rank is None:
            return None
        if rank not in active:
            del self.ranks[key]
            self.replaced += 1
            return None
        self.ranks.move_to_end(key)
        self.routed += 1
        return rank

    def remember(self, key: str, rank: int) -> None:
        self.ranks[key] = rank
        self.ranks.move_to_end(key)
        self.placed += 1
        while len(self.ranks) > self.capacity:
            self.ranks.popitem(last=False)
            self.evicted += 1

    def report(self) -> dict[str, int]:
        return {"keys": len(self.ranks), "routed": self.routed, "placed": self.placed,
                "evicted": self.evicted, "replaced": self.replaced}


class WorkerLog(list):
    """The controller's worker-socket list, noting the last index read. Every SGLang dispatch method
    sends with `sock_send(self.workers[rank], req)`, so after a dispatch `last` is the rank it chose."""

    last: int | None = None

    def __getitem__(self, index: Any) -> Any:  # an int or a slice, as list's
        if isinstance(index, int):
            self.last = index
        return super().__getitem__(index)


@dataclass
class PhaseRows:
    """A scheduler's per-phase row counts for /server_info (most recent MAX_REPORTED phases)."""

    capacity: int = MAX_REPORTED
    rows: OrderedDict[str, int] = field(default_factory=OrderedDict)

    def add(self, phase: str) -> None:
        self.rows[phase] = self.rows.get(phase, 0) + 1
        self.rows.move_to_end(phase)
        while len(self.rows) > self.capacity:
            self.rows.popitem(last=False)


# ---- DataParallelController hooks (DP controller process) ----------------------------------------
def after_controller_init(result: None, ctl: DataParallelController, *args: Any, **kwargs: Any) -> None:
    ctl.workers = WorkerLog(ctl.workers)
    ctl._branchwise_phase_ranks = PhaseRanks()


def _key_of(req: object) -> str | None:
    try:
        custom = getattr(getattr(req, "sampling_params", None), "custom_params", None)
        return affinity_key(custom, getattr(req, "routing_key", None))
    except Exception:  # never let a request's content break the controller's loop
        return None


def around_dispatching_with_trace(orig: Callable[..., None], ctl: DataParallelController,
                                  req: TokenizedGenerateReqInput, *args: Any, **kwargs: Any) -> None:
    """Send a keyed request to its key's rank; let SGLang place a key's first request and note where."""
    phases: PhaseRanks | None = getattr(ctl, "_branchwise_phase_ranks", None)
    if phases is None or getattr(req, "routed_dp_rank", None) is not None:
        return orig(ctl, req, *args, **kwargs)
    key = _key_of(req)
    if key is None:
        return orig(ctl, req, *args, **kwargs)
    rank = phases.lookup(key, ctl._active_workers)
    if rank is not None:
        req.routed_dp_rank = rank
        return orig(ctl, req, *args, **kwargs)
    workers = ctl.workers
    workers.last = None
    out = orig(ctl, req, *args, **kwargs)
    if isinstance(workers, WorkerLog) and workers.last is not None:
        phases.remember(key, workers.last)
    return out


# ---- Scheduler side (per DP rank): which rank this is, and which phases it served ---------------
@dataclass
class SchedulerDp:
    """A scheduler's part of DP dispatch, for /server_info (runtime.Branchwise.dp)."""

    dp_rank: int
    phase_rows: PhaseRows = field(default_factory=PhaseRows)

    def on_request_created(self, req: Req) -> None:
        """After scheduler_hook has set `req.bw_meta`."""
        phase = request_meta.of(req).phase
        if phase:
            self.phase_rows.add(phase)

    def report(self) -> dict[str, Any]:
        """Merged into the scheduler's "branchwise" report."""
        return {"dp_rank": self.dp_rank, "phase_rows": dict(self.phase_rows.rows)}


def build(scheduler: Scheduler, config: BranchwiseConfig) -> SchedulerDp:
    from branchwise.metrics import current_dp_rank

    return SchedulerDp(dp_rank=current_dp_rank())
