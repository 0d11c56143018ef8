"""The emulated device's model: presets, a forward's modeled time, one in-order stream, overruns.

No SGLang import (emulated_device.py is the glue). T_device and the spec: docs/design/emulated-device.md.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

PRESET_DIR = Path(__file__).resolve().parent / "devices"
_REQUIRED = ("name", "floor_ms", "per_row_ms", "per_context_token_us", "per_prefill_token_us",
             "graph_batch_sizes", "source")
_OPTIONAL = ("description", "time_scale", "notes")


class DeviceSpecError(ValueError):
    """A bad --emulate-device value or preset file (the message says which and why)."""


@dataclass(frozen=True, slots=True)
class DevicePreset:
    """One device's step model, in seconds; `time_scale` already multiplies every T_device."""

    name: str
    floor_s: float
    row_s: float
    context_token_s: float
    prefill_token_s: float
    graph_batch_sizes: tuple[int, ...]
    time_scale: float = 1.0
    source: tuple[str, ...] = ()

    def padded_rows(self, rows: int) -> int:
        """The captured graph size a decode batch of `rows` replays at (itself past the largest)."""
        for size in self.graph_batch_sizes:
            if size >= rows:
                return size
        return rows

    def t_device(self, comp: Composition) -> float:
        """Seconds the device spends on one forward of this composition."""
        rows = comp.decode_rows + comp.prefill_rows
        if comp.prefill_rows == 0:
            rows = self.padded_rows(rows)
        raw = (self.floor_s + self.row_s * rows + self.context_token_s * comp.context_tokens
               + self.prefill_token_s * comp.prefill_tokens)
        return self.time_scale * raw

    def label(self) -> str:
        return self.name if self.time_scale == 1.0 else f"{self.name}@x{self.time_scale:g}"


@dataclass(frozen=True, slots=True)
class Composition:
    """What one forward holds: decoding rows with KV lengths, extending rows with their new tokens."""

    decode_rows: int = 0
    context_tokens: int = 0
    prefill_rows: int = 0
    prefill_tokens: int = 0


def preset_names() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.json"))


def parse_spec(spec: str) -> DevicePreset:
    """`NAME[@xS]` or `PATH[@xS]` -> the preset, read and checked (DeviceSpecError says what is wrong)."""
    text = str(spec).strip()
    if not text:
        raise DeviceSpecError(f"--emulate-device needs a preset name or a JSON file; presets: "
                              f"{', '.join(preset_names())}")
    base, scale = _split_scale(text)
    path = _resolve(base)
    preset = load_file(path)
    if scale != 1.0:
        preset = _scaled(preset, scale)
    return preset


def _split_scale(text: str) -> tuple[str, float]:
    base, sep, tail = text.rpartition("@")
    if not sep:
        return text, 1.0
    if not tail.startswith("x"):
        raise DeviceSpecError(f"--emulate-device {text!r}: a time scale is written @xS (e.g. @x10), got @{tail}")
    try:
        scale = float(tail[1:])
    except ValueError:
        raise DeviceSpecError(f"--emulate-device {text!r}: @x needs a number, got {tail[1:]!r}") from None
    if not (math.isfinite(scale) and scale > 0):
        raise DeviceSpecError(f"--emulate-device {text!r}: the time scale must be a finite number > 0")
    return base, scale


def _resolve(base: str) -> Path:
    named = PRESET_DIR / f"{base}.json"
    if "/" not in base and not base.endswith(".json") and named.is_file():
        return named
    path = Path(base)
    if path.is_file():
        return path
    raise DeviceSpecError(f"--emulate-device {base!r} is neither a preset ({', '.join(preset_names())}) "
                          "nor a readable JSON file")


def load_file(path: Path) -> DevicePreset:
    try:
        doc = json.loads(path.read_text())
    except OSError as err:
        raise DeviceSpecError(f"cannot read device preset {path}: {err}") from None
    except json.JSONDecodeError as err:
        raise DeviceSpecError(f"device preset {path} is not valid JSON: {err}") from None
    try:
        return from_dict(doc)
    except DeviceSpecError as err:
        raise DeviceSpecError(f"device preset {path}: {err}") from None


