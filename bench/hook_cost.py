"""Per-step CPU cost of Branchwise's always-on hook bodies on a serial decode batch (no server).

    python -m bench.hook_cost [--batch-sizes 1,32,128] [--steps 400] [--repeat 5]

A server with Branchwise installed and its flags off runs these hooks every decode step, whatever
the requests: TAPER's AROUND update_running_batch and AFTER process_batch_result, server-side fork's
output-stream filter and whatever SGLang's Req.update_finish_state resolves to per row (fork's
per-token hook is only set on tracked requests). This drives them on real SGLang `Req`s in a
plain-serial batch (fake Scheduler/ScheduleBatch shells: the hooks must exit before touching
anything else) and reports, per step, the time they add over SGLang's own per-row work they wrap
(append a token + update_finish_state), measured alternately in the same process. Much steadier
than bench.overhead on a shared machine, where the whole-step figures move by more than the hooks.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from array import array
from pathlib import Path
from types import SimpleNamespace
from typing import Any

try:
    import branchwise  # noqa: F401
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "overlay"))

from branchwise import request_meta, runtime, scheduler_hook  # noqa: E402
from branchwise.config import BranchwiseConfig  # noqa: E402
from branchwise.fork import hooks as fork  # noqa: E402


def _reqs(count: int) -> list[Any]:
    os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    out = []
    for i in range(count):
        sampling = SamplingParams(max_new_tokens=1 << 30, ignore_eos=True)
        sampling.normalize(None)
        req = Req(f"r{i}", "x", array("q", [1, 2, 3]), sampling, vocab_size=100)
        req.bw_meta = request_meta.SERIAL  # as after_create_generation_req leaves a plain request
        out.append(req)
    return out


def _sglang_rows(reqs: list[Any]) -> None:
    for req in reqs:
        req.output_ids.append(5)
        req.update_finish_state(1)


def measure(batch_size: int, steps: int) -> tuple[float, float]:
    """(median us per step of SGLang's per-row work alone, of the same with the hooks)."""
    cfg = BranchwiseConfig()
    state = scheduler_hook.BranchwiseState(config=cfg, controller=scheduler_hook._build_controller(cfg))
    sched = SimpleNamespace(branchwise=runtime.Branchwise(config=state.config, state=state))
    # the output streamer shares the scheduler's tree cache, where fork.build leaves its manager
    streamer = SimpleNamespace(tree_cache=SimpleNamespace(_branchwise_fork=SimpleNamespace(tracking=False)))
    reqs = _reqs(batch_size)
    batch = SimpleNamespace(reqs=reqs, is_empty=lambda: False, forward_iter=0, launch_ts=0.0,
                            forward_mode=SimpleNamespace(is_decode=lambda: True, is_mixed=lambda: False))

    def hooked(step: int) -> None:
        batch.forward_iter, batch.launch_ts = step, step * 1e-3
        scheduler_hook.around_update_running_batch(lambda self, running: running, sched, batch)
        _sglang_rows(reqs)
        fork.around_stream_output(lambda self, streamed, *rest: streamed, streamer, reqs)
        scheduler_hook.after_process_batch_result(None, sched, batch)

    base, hook = [], []
    for step in range(steps):  # alternate, so both see the same machine load
        start = time.perf_counter()
        _sglang_rows(reqs)
        mid = time.perf_counter()
        hooked(step)
        end = time.perf_counter()
        base.append(mid - start)
        hook.append(end - mid)
    skip = steps // 8  # warm-up
    return 1e6 * statistics.median(base[skip:]), 1e6 * statistics.median(hook[skip:])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", default="1,32,128")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--repeat", type=int, default=5,
                        help="runs per batch size; the lowest added cost counts")
    args = parser.parse_args(argv)
    for batch_size in [int(size) for size in args.batch_sizes.split(",")]:
        runs = [measure(batch_size, args.steps) for _ in range(args.repeat)]
        base, hook = min(runs, key=lambda run: run[1] - run[0])
        print(f"bs {batch_size:4d}: SGLang per-row work {base:8.1f} us/step, "
              f"with Branchwise hooks {hook:8.1f} us/step: "
              f"hooks add {hook - base:7.1f} us ({(hook - base) / base:+.1%})", flush=True)


if __name__ == "__main__":
    main()
