"""Trace workload: arrival schedules from an LLM-trace CSV and a request composer with branch structure.

A trace CSV has the Azure LLM inference schema `TIMESTAMP,ContextTokens,GeneratedTokens` (TIMESTAMP
is an ISO date-time or seconds as a number). Schedules keep the trace's arrival pattern: `unscaled`
(the trace's own arrival times), `rate:X` (time-scaled to a mean of X req/s) and `paper-3regime`
(TAPER Appendix D's 600-minute low/high/moderate envelope times the trace's burstiness);
`compress=F` makes a run F times shorter at the same load. The composer turns each arrival into a
`RequestSpec`: prompt length from the trace, output length and phase structure from a `Preset`.
All random draws come from one seeded generator, so a (trace, schedule, preset, seed) tuple is
reproducible. Details: docs/design/simulator.md.

    python -m bench.workload synth OUT.csv [--rate R] [--duration S] [--seed N]
    python -m bench.workload stats CSV [--schedule S] [--preset P]
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
# the Azure conversation trace
DEFAULT_TRACE = str(Path(__file__).parent / "data" / "AzureLLMInferenceTrace_conv.csv")


class TraceError(ValueError):
    """The CSV is not a usable trace (missing columns, unparsable, non-finite or empty rows), or it
    cannot supply the asked-for schedule (too few arrivals, too short)."""


@dataclass(frozen=True, slots=True)
class Trace:
    arrival_s: np.ndarray  # seconds since the first arrival, sorted
    prompt_tokens: np.ndarray  # int64
    output_tokens: np.ndarray  # int64
    source: str = ""

    def __len__(self) -> int:
        return len(self.arrival_s)

    @property
    def duration_s(self) -> float:
        return float(self.arrival_s[-1]) if len(self) else 0.0

    @property
    def mean_rate(self) -> float:
        return (len(self) - 1) / self.duration_s if self.duration_s > 0 else float("nan")


def _parse_times(values: list[str], path: str) -> np.ndarray:
    try:
        return np.array([float(value) for value in values])
    except ValueError:
        pass
    out = np.empty(len(values))
    for idx, value in enumerate(values):
        try:
            out[idx] = np.datetime64(value.strip(), "ns").astype(np.int64) / 1e9
        except ValueError:
            raise TraceError(f"{path}: row {idx + 2}: TIMESTAMP {value!r} is neither a number nor a "
                             "date-time") from None
    return out


def load_trace(path: str | Path) -> Trace:
    """Read a trace CSV; raise TraceError naming the file and row on anything malformed."""
    path = str(path)
    try:
        with open(path, newline="", encoding="utf-8-sig") as handle:
            reader = csv.DictReader(handle)
            header = reader.fieldnames or []
            missing = [col for col in COLUMNS if col not in header]
            if missing:
                raise TraceError(f"{path}: missing column(s) {missing}; expected header "
                                 f"{','.join(COLUMNS)}, got {header}")
            rows = list(reader)
    except (OSError, UnicodeDecodeError, csv.Error) as e:
        raise TraceError(f"{path}: cannot read trace: {e}") from e
    if not rows:
        raise TraceError(f"{path}: no data rows")
    times, prompts, outputs = [], [], []
    for idx, row in enumerate(rows):
        try:
            prompt, output = int(row["ContextTokens"]), int(row["GeneratedTokens"])
        except (TypeError, ValueError):
            raise TraceError(f"{path}: row {idx + 2}: token counts must be integers, got {row}") from None
        if prompt < 0 or output < 0 or row["TIMESTAMP"] is None:
            raise TraceError(f"{path}: row {idx + 2}: negative or missing values in {row}")
        times.append(row["TIMESTAMP"])
        prompts.append(prompt)
        outputs.append(output)
    times_s = _parse_times(times, path)
    bad = np.flatnonzero(~np.isfinite(times_s))
    if len(bad):
        raise TraceError(f"{path}: row {bad[0] + 2}: TIMESTAMP {times[bad[0]]!r} is not a finite time "
                         f"({len(bad)} such row(s))")
    order = np.argsort(times_s, kind="stable")
    times_s = times_s[order] - times_s[order[0]]
    return Trace(times_s, np.asarray(prompts, np.int64)[order], np.asarray(outputs, np.int64)[order], path)


def write_trace(path: str | Path, trace: Trace, start: str = "2024-01-01T00:00:00") -> None:
    start_t = np.datetime64(start, "ns")
    stamps = start_t + (trace.arrival_s * 1e9).astype("timedelta64[ns]")
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(COLUMNS)
        for stamp, prompt, output in zip(stamps, trace.prompt_tokens, trace.output_tokens, strict=True):
            writer.writerow([str(stamp).replace("T", " "), int(prompt), int(output)])


def synthetic_trace(duration_s: float = 3600.0, rate: float = 4.0, seed: int = 1) -> Trace:
    """A bursty trace no constant was ever tuned on: a 2-state Markov-modulated Poisson process
    (calm at 0.6x, bursts at 2.5x the mean, ~90 s sojourns) with lognormal prompt/output lengths
    unlike Azure's (longer outputs, shorter prompts)."""
    rng = np.random.default_rng(seed)
    calm, burst = 0.6 * rate, 2.5 * rate
    p_burst = (rate - calm) / (burst - calm)  # fraction of time bursting so the mean is `rate`
    clock_s, times, bursting = 0.0, [], False
    while clock_s < duration_s:
        stay = rng.exponential(90.0 * (p_burst / (1 - p_burst) if bursting else 1.0))
        end = min(clock_s + stay, duration_s)
        lam = burst if bursting else calm
        n_arrivals = rng.poisson(lam * (end - clock_s))
        times.extend(np.sort(rng.uniform(clock_s, end, n_arrivals)))
        clock_s, bursting = end, not bursting
    arrivals = np.asarray(times)
    n_arrivals = len(arrivals)
    prompts = np.clip(rng.lognormal(6.0, 0.9, n_arrivals), 4, 16000).astype(np.int64)
    outputs = np.clip(rng.lognormal(5.6, 0.8, n_arrivals), 4, 4000).astype(np.int64)
    return Trace(arrivals - arrivals[0], prompts, outputs, f"synthetic(rate={rate},seed={seed})")


