"""Live servers under the load benches: launch settings, the server pool, the probe-set operating
point and live points as a capacity engine's point function.

bench.capacity (`--engine replay`) and bench.sweep (`make bench`) both run on this module; neither
imports the other's engine. The operating point follows the machine: the first non-taper server
is probed (bench.probe), the SLO is the probe's auto SLO (unless given) times a scale, taper
servers plan with the probe's fit, and the fluid bound comes from that fit and the contexts the
live client really sends (bench.bound.LIVE_CLIENT) over a long draw of the programs.
"""

from __future__ import annotations

import asyncio
import re
import shlex
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from bench import emulated
from bench.bound import LIVE_CLIENT, fluid_bound_rps
from bench.confidence import point_line, pool
from bench.point import PointSetup, run_point
from bench.probe import Probe, probe
from bench.report import fmt
from bench.results import write_records
from branchwise.taper.predictor import LinearLatencyModel
from branchwise.tools.launch import LocalServer

ENV_TOKEN = re.compile(r"[A-Z][A-Z0-9_]*=")  # a variant's NAME=VALUE token: the server's environment


@dataclass(frozen=True, slots=True)
class ServerSettings:
    """How launched servers run (the flags every policy's server shares)."""

    model: str = "models/tiny"
    taper_rho: float = 0.8
    server_threads: int = 1  # OMP threads: torch's spin at barriers, so more than free cores slows every step
    max_total_tokens: int = 65536  # room for every live prefix: no policy pays re-prefills
    extra_args: str = ""
    # server variants (bench.sweep --variant): a label served by a policy with more flags (a NAME=VALUE
    # token among them sets the server's environment, e.g. BRANCHWISE_PREFILL_BUDGET=1)
    variants: Mapping[str, tuple[str, str]] = field(default_factory=dict)

    def args(self, policy: str, slo_ms: float | None, latency_model: str | None) -> list[str]:
        """Requests carry their SLO stamp; the flag covers unstamped ones. `policy` may be a
        variant's label: its policy, then its flags after every shared one."""
        policy, own = self.variants.get(policy, (policy, ""))
        args = ["--branch-policy", policy, "--taper-rho", f"{self.taper_rho:g}", "--enable-metrics"]
        args += ["--branch-slo-tpot-ms", f"{slo_ms:.6g}"] if slo_ms else []
        args += ["--latency-model", latency_model] if latency_model else []
        return args + shlex.split(self.extra_args) + [arg for arg in shlex.split(own) if not ENV_TOKEN.match(arg)]

    def env(self, policy: str) -> dict[str, str]:
        """The server's own environment: OMP threads, and a variant's NAME=VALUE tokens."""
        own = self.variants.get(policy, (policy, ""))[1]
        env = {"OMP_NUM_THREADS": str(self.server_threads)} if self.server_threads else {}
        return env | dict(arg.split("=", 1) for arg in shlex.split(own) if ENV_TOKEN.match(arg))

    def server(self, policy: str, slo_ms: float | None, latency_model: str | None) -> LocalServer:
        """The server, not started yet."""
        return LocalServer(self.model, self.args(policy, slo_ms, latency_model), env=self.env(policy),
                           max_total_tokens=self.max_total_tokens)

    def start(self, policy: str, slo_ms: float | None, latency_model: str | None) -> LocalServer:
        return self.server(policy, slo_ms, latency_model).start()


@dataclass(slots=True)
class Servers:
    """Where each policy is served: launched on first use (at most `max_alive` at once, the least
    recently used stops first; a CPU server holds ~3 GB) or given as running servers' URLs."""

    settings: ServerSettings | None = None  # None: only `urls`
    urls: dict[str, str] = field(default_factory=dict)
    slo_ms: float | None = None  # for servers started from now on
    latency_model: str | None = None
    max_alive: int = 3
    alive: OrderedDict[str, LocalServer] = field(default_factory=OrderedDict)

    def url(self, policy: str) -> str:
        if policy in self.urls:
            return self.urls[policy]
        if self.settings is None:
            raise ValueError(f"no server for policy {policy!r} (given: {', '.join(self.urls) or 'none'})")
        if policy in self.alive:
            self.alive.move_to_end(policy)
            return self.alive[policy].url
        while len(self.alive) >= self.max_alive:
            self.alive.popitem(last=False)[1].stop()
        self.alive[policy] = self.settings.start(policy, self.slo_ms, self.latency_model)
        return self.alive[policy].url

    def stop(self, policy: str) -> None:
        if policy in self.alive:
            self.alive.pop(policy).stop()

    def close(self) -> None:
        while self.alive:
            self.alive.popitem()[1].stop()


