"""Probing a live server and calibrating a run's operating point from the probe.

`probe` times the decode step at a grid of (concurrent streams, prompt tokens) and fits
T(S) = c0 + c_seq rows + c_ctx context tokens: one implementation for bench.profile (a T(S) file
for `--latency-model`) and bench.replay / bench.sweep (the operating point of a run).
`calibrate` fills every `auto` of a replay's operating point (the SLO, the arrival-rate scale, the
--latency-model of taper servers) from such a probe. How a step is timed, why each grid point
keeps its fastest round, and the calibration rule: docs/design/bench-micro.md.
"""

from __future__ import annotations

import asyncio
import json
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from bench.programs import Scaling, build_programs, fit_schedule, mean_demand_tok_s, prompt_ids
from branchwise import client
from branchwise.taper.predictor import LinearLatencyModel

SIZES = (1, 8, 16, 32)
CONTEXTS = (32, 512)


def probe_prompt(index: int, ctx: int, salt: int, vocab: int = 400) -> list[int]:
    """A deterministic prompt of random token ids, its own per (salt, index)."""
    return prompt_ids(str(index), ctx, f"probe:{salt}", vocab)


@dataclass(frozen=True, slots=True)
class Probe:
    """Median decode step per (streams, prompt tokens) and T(S) fitted to them."""

    step_s: dict[tuple[int, int], float]
    model: LinearLatencyModel
    tokens: int = 32

    def at(self, rows: float, ctx: float) -> float:
        """Predicted step with `rows` rows whose KV holds `ctx` tokens each."""
        return self.model.predict(rows, rows * ctx)

    def auto_slo_s(self, rows: float = 32.0, ctx: float = 256.0, floor: float = 2.5) -> float:
        """The SLO a run calibrates to: T(rows rows of ctx KV tokens), but at least floor x T(1 row), so
        per-forward costs that do not grow with rows (prefills of arrivals, scheduling) cannot take
        the whole SLO on a machine with a flat T(S)."""
        return max(self.at(rows, ctx), floor * self.at(1, ctx))

    def rows_within(self, t_s: float, ctx: float) -> float:
        """How many rows of `ctx` KV tokens fit in a step of `t_s` (the fluid bound's batch)."""
        per_row = self.model.c_seq + self.model.c_ctx * ctx
        return max(t_s - self.model.c0, 0.0) / per_row if per_row > 0 else float("inf")

    def samples(self) -> list[tuple[int, int, float]]:
        """(rows, context tokens, step s) per grid point: what T(S) is fitted to."""
        return [(streams, streams * (ctx + self.tokens // 2), step)
                for (streams, ctx), step in self.step_s.items()]

    def as_dict(self) -> dict[str, Any]:
        return {"step_ms": {f"{streams}x{ctx}": 1e3 * step for (streams, ctx), step in self.step_s.items()},
                "model": json.loads(self.model.to_json())}

    def line(self) -> str:
        model = self.model
        steps = ", ".join(f"{streams}x{ctx} {1e3 * step:.1f}" for (streams, ctx), step in self.step_s.items())
        return (f"ms at streams x prompt tokens: {steps} -> T = {1e3 * model.c0:.2f} ms + "
                f"{1e3 * model.c_seq:.3f} ms/row + {1e6 * model.c_ctx:.3f} us/ctx token")


async def step_time(url: str, session: Any, streams: int, ctx: int, tokens: int, salt: int = 0,
                    vocab: int = 400) -> float:
    """Median decode step of `streams` concurrent streamed requests of `ctx` prompt tokens."""
    sampling = {"max_new_tokens": tokens, "temperature": 0.0, "ignore_eos": True}
    gens = await asyncio.gather(*[client.generate(url, None, sampling, stream=True, session=session,
                                                  input_ids=probe_prompt(i, ctx, salt, vocab))
                                  for i in range(streams)])
    steps = [(gen.chunk_times[-1] - gen.chunk_times[0]) / (gen.completion_tokens - 1) for gen in gens
             if len(gen.chunk_times) > 1 and gen.completion_tokens > 1]
    if not steps:
        raise RuntimeError(f"probe at {streams} streams x {ctx} tokens: "
                           f"no streamed decode timings from {url}")
    return statistics.median(steps)


async def probe(url: str, sizes: tuple[int, ...] = SIZES, contexts: tuple[int, ...] = CONTEXTS,
                tokens: int = 32, repeats: int = 2, vocab: int = 400, progress: bool = False) -> Probe:
    """The fastest of `repeats` rounds at every (streams, prompt tokens) point and T(S) fitted to them."""
    grid = [(streams, ctx) for ctx in contexts for streams in sizes]
    seen: dict[tuple[int, int], list[float]] = {point: [] for point in grid}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        await step_time(url, session, 1, 8, 4, vocab=vocab)  # warm up
        for _ in range(repeats):
            for streams, ctx in grid:
                step_s = await step_time(url, session, streams, ctx, tokens, salt=streams, vocab=vocab)
                seen[streams, ctx].append(step_s)
                if progress:
                    print(f"bs={streams:4d} ctx={ctx:5d}  step={1e3 * step_s:8.3f} ms", flush=True)
    fastest = {point: min(times) for point, times in seen.items()}  # interference only adds time
    model = LinearLatencyModel.fit([(streams, streams * (ctx + tokens // 2), step)
                                    for (streams, ctx), step in fastest.items()])
    return Probe(fastest, model, tokens)


def probe_url(url: str) -> Probe:
    """`probe` from synchronous code, its fit printed."""
    probed = asyncio.run(probe(url))
    print(f"probe {url}: {probed.line()}", flush=True)
    return probed


# ------------------------------------------------------------------------------------ calibration
@dataclass(frozen=True, slots=True)
class Calibration:
    """What a replay's operating point is calibrated to; None or "auto": from the probe."""

    schedule: str
    duration_s: float
    preset: str
    seed: int
    slo_tpot_ms: float | None = None
    rate_scale: float | None = None
    slo_rows: float = 32.0
    slo_context: float = 256.0
    slo_floor: float = 2.5
    load: float = 0.35
    latency_model: str = "auto"  # T(S) JSON for launched servers | auto: the probe's fit | none
    launch: bool = False  # the run starts its servers (only those take a --latency-model)

    @property
    def needs_probe(self) -> bool:
        return (self.slo_tpot_ms is None or self.rate_scale is None
                or (self.launch and self.latency_model == "auto"))

    def given(self) -> Point:
        """The operating point when every part of it is given (needs_probe is False)."""
        assert self.slo_tpot_ms is not None and self.rate_scale is not None
        model = self.latency_model if self.launch and self.latency_model != "none" else None
        return Point(self.slo_tpot_ms, self.rate_scale, model)


@dataclass(slots=True)
class Point:
    """The operating point: SLO and arrival-rate scale, given or calibrated from a probe."""

    slo_tpot_ms: float
    rate_scale: float
    latency_model: str | None = None  # T(S) JSON passed to --launch servers
    probe: Probe | None = None


def solve_rate_scale(target: float, demand: Callable[[float], float], tries: int = 16) -> float:
    """The rate scale whose schedule demands closest to `target` tok/s. Demand is only roughly linear in
    the scale (each scale draws other programs and lengths), so iterate and keep the best."""
    scale, best = 1.0, (float("inf"), 1.0)
    for _ in range(tries):
        demanded = demand(scale)
        best = min(best, (abs(demanded - target), scale))
        if best[0] <= 0.02 * target:
            break
        scale *= (target / max(demanded, 1e-9)) ** 0.8  # damped: a jump can land on a run of long programs
    return best[1]


def calibrate(cal: Calibration, trace: Any, scaling: Scaling, probed: Probe, out: Path) -> Point:
    """Fill every `auto` from the probe (the rule: docs/design/bench-micro.md); the fit goes to
    out/latency_model.json."""
    t_slo = probed.at(cal.slo_rows, cal.slo_context)
    slo_ms = (cal.slo_tpot_ms if cal.slo_tpot_ms is not None
              else 1e3 * probed.auto_slo_s(cal.slo_rows, cal.slo_context, cal.slo_floor))

    def demand(scale: float) -> float:
        schedule = fit_schedule(trace, cal.schedule, cal.duration_s, scale)
        specs = build_programs(trace, schedule, cal.preset, cal.seed, scaling)
        return mean_demand_tok_s(specs, cal.duration_s)

    rate_scale = cal.rate_scale
    if rate_scale is None:
        rate_scale = solve_rate_scale(cal.load * cal.slo_rows / t_slo, demand)
    model = cal.latency_model if cal.launch and cal.latency_model not in ("auto", "none") else None
    if cal.launch and cal.latency_model == "auto":
        out.mkdir(parents=True, exist_ok=True)
        model = str(out / "latency_model.json")
        probed.model.save(model)
    return Point(slo_ms, rate_scale, model, probed)
