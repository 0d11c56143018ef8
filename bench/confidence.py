"""How sure a live point is: bootstrap intervals over its requests, repeats pooled, and the
three-valued outcomes (PASS / FAIL / UNDECIDED) the verdict is built from. Pure: numpy only.

Method: a 95% percentile bootstrap over a point's arrivals (RESAMPLES resamples, RNG seed SEED, so a
report is reproducible); seeds are strata, resampled within and averaged over as the means are. A
ratio of two policies' P50s is paired: at one (load, seed) every policy runs the same programs, so
one resample of request keys serves both. A comparison is decided only where the whole interval lies
on one side of its bound; otherwise it is UNDECIDED. Under MIN_REQUESTS requests (pairs, for a
ratio) the interval is the widest one: a bootstrap that small claims more than it knows.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

LEVEL = 0.95  # two-sided interval
RESAMPLES = 2000
SEED = 0
PASS, FAIL, UNDECIDED = "PASS", "FAIL", "UNDECIDED"
EPS = 1e-12
MIN_REQUESTS = 6  # six paired requests all on one side: 1 in 32 by chance alone

Interval = tuple[float, float]


# ------------------------------------------------------------------------- three-valued outcomes
def decide(lo: float, hi: float, bound: float, above_ok: bool) -> str:
    """PASS when [lo, hi] lies wholly on the good side of `bound` (>= it with above_ok, else <= it),
    FAIL when wholly on the other side, UNDECIDED when it straddles."""
    if above_ok:
        return PASS if lo >= bound - EPS else FAIL if hi < bound - EPS else UNDECIDED
    return PASS if hi <= bound + EPS else FAIL if lo > bound + EPS else UNDECIDED


def all_of(outcomes: Iterable[str]) -> str:
    """Kleene AND: FAIL if any fails, else UNDECIDED if any is, else PASS (PASS when empty)."""
    got = set(outcomes)
    return FAIL if FAIL in got else UNDECIDED if UNDECIDED in got else PASS


def any_of(outcomes: Iterable[str]) -> str:
    """Kleene OR: PASS if any passes, else UNDECIDED if any is, else FAIL (FAIL when empty)."""
    got = set(outcomes)
    return PASS if PASS in got else UNDECIDED if UNDECIDED in got else FAIL


def negate(outcome: str) -> str:
    return {PASS: FAIL, FAIL: PASS}.get(outcome, UNDECIDED)


# ------------------------------------------------------------------------------ a point's requests
@dataclass(frozen=True, slots=True)
class Requests:
    """A point's arrivals in its window (bench.metrics.request_samples): key, met the SLO,
    decomposable, end to end (nan: unfinished)."""

    key: tuple[str, ...]
    good: np.ndarray
    decomp: np.ndarray
    e2e_s: np.ndarray

    @classmethod
    def of(cls, point: Mapping[str, Any] | None) -> Requests | None:
        """The requests a point carries under "samples" (None: it carries none, e.g. simulated)."""
        samples = (point or {}).get("samples")
        if not samples:
            return None
        e2e = np.array([np.nan if value is None else value for value in samples["e2e_s"]], float)
        return cls(tuple(samples["key"]), np.asarray(samples["good"], bool).reshape(-1),
                   np.asarray(samples["decomp"], bool).reshape(-1), e2e)

    def values(self, decomp: bool) -> np.ndarray:
        """End to end of one class's arrivals, nan where unfinished (a P50 counts finished ones)."""
        return self.e2e_s[self.decomp == decomp]


def _p50_rows(values: np.ndarray) -> np.ndarray:
    """Each row's P50 over its finite values (nan for a row with none): np.percentile's linear
    interpolation, vectorised over rows (np.nanpercentile loops over them)."""
    ordered = np.sort(values, axis=-1)  # nan last
    count = np.isfinite(ordered).sum(axis=-1)
    pos = np.maximum(count - 1, 0) * 0.5
    below, above = np.floor(pos).astype(int), np.ceil(pos).astype(int)
    low = np.take_along_axis(ordered, below[..., None], axis=-1)[..., 0]
    high = np.take_along_axis(ordered, above[..., None], axis=-1)[..., 0]
    return np.where(count > 0, low + (high - low) * (pos - below), np.nan)


