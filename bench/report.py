"""Reporting for every bench CLI (simulate, replay, capacity): number cells, column tables, JSON files.

A table is a list of `Col`s over a {name: metrics dict} mapping: a left-aligned name column, then
right-aligned cells, a dashed rule under the header. Every table puts attainment over all arrivals,
finished fraction and P99 TTFT side by side (`HEADLINE`), and end-to-end latency per request class
(`LATENCY_COLS`). Result files are written atomically, so an interrupted run never leaves a
truncated file.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any


def fmt(value: float | None, pct: bool = False, nd: int = 1) -> str:
    """A number cell: '-' for a missing or non-finite value, a percentage with `pct`, `nd` decimals."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return f"{100 * value:.{nd}f}%" if pct else f"{value:.{nd}f}"


def num(value: float | None) -> str:
    """A number cell with one decimal below 100 and none above (latencies in ms, TTFT in s)."""
    return fmt(value, nd=1 if value is None or abs(value) < 100 else 0)


@dataclass(frozen=True, slots=True)
class Col:
    """One right-aligned column: its title (and an optional second header line) and its cell."""

    title: str
    width: int
    cell: Callable[[str, dict], str]  # (row name, row's dict) -> text
    sub: str = ""


def key(name: str, pct: bool = False, nd: int = 1) -> Callable[[str, dict], str]:
    """The cell of one metric of the row's dict."""
    return lambda _name, row: fmt(row.get(name), pct, nd)


def blank(width: int) -> Col:
    return Col("", width, lambda _name, _row: "")


def _ttft_cell(_name: str, row: dict) -> str:
    ttft = row.get("ttft_p99_s")
    return fmt(ttft, nd=2 if (ttft or 0) < 100 else 0)


HEADLINE = (
    Col("attain", 8, key("slo_attainment", True)),
    Col("finished", 9, key("finished_frac", True)),
    Col("P99 TTFT", 9, _ttft_cell),
)


LATENCY_COLS = (  # seconds, over finished requests of the class; decomposable: with a parallel phase
    Col("dP50 e2e", 9, key("decomp_e2e_p50_s")),
    Col("dP99 e2e", 9, lambda _name, row: num(row.get("decomp_e2e_p99_s"))),
    Col("d fin", 7, key("decomp_finished_frac", True, 0)),
    Col("sP50 e2e", 9, key("serial_e2e_p50_s")),
)


def render(rows: Mapping[str, dict], cols: Sequence[Col], name: str = "policy", name_width: int = 10) -> str:
    head = f"{name:<{name_width}}" + "".join(f"{col.title:>{col.width}}" for col in cols)
    lines = [head]
    if any(col.sub for col in cols):
        lines.append(f"{'':<{name_width}}" + "".join(f"{col.sub:>{col.width}}" for col in cols))
    lines.append("-" * len(head))
    for row_name, row in rows.items():
        cells = "".join(f"{col.cell(row_name, row):>{col.width}}" for col in cols)
        lines.append(f"{row_name:<{name_width}}" + cells)
    return "\n".join(lines)


def write_json(path: Path, doc: Any, **dumps: Any) -> Path:
    """Write `doc` as JSON through a temporary file: a Ctrl-C mid-write never leaves a truncated file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(doc, **dumps))
    tmp.replace(path)
    return path
