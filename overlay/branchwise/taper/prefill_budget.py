"""Prefill tokens per step under the slack budget that sizes branch rows (pure, no SGLang).

A step that carries a prefill chunk delays every decoding request by the chunk's cost, so the
chunk is sized by the same rule as the step's rows: the step's predicted time
T(rows, context, prefill tokens) stays within rho x the least slack of its decoding requests.
The rows come first (they are what the SLO protects); the chunk gets the budget left above them:

    tokens = floor((rho x least slack - T(rows, context, 0)) / c_tok), clipped to [floor, chunk_max]

Progress (prefill is never starved): every step with a pending prefill carries at least
`min_chunk` tokens (or what is left of the prompt), so the FCFS head's prompt of P tokens is done
within ceil(P / min_chunk) steps whatever the slack, and steps are finite. The floor is derived,
not tuned: the tokens whose cost fills the (1 - rho) x SLO margin that rho keeps in every step
(`min_chunk_for`). Once the head's TTFT slack runs out (it has waited so long that its remaining
prefill at full speed no longer meets the TTFT SLO, `ttft_due`) it gets the whole chunk_max, as
under stock: the rule never delays a late first token further. No decoding request (nothing to
protect): chunk_max. The derivation and the server/simulator seams: docs/design/prefill-budget.md.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol


class StepModel(Protocol):
    """What the rule needs of a latency model (predictor.LinearLatencyModel has it)."""

    c_tok: float

    def predict(self, n_seqs: int, ctx_tokens: int, extra_tokens: int = 0) -> float: ...


@dataclass(frozen=True, slots=True)
class PrefillRule:
    """One server's prefill rule: its chunk cap, progress floor, rho and TTFT SLO (None: no TTFT
    clause, the floor alone guarantees progress)."""

    chunk_max: int  # --chunked-prefill-size: the most tokens a step may carry
    min_chunk: int  # progress floor per step (min_chunk_for)
    rho: float = 0.8
    ttft_slo_s: float | None = None


def min_chunk_for(slo_s: float, rho: float, c_tok: float, chunk_max: int) -> int:
    """The progress floor: tokens whose cost fills the (1 - rho) x SLO margin of a step, at least 1
    and at most chunk_max (all of it when prefill costs nothing in the model)."""
    if c_tok <= 0:
        return chunk_max
    return max(1, min(chunk_max, int((1.0 - rho) * slo_s / c_tok)))


def stage_slack(slo_s: float, tokens: int, elapsed_s: float) -> float:
    """A decoding request's slack on its stage's mean pace (controller.SlackTracker, mean=True):
    (tokens delivered in the stage + 1) x SLO - time since the stage began."""
    return (tokens + 1) * slo_s - elapsed_s


def least_slack(slacks: Iterable[float]) -> float:
    """The tightest decoding request's slack (inf with none)."""
    return min(slacks, default=math.inf)


def ttft_due(ttft_slo_s: float | None, waited_s: float, left_tokens: int, c_tok: float) -> bool:
    """The head's TTFT slack has run out: what it has waited plus its remaining prefill at full
    speed reaches the TTFT SLO (False without one)."""
    return ttft_slo_s is not None and waited_s + c_tok * left_tokens >= ttft_slo_s


@dataclass(frozen=True, slots=True)
class PrefillStep:
    """The step a chunk joins: its decode rows and their context, the least slack of its decoding
    requests (least_slack), whether the head is due (ttft_due) and the host's per-step time."""

    rows: int
    ctx_tokens: int
    slack_s: float
    due: bool = False
    host_s: float = 0.0


def prefill_tokens(rule: PrefillRule, model: StepModel, step: PrefillStep) -> int:
    """Prefill tokens this step may carry: the budget rho x the least slack less T(rows, context, 0)
    and the host's time, in tokens; never below the floor, never above chunk_max; chunk_max when the
    head is due or nothing decodes (slack inf)."""
    if step.due or not math.isfinite(step.slack_s) or model.c_tok <= 0:
        return rule.chunk_max
    room = rule.rho * step.slack_s - model.predict(step.rows, step.ctx_tokens, 0) - step.host_s
    fit = int(room / model.c_tok) if room > 0 else 0
    return min(rule.chunk_max, max(rule.min_chunk, fit))
