"""Step-latency predictor T(S) over the step composition S = (rows, context tokens, extra tokens).

Monotone (NNLS keeps coefficients >= 0), separable but for graph padding: docs/design/taper-predictor.md.
"""

from __future__ import annotations

import bisect
import json
import math
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Protocol

import numpy as np
from scipy.optimize import nnls

# One realized step: (n_seqs, ctx_tokens, latency_s) or (n_seqs, ctx_tokens, latency_s, extra_tokens).
Sample = Sequence[float]


class LatencyModel(Protocol):
    def predict(self, n_seqs: int, ctx_tokens: int, extra_tokens: int = 0) -> float: ...

    def row_costs(self, ctx_lens: np.ndarray) -> np.ndarray:
        """Marginal seconds (>= 0, a new float64 array) of adding a row of each context length to any step."""
        ...


@dataclass(slots=True)
class LinearLatencyModel:
    """T(S) = c0 + c_seq rows + c_ctx ctx + c_tok extra tokens; deferring d rows adds c_defer + c_deferred d.
    With `graph_batch_sizes` a decode step's rows (no extra tokens) count as the next size up."""

    c0: float
    c_seq: float
    c_ctx: float
    c_tok: float = 0.0
    c_defer: float = 0.0
    c_deferred: float = 0.0
    # decode batch sizes captured as CUDA graphs, increasing; () on CPU (the device says, not the JSON)
    graph_batch_sizes: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name in ("c0", "c_seq", "c_ctx", "c_tok", "c_defer", "c_deferred"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0.0):
                raise ValueError(f"latency model coefficient {name} must be finite and >= 0, got {value!r}")
        self.graph_batch_sizes = _graph_sizes(self.graph_batch_sizes)

    def predict(self, n_seqs: int, ctx_tokens: int, extra_tokens: int = 0) -> float:
        if self.graph_batch_sizes and not extra_tokens:
            n_seqs = padded_rows(self.graph_batch_sizes, n_seqs)
        return self.c0 + self.c_seq * n_seqs + self.c_ctx * ctx_tokens + self.c_tok * extra_tokens

    def padded(self, seqs: np.ndarray) -> np.ndarray:
        """Decode rows as the captured graph sizes they replay at (float64; unchanged without sizes)."""
        seqs = np.asarray(seqs, dtype=np.float64)
        sizes = self.graph_batch_sizes
        if not sizes:
            return seqs
        table = np.array(sizes, dtype=np.float64)
        index = np.searchsorted(table, seqs, side="left")
        inside = (index < len(table)) & (seqs > 0)
        return np.where(inside, table[np.minimum(index, len(table) - 1)], seqs)

    def padding_s(self, seqs: np.ndarray) -> np.ndarray:
        """Seconds the graph padding adds to a decode step of each row count (0 without sizes)."""
        seqs = np.asarray(seqs, dtype=np.float64)
        return (self.padded(seqs) - seqs) * self.c_seq

    def row_costs(self, ctx_lens: np.ndarray) -> np.ndarray:
        out = ctx_lens * self.c_ctx
        out += self.c_seq
        return out

    @classmethod
    def fit(cls, samples: Iterable[Sample]) -> LinearLatencyModel:
        """NNLS fit; raises ValueError when the samples cannot separate the coefficients."""
        return _fit(*_columns(samples))

    def coefs(self) -> tuple[float, float, float, float]:
        return (self.c0, self.c_seq, self.c_ctx, self.c_tok)

    def deferral(self) -> tuple[float, float]:
        """(seconds per step that defers rows, seconds per deferred row)."""
        return (self.c_defer, self.c_deferred)

    def deferral_s(self, deferred: int) -> float:
        return self.c_defer + self.c_deferred * deferred if deferred > 0 else 0.0

    def to_json(self) -> str:
        doc = {"kind": "linear", "units": "seconds", "c0": self.c0, "c_seq": self.c_seq, "c_ctx": self.c_ctx,
               "c_tok": self.c_tok}
        if self.c_defer or self.c_deferred:
            doc |= {"c_defer": self.c_defer, "c_deferred": self.c_deferred}
        return json.dumps(doc, indent=1)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json() + "\n")

    @classmethod
    def from_json(cls, text: str) -> LinearLatencyModel:
        return _expect(cls, model_from_json(text))

    @classmethod
    def load(cls, path: str | Path) -> LinearLatencyModel:
        return _expect(cls, load_model(path))


