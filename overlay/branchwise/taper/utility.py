"""Utility curves u_r(k) over k opportunistic rows granted to a request (TAPER §3.3).

The planner needs only the marginal gain of the k-th opportunistic row, u(k) - u(k-1) for k >= 1,
which it reads from a table indexed by k. Curves must be non-decreasing (gains >= 0).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

UTILITY_NAMES = ("linear", "concave", "priority")


class Utility:
    """A named marginal-gain curve; `weighted` multiplies gains by RequestView.weight."""

    __slots__ = ("name", "gain", "weighted", "_table")

    def __init__(self, name: str, gain: Callable[[int], float], weighted: bool = False) -> None:
        self.name, self.gain, self.weighted = name, gain, weighted
        self._table = np.ones(1)

    def table(self, kmax: int) -> np.ndarray:
        """Gains indexed by k; index 0 (the protected row, which is not priced) holds a placeholder 1."""
        if len(self._table) <= kmax:
            size = max(kmax + 1, 2 * len(self._table), 16)
            self._table = np.array([1.0] + [self.gain(k) for k in range(1, size)])
        return self._table

    def __repr__(self) -> str:
        return f"Utility({self.name!r})"


LINEAR = Utility("linear", lambda k: 1.0)  # throughput: every row is worth the same
CONCAVE = Utility("concave", lambda k: math.log1p(k) - math.log1p(k - 1))  # fairness: first extra row counts most
PRIORITY = Utility("priority", lambda k: 1.0, weighted=True)  # linear, scaled by the tenant's weight

_BY_NAME = {u.name: u for u in (LINEAR, CONCAVE, PRIORITY)}


def parse_utility(name: str | Utility) -> Utility:
    if isinstance(name, Utility):
        return name
    try:
        return _BY_NAME[str(name).strip().lower()]
    except KeyError:
        raise ValueError(f"invalid utility {name!r}; valid: {', '.join(UTILITY_NAMES)}") from None
