"""Utility curves u_r(k) over k opportunistic rows granted to a request (TAPER §3.3).

The planner needs only the marginal gain of the k-th opportunistic row, u(k) - u(k-1) for k >= 1,
which it reads from a table indexed by k. Curves must be non-decreasing (gains >= 0).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

UTILITY_NAMES = ("linear", "concave", "priority")
_TABLE = 64  # gains precomputed per curve; a wider request gets a table built for that call


@dataclass(frozen=True, slots=True, eq=False, repr=False)
class Utility:
    """A named marginal-gain curve; `weighted` multiplies gains by the request's weight."""

    name: str
    gain: Callable[[int], float]
    weighted: bool = False
    _table: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        table = self._build(_TABLE)
        table.flags.writeable = False
        object.__setattr__(self, "_table", table)

    def _build(self, kmax: int) -> np.ndarray:
        return np.array([1.0] + [self.gain(rank) for rank in range(1, kmax + 1)])

    def table(self, kmax: int) -> np.ndarray:
        """Gains indexed by k <= kmax (read-only); index 0 (the protected row, which is not priced)
        holds a placeholder 1."""
        return self._table if kmax < len(self._table) else self._build(kmax)

    def __repr__(self) -> str:
        return f"Utility({self.name!r})"


LINEAR = Utility("linear", lambda rank: 1.0)  # throughput: every row is worth the same
# fairness: first extra row counts most
CONCAVE = Utility("concave", lambda rank: math.log1p(rank) - math.log1p(rank - 1))
PRIORITY = Utility("priority", lambda rank: 1.0, weighted=True)  # linear, scaled by the tenant's weight


def parse_utility(name: str | Utility) -> Utility:
    if isinstance(name, Utility):
        return name
    for curve in (LINEAR, CONCAVE, PRIORITY):
        if curve.name == str(name).strip().lower():
            return curve
    raise ValueError(f"invalid utility {name!r}; valid: {', '.join(UTILITY_NAMES)}")
