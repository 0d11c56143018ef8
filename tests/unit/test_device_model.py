"""The emulated device's model (device_model.py): presets, T_device, padding, the stream, overruns."""

from __future__ import annotations

import argparse
import json
from types import SimpleNamespace

import pytest

from branchwise import config
from branchwise.device_model import (
    Composition,
    DeviceEvent,
    DeviceSpecError,
    DeviceStream,
    from_dict,
    parse_spec,
    preset_names,
)
from branchwise.emulated_device import composition
from branchwise.taper.predictor import default_model

GOOD = {"name": "test", "floor_ms": 10.0, "per_row_ms": 1.0, "per_context_token_us": 2.0,
        "per_prefill_token_us": 5.0, "graph_batch_sizes": [1, 2, 4, 8], "source": "made up for tests"}


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def stream_of(doc: dict | None = None) -> tuple[DeviceStream, FakeClock]:
    clock = FakeClock()
    return DeviceStream(from_dict(doc or GOOD), clock=clock, sleep=clock.sleep), clock


def test_the_a100_preset_is_the_simulators_default_model():
    preset = parse_spec("a100-qwen3-32b-tp8")
    assert (preset.floor_s, preset.row_s, preset.context_token_s, preset.prefill_token_s) == \
        pytest.approx(default_model().coefs(), rel=1e-12)
    assert preset.graph_batch_sizes[:6] == (1, 2, 4, 8, 12, 16) and preset.graph_batch_sizes[-1] == 512


def test_every_shipped_preset_loads_and_cites_sources():
    names = preset_names()
    assert {"a100-qwen3-32b-tp8", "h100-llama3.1-8b"} <= set(names)
    for name in names:
        preset = parse_spec(name)
        assert preset.name == name and preset.source and preset.time_scale == 1.0


def test_t_device_pads_decode_rows_to_the_next_graph_size():
    preset = from_dict(GOOD)
    # 3 rows replay the 4-row graph: 10 + 4 x 1 ms + 100 tokens x 2 us
    assert preset.t_device(Composition(decode_rows=3, context_tokens=100)) == pytest.approx(14.2e-3)
    assert preset.t_device(Composition(decode_rows=4, context_tokens=100)) == pytest.approx(14.2e-3)
    assert preset.t_device(Composition(decode_rows=5, context_tokens=0)) == pytest.approx(18e-3)
    # past the largest captured size the forward runs eagerly: no padding
    assert preset.t_device(Composition(decode_rows=9)) == pytest.approx(19e-3)
    assert preset.padded_rows(9) == 9 and from_dict(GOOD | {"graph_batch_sizes": []}).padded_rows(3) == 3


def test_prefill_and_mixed_forwards_are_not_padded():
    preset = from_dict(GOOD)
    # 3 prompts of 100 new tokens: 10 + 3 x 1 + 300 x 5 us
    assert preset.t_device(Composition(prefill_rows=3, prefill_tokens=300)) == pytest.approx(14.5e-3)
    mixed = Composition(decode_rows=2, context_tokens=50, prefill_rows=1, prefill_tokens=20)
    assert preset.t_device(mixed) == pytest.approx((10 + 3 + 0.1 + 0.1) * 1e-3)


def test_time_scale_from_the_file_and_the_flag_multiply(tmp_path):
    path = tmp_path / "dev.json"
    path.write_text(json.dumps(GOOD | {"time_scale": 2}))
    comp = Composition(decode_rows=1)
    base = from_dict(GOOD).t_device(comp)
    assert parse_spec(str(path)).t_device(comp) == pytest.approx(2 * base)
    scaled = parse_spec(f"{path}@x5")
    assert scaled.t_device(comp) == pytest.approx(10 * base) and scaled.label() == "test@x10"
    assert parse_spec("a100-qwen3-32b-tp8@x10").time_scale == 10


def test_the_stream_runs_forwards_in_order():
    stream, clock = stream_of()
    one = stream.launch(Composition(decode_rows=1), 0.0)  # 10 + 1 ms
    two = stream.launch(Composition(decode_rows=1), 0.002)  # launched while one runs: starts after it
    assert (one.start_s, one.done_s) == pytest.approx((0.0, 0.011))
    assert (two.start_s, two.done_s) == pytest.approx((0.011, 0.022))
    three = stream.launch(Composition(decode_rows=1), 0.050)  # the device was idle: starts at launch
    assert (three.start_s, three.done_s) == pytest.approx((0.050, 0.061))
    assert stream.stats.forwards == 3 and stream.stats.modeled_s == pytest.approx(0.033)


