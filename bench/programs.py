"""Trace schedule -> client programs for a live server: lengths scaled to the served model, token ids.

Every scheduled arrival (bench.workload: the trace's arrival pattern, the composer's phase structure)
becomes a program shaped like an SGLang frontend fork/join program: serial stages and parallel phases
of branch lengths. A live server serves a smaller model than the trace's, so every length is scaled
and capped (`Scaling`), keeping each program's shape. Programs send token ids rather than text so
that every shared prefix is exactly what sits in the radix cache (text would be re-tokenized at each
seam): the prompt is deterministic random ids, a branch opens with a two-token header.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace
from typing import Any

from bench.workload import Regime, RequestSpec, Schedule, build_schedule, compose


@dataclass(frozen=True, slots=True)
class Scaling:
    """Trace token counts -> what the served model can do: n -> clamp(round(n * scale), 1, cap)."""

    output_scale: float = 0.3
    max_stage_tokens: int = 128  # per serial stage and per branch
    prompt_scale: float = 0.05
    max_prompt_tokens: int = 64
    max_program_tokens: int = 1536  # all stages of one program: the joined context must fit the model

    def __post_init__(self) -> None:
        if not (self.output_scale > 0 and self.prompt_scale > 0 and self.max_stage_tokens >= 1
                and self.max_prompt_tokens >= 1 and self.max_program_tokens >= 1):
            raise ValueError(f"scales must be > 0 and caps >= 1, got {self}")


def _scaled(tokens: int, scale: float, cap: int) -> int:
    return int(min(max(round(tokens * scale), 1), cap))


def _scaled_stages(spec: RequestSpec, scale: float, cap: int) -> tuple[int | tuple[int, ...], ...]:
    return tuple(tuple(_scaled(branch, scale, cap) for branch in stage) if isinstance(stage, tuple)
                 else _scaled(stage, scale, cap)
                 for stage in spec.stages)


def scale_spec(spec: RequestSpec, scaling: Scaling) -> RequestSpec:
    """The same program with every serial stage and branch length (and the prompt) scaled and capped."""
    scale = scaling.output_scale
    stages = _scaled_stages(spec, scale, scaling.max_stage_tokens)
    while (total := RequestSpec("", 0.0, 0, stages).output_tokens) > scaling.max_program_tokens:
        scale *= 0.95 * scaling.max_program_tokens / total  # shrink the whole program, keeping its shape
        stages = _scaled_stages(spec, scale, scaling.max_stage_tokens)
    prompt = _scaled(spec.prompt_tokens, scaling.prompt_scale, scaling.max_prompt_tokens)
    return replace(spec, prompt_tokens=prompt, stages=stages)


def fit_schedule(trace: Any, spec: str, duration_s: float, rate_scale: float = 1.0) -> Schedule:
    """bench.workload's schedule compressed to `duration_s`, its arrival rates times `rate_scale`.

    The workload's `compress` keeps every rate and shortens the run; a rate scale k then squeezes the
    arrivals k-fold in time, so the paper's regimes keep their shape at k times the paper's req/s."""
    if duration_s <= 0 or rate_scale <= 0:
        raise ValueError(f"duration and rate scale must be > 0, got {duration_s}, {rate_scale}")
    natural = build_schedule(trace, spec).duration_s
    compress = natural / (duration_s * rate_scale)
    if compress < 1.0:
        raise ValueError(f"schedule {spec!r} lasts {natural:.0f} s at its own rate: it cannot fill "
                         f"{duration_s:g} s x rate scale {rate_scale:g}; shorten --duration-s or lower "
                         "--rate-scale")
    sched = build_schedule(trace, spec, compress)
    squeeze = 1.0 / rate_scale
    regimes = tuple(Regime(regime.name, regime.start_s * squeeze, regime.end_s * squeeze)
                    for regime in sched.regimes)
    name = spec if rate_scale == 1.0 else f"{spec} x{rate_scale:g}"
    return Schedule(sched.arrival_s * squeeze, sched.row, sched.duration_s * squeeze, regimes, name)


def build_programs(trace: Any, schedule: Schedule, preset: str, seed: int,
                   scaling: Scaling) -> list[RequestSpec]:
    return [scale_spec(spec, scaling) for spec in compose(trace, schedule, preset, seed)]


def mean_demand_tok_s(specs: list[RequestSpec], duration_s: float) -> float:
    """Output tokens the programs ask for, per second of the schedule."""
    return sum(spec.output_tokens for spec in specs) / duration_s


def prompt_ids(rid: str, tokens: int, seed: int | str, vocab: int = 400) -> list[int]:
    """A deterministic prompt of random token ids (ids below 10 may be special)."""
    rng = random.Random(f"{seed}:{rid}")
    return [rng.randrange(10, vocab) for _ in range(tokens)]


SEP_ID = 11  # a plain token (ids below 10 may be special): opens a branch header and closes the join


def branch_head(index: int, vocab: int = 400) -> list[int]:
    """The tokens that open branch `index` after the shared prefix (its header, as in
    `forks[i] += ...`)."""
    return [SEP_ID, 12 + index % (vocab - 12)]
