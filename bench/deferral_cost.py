"""What a deferring decode step adds on the scheduler side: k of n ready rows run against a step
that has only those k rows, on a real SGLang scheduler in this process (no server).

    python -m bench.deferral_cost [--out FILE] [--sizes 8,32,128] [--fracs 0.25,0.5,0.75] [--steps 200]

Two arms share one real `Scheduler` of the tiny model (CPU, Branchwise's hooks installed) and
alternate step by step: arm A holds n rows and runs k = frac x n of them, arm B holds only the k
rows. Writes {"points": [{"n", "frac", "changed", "added_ms", "a_ms", "b_ms", "steps"}]}: added_ms =
median over steps of arm A's scheduler-side time minus the median of arm B's. The setup, what the
scheduler-side time covers and `changed`: docs/design/bench-tools.md. `scheduler`, `add_request` and
`iterate` also drive the integration tests' scheduler scenarios.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from array import array
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

try:
    import branchwise  # noqa: F401
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "overlay"))

from bench.report import write_json  # noqa: E402
from branchwise.request_meta import RequestMeta  # noqa: E402
from branchwise.tools.launch import cpu_env  # noqa: E402

FANOUT = 8
PROMPT = 64
WARMUP = 16
TOKENS = 3  # max new tokens per request, per step of a point


def scheduler(model: str, max_total_tokens: int, policy: str = "serial", **server_args: Any) -> Any:
    """A real SGLang Scheduler in this process, as a `--device cpu` server's scheduler process
    builds it (plugins loaded: Branchwise's hooks are on). Its outputs go nowhere. Drive it with
    `iterate`; a process holds one (SGLang's runtime context is process-wide)."""
    for key, value in cpu_env().items():  # what a CPU server's processes get (branchwise.tools.launch)
        os.environ.setdefault(key, value)
    from sglang.srt import runtime_context
    from sglang.srt.managers.scheduler import Scheduler, configure_scheduler_process
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import PortArgs, ServerArgs

    load_plugins()
    args = ServerArgs(model_path=model, device="cpu", attention_backend="torch_native", dtype="float32",
                      max_total_tokens=max_total_tokens, branch_policy=policy, **server_args)
    ranks = runtime_context.SpawnRanks(world_rank=0, dp_rank=None, gpu_id=0)
    runtime_context.publish(args, role="scheduler", ranks=ranks)
    configure_scheduler_process(args, 0)
    sched = Scheduler(args, PortArgs.init_new(args))
    sched.ipc_channels.send_to_detokenizer.socket = None  # no detokenizer: outputs are dropped
    sched.ipc_channels.send_to_tokenizer.socket = None
    sched.enable_skip_finishing_decode = True  # as event_loop_overlap sets them
    sched.result_queue = deque()
    return sched


def add_request(sched: Any, rid: str, ids: list[int], meta: RequestMeta, **sampling: Any) -> Any:
    """Queue one greedy request for prefill, as SGLang's handle_generate_request would (no tokenizer
    process: the request arrives as ids, its Branchwise stamp already parsed)."""
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    from branchwise import scheduler_hook

    params = SamplingParams(**({"temperature": 0, "ignore_eos": True} | sampling))
    params.normalize(None)
    req = Req(rid, "", array("q", ids), params, vocab_size=sched.model_config.vocab_size)
    req.tokenizer = sched.tokenizer
    req.bw_meta = meta
    if meta.is_branch:
        scheduler_hook.note_phase_requests(sched)
    sched.init_req_max_new_tokens(req)
    sched._add_request_to_queue(req)
    return req


def add_phase_requests(sched: Any, tag: str, phases: int, rows: int, *, max_new_tokens: int) -> list[Any]:
    """`phases` parallel phases of `rows` greedy branches each, queued for prefill."""
    return [add_request(sched, f"{tag}-p{phase}-b{branch}",
                        [1 + (phase * 31 + branch * 7 + pos) % 400 for pos in range(PROMPT)],
                        RequestMeta(phase=f"{tag}-p{phase}", branch=branch, fanout=FANOUT),
                        max_new_tokens=max_new_tokens)
            for phase in range(phases) for branch in range(rows)]


@dataclass
class Arm:
    """One arm's share of the scheduler's loop state, swapped in for its steps."""

    controller: Any
    kept: Any = None  # its deferral.KeptSubset
    running_batch: Any = None
    last_batch: Any = None
    result_queue: Any = None
    last_step: Any = None
    planned: dict = field(default_factory=dict)  # its BranchwiseState.planned
    times: list[float] = field(default_factory=list)


def _swap_in(sched: Any, arm: Arm) -> None:
    from sglang.srt.managers.schedule_batch import ScheduleBatch

    state = sched.branchwise.state
    sched.running_batch = (arm.running_batch if arm.running_batch is not None
                           else ScheduleBatch(reqs=[], batch_is_full=False))
    sched.last_batch = arm.last_batch
    sched.result_queue = arm.result_queue if arm.result_queue is not None else deque()
    state.controller, state.last_step, state.planned = arm.controller, arm.last_step, arm.planned
    if arm.kept is None:
        arm.kept = type(state.kept)()
    state.kept = arm.kept


def _swap_out(sched: Any, arm: Arm) -> None:
    state = sched.branchwise.state
    arm.running_batch, arm.last_batch = sched.running_batch, sched.last_batch
    arm.result_queue = sched.result_queue
    arm.controller, arm.last_step, arm.kept = state.controller, state.last_step, state.kept
    arm.planned = state.planned


def iterate(sched: Any) -> float:
    """One pass of Scheduler.event_loop_overlap (no input to receive); the seconds spent in
    get_next_batch_to_run and process_batch_result."""
    start = time.perf_counter()
    plan = sched.get_next_batch_to_run(running_batch=sched.running_batch, last_batch=sched.last_batch)
    sched_s = time.perf_counter() - start
    sched.running_batch, batch = plan.running_batch, plan.batch_to_run
    result = None
    if batch is not None:
        result = sched.run_batch(batch)
        sched.result_queue.append((batch.copy(), result))
    result_start = time.perf_counter()
    if sched.last_batch is not None:
        sched.process_batch_result(*sched.result_queue.popleft())
    sched_s += time.perf_counter() - result_start
    if batch is not None:
        sched.launch_batch_sample_if_needed(result, batch)
    sched.last_batch = batch
    return sched_s


def _trade_orders(reqs: list[Any], width: int) -> None:
    """In every phase, the last running row (order width-1) and the first deferred one (order width)
    trade orders: the controller then runs the other one of the two."""
    by_phase: dict[str, list[Any]] = {}
    for req in reqs:
        by_phase.setdefault(req.bw_meta.phase, []).append(req)
    for rows in by_phase.values():
        last_running = next(req for req in rows if req.bw_meta.branch == width - 1)
        first_deferred = next(req for req in rows if req.bw_meta.branch == width)
        last_running.bw_meta, first_deferred.bw_meta = (
            dataclasses.replace(last_running.bw_meta, branch=width),
            dataclasses.replace(first_deferred.bw_meta, branch=width - 1))


def _drain(sched: Any, arm: Arm, reqs: list[Any]) -> None:
    """Abort the arm's requests and step until they left (frees their KV and radix locks)."""
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    _swap_in(sched, arm)
    for req in reqs:
        req.to_finish = FINISH_ABORT("bench done")

    def drained() -> bool:
        return sched.running_batch.is_empty() and sched.last_batch is None and not sched.result_queue

    _until(sched, drained, "drain")
    _swap_out(sched, arm)


def _until(sched: Any, done: Any, what: str, limit: int = 64) -> None:
    for _ in range(limit):
        if done():
            return
        iterate(sched)
    raise RuntimeError(f"{what}: not done after {limit} iterations (waiting {len(sched.waiting_queue)}, "
                       f"running {sched.running_batch.batch_size()}, "
                       f"last batch {sched.last_batch is not None})")


def measure(sched: Any, n_rows: int, frac: float, changed: bool, steps: int, tag: str) -> dict[str, Any]:
    from branchwise.taper.controller import StepController
    from branchwise.taper.policies import parse_policy

    width = round(frac * FANOUT)
    phases = n_rows // FANOUT
    arms = [Arm(StepController(parse_policy(f"cap:{width}"))) for _ in range(2)]
    reqs = []
    for arm, rows in zip(arms, (FANOUT, width), strict=True):
        _swap_in(sched, arm)
        # enough tokens to outlast the point (the KV pool holds them all: no retraction)
        reqs.append(add_phase_requests(sched, f"{tag}-{'ab'[len(reqs)]}", phases, rows,
                                       max_new_tokens=TOKENS * (WARMUP + steps)))

        def prefilled(rows: int = rows) -> bool:
            return not sched.waiting_queue and sched.running_batch.batch_size() == phases * rows

        _until(sched, prefilled, "prefill", limit=64 + n_rows)
        _swap_out(sched, arm)
    for step_idx in range(WARMUP + steps):
        for arm, arm_reqs in zip(arms, reqs, strict=True):
            _swap_in(sched, arm)
            if changed and arm is arms[0]:
                _trade_orders(arm_reqs, width)
            step_s = iterate(sched)
            _swap_out(sched, arm)
            if step_idx >= WARMUP:
                arm.times.append(step_s)
    for arm, arm_reqs in zip(arms, reqs, strict=True):
        _drain(sched, arm, arm_reqs)
    a_ms, b_ms = (1e3 * statistics.median(arm.times) for arm in arms)
    return {"n": n_rows, "frac": frac, "changed": changed, "added_ms": a_ms - b_ms, "a_ms": a_ms,
            "b_ms": b_ms, "steps": steps}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="models/tiny")
    parser.add_argument("--sizes", default="8,32,128")
    parser.add_argument("--fracs", default="0.25,0.5,0.75")
    parser.add_argument("--steps", type=int, default=200, help="measured steps per arm and point")
    parser.add_argument("--out", help="write the points as JSON here")
    args = parser.parse_args(argv)
    sizes = [int(size) for size in args.sizes.split(",")]
    fracs = [float(frac) for frac in args.fracs.split(",")]
    if (any(size % FANOUT for size in sizes)
            or any(round(frac * FANOUT) not in range(1, FANOUT) for frac in fracs)):
        print(f"error: sizes must be multiples of {FANOUT} and fracs leave 1..{FANOUT - 1} of {FANOUT} rows",
              file=sys.stderr)
        return 2
    sched = scheduler(args.model,
                      max_total_tokens=2 * max(sizes) * (PROMPT + TOKENS * (WARMUP + args.steps)) + 4096)
    points = []
    for size in sizes:
        for frac in fracs:
            for changed in (False, True):
                point = measure(sched, size, frac, changed, args.steps, f"n{size}f{frac}c{int(changed)}")
                points.append(point)
                print(f"n {size:4d}  k/n {frac:.2f}  {'changed  ' if changed else 'unchanged'}: "
                      f"k of n rows {point['a_ms']:.3f} ms, k rows {point['b_ms']:.3f} ms, "
                      f"added {point['added_ms']:+.3f} ms", flush=True)
    if args.out:
        write_json(Path(args.out), {"points": points}, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
