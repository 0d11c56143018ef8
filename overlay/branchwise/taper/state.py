"""What the per-step planner sees: one snapshot of the decode batch, and what it returns.

Pure data, no SGLang import: the scheduler hook and the simulator both build these.
"""

from __future__ import annotations

from dataclasses import dataclass, field


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