# ---------------------------------------------------------------------------------------- schedules


@dataclass(frozen=True, slots=True)
class Regime:
    name: str
    start_s: float
    end_s: float


@dataclass(frozen=True, slots=True)
class Schedule:
    arrival_s: np.ndarray  # sorted arrival times in the run
    row: np.ndarray  # trace row that supplies each arrival's token counts
    duration_s: float
    regimes: tuple[Regime, ...]
    name: str

    def __len__(self) -> int:
        return len(self.arrival_s)

    def rate_in(self, start_s: float, end_s: float) -> float:
        count = np.count_nonzero((self.arrival_s >= start_s) & (self.arrival_s < end_s))
        return count / (end_s - start_s)


# (name, start min, end min, rate(x in [0,1]) -> req/s); regime means/peaks from TAPER Appendix D / §4.2.
PAPER_REGIMES: tuple[tuple[str, float, float], ...] = (
    ("low", 0.0, 240.0),
    ("transition", 240.0, 250.0),
    ("high", 250.0, 400.0),
    ("moderate", 400.0, 600.0),
)


def paper_rate(t_min: np.ndarray) -> np.ndarray:
    """The paper's envelope in req/s at minute t: flat low, a ramp, a sin^2 surge from 1.0 (mean 1.27,
    peak 1.54), then two 0.6 +- 0.3 waves."""
    minutes = np.asarray(t_min, float)
    x_hi = np.clip((minutes - 250.0) / 150.0, 0, 1)
    x_mod = np.clip((minutes - 400.0) / 200.0, 0, 1)
    low = np.full_like(minutes, 0.23)
    ramp = 0.23 + (1.0 - 0.23) * (minutes - 240.0) / 10.0
    surge = 1.0 + 0.54 * np.sin(np.pi * x_hi) ** 2
    return np.select(
        [minutes < 240, minutes < 250, minutes < 400],
        [low, ramp, surge],
        0.6 + 0.3 * np.sin(4 * np.pi * x_mod),
    )


