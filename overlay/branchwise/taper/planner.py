"""TAPER's per-step planner (Algorithm 1): a decode batch in (`ArrayBatch`), widths out (`StepPlan`).

Greedy by marginal utility per marginal latency while T(S) fits: docs/design/taper-planner.md.
Hot path: one sort, one cumsum and one binary search per step over flat arrays, no per-row objects.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from branchwise.taper.predictor import LatencyModel, padded_rows
from branchwise.taper.utility import LINEAR, Utility

# greedy_order packs (price bits less the low _Q_SHIFT ones, row index) in one int64; ties by row
_Q_SHIFT = 20
_TINY = 1e-300  # a zero weight makes rows last, not NaN
_ROW_BITS = 20  # < 2^20 rows and requests per step
_Q_BITS = 63 - _ROW_BITS  # price bits: 0x7FF0... (inf) >> 20 < 2^43
_ROW_MASK = (1 << _ROW_BITS) - 1
_ROWS = np.arange(1 << 12, dtype=np.int64)  # 0..4095, sliced for the common batch sizes
_ROWS.flags.writeable = False
_PAD_TOL = 1e-9  # relative: a padded prefix's sum of row costs and padding that cancel is not above 0
# the price of deferring: (per step that defers, per deferred row) seconds, or a function giving it
Deferral = tuple[float, float] | Callable[[], tuple[float, float]]


@dataclass(frozen=True, slots=True, eq=False)
class ArrayBatch:
    """One decode batch as flat arrays: per request its ready rows, the protected one first."""

    rids: Sequence[str]  # n requests (the controller's grouping keys)
    ready: np.ndarray  # int64[n], ready rows per request (>= 1)
    ctx: np.ndarray  # int64[sum(ready)], row context lengths, request-major, protected row first
    slack_s: np.ndarray  # float64[n], residual TPOT slack in seconds (may be negative)
    weight: np.ndarray | None = None  # float64[n], the "priority" utility's weights; None: all 1.0
    in_phase: np.ndarray | None = None  # bool[n], in a parallel phase; None: none is
    fixed_width: np.ndarray | None = None  # int64[n], 0 = not pinned (taper-no-replan)
    extra_tokens: int = 0  # tokens in the same forward that are not decode rows (mixed prefill)
    slo_s: np.ndarray | None = None  # float64[n], each request's TPOT target; None: unknown (paper rule)
    waiting: int = 0  # requests queued for admission (SGLang's waiting queue): the backlog
    gap_slack_s: np.ndarray | None = None  # float64[n], slack_s read per gap (the paper's serial slack)
    starts: np.ndarray = field(init=False, repr=False)  # int64[n], each request's first (protected) row
    protected_ctx: int = field(init=False, repr=False)  # context tokens of the protected rows, S0's

    def __post_init__(self) -> None:
        count = len(self.rids)
        if self.ready.shape != (count,) or self.slack_s.shape != (count,):
            raise ValueError(f"ArrayBatch: ready and slack_s need one entry per request ({count})")
        if count and int(self.ready.min()) < 1:
            raise ValueError("ArrayBatch: every request needs at least one ready row")
        starts = self.ready.cumsum()
        if self.ctx.shape != (int(starts[-1]) if count else 0,):
            raise ValueError("ArrayBatch: ctx needs one entry per ready row (sum of ready)")
        for name in ("weight", "in_phase", "fixed_width", "slo_s", "gap_slack_s"):
            column = getattr(self, name)
            if column is not None and column.shape != (count,):
                raise ValueError(f"ArrayBatch: {name} needs one entry per request ({count})")
        starts -= self.ready
        starts.flags.writeable = False  # shared by every reader of the batch
        object.__setattr__(self, "starts", starts)
        object.__setattr__(self, "protected_ctx", int(self.ctx[starts].sum()))


@dataclass(frozen=True, slots=True, eq=False)
class PlanOptions:
    """What plan_step honours beyond the budget: the policy's extras (policies.py)."""

    utility: Utility = LINEAR
    pinned: bool = False  # a pinned request runs exactly min(fixed_width, ready) rows (taper-no-replan)
    fill: bool = False  # Algorithm 1's pruning rule exactly, after the first misfit
    floor: np.ndarray | None = None  # int64[n], rows per request that run whatever the budget
    deferral: Deferral | None = None  # priced plans defer only where shorter than running every row