@dataclass(slots=True)
class ConstantLatencyModel:
    """The taper-const-predictor ablation: every step costs `value_s`, whatever its composition."""

    value_s: float

    def __post_init__(self) -> None:
        if not (math.isfinite(self.value_s) and self.value_s >= 0.0):
            raise ValueError(f"constant latency must be finite and >= 0, got {self.value_s!r}")

    def predict(self, n_seqs: int, ctx_tokens: int, extra_tokens: int = 0) -> float:
        return self.value_s

    def row_costs(self, ctx_lens: np.ndarray) -> np.ndarray:
        return np.zeros(len(ctx_lens))

    def deferral(self) -> tuple[float, float]:
        return (0.0, 0.0)

    def deferral_s(self, deferred: int) -> float:
        return 0.0

    @classmethod
    def from_model(cls, model: LatencyModel, n_seqs: int, ctx_tokens: int) -> ConstantLatencyModel:
        """The value of another model at a reference composition."""
        return cls(model.predict(n_seqs, ctx_tokens))

    def to_json(self) -> str:
        return json.dumps({"kind": "constant", "units": "seconds", "value_s": self.value_s}, indent=1)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json() + "\n")

    @classmethod
    def from_json(cls, text: str) -> ConstantLatencyModel:
        return _expect(cls, model_from_json(text))

    @classmethod
    def load(cls, path: str | Path) -> ConstantLatencyModel:
        return _expect(cls, load_model(path))


def padded_rows(sizes: tuple[int, ...], rows: int) -> int:
    """The captured size a decode step of `rows` replays at: the next one up, itself past the largest."""
    index = bisect.bisect_left(sizes, rows)
    return sizes[index] if rows > 0 and index < len(sizes) else rows


def _graph_sizes(sizes: Iterable[int]) -> tuple[int, ...]:
    out = tuple(int(size) for size in sizes)
    if any(size < 1 for size in out) or any(later <= earlier for earlier, later in zip(out, out[1:], strict=False)):
        raise ValueError(f"graph_batch_sizes must be increasing integers >= 1, got {out!r}")
    return out


def _expect(cls: type, model: object) -> Any:
    if not isinstance(model, cls):
        raise ValueError(f"expected a {cls.__name__}, the JSON holds a {type(model).__name__}")
    return model


def default_model() -> LinearLatencyModel:
    """Qwen3-32B, TP=8, A100-80GB, fit to the TAPER paper (taper-predictor.md); real GPUs: --latency-model."""
    return LinearLatencyModel(c0=14e-3, c_seq=2.5e-4, c_ctx=1.0e-7, c_tok=4.0e-5)


_UNITS = MappingProxyType({"seconds": 1.0, "s": 1.0, "milliseconds": 1e-3, "ms": 1e-3})
_KEYS = MappingProxyType({"linear": ("c0", "c_seq", "c_ctx"), "constant": ("value_s",)})
_OPTIONAL = MappingProxyType({"linear": ("c_tok", "c_defer", "c_deferred"), "constant": ()})
MAX_INTERCEPT_S = 10.0  # a per-step floor above this is a unit mistake, not a measurement


def _finite_number(value: Any) -> bool:
    try:
        return not isinstance(value, bool) and isinstance(value, int | float) and math.isfinite(value)
    except OverflowError:
        return False


def model_from_json(text: str | dict[str, Any]) -> LinearLatencyModel | ConstantLatencyModel:
    """Parse a latency-model JSON document (kind, units, coefficients, in seconds); ValueError says why."""
    try:
        doc = json.loads(text) if isinstance(text, str) else text
    except json.JSONDecodeError as err:
        raise ValueError(f"latency model is not valid JSON: {err}") from None
    if not isinstance(doc, dict):
        raise ValueError(f"latency model JSON must be an object, got {type(doc).__name__}")
    kind = doc.get("kind", "linear")
    keys = _KEYS.get(kind) if isinstance(kind, str) else None
    if keys is None:
        raise ValueError(f"latency model kind must be 'linear' or 'constant', got {kind!r}")
    units = doc.get("units", "seconds")
    scale = _UNITS.get(units) if isinstance(units, str) else None
    if scale is None:
        raise ValueError(f"latency model units must be one of {', '.join(_UNITS)}, got {units!r}")
    unknown = sorted(set(doc) - {"kind", "units", *keys, *_OPTIONAL[kind]})
    if unknown:
        raise ValueError(f"unknown {kind} latency model keys {unknown}; valid: "
                         f"{', '.join(['kind', 'units', *keys, *_OPTIONAL[kind]])}")
    missing = [key for key in keys if key not in doc]
    if missing:
        raise ValueError(f"{kind} latency model JSON lacks {', '.join(missing)}")
    vals = {key: doc[key] for key in (*keys, *_OPTIONAL[kind]) if key in doc}
    bad = [key for key, value in vals.items() if not _finite_number(value)]
    if bad:
        raise ValueError(f"latency model fields must be numbers (finite, in {units}): {', '.join(bad)}")
    vals = {key: float(value) * scale for key, value in vals.items()}
    floor = vals.get("c0", vals.get("value_s", 0.0))
    if floor > MAX_INTERCEPT_S:
        raise ValueError(f"a decode step floor of {floor:g} s is implausible; a file in milliseconds "
                         f'needs "units": "ms"')
    return LinearLatencyModel(**vals) if kind == "linear" else ConstantLatencyModel(**vals)