def test_a_computation_past_the_modeled_completion_is_an_overrun():
    stream, clock = stream_of()
    fwd = stream.launch(Composition(decode_rows=1), 0.0)
    stream.computed(fwd, 0.011)  # exactly on time is in time
    late = stream.launch(Composition(decode_rows=1), 0.011)
    stream.computed(late, 0.0250)  # done at 0.022: 3 ms late
    worse = stream.launch(Composition(decode_rows=1), 0.025)
    stream.computed(worse, 0.0400)  # done at 0.036: 4 ms late
    rep = stream.report()
    assert (rep["forwards"], rep["overruns"], rep["overrun_ms_max"]) == (3, 2, pytest.approx(4.0))
    assert rep["preset"] == "test" and rep["compute_ms_max"] == pytest.approx(15.0)
    assert rep["compute_ms"] == pytest.approx(11.0 + 14.0 + 15.0)


def test_sglangs_warm_up_request_is_counted_apart():
    """The first batch's requests (SGLang's warm-up, before the server reports ready) are counted in
    `warmup`: a fresh process's first forward overruns there, not in the served forwards."""
    stream, _clock = stream_of()
    assert stream.in_warmup(["warm"]) and stream.in_warmup(["warm"])  # its prefill, then its decode steps
    first = stream.launch(Composition(prefill_rows=1, prefill_tokens=6), 0.0, kind="extend", warmup=True)
    stream.computed(first, 0.300)  # done at 0.01103: 288.97 ms late
    assert not stream.in_warmup(["warm", "a"]) and not stream.in_warmup(["warm"])  # over for good
    served = stream.launch(Composition(decode_rows=1), 1.0)
    stream.computed(served, 1.005)
    rep = stream.report()
    assert (rep["forwards"], rep["overruns"], rep["compute_ms_max"]) == (1, 0, pytest.approx(5.0))
    assert rep["warmup"] == {"forwards": 1, "overruns": 1, "overrun_ms_max": pytest.approx(288.97),
                             "compute_ms_max": pytest.approx(300.0)}
    skipped = DeviceStream(stream.preset, warmup_rids=None)  # --skip-server-warmup: no warm-up request
    assert not skipped.in_warmup(["a"])


def test_exposed_time_is_the_device_idle_between_forwards_while_requests_run():
    """A pipelined clock: forward 2 launches before 1 completes (hidden), forward 3 launches 4 ms after
    2 completes (exposed), forward 4 is an idle server's first prefill (not the scheduler's)."""
    stream, _clock = stream_of()  # T_device of one decode row: 11 ms
    stream.launch(Composition(decode_rows=1), 0.0, running=True)  # nothing before it: not counted
    stream.launch(Composition(decode_rows=1), 0.005, running=True)  # done at 0.011: no idle
    stream.launch(Composition(decode_rows=1), 0.026, running=True)  # previous done at 0.022: 4 ms idle
    stream.launch(Composition(prefill_rows=1, prefill_tokens=4), 1.0, kind="extend", running=False)
    rep = stream.report()
    assert (rep["idle_ms"], rep["idle_steps"]) == (pytest.approx(4.0), 2)


def test_the_event_is_done_at_the_modeled_completion():
    stream, clock = stream_of()
    inner = SimpleNamespace(synced=0, synchronize=lambda: setattr(inner, "synced", inner.synced + 1),
                            query=lambda: True, recorded=0,
                            record=lambda *a: setattr(inner, "recorded", inner.recorded + 1))
    fwd = stream.launch(Composition(decode_rows=1), 0.0)
    event = DeviceEvent(stream, fwd, inner)
    event.record()  # a copy issued after launch (delayed sampling) records SGLang's own event
    assert inner.recorded == 1
    clock.now = 0.004
    assert not event.query()
    event.synchronize()
    assert clock.now == pytest.approx(0.011) and clock.slept == [pytest.approx(0.007)] and inner.synced == 1
    assert event.query()
    event.synchronize()  # a second wait does not sleep again
    assert len(clock.slept) == 1 and stream.report()["waited_ms"] == pytest.approx(7.0)


def test_an_event_after_its_completion_does_not_wait():
    stream, clock = stream_of()
    fwd = stream.launch(Composition(decode_rows=1), 0.0)
    clock.now = 1.0
    DeviceEvent(stream, fwd).synchronize()
    assert clock.slept == []