PLAIN = PlanOptions()


@dataclass(slots=True)
class StepPlan:
    """Rows to run per request (aligned with the batch's rids), plus what the planner predicted."""

    rids: Sequence[str]
    widths: np.ndarray  # int64[n], in [1, ready] for every request
    predicted_s: float = 0.0
    budget_s: float = math.inf
    considered: int = 0  # opportunistic rows the greedy pass priced
    notes: dict[str, float] = field(default_factory=dict)  # protected_s, and the taper terms that applied

    @property
    def rows(self) -> int:
        return int(self.widths.sum())


@dataclass(frozen=True, slots=True)
class _RowArrays:
    """Per-row arrays of one plan: marginal cost, owning request, position inside that request."""

    cost: np.ndarray
    owner: np.ndarray
    rank: np.ndarray


@dataclass(frozen=True, slots=True)
class _Padding:
    """A decode step's graph padding: the seconds it adds at each row count, c_seq x (padded - rows)."""

    sizes: tuple[int, ...]
    c_seq: float

    def at(self, rows: int) -> float:
        return self.c_seq * (padded_rows(self.sizes, rows) - rows)

    def after(self, forced: int, added: np.ndarray) -> np.ndarray:
        """What the padding adds beyond its value at `forced` rows, with `added` more rows (each)."""
        rows = added + float(forced)
        table = np.array(self.sizes, dtype=np.float64)
        index = np.searchsorted(table, rows, side="left")
        padded = np.where(index < len(table), table[np.minimum(index, len(table) - 1)], rows)
        return self.c_seq * (padded - rows) - self.at(forced)


def _padding(model: LatencyModel, extra_tokens: int) -> _Padding | None:
    """The model's graph padding for a decode step; None where T is linear in rows (CPU, mixed step)."""
    sizes = getattr(model, "graph_batch_sizes", ())
    if not sizes or extra_tokens:
        return None
    return _Padding(sizes, model.c_seq)


def _ones(count: int) -> np.ndarray:
    return np.ones(count, dtype=np.int64)


def _arange(count: int) -> np.ndarray:
    if count <= len(_ROWS):
        return _ROWS[:count]
    if count > _ROW_MASK:
        raise ValueError(f"planner supports < {_ROW_MASK} rows per step, got {count}")
    return np.arange(count, dtype=np.int64)


def plan_capped(batch: ArrayBatch, cap: int | None, model: LatencyModel | None) -> StepPlan:
    """The static rule: min(ready, cap) rows per request (cap None: all); `model` only fills predicted_s."""
    widths = batch.ready if cap is None else np.minimum(batch.ready, cap)
    predicted = 0.0
    if model is not None and len(batch.rids):
        if cap is None:
            rows, ctx = len(batch.ctx), int(batch.ctx.sum())
        elif cap == 1:
            rows, ctx = len(batch.rids), batch.protected_ctx
        else:
            keep = np.arange(len(batch.ctx)) < (batch.starts + widths).repeat(batch.ready)
            rows, ctx = int(widths.sum()), int(batch.ctx[keep].sum())
        predicted = model.predict(rows, ctx, batch.extra_tokens)
    return StepPlan(batch.rids, widths, predicted)


