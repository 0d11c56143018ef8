"""Profile a live server's decode step latency over a (batch, context) grid and fit T(S).

    python -m bench.profile --url URL --out model.json [--batch-sizes 1,8,32,64] [--contexts 64,256,512]

The measurement is bench.probe's (the one replay and the sweep calibrate with): at each grid point
`bs` concurrent streamed requests of `ctx` random prompt tokens and a fixed number of output tokens;
T(S) is fitted over rows and context tokens with non-negative least squares; MAPE is reported.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from bench.probe import probe
from branchwise.taper.predictor import mape


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
    ap.add_argument("--repeats", type=int, default=1, help="rounds over the grid; each point keeps its median")
    ap.add_argument("--vocab", type=int, default=400, help="prompt token ids are drawn below this")
    args = ap.parse_args(argv)
    try:
        p = asyncio.run(probe(args.url, tuple(args.batch_sizes), tuple(args.contexts), args.new_tokens,
                              args.repeats, args.vocab, progress=True))
    except (ConnectionError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    p.model.save(args.out)
    m = p.model
    print(f"T(S) = {1e3 * m.c0:.3f} ms + {1e3 * m.c_seq:.4f} ms/row + {1e6 * m.c_ctx:.4f} us/context token;  "
          f"MAPE {100 * mape(m, p.samples()):.1f}% over {len(p.step_s)} grid points -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
