"""Profile a live server's decode step latency over a (batch, context) grid and fit T(S).

    python -m bench.profile --url URL --out model.json [--batch-sizes 1,8,32,64] [--contexts 64,256,512]

For each grid point it sends `bs` concurrent streamed requests of `ctx` random prompt tokens with a
fixed number of output tokens, and takes the decode step time of each request as
(last chunk - first chunk) / (tokens - 1). T(S) is fitted over (rows = bs, context tokens =
bs x mean KV length) with non-negative least squares (monotone by construction); MAPE is reported.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
from dataclasses import dataclass

import aiohttp

from branchwise.client import generate
from branchwise.taper.predictor import LinearLatencyModel, mape


@dataclass(frozen=True, slots=True)
class Point:
    bs: int
    ctx: int
    step_s: float  # median decode step time over the batch's requests

    def sample(self, new_tokens: int) -> tuple[int, int, float]:
        return (self.bs, self.bs * (self.ctx + new_tokens // 2), self.step_s)


async def measure(url: str, bs: int, ctx: int, new_tokens: int, vocab: int, rng: random.Random) -> Point:
    sp = {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        gens = await asyncio.gather(*[
            generate(url, input_ids=[rng.randrange(10, vocab) for _ in range(ctx)], sampling_params=sp,
                     stream=True, session=session) for _ in range(bs)])
    steps = [(g.chunk_times[-1] - g.chunk_times[0]) / (g.completion_tokens - 1)
             for g in gens if len(g.chunk_times) > 1 and g.completion_tokens > 1]
    if not steps:
        raise RuntimeError(f"no streamed decode timings at bs={bs} ctx={ctx}")
    return Point(bs, ctx, statistics.median(steps))


async def profile(url: str, batch_sizes: list[int], contexts: list[int], new_tokens: int, vocab: int,
                  seed: int) -> list[Point]:
    rng = random.Random(seed)
    await measure(url, 1, 16, 8, vocab, rng)  # warm up
    points = []
    for ctx in contexts:
        for bs in batch_sizes:
            p = await measure(url, bs, ctx, new_tokens, vocab, rng)
            print(f"bs={bs:4d} ctx={ctx:5d}  step={1e3 * p.step_s:8.3f} ms", flush=True)
            points.append(p)
    return points


def csv_ints(text: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not vals or min(vals) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return vals


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--batch-sizes", type=csv_ints, default=[1, 8, 32, 64])
    ap.add_argument("--contexts", type=csv_ints, default=[64, 256, 512])
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=400, help="prompt token ids are drawn below this")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    try:
        points = asyncio.run(profile(args.url, args.batch_sizes, args.contexts, args.new_tokens,
                                     args.vocab, args.seed))
    except ConnectionError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    samples = [p.sample(args.new_tokens) for p in points]
    model = LinearLatencyModel.fit(samples)
    model.save(args.out)
    print(f"T(S) = {1e3 * model.c0:.3f} ms + {1e3 * model.c_seq:.4f} ms/row + "
          f"{1e6 * model.c_ctx:.4f} us/context token;  MAPE {100 * mape(model, samples):.1f}% "
          f"over {len(samples)} grid points -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