def plan_step(batch: ArrayBatch, model: LatencyModel, budget_s: float,
              options: PlanOptions = PLAIN) -> StepPlan:
    """Widths per request: protected rows (or pins, floors) even over budget, then the greedy plan."""
    if budget_s != budget_s:  # NaN (a broken clock upstream) must not widen anything
        budget_s = -math.inf
    deferral = options.deferral
    if deferral is not None and not callable(deferral) and not any(deferral):
        deferral = None
    rids = batch.rids
    count = len(rids)
    if count == 0:
        return StepPlan(rids, _ones(0), 0.0, budget_s)
    padding = _padding(model, batch.extra_tokens)  # None on CPU: every line below as without graphs
    ready, ctx, starts = batch.ready, batch.ctx, batch.starts
    least = None  # rows per request that run no matter what; None: one (the protected row)
    fixed = batch.fixed_width if options.pinned else None
    floor = options.floor
    if fixed is not None and fixed.any():
        least = np.where(fixed > 0, np.minimum(fixed, ready), 1)
        cap = np.where(fixed > 0, least, ready)  # a pinned request is never widened past its width
        owner = _arange(count).repeat(ready)
        ctx = ctx[_arange(len(ctx)) - starts[owner] < cap[owner]]
        ready = cap
        starts = ready.cumsum()
        starts -= ready
    elif floor is not None and bool((floor > 1).any()):
        least = np.minimum(np.maximum(floor, 1), ready)
    else:
        base_s = model.predict(count, batch.protected_ctx, batch.extra_tokens)  # T(S0)
        # the protected composition alone is over budget: it runs (and, padded, the rows that add nothing)
        if base_s > budget_s and deferral is None and padding is None:
            return StepPlan(rids, _ones(count), predicted_s=base_s, budget_s=budget_s,
                            notes={"protected_s": base_s})

    total = len(ctx)
    owner = _arange(count).repeat(ready)
    utility = options.utility
    rank = None
    if least is not None or options.fill or utility is not LINEAR:
        rank = _arange(total) - starts[owner]
    cost = model.row_costs(ctx)  # a new float64 array, >= 0: its bits sort like its values
    if least is None:
        forced = starts
    else:
        forced = (rank < least[owner]).nonzero()[0]
        base_s = model.predict(0, 0, batch.extra_tokens) + float(cost[forced].sum())  # T is separable
        if padding is not None:
            base_s += padding.at(len(forced))
        if base_s > budget_s and deferral is None and padding is None:
            return StepPlan(rids, least, predicted_s=base_s, budget_s=budget_s,
                            notes={"protected_s": base_s})
    notes = {"protected_s": base_s}
    cost[forced] = 0.0  # in base_s already
    considered = total - len(forced)
    extra_s = float(cost.sum())
    if padding is not None:
        extra_s += padding.at(total) - padding.at(len(forced))
    if base_s + extra_s <= budget_s:  # everything ready fits (also taper-no-slack's infinite budget)
        return StepPlan(rids, ready, predicted_s=base_s + extra_s, budget_s=budget_s,
                        considered=considered, notes=notes)
    start_s = base_s
    if deferral is not None:  # every row deferred costs its share; admitting it saves cost - per row
        per_step, per_row = deferral() if callable(deferral) else deferral
        start_s = base_s + per_step + per_row * considered
        cost = np.maximum(cost - per_row, 0.0)
        cost[forced] = 0.0
        # no plan that defers beats running every row: no greedy pass (padded: a bucket may save more)
        if padding is None and float(cost.sum()) <= per_step:
            notes["defer_cost"] = 1.0
            return StepPlan(rids, ready, predicted_s=base_s + extra_s, budget_s=budget_s,
                            considered=considered, notes=notes)

    # price = seconds per unit of marginal utility; greedy takes the lowest first (forced rows: 0)
    price = cost
    if utility is not LINEAR:
        gain = utility.table(int(ready.max()))[rank]
        if utility.weighted and batch.weight is not None:
            gain *= batch.weight[owner]
        price = cost / np.maximum(gain, _TINY)
    order = greedy_order(price, owner)
    cumulative = cost[order].cumsum()
    room = budget_s - start_s
    if padding is None:
        taken = int(cumulative.searchsorted(room, side="right"))
    else:  # each prefix with the padding it reaches (not monotone under a per-row price: the last fit)
        added = np.ones(total)
        added[forced] = 0.0  # in base_s already
        added = added[order].cumsum()
        cumulative += padding.after(len(forced), added)
        room = max(room, 0.0) + _PAD_TOL * max(start_s, 0.0)  # over budget, rows adding nothing run
        fits = np.flatnonzero(cumulative <= room)
        taken = int(fits[-1]) + 1 if len(fits) else 0
    width = np.bincount(owner[order[:taken]], minlength=count)
    if deferral is not None or padding is not None:  # over budget (room < 0) the forced rows still run
        width = np.maximum(width, 1 if least is None else least)
    used = float(cumulative[taken - 1]) if taken else 0.0
    if options.fill and taken < total:
        rows = _RowArrays(cost, owner, rank)
        if padding is None:
            used += _fill(order[taken:], rows, width, room - used)
        else:
            running = len(forced) + (int(added[taken - 1]) if taken else 0)
            used += _fill_padded(order[taken:], rows, width, room - used, (padding, running))
    if deferral is not None and base_s + extra_s <= start_s + used:  # deferring would not shorten the step
        notes["defer_cost"] = 1.0
        return StepPlan(rids, ready, predicted_s=base_s + extra_s, budget_s=budget_s,
                        considered=considered, notes=notes)
    return StepPlan(rids, width, predicted_s=start_s + used, budget_s=budget_s,
                    considered=considered, notes=notes)