def _unit_gaps(trace: Trace, window: int = 200) -> np.ndarray:
    """Inter-arrival gaps divided by their local (rolling) mean: bursts kept, slow drift removed."""
    gaps = np.diff(trace.arrival_s)
    if len(gaps) == 0 or not np.all(np.isfinite(gaps)) or gaps.sum() <= 0:
        raise TraceError(f"{trace.source}: need at least two distinct arrival times")
    kernel = np.ones(min(window, len(gaps)))
    # edge-exact rolling mean
    local = np.convolve(gaps, kernel, mode="same") / np.convolve(np.ones_like(gaps), kernel, mode="same")
    local[local <= 0] = gaps.mean()
    return gaps / local


def _warp(trace: Trace, rate_fn, duration_s: float, steps: int = 20000) -> tuple[np.ndarray, np.ndarray]:
    """Arrivals whose operational time (unit gaps, cycled) is mapped through Lambda^-1 of rate_fn."""
    grid = np.linspace(0.0, duration_s, steps + 1)
    rates = rate_fn(grid)
    cum = np.concatenate([[0.0], np.cumsum((rates[1:] + rates[:-1]) / 2 * np.diff(grid))])
    total = cum[-1]
    gaps = _unit_gaps(trace)
    reps = int(math.ceil(total * 1.2 / gaps.sum())) + 1
    op_time = np.cumsum(np.tile(gaps, reps))
    op_time = np.concatenate([[0.0], op_time])
    op_time = op_time[op_time < total]
    arrivals = np.interp(op_time, cum, grid)
    return arrivals, np.arange(len(arrivals)) % len(trace)


def stationary_schedule(trace: Trace, rate: float, duration_s: float, seed: int = 0) -> Schedule:
    """`rate` req/s for `duration_s`: the trace's burst pattern (each gap over its local mean, as in
    paper-3regime) at a constant mean rate, read from a seed-chosen place in the trace (cycled).
    A prefix of the trace would not do for a short run: the Azure trace starts at ~60% of its mean
    rate. The same construction as bench.replay's live points."""
    if not (rate > 0 and duration_s > 0 and math.isfinite(rate) and math.isfinite(duration_s)):
        raise ValueError(f"rate and duration must be finite and > 0, got {rate}, {duration_s}")
    gaps = _unit_gaps(trace)
    start = int(np.random.default_rng(seed).integers(len(gaps)))
    n_gaps = int(rate * duration_s * 3) + 16
    arrival = np.concatenate([[0.0], np.cumsum(np.resize(np.roll(gaps, -start), n_gaps))]) / rate
    keep = arrival < duration_s
    row = (start + np.arange(len(arrival))) % len(trace)
    return Schedule(arrival[keep], row[keep], duration_s, (Regime("all", 0.0, duration_s),),
                    f"stationary {rate:.3g} req/s")


