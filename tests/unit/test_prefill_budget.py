"""The prefill budget rule (branchwise.taper.prefill_budget) and its simulator variants (bench.prefill)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from bench.engine import EngineConfig, Simulator, build_controller
from bench.prefill import long_prompt_trace
from bench.variants import BASELINES, CHUNKS, Variant, engine_for, parse_variant, variant_name
from bench.workload import RequestSpec, synthetic_trace
from branchwise.taper import LinearLatencyModel, default_model
from branchwise.taper.prefill_budget import (
    PrefillRule,
    PrefillStep,
    least_slack,
    min_chunk_for,
    prefill_tokens,
    stage_slack,
    ttft_due,
)

MODEL = LinearLatencyModel(c0=14e-3, c_seq=2.5e-4, c_ctx=1e-7, c_tok=4e-5)
RULE = PrefillRule(chunk_max=8192, min_chunk=250, rho=0.8, ttft_slo_s=2.5)


def test_the_chunk_fills_what_the_rows_leave_of_the_budget() -> None:
    slack = 0.2
    tokens = prefill_tokens(RULE, MODEL, PrefillStep(40, 80_000, slack))
    room = 0.8 * slack - MODEL.predict(40, 80_000)
    assert tokens == int(room / MODEL.c_tok)
    assert MODEL.predict(40, 80_000, tokens) <= 0.8 * slack + 1e-12 < MODEL.predict(40, 80_000, tokens + 1)


def test_the_floor_and_the_cap_bound_the_chunk() -> None:
    assert prefill_tokens(RULE, MODEL, PrefillStep(40, 80_000, -1.0)) == RULE.min_chunk  # behind pace: the floor
    assert prefill_tokens(RULE, MODEL, PrefillStep(40, 80_000, 0.001)) == RULE.min_chunk
    assert prefill_tokens(RULE, MODEL, PrefillStep(1, 0, 100.0)) == RULE.chunk_max  # a large bank: the cap


def test_nothing_to_protect_or_a_due_head_gets_the_whole_chunk() -> None:
    assert prefill_tokens(RULE, MODEL, PrefillStep(0, 0, least_slack([]))) == RULE.chunk_max
    assert prefill_tokens(RULE, MODEL, PrefillStep(40, 80_000, -1.0, due=True)) == RULE.chunk_max


def test_host_time_counts_against_the_budget() -> None:
    assert prefill_tokens(RULE, MODEL, PrefillStep(40, 80_000, 0.2, host_s=0.004)) == \
        prefill_tokens(RULE, MODEL, PrefillStep(40, 80_000, 0.2)) - 100


def test_min_chunk_fills_the_margin_rho_keeps() -> None:
    floor = min_chunk_for(0.050, 0.8, 4e-5, 8192)
    assert floor * 4e-5 <= 0.2 * 0.050 < (floor + 2) * 4e-5  # ~250 (the float product rounds down)
    assert min_chunk_for(0.050, 0.8, 4e-5, 128) == 128
    assert min_chunk_for(0.050, 0.8, 0.0, 8192) == 8192
    assert min_chunk_for(0.050, 1.0, 4e-5, 8192) == 1


def test_slack_and_ttft_clocks() -> None:
    assert stage_slack(0.05, 9, 0.4) == pytest.approx(0.1)
    assert least_slack([0.3, -0.1, 2.0]) == -0.1 and least_slack([]) == math.inf
    assert not ttft_due(None, 100.0, 1000, 4e-5)
    assert not ttft_due(2.5, 2.0, 1000, 4e-5)  # 2.0 + 0.04 < 2.5
    assert ttft_due(2.5, 2.47, 1000, 4e-5)


def test_variant_names() -> None:
    assert parse_variant("eager@512") == Variant("eager", 512)
    assert parse_variant("taper-prefill") == Variant("taper", None, True)
    assert parse_variant("taper") == Variant("taper")
    assert variant_name("taper-prefill@4096") == "taper-prefill@4096"
    assert len(BASELINES) == 3 * len(CHUNKS)
    for bad in ("eager@0", "eager@x", "nonsense@512"):
        with pytest.raises(ValueError):
            parse_variant(bad)


def test_stock_variants_carry_no_rule() -> None:
    cfg = EngineConfig()
    assert engine_for(cfg, parse_variant("taper"), MODEL, 0.8, 2.5) == cfg
    assert engine_for(cfg, parse_variant("serial@1024"), MODEL, 0.8, 2.5).chunk_tokens == 1024
    ruled = engine_for(cfg, parse_variant("taper-prefill"), MODEL, 0.8, 2.5).prefill_rule
    assert ruled == PrefillRule(8192, min_chunk_for(0.050, 0.8, 4e-5, 8192), 0.8, 2.5)


def _sim(specs: list[RequestSpec], rule: PrefillRule | None) -> Simulator:
    model = default_model()
    cfg = EngineConfig(chunk_tokens=8192, prefill_rule=rule)
    return Simulator(specs, build_controller("taper", model), model, cfg, 1e9)


def test_a_long_prompt_progresses_beside_a_tight_decode() -> None:
    """Decoding requests bound the chunk; the prompt still completes (the floor) and everything
    finishes with its tokens; the chunks stay within the floor and the cap."""
    decoding = [RequestSpec(f"d{i}", 0.0, 16, (2000,)) for i in range(200)]
    phased = [RequestSpec("p0", 0.0, 16, (4, (400, 400, 400, 400), 4))]
    long = [RequestSpec("long", 1.0, 12_000, (20,))]
    rule = PrefillRule(8192, 250, 0.8, None)
    sim = _sim(decoding + phased + long, rule)
    chunks: list[int] = []
    compose = sim._compose

    def spy():
        step = compose()
        chunks.append(step.chunk)
        return step
    sim._compose = spy
    res = sim.run()
    assert all(rec.finished for rec in res.records)
    by_rid = {rec.rid: rec for rec in res.records}
    assert by_rid["long"].output_tokens == 20
    carried = [chunk for chunk in chunks if chunk]
    assert carried[0] == 201 * 16  # nothing decodes yet: the opening prompts in one chunk
    long_chunks = carried[1:]  # the long prompt, sized by the decoding requests' slack
    assert sum(long_chunks) == 12_000
    assert all(rule.min_chunk <= chunk < rule.chunk_max for chunk in long_chunks[:-1])
    assert len(long_chunks) > 2  # smaller chunks than the fixed 8192


def test_no_rule_keeps_the_fixed_chunk() -> None:
    specs = [RequestSpec(f"r{i}", 0.01 * i, 3000, (50,)) for i in range(20)]
    ruled = _sim(specs, PrefillRule(8192, 8192, 0.8, None)).run()  # floor = cap: the fixed chunk again
    stock = _sim(specs, None).run()
    assert [rec.first_token_s for rec in ruled.records] == [rec.first_token_s for rec in stock.records]


def test_long_prompt_trace_has_the_published_median() -> None:
    base = synthetic_trace(600.0, 4.0, seed=3)
    trace = long_prompt_trace(base, seed=0)
    assert np.array_equal(trace.arrival_s, base.arrival_s)
    assert 1300 < np.median(trace.prompt_tokens) < 1700
    assert trace.prompt_tokens.min() >= 1 and trace.prompt_tokens.max() <= 16000


def test_points_report_reads_capacity_on_the_fixed_rates(tmp_path) -> None:
    import json

    from bench.prefill import points_report

    (tmp_path / "config.json").write_text(json.dumps({"fluid_bound_rps": 1.0, "ttft_target_s": 2.5,
                                                      "policies": "eager@512,taper-prefill"}))

    def point(policy: str, frac: float, att: float) -> dict:
        return {"policy": policy, "frac": frac, "seed": 0, "attainment": att, "queue_growth": 0.0,
                "ttft_attainment": 1.0, "ttft_p50_s": 0.1, "p99_ttft_s": 0.5, "decomp_e2e_p50_s": 40.0}
    pts = [point("eager@512", 0.7, 0.99), point("eager@512", 0.85, 0.90),
           point("taper-prefill", 0.7, 0.99), point("taper-prefill", 0.85, 0.97)]
    (tmp_path / "points.jsonl").write_text("\n".join(map(json.dumps, pts)))
    lines = points_report(tmp_path).splitlines()
    rows = {line.split()[0]: line.split()[1] for line in lines[4:6]}
    assert rows == {"eager@512": "0.700", "taper-prefill": "0.850"}
    assert lines[6] == "seed 0: PASS"
