"""Reporting for every bench CLI (simulate, replay, capacity): number cells, column tables, JSON files.

A table is a list of `Col`s over a {name: metrics dict} mapping: a left-aligned name column, then
right-aligned cells, a dashed rule under the header. Every table puts attainment over all arrivals,
finished fraction and P99 TTFT side by side (`HEADLINE`), and end-to-end latency per request class
(`LATENCY_COLS`). Result files are written atomically, so
an interrupted run never leaves a truncated file.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any


def fmt(x: float | None, pct: bool = False, nd: int = 1) -> str:
    """A number cell: '-' for a missing or non-finite value, a percentage with `pct`."""
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "-"
    return f"{100 * x:.{nd}f}%" if pct else f"{x:.{nd}f}"


def num(x: float | None) -> str:
    """A number cell with one decimal below 100 and none above (latencies in ms, TTFT in s)."""
    return fmt(x, nd=1 if x is None or abs(x) < 100 else 0)


@dataclass(frozen=True, slots=True)
class Col:
    """One right-aligned column: its title (and an optional second header line) and its cell."""

    title: str
    width: int
    cell: Callable[[str, dict], str]  # (row name, row's dict) -> text
    sub: str = ""


def key(name: str, pct: bool = False, nd: int = 1) -> Callable[[str, dict], str]:
    """The cell of one metric of the row's dict."""
    return lambda _k, r: fmt(r.get(name), pct, nd)


def blank(width: int) -> Col:
    return Col("", width, lambda _k, _r: "")


HEADLINE = (
    Col("attain", 8, key("slo_attainment", True)),
    Col("finished", 9, key("finished_frac", True)),
    Col("P99 TTFT", 9, lambda _k, r: fmt(r.get("ttft_p99_s"), nd=2 if (r.get("ttft_p99_s") or 0) < 100 else 0)),
)


LATENCY_COLS = (  # seconds, over finished requests of the class; decomposable: with a parallel phase
    Col("dP50 e2e", 9, key("decomp_e2e_p50_s")),
    Col("dP99 e2e", 9, lambda _k, r: num(r.get("decomp_e2e_p99_s"))),
    Col("d fin", 7, key("decomp_finished_frac", True, 0)),
    Col("sP50 e2e", 9, key("serial_e2e_p50_s")),
)


def render(rows: Mapping[str, dict], cols: Sequence[Col], name: str = "policy", name_width: int = 10) -> str:
    head = f"{name:<{name_width}}" + "".join(f"{c.title:>{c.width}}" for c in cols)
    lines = [head]
    if any(c.sub for c in cols):
        lines.append(f"{'':<{name_width}}" + "".join(f"{c.sub:>{c.width}}" for c in cols))
    lines.append("-" * len(head))
    for k, r in rows.items():
        lines.append(f"{k:<{name_width}}" + "".join(f"{c.cell(k, r):>{c.width}}" for c in cols))
    return "\n".join(lines)


def write_json(path: Path, doc: Any, **dumps: Any) -> Path:
    """Write `doc` as JSON through a temporary file: a Ctrl-C mid-write never leaves a truncated file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(doc, **dumps))
    tmp.replace(path)
    return path