def build_schedule(trace: Trace, spec: str, compress: float = 1.0,
                   duration_s: float | None = None) -> Schedule:
    """`unscaled` | `rate:X` | `paper-3regime`; `compress` as in the module docstring.
    `duration_s` (unscaled and rate:X): keep only the first duration_s seconds; TraceError when the
    (scaled) trace is shorter than that. TraceError too when the trace has fewer than two distinct
    arrival times or the schedule would hold no arrival."""
    if not compress >= 1.0:
        raise ValueError(f"compress must be >= 1, got {compress}")
    if spec in ("unscaled",) or spec.startswith("rate:"):
        if len(trace) < 2 or not trace.duration_s > 0:
            raise TraceError(f"{trace.source}: schedule {spec!r} needs at least two distinct arrival times, "
                             f"the trace has {len(trace)} row(s) over {trace.duration_s:g} s")
        scale = 1.0
        if spec.startswith("rate:"):
            try:
                rate = float(spec.split(":", 1)[1])
            except ValueError:
                raise ValueError(f"bad schedule {spec!r}: rate:X needs a number") from None
            if not (rate > 0 and math.isfinite(rate)):
                raise ValueError(f"bad schedule {spec!r}: rate must be a finite number > 0")
            scale = trace.mean_rate / rate
        times = trace.arrival_s * scale
        duration = (trace.duration_s * scale) / compress
        if duration_s is not None:
            if duration_s > trace.duration_s * scale:
                raise TraceError(f"{trace.source}: too short for {spec!r} over {duration_s:g} s: it spans "
                                 f"{trace.duration_s * scale:g} s at that rate ({len(trace)} arrivals)")
            duration = duration_s
        keep = times <= duration
        if not keep.any():
            raise TraceError(f"{trace.source}: schedule {spec!r} holds no arrival")
        return Schedule(times[keep], np.flatnonzero(keep), duration, (Regime("all", 0.0, duration),), spec)
    if spec == "paper-3regime":
        duration = 600.0 * 60.0 / compress
        arrivals, row = _warp(trace, lambda t_s: paper_rate(t_s * compress / 60.0), duration)
        regimes = tuple(Regime(name, start * 60.0 / compress, end * 60.0 / compress)
                        for name, start, end in PAPER_REGIMES)
        return Schedule(arrivals, row, duration, regimes, spec)
    raise ValueError(f"unknown schedule {spec!r}: use unscaled, rate:X or paper-3regime")


# ---------------------------------------------------------------------------------- request composer


@dataclass(frozen=True, slots=True)
class Preset:
    """Branch structure of decomposable requests plus output-length distributions (lognormal, tokens).

    Fanout, PDR and PTS are the paper's; the output lengths are this simulator's calibration (see
    docs/benchmarks.md, "Calibration")."""

    name: str
    pdr: float  # fraction of requests that are decomposable
    fanout: dict[int, float]  # branch-fanout distribution per phase; its mean is the ABF
    pts: float  # mean share of a decomposable request's tokens generated in parallel phases
    phases_extra: float  # parallel phases per decomposable request = 1 + Poisson(phases_extra)
    serial_out: tuple[float, float]  # non-decomposable output length: lognormal (median, sigma)
    decomp_out: tuple[float, float]  # decomposable output length (all stages, all branches)
    branch_sigma: float = 0.35  # lognormal spread of branch lengths inside one phase (stragglers)
    max_out: int = 16384
    samples: bool = False  # a decomposable request is SGLang's n > 1: one phase of n equal samples
    trace_outputs: bool = False  # output lengths from the trace's GeneratedTokens (compose's flag)

    @property
    def abf(self) -> float:
        return sum(fanout * weight for fanout, weight in self.fanout.items()) / sum(self.fanout.values())


# Output lengths (see docs/benchmarks.md, "Calibration"): non-decomposable requests are
# ShareGPT-like (median 250, mean ~375 tokens); decomposable ones are long reasoning responses whose
# median (2700, mean ~3250) is the one calibrated constant: it puts IRP-Off's low-load step latency
# at the paper's 18 ms under the default latency model. SPRINT reuses both (not calibrated separately).
_SHAREGPT_OUT = (250.0, 0.9)
_REASONING_OUT = (2700.0, 0.6)