def greedy_order(price: np.ndarray, owner: np.ndarray) -> np.ndarray:
    """Rows in greedy order: by price, a request's rows in order (running max), ties by row index."""
    key = price.view(np.int64) >> _Q_SHIFT
    # running max along each request's rows, in one 1-D pass by lifting every request above the last
    lift = owner << _Q_BITS
    key += lift
    np.maximum.accumulate(key, out=key)
    key -= lift
    key <<= _ROW_BITS
    key |= _arange(len(price))
    key.sort()
    return key & _ROW_MASK


def _fill(rest: np.ndarray, rows: _RowArrays, width: np.ndarray, room: float) -> float:
    """Algorithm 1's pruning after the first misfit: a request whose next row misfits drops out."""
    rest_cost = rows.cost[rest]
    fits = np.flatnonzero(rest_cost <= room)  # rows costlier than the room now never fit later either
    done = width.tolist()
    dropped = np.zeros(len(done), dtype=bool)
    dropped[rows.owner[rest[0]]] = True  # the row that ended the prefix did not fit
    added = 0.0
    for row, row_cost in zip(rest[fits].tolist(), rest_cost[fits].tolist(), strict=True):
        request = int(rows.owner[row])
        if dropped[request] or rows.rank[row] != done[request]:  # dropped, or an earlier row was skipped
            continue
        if row_cost <= room - added:
            done[request] += 1
            added += row_cost
        else:
            dropped[request] = True
    width[:] = done
    return added


def _fill_padded(rest: np.ndarray, rows: _RowArrays, width: np.ndarray, room: float,
                 padded: tuple[_Padding, int]) -> float:
    """_fill where a row adds its cost and the padding it moves (inside the bucket a row may fit)."""
    padding, running = padded
    done = width.tolist()
    dropped = np.zeros(len(done), dtype=bool)
    dropped[rows.owner[rest[0]]] = True
    added = 0.0
    for row in rest.tolist():
        request = int(rows.owner[row])
        if dropped[request] or rows.rank[row] != done[request]:
            continue
        step = float(rows.cost[row]) + padding.at(running + 1) - padding.at(running)
        if step <= room - added:
            done[request] += 1
            added += step
            running += 1
        else:
            dropped[request] = True
    width[:] = done
    return added


def floor_cost(batch: ArrayBatch, model: LatencyModel, floor: np.ndarray | None) -> float:
    """Predicted latency of the composition that runs `floor` rows per request (None: one each)."""
    if floor is None:
        return model.predict(len(batch.rids), batch.protected_ctx, batch.extra_tokens)
    least = np.minimum(np.maximum(floor, 1), batch.ready)
    keep = _arange(len(batch.ctx)) < (batch.starts + least).repeat(batch.ready)  # below its request's floor
    return model.predict(int(least.sum()), int(batch.ctx[keep].sum()), batch.extra_tokens)
