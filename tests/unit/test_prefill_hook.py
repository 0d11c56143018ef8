"""The prefill budget on the server (branchwise.prefill_hook, no SGLang): its opt-in, its refusal, the
chunk each prefill call gets, the least slack it reads, and SGLang's chunk restored after the call."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from bench.live import ServerSettings
from branchwise import config, request_meta
from branchwise import prefill_hook as ph
from branchwise.config import BranchwiseConfig
from branchwise.support import ServingModes, refusals
from branchwise.taper.controller import StepController
from branchwise.taper.policies import parse_policy
from branchwise.taper.predictor import LinearLatencyModel
from branchwise.taper.prefill_budget import PrefillStep, min_chunk_for, prefill_tokens

MODEL = LinearLatencyModel(c0=14e-3, c_seq=2.5e-4, c_ctx=1e-7, c_tok=4e-5)
CFG = BranchwiseConfig(branch_policy="taper", prefill_budget=True)
FLOOR = 249  # (1 - 0.8) x 50 ms / 40 us, rounded down in floating point


def budget(model: LinearLatencyModel = MODEL, **kw) -> ph.PrefillBudget:
    return ph.PrefillBudget(model=model, chunk_max=kw.pop("chunk_max", 4096), slo_s=0.05, rho=0.8, **kw)


def req(tokens: int, since_first_s: float, now: float = 100.0, phase: str | None = None,
        done: bool = False) -> SimpleNamespace:
    meta = request_meta.RequestMeta(phase=phase, branch=0, fanout=2) if phase else request_meta.SERIAL
    return SimpleNamespace(output_ids=[1] * tokens, finished=lambda: done, bw_meta=meta,
                           time_stats=SimpleNamespace(prefill_finished_time=now - since_first_s,
                                                      wait_queue_entry_time=now - since_first_s),
                           origin_input_ids=[1] * 1000, kv=SimpleNamespace(kv_committed_len=0))


# ----------------------------------------------------------------------------- the opt-in, refused
@pytest.mark.parametrize("env,want", [({}, (False, None)), ({config.PREFILL_ENV: "1"}, (True, None)),
                                      ({config.PREFILL_ENV: "off"}, (False, None)),
                                      ({config.PREFILL_ENV: "on", config.PREFILL_TTFT_ENV: "2.5"}, (True, 2.5))])
def test_the_environment_opts_in(env, want):
    got = config.prefill_settings(env)
    assert (got["prefill_budget"], got["prefill_ttft_s"]) == want


@pytest.mark.parametrize("env,needle", [({config.PREFILL_ENV: "maybe"}, "must be 1 .on. or 0 .off."),
                                        ({config.PREFILL_ENV: "1", config.PREFILL_TTFT_ENV: "-1"}, "> 0"),
                                        ({config.PREFILL_ENV: "1", config.PREFILL_TTFT_ENV: "soon"}, "> 0")])
def test_bad_values_are_refused(env, needle):
    with pytest.raises(ValueError, match=needle):
        config.prefill_settings(env)


def test_a_ttft_without_the_budget_is_refused():
    with pytest.raises(ValueError, match=f"needs {config.PREFILL_ENV}=1"):
        BranchwiseConfig(branch_policy="taper", prefill_ttft_s=2.0).validated()


@pytest.mark.parametrize("policy", ["stock", "serial", "eager", "taper-paper", "taper-no-mean", "taper"])
def test_only_taper_runs_the_budget(policy):
    got = refusals(BranchwiseConfig(branch_policy=policy, prefill_budget=True), ServingModes())
    if policy == "taper":
        assert got == []
        return
    assert len(got) == 1 and got[0].startswith("Branchwise: ") and f"--branch-policy {policy}:" in got[0]
    assert "Use --branch-policy taper" in got[0] and f"unset {config.PREFILL_ENV}" in got[0]
    assert refusals(BranchwiseConfig(branch_policy=policy), ServingModes()) == []


# ---------------------------------------------------------------------------------------- the rule
def test_the_chunk_is_the_simulators_rule_with_the_decode_step_after_it():
    plan = budget()
    rule = plan.rule()
    assert rule.min_chunk == min_chunk_for(0.05, 0.8, MODEL.c_tok, 4096) == FLOOR
    for slack in (-1.0, 0.0, 0.02, 0.05, 0.1, 10.0, math.inf):
        want = prefill_tokens(rule, MODEL, PrefillStep(8, 4000, slack, False, MODEL.c0))
        assert plan.chunk(8, 4000, slack, False) == want
    tokens = plan.chunk(8, 4000, 0.1, False)  # the chunk's forward, then the decode step, within the budget
    assert MODEL.c0 + MODEL.c_tok * tokens + MODEL.predict(8, 4000) <= 0.8 * 0.1 + 1e-12
    assert MODEL.c0 + MODEL.c_tok * (tokens + 1) + MODEL.predict(8, 4000) > 0.8 * 0.1
    assert plan.chunk(8, 4000, -1.0, False) == FLOOR and plan.chunk(0, 0, math.inf, False) == 4096
    assert plan.chunk(8, 4000, -1.0, True) == 4096  # the head is TTFT-due: SGLang's chunk


def test_a_model_without_a_prefill_price_uses_a_decode_rows():
    probed = LinearLatencyModel(c0=5e-3, c_seq=1e-4, c_ctx=0.0)  # bench.probe fits no c_tok
    plan = budget(probed)
    assert ph.PricedModel(probed).c_tok == probed.c_seq
    assert plan.rule().min_chunk == min_chunk_for(0.05, 0.8, 1e-4, 4096) > FLOOR / 3
    assert plan.chunk(0, 0, 0.05, False) == int((0.8 * 0.05 - 5e-3 - 5e-3) / 1e-4)


def test_the_floor_is_at_least_what_sglang_can_chunk():
    assert budget(align=64).rule().min_chunk == FLOOR
    assert budget(align=512).rule().min_chunk == 512
    assert budget(align=8192).rule().min_chunk == 4096


def test_the_report_counts_limited_floor_and_due_steps():
    plan = budget()
    for chunk, due, tokens in ((4096, False, 4096), (FLOOR, False, FLOOR), (900, False, 600), (4096, True, 4096)):
        plan.record(chunk, due, tokens)
    rep = plan.report()
    assert (rep["steps"], rep["limited_steps"], rep["floor_steps"], rep["due_steps"]) == (4, 2, 1, 1)
    assert rep["tokens_mean"] == pytest.approx((4096 * 2 + FLOOR + 600) / 4)
    assert rep["budget_mean"] == pytest.approx((4096 * 2 + FLOOR + 900) / 4)
    assert (rep["chunk_max"], rep["floor"], rep["c_tok_us"]) == (4096, FLOOR, pytest.approx(40.0))


def test_build_interleaves_decode_rounds_unless_sglang_was_told_how_many():
    ctl = StepController(parse_policy("taper", model=MODEL))
    sched = SimpleNamespace(chunked_prefill_size=2048, page_size=1, truncation_align_size=None,
                            prefill_decode_interval=0, prefill_decode_interval_min_bs=0)
    plan = ph.build(sched, CFG, ctl)
    assert (plan.chunk_max, plan.model, plan.interval) == (2048, ctl.policy.model, 1)
    assert (sched.prefill_decode_interval, sched.prefill_decode_interval_min_bs) == (1, 1)  # none running: no wait
    sched.prefill_decode_interval = 3
    assert ph.build(sched, CFG, ctl).interval == 3
    sched.chunked_prefill_size = None
    with pytest.raises(RuntimeError, match="--chunked-prefill-size"):
        ph.build(sched, CFG, ctl)


# ------------------------------------------------------------------------------------ the slack
def test_least_slack_reads_each_requests_stage_and_the_phase_clocks():
    ctl = StepController(parse_policy("taper", model=MODEL))
    now = (50.0, 100.0)
    serial = [req(11, 0.3), req(3, 0.05), req(1, 9.0, done=True)]  # 11 x 50 - 300 ms; 3 x 50 - 50 ms
    assert ph.least_slack(ctl, CFG, serial, 0, now) == pytest.approx(0.1)
    assert ph.least_slack(ctl, CFG, serial, 1, now) == pytest.approx(0.15)  # a decode step in flight
    branch = req(40, 0.01, phase="ph")
    branch.bw_row = SimpleNamespace(key="phase:ph")
    ctl._tracker("phase:ph", 0.05, True, 49.0)  # a phase clock 1 s old, no token yet: 50 ms - 1 s
    assert ph.least_slack(ctl, CFG, [*serial, branch], 0, now) == pytest.approx(-0.95)
    assert ph.least_slack(ctl, CFG, [], 0, now) == math.inf
    stamped = req(0, 0.0)
    stamped.bw_meta = request_meta.RequestMeta(slo_tpot_ms=200.0)
    stamped.time_stats.prefill_finished_time = 99.9  # its own SLO: 200 ms - 100 ms
    assert ph.least_slack(ctl, CFG, [stamped], 0, now) == pytest.approx(0.1)


def test_the_head_is_due_once_its_wait_and_prefill_reach_the_ttft_slo():
    plan = budget(ttft_s=2.0)
    head = req(0, 1.9)  # waited 1.9 s, 1000 tokens left at 40 us: 1.94 s
    sched = SimpleNamespace(chunked_req=None, waiting_queue=[head])
    assert not ph.head_due(plan, sched, 100.0)
    assert ph.head_due(plan, sched, 100.1)
    assert not ph.head_due(budget(), sched, 100.1)  # no TTFT SLO: the floor alone


# ------------------------------------------------------------------------------------- the hook
def scheduler(plan: ph.PrefillBudget | None, reqs: list) -> SimpleNamespace:
    ctl = StepController(parse_policy("taper", model=MODEL))
    state = SimpleNamespace(prefill=plan, controller=ctl, config=CFG, tp_rank=0, tp_size=1)
    return SimpleNamespace(branchwise=SimpleNamespace(state=state), chunked_prefill_size=4096,
                           waiting_queue=[req(0, 0.0)], chunked_req=None, running_batch=SimpleNamespace(reqs=reqs),
                           last_batch=None, enable_overlap=True)


def run(sched: SimpleNamespace, fail: bool = False) -> list[int]:
    seen: list[int] = []

    def orig(self, prefill_delayer_single_pass=None, running_batch=None):
        seen.append(self.chunked_prefill_size)
        if fail:
            raise RuntimeError("prefill failed")
        return SimpleNamespace(extend_num_tokens=min(self.chunked_prefill_size, 1000)), running_batch

    ph.around_get_new_batch_prefill_raw(orig, sched, prefill_delayer_single_pass=None,
                                        running_batch=sched.running_batch)
    return seen


def test_the_call_gets_the_rules_chunk_and_sglangs_is_restored():
    late = [req(2, 1.0)]  # far behind its pace: the floor
    plan = budget()
    sched = scheduler(plan, late)
    assert run(sched) == [FLOOR] and sched.chunked_prefill_size == 4096
    assert run(scheduler(plan, [])) == [4096]  # nothing decodes: the whole chunk
    assert (plan.steps, plan.limited_steps, plan.tokens) == (2, 1, FLOOR + 1000)
    with pytest.raises(RuntimeError):
        run(sched, fail=True)
    assert sched.chunked_prefill_size == 4096 and plan.steps == 2


def test_without_the_budget_or_a_pending_prefill_nothing_changes():
    assert run(scheduler(None, [req(2, 1.0)])) == [4096]
    plan = budget()
    idle = scheduler(plan, [req(2, 1.0)])
    idle.waiting_queue = []
    assert run(idle) == [4096] and plan.steps == 0


def test_a_rule_failure_gives_sglangs_chunk_and_is_counted():
    plan = budget()
    broken = SimpleNamespace(finished=lambda: False)  # no time stats: the slack cannot be read
    assert run(scheduler(plan, [broken])) == [4096]
    assert plan.errors == 1 and plan.steps == 1 and plan.limited_steps == 0


# ------------------------------------------------------------------------------ the bench variant
def test_a_sweep_variant_carries_the_opt_in_as_environment():
    settings = ServerSettings(variants={"taper-prefill": ("taper", f"{config.PREFILL_ENV}=1 --chunked-prefill-size 2048")})
    args = settings.args("taper-prefill", 20.0, None)
    assert args[:2] == ["--branch-policy", "taper"] and args[-2:] == ["--chunked-prefill-size", "2048"]
    assert not any(config.PREFILL_ENV in arg for arg in args)
    assert settings.env("taper-prefill") == {"OMP_NUM_THREADS": "1", config.PREFILL_ENV: "1"}
    assert settings.env("taper") == {"OMP_NUM_THREADS": "1"}
