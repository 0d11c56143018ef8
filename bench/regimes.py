"""Simulator regimes: one setting's latency model, SLO, engine costs, program scale and point length.

`default` is the paper's setting (bench.engine's defaults: the modelled Qwen3-32B server, a 50 ms
SLO, trace-scale programs, 180 s warm-up, 600 s measured, 300 s more of arrivals). The `live*`
regimes are `make bench`'s live sweep (bench.sweep) on a quiet 2-core CPU box serving the tiny
model, where one more row costs ~2-3% of the SLO and a step's floor ~25% of it (width is dear):
the box's probed T(S) and SLO, bench.point's programs scaled for the tiny model and run as
client-side fork/join, SGLang's separate prefill forwards, the sweep's KV pool, and what a loaded
step costs beyond T(S) (LIVE_HOST, LIVE_C_TOK). `device:SPEC` (`device_regime`, issue 36) is the
live sweep on an emulated device (--emulate-device SPEC): the preset's T(S) and the sweep's SLO rule
on it. Each regime's figures and where they come from: docs/design/simulator.md.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Any

from bench.engine import Cost, EngineConfig, HostCosts
from bench.programs import Scaling, scale_spec
from bench.workload import RequestSpec, compose, stationary_schedule
from branchwise.taper import LinearLatencyModel, default_model


@dataclass(frozen=True, slots=True)
class SimRegime:
    name: str
    coefs: tuple[float, float, float, float]  # T(S): c0, c_seq, c_ctx, c_tok (seconds)
    slo_s: float
    engine: EngineConfig  # its slo_s is set by `engine_for`
    scaling: Scaling | None = None  # None: the trace's lengths
    warmup_s: float = 180.0
    window_s: float = 600.0
    drain_s: float = 300.0
    calibrated: bool = False  # taper plans with this model as its --latency-model (intercept refit)
    drain_arrivals: bool = True  # arrivals go on through the drain (bench.capacity); False: live points
    graph_batch_sizes: tuple[int, ...] = ()  # decode rows padded to these (an emulated GPU's graphs)

    @property
    def model(self) -> LinearLatencyModel:
        return LinearLatencyModel(*self.coefs, graph_batch_sizes=self.graph_batch_sizes)

    def engine_for(self, slo_s: float | None = None, max_running: int = 0) -> EngineConfig:
        return replace(self.engine, slo_s=self.slo_s if slo_s is None else slo_s, max_running=max_running)


LIVE_SCALING = Scaling(output_scale=1.0, max_stage_tokens=256)  # bench.point.PointSetup's
_LIVE = EngineConfig(kv_tokens=65536, context_len=2048, prefill_steps=True, client_programs=True,
                     drain_s=20.0)
# What a loaded live step costs beyond the probe's T(S), from the step accounting of one make-bench
# load (bench.step_account, load 0.4, serial / eager / taper servers on a quiet 2-core box whose probe
# read T = 1.38 ms + 0.089 ms/row + 0.099 us/token; docs/design/benchmark-methods.md). Prefill forwards: ~1.5 ms
# per request plus ~25 us per new token on top of c0 (an arrival's 44-token prompt ~4 ms, a join's
# ~400 tokens ~13 ms, a fork of n branches ~2 + 1.8 n ms). Decode: eager's steps ran 0.50 ms +
# 0.02 ms/row above the probe's T (0.25 ms of it lost to the other processes, eager's mean run-queue
# wait); a step that defers rows costs 0.5 ms more (its sub-batch, the subset span of 0.22-0.30 ms,
# and the longer forward of deferring steps at equal rows) and ~0.05 ms per deferred row (regression
# of the step on rows run and deferred over all three servers); taper's planning adds 0.14 ms (its
# plan spans less eager's; 0.10 ms in the accounting after the kept sub-batch, not used here) to a
# step the planner decides. A step that runs every row unplanned (no deferral can pay, or every row
# fits) is charged nothing: its decision costs no more than eager's (bench.plan_cost).
LIVE_HOST = HostCosts(step=Cost(0.50e-3, 0.02e-3), plan=Cost(0.14e-3), subset=Cost(0.5e-3, 0.05e-3),
                      same_subset=Cost(0.5e-3, 0.05e-3), prefill=Cost(0.0, 1.5e-3))
LIVE_C_TOK = 25e-6


def _live(name: str, c0: float, c_seq: float, c_ctx: float, slo_s: float, host: HostCosts) -> SimRegime:
    return SimRegime(name, (c0, c_seq, c_ctx, LIVE_C_TOK), slo_s, replace(_LIVE, host=host), LIVE_SCALING,
                     0.0, 40.0, 20.0, True, drain_arrivals=False)


REGIMES = MappingProxyType({
    "default": SimRegime("default", default_model().coefs(), 0.050, EngineConfig()),
    # the box the step accounting ran on (its probe and SLO)
    "live": _live("live", 1.38e-3, 0.089e-3, 0.099e-6, 5.05e-3, LIVE_HOST),
    # a fresh clone on a quiet box (the make bench): its probe, the accounting's host costs
    "live-fast": _live("live-fast", 1.15e-3, 0.089e-3, 0.109e-6, 4.89e-3, LIVE_HOST),
})


def regime_specs(trace: Any, rate: float, duration_s: float, seed: int, preset: str,
                 scaling: Scaling | None) -> list[RequestSpec]:
    """A stationary point's requests, scaled as the regime's programs are (None: trace lengths)."""
    specs = compose(trace, stationary_schedule(trace, rate, duration_s, seed), preset, seed)
    return [scale_spec(spec, scaling) for spec in specs] if scaling is not None else specs


DEVICE_PREFIX = "device:"


def device_regime(spec: str) -> SimRegime:
    """`make bench BENCH_ARGS="--emulate-device SPEC"` in the simulator: the preset's T_device (its
    time scale applied; decode rows padded to its graph sizes; a prefill forward's rows at the
    per-row cost, booked as HostCosts.prefill) as the engine's step time and as taper's model, as on
    the emulated server, and the sweep's SLO on it (bench.emulated's load rule), the live programs,
    prefill forwards, pool and point length, and no host costs: the emulated server's scheduler work
    runs beside the modeled device, and the live sweep's exposed time per step says what that
    leaves out."""
    from bench import emulated
    from branchwise.device_model import parse_spec

    model = emulated.spec_model(spec)
    engine = replace(_LIVE, host=HostCosts(prefill=Cost(0.0, model.c_seq)))
    return SimRegime(DEVICE_PREFIX + spec, model.coefs(), emulated.device_slo_s(model), engine, LIVE_SCALING,
                     0.0, 40.0, 20.0, True, drain_arrivals=False,
                     graph_batch_sizes=parse_spec(spec).graph_batch_sizes)


def get_regime(name: str) -> SimRegime:
    """A named regime, or `device:SPEC` (`device_regime`)."""
    if name.startswith(DEVICE_PREFIX):
        return device_regime(name[len(DEVICE_PREFIX):])
    try:
        return REGIMES[name]
    except KeyError:
        raise ValueError(f"unknown regime {name!r}; valid: {', '.join(REGIMES)}, "
                         f"{DEVICE_PREFIX}PRESET|FILE[@xS]") from None