def from_dict(doc: Any) -> DevicePreset:
    """A preset from its JSON object; every key checked, unknown keys refused (a typo is not a 0)."""
    if not isinstance(doc, dict):
        raise DeviceSpecError("a preset is a JSON object")
    missing = [k for k in _REQUIRED if k not in doc]
    unknown = sorted(set(doc) - set(_REQUIRED) - set(_OPTIONAL))
    if missing:
        raise DeviceSpecError(f"missing keys {missing}")
    if unknown:
        raise DeviceSpecError(f"unknown keys {unknown}; valid: {sorted(_REQUIRED + _OPTIONAL)}")
    name = doc["name"]
    if not isinstance(name, str) or not name.strip() or "@" in name:
        raise DeviceSpecError(f"name must be a non-empty string without '@', got {name!r}")
    floor_ms = _number(doc, "floor_ms")
    if floor_ms <= 0:
        raise DeviceSpecError(f"floor_ms must be > 0, got {floor_ms!r}")
    scale = _number(doc, "time_scale") if "time_scale" in doc else 1.0
    if scale <= 0:
        raise DeviceSpecError(f"time_scale must be > 0, got {scale!r}")
    return DevicePreset(name=name.strip(), floor_s=floor_ms * 1e-3, row_s=_number(doc, "per_row_ms") * 1e-3,
                        context_token_s=_number(doc, "per_context_token_us") * 1e-6,
                        prefill_token_s=_number(doc, "per_prefill_token_us") * 1e-6,
                        graph_batch_sizes=_sizes(doc["graph_batch_sizes"]), time_scale=scale,
                        source=_sources(doc["source"]))


def _number(doc: dict[str, Any], key: str) -> float:
    value = doc[key]
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        raise DeviceSpecError(f"{key} must be a finite number >= 0, got {value!r}")
    return float(value)


def _sizes(value: Any) -> tuple[int, ...]:
    ok = isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) and v >= 1
                                         for v in value)
    if not ok or any(b <= a for a, b in zip(value, value[1:], strict=False)):
        raise DeviceSpecError(f"graph_batch_sizes must be a strictly increasing list of integers >= 1 "
                              f"([] for no graphs), got {value!r}")
    return tuple(value)


def _sources(value: Any) -> tuple[str, ...]:
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not items or not all(isinstance(s, str) and s.strip() for s in items):
        raise DeviceSpecError("source must name where the figures come from (a string or a non-empty "
                              "list of strings)")
    return tuple(items)


def _scaled(preset: DevicePreset, scale: float) -> DevicePreset:
    from dataclasses import replace

    return replace(preset, time_scale=preset.time_scale * scale)


@dataclass(slots=True)
class Forward:
    """One launched forward on the emulated stream (perf_counter seconds)."""

    launch_s: float
    start_s: float
    done_s: float  # its modeled completion: SGLang sees its result no earlier
    modeled_s: float
    compute_end_s: float | None = None  # when the real computation of its tokens ended
    warmup: bool = False


@dataclass(slots=True)
class DeviceStats:
    forwards: int = 0
    decode: int = 0
    extend: int = 0
    mixed: int = 0
    overruns: int = 0  # forwards whose real computation ended after their modeled completion
    overrun_s_max: float = 0.0
    modeled_s: float = 0.0  # sum of T_device over forwards
    waited_s: float = 0.0  # time the scheduler spent waiting for modeled completions
    compute_s: float = 0.0  # sum of the real computations (launch to end)
    compute_s_max: float = 0.0  # longest real computation
    # exposed scheduler time: the device idle between a forward's completion and the next launch,
    # summed over the forwards launched while requests were running (idle_steps of them)
    idle_s: float = 0.0
    idle_steps: int = 0