PRESETS: dict[str, Preset] = {
    # Multiverse (TAPER §4.1): PDR 50%, ABF 4.1, PTS 58%; few wide phases.
    "multiverse": Preset(
        "multiverse", 0.50, {2: 0.18, 3: 0.24, 4: 0.22, 5: 0.15, 6: 0.11, 7: 0.06, 8: 0.04}, 0.58, 0.6,
        serial_out=_SHAREGPT_OUT, decomp_out=_REASONING_OUT,
    ),
    # SPRINT (TAPER E.6): PDR 65%, ABF 2.8, PTS 35%; more frequent, shorter, narrower phases.
    "sprint": Preset(
        "sprint", 0.65, {2: 0.35, 3: 0.52, 4: 0.13}, 0.35, 2.5,
        serial_out=_SHAREGPT_OUT, decomp_out=_REASONING_OUT,
    ),
    # Best-of-n (sampling_params.n / OpenAI n): half the requests ask for n ~ U{2..8} samples of the
    # trace's prompt, each sample as long as the trace's output; the other half are serial.
    "best-of-n": Preset(
        "best-of-n", 0.50, dict.fromkeys(range(2, 9), 1.0), 1.0, 0.0,
        serial_out=_SHAREGPT_OUT, decomp_out=_SHAREGPT_OUT, samples=True, trace_outputs=True,
    ),
}


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """One request: arrival, prompt, and its output as stages. A serial stage is an int (tokens); a
    parallel phase is a tuple of branch lengths (tokens per branch)."""

    rid: str
    arrival_s: float
    prompt_tokens: int
    stages: tuple[int | tuple[int, ...], ...]
    samples: bool = False  # (1, (m,) * n): one request with n samples of 1 + m tokens (SGLang's n > 1)

    @property
    def decomposable(self) -> bool:
        return any(isinstance(stage, tuple) for stage in self.stages)

    @property
    def output_tokens(self) -> int:
        return sum(sum(stage) if isinstance(stage, tuple) else stage for stage in self.stages)

    @property
    def parallel_tokens(self) -> int:
        return sum(sum(stage) for stage in self.stages if isinstance(stage, tuple))


def _lognormal(rng: np.random.Generator, median_sigma: tuple[float, float]) -> float:
    return float(rng.lognormal(math.log(median_sigma[0]), median_sigma[1]))


def _split(rng: np.random.Generator, total: int, parts: int, minimum: int = 1) -> list[int]:
    """`total` tokens into `parts` positive pieces (Dirichlet shares)."""
    total = max(total, parts * minimum)
    shares = rng.dirichlet(np.full(parts, 2.0))
    out = np.maximum(np.floor(shares * (total - parts * minimum)).astype(int), 0) + minimum
    out[-1] += total - out.sum()
    return [int(piece) for piece in out]


def _decompose(rng: np.random.Generator, preset: Preset, total: int) -> tuple[int | tuple[int, ...], ...]:
    phases = 1 + int(rng.poisson(preset.phases_extra))
    fan_k = np.fromiter(preset.fanout, int)
    fan_p = np.fromiter(preset.fanout.values(), float)
    fans = rng.choice(fan_k, size=phases, p=fan_p / fan_p.sum())
    share = float(rng.beta(8 * preset.pts, 8 * (1 - preset.pts)))  # per-request PTS, mean preset.pts
    par_total = max(int(round(share * total)), int(fans.sum()))
    ser_total = max(total - par_total, phases + 1)
    serial = _split(rng, ser_total, phases + 1)
    phase_tok = _split(rng, par_total, phases)
    stages: list[int | tuple[int, ...]] = []
    for idx, (fanout, tok) in enumerate(zip(fans, phase_tok, strict=True)):
        stages.append(serial[idx])
        weights = rng.lognormal(0.0, preset.branch_sigma, int(fanout))
        branches = np.maximum(np.round(weights / weights.sum() * tok), 1).astype(int)
        stages.append(tuple(int(length) for length in branches))
    stages.append(serial[-1])
    return tuple(stages)


def _samples(rng: np.random.Generator, preset: Preset, length: int) -> tuple[int, tuple[int, ...]]:
    """n samples of `length` tokens: the first token (the prefill's) then n branches of the rest."""
    fan_k = np.fromiter(preset.fanout, int)
    fan_p = np.fromiter(preset.fanout.values(), float)
    fanout = int(rng.choice(fan_k, p=fan_p / fan_p.sum()))
    return (1, (max(length - 1, 1),) * fanout)