@pytest.mark.parametrize("change,needle", [
    ({"floor_ms": None}, "missing keys ['floor_ms']"),
    ({"floor_us": 3}, "unknown keys ['floor_us']"),
    ({"floor_ms": 0}, "floor_ms must be > 0"),
    ({"per_row_ms": -1}, "per_row_ms must be a finite number >= 0"),
    ({"per_row_ms": "1"}, "per_row_ms must be a finite number >= 0"),
    ({"graph_batch_sizes": [1, 4, 2]}, "strictly increasing"),
    ({"graph_batch_sizes": [0, 1]}, "strictly increasing"),
    ({"source": []}, "source must name where the figures come from"),
    ({"time_scale": 0}, "time_scale must be > 0"),
    ({"name": "a@b"}, "name must be a non-empty string"),
])
def test_bad_presets_say_what_is_wrong(change, needle):
    doc = {k: v for k, v in (GOOD | change).items() if v is not None}
    with pytest.raises(DeviceSpecError, match=needle.replace("[", r"\[").replace("]", r"\]")):
        from_dict(doc)


@pytest.mark.parametrize("spec,needle", [
    ("", "needs a preset name or a JSON file"),
    ("no-such-gpu", "neither a preset"),
    ("a100-qwen3-32b-tp8@10", "written @xS"),
    ("a100-qwen3-32b-tp8@xfast", "@x needs a number"),
    ("a100-qwen3-32b-tp8@x0", "finite number > 0"),
])
def test_bad_specs_fail_at_argument_parsing(spec, needle):
    with pytest.raises(argparse.ArgumentTypeError, match=needle):
        config.emulate_device_arg(spec)


def test_a_bad_file_fails_at_argument_parsing_with_its_path(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(argparse.ArgumentTypeError, match=f"device preset {bad} is not valid JSON"):
        config.emulate_device_arg(str(bad))
    bad.write_text(json.dumps(GOOD | {"per_row_ms": -2}))
    with pytest.raises(argparse.ArgumentTypeError, match=f"device preset {bad}: per_row_ms"):
        config.emulate_device_arg(str(bad))
    assert config.emulate_device_arg(" h100-llama3.1-8b@x4 ") == "h100-llama3.1-8b@x4"


def _mode(kind: str) -> SimpleNamespace:
    return SimpleNamespace(is_decode=lambda: kind == "decode", is_mixed=lambda: kind == "mixed",
                           is_extend=lambda: kind in ("extend", "mixed"))


def test_composition_reads_decode_extend_and_mixed_batches():
    import torch

    decode = SimpleNamespace(forward_mode=_mode("decode"), batch_size=lambda: 3,
                             seq_lens_cpu=torch.tensor([10, 20, 30]), reqs=[])
    assert composition(decode) == (Composition(decode_rows=3, context_tokens=60), "decode")
    extend = SimpleNamespace(forward_mode=_mode("extend"), prefix_lens=[0, 8], extend_lens=[44, 4])
    assert composition(extend) == (Composition(prefill_rows=2, prefill_tokens=48), "extend")
    # mix_with_running appends the running rows (prefix = seq_len - 1, extend 1) after the prefill rows
    mixed = SimpleNamespace(forward_mode=_mode("mixed"), prefix_lens=[0, 11, 29], extend_lens=[64, 1, 1],
                            mix_running_indices_cpu=torch.tensor([5, 6]))
    assert composition(mixed) == (Composition(decode_rows=2, context_tokens=42, prefill_rows=1,
                                              prefill_tokens=64), "mixed")
    assert composition(SimpleNamespace(forward_mode=_mode("idle"))) is None


@pytest.mark.parametrize("args,env,needle", [
    ({}, "1", "BRANCHWISE_FORWARD_THREAD=1"),
    ({"speculative_algorithm": "EAGLE"}, "", "speculative decoding"),
    ({"pp_size": 2}, "", "pipeline parallelism"),
    ({"disaggregation_mode": "prefill"}, "", "PD disaggregation"),
])
def test_unmodeled_modes_are_refused_at_start(monkeypatch, args, env, needle):
    from branchwise import emulated_device
    from branchwise.config import BranchwiseConfig

    monkeypatch.setenv("BRANCHWISE_FORWARD_THREAD", env)
    server_args = SimpleNamespace(**({"speculative_algorithm": None, "pp_size": 1, "disaggregation_mode": "null"}
                                     | args))
    scheduler = SimpleNamespace(server_args=server_args)
    cfg = BranchwiseConfig(async_output=True, emulate_device="a100-qwen3-32b-tp8")
    with pytest.raises(ValueError, match=f"--emulate-device does not run with .*{needle}"):
        emulated_device.build(scheduler, cfg)
    monkeypatch.setenv("BRANCHWISE_FORWARD_THREAD", "")
    if not args:  # the same server without the forward thread runs emulated
        assert emulated_device.build(scheduler, cfg).preset.name == "a100-qwen3-32b-tp8"
