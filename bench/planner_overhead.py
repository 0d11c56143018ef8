"""Per-step CPU cost of the TAPER planner on random decode batches (TAPER paper §4.3 / Table 7).

    python -m bench.planner_overhead --requests 256 --fanout 8 [--steps N --seed S --policy taper]

Half the requests are in a serial stage (one row); the other half are in a parallel phase with
2..fanout ready branches that share a prefix. The tightest request's slack is drawn so the budget
falls anywhere from below the protected composition (tight step) to above the eager one (loose
step), so most steps run the greedy widening, the expensive case. Batches are built up front and
frozen out of the garbage collector (as SGLang's scheduler does with its startup heap), so a
collection of the bench's own million objects is not billed to the planner; only
`policy.plan(batch)` is timed: wall clock (perf_counter_ns, the goal) and this thread's CPU time
(thread_time_ns, which excludes time the OS gave to other processes on a busy machine).
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import sys
import timeit
from pathlib import Path
from time import perf_counter_ns, thread_time_ns

import numpy as np

try:
    import branchwise  # noqa: F401
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "overlay"))

from branchwise.taper.planner import ArrayBatch  # noqa: E402
from branchwise.taper.policies import parse_policy  # noqa: E402
from branchwise.taper.predictor import default_model  # noqa: E402

GOAL_MEDIAN_MS, GOAL_P99_MS = 0.1, 0.3
PAPER_MEDIAN_MS, PAPER_P99_MS = 0.31, 0.81  # TAPER Table 7 (their hardware, their batches)


def random_batch(rng: random.Random, n_requests: int, fanout: int, rho: float) -> ArrayBatch:
    """The planner's input as the step controller builds it (no SLOs: the paper's budget rule)."""
    model = default_model()
    lens_of, slack_of, phase_of = [], [], []
    rows, ctx, first_rows, first_ctx = 0, 0, 0, 0
    for _ in range(n_requests):
        prefix = rng.randint(256, 6000)
        if fanout >= 2 and rng.random() < 0.5:
            branches = rng.randint(2, fanout)
            lens = [prefix + rng.randint(0, 1000) for _ in range(branches)]
            phase_of.append(True)
            slack_of.append(rng.uniform(0.01, 0.6))
        else:
            lens = [prefix]
            phase_of.append(False)
            slack_of.append(rng.uniform(0.5, 1.0))
        lens_of.append(lens)
        rows, ctx = rows + len(lens), ctx + sum(lens)
        first_rows, first_ctx = first_rows + 1, first_ctx + lens[0]
    t_first, t_all = model.predict(first_rows, first_ctx), model.predict(rows, ctx)
    budget = t_first + rng.uniform(-0.25, 1.25) * (t_all - t_first)
    tight = rng.randrange(n_requests)
    slack = [(budget / rho) * (1.0 if index == tight else 1.0 + extra)
             for index, extra in enumerate(slack_of)]
    return ArrayBatch([f"r{i}" for i in range(n_requests)],
                      np.array([len(request_lens) for request_lens in lens_of], dtype=np.int64),
                      np.array([length for request_lens in lens_of for length in request_lens],
                               dtype=np.int64),
                      np.array(slack, dtype=np.float64), np.ones(n_requests), np.array(phase_of, dtype=bool))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--fanout", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--policy", default="taper")
    parser.add_argument("--utility", default="linear")
    parser.add_argument("--rho", type=float, default=0.8)
    parser.add_argument("--repeat", type=int, default=1,
                        help="plan each batch R times and keep the fastest "
                             "(filters out other processes' load)")
    args = parser.parse_args(argv)

    rng = random.Random(args.seed)
    policy = parse_policy(args.policy, rho=args.rho, utility=args.utility)
    batches = [random_batch(rng, args.requests, args.fanout, args.rho) for _ in range(args.steps)]
    for batch in batches[:50]:  # warm up caches and numpy dispatch
        policy.plan(batch)
    gc.collect()
    gc.freeze()
    times, cpu, paths = [], [], {"protected": 0, "greedy": 0, "eager": 0}
    for batch in batches:
        best_wall = best_cpu = 1 << 62
        for _ in range(max(1, args.repeat)):
            cpu_start, wall_start = thread_time_ns(), perf_counter_ns()
            plan = policy.plan(batch)
            best_wall = min(best_wall, perf_counter_ns() - wall_start)
            best_cpu = min(best_cpu, thread_time_ns() - cpu_start)
        times.append(best_wall)
        cpu.append(best_cpu)
        width = plan.rows
        outcome = ("protected" if width == len(batch.rids) else "eager" if width == len(batch.ctx)
                   else "greedy")
        paths[outcome] += 1
    med, p99 = _pct(times, 0.5), _pct(times, 0.99)
    rows = sum(len(batch.ctx) for batch in batches) / len(batches)
    print(f"policy={policy.name} utility={args.utility} requests={args.requests} fanout={args.fanout} "
          f"steps={args.steps} seed={args.seed} repeat={args.repeat} mean rows/step={rows:.0f}")
    print("steps by outcome: " + ", ".join(f"{outcome} {count / len(batches):.0%}"
                                           for outcome, count in paths.items()))
    print(f"planner per step: median {med:.3f} ms, P99 {p99:.3f} ms, max {max(times) / 1e6:.3f} ms (wall)")
    print(f"                  median {_pct(cpu, 0.5):.3f} ms, P99 {_pct(cpu, 0.99):.3f} ms "
          f"(thread CPU time); load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    ref_us = min(timeit.repeat("sum(range(1000))", number=1000, repeat=5)) * 1e3
    print(f"CPU speed now: sum(range(1000)) takes {ref_us:.0f} us (a modern idle core: ~10 us); "
          "times scale with it")
    print(f"goal (median <= {GOAL_MEDIAN_MS} ms, P99 <= {GOAL_P99_MS} ms): "
          f"{'met' if med <= GOAL_MEDIAN_MS and p99 <= GOAL_P99_MS else 'NOT met'}")
    print(f"TAPER paper (Table 7): median {PAPER_MEDIAN_MS} ms, P99 {PAPER_P99_MS} ms")


def _pct(values_ns: list[int], quantile: float) -> float:
    """The `quantile` of nanosecond values, in ms."""
    ordered = sorted(values_ns)
    return ordered[min(len(ordered) - 1, int(quantile * len(ordered)))] / 1e6


if __name__ == "__main__":
    main()
