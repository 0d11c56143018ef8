"""What the per-step planner sees: one snapshot of the decode batch, and what it returns.

Pure data, no SGLang import: the scheduler hook and the simulator both build these.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain

import numpy as np


@dataclass(frozen=True, slots=True)
class RequestView:
    """One active request in the running batch at this step.

    A request in a serial stage has one ready row. A request in a parallel phase has one row per
    ready (unfinished, not blocked) branch; the first row is the protected one, the rest are
    opportunistic candidates in the order the hook would admit them.
    """

    rid: str
    context_lens: tuple[int, ...]  # KV length of each ready row; len >= 1
    slack_s: float  # residual TPOT slack in seconds (may be negative)
    weight: float = 1.0  # priority weight for the "priority" utility
    phase_id: str | None = None  # None: serial stage
    phase_fanout: int = 1  # branches the phase announced (>= ready rows)
    fixed_width: int | None = None  # taper-no-replan: width committed at phase start
    slo_s: float | None = None  # the request's TPOT target (taper's SLO-pace terms); None: unknown

    @property
    def ready(self) -> int:
        return len(self.context_lens)


@dataclass(frozen=True, slots=True)
class BatchView:
    requests: tuple[RequestView, ...]
    extra_tokens: int = 0  # tokens in the same forward that are not decode rows (mixed prefill)
    waiting: int = 0  # requests queued for admission (the backlog; see policies.py)


@dataclass(frozen=True, slots=True, eq=False)
class ArrayBatch:
    """The same snapshot as a BatchView, as flat arrays: what the planner computes on.

    Producers that already hold per-row numbers (the scheduler hook, the benchmark) build this
    directly and skip one Python object per request; `from_view` converts a BatchView.
    """

    rids: Sequence[str]  # n requests
    ready: np.ndarray  # int64[n], ready rows per request (>= 1)
    ctx: np.ndarray  # int64[sum(ready)], row context lengths, request-major, protected row first
    slack_s: np.ndarray  # float64[n]
    weight: np.ndarray | None = None  # float64[n]; None: all 1.0
    phase: np.ndarray | None = None  # bool[n], in a parallel phase; None: none is
    fixed_width: np.ndarray | None = None  # int64[n], 0 = not pinned (taper-no-replan)
    extra_tokens: int = 0
    slo_s: np.ndarray | None = None  # float64[n], each request's TPOT target; None: unknown (paper rule)
    waiting: int = 0  # requests queued for admission (SGLang's waiting queue): the backlog
    gap_slack_s: np.ndarray | None = None  # float64[n], slack_s read per gap (the paper's serial slack)

    def __post_init__(self) -> None:
        n = len(self.rids)
        if self.ready.shape != (n,) or self.slack_s.shape != (n,):
            raise ValueError(f"ArrayBatch: ready and slack_s need one entry per request ({n})")
        if n and int(self.ready.min()) < 1:
            raise ValueError("ArrayBatch: every request needs at least one ready row")
        if self.ctx.shape != (int(self.ready.sum()),):
            raise ValueError("ArrayBatch: ctx needs one entry per ready row (sum of ready)")
        for name in ("weight", "phase", "fixed_width", "slo_s", "gap_slack_s"):
            a = getattr(self, name)
            if a is not None and a.shape != (n,):
                raise ValueError(f"ArrayBatch: {name} needs one entry per request ({n})")

    @classmethod
    def from_view(cls, batch: BatchView) -> ArrayBatch:
        reqs = batch.requests
        n = len(reqs)
        lens = [r.context_lens for r in reqs]
        fixed = [r.fixed_width or 0 for r in reqs]
        slo = [r.slo_s for r in reqs]
        return cls(
            [r.rid for r in reqs], np.fromiter(map(len, lens), np.int64, n),
            np.fromiter(chain.from_iterable(lens), np.int64),
            np.array([r.slack_s for r in reqs], dtype=np.float64),
            np.array([r.weight for r in reqs], dtype=np.float64),
            np.array([r.phase_id is not None for r in reqs], dtype=bool),
            np.array(fixed, dtype=np.int64) if any(fixed) else None, batch.extra_tokens,
            np.array(slo, dtype=np.float64) if reqs and None not in slo else None, batch.waiting)


def as_arrays(batch: BatchView | ArrayBatch) -> ArrayBatch:
    return batch if isinstance(batch, ArrayBatch) else ArrayBatch.from_view(batch)


class StepPlan:
    """Rows to run per request (>= 1 for every request), plus what the planner predicted.

    The planner hands over the widths as an array aligned with its request ids; the dict view
    `width` is built on first use (a dict of 256 requests costs as much as the plan itself).
    """

    __slots__ = ("_width", "_rids", "_widths", "predicted_s", "budget_s", "considered", "notes")

    def __init__(self, width: dict[str, int] | None = None, predicted_s: float = 0.0,
                 budget_s: float = float("inf"), considered: int = 0, notes: dict[str, float] | None = None,
                 *, rids: Sequence[str] | None = None, widths: np.ndarray | None = None) -> None:
        if (width is None) == (widths is None) or (widths is not None and rids is None):
            raise ValueError("StepPlan takes either width (a dict) or rids and widths (an array)")
        self._width, self._rids, self._widths = width, rids, widths
        self.predicted_s, self.budget_s, self.considered = predicted_s, budget_s, considered
        self.notes = notes if notes is not None else {}

    @property
    def width(self) -> dict[str, int]:
        if self._width is None:
            self._width = dict(zip(self._rids, self._widths.tolist(), strict=True))
        return self._width

    def widths(self, rids: Sequence[str]) -> list[int]:
        """Widths in the order of `rids` (cheap when they are the planner's own request ids)."""
        if self._widths is not None and (rids is self._rids or list(rids) == list(self._rids)):
            return self._widths.tolist()
        w = self.width
        return [w[r] for r in rids]

    @property
    def rows(self) -> int:
        return int(self._widths.sum()) if self._widths is not None else sum(self._width.values())

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, StepPlan):
            return NotImplemented
        return (self.width, self.predicted_s, self.budget_s, self.considered, self.notes) == \
            (other.width, other.predicted_s, other.budget_s, other.considered, other.notes)

    __hash__ = None  # type: ignore[assignment]  # mutable, like the dataclass it replaces

    def __repr__(self) -> str:
        return (f"StepPlan(width={self.width!r}, predicted_s={self.predicted_s!r}, budget_s={self.budget_s!r}, "
                f"considered={self.considered!r}, notes={self.notes!r})")
