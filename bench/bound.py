"""The fluid bound: the highest arrival rate any width policy can serve with every step inside the SLO.

Under a linear step latency T = c0 + c_seq rows + c_ctx context tokens + c_tok prefill tokens,
`fluid_bound_rps` = (1 - c0 / SLO) / mean work per request, where a request's work
(`request_work_s`) is c_seq + c_ctx x a token's own KV context summed over its decoded tokens,
plus c_tok x its prefilled tokens; the widths only move work between steps. `Contexts` says how a
server runs a request's stages, and so what each decoded token's context is (`SIMULATOR`: the
engine's; `LIVE_CLIENT`: bench.client's programs). The derivation: docs/design/simulator.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from bench.workload import RequestSpec
from branchwise.taper import LinearLatencyModel


@dataclass(frozen=True, slots=True)
class Contexts:
    """How a server runs a request's stages, as far as each decoded token's context goes."""

    header_tokens: int = 0  # tokens that open each branch after the shared prefix
    join_tokens: int = 0  # tokens that close the joined branches
    prefill_per_stage: bool = False  # every stage and branch starts with a prefill (its own /generate)


SIMULATOR = Contexts()  # bench.engine: branches fork on the parent's KV, one prefill per request
LIVE_CLIENT = Contexts(header_tokens=2, join_tokens=1, prefill_per_stage=True)  # bench.client programs


def _rows(model: LinearLatencyModel, tokens: int, ctx: int) -> float:
    """Work of `tokens` decode rows of one sequence whose first row sees `ctx` KV tokens."""
    return tokens * (model.c_seq + model.c_ctx * ctx) + model.c_ctx * tokens * (tokens - 1) / 2


def request_work_s(spec: RequestSpec, model: LinearLatencyModel, how: Contexts = SIMULATOR) -> float:
    """Engine seconds beyond the per-step c0 that one request needs, whatever the widths."""
    ctx, work, started = spec.prompt_tokens, model.c_tok * spec.prompt_tokens, False
    for stage in spec.stages:
        if isinstance(stage, tuple):
            base = ctx + how.header_tokens
            for branch in stage:
                free = 1 if how.prefill_per_stage else 0  # the branch's first token comes out of its prefill
                work += _rows(model, branch - free, base + free)
            ctx += sum(stage) + len(stage) * how.header_tokens + how.join_tokens
        else:
            free = 1 if how.prefill_per_stage or not started else 0
            work += _rows(model, stage - free, ctx + free)
            ctx += stage
        started = True
    return work


def fluid_bound_rps(model: LinearLatencyModel, slo_s: float, specs: list[RequestSpec],
                    how: Contexts = SIMULATOR) -> float:
    """The arrival rate whose mean work fills steps of exactly the SLO (module docstring)."""
    if not specs or slo_s <= model.c0:
        return 0.0
    mean = float(np.mean([request_work_s(spec, model, how) for spec in specs]))
    return (1.0 - model.c0 / slo_s) / mean if mean > 0 else float("inf")
