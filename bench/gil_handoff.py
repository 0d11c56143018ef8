"""Why the CPU forward thread does not raise throughput on a small model: GIL hand-off cost.

    python -m bench.gil_handoff [--ops 20000] [--busy-ms 1.0] [--period-ms 3.0] [--switch-ms 5,0.5]

A worker thread runs --ops small torch ops (64x64 matmul + tanh: each releases and retakes the
GIL, as a torch_native forward does thousands of times per step); meanwhile the main thread holds
the GIL for --busy-ms of Python every --period-ms (the scheduler thread's per-step work). Printed:
the worker's time alone and with the main thread, and how much longer it got per millisecond of
main-thread CPU. 1.0 would be plain serialisation (the two threads' Python simply taking turns);
above 1.0 each hand-off costs extra (wake-ups, the switch interval's forced drops). Below 1.0 the
main thread's Python would overlap the worker's ops for free, which is what a forward thread needs
to win; the measured ratios, and SGLang's forward on the thread under bench.overhead --ab, are in
docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time

import torch


def _ops(mat: torch.Tensor, count: int) -> torch.Tensor:
    out = mat
    for _ in range(count):
        out = torch.tanh(out @ mat * 0.01)
    return out


def run(ops: int, busy_ms: float, period_ms: float) -> tuple[float, float, float]:
    """(worker alone s, worker beside the main thread s, main-thread CPU s)."""
    mat = torch.randn(64, 64)
    start = time.perf_counter()
    _ops(mat, ops)
    alone = time.perf_counter() - start
    done, took = threading.Event(), [0.0]

    def worker() -> None:
        worker_start = time.perf_counter()
        _ops(mat, ops)
        took[0] = time.perf_counter() - worker_start
        done.set()

    thread = threading.Thread(target=worker)
    thread.start()
    cpu = 0.0
    while not done.is_set():
        cpu_start, end = time.thread_time(), time.perf_counter() + busy_ms / 1e3
        while time.perf_counter() < end:  # Python work: holds the GIL
            pass
        cpu += time.thread_time() - cpu_start
        done.wait(period_ms / 1e3)  # blocked: the GIL is free
    thread.join()
    return alone, took[0], cpu


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", type=int, default=20000)
    parser.add_argument("--busy-ms", type=float, default=1.0)
    parser.add_argument("--period-ms", type=float, default=3.0)
    parser.add_argument("--switch-ms", default="5,0.5", help="sys.setswitchinterval values to try (ms)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # as the servers run (OMP_NUM_THREADS=1)
    for switch_ms in (float(value) for value in args.switch_ms.split(",")):
        sys.setswitchinterval(switch_ms / 1e3)
        alone, beside, cpu = run(args.ops, args.busy_ms, args.period_ms)
        print(f"switch interval {switch_ms:g} ms: worker alone {alone * 1e3:.0f} ms, beside the main thread "
              f"{beside * 1e3:.0f} ms (+{(beside - alone) * 1e3:.0f} ms for {cpu * 1e3:.0f} ms "
              f"of main-thread CPU: {(beside - alone) / max(cpu, 1e-9):.2f} ms per ms)", flush=True)


if __name__ == "__main__":
    main()
