"""Decode step latency of a live server, fitted as T(S) = c0 + c_seq rows + c_ctx context tokens.

One implementation for bench.profile (a T(S) file for `--latency-model`) and bench.replay / bench.sweep
(the operating point of a run). At each grid point (b streams, ctx prompt tokens) it sends b concurrent
streamed greedy requests and takes each one's decode step as (last chunk - first chunk) / (tokens - 1):
serial streams only, so the probe means the same under every branch policy. Grid points take turns
over `repeats` rounds and each keeps its median, so a passing burst of load on a shared box bends no
single point. T(S) is fitted with non-negative least squares (monotone by construction) over rows and
context tokens (b x (ctx + tokens / 2)): a fit on short prompts alone under-predicts replay steps.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
from dataclasses import dataclass
from typing import Any

import aiohttp

from branchwise import client
from branchwise.taper.predictor import LinearLatencyModel

SIZES = (1, 8, 16, 32)
CONTEXTS = (32, 512)


def probe_prompt(i: int, ctx: int, salt: int, vocab: int = 400) -> list[int]:
    """A deterministic prompt of random token ids (ids below 10 may be special)."""
    rng = random.Random(f"probe:{salt}:{i}")
    return [rng.randrange(10, vocab) for _ in range(ctx)]


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
    step = {g: statistics.median(v) for g, v in seen.items()}
    model = LinearLatencyModel.fit([(b, b * (c + tokens // 2), t) for (b, c), t in step.items()])
    return Probe(step, model, tokens)
