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
        vals = [int(item) for item in text.split(",") if item.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not vals or min(vals) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return vals


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--batch-sizes", type=csv_ints, default=[1, 8, 32, 64])
    parser.add_argument("--contexts", type=csv_ints, default=[64, 256, 512])
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=1,
                        help="rounds over the grid; each point keeps its median")
    parser.add_argument("--vocab", type=int, default=400, help="prompt token ids are drawn below this")
    args = parser.parse_args(argv)
    try:
        probed = asyncio.run(probe(args.url, tuple(args.batch_sizes), tuple(args.contexts), args.new_tokens,
                                   args.repeats, args.vocab, progress=True))
    except (ConnectionError, RuntimeError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    probed.model.save(args.out)
    model = probed.model
    print(f"T(S) = {1e3 * model.c0:.3f} ms + {1e3 * model.c_seq:.4f} ms/row + "
          f"{1e6 * model.c_ctx:.4f} us/context token;  MAPE {100 * mape(model, probed.samples()):.1f}% "
          f"over {len(probed.step_s)} grid points -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
