"""Prefill tokens per step under the slack budget that sizes branch rows (pure, no SGLang).

tokens = floor((rho x least slack - T(rows, context, 0)) / c_tok), clipped to [min_chunk, chunk_max];
chunk_max once the head is TTFT-due or nothing decodes. Derivation: docs/design/prefill-budget.md.
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
    """One server's prefill rule: chunk cap, progress floor, rho, TTFT SLO (None: the floor alone)."""

    chunk_max: int  # --chunked-prefill-size: the most tokens a step may carry
    min_chunk: int  # progress floor per step (min_chunk_for)
    rho: float = 0.8
    ttft_slo_s: float | None = None


def min_chunk_for(slo_s: float, rho: float, c_tok: float, chunk_max: int) -> int:
    """The progress floor: tokens whose cost fills the (1 - rho) x SLO margin, in [1, chunk_max]."""
    if c_tok <= 0:
        return chunk_max
    return max(1, min(chunk_max, int((1.0 - rho) * slo_s / c_tok)))


def stage_slack(slo_s: float, tokens: int, elapsed_s: float) -> float:
    """A decoding request's slack on its stage's mean pace: (tokens + 1) x SLO - time in the stage."""
    return (tokens + 1) * slo_s - elapsed_s


def least_slack(slacks: Iterable[float]) -> float:
    """The tightest decoding request's slack (inf with none)."""
    return min(slacks, default=math.inf)


def ttft_due(ttft_slo_s: float | None, waited_s: float, left_tokens: int, c_tok: float) -> bool:
    """The head's wait plus its remaining prefill at full speed reaches the TTFT SLO (False: none)."""
    return ttft_slo_s is not None and waited_s + c_tok * left_tokens >= ttft_slo_s


@dataclass(frozen=True, slots=True)
class PrefillStep:
    """The step a chunk joins: decode rows, context, least slack, head due, the host's step time."""

    rows: int
    ctx_tokens: int
    slack_s: float
    due: bool = False
    host_s: float = 0.0


def prefill_tokens(rule: PrefillRule, model: StepModel, step: PrefillStep) -> int:
    """Prefill tokens this step may carry: the budget left above T(rows, context, 0), floor..chunk_max."""
    if step.due or not math.isfinite(step.slack_s) or model.c_tok <= 0:
        return rule.chunk_max
    room = rule.rho * step.slack_s - model.predict(step.rows, step.ctx_tokens, 0) - step.host_s
    fit = int(room / model.c_tok) if room > 0 else 0
    return min(rule.chunk_max, max(rule.min_chunk, fit))
