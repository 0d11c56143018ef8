"""What the per-step planner sees: one snapshot of the decode batch, and what it returns.

Pure data, no SGLang import: the scheduler hook and the simulator both build these.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

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

    @property
    def ready(self) -> int:
        return len(self.context_lens)


@dataclass(frozen=True, slots=True)
class BatchView:
    requests: tuple[RequestView, ...]
    extra_tokens: int = 0  # tokens in the same forward that are not decode rows (mixed prefill)


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

    def __post_init__(self) -> None:
        n = len(self.rids)
        if self.ready.shape != (n,) or self.slack_s.shape != (n,):
            raise ValueError(f"ArrayBatch: ready and slack_s need one entry per request ({n})")
        if n and int(self.ready.min()) < 1:
            raise ValueError("ArrayBatch: every request needs at least one ready row")
        if self.ctx.shape != (int(self.ready.sum()),):
            raise ValueError("ArrayBatch: ctx needs one entry per ready row (sum of ready)")
        for name in ("weight", "phase", "fixed_width"):
            a = getattr(self, name)
            if a is not None and a.shape != (n,):
                raise ValueError(f"ArrayBatch: {name} needs one entry per request ({n})")

    @classmethod
    def from_view(cls, batch: BatchView) -> ArrayBatch:
        reqs = batch.requests
        n = len(reqs)
        fixed = [r.fixed_width or 0 for r in reqs]
        return cls(
            [r.rid for r in reqs], np.fromiter((len(r.context_lens) for r in reqs), np.int64, n),
            np.fromiter((c for r in reqs for c in r.context_lens), np.int64),
            np.fromiter((r.slack_s for r in reqs), np.float64, n),
            np.fromiter((r.weight for r in reqs), np.float64, n),
            np.fromiter((r.phase_id is not None for r in reqs), bool, n),
            np.array(fixed, dtype=np.int64) if any(fixed) else None, batch.extra_tokens)


def as_arrays(batch: BatchView | ArrayBatch) -> ArrayBatch:
    return batch if isinstance(batch, ArrayBatch) else ArrayBatch.from_view(batch)


@dataclass(slots=True)
class StepPlan:
    """Rows to run per request (>= 1 for every request), plus what the planner predicted."""

    width: dict[str, int]
    predicted_s: float = 0.0
    budget_s: float = float("inf")
    considered: int = 0  # candidate evaluations, for overhead reporting
    notes: dict[str, float] = field(default_factory=dict)

    @property
    def rows(self) -> int:
        return sum(self.width.values())
