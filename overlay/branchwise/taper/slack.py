"""Residual TPOT slack per request and the batch's slack budget (TAPER §3.3, Appendix D).

Slack is how long the *next* step may take before the request's TPOT exceeds its SLO:
- serial stage: the next token is delivered one step from now, so
      slack = slo - (now - last_token_delivery)
- parallel phase: the SLO applies to the phase's effective TPOT = phase wall time / tokens generated
  over all its branches. The next step adds at least one token, so it keeps the effective TPOT
  within the SLO iff (now + T - phase_start) / (tokens_in_phase + 1) <= slo, i.e.
      slack = (tokens_in_phase + 1) * slo - (now - phase_start)
  (counting only the protected row's token keeps this conservative when more rows run).
Budget B_t = rho * min slack over every request in the batch: width must be safe for the most urgent
request, not for the one being widened.

The serial rule above is the paper's per-gap reading. The SLO is judged per stage (a serial stage's
TPOT is its wall time over its tokens, like a phase's), so a tracker built with `mean=True` (policy
`taper`) gives a serial stage the same form as a phase:
      slack = (tokens_in_stage + 1) * slo - (now - stage_start)
A request that ran ahead of its pace has banked the difference; one that fell behind has less.

Time is always passed in (scheduler clock of TP rank 0), never read here, so every function is
deterministic and rank-invariant.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


def serial_slack(slo_s: float, now_s: float, last_token_s: float) -> float:
    return slo_s - (now_s - last_token_s)


def phase_slack(slo_s: float, now_s: float, phase_start_s: float, tokens_in_phase: int) -> float:
    return (tokens_in_phase + 1) * slo_s - (now_s - phase_start_s)


def slack_budget(slacks: Iterable[float], rho: float = 0.8) -> float:
    """rho * min(slacks); +inf for an empty batch. Negative when some request is already late."""
    if not 0.0 < rho <= 1.0:
        raise ValueError(f"rho must be in (0, 1], got {rho}")
    return rho * min(slacks, default=float("inf"))


@dataclass(slots=True)
class SlackTracker:
    """Per-request delivery clock. The caller reports token deliveries and phase boundaries.

    In a phase, `on_tokens(now, n)` is called with the tokens delivered by all of its branches in
    that step; after the reduce, `end_phase(now)` resumes serial timing from the reduce time.
    `mean`: a serial stage's slack is judged on its mean pace since the stage began (phase_slack's form).
    """

    slo_s: float
    last_token_s: float  # serial stage: time of the last token delivery (first token time initially)
    phase_start_s: float | None = None
    phase_tokens: int = 0
    mean: bool = False
    stage_start_s: float = float("nan")  # serial stage start; NaN: last_token_s at creation
    stage_tokens: int = 0

    def __post_init__(self) -> None:
        if self.stage_start_s != self.stage_start_s:
            self.stage_start_s = self.last_token_s

    def on_tokens(self, now_s: float, n: int = 1) -> None:
        self.last_token_s = now_s
        if self.phase_start_s is not None:
            self.phase_tokens += n
        else:
            self.stage_tokens += n

    def start_phase(self, now_s: float) -> None:
        self.phase_start_s, self.phase_tokens = now_s, 0

    def end_phase(self, now_s: float) -> None:
        self.phase_start_s, self.phase_tokens, self.last_token_s = None, 0, now_s
        self.stage_start_s, self.stage_tokens = now_s, 0

    @property
    def in_phase(self) -> bool:
        return self.phase_start_s is not None

    def slack(self, now_s: float) -> float:
        if self.phase_start_s is None:
            if self.mean:
                return phase_slack(self.slo_s, now_s, self.stage_start_s, self.stage_tokens)  # same form
            return serial_slack(self.slo_s, now_s, self.last_token_s)
        return phase_slack(self.slo_s, now_s, self.phase_start_s, self.phase_tokens)

    def gap_slack(self, now_s: float) -> float:
        """The paper's reading: per gap in a serial stage (the phase slack in a phase)."""
        if self.phase_start_s is None:
            return serial_slack(self.slo_s, now_s, self.last_token_s)
        return phase_slack(self.slo_s, now_s, self.phase_start_s, self.phase_tokens)

    def effective_tpot(self, now_s: float) -> float | None:
        """The phase's running effective TPOT (None outside a phase or before its first token)."""
        if self.phase_start_s is None or self.phase_tokens == 0:
            return None
        return (now_s - self.phase_start_s) / self.phase_tokens
