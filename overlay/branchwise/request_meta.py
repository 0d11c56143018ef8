"""Per-request Branchwise metadata carried in `sampling_params.custom_params["branchwise"]`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

KEY = "branchwise"
GRAMMARS = ("none", "multiverse", "sprint")
_FIELDS = frozenset({"phase", "branch", "fanout", "slo_tpot_ms", "weight", "grammar"})
INT_MAX = 2**31 - 1  # branch/fanout: far above any real fanout, and a plain int everywhere downstream
FLOAT_MAX = 1e9  # slo_tpot_ms/weight: finite, and its products with token counts stay finite
MAX_SHOWN = 40  # characters of an offending value quoted in an error
MAX_KEY_CHARS = 256  # a longer routing key is truncated: what keys it stays bounded whatever clients send


class MetaError(ValueError):
    pass


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestMeta:
    """A request's parsed stamp: its place in a client-side phase and its TAPER inputs."""

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


def of(req: object) -> RequestMeta:
    """A Req's parsed stamp (`req.bw_meta`, set when the scheduler creates it); SERIAL before that."""
    return getattr(req, "bw_meta", SERIAL)


def show(value: object) -> str:
    """A short repr of a client value for an error message (never raises: ints past Python's
    4300-digit str limit cannot be repr'd)."""
    try:
        text = repr(value)
    except ValueError:
        return f"<{type(value).__name__}>"
    return text if len(text) <= MAX_SHOWN else text[: MAX_SHOWN - 3] + "..."


def _num(fields: dict[str, Any], key: str, kind: type[int] | type[float], lo: float, hi: float,
         default: float | None) -> Any:
    """A bounded number from fields[key]. Compared before any conversion (an int compares exactly, so
    a 400-digit int is out of range, not an OverflowError), NaN fails every comparison."""
    value = fields.get(key, default)
    if value is default:
        return value
    what, fmt = ("an integer", "d") if kind is int else ("a number", "g")
    if (isinstance(value, bool) or not isinstance(value, int | float)
            or (kind is int and isinstance(value, float) and not value.is_integer())
            or not lo <= value <= hi):
        raise MetaError(f"custom_params.{KEY}.{key} must be {what} in [{lo:{fmt}}, {hi:{fmt}}], "
                        f"got {show(value)}")
    return kind(value)


def parse(custom_params: object) -> RequestMeta:
    """RequestMeta from a request's custom_params; MetaError with a message naming the field for
    anything else. Total over JSON values: no other exception, whatever the client sent."""
    if custom_params is None:
        return SERIAL
    if not isinstance(custom_params, dict):
        raise MetaError(f"custom_params must be an object, got {type(custom_params).__name__}")
    fields = custom_params.get(KEY)
    if fields is None:
        return SERIAL
    if not isinstance(fields, dict):
        raise MetaError(f"custom_params.{KEY} must be an object, got {type(fields).__name__}")
    unknown = [key for key in fields if key not in _FIELDS]
    if unknown:
        shown = ", ".join(show(key) for key in unknown[:4]) + (", ..." if len(unknown) > 4 else "")
        raise MetaError(f"unknown custom_params.{KEY} keys [{shown}]; valid: {sorted(_FIELDS)}")
    phase = fields.get("phase")
    if phase is not None and (not isinstance(phase, str) or not phase):
        raise MetaError(f"custom_params.{KEY}.phase must be a non-empty string, got {show(phase)}")
    fanout = _num(fields, "fanout", int, 1, INT_MAX, 1)
    branch = _num(fields, "branch", int, 0, INT_MAX, 0)
    if branch >= fanout:
        raise MetaError(f"custom_params.{KEY}.branch {branch} must be < fanout {fanout}")
    grammar = fields.get("grammar")
    if grammar is not None and (not isinstance(grammar, str) or grammar not in GRAMMARS):
        raise MetaError(f"custom_params.{KEY}.grammar {show(grammar)}; valid: {', '.join(GRAMMARS)}")
    return RequestMeta(phase=phase, branch=branch, fanout=fanout,
                       slo_tpot_ms=_num(fields, "slo_tpot_ms", float, 1e-3, FLOAT_MAX, None),
                       weight=_num(fields, "weight", float, 0.0, FLOAT_MAX, 1.0), grammar=grammar)


# ---- rids and routing keys: the scheme client and server share ----------------------------------
def branch_rid(group: str, branch: int, turn: int = 0) -> str:
    """Rid of branch `branch`'s `turn`-th request in `group` (abort prefix of the group: f"{group}/")."""
    if not group:
        raise ValueError("group must be a non-empty string")
    if branch < 0 or turn < 0:
        raise ValueError(f"branch and turn must be >= 0, got {branch}, {turn}")
    return f"{group}/b{branch}/{turn}"


def _root(value: object) -> str | None:
    if not isinstance(value, str) or not value:
        return None
    return value.split("/", 1)[0][:MAX_KEY_CHARS] or None


def affinity_key(custom_params: object, routing_key: object = None) -> str | None:
    """The key that keeps a request with its phase, or None (the configured method places it).
    Total over client input: anything malformed is None here; the scheduler rejects bad stamps."""
    if isinstance(custom_params, dict):
        meta = custom_params.get(KEY)
        if isinstance(meta, dict) and (key := _root(meta.get("phase"))) is not None:
            return key
    return _root(routing_key)


def stamp(sampling_params: dict[str, Any] | None, **fields: Any) -> dict[str, Any]:
    """Return sampling_params with custom_params.branchwise updated (clients use this)."""
    params = dict(sampling_params or {})
    parse(params.get("custom_params"))  # a malformed existing stamp fails here with the field's name
    custom = dict(params.get("custom_params") or {})
    custom[KEY] = {**(custom.get(KEY) or {}),
                   **{key: value for key, value in fields.items() if value is not None}}
    parse(custom)  # fail on the client, not in the scheduler
    params["custom_params"] = custom
    return params
