"""The simulator's prefill variants: `POLICY@N` (a fixed chunk of N tokens) and `taper-prefill[@N]`
(the chunk sized by the decoding requests' slack), their engines and the TTFT attainment figure.
A leaf: bench.capacity and bench.prefill both read it (bench.prefill's docstring has the names)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from bench.engine import EngineConfig
from branchwise.taper import LinearLatencyModel, parse_policy_name
from branchwise.taper.prefill_budget import PrefillRule, min_chunk_for

CHUNKS = (512, 1024, 2048, 4096, 8192)
BASELINES = tuple(f"{policy}@{chunk}" for policy in ("serial", "eager", "taper") for chunk in CHUNKS)
RULED = "taper-prefill"
TTFT_TARGET_S = 2.5  # the TTFT SLO of the tables and of the rule's TTFT clause (fixed before any result)
@dataclass(frozen=True, slots=True)
class Variant:
    """A --policies entry: the controller's policy, its chunk cap, and whether the rule sizes it."""

    policy: str
    chunk: int | None = None  # None: the engine's chunk_tokens
    ruled: bool = False


def parse_variant(name: str) -> Variant:
    """`POLICY`, `POLICY@N` or `taper-prefill[@N]` (ValueError on anything else)."""
    base, _, chunk_text = name.strip().partition("@")
    chunk = None
    if chunk_text:
        if not chunk_text.isdigit() or int(chunk_text) < 1:
            raise ValueError(f"{name!r}: the chunk after @ must be an integer >= 1")
        chunk = int(chunk_text)
    if base == RULED:
        return Variant("taper", chunk, True)
    return Variant(parse_policy_name(base), chunk)


def variant_name(name: str) -> str:
    """The canonical --policies name (parse_policy_name's for the base)."""
    var = parse_variant(name)
    base = RULED if var.ruled else var.policy
    return base if var.chunk is None else f"{base}@{var.chunk}"


def engine_for(cfg: EngineConfig, var: Variant, model: LinearLatencyModel, rho: float,
               ttft_target_s: float | None) -> EngineConfig:
    """The engine a variant runs on: its chunk cap, and the rule for taper-prefill."""
    chunk = var.chunk or cfg.chunk_tokens
    rule = None
    if var.ruled:
        rule = PrefillRule(chunk, min_chunk_for(cfg.slo_s, rho, model.c_tok, chunk), rho, ttft_target_s)
    return replace(cfg, chunk_tokens=chunk, prefill_rule=rule)


def ttft_attainment(ttft_s: np.ndarray, target_s: float) -> float | None:
    """Share of the window's arrivals whose first token came within target_s (never: a miss)."""
    if not len(ttft_s):
        return None
    return float(np.mean(np.nan_to_num(ttft_s, nan=np.inf) <= target_s * (1 + 1e-9)))
