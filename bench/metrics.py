"""Serving metrics from per-request token-delivery records (pure; shared by the simulator and replay).

Definitions (TAPER Appendix D for TPOT; the rest chosen so a policy cannot look good by stranding
requests):
* A request's output is a sequence of stages. A serial stage's TPOT is the time from the delivery
  before its first token to its last token, divided by its tokens (the first token of a response is
  TTFT, not TPOT). A parallel stage's effective TPOT is the phase's wall time (from the delivery
  that opened it to its last branch token) divided by the tokens of all its branches.
* A request meets the SLO when it finished, its maximum stage TPOT is within the TPOT target and,
  when a TTFT target is set, its TTFT is within that too.
* Attainment (`slo_attainment`): SLO-meeting share of ALL requests that arrived in the window; a
  request that did not finish (still queued, running or failed) is a miss. `finished_frac` is the
  finished share of those arrivals; `slo_attainment_finished` is the paper's share among finished
  requests only (reported, never the headline).
* Goodput (`goodput_tok_s`): the output tokens of the requests that arrived in the window and met
  the SLO, wherever they were delivered, per second of window: equal attainment gives equal goodput.
  `goodput_delivered_tok_s` counts the SLO-meeting tokens delivered inside the window instead (it
  moves with when long requests happen to deliver); raw throughput is every token delivered in it.
* Latency: a request's end to end is arrival to its last token (of any branch), its decode time
  first to last token. Per class (`decomp_*`: requests with a parallel phase, `serial_*`: the rest)
  P50 / P90 / P99 end to end and the P50 decode time are over the class's finished arrivals (None
  where none finished), `*_finished_frac` beside them.
* TTFT percentiles are over every arrival in the window; a request that never got its first token
  counts with its wait up to the end of observation (`horizon_s`), a lower bound on its TTFT.
* Per-gap TPOT, a second figure: a request's largest interval between two consecutive deliveries
  after its first token (`RequestRecord.max_gap_s`; any branch's token is a delivery). It is the
  literal per-token reading of a TPOT SLO; `slo_attainment_gap` applies it instead of the stage mean.
* Branch admission rate: admitted opportunistic rows / eligible opportunistic rows over the steps.

A stage's tokens are taken as spread evenly over its wall time when a window cuts through it.
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
        return int(started) + sum(s.tokens for s in self.stages)

    @property
    def last_token_s(self) -> float:
        """Delivery of the last token of any branch (nan: never got its first token)."""
        return max((s.end_s for s in self.stages), default=self.first_token_s)

    @property
    def max_tpot_s(self) -> float:
        return max((s.tpot_s for s in self.stages if s.tokens > 0), default=0.0)

    @classmethod
    def from_token_times(
        cls, rid: str, arrival_s: float, stages: Sequence[tuple[bool, Sequence[float]]], finished: bool = True
    ) -> RequestRecord:
        """Build a record from raw delivery times: `stages` is [(parallel, token times)], a parallel
        stage listing the tokens of all its branches (any order). For live-server replay."""
        rec = cls(rid, arrival_s, finished=finished, decomposable=any(p for p, _ in stages))
        every = sorted(t for _, times in stages for t in times)
        rec.max_gap_s = float(np.diff(every).max()) if len(every) > 1 else 0.0
        prev = None
        for parallel, times in stages:
            ts = sorted(times)
            if not ts:
                continue
            if prev is None:  # the response's first token is TTFT; the stage is measured after it
                rec.first_token_s, prev, ts = ts[0], ts[0], ts[1:]
                if not ts:
                    continue
            rec.stages.append(StageRecord(parallel, prev, ts[-1], len(ts)))
            prev = ts[-1]
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

    def add(self, t: float, count: int, latency: float, max_latency: float, eligible: int, admitted: int) -> None:
        self.t_s.append(t)
        self.count.append(count)
        self.latency_s.append(latency)
        self.max_latency_s.append(max_latency)
        self.eligible.append(eligible)
        self.admitted.append(admitted)

    def arrays(self) -> dict[str, np.ndarray]:
        return {k: np.asarray(getattr(self, k), float) for k in self.__slots__}


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
        st = [(i, s.parallel, s.start_s, s.end_s, s.tokens) for i, r in enumerate(recs) for s in r.stages]
        a = np.array(st, float).reshape(-1, 5)
        arrival = np.array([r.arrival_s for r in recs], float)
        first = np.array([r.first_token_s for r in recs], float)
        last = np.array([r.last_token_s for r in recs], float)
        finished = np.array([r.finished for r in recs], bool)
        decomp = np.array([r.decomposable for r in recs], bool)
        out_tok = np.array([r.output_tokens for r in recs], float)
        gap = np.array([r.max_gap_s for r in recs], float)
        on_time = finished.copy()
        if slo_ttft_s is not None:
            on_time &= (first - arrival) <= slo_ttft_s * (1 + 1e-9)  # nan (never started) compares False
        good = on_time & np.array([r.max_tpot_s <= tol for r in recs], bool)
        good_gap = on_time & (np.nan_to_num(gap, nan=np.inf) <= tol)
        if horizon_s is None:
            seen = [arrival, first[np.isfinite(first)], a[:, 3]]
            horizon_s = float(max((x.max() for x in seen if len(x)), default=0.0))
        return cls(
            arrival, first, last, finished, decomp, out_tok, good, good_gap, gap, horizon_s,
            a[:, 0].astype(int), a[:, 1] > 0, a[:, 2], a[:, 3], a[:, 4],
        )

    def ttft(self, sel: np.ndarray) -> np.ndarray:
        """TTFT of the selected requests; one that never started counts its wait up to the horizon."""
        t = self.first[sel] - self.arrival[sel]
        return np.where(np.isfinite(t), t, np.maximum(self.horizon - self.arrival[sel], 0.0))

    def delivered_by(self, ts: np.ndarray, only_good: bool) -> np.ndarray:
        """Output tokens delivered before each time in `ts`: first tokens and instantaneous stages
        count as steps, every other stage as a ramp over its wall time (ramps summed by cumsums)."""
        keep = self.good[self.stage_req] if only_good else np.ones(len(self.stage_req), bool)
        s, e, n = self.stage_start[keep], self.stage_end[keep], self.stage_tok[keep]
        ramp = e > s
        firsts = self.first[self.good] if only_good else self.first
        firsts = firsts[np.isfinite(firsts)]
        out = _before(np.concatenate([firsts, e[~ramp]]), np.concatenate([np.ones(len(firsts)), n[~ramp]]), ts)
        s, e, n = s[ramp], e[ramp], n[ramp]
        slope = n / (e - s)
        for edge, sign in ((s, 1.0), (e, -1.0)):  # a ramp starts at s and is cancelled from e on
            out += sign * (_before(edge, slope, ts) * ts - _before(edge, slope * edge, ts))
        return out

    def tokens_in(self, t0: float, t1: float, only_good: bool) -> float:
        """Output tokens delivered in [t0, t1), stage tokens spread evenly over the stage."""
        sel = self.good[self.stage_req] if only_good else np.ones(len(self.stage_req), bool)
        s, e, n = self.stage_start[sel], self.stage_end[sel], self.stage_tok[sel]
        span = np.maximum(e - s, 1e-12)
        frac = np.clip((np.minimum(e, t1) - np.maximum(s, t0)) / span, 0, 1)
        frac = np.where(e - s > 0, frac, ((e >= t0) & (e < t1)).astype(float))
        first_ok = self.good if only_good else np.ones(len(self.first), bool)
        firsts = np.count_nonzero(first_ok & (self.first >= t0) & (self.first < t1))
        return float((frac * n).sum() + firsts)


def _before(t: np.ndarray, w: np.ndarray, ts: np.ndarray) -> np.ndarray:
    """Sum of weights w of events at times t strictly before each of ts."""
    o = np.argsort(t)
    return np.concatenate([[0.0], np.cumsum(w[o])])[np.searchsorted(t[o], ts, side="left")]


def _p99_ms(x: np.ndarray) -> float | None:
    return float(np.percentile(x, 99) * 1e3) if len(x) else None


def _pct(x: np.ndarray, q: float, scale: float = 1.0) -> float | None:
    return float(np.percentile(x, q) * scale) if len(x) else None


def _share(x: np.ndarray) -> float | None:
    return float(x.mean()) if len(x) else None


LATENCY_CLASSES = (("decomp", True), ("serial", False))


def latency_metrics(flat: _Flat, arrived: np.ndarray) -> dict[str, float | int | None]:
    """End-to-end and decode-time percentiles per class over its finished arrivals (module docstring)."""
    out: dict[str, float | int | None] = {}
    for name, decomp in LATENCY_CLASSES:
        cls = arrived & (flat.decomp == decomp)
        done = cls & flat.finished
        e2e = flat.last[done] - flat.arrival[done]
        for q in (50, 90, 99):
            out[f"{name}_e2e_p{q}_s"] = _pct(e2e, q)
        out[f"{name}_decode_p50_s"] = _pct(flat.last[done] - flat.first[done], 50)
        out[f"{name}_finished_frac"] = _share(flat.finished[cls])
        out[f"{name}_requests"] = int(cls.sum())
    return out


def window_metrics(flat: _Flat, steps: dict[str, np.ndarray] | None, t0: float, t1: float) -> dict:
    dur = max(t1 - t0, 1e-9)
    arrived = (flat.arrival >= t0) & (flat.arrival < t1)
    done = arrived & flat.finished
    tpot = (flat.stage_end - flat.stage_start) / np.maximum(flat.stage_tok, 1)
    in_win = (flat.stage_end >= t0) & (flat.stage_end < t1) & (flat.stage_tok > 0)
    ttft = flat.ttft(arrived)
    gap = flat.gap[done]
    gap = gap[np.isfinite(gap)]
    out = {
        "goodput_tok_s": float(flat.out_tok[arrived & flat.good].sum()) / dur,
        "goodput_delivered_tok_s": flat.tokens_in(t0, t1, True) / dur,
        "raw_throughput_tok_s": flat.tokens_in(t0, t1, False) / dur,
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
        m = (steps["t_s"] >= t0) & (steps["t_s"] < t1)
        n, elig = steps["count"][m].sum(), steps["eligible"][m].sum()
        out["step_latency_mean_ms"] = float(steps["latency_s"][m].sum() / n * 1e3) if n else None
        out["step_latency_max_ms"] = float(steps["max_latency_s"][m].max() * 1e3) if n else None
        out["steps"] = int(n)
        out["admission_rate"] = float(steps["admitted"][m].sum() / elig) if elig else None
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
    out["per_regime"] = {name: window_metrics(flat, arr, a, b) for name, a, b in regimes}
    return out


def timeseries(
    recs: Sequence[RequestRecord], slo_s: float, window: tuple[float, float], bin_s: float,
    steps: StepLog | None = None, slo_ttft_s: float | None = None, horizon_s: float | None = None,
) -> dict[str, np.ndarray]:
    """Per-bin metrics for plots (Figure 2 panels), the same definitions as window_metrics, computed
    in one vectorised pass; keys as in window_metrics plus `t_s` (bin start), nan where undefined.
    `ttft_mean_s` here averages only requests that got their first token."""
    f = _Flat.build(recs, slo_s, slo_ttft_s, horizon_s)
    edges = np.arange(window[0], window[1], bin_s)
    nb = len(edges)
    bounds = np.append(edges, edges[-1] + bin_s if nb else window[0])
    out: dict[str, np.ndarray] = {"t_s": edges}
    for key, only_good in (("raw_throughput_tok_s", False), ("goodput_delivered_tok_s", True)):
        out[key] = np.diff(f.delivered_by(bounds, only_good)) / bin_s

    def per_bin(t: np.ndarray, w: np.ndarray | None = None) -> np.ndarray:
        i = np.floor((t - window[0]) / bin_s).astype(np.int64)
        ok = (i >= 0) & (i < nb) & np.isfinite(t)
        return np.bincount(i[ok], None if w is None else w[ok], minlength=nb)[:nb]

    arrived = per_bin(f.arrival)
    done = per_bin(f.arrival[f.finished])
    out["goodput_tok_s"] = per_bin(f.arrival[f.good], f.out_tok[f.good]) / bin_s  # by arrival, as window_metrics
    with np.errstate(invalid="ignore", divide="ignore"):
        out["slo_attainment"] = per_bin(f.arrival[f.good]) / arrived
        out["slo_attainment_finished"] = per_bin(f.arrival[f.good]) / done
        out["finished_frac"] = done / arrived
        ttft = f.first - f.arrival
        ok = np.isfinite(ttft)
        out["ttft_mean_s"] = per_bin(f.arrival[ok], ttft[ok]) / per_bin(f.arrival[ok])
    out["requests"] = arrived.astype(float)
    tpot = (f.stage_end - f.stage_start) / np.maximum(f.stage_tok, 1)
    for key, cls in (("p99_tpot_serial_ms", ~f.stage_par), ("p99_tpot_parallel_ms", f.stage_par)):
        sel = cls & (f.stage_tok > 0)
        i = np.floor((f.stage_end[sel] - window[0]) / bin_s).astype(np.int64)
        v = tpot[sel]
        keep = (i >= 0) & (i < nb)
        i, v = i[keep], v[keep]
        order = np.lexsort((v, i))
        i, v = i[order], v[order]
        cut = np.searchsorted(i, np.arange(nb + 1))
        out[key] = np.array([np.percentile(v[a:b], 99) * 1e3 if b > a else np.nan
                             for a, b in zip(cut[:-1], cut[1:], strict=True)])
    if steps is not None:
        st = steps.arrays()
        n = per_bin(st["t_s"], st["count"])
        with np.errstate(invalid="ignore", divide="ignore"):
            out["step_latency_mean_ms"] = per_bin(st["t_s"], st["latency_s"]) / n * 1e3
            out["admission_rate"] = per_bin(st["t_s"], st["admitted"]) / per_bin(st["t_s"], st["eligible"])
        out["steps"] = n.astype(float)
    return out


# A load point's figures (capacity.json, sweep.json): (name in the point, name in window_metrics)
POINT_FIGURES = (
    ("goodput_tok_s", "goodput_tok_s"), ("attainment", "slo_attainment"), ("finished_frac", "finished_frac"),
    ("p99_ttft_s", "ttft_p99_s"), ("decomp_e2e_p50_s", "decomp_e2e_p50_s"), ("decomp_e2e_p90_s", "decomp_e2e_p90_s"),
    ("decomp_e2e_p99_s", "decomp_e2e_p99_s"), ("decomp_finished_frac", "decomp_finished_frac"),
    ("serial_e2e_p50_s", "serial_e2e_p50_s"), ("serial_e2e_p99_s", "serial_e2e_p99_s"),
    ("serial_finished_frac", "serial_finished_frac"), ("goodput_delivered_tok_s", "goodput_delivered_tok_s"),
)
POINT_KEYS = ("rate", *(k for k, _ in POINT_FIGURES))


def load_point(rate: float, m: dict) -> dict:
    """One load point's figures from a window's metrics (missing ones None)."""
    return {"rate": rate} | {k: m.get(src) for k, src in POINT_FIGURES}