def _nanmean_rows(stats: list[np.ndarray]) -> np.ndarray:
    """Mean over strata, a stratum left out where its statistic is undefined (as the means over
    seeds leave out a seed without the figure)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return np.nanmean(np.vstack(stats), axis=0)


def _percentile_interval(stats: np.ndarray) -> Interval | None:
    """The central LEVEL of the resampled statistic; None when most resamples leave it undefined."""
    finite = stats[np.isfinite(stats)]
    if len(finite) < len(stats) / 2:
        return None
    tail = 50 * (1 - LEVEL)
    lo, hi = np.percentile(finite, [tail, 100 - tail])
    return float(lo), float(hi)


def _resamples(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.integers(0, n, size=(RESAMPLES, n))


def stratified(strata: Sequence[np.ndarray], stat: Callable[[np.ndarray], np.ndarray]) -> Interval | None:
    """The interval of the mean over strata of `stat` (rows -> one value per row), each stratum
    resampled within itself. Empty strata are left out."""
    rng = np.random.default_rng(SEED)
    stats = [stat(values[_resamples(rng, len(values))]) for values in strata if len(values)]
    return _percentile_interval(_nanmean_rows(stats)) if stats else None


def attainment_interval(strata: Sequence[Requests]) -> Interval | None:
    """[0, 1] (nothing decided) under MIN_REQUESTS arrivals over the strata."""
    if 0 < sum(len(reqs.good) for reqs in strata) < MIN_REQUESTS:
        return 0.0, 1.0
    return stratified([reqs.good.astype(float) for reqs in strata], lambda rows: rows.mean(axis=1))


def p50_interval(strata: Sequence[Requests], decomp: bool = True) -> Interval | None:
    return stratified([reqs.values(decomp) for reqs in strata], _p50_rows)


@dataclass(frozen=True, slots=True)
class Ratio:
    """A's decomposable P50 over B's on the requests both ran, and its paired interval."""

    value: float
    lo: float
    hi: float  # inf: too few pairs to bound it

    def as_list(self) -> list[float | None]:
        """For JSON: an unbounded end is None."""
        return [self.value, self.lo, self.hi if np.isfinite(self.hi) else None]


def _paired(a: Requests, b: Requests) -> tuple[np.ndarray, np.ndarray]:
    """Both policies' end to end over the keys both ran that are decomposable in either (nan where
    one side did not finish it or did not reach its parallel phase)."""
    where_b = {key: idx for idx, key in enumerate(b.key)}
    pairs = [(idx, where_b[key]) for idx, key in enumerate(a.key)
             if key in where_b and (a.decomp[idx] or b.decomp[where_b[key]])]
    ia = np.array([pair[0] for pair in pairs], int)
    ib = np.array([pair[1] for pair in pairs], int)
    va = np.where(a.decomp[ia], a.e2e_s[ia], np.nan)
    vb = np.where(b.decomp[ib], b.e2e_s[ib], np.nan)
    return va, vb


def p50_ratio(pairs: Sequence[tuple[Requests, Requests]]) -> Ratio | None:
    """Paired bootstrap of mean-over-strata P50(A) / mean-over-strata P50(B): each stratum's common
    requests are resampled once for both policies. None when either P50 is undefined; [0, inf)
    under MIN_REQUESTS requests both finished."""
    rng = np.random.default_rng(SEED)
    est_a, est_b, rows_a, rows_b, both = [], [], [], [], 0
    for a, b in pairs:
        va, vb = _paired(a, b)
        both += int(np.count_nonzero(np.isfinite(va) & np.isfinite(vb)))
        if not len(va):
            continue
        idx = _resamples(rng, len(va))
        est_a.append(_p50_rows(va[None, :]))
        est_b.append(_p50_rows(vb[None, :]))
        rows_a.append(_p50_rows(va[idx]))
        rows_b.append(_p50_rows(vb[idx]))
    if not rows_a:
        return None
    point_b = float(_nanmean_rows(est_b)[0])
    if not (point_b > 0):
        return None
    value = float(_nanmean_rows(est_a)[0]) / point_b
    with np.errstate(invalid="ignore", divide="ignore"):
        ratios = _nanmean_rows(rows_a) / _nanmean_rows(rows_b)
    ratios[~np.isfinite(ratios)] = np.nan
    interval = _percentile_interval(ratios)
    if interval is None or not np.isfinite(value):
        return None
    return Ratio(value, *interval) if both >= MIN_REQUESTS else Ratio(value, 0.0, np.inf)


# ------------------------------------------------------------------------------------ repeats
REQUEST_FIGURES = ("attainment", "finished_frac", "decomp_e2e_p50_s", "decomp_e2e_p90_s", "decomp_e2e_p99_s",
                   "decomp_finished_frac", "serial_e2e_p50_s", "serial_e2e_p99_s", "serial_finished_frac")


def request_figures(reqs: Requests) -> dict[str, float | None]:
    """The point figures that are per request, recomputed over (pooled) requests."""
    def share(flags: np.ndarray) -> float | None:
        return float(flags.mean()) if len(flags) else None

    def pct(values: np.ndarray, q: float) -> float | None:
        done = values[np.isfinite(values)]
        return float(np.percentile(done, q)) if len(done) else None

    out = {"attainment": share(reqs.good), "finished_frac": share(np.isfinite(reqs.e2e_s))}
    for name, decomp in (("decomp", True), ("serial", False)):
        values = reqs.values(decomp)
        out |= {f"{name}_e2e_p{q}_s": pct(values, q) for q in (50, 90, 99)}
        out[f"{name}_finished_frac"] = share(np.isfinite(values))
    return {name: out[name] for name in REQUEST_FIGURES}


def pool(runs: Sequence[dict]) -> dict:
    """One point from R runs of it (same policy, load and seed): the per-request figures over the
    pooled requests (keys prefixed with the run's index, so repeats pair run by run across
    policies), every other number the mean over runs; `repeats` R."""
    out = {name: value for name, value in runs[0].items() if name != "samples"} | {"repeats": len(runs)}
    if all(run.get("samples") for run in runs):
        samples = {"key": [f"{idx}/{key}" for idx, run in enumerate(runs) for key in run["samples"]["key"]]}
        for column in ("good", "decomp", "e2e_s"):
            samples[column] = [value for run in runs for value in run["samples"][column]]
        out["samples"] = samples
    if len(runs) == 1:
        return out
    for name, value in runs[0].items():
        if isinstance(value, int | float) and not isinstance(value, bool):
            vals = [run[name] for run in runs if isinstance(run.get(name), int | float)]
            out[name] = float(np.mean(vals)) if vals else None
    reqs = Requests.of(out)
    if reqs is not None:
        out |= request_figures(reqs)
    out["per_repeat"] = [{name: value for name, value in run.items() if name != "samples"} for run in runs]
    return out


# ----------------------------------------------------------------------------- a document's points
def annotate(doc: dict, got: Mapping[tuple[str, float, int], Mapping[str, Any]], seeds: Sequence[int]) -> bool:
    """Each point of a capacity document (bench.capacity) gets its intervals from the requests of
    its runs over `seeds`: `attainment_ci`, `decomp_e2e_p50_s_ci` ([lo, hi]) and `p50_ratio`
    ({other policy: [ratio, lo, hi]}, paired). False, and nothing added, when a run carries no
    requests (simulated points)."""
    pols = doc["policies"]
    strata = {(policy, point["rate"]): [Requests.of(got.get((policy, point["rate"], seed))) for seed in seeds]
              for policy, entry in pols.items() for point in entry["points"]}
    if any(reqs is None for per_seed in strata.values() for reqs in per_seed):
        return False
    for policy, entry in pols.items():
        for point in entry["points"]:
            mine = strata[(policy, point["rate"])]
            att, p50 = attainment_interval(mine), p50_interval(mine)
            point["attainment_ci"] = list(att) if att else None
            point["decomp_e2e_p50_s_ci"] = list(p50) if p50 else None
            ratios = {other: p50_ratio(list(zip(mine, strata[(other, point["rate"])], strict=True)))
                      for other in pols if other != policy}
            point["p50_ratio"] = {other: ratio.as_list() for other, ratio in ratios.items() if ratio}
    return True


def point_line(point: Mapping[str, Any]) -> str:
    """A run's attainment and decomposable P50 intervals for a progress line ('' without requests)."""
    reqs = Requests.of(point)
    if reqs is None:
        return ""
    att, p50 = attainment_interval([reqs]), p50_interval([reqs])
    return (f"attainment [{span(att, pct=True)}], decomposable P50 [{span(p50)}] s "
            f"({int(reqs.decomp.sum())} decomposable of {len(reqs.key)})")


def span(interval: Sequence[float] | None, pct: bool = False, nd: int = 1) -> str:
    """'lo-hi' for a table cell or a line ('-' without an interval)."""
    if not interval:
        return "-"
    lo, hi = interval[-2], interval[-1]
    return f"{100 * lo:.0f}-{100 * hi:.0f}" if pct else f"{lo:.{nd}f}-{hi:.{nd}f}"
