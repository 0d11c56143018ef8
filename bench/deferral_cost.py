"""What a deferring decode step adds on the scheduler side: k of n ready rows run against a step
that has only those k rows, on a real SGLang scheduler in this process (no server).

    python -m bench.deferral_cost [--out FILE] [--sizes 8,32,128] [--fracs 0.25,0.5,0.75] [--steps 200]

One real `Scheduler` of the tiny model (CPU, overlap scheduling, Branchwise's hooks installed) runs
its own loop (get_next_batch_to_run, run_batch, process_batch_result) on requests put straight into
its waiting queue, with nothing to send them to (the output socket is unset). The rows are phases of
FANOUT branches. Arm A holds n rows and runs k = frac x n of them (policy cap:w, w = frac x FANOUT per
phase); arm B holds only k rows, w per phase, so nothing is deferred. The two arms keep separate
running batches and controllers and alternate step by step, so both see the same machine. A step's
scheduler-side time is get_next_batch_to_run + process_batch_result (TAPER's hooks run inside them;
run_batch builds the same k-row forward in both arms and is not counted). `changed`: before every
step of arm A, in every phase the last running row and the first deferred one trade branch orders,
so one row leaves and one joins each phase's active set (unchanged: the same rows run every step).

Writes {"points": [{"n", "frac", "changed", "added_ms", "a_ms", "b_ms", "steps"}]}: added_ms = median
over steps of arm A's time minus the median of arm B's.
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
from branchwise.launch import cpu_env  # noqa: E402
from branchwise.request_meta import RequestMeta  # noqa: E402

FANOUT = 8
PROMPT = 64
WARMUP = 16
TOKENS = 3  # max new tokens per request, per step of a point


def scheduler(model: str, max_total_tokens: int, policy: str = "off", **server_args: Any) -> Any:
    """A real SGLang Scheduler in this process, as a `--device cpu` server's scheduler process
    builds it (plugins loaded: Branchwise's hooks are on). Its outputs go nowhere. Drive it with
    `iterate`; a process holds one (SGLang's runtime context is process-wide)."""
    for key, value in cpu_env().items():  # what a CPU server's processes get (branchwise.launch)
        os.environ.setdefault(key, value)
    from sglang.srt import runtime_context as rc
    from sglang.srt.managers.scheduler import Scheduler, configure_scheduler_process
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import PortArgs, ServerArgs

    load_plugins()
    args = ServerArgs(model_path=model, device="cpu", attention_backend="torch_native", dtype="float32",
                      max_total_tokens=max_total_tokens, branch_policy=policy, **server_args)
    rc.publish(args, role="scheduler", ranks=rc.SpawnRanks(world_rank=0, dp_rank=None, gpu_id=0))
    configure_scheduler_process(args, 0)
    s = Scheduler(args, PortArgs.init_new(args))
    s.ipc_channels.send_to_detokenizer.socket = None  # no detokenizer: outputs are dropped
    s.ipc_channels.send_to_tokenizer.socket = None
    s.enable_skip_finishing_decode = True  # as event_loop_overlap sets them
    s.result_queue = deque()
    return s


def add_request(s: Any, rid: str, ids: list[int], meta: RequestMeta, **sampling: Any) -> Any:
    """Queue one greedy request for prefill, as SGLang's handle_generate_request would (no tokenizer
    process: the request arrives as ids, its Branchwise stamp already parsed)."""
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    from branchwise import scheduler_hook

    sp = SamplingParams(**({"temperature": 0, "ignore_eos": True} | sampling))
    sp.normalize(None)
    r = Req(rid, "", array("q", ids), sp, vocab_size=s.model_config.vocab_size)
    r.tokenizer = s.tokenizer
    r.bw_meta = meta
    if meta.is_branch:
        scheduler_hook.note_phase_requests(s)
    s.init_req_max_new_tokens(r)
    s._add_request_to_queue(r)
    return r


def add_phase_requests(s: Any, tag: str, phases: int, rows: int, *, max_new_tokens: int) -> list[Any]:
    """`phases` parallel phases of `rows` greedy branches each, queued for prefill."""
    return [add_request(s, f"{tag}-p{p}-b{b}", [1 + (p * 31 + b * 7 + i) % 400 for i in range(PROMPT)],
                        RequestMeta(phase=f"{tag}-p{p}", branch=b, fanout=FANOUT), max_new_tokens=max_new_tokens)
            for p in range(phases) for b in range(rows)]


@dataclass
class Arm:
    """One arm's share of the scheduler's loop state, swapped in for its steps."""

    controller: Any
    kept: Any = None  # its deferral.KeptSubset
    running_batch: Any = None
    last_batch: Any = None
    result_queue: Any = None
    last_step: Any = None
    times: list[float] = field(default_factory=list)


def _swap_in(s: Any, arm: Arm) -> None:
    from sglang.srt.managers.schedule_batch import ScheduleBatch

    st = s.branchwise.taper
    s.running_batch = arm.running_batch if arm.running_batch is not None else ScheduleBatch(reqs=[], batch_is_full=False)
    s.last_batch, s.result_queue = arm.last_batch, arm.result_queue if arm.result_queue is not None else deque()
    st.controller, st.last_step = arm.controller, arm.last_step
    if arm.kept is None:
        arm.kept = type(st.kept)()
    st.kept = arm.kept


def _swap_out(s: Any, arm: Arm) -> None:
    st = s.branchwise.taper
    arm.running_batch, arm.last_batch, arm.result_queue = s.running_batch, s.last_batch, s.result_queue
    arm.controller, arm.last_step, arm.kept = st.controller, st.last_step, st.kept


def iterate(s: Any) -> float:
    """One pass of Scheduler.event_loop_overlap (no input to receive); the seconds spent in
    get_next_batch_to_run and process_batch_result."""
    t0 = time.perf_counter()
    plan = s.get_next_batch_to_run(running_batch=s.running_batch, last_batch=s.last_batch)
    sched = time.perf_counter() - t0
    s.running_batch, batch = plan.running_batch, plan.batch_to_run
    result = None
    if batch is not None:
        result = s.run_batch(batch)
        s.result_queue.append((batch.copy(), result))
    t1 = time.perf_counter()
    if s.last_batch is not None:
        s.process_batch_result(*s.result_queue.popleft())
    sched += time.perf_counter() - t1
    if batch is not None:
        s.launch_batch_sample_if_needed(result, batch)
    s.last_batch = batch
    return sched


def _trade_orders(reqs: list[Any], width: int) -> None:
    """In every phase, the last running row (order width-1) and the first deferred one (order width)
    trade orders: the controller then runs the other one of the two."""
    by_phase: dict[str, list[Any]] = {}
    for r in reqs:
        by_phase.setdefault(r.bw_meta.phase, []).append(r)
    for rows in by_phase.values():
        a = next(r for r in rows if r.bw_meta.branch == width - 1)
        b = next(r for r in rows if r.bw_meta.branch == width)
        a.bw_meta, b.bw_meta = (dataclasses.replace(a.bw_meta, branch=width),
                                dataclasses.replace(b.bw_meta, branch=width - 1))


def _drain(s: Any, arm: Arm, reqs: list[Any]) -> None:
    """Abort the arm's requests and step until they left (frees their KV and radix locks)."""
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    _swap_in(s, arm)
    for r in reqs:
        r.to_finish = FINISH_ABORT("bench done")
    _until(s, lambda: s.running_batch.is_empty() and s.last_batch is None and not s.result_queue, "drain")
    _swap_out(s, arm)


def _until(s: Any, done: Any, what: str, limit: int = 64) -> None:
    for _ in range(limit):
        if done():
            return
        iterate(s)
    raise RuntimeError(f"{what}: not done after {limit} iterations (waiting {len(s.waiting_queue)}, "
                       f"running {s.running_batch.batch_size()}, last batch {s.last_batch is not None})")


def measure(s: Any, n: int, frac: float, changed: bool, steps: int, tag: str) -> dict[str, Any]:
    from branchwise.taper.controller import StepController
    from branchwise.taper.policies import parse_policy

    width = round(frac * FANOUT)
    phases = n // FANOUT
    arms = [Arm(StepController(parse_policy(f"cap:{width}"))), Arm(StepController(parse_policy(f"cap:{width}")))]
    reqs = []
    for arm, rows in zip(arms, (FANOUT, width), strict=True):
        _swap_in(s, arm)
        # enough tokens to outlast the point (the KV pool holds them all: no retraction)
        reqs.append(add_phase_requests(s, f"{tag}-{'ab'[len(reqs)]}", phases, rows, max_new_tokens=TOKENS * (WARMUP + steps)))
        _until(s, lambda rows=rows: not s.waiting_queue and s.running_batch.batch_size() == phases * rows, "prefill",
               limit=64 + n)
        _swap_out(s, arm)
    for i in range(WARMUP + steps):
        for arm, arm_reqs in zip(arms, reqs, strict=True):
            _swap_in(s, arm)
            if changed and arm is arms[0]:
                _trade_orders(arm_reqs, width)
            dt = iterate(s)
            _swap_out(s, arm)
            if i >= WARMUP:
                arm.times.append(dt)
    for arm, arm_reqs in zip(arms, reqs, strict=True):
        _drain(s, arm, arm_reqs)
    a_ms, b_ms = (1e3 * statistics.median(arm.times) for arm in arms)
    return {"n": n, "frac": frac, "changed": changed, "added_ms": a_ms - b_ms, "a_ms": a_ms, "b_ms": b_ms,
            "steps": steps}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="models/tiny")
    ap.add_argument("--sizes", default="8,32,128")
    ap.add_argument("--fracs", default="0.25,0.5,0.75")
    ap.add_argument("--steps", type=int, default=200, help="measured steps per arm and point")
    ap.add_argument("--out", help="write the points as JSON here")
    a = ap.parse_args(argv)
    sizes = [int(x) for x in a.sizes.split(",")]
    fracs = [float(x) for x in a.fracs.split(",")]
    if any(n % FANOUT for n in sizes) or any(round(f * FANOUT) not in range(1, FANOUT) for f in fracs):
        print(f"error: sizes must be multiples of {FANOUT} and fracs leave 1..{FANOUT - 1} of {FANOUT} rows",
              file=sys.stderr)
        return 2
    s = scheduler(a.model, max_total_tokens=2 * max(sizes) * (PROMPT + TOKENS * (WARMUP + a.steps)) + 4096)
    points = []
    for n in sizes:
        for frac in fracs:
            for changed in (False, True):
                p = measure(s, n, frac, changed, a.steps, f"n{n}f{frac}c{int(changed)}")
                points.append(p)
                print(f"n {n:4d}  k/n {frac:.2f}  {'changed  ' if changed else 'unchanged'}: "
                      f"k of n rows {p['a_ms']:.3f} ms, k rows {p['b_ms']:.3f} ms, added {p['added_ms']:+.3f} ms",
                      flush=True)
    if a.out:
        write_json(Path(a.out), {"points": points}, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