def probe_server(url: str) -> Probe:
    probed = asyncio.run(probe(url, repeats=3))
    print(f"probe {url}: {probed.line()}", flush=True)
    return probed


def calibration_policy(policies: list[str]) -> str:
    """The server the probe reads: the first policy that needs no T(S) (serial probe streams read the
    same under every policy), else a temporary serial server."""
    return next((policy for policy in policies if not policy.startswith("taper")), "serial")


def live_bound_rps(probed: Probe, setup: PointSetup, seed: int = 0, duration_s: float = 2000.0) -> float:
    """The fluid bound at setup's SLO under the probed T(S), over the programs' real contexts."""
    specs = replace(setup, duration_s=duration_s).programs(1.0, seed)[1]
    return fluid_bound_rps(probed.model, setup.slo_tpot_ms / 1e3, specs, LIVE_CLIENT)


@dataclass(frozen=True, slots=True)
class OperatingPoint:
    probe: Probe
    setup: PointSetup  # with the SLO
    probed_slo_ms: float  # the probe's auto SLO before any scale
    fluid_bound_rps: float
    latency_model: str  # the probe's fit, saved for taper servers


def device_point(model: LinearLatencyModel, base: PointSetup, slo_ms: float | None = None,
                 slo_scale: float = 1.0) -> tuple[float, PointSetup, float]:
    """The load rule on an emulated device (bench.emulated): the preset's T(S), not a probe of the CPU,
    gives the auto SLO and the fluid bound. (auto SLO ms, the setup with its SLO, load 1.0 in req/s)."""
    modeled = Probe({}, model)
    auto_ms = 1e3 * modeled.auto_slo_s()
    setup = replace(base, slo_tpot_ms=(slo_ms or auto_ms) * slo_scale)
    return auto_ms, setup, live_bound_rps(modeled, setup)


def calibrate(servers: Servers, policies: list[str], base: PointSetup, out: Path, slo_ms: float | None = None,
              slo_scale: float = 1.0, device: str | None = None) -> OperatingPoint:
    """Probe, fix the SLO (given, or the probe's auto SLO; times slo_scale) and the fluid bound, and
    set what the servers started from now on get (the SLO, the fit as --latency-model). With an
    emulated `device` (an --emulate-device value) its preset's T(S) takes the probe's place."""
    if device is not None:
        probed = Probe({}, emulated.spec_model(device))
        auto_ms, setup, bound = device_point(probed.model, base, slo_ms, slo_scale)
        coefs = probed.model
        print(f"emulated device {device}: T = {1e3 * coefs.c0:.2f} ms + {1e3 * coefs.c_seq:.3f} ms/row + "
              f"{1e6 * coefs.c_ctx:.3f} us/ctx token + {1e6 * coefs.c_tok:.1f} us/prefill token (the "
              "preset's T(S), no probe)", flush=True)
    else:
        calib = calibration_policy(policies)
        if servers.settings is None and calib not in servers.urls:
            calib = next(iter(servers.urls))
        probed = probe_server(servers.url(calib))
        if calib not in policies:
            servers.stop(calib)
        auto_ms = 1e3 * probed.auto_slo_s()
        setup = replace(base, slo_tpot_ms=(slo_ms or auto_ms) * slo_scale)
        bound = live_bound_rps(probed, setup)
    out.mkdir(parents=True, exist_ok=True)
    model = str(out / "latency_model.json")
    probed.model.save(model)
    servers.slo_ms, servers.latency_model = setup.slo_tpot_ms, model
    return OperatingPoint(probed, setup, auto_ms, bound, model)


Job = tuple[str, float, int]  # (policy, rate, seed)


