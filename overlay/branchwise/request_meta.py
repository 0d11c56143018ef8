"""Per-request Branchwise metadata carried in `sampling_params.custom_params["branchwise"]`.

Clients stamp it (branchwise.client, the frontend fork hook); the scheduler parses it once when it
creates the Req. Pure: no SGLang import. Keys:

    {"branchwise": {"phase": "grp42", "branch": 0, "fanout": 4,      # client-side fork/join
                    "slo_tpot_ms": 50, "weight": 1.0,                 # TAPER inputs
                    "grammar": "multiverse" | "sprint" | "none"}}      # server-side phases
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

KEY = "branchwise"
GRAMMARS = ("none", "multiverse", "sprint")
_FIELDS = {"phase", "branch", "fanout", "slo_tpot_ms", "weight", "grammar"}


class MetaError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class RequestMeta:
    phase: str | None = None  # client-side phase id shared by sibling branches
    branch: int = 0
    fanout: int = 1
    slo_tpot_ms: float | None = None  # None: the server's --branch-slo-tpot-ms
    weight: float = 1.0
    grammar: str | None = None  # None: the server's --branch-grammar

    @property
    def is_branch(self) -> bool:
        return self.phase is not None


SERIAL = RequestMeta()


def _num(d: dict, key: str, kind: type, lo: float, default: Any) -> Any:
    v = d.get(key, default)
    if v is default:
        return v
    if isinstance(v, bool) or not isinstance(v, int | float) or (kind is int and not float(v).is_integer()):
        raise MetaError(f"custom_params.branchwise.{key} must be a number, got {v!r}")
    if not math.isfinite(v) or v < lo:
        raise MetaError(f"custom_params.branchwise.{key} must be >= {lo}, got {v!r}")
    return kind(v)


def parse(custom_params: Any) -> RequestMeta:
    """RequestMeta from a request's custom_params; MetaError with a clear message if malformed."""
    if not custom_params or KEY not in custom_params:
        return SERIAL
    d = custom_params[KEY]
    if not isinstance(d, dict):
        raise MetaError(f"custom_params.branchwise must be an object, got {type(d).__name__}")
    unknown = set(d) - _FIELDS
    if unknown:
        raise MetaError(f"unknown custom_params.branchwise keys {sorted(unknown)}; valid: {sorted(_FIELDS)}")
    phase = d.get("phase")
    if phase is not None and (not isinstance(phase, str) or not phase):
        raise MetaError("custom_params.branchwise.phase must be a non-empty string")
    fanout = _num(d, "fanout", int, 1, 1)
    branch = _num(d, "branch", int, 0, 0)
    if branch >= fanout:
        raise MetaError(f"custom_params.branchwise.branch {branch} must be < fanout {fanout}")
    grammar = d.get("grammar")
    if grammar is not None and grammar not in GRAMMARS:
        raise MetaError(f"custom_params.branchwise.grammar {grammar!r}; valid: {', '.join(GRAMMARS)}")
    slo = _num(d, "slo_tpot_ms", float, 1e-3, None)
    return RequestMeta(phase, branch, fanout, slo, _num(d, "weight", float, 0.0, 1.0), grammar)


def stamp(sampling_params: dict | None, **fields: Any) -> dict:
    """Return sampling_params with custom_params.branchwise updated (clients use this)."""
    sp = dict(sampling_params or {})
    cp = dict(sp.get("custom_params") or {})
    cp[KEY] = {**cp.get(KEY, {}), **{k: v for k, v in fields.items() if v is not None}}
    parse(cp)  # fail on the client, not in the scheduler
    sp["custom_params"] = cp
    return sp