@dataclass(slots=True)
class DeviceStream:
    """The emulated device: one in-order stream of forwards, and its overrun accounting."""

    preset: DevicePreset
    clock: Callable[[], float] = time.perf_counter
    sleep: Callable[[float], None] = time.sleep
    stats: DeviceStats = field(default_factory=DeviceStats)
    done_s: float = -math.inf  # the previous forward's modeled completion
    warmup: DeviceStats = field(default_factory=DeviceStats)
    warmup_rids: frozenset[str] | None = frozenset()  # empty: not seen yet; None: over, or no warm-up

    def in_warmup(self, rids: Iterable[str]) -> bool:
        """Whether these requests are SGLang's warm-up (the first batch's, until a batch holds another)."""
        if self.warmup_rids is None:
            return False
        mine = frozenset(rids)
        if not self.warmup_rids:
            self.warmup_rids = mine
        elif not mine <= self.warmup_rids:
            self.warmup_rids = None
            return False
        return True

    def launch(self, comp: Composition, launch_s: float | None = None, kind: str = "decode",
               running: bool = False, warmup: bool = False) -> Forward:
        """Queue a forward launched now (or at `launch_s`); `running`: idle time since counts as exposed."""
        now = self.clock() if launch_s is None else launch_s
        modeled = self.preset.t_device(comp)
        st = self.warmup if warmup else self.stats
        if running and math.isfinite(self.done_s):
            st.idle_s += max(0.0, now - self.done_s)
            st.idle_steps += 1
        start = max(now, self.done_s)
        fwd = Forward(launch_s=now, start_s=start, done_s=start + modeled, modeled_s=modeled, warmup=warmup)
        self.done_s = fwd.done_s
        st.forwards += 1
        st.modeled_s += modeled
        if kind in ("decode", "extend", "mixed"):
            setattr(st, kind, getattr(st, kind) + 1)
        return fwd

    def computed(self, fwd: Forward, end_s: float | None = None) -> None:
        """The real computation of `fwd` ended (now, or at `end_s`): an overrun if past its completion."""
        end = self.clock() if end_s is None else end_s
        fwd.compute_end_s = end
        st = self.warmup if fwd.warmup else self.stats
        st.compute_s += end - fwd.launch_s
        st.compute_s_max = max(st.compute_s_max, end - fwd.launch_s)
        late = end - fwd.done_s
        if late > 0:
            st.overruns += 1
            st.overrun_s_max = max(st.overrun_s_max, late)

    def wait(self, fwd: Forward) -> None:
        """Block until `fwd`'s modeled completion (the scheduler's view of the device)."""
        left = fwd.done_s - self.clock()
        if left > 0:
            self.sleep(left)
            (self.warmup if fwd.warmup else self.stats).waited_s += left

    def report(self) -> dict[str, Any]:
        st = self.stats
        return {"preset": self.preset.name, "time_scale": self.preset.time_scale,
                "forwards": st.forwards, "overruns": st.overruns,
                "overrun_ms_max": round(1e3 * st.overrun_s_max, 3),
                "decode": st.decode, "extend": st.extend, "mixed": st.mixed,
                "modeled_ms": round(1e3 * st.modeled_s, 3), "waited_ms": round(1e3 * st.waited_s, 3),
                "compute_ms": round(1e3 * st.compute_s, 3), "compute_ms_max": round(1e3 * st.compute_s_max, 3),
                "idle_ms": round(1e3 * st.idle_s, 3), "idle_steps": st.idle_steps,
                "warmup": {"forwards": self.warmup.forwards, "overruns": self.warmup.overruns,
                           "overrun_ms_max": round(1e3 * self.warmup.overrun_s_max, 3),
                           "compute_ms_max": round(1e3 * self.warmup.compute_s_max, 3)}}


class _Event(Protocol):
    def synchronize(self) -> None: ...

    def query(self) -> bool: ...


class DeviceEvent:
    """Drop-in for a result's `copy_done`: synchronize() waits SGLang's event, then the modeled end."""

    __slots__ = ("stream", "forward", "inner", "_waited")

    def __init__(self, stream: DeviceStream, forward: Forward, inner: _Event | None = None) -> None:
        self.stream, self.forward, self.inner = stream, forward, inner
        self._waited = False

    def record(self, stream: object = None) -> None:
        """A copy issued after launch (a grammar batch's delayed sampling) records SGLang's event."""
        if self.inner is not None and hasattr(self.inner, "record"):
            self.inner.record() if stream is None else self.inner.record(stream)

    def query(self) -> bool:
        inner_done = self.inner is None or self.inner.query()
        return inner_done and self.stream.clock() >= self.forward.done_s

    def synchronize(self) -> None:
        if self.inner is not None:
            self.inner.synchronize()
        if not self._waited:
            self._waited = True
            self.stream.wait(self.forward)

    def wait(self, stream: object = None) -> None:
        self.synchronize()