@dataclass(slots=True)
class LivePoints:
    """A capacity engine's point function on live servers: bench.point.run_point per (policy, rate,
    seed), `repeats` runs of it (plus `extra[(policy, rate, seed)]` more) pooled into one point
    (bench.confidence.pool), records per run under `out`, every finished run kept in `runs` and
    `done` (an interrupted sweep keeps them). A run is never repeated: a later call runs only the
    repeats it lacks."""

    servers: Servers
    setup: PointSetup
    fluid_bound_rps: float
    out: Path | None = None
    progress: bool = False
    done: list[dict[str, Any]] = field(default_factory=list)
    repeats: int = 1
    extra: dict[Job, int] = field(default_factory=dict)
    runs: dict[Job, list[dict[str, Any]]] = field(default_factory=dict)
    walls: dict[Job, list[float]] = field(default_factory=dict)  # seconds per run

    def wanted(self, job: Job) -> int:
        return self.repeats + self.extra.get(job, 0)

    def __call__(self, policy: str, rate: float, seed: int) -> dict[str, Any]:
        job = (policy, rate, seed)
        while len(self.runs.get(job, [])) < self.wanted(job):
            self._run(job)
        return emulated.mark(pool(self.runs[job]))

    def batch(self, jobs: Sequence[Job]) -> list[dict[str, Any]]:
        """Every job's runs, each (rate, seed)'s repeats interleaved: repeat k runs the policies in
        the jobs' order rotated by k, so a drift of the machine does not always hit the same one."""
        groups: dict[tuple[float, int], list[str]] = {}
        for policy, rate, seed in jobs:
            groups.setdefault((rate, seed), []).append(policy)
        for (rate, seed), policies in groups.items():
            for k in range(max(self.wanted((policy, rate, seed)) for policy in policies)):
                shift = k % len(policies)
                for policy in policies[shift:] + policies[:shift]:
                    job = (policy, rate, seed)
                    if len(self.runs.get(job, [])) == k < self.wanted(job):
                        self._run(job)
        return [self(*job) for job in jobs]

    def _run(self, job: Job) -> None:
        policy, rate, seed = job
        repeat = len(self.runs.get(job, []))
        url = self.servers.url(policy)  # may start the server: not part of the run's time
        start = time.perf_counter()
        metrics, run = run_point(url, policy, rate, seed, self.setup, progress=self.progress)
        load = rate / self.fluid_bound_rps if self.fluid_bound_rps > 0 else None
        metrics |= {"load": load, "policy": policy, "seed": seed, "repeat": repeat}
        self.done.append(metrics)
        self.runs.setdefault(job, []).append(metrics)
        self.walls.setdefault(job, []).append(time.perf_counter() - start)
        if self.out is not None:
            name = f"seed{seed}_rate{rate:.4g}_{policy}" + (f"_repeat{repeat}" if repeat else "")
            write_records(self.out / "records" / name, {policy: run})
        sure = point_line(metrics)
        print(f"seed {seed} rate {rate:.3f} ({fmt(load, nd=2)} x bound) {policy:>11}"
              + (f" repeat {repeat}" if repeat else "") + ": attainment "
              f"{fmt(metrics['attainment'], True)}, finished {fmt(metrics['finished_frac'], True)}, "
              f"decomposable P50 e2e {fmt(metrics['decomp_e2e_p50_s'], nd=2)} s, "
              f"goodput {fmt(metrics['goodput_tok_s'], nd=0)} tok/s"
              + (f"; 95%: {sure}" if sure else "") + _device_line(metrics)
              + (f"  [{metrics['error']}]" if metrics.get("error") else ""), flush=True)
        if run.interrupted:
            raise KeyboardInterrupt



def _device_line(metrics: dict[str, Any]) -> str:
    """A run's emulated-device figures for its progress line ('' without an emulated device)."""
    if metrics.get("device_forwards") is None:
        return ""
    exposed = metrics.get("device_exposed_ms_per_step")
    return (f"; device {metrics['device_overruns']}/{metrics['device_forwards']} overruns, exposed "
            f"{fmt(exposed, nd=2)} ms/step" + (" INVALID" if metrics.get("invalid") else ""))