def compose(
    trace: Trace, schedule: Schedule, preset: Preset | str = "multiverse", seed: int = 0,
    trace_outputs: bool = False, max_prompt: int = 16384,
) -> list[RequestSpec]:
    """One RequestSpec per scheduled arrival. Output lengths come from the preset, or from the trace's
    GeneratedTokens when `trace_outputs` or the preset says so (decomposable ones are still split by
    the preset's PTS/ABF; a samples preset makes each of n samples that long)."""
    shape = PRESETS[preset] if isinstance(preset, str) else preset
    rng = np.random.default_rng(seed)
    out = []
    for idx, (arrival, row) in enumerate(zip(schedule.arrival_s, schedule.row, strict=True)):
        prompt = int(min(max(trace.prompt_tokens[row], 1), max_prompt))
        decomp = rng.random() < shape.pdr
        if trace_outputs or shape.trace_outputs:
            total = int(max(trace.output_tokens[row], 2))
        else:
            drawn = _lognormal(rng, shape.decomp_out if decomp else shape.serial_out)
            total = int(min(max(drawn, 2), shape.max_out))
        if decomp and shape.samples:
            samples = _samples(rng, shape, total)
            out.append(RequestSpec(f"r{idx}", float(arrival), prompt, samples, samples=True))
            continue
        stages = _decompose(rng, shape, total) if decomp else (total,)
        out.append(RequestSpec(f"r{idx}", float(arrival), prompt, stages))
    return out


def workload_stats(reqs: list[RequestSpec]) -> dict[str, float]:
    """PDR, ABF (mean fanout per phase), PTS (mean per decomposable request), mean output length."""
    dec = [req for req in reqs if req.decomposable]
    fans = [len(stage) for req in dec for stage in req.stages if isinstance(stage, tuple)]
    return {
        "requests": float(len(reqs)),
        "pdr": len(dec) / max(len(reqs), 1),
        "abf": float(np.mean(fans)) if fans else 0.0,
        "pts": float(np.mean([req.parallel_tokens / req.output_tokens for req in dec])) if dec else 0.0,
        "phases_per_decomposable": len(fans) / max(len(dec), 1),
        "mean_output_tokens": float(np.mean([req.output_tokens for req in reqs])) if reqs else 0.0,
        "mean_prompt_tokens": float(np.mean([req.prompt_tokens for req in reqs])) if reqs else 0.0,
    }


def main(argv: list[str] | None = None) -> int:
    """`python -m bench.workload synth OUT.csv [--rate R] [--duration S] [--seed N]`: write a synthetic
    trace; `python -m bench.workload stats CSV [--schedule S] [--preset P]`: describe a workload."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m bench.workload")
    sub = parser.add_subparsers(dest="cmd", required=True)
    synth = sub.add_parser("synth", help="write a bursty synthetic trace CSV (same schema as Azure's)")
    synth.add_argument("out")
    synth.add_argument("--rate", type=float, default=4.0)
    synth.add_argument("--duration", type=float, default=3600.0)
    synth.add_argument("--seed", type=int, default=1)
    stats = sub.add_parser("stats", help="schedule and composer statistics of a trace")
    stats.add_argument("trace")
    stats.add_argument("--schedule", default="paper-3regime")
    stats.add_argument("--preset", default="multiverse", choices=sorted(PRESETS))
    stats.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.cmd == "synth":
        trace = synthetic_trace(args.duration, args.rate, args.seed)
        write_trace(args.out, trace)
        print(f"{args.out}: {len(trace)} requests over {trace.duration_s:.0f} s "
              f"({trace.mean_rate:.2f} req/s)")
        return 0
    try:
        trace = load_trace(args.trace)
        sched = build_schedule(trace, args.schedule)
    except ValueError as e:
        print(f"error: {e}")
        return 2
    print(f"trace {args.trace}: {len(trace)} rows, {trace.duration_s:.0f} s, {trace.mean_rate:.2f} req/s")
    for regime in sched.regimes:
        rate = sched.rate_in(regime.start_s, regime.end_s)
        span = f"{regime.start_s / 60:6.0f}-{regime.end_s / 60:<6.0f}"
        print(f"  {regime.name:<10} {span} min  {rate:.3f} req/s")
    for name, value in workload_stats(compose(trace, sched, args.preset, args.seed)).items():
        print(f"  {name:<24} {value:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