def load_model(path: str | Path) -> LinearLatencyModel | ConstantLatencyModel:
    """Read the --latency-model file."""
    try:
        text = Path(path).read_text()
    except OSError as err:
        raise ValueError(f"cannot read latency model {path}: {err}") from None
    try:
        return model_from_json(text)
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from None


def mape(model: LatencyModel, samples: Iterable[Sample]) -> float:
    """Mean absolute percentage error (fraction, 0.018 = 1.8%) of `model` on realized steps."""
    seqs, ctx, lat, extra = _columns(samples)
    if len(lat) == 0:
        raise ValueError("mape needs at least one sample")
    pred = np.array([model.predict(*step) for step in zip(seqs, ctx, extra, strict=True)])
    return float(np.mean(np.abs(pred - lat) / np.maximum(lat, 1e-12)))


def _columns(samples: Iterable[Sample]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    rows = [(sample[0], sample[1], sample[2], sample[3] if len(sample) > 3 else 0) for sample in samples]
    table = np.array(rows, dtype=np.float64).reshape(-1, 4)
    return table[:, 0], table[:, 1], table[:, 2], table[:, 3]


def _degenerate(seqs: np.ndarray, ctx: np.ndarray, max_corr: float = 0.999) -> str | None:
    """Why (rows, ctx) cannot identify c_seq and c_ctx separately, or None if they can."""
    if len(seqs) < 3:
        return "fewer than 3 samples"
    if np.ptp(seqs) == 0:
        return "every sample has the same number of rows"
    if np.ptp(ctx) == 0:
        return "every sample has the same context size"
    if abs(np.corrcoef(seqs, ctx)[0, 1]) > max_corr:
        return "rows and context size move together (collinear)"
    return None


def _fit(seqs: np.ndarray, ctx: np.ndarray, lat: np.ndarray, extra: np.ndarray) -> LinearLatencyModel:
    why = _degenerate(seqs, ctx)
    if why:
        raise ValueError(f"cannot fit a latency model: {why}")
    if not np.all(np.isfinite(lat)) or np.any(lat < 0):
        raise ValueError("cannot fit a latency model: latencies must be finite and >= 0")
    if np.any(extra) and np.ptp(extra) == 0:
        raise ValueError("cannot fit a latency model: extra tokens are the same nonzero value everywhere")
    cols = [np.ones_like(seqs), seqs, ctx] + ([extra] if np.ptp(extra) > 0 else [])
    design = np.stack(cols, axis=1)
    scale = np.abs(design).max(axis=0)  # > 0 for every column here; scaling keeps NNLS well conditioned
    scaled, _ = nnls(design / scale, lat)
    coef = (scaled / scale).tolist() + [0.0]
    return LinearLatencyModel(c0=coef[0], c_seq=coef[1], c_ctx=coef[2], c_tok=coef[3])


MIN_SPLIT = 8  # steps that deferred, and steps that did not, before the deferral price is believed
_PRICE_Z = 3.0  # standard errors by which the price must stand out of the noise
_RCOND = 1e-9  # a direction of the composition this much weaker than the strongest is not identified


@dataclass(frozen=True, slots=True)
class _PriceFit:
    """Deferral columns fitted beside the composition: coefficients (s), the combination and its error."""

    coef: tuple[float, ...]
    est: float
    std_err: float

    @property
    def believed(self) -> bool:
        return self.est > _PRICE_Z * self.std_err


@dataclass(slots=True)
class DeferralEvidence:
    """What deferring steps took beyond their composition: one joint weighted regression (taper-rule.md)."""

    steps: int = 0
    defer_steps: int = 0
    deferred_rows: float = 0.0  # rows deferred, over the steps that deferred
    xtx: np.ndarray = field(default_factory=lambda: np.zeros((4, 4)))
    xty: np.ndarray = field(default_factory=lambda: np.zeros(4))
    yty: float = 0.0

    def add(self, design: np.ndarray, latency: np.ndarray, deferred: np.ndarray) -> None:
        """Steps (centred, weighted rows of `design`) with latencies likewise, and the rows each deferred."""
        self.steps += len(latency)
        self.defer_steps += int((deferred > 0).sum())
        self.deferred_rows += float(deferred.sum())
        self.xtx += design.T @ design
        self.xty += design.T @ latency
        self.yty += float(latency @ latency)

    def price(self) -> tuple[float, float]:
        """(c_defer, c_deferred) in seconds: (0, 0) until the joint price is believed; negative parts drop."""
        if self.defer_steps < MIN_SPLIT or self.steps - self.defer_steps < MIN_SPLIT:
            return 0.0, 0.0
        both = self._fit((2, 3), (1.0, self.deferred_rows / self.defer_steps))
        if both is None:  # every deferring step deferred as many rows: one column holds the price
            alone = self._fit((2,), (1.0,))
            return (alone.est, 0.0) if alone is not None and alone.believed else (0.0, 0.0)
        if not both.believed:
            return 0.0, 0.0
        c_defer, c_deferred = both.coef
        if c_defer >= 0.0 and c_deferred >= 0.0:
            return c_defer, c_deferred
        if c_deferred < 0.0:
            alone = self._fit((2,), (1.0,))
            return (max(alone.est, 0.0), 0.0) if alone is not None else (0.0, 0.0)
        alone = self._fit((3,), (1.0,))
        return (0.0, max(alone.est, 0.0)) if alone is not None else (0.0, 0.0)

    def _fit(self, cols: tuple[int, ...], combo: tuple[float, ...]) -> _PriceFit | None:
        """The deferral columns `cols` fitted with (rows, ctx) partialled out, `combo`, its error; or None."""
        scale = np.sqrt(np.diag(self.xtx))
        scale[scale == 0.0] = 1.0
        xtx = self.xtx / np.outer(scale, scale)
        xty = self.xty / scale
        comp, defer = [0, 1], list(cols)
        comp_inv = np.linalg.pinv(xtx[np.ix_(comp, comp)], rcond=_RCOND, hermitian=True)
        cross = xtx[np.ix_(defer, comp)]
        # the deferral columns' information beyond the composition
        info = xtx[np.ix_(defer, defer)] - cross @ comp_inv @ cross.T
        resid = xty[defer] - cross @ comp_inv @ xty[comp]
        if np.any(np.diag(info) <= _RCOND) or np.linalg.cond(info) > 1.0 / _RCOND:
            return None
        info_inv = np.linalg.inv(info)
        scaled = info_inv @ resid
        rss = max(self.yty - float(xty[comp] @ comp_inv @ xty[comp]) - float(scaled @ resid), 0.0)  # 0: exact
        dof = self.steps - np.linalg.matrix_rank(xtx[np.ix_(comp, comp)], tol=_RCOND, hermitian=True) - len(defer)
        if dof <= 0:
            return None
        weights = np.asarray(combo) * (1.0 / scale[defer])  # the combination in seconds
        coef = scaled / scale[defer]
        return _PriceFit(coef=tuple(float(value) for value in coef), est=float(np.asarray(combo) @ coef),
                         std_err=math.sqrt(rss / dof * float(weights @ info_inv @ weights)))


def _mape_deferred(model: LinearLatencyModel, seqs: np.ndarray, ctx: np.ndarray, lat: np.ndarray,
                   deferred: np.ndarray) -> float:
    price = np.where(deferred > 0, model.c_defer + model.c_deferred * deferred, 0.0)
    pred = model.c0 + model.c_seq * seqs + model.c_ctx * ctx + price
    return float(np.mean(np.abs(pred - lat) / np.maximum(lat, 1e-12)))


@dataclass(slots=True)
class OnlineRefit:
    """Refit the shared model in place from the last `window` decode steps (TP rank 0; taper-predictor.md)."""

    model: LinearLatencyModel | ConstantLatencyModel
    window: int = 200
    every: int = 50
    blend: float = 0.5
    min_samples: int = 32
    slopes_fixed: bool = False
    deferral: bool = False
    refits: int = field(default=0, init=False)
    intercept_refits: int = field(default=0, init=False)  # of `refits`, c0-only corrections
    skipped: int = field(default=0, init=False)
    last_skip: str = field(default="", init=False)
    steps: int = field(default=0, init=False)  # realized steps taken in (observe accepted)
    deferring_steps: int = field(default=0, init=False)  # of `steps`, those that deferred rows
    _buf: deque[tuple[int, int, float]] = field(init=False, repr=False)
    _deferred: deque[int] = field(init=False, repr=False)
    evidence: DeferralEvidence = field(default_factory=DeferralEvidence, init=False)
    _since: int = field(default=0, init=False, repr=False)
    _fresh: int = field(default=0, init=False, repr=False)  # observations since the last refit

    def __post_init__(self) -> None:
        if not 0.0 < self.blend <= 1.0:
            raise ValueError(f"blend must be in (0, 1], got {self.blend}")
        self._buf = deque(maxlen=self.window)
        self._deferred = deque(maxlen=self.window)

    def observe(self, n_seqs: int, ctx_tokens: int, latency_s: float, extra_tokens: int = 0,
                deferred: int = 0) -> bool:
        """Record one realized step (`deferred`: rows it did not run); True when the coefficients changed."""
        if extra_tokens or not (math.isfinite(latency_s) and latency_s > 0.0):
            return False
        self._buf.append((n_seqs, ctx_tokens, latency_s))
        self._deferred.append(max(int(deferred), 0))
        self.steps += 1
        self.deferring_steps += deferred > 0
        self._fresh += 1
        self._since += 1
        if self._since < self.every or len(self._buf) < self.min_samples:
            return False
        self._since = 0
        return self.refit()

    def refit(self) -> bool:
        """Refit from the window now (observe() calls this every `every` steps)."""
        if len(self._buf) < self.min_samples:
            return self._skip(f"fewer than {self.min_samples} samples")
        seqs, ctx, lat, _ = _columns(self._buf)
        model = self.model
        if isinstance(model, LinearLatencyModel):  # decode steps cost their padded rows
            seqs = model.padded(seqs)
        if isinstance(model, ConstantLatencyModel):
            changed = model.value_s != float(lat.max())
            model.value_s = float(lat.max())
            self.refits += changed
            return changed
        blend = self.blend
        deferred = np.fromiter(self._deferred, np.float64, len(self._deferred))
        defers = deferred > 0
        fresh, self._fresh = min(self._fresh, len(deferred)), 0
        price = model.deferral()
        if self.deferral:  # the new steps, centred on their window, relative to T (DeferralEvidence)
            design = np.stack([seqs, ctx, defers.astype(np.float64), deferred], axis=1)
            new = slice(len(deferred) - fresh, None)
            t_hat = model.c0 + model.c_seq * seqs[new] + model.c_ctx * ctx[new]
            weights = 1.0 / np.where(t_hat > 0.0, t_hat, float(lat.mean()))
            self.evidence.add((design - design.mean(axis=0))[new] * weights[:, None],
                              (lat - lat.mean())[new] * weights, deferred[new])
            price = self.evidence.price()
        # T's part of each step: the price taken out, floored at 0 (a price is a mean over steps)
        plain = np.maximum(lat - np.where(defers, price[0] + price[1] * deferred, 0.0), 0.0)
        why = "slopes fixed (calibrated model)" if self.slopes_fixed else _degenerate(seqs, ctx)
        if why:
            c0_fit = max(0.0, float(np.mean(plain - model.c_seq * seqs - model.c_ctx * ctx)))
            cand = LinearLatencyModel((1 - blend) * model.c0 + blend * c0_fit, model.c_seq, model.c_ctx,
                                      model.c_tok, *price)
        else:
            fit = _fit(seqs, ctx, plain, np.zeros_like(seqs))
            cand = LinearLatencyModel(*((1 - blend) * old + blend * new_coef for old, new_coef in
                                        zip(model.coefs()[:3], fit.coefs()[:3], strict=True)),
                                      model.c_tok, *price)
        model.c_defer, model.c_deferred = price  # from all the evidence, not from this window alone
        if cand.coefs() == model.coefs():
            return self._skip(f"{why}; intercept already fits" if why else "fit unchanged")
        # worse beyond rounding
        if (_mape_deferred(cand, seqs, ctx, lat, deferred)
                > _mape_deferred(model, seqs, ctx, lat, deferred) + 1e-9):
            return self._skip(f"{why}; intercept update would fit the window worse" if why
                              else "update would fit the window worse")
        model.c0, model.c_seq, model.c_ctx, model.c_defer, model.c_deferred = (
            cand.c0, cand.c_seq, cand.c_ctx, cand.c_defer, cand.c_deferred)
        self.refits += 1
        self.intercept_refits += bool(why)
        if why:
            self.last_skip = f"slopes kept ({why})"
        return True

    def _skip(self, why: str) -> bool:
        self.skipped += 1
        self.last_skip = why
        return False
