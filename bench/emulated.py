"""Live benches on an emulated device (`--emulate-device PRESET|FILE[@xS]`, issue 36): the load
rule, a point's device counters and the validity rule. Pure but for `read_device`.

Load rule: the modeled device is what serves, so a sweep's operating point comes from the preset's
T(S) (its floor, per row, per context token and per prefill token, times its time scale), never
from a probe of the CPU: SLO = max(T(32 rows of 256 KV tokens), 2.5 x T(1 row)) (bench.probe's
auto rule) x --slo-scale, load 1.0 = the fluid bound at that SLO over the live client's contexts
(bench.live.live_bound_rps). The fluid bound ignores graph padding (a decode batch padded to its
captured size costs more), so it stays an upper bound.

Validity rule: a point reads the server's `emulated_device` counters before and after it; a point
whose real computation overran its modeled time in more than MAX_OVERRUN_FRAC of its forwards did
not run on the modeled device and is invalid: marked in the tables and JSON, and neither held nor
failed in the capacity and the verdicts (bench.capacity.hold_outcome: UNDECIDED).
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from branchwise.device_model import DevicePreset, parse_spec
from branchwise.taper.predictor import LinearLatencyModel

MAX_OVERRUN_FRAC = 0.01  # overruns in more than this share of a point's forwards: invalid
COUNTERS = ("forwards", "overruns", "idle_ms", "idle_steps", "modeled_ms", "compute_ms")
PREFIX = "device_"  # a point's keys: device_forwards, device_overruns, ...


def latency_model(preset: DevicePreset) -> LinearLatencyModel:
    """The preset's T(S) as the linear model the grid, the simulator and taper servers use, without
    graph sizes: the grid's bound leaves padding out (module docstring), a taper server takes the
    sizes from its device, the simulator's device regime from the preset."""
    scale = preset.time_scale
    return LinearLatencyModel(scale * preset.floor_s, scale * preset.row_s, scale * preset.context_token_s,
                              scale * preset.prefill_token_s)


def spec_model(spec: str) -> LinearLatencyModel:
    """`latency_model` of an --emulate-device value (DeviceSpecError, a ValueError, when bad)."""
    return latency_model(parse_spec(spec))


def point_window_s(spec: str | None, duration_s: float, drain_s: float) -> tuple[float, float]:
    """A point's arrival window and drain on a device slowed S times (`@xS`): both x S, since every
    request takes S times as long at S times fewer arrivals a second; the point keeps its requests
    and its drain still fits them. Unchanged without a device."""
    if spec is None:
        return duration_s, drain_s
    scale = parse_spec(spec).time_scale
    return duration_s * scale, drain_s * scale


def device_slo_s(model: LinearLatencyModel) -> float:
    """The load rule's SLO before any scale: bench.probe's auto rule on the preset's T(S)."""
    from bench.probe import Probe

    return Probe({}, model).auto_slo_s()


def read_device(url: str) -> dict[str, Any] | None:
    """The first scheduler's `emulated_device` counters (/server_info), None where the server has none
    or does not answer."""
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/server_info", timeout=30) as resp:
            states = json.loads(resp.read())["internal_states"]
    except Exception:  # noqa: BLE001 - no server or no such report: the point goes on without it
        return None
    return next((state["emulated_device"] for state in states if state.get("emulated_device")), None)


def device_delta(before: Mapping[str, Any] | None, after: Mapping[str, Any] | None) -> dict[str, Any]:
    """A point's counters (after less before, `PREFIX`ed keys); {} when either read is missing."""
    if not before or not after:
        return {}
    out = {PREFIX + name: after.get(name, 0) - before.get(name, 0) for name in COUNTERS}
    out[PREFIX + "preset"] = after.get("preset")
    return out


@dataclass(frozen=True, slots=True)
class Validity:
    """A point's overrun share, its exposed scheduler time per step and whether it counts."""

    overrun_frac: float | None
    exposed_ms_per_step: float | None
    valid: bool


def validity(forwards: float, overruns: float, idle_ms: float = 0.0, idle_steps: float = 0.0,
             max_frac: float = MAX_OVERRUN_FRAC) -> Validity:
    """Invalid when overruns > max_frac x forwards (a point with no forwards has nothing overrun)."""
    frac = overruns / forwards if forwards > 0 else None
    exposed = idle_ms / idle_steps if idle_steps > 0 else None
    return Validity(frac, exposed, overruns <= max_frac * forwards)


def mark(point: dict[str, Any]) -> dict[str, Any]:
    """`point` with `device_overrun_frac`, `device_exposed_ms_per_step` and `invalid` from its
    counters (pooled repeats: their means, so the shares are those of the sums); unchanged without
    counters (a server with no emulated device)."""
    if point.get(PREFIX + "forwards") is None:
        return point
    got = validity(*(float(point.get(PREFIX + name) or 0.0)
                     for name in ("forwards", "overruns", "idle_ms", "idle_steps")))
    return point | {PREFIX + "overrun_frac": got.overrun_frac,
                    PREFIX + "exposed_ms_per_step": got.exposed_ms_per_step, "invalid": not got.valid}


def seeds_point(points: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One rate's device figures over seeds (a capacity document's point): invalid if any seed's is,
    the shares of the summed counters; {} when no point has counters."""
    having = [point for point in points if point.get(PREFIX + "forwards") is not None]
    if not having:
        return {}
    sums = {name: sum(float(point.get(PREFIX + name) or 0.0) for point in having) for name in COUNTERS}
    got = validity(sums["forwards"], sums["overruns"], sums["idle_ms"], sums["idle_steps"])
    tputs = [float(point["raw_throughput_tok_s"]) for point in having
             if point.get("raw_throughput_tok_s") is not None]
    return {PREFIX + "overrun_frac": got.overrun_frac, PREFIX + "exposed_ms_per_step": got.exposed_ms_per_step,
            "invalid": any(point.get("invalid") for point in having),
            "raw_throughput_tok_s": sum(tputs) / len(tputs) if tputs else None}


def device_table(doc: Mapping[str, Any]) -> str:
    """Per policy and rate: overruns (% of forwards), exposed scheduler ms per step and raw throughput
    (tok/s); '!' marks an invalid point. '' when no point has device figures."""
    pols = doc["policies"]
    if not any(PREFIX + "overrun_frac" in point for entry in pols.values() for point in entry["points"]):
        return ""
    rates = [point["rate"] for point in next(iter(pols.values()))["points"]]

    def cell(point: Mapping[str, Any]) -> str:
        frac, exposed = point.get(PREFIX + "overrun_frac"), point.get(PREFIX + "exposed_ms_per_step")
        tput = point.get("raw_throughput_tok_s")
        text = (f"{'-' if frac is None else f'{100 * frac:.1f}%'} "
                f"{'-' if exposed is None else f'{exposed:.2f}'} {'-' if tput is None else f'{tput:.0f}'}")
        return text + ("!" if point.get("invalid") else "")

    head = "| policy | " + " | ".join(f"{rate:.3f} req/s" for rate in rates) + " |"
    rows = [f"| {policy} | " + " | ".join(cell(point) for point in entry["points"]) + " |"
            for policy, entry in pols.items()]
    return "\n".join([f"emulated device: overruns (% of forwards), exposed scheduler ms per step, raw "
                      f"throughput tok/s; !: invalid (overruns > {100 * MAX_OVERRUN_FRAC:g}% of forwards), "
                      "not counted in capacity or verdicts", head, "|---|" + "---|" * len(rates), *rows])
