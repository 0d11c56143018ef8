"""Probing a live server and calibrating a run's operating point from the probe.

Probe: decode step latency fitted as T(S) = c0 + c_seq rows + c_ctx context tokens. One
implementation for bench.profile (a T(S) file for `--latency-model`) and bench.replay / bench.sweep
(the operating point of a run). At each grid point (b streams, ctx prompt tokens) it sends b concurrent
streamed greedy requests and takes each one's decode step as (last chunk - first chunk) / (tokens - 1):
serial streams only, so the probe means the same under every branch policy. Grid points take turns
over `repeats` rounds and each keeps its fastest round: load from other processes on a shared box
only adds time, so the minimum is the estimate of the machine that a burst of load bends least. T(S) is fitted with non-negative least squares (monotone by construction) over rows and
context tokens (b x (ctx + tokens / 2)): a fit on short prompts alone under-predicts replay steps.

Calibration (`calibrate`): the SLO is T(slo_rows rows of slo_context KV tokens), at least slo_floor x
T(1 row) (a stage's TPOT also carries per-forward costs that do not grow with rows: prefills of
arriving requests, scheduling); the arrival-rate scale makes the programs' mean demanded token rate
`load` x the tokens/s the server delivers at slo_rows rows; taper servers get the probe's T(S) as
their --latency-model.
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


def probe_prompt(i: int, ctx: int, salt: int, vocab: int = 400) -> list[int]:
    """A deterministic prompt of random token ids, its own per (salt, i)."""
    return prompt_ids(str(i), ctx, f"probe:{salt}", vocab)


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
        return [(b, b * (c + self.tokens // 2), t) for (b, c), t in self.step_s.items()]

    def as_dict(self) -> dict[str, Any]:
        return {"step_ms": {f"{b}x{c}": 1e3 * t for (b, c), t in self.step_s.items()},
                "model": json.loads(self.model.to_json())}

    def line(self) -> str:
        m = self.model
        steps = ", ".join(f"{b}x{c} {1e3 * t:.1f}" for (b, c), t in self.step_s.items())
        return (f"ms at streams x prompt tokens: {steps} -> T = {1e3 * m.c0:.2f} ms + "
                f"{1e3 * m.c_seq:.3f} ms/row + {1e6 * m.c_ctx:.3f} us/ctx token")


async def step_time(url: str, session: Any, streams: int, ctx: int, tokens: int, salt: int = 0,
                    vocab: int = 400) -> float:
    """Median decode step of `streams` concurrent streamed requests of `ctx` prompt tokens."""
    sp = {"max_new_tokens": tokens, "temperature": 0.0, "ignore_eos": True}
    gens = await asyncio.gather(*[client.generate(url, None, sp, stream=True, session=session,
                                                  input_ids=probe_prompt(i, ctx, salt, vocab))
                                  for i in range(streams)])
    steps = [(g.chunk_times[-1] - g.chunk_times[0]) / (g.completion_tokens - 1) for g in gens
             if len(g.chunk_times) > 1 and g.completion_tokens > 1]
    if not steps:
        raise RuntimeError(f"probe at {streams} streams x {ctx} tokens: no streamed decode timings from {url}")
    return statistics.median(steps)


async def probe(url: str, sizes: tuple[int, ...] = SIZES, contexts: tuple[int, ...] = CONTEXTS,
                tokens: int = 32, repeats: int = 2, vocab: int = 400, progress: bool = False) -> Probe:
    grid = [(b, c) for c in contexts for b in sizes]
    seen: dict[tuple[int, int], list[float]] = {g: [] for g in grid}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        await step_time(url, session, 1, 8, 4, vocab=vocab)  # warm up
        for _ in range(repeats):
            for b, c in grid:
                seen[b, c].append(t := await step_time(url, session, b, c, tokens, salt=b, vocab=vocab))
                if progress:
                    print(f"bs={b:4d} ctx={c:5d}  step={1e3 * t:8.3f} ms", flush=True)
    step = {g: min(v) for g, v in seen.items()}  # interference only adds time
    model = LinearLatencyModel.fit([(b, b * (c + tokens // 2), t) for (b, c), t in step.items()])
    return Probe(step, model, tokens)


def probe_url(url: str) -> Probe:
    """`probe` from synchronous code, its fit printed."""
    p = asyncio.run(probe(url))
    print(f"probe {url}: {p.line()}", flush=True)
    return p


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
        return self.slo_tpot_ms is None or self.rate_scale is None or (self.launch and self.latency_model == "auto")

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
    k, best = 1.0, (float("inf"), 1.0)
    for _ in range(tries):
        d = demand(k)
        best = min(best, (abs(d - target), k))
        if best[0] <= 0.02 * target:
            break
        k *= (target / max(d, 1e-9)) ** 0.8  # damped: a jump can land on a run of long programs
    return best[1]


def calibrate(c: Calibration, trace: Any, scaling: Scaling, p: Probe, out: Path) -> Point:
    """Fill every `auto` from the probe (module docstring); the fit goes to out/latency_model.json."""
    t_slo = p.at(c.slo_rows, c.slo_context)
    slo_ms = c.slo_tpot_ms if c.slo_tpot_ms is not None else 1e3 * p.auto_slo_s(c.slo_rows, c.slo_context, c.slo_floor)
    rs = c.rate_scale
    if rs is None:
        rs = solve_rate_scale(c.load * c.slo_rows / t_slo, lambda k: mean_demand_tok_s(
            build_programs(trace, fit_schedule(trace, c.schedule, c.duration_s, k), c.preset, c.seed, scaling),
            c.duration_s))
    model = c.latency_model if c.launch and c.latency_model not in ("auto", "none") else None
    if c.launch and c.latency_model == "auto":
        out.mkdir(parents=True, exist_ok=True)
        model = str(out / "latency_model.json")
        p.model.save(model)
    return Point(slo_ms, rs, model, p)
