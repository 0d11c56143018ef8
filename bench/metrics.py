"""Serving metrics from per-request token-delivery records (pure; shared by the simulator and replay).

A request's output is a sequence of stages, serial or parallel (`StageRecord`); a request meets
the SLO when it finished and its worst stage TPOT (and, when set, its TTFT) is within target.
`summarize` gives a window's figures and `per_regime` ones: attainment over ALL arrivals (an
unfinished request is a miss, so no policy looks good by stranding requests), goodput of the
SLO-meeting requests, throughput, TPOT and TTFT percentiles, end-to-end latency per request class,
the per-gap TPOT reading and the branch admission rate. `timeseries` bins the same definitions for
plots. The definitions in full: docs/design/simulator.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np


@dataclass(slots=True)
class StageRecord:
    parallel: bool
    start_s: float  # delivery that precedes the stage's first token (phase open for a parallel stage)
    end_s: float  # delivery of the stage's last token
    tokens: int  # tokens measured against start..end (all branches of a parallel stage)

    @property
    def tpot_s(self) -> float:
        return (self.end_s - self.start_s) / self.tokens if self.tokens > 0 else 0.0


@dataclass(slots=True)
class RequestRecord:
    rid: str
    arrival_s: float
    first_token_s: float = float("nan")  # nan: never got its first token
    stages: list[StageRecord] = field(default_factory=list)
    finished: bool = False
    decomposable: bool = False
    max_gap_s: float = float("nan")  # largest gap between deliveries after the first token; nan: unknown

    @property
    def ttft_s(self) -> float:
        return self.first_token_s - self.arrival_s

    @property
    def output_tokens(self) -> int:
        started = self.first_token_s == self.first_token_s
        return int(started) + sum(stage.tokens for stage in self.stages)

    @property
    def last_token_s(self) -> float:
        """Delivery of the last token of any branch (nan: never got its first token)."""
        return max((stage.end_s for stage in self.stages), default=self.first_token_s)

    @property
    def max_tpot_s(self) -> float:
        return max((stage.tpot_s for stage in self.stages if stage.tokens > 0), default=0.0)

    @classmethod
    def from_token_times(
        cls, rid: str, arrival_s: float, stages: Sequence[tuple[bool, Sequence[float]]], finished: bool = True
    ) -> RequestRecord:
        """Build a record from raw delivery times: `stages` is [(parallel, token times)], a parallel
        stage listing the tokens of all its branches (any order). For live-server replay."""
        decomposable = any(parallel for parallel, _ in stages)
        rec = cls(rid, arrival_s, finished=finished, decomposable=decomposable)
        every = sorted(t_s for _, times in stages for t_s in times)
        rec.max_gap_s = float(np.diff(every).max()) if len(every) > 1 else 0.0
        prev = None
        for parallel, times in stages:
            ordered = sorted(times)
            if not ordered:
                continue
            if prev is None:  # the response's first token is TTFT; the stage is measured after it
                rec.first_token_s, prev, ordered = ordered[0], ordered[0], ordered[1:]
                if not ordered:
                    continue
            rec.stages.append(StageRecord(parallel, prev, ordered[-1], len(ordered)))
            prev = ordered[-1]
        return rec


@dataclass(slots=True)
class StepLog:
    """Decode steps, possibly run-length encoded: one row may stand for `count` identical-shape steps."""

    t_s: list[float] = field(default_factory=list)  # start of the (first) step
    count: list[int] = field(default_factory=list)
    latency_s: list[float] = field(default_factory=list)  # summed over the `count` steps
    max_latency_s: list[float] = field(default_factory=list)
    eligible: list[int] = field(default_factory=list)  # opportunistic rows offered, summed
    admitted: list[int] = field(default_factory=list)  # opportunistic rows run, summed

    def add(self, t_s: float, count: int, latency: float, max_latency: float, eligible: int,
            admitted: int) -> None:
        self.t_s.append(t_s)
        self.count.append(count)
        self.latency_s.append(latency)
        self.max_latency_s.append(max_latency)
        self.eligible.append(eligible)
        self.admitted.append(admitted)

    def arrays(self) -> dict[str, np.ndarray]:
        return {name: np.asarray(getattr(self, name), float) for name in self.__slots__}


@dataclass(slots=True)
class _Flat:
    """Records as arrays, built once per summary."""

    arrival: np.ndarray
    first: np.ndarray
    last: np.ndarray  # last token of any branch
    finished: np.ndarray
    decomp: np.ndarray  # has a parallel phase
    out_tok: np.ndarray  # output tokens delivered so far
    good: np.ndarray  # met the SLO (stage-mean TPOT, and TTFT when a TTFT target is set)
    good_gap: np.ndarray  # the same under the per-gap TPOT reading
    gap: np.ndarray  # max_gap_s per request (nan: unknown)
    horizon: float  # end of observation: a request without a first token has waited this long
    stage_req: np.ndarray
    stage_par: np.ndarray
    stage_start: np.ndarray
    stage_end: np.ndarray
    stage_tok: np.ndarray

    @classmethod
    def build(cls, recs: Sequence[RequestRecord], slo_s: float, slo_ttft_s: float | None = None,
              horizon_s: float | None = None) -> _Flat:
        tol = slo_s * (1 + 1e-9)
        stage_rows = [(idx, stage.parallel, stage.start_s, stage.end_s, stage.tokens)
                      for idx, rec in enumerate(recs) for stage in rec.stages]
        stage_arr = np.array(stage_rows, float).reshape(-1, 5)
        arrival = np.array([rec.arrival_s for rec in recs], float)
        first = np.array([rec.first_token_s for rec in recs], float)
        last = np.array([rec.last_token_s for rec in recs], float)
        finished = np.array([rec.finished for rec in recs], bool)
        decomp = np.array([rec.decomposable for rec in recs], bool)
        out_tok = np.array([rec.output_tokens for rec in recs], float)
        gap = np.array([rec.max_gap_s for rec in recs], float)
        on_time = finished.copy()
        if slo_ttft_s is not None:
            on_time &= (first - arrival) <= slo_ttft_s * (1 + 1e-9)  # nan (never started) compares False
        good = on_time & np.array([rec.max_tpot_s <= tol for rec in recs], bool)
        good_gap = on_time & (np.nan_to_num(gap, nan=np.inf) <= tol)
        if horizon_s is None:
            seen = [arrival, first[np.isfinite(first)], stage_arr[:, 3]]
            horizon_s = float(max((times.max() for times in seen if len(times)), default=0.0))
        return cls(
            arrival, first, last, finished, decomp, out_tok, good, good_gap, gap, horizon_s,
            stage_arr[:, 0].astype(int), stage_arr[:, 1] > 0, stage_arr[:, 2], stage_arr[:, 3],
            stage_arr[:, 4],
        )

    def waiting_at(self, t_s: float) -> int:
        """Requests arrived before t_s that had no first token by then (queued for admission)."""
        return int(np.count_nonzero((self.arrival < t_s) & ~(self.first < t_s)))  # nan: never started

    def ttft(self, sel: np.ndarray) -> np.ndarray:
        """TTFT of the selected requests; one that never started counts its wait up to the horizon."""
        wait = self.first[sel] - self.arrival[sel]
        return np.where(np.isfinite(wait), wait, np.maximum(self.horizon - self.arrival[sel], 0.0))

    def delivered_by(self, times: np.ndarray, only_good: bool) -> np.ndarray:
        """Output tokens delivered before each of `times`: first tokens and instantaneous stages
        count as steps, every other stage as a ramp over its wall time (ramps summed by cumsums)."""
        keep = self.good[self.stage_req] if only_good else np.ones(len(self.stage_req), bool)
        start, end, tokens = self.stage_start[keep], self.stage_end[keep], self.stage_tok[keep]
        ramp = end > start
        firsts = self.first[self.good] if only_good else self.first
        firsts = firsts[np.isfinite(firsts)]
        out = _before(np.concatenate([firsts, end[~ramp]]),
                      np.concatenate([np.ones(len(firsts)), tokens[~ramp]]), times)
        start, end, tokens = start[ramp], end[ramp], tokens[ramp]
        slope = tokens / (end - start)
        for edge, sign in ((start, 1.0), (end, -1.0)):  # a ramp starts at its start, cancelled from its end
            out += sign * (_before(edge, slope, times) * times - _before(edge, slope * edge, times))
        return out

    def tokens_in(self, start_s: float, end_s: float, only_good: bool) -> float:
        """Output tokens delivered in [start_s, end_s), stage tokens spread evenly over the stage."""
        sel = self.good[self.stage_req] if only_good else np.ones(len(self.stage_req), bool)
        start, end, tokens = self.stage_start[sel], self.stage_end[sel], self.stage_tok[sel]
        span = np.maximum(end - start, 1e-12)
        frac = np.clip((np.minimum(end, end_s) - np.maximum(start, start_s)) / span, 0, 1)
        frac = np.where(end - start > 0, frac, ((end >= start_s) & (end < end_s)).astype(float))
        first_ok = self.good if only_good else np.ones(len(self.first), bool)
        firsts = np.count_nonzero(first_ok & (self.first >= start_s) & (self.first < end_s))
        return float((frac * tokens).sum() + firsts)


def _before(event_t: np.ndarray, weight: np.ndarray, times: np.ndarray) -> np.ndarray:
    """Sum of the weights of events at times event_t strictly before each of `times`."""
    order = np.argsort(event_t)
    cum = np.concatenate([[0.0], np.cumsum(weight[order])])
    return cum[np.searchsorted(event_t[order], times, side="left")]


def _p99_ms(values: np.ndarray) -> float | None:
    return float(np.percentile(values, 99) * 1e3) if len(values) else None


def _pct(values: np.ndarray, pct: float, scale: float = 1.0) -> float | None:
    return float(np.percentile(values, pct) * scale) if len(values) else None


def _share(flags: np.ndarray) -> float | None:
    return float(flags.mean()) if len(flags) else None


LATENCY_CLASSES = (("decomp", True), ("serial", False))


def latency_metrics(flat: _Flat, arrived: np.ndarray) -> dict[str, float | int | None]:
    """End-to-end and decode-time percentiles per class over its finished arrivals
    (docs/design/simulator.md)."""
    out: dict[str, float | int | None] = {}
    for name, decomp in LATENCY_CLASSES:
        cls = arrived & (flat.decomp == decomp)
        done = cls & flat.finished
        e2e = flat.last[done] - flat.arrival[done]
        for pct in (50, 90, 99):
            out[f"{name}_e2e_p{pct}_s"] = _pct(e2e, pct)
        out[f"{name}_decode_p50_s"] = _pct(flat.last[done] - flat.first[done], 50)
        out[f"{name}_finished_frac"] = _share(flat.finished[cls])
        out[f"{name}_requests"] = int(cls.sum())
    return out


def request_samples(recs: Sequence[RequestRecord], slo_s: float, window: tuple[float, float],
                    slo_ttft_s: float | None = None) -> dict[str, list]:
    """Per arrival in the window, what bench.confidence resamples: its key (rid), whether it met the
    SLO, whether it is decomposable, and its end to end (None: unfinished), by the definitions above."""
    flat = _Flat.build(recs, slo_s, slo_ttft_s)
    idx = np.flatnonzero((flat.arrival >= window[0]) & (flat.arrival < window[1]))
    e2e = flat.last - flat.arrival
    return {"key": [recs[i].rid for i in idx], "good": flat.good[idx].tolist(),
            "decomp": flat.decomp[idx].tolist(),
            "e2e_s": [round(float(e2e[i]), 4) if flat.finished[i] else None for i in idx]}


def window_metrics(flat: _Flat, steps: dict[str, np.ndarray] | None, start_s: float,
                   end_s: float) -> dict:
    dur = max(end_s - start_s, 1e-9)
    arrived = (flat.arrival >= start_s) & (flat.arrival < end_s)
    done = arrived & flat.finished
    tpot = (flat.stage_end - flat.stage_start) / np.maximum(flat.stage_tok, 1)
    in_win = (flat.stage_end >= start_s) & (flat.stage_end < end_s) & (flat.stage_tok > 0)
    ttft = flat.ttft(arrived)
    gap = flat.gap[done]
    gap = gap[np.isfinite(gap)]
    # how much the admission queue grew, per arrival: near 0 at a load the engine keeps up with; a
    # running-request cap turns overload into waiting that attainment sees only once the drain ends
    growth = flat.waiting_at(end_s) - flat.waiting_at(start_s)
    out = {
        "queue_growth": growth / int(arrived.sum()) if arrived.any() else None,
        "goodput_tok_s": float(flat.out_tok[arrived & flat.good].sum()) / dur,
        "goodput_delivered_tok_s": flat.tokens_in(start_s, end_s, True) / dur,
        "raw_throughput_tok_s": flat.tokens_in(start_s, end_s, False) / dur,
        "slo_attainment": _share(flat.good[arrived]),
        "finished_frac": _share(flat.finished[arrived]),
        "slo_attainment_finished": _share(flat.good[done]),
        "slo_attainment_gap": _share(flat.good_gap[arrived]) if len(gap) else None,
        "requests": int(arrived.sum()),
        "unstarted": int(np.count_nonzero(~np.isfinite(flat.first[arrived]))),
        "p99_tpot_serial_ms": _p99_ms(tpot[in_win & ~flat.stage_par]),
        "p99_tpot_parallel_ms": _p99_ms(tpot[in_win & flat.stage_par]),
        "max_gap_p50_ms": _pct(gap, 50, 1e3),
        "max_gap_p99_ms": _pct(gap, 99, 1e3),
        "ttft_mean_s": float(ttft.mean()) if len(ttft) else None,
        "ttft_p50_s": _pct(ttft, 50),
        "ttft_p99_s": _pct(ttft, 99),
    } | latency_metrics(flat, arrived)
    if steps is not None:
        in_steps = (steps["t_s"] >= start_s) & (steps["t_s"] < end_s)
        n_steps, elig = steps["count"][in_steps].sum(), steps["eligible"][in_steps].sum()
        latency_s, max_latency_s = steps["latency_s"][in_steps], steps["max_latency_s"][in_steps]
        out["step_latency_mean_ms"] = float(latency_s.sum() / n_steps * 1e3) if n_steps else None
        out["step_latency_max_ms"] = float(max_latency_s.max() * 1e3) if n_steps else None
        out["steps"] = int(n_steps)
        out["admission_rate"] = float(steps["admitted"][in_steps].sum() / elig) if elig else None
    return out


def summarize(
    recs: Sequence[RequestRecord], slo_s: float, window: tuple[float, float],
    regimes: Sequence[tuple[str, float, float]] = (), steps: StepLog | None = None,
    slo_ttft_s: float | None = None, horizon_s: float | None = None,
) -> dict:
    """Whole-window metrics plus `per_regime` for each (name, start, end). `slo_ttft_s`: a TTFT
    target that attainment and goodput also require; `horizon_s`: end of observation (default: the
    last recorded event), the wait a request that never started is counted with."""
    flat = _Flat.build(recs, slo_s, slo_ttft_s, horizon_s)
    arr = steps.arrays() if steps is not None else None
    out = window_metrics(flat, arr, *window)
    out["per_regime"] = {name: window_metrics(flat, arr, start, end) for name, start, end in regimes}
    return out


def timeseries(
    recs: Sequence[RequestRecord], slo_s: float, window: tuple[float, float], bin_s: float,
    steps: StepLog | None = None, slo_ttft_s: float | None = None, horizon_s: float | None = None,
) -> dict[str, np.ndarray]:
    """Per-bin metrics for plots (Figure 2 panels), the same definitions as window_metrics, computed
    in one vectorised pass; keys as in window_metrics plus `t_s` (bin start), nan where undefined.
    `ttft_mean_s` here averages only requests that got their first token."""
    flat = _Flat.build(recs, slo_s, slo_ttft_s, horizon_s)
    edges = np.arange(window[0], window[1], bin_s)
    n_bins = len(edges)
    bounds = np.append(edges, edges[-1] + bin_s if n_bins else window[0])
    out: dict[str, np.ndarray] = {"t_s": edges}
    for key, only_good in (("raw_throughput_tok_s", False), ("goodput_delivered_tok_s", True)):
        out[key] = np.diff(flat.delivered_by(bounds, only_good)) / bin_s

    def per_bin(times: np.ndarray, weights: np.ndarray | None = None) -> np.ndarray:
        bin_idx = np.floor((times - window[0]) / bin_s).astype(np.int64)
        valid = (bin_idx >= 0) & (bin_idx < n_bins) & np.isfinite(times)
        counted = None if weights is None else weights[valid]
        return np.bincount(bin_idx[valid], counted, minlength=n_bins)[:n_bins]

    arrived = per_bin(flat.arrival)
    done = per_bin(flat.arrival[flat.finished])
    good_arrival = flat.arrival[flat.good]
    # by arrival, as window_metrics
    out["goodput_tok_s"] = per_bin(good_arrival, flat.out_tok[flat.good]) / bin_s
    with np.errstate(invalid="ignore", divide="ignore"):
        out["slo_attainment"] = per_bin(good_arrival) / arrived
        out["slo_attainment_finished"] = per_bin(good_arrival) / done
        out["finished_frac"] = done / arrived
        ttft = flat.first - flat.arrival
        started = np.isfinite(ttft)
        out["ttft_mean_s"] = per_bin(flat.arrival[started], ttft[started]) / per_bin(flat.arrival[started])
    out["requests"] = arrived.astype(float)
    tpot = (flat.stage_end - flat.stage_start) / np.maximum(flat.stage_tok, 1)
    for key, cls in (("p99_tpot_serial_ms", ~flat.stage_par), ("p99_tpot_parallel_ms", flat.stage_par)):
        sel = cls & (flat.stage_tok > 0)
        bin_idx = np.floor((flat.stage_end[sel] - window[0]) / bin_s).astype(np.int64)
        tpots = tpot[sel]
        keep = (bin_idx >= 0) & (bin_idx < n_bins)
        bin_idx, tpots = bin_idx[keep], tpots[keep]
        order = np.lexsort((tpots, bin_idx))
        bin_idx, tpots = bin_idx[order], tpots[order]
        cut = np.searchsorted(bin_idx, np.arange(n_bins + 1))
        out[key] = np.array([np.percentile(tpots[begin:stop], 99) * 1e3 if stop > begin else np.nan
                             for begin, stop in zip(cut[:-1], cut[1:], strict=True)])
    if steps is not None:
        step_arr = steps.arrays()
        step_t = step_arr["t_s"]
        n_steps = per_bin(step_t, step_arr["count"])
        with np.errstate(invalid="ignore", divide="ignore"):
            out["step_latency_mean_ms"] = per_bin(step_t, step_arr["latency_s"]) / n_steps * 1e3
            admitted = per_bin(step_t, step_arr["admitted"])
            out["admission_rate"] = admitted / per_bin(step_t, step_arr["eligible"])
        out["steps"] = n_steps.astype(float)
    return out


# A load point's figures (capacity.json, sweep.json): (name in the point, name in window_metrics)
POINT_FIGURES = (
    ("goodput_tok_s", "goodput_tok_s"), ("attainment", "slo_attainment"),
    ("finished_frac", "finished_frac"), ("p99_ttft_s", "ttft_p99_s"),
    ("decomp_e2e_p50_s", "decomp_e2e_p50_s"), ("decomp_e2e_p90_s", "decomp_e2e_p90_s"),
    ("decomp_e2e_p99_s", "decomp_e2e_p99_s"), ("decomp_finished_frac", "decomp_finished_frac"),
    ("serial_e2e_p50_s", "serial_e2e_p50_s"), ("serial_e2e_p99_s", "serial_e2e_p99_s"),
    ("serial_finished_frac", "serial_finished_frac"), ("goodput_delivered_tok_s", "goodput_delivered_tok_s"),
)
POINT_KEYS = ("rate", *(name for name, _ in POINT_FIGURES))


def load_point(rate: float, metrics: dict) -> dict:
    """One load point's figures from a window's metrics (missing ones None)."""
    return {"rate": rate} | {name: metrics.get(src) for name, src in POINT_FIGURES}
