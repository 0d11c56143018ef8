"""Flag parsers (what SGLang's argparse calls for Branchwise's flags) and the per-request bounds."""

from __future__ import annotations

import argparse
import json

import pytest

from branchwise import config
from branchwise.config import BranchwiseConfig
from branchwise.taper.predictor import LinearLatencyModel, default_model, model_from_json


@pytest.mark.parametrize("arg,text,value", [
    (config.fanout_arg, "16", 16), (config.fanout_arg, " 1 ", 1),
    (config.branch_tokens_arg, "auto", None), (config.branch_tokens_arg, "4096", 4096),
    (config.slo_arg, "25", 25.0),
])
def test_parsers_accept(arg, text, value):
    assert arg(text) == value


@pytest.mark.parametrize("arg,text,needle", [
    (config.fanout_arg, "0", "--branch-max-fanout must be an integer >= 1"),
    (config.fanout_arg, "2.5", "--branch-max-fanout must be an integer >= 1"),
    (config.branch_tokens_arg, "-3", "--branch-max-branch-tokens must be an integer >= 1"),
    (config.branch_tokens_arg, "lots", "--branch-max-branch-tokens must be an integer >= 1"),
    (config.slo_arg, "0", "> 0 ms"), (config.slo_arg, "inf", "> 0 ms"), (config.slo_arg, "nan", "> 0 ms"),
])
def test_parsers_reject_with_the_flag_named(arg, text, needle):
    with pytest.raises(argparse.ArgumentTypeError, match=needle):
        arg(text)


def test_latency_model_arg_reads_the_file(tmp_path):
    good = tmp_path / "model.json"
    default_model().save(good)  # what python -m bench.profile writes
    assert config.latency_model_arg(str(good)) == str(good)
    with pytest.raises(argparse.ArgumentTypeError, match="cannot read latency model"):
        config.latency_model_arg(str(tmp_path / "missing.json"))
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"c0": 0.01, "c_seq": 0.001, "c_ctx": 0, "slope": 2}))
    with pytest.raises(argparse.ArgumentTypeError, match=r"unknown linear latency model keys \['slope'\]"):
        config.latency_model_arg(str(bad))


def test_latency_model_units_are_honoured():
    secs = model_from_json({"c0": 0.014, "c_seq": 2.5e-4, "c_ctx": 1e-7, "c_tok": 4e-5})
    ms = model_from_json({"units": "ms", "c0": 14, "c_seq": 0.25, "c_ctx": 1e-4, "c_tok": 0.04})
    assert isinstance(ms, LinearLatencyModel)
    assert ms.coefs() == pytest.approx(secs.coefs(), rel=1e-12)
    const = model_from_json({"kind": "constant", "units": "milliseconds", "value_s": 20})
    assert const.value_s == pytest.approx(0.02)


@pytest.mark.parametrize("doc,needle", [
    ({"c0": 14, "c_seq": 0.25, "c_ctx": 1e-4}, '"units": "ms"'),  # milliseconds without units
    ({"units": "minutes", "c0": 0.01, "c_seq": 0, "c_ctx": 0}, "units must be one of"),
    ({"kind": "constant", "value_s": 0.01, "c_tok": 1e-5}, "unknown constant latency model keys"),
    ({"c0": 10 ** 400, "c_seq": 0, "c_ctx": 0}, "must be numbers"),
    ({"c0": float("nan"), "c_seq": 0, "c_ctx": 0}, "must be numbers"),
    ({"kind": ["linear"], "c0": 0.01}, "kind must be"),
])
def test_latency_model_rejects(doc, needle):
    with pytest.raises(ValueError, match=needle):
        model_from_json(doc)


def test_min_slo_defaults_to_half_the_default_and_bounds_requests():
    cfg = BranchwiseConfig(branch_slo_tpot_ms=50.0)
    assert cfg.min_slo_tpot_ms == 25.0
    assert cfg.slo_s(None) == pytest.approx(0.05)  # no SLO: the server's
    assert cfg.slo_s(0.001) == pytest.approx(0.025)  # too tight: the floor
    assert cfg.slo_s(80.0) == pytest.approx(0.08)  # looser: its own
    assert BranchwiseConfig(branch_min_slo_tpot_ms=5.0).slo_s(1.0) == pytest.approx(0.005)


def test_weights_are_bounded():
    assert [BranchwiseConfig.weight(w) for w in (-1.0, 0.0, 2.5, 1e300)] == [0.0, 0.0, 2.5, config.MAX_WEIGHT]


def test_client_grammar_policy():
    assert config.parse_grammar_clients("DENY") == "deny"
    with pytest.raises(ValueError, match="valid: allow, deny"):
        config.parse_grammar_clients("some")
    allow = BranchwiseConfig(branch_grammar="multiverse")
    deny = BranchwiseConfig(branch_grammar="multiverse", branch_grammar_clients="deny")
    assert allow.client_grammar_error("sprint") is None
    assert [deny.client_grammar_error(g) for g in (None, "none", "multiverse")] == [None] * 3
    assert "--branch-grammar-clients deny" in deny.client_grammar_error("sprint")


def test_validated_rejects_bad_values():
    for bad in ({"branch_max_fanout": 0}, {"branch_grammar_clients": "maybe"},
                {"branch_min_slo_tpot_ms": -1.0}, {"branch_max_branch_tokens": 0}):
        with pytest.raises(ValueError):
            BranchwiseConfig(**bad).validated()
    assert BranchwiseConfig().validated().branch_max_fanout == 16


@pytest.mark.parametrize("timer", [None, "1", "stock", "albireo"])
def test_runtime_parses_the_settings_once_and_builds_in_order(monkeypatch, timer):
    """runtime.build: one parse per scheduler, each component built once from that config, in a
    fixed order, each seeing the ones before it on scheduler.branchwise."""
    from types import SimpleNamespace

    from branchwise import runtime, scheduler_hook, step_timer
    from branchwise.albireo import async_output, forward_thread, sp_sampler_hook
    from branchwise.fork import hooks as fork
    from branchwise.ingress import dp_dispatch

    parsed: list[object] = []
    monkeypatch.setattr(BranchwiseConfig, "from_server_args",
                        classmethod(lambda cls, args: parsed.append(args) or cls()))
    if timer is None:
        monkeypatch.delenv(step_timer.ENV, raising=False)
    else:
        monkeypatch.setenv(step_timer.ENV, timer)
    order: list[str] = []
    fields = ("state", "fork", "dp", "async_output", "forward", "sampler", "timer")
    for field, module in zip(fields, (scheduler_hook, fork, dp_dispatch, async_output, forward_thread,
                                      sp_sampler_hook, step_timer), strict=True):
        def fake(sched, cfg, field=field):
            bw = sched.branchwise
            assert cfg is bw.config
            assert all(getattr(bw, f) == f for f in order)  # the earlier ones are in place
            order.append(field)
            return field
        monkeypatch.setattr(module, "build", fake)
    sched = SimpleNamespace(server_args=object())
    runtime.after_scheduler_init(None, sched)
    assert parsed == [sched.server_args]
    expected = {None: fields[:6], "1": fields, "albireo": fields[3:], "stock": fields[6:]}[timer]
    assert tuple(order) == expected
    assert all(getattr(sched.branchwise, f) == (f if f in expected else None) for f in fields)
