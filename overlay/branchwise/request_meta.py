"""Per-request Branchwise metadata carried in `sampling_params.custom_params["branchwise"]`.

Clients stamp it (branchwise.client, the frontend fork hook); the scheduler parses it once when it
creates the Req. Pure: no SGLang import. Keys:

    {"branchwise": {"phase": "grp42", "branch": 0, "fanout": 4,      # client-side fork/join
                    "slo_tpot_ms": 50, "weight": 1.0,                 # TAPER inputs
                    "grammar": "multiverse" | "sprint" | "none"}}      # server-side phases
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

KEY = "branchwise"
GRAMMARS = ("none", "multiverse", "sprint")
_FIELDS = frozenset({"phase", "branch", "fanout", "slo_tpot_ms", "weight", "grammar"})
INT_MAX = 2**31 - 1  # branch/fanout: far above any real fanout, and a plain int everywhere downstream
FLOAT_MAX = 1e9  # slo_tpot_ms/weight: finite, and its products with token counts stay finite
MAX_SHOWN = 40  # characters of an offending value quoted in an error


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


def show(v: Any) -> str:
    """A short repr of a client value for an error message (never raises: ints past Python's
    4300-digit str limit cannot be repr'd)."""
    try:
        s = repr(v)
    except ValueError:
        return f"<{type(v).__name__}>"
    return s if len(s) <= MAX_SHOWN else s[: MAX_SHOWN - 3] + "..."


def _num(d: dict, key: str, kind: type, lo: float, hi: float, default: Any) -> Any:
    """A bounded number from d[key]. Compared before any conversion (an int compares exactly, so
    a 400-digit int is out of range, not an OverflowError), NaN fails every comparison."""
    v = d.get(key, default)
    if v is default:
        return v
    what, fmt = ("an integer", "d") if kind is int else ("a number", "g")
    if (isinstance(v, bool) or not isinstance(v, int | float)
            or (kind is int and isinstance(v, float) and not v.is_integer()) or not lo <= v <= hi):
        raise MetaError(f"custom_params.{KEY}.{key} must be {what} in [{lo:{fmt}}, {hi:{fmt}}], got {show(v)}")
    return kind(v)


def parse(custom_params: Any) -> RequestMeta:
    """RequestMeta from a request's custom_params; MetaError with a message naming the field for
    anything else. Total over JSON values: no other exception, whatever the client sent."""
    if custom_params is None:
        return SERIAL
    if not isinstance(custom_params, dict):
        raise MetaError(f"custom_params must be an object, got {type(custom_params).__name__}")
    d = custom_params.get(KEY)
    if d is None:
        return SERIAL
    if not isinstance(d, dict):
        raise MetaError(f"custom_params.{KEY} must be an object, got {type(d).__name__}")
    unknown = [k for k in d if k not in _FIELDS]
    if unknown:
        shown = ", ".join(show(k) for k in unknown[:4]) + (", ..." if len(unknown) > 4 else "")
        raise MetaError(f"unknown custom_params.{KEY} keys [{shown}]; valid: {sorted(_FIELDS)}")
    phase = d.get("phase")
    if phase is not None and (not isinstance(phase, str) or not phase):
        raise MetaError(f"custom_params.{KEY}.phase must be a non-empty string, got {show(phase)}")
    fanout = _num(d, "fanout", int, 1, INT_MAX, 1)
    branch = _num(d, "branch", int, 0, INT_MAX, 0)
    if branch >= fanout:
        raise MetaError(f"custom_params.{KEY}.branch {branch} must be < fanout {fanout}")
    grammar = d.get("grammar")
    if grammar is not None and (not isinstance(grammar, str) or grammar not in GRAMMARS):
        raise MetaError(f"custom_params.{KEY}.grammar {show(grammar)}; valid: {', '.join(GRAMMARS)}")
    slo = _num(d, "slo_tpot_ms", float, 1e-3, FLOAT_MAX, None)
    weight = _num(d, "weight", float, 0.0, FLOAT_MAX, 1.0)
    return RequestMeta(phase, branch, fanout, slo, weight, grammar)


def stamp(sampling_params: dict | None, **fields: Any) -> dict:
    """Return sampling_params with custom_params.branchwise updated (clients use this)."""
    sp = dict(sampling_params or {})
    parse(sp.get("custom_params"))  # a malformed existing stamp fails here with the field's name
    cp = dict(sp.get("custom_params") or {})
    cp[KEY] = {**(cp.get(KEY) or {}), **{k: v for k, v in fields.items() if v is not None}}
    parse(cp)  # fail on the client, not in the scheduler
    sp["custom_params"] = cp
    return sp
