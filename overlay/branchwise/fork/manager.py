"""One scheduler's server-side fork/join state; the work on it is in lifecycle.py and aborts.py."""

from __future__ import annotations

import functools
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from branchwise.config import BranchwiseConfig
from branchwise.fork.grammars import Detector
from branchwise.fork.limits import ForkLimits
from branchwise.fork.phases import ParallelPhase, PhaseRegistry, Stage, TextStream

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.managers.scheduler import Scheduler

    from branchwise.metrics import BranchwiseMetrics

MAX_DEPTH = 3  # phases nested deeper than this are a grammar error (detector and registry agree)
RECENT = 64  # phase records kept for /server_info
ENC_CACHE = 4096  # encoded texts kept (headers carry client text: the cache must not grow per request)


@dataclass(slots=True, eq=False)
class Track:
    """A tracked sequence's detector and text; where it stands is in its phase, not here."""

    mgr: ForkManager
    req: Req
    det: Detector | None  # None: structure tracking stopped (grammar error, or the sequence ended)
    text: TextStream
    grammar: str
    branch: bool = False  # a server-side branch (internal rid, never streamed to the client)
    close_at: int | None = None  # branch closed by its tag: output text ends here
    close_keep: int = 0
    close_leftover: str = ""
    error: str | None = None  # the first grammar error, until the end puts it into the finish reason

    @property
    def rid(self) -> str:
        return self.req.rid

    @property
    def phase(self) -> ParallelPhase | None:
        """The phase this sequence opened and that is still open."""
        return self.mgr.reg.of_parent(self.req.rid)

    @property
    def waiting(self) -> bool:
        """A parent between its fork and its join: it does not decode."""
        phase = self.phase
        return phase is not None and phase.waiting

    def fail(self, msg: str) -> None:
        """Stop structure tracking; the sequence continues as plain serial text."""
        if self.error is None:
            self.error = msg
        self.det = None

    def undecided(self) -> bool:
        """True while text already decoded may still be cut (a fork, or one waiting for its next char)."""
        return self.waiting or (self.det is not None and self.det.deciding)


class ForkManager:
    """Server-side fork/join state of one scheduler: the registry, counters and text codec."""

    def __init__(self, sched: Scheduler, cfg: BranchwiseConfig) -> None:
        self.sched = sched
        self.cfg = cfg
        self.reg = PhaseRegistry(max_depth=MAX_DEPTH)
        self.stats: Counter[str] = Counter()
        self.recent: deque[dict[str, Any]] = deque(maxlen=RECENT)
        # auto: a request's branches may not claim more decode tokens than the whole KV pool holds
        self.limits = ForkLimits(max_fanout=cfg.branch_max_fanout,
                                 max_branch_tokens=cfg.branch_max_branch_tokens
                                 or getattr(sched, "max_total_num_tokens", None) or 1 << 62)
        # hooks.build hands over taper's, under --enable-metrics)
        self.metrics: BranchwiseMetrics | None = None
        # set by the first tracked request, never reset: until then no output row needs filtering
        self.tracking = False
        self._tok = sched.tokenizer
        self._enc = functools.lru_cache(maxsize=ENC_CACHE)(self._encode_uncached)

    @property
    def max_branch_tokens(self) -> int:
        return self.limits.max_branch_tokens

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)

    def encode(self, text: str) -> list[int]:
        return list(self._enc(text)) if text else []

    def _encode_uncached(self, text: str) -> tuple[int, ...]:
        return tuple(self._tok.encode(text, add_special_tokens=False))

    def busy(self) -> bool:
        """A parent waits at a fork or on its branches (it is in no SGLang queue while parked)."""
        return any(phase.waiting for phase in self.reg.phases.values())

    def pending(self) -> bool:
        """The next scheduling point has a park, a spawn or a join to do."""
        return any(phase.pending for phase in self.reg.phases.values())

    def parked(self) -> list[ParallelPhase]:
        return self.reg.in_state(Stage.PARALLEL)

    def live_branches(self) -> int:
        return sum(len(phase.open_branches) for phase in self.parked())

    def record(self, phase: ParallelPhase) -> dict[str, Any]:
        """The phase's entry in `recent` (/server_info), made on first use."""
        for rec in reversed(self.recent):
            if rec["phase"] == phase.phase_id:
                return rec
        rec = {"phase": phase.phase_id, "parent": phase.parent_rid, "fanout": phase.fanout,
               "depth": phase.depth, "prefix_tokens": phase.prefix_len, "shared_tokens": phase.shared,
               "cached_tokens": [None] * phase.fanout, "reasons": [None] * phase.fanout,
               "joined_tokens": None}
        self.recent.append(rec)
        return rec

    def report(self) -> dict[str, Any]:
        reg = self.reg
        sizes = {"forking": len(reg.in_state(Stage.FORKING)),
                 "join_ready": sum(phase.pending for phase in self.parked()),
                 "by_branch": len(reg.by_branch), "by_parent": len(reg.by_parent),
                 "phase_counts": len(reg.counts), "enc_cache": self._enc.cache_info().currsize}
        return {"counters": dict(self.stats), "parked": len(self.parked()), "open_phases": len(reg),
                "live_branches": self.live_branches(), "sizes": sizes, "recent": list(self.recent),
                "limits": {"max_fanout": self.limits.max_fanout, "max_branch_tokens": self.max_branch_tokens}}
