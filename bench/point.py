"""One live point: one policy at one stationary load on a running server, and its metrics.

What `python -m bench.sweep` (make bench, load sweeps) and `python -m bench.capacity --engine replay`
run. A point is a stationary schedule of `rate` req/s for `duration_s` (bench.workload's
`stationary_schedule`), composed into programs and replayed (bench.client) with `drain_s` after the
last arrival; its metrics carry `samples`, one entry per arrival (bench.confidence's intervals
resample them). The server's radix cache is flushed before the point (no point inherits another's
prefixes), and afterwards the point waits until the server has dropped the abandoned requests (their
leftover work would slow whatever runs next). Tokens are streamed 8 per chunk, so the per-gap TPOT
figure does not apply to live points and is left out. On a server with an emulated device the
point carries its `device_*` counters (/server_info before and after, bench.emulated) and whether
it is valid.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from bench import emulated
from bench.client import GenerateFn, Outcome, Run, Target, abort_all, execute, flush_cache
from bench.metrics import load_point, request_samples
from bench.programs import Scaling, build_programs, mean_demand_tok_s
from bench.results import summarize_run
from bench.workload import RequestSpec, Schedule, stationary_schedule
from branchwise import client as bw


@dataclass(frozen=True, slots=True)
class PointSetup:
    """What every live point of a sweep shares: the workload, the SLO and how long a point runs."""

    trace: Any
    slo_tpot_ms: float
    scaling: Scaling = Scaling(output_scale=1.0, max_stage_tokens=256)
    duration_s: float = 40.0
    drain_s: float = 20.0  # after the last arrival; whatever is unfinished then is a miss
    preset: str = "multiverse"
    slo_ttft_s: float | None = None
    stream_interval: int = 8
    vocab: int = 400
    poll_s: float = 1.0
    generate: GenerateFn = bw.generate

    def programs(self, rate: float, seed: int) -> tuple[Schedule, list[RequestSpec]]:
        schedule = stationary_schedule(self.trace, rate, self.duration_s, seed)
        return schedule, build_programs(self.trace, schedule, self.preset, seed, self.scaling)


EXTRA_KEYS = ("raw_throughput_tok_s", "slo_attainment_gap", "p99_tpot_serial_ms", "p99_tpot_parallel_ms",
              "max_gap_p99_ms", "ttft_p50_s", "step_latency_mean_ms", "admission_rate")


def point_metrics(rate: float, res: dict[str, Any], specs: list[RequestSpec],
                  duration_s: float) -> dict[str, Any]:
    """A load point's figures (bench.metrics.load_point), then the rest of the run's metrics and its
    bookkeeping."""
    run = res.get("run", {})
    counts = {"requests": res.get("requests", len(specs)),
              "demand_tok_s": mean_demand_tok_s(specs, duration_s)}
    bookkeeping = {"error": run.get("error"), "warning": run.get("warning"), "server": run.get("server"),
                   "client_stalls": run.get("client_stalls")}
    return load_point(rate, res) | counts | {name: res.get(name) for name in EXTRA_KEYS} | bookkeeping


def run_point(url: str, policy: str, rate: float, seed: int, setup: PointSetup,
              progress: bool = False) -> tuple[dict[str, Any], Run]:
    """One policy at one stationary load on a running server: flush its cache, replay `rate` req/s for
    setup.duration_s (+ drain), wait until the server is idle again; the point's metrics and the run."""
    flushed = flush_cache(url)
    device_before = emulated.read_device(url)
    schedule, specs = setup.programs(rate, seed)
    run = Run(policy, [Outcome(spec) for spec in specs])
    target = Target(url, setup.slo_tpot_ms, seed, setup.stream_interval, vocab=setup.vocab,
                    generate=setup.generate)
    execute(run, target, schedule.duration_s + setup.drain_s, setup.poll_s, progress)
    if any(outcome.started and not outcome.finished for outcome in run.outcomes):
        abort_all(url)
    idle = flush_cache(url) if not run.interrupted else False  # waits until the server is idle
    device = emulated.device_delta(device_before, emulated.read_device(url))
    res = summarize_run(run, setup.slo_tpot_ms / 1e3, schedule, setup.slo_ttft_s)
    end = schedule.duration_s if run.t_stop is None else min(schedule.duration_s, run.t_stop)
    samples = request_samples(run.records, setup.slo_tpot_ms / 1e3, (0.0, max(end, 1e-9)), setup.slo_ttft_s)
    metrics = (point_metrics(rate, res, specs, schedule.duration_s)
               | {"cache_flushed": flushed, "left_idle": idle, "samples": samples} | device)
    if setup.stream_interval > 1:  # a delivery carries n tokens: the per-gap reading does not apply
        metrics["slo_attainment_gap"] = metrics["max_gap_p99_ms"] = None
    return emulated.mark(metrics), run
