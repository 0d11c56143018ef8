"""--emulate-device in SGLang (overlap on, the default): the same greedy tokens, the modeled time honored,
TAPER's refit fed each step's modeled time.

Two servers from the pool: the default one (the reference, shared with other modules) and one under
a test preset whose 50 ms floor dwarfs the tiny model's few-ms forward, so every forward's result
must wait for its modeled completion; it runs taper-paper under an SLO no step meets, so phases
defer rows (serial requests are not affected). The timing check reads the server's own report: a
lone request's forwards run one after another on the emulated stream, so its wall time is at least
the sum of their modeled times, each at least the floor.
"""

from __future__ import annotations

import json
import time

import pytest

from branchwise.request_meta import stamp
from branchwise.tools.launch import branchwise_report, get_json, post_json

FLOOR_MS = 50.0
PRESET = {"name": "test-50ms", "floor_ms": FLOOR_MS, "per_row_ms": 1.0, "per_context_token_us": 0.0,
          "per_prefill_token_us": 0.0, "graph_batch_sizes": [1, 2, 4, 8], "source": "a test preset"}
PROMPTS = [f"request {i}: the plan is to" for i in range(4)]
# an SLO no step meets: taper-paper runs one row per phase in every step with a choice (test_taper.py)
TIGHT = ("--branch-policy", "taper-paper", "--branch-slo-tpot-ms", "2")
GREEDY = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def preset_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("device") / "test-50ms.json"
    path.write_text(json.dumps(PRESET))
    return str(path)


@pytest.fixture(scope="module")
def emulated(servers, preset_file):
    return servers.get("--emulate-device", preset_file, *TIGHT)


def device_report(url: str) -> dict:
    (state,) = get_json(url + "/server_info")["internal_states"]
    return state["emulated_device"]


def texts(url: str) -> list[str]:
    out = post_json(url + "/generate", {"text": PROMPTS, "sampling_params": GREEDY})
    return [item["text"] for item in out]


def test_greedy_outputs_are_the_same_with_and_without_the_emulated_device(servers, emulated):
    reference = servers.get()
    before = device_report(emulated.url)["forwards"]
    assert texts(emulated.url) == texts(reference.url)
    assert "emulated_device" not in get_json(reference.url + "/server_info")["internal_states"][0]
    assert device_report(emulated.url)["forwards"] > before


def test_grammar_outputs_are_the_same(servers, emulated):
    """A grammar batch samples later (SGLang's delayed sampling): its computation ends there."""
    regex = r"(yes|no), [a-z]{2,6}( [a-z]{2,6}){1,3}\."
    payload = {"text": PROMPTS[:2], "sampling_params": {"max_new_tokens": 32, "temperature": 0, "regex": regex}}
    got = [item["text"] for item in post_json(emulated.url + "/generate", payload)]
    assert got == [item["text"] for item in post_json(servers.get().url + "/generate", payload)]
    assert all(text.startswith(("yes, ", "no, ")) for text in got)


def test_each_forward_is_seen_no_earlier_than_its_modeled_completion(emulated):
    before = device_report(emulated.url)
    n = 12
    start = time.perf_counter()
    out = post_json(emulated.url + "/generate", {"text": "one request alone", "sampling_params":
                                                 {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}})
    wall_s = time.perf_counter() - start
    after = device_report(emulated.url)
    forwards = after["forwards"] - before["forwards"]
    modeled_s = (after["modeled_ms"] - before["modeled_ms"]) / 1e3
    assert out["meta_info"]["completion_tokens"] == n
    assert forwards >= n  # a prefill, then a decode step per further token
    assert modeled_s >= forwards * FLOOR_MS / 1e3
    assert wall_s >= modeled_s  # one in-order stream: the last result waits for every forward before it
    assert after["waited_ms"] > before["waited_ms"]  # the scheduler did wait on the device
    # every decode step was launched while the request ran: each is a step of the exposed-time figure
    assert after["idle_steps"] - before["idle_steps"] >= n - 1
    assert after["idle_ms"] >= before["idle_ms"]
    # a 50 ms floor fits the CPU's forward (the server's first forwards, its warm-up, may not: they
    # are counted apart, in "warmup")
    assert after["preset"] == "test-50ms" and after["overruns"] == before["overruns"], (before, after)


def test_a_bad_preset_fails_at_argument_parsing(tmp_path, capsys):
    """SGLang's own argument parsing (the patched ServerArgs) reads and checks the file, before a model loads."""
    from sglang.srt.server_args import prepare_server_args

    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(PRESET | {"floor_ms": -1}))
    with pytest.raises(SystemExit) as exit_info:
        prepare_server_args(["--model-path", "unused", "--emulate-device", str(bad)])
    assert exit_info.value.code == 2
    assert f"device preset {bad}: floor_ms must be a finite number >= 0" in capsys.readouterr().err
    args = prepare_server_args(["--model-path", "unused", "--emulate-device", "h100-llama3.1-8b@x4"])
    assert args.emulate_device == "h100-llama3.1-8b@x4"


def test_the_refit_recovers_the_preset_floor_and_per_row_cost(emulated):
    """Under a deferring load with overlap on, the refit takes each decode step's modeled time with
    that step's own rows (device_time.py), and T(S) pads rows to the preset's graph sizes: its fit
    is the preset's floor and per-row cost. Phases of different lengths finish one by one, so the
    rows per step sweep 12 down to 1 (both sides of the largest graph size, 8) over ~300 steps."""
    jobs = [(phase, branch) for phase in range(12) for branch in range(2)]
    sampling = [stamp({"max_new_tokens": 13 * (phase + 1), "temperature": 0, "ignore_eos": True},
                      phase=f"fit{phase}", branch=branch, fanout=2) for phase, branch in jobs]
    post_json(emulated.url + "/generate", {"text": [f"program {phase}: the plan then" for phase, _ in jobs],
                                           "rid": [f"fit{phase}/b{branch}" for phase, branch in jobs],
                                           "sampling_params": sampling})
    deadline = time.monotonic() + 30  # the last step launched may still be in flight: its result comes back
    while (rep := branchwise_report(emulated.url))["taper"]["refit"]["latency"]["pending"] and \
            time.monotonic() < deadline:
        time.sleep(0.1)
    taper, counters = rep["taper"], rep["counters"]
    refit = taper["refit"]
    assert refit["latency"] == {"source": "emulated", "pending": 0, "dropped": 0}
    assert refit["deferring_steps"] > 0 and counters.get("device_time_missing", 0) == 0
    assert taper["graph_batch_sizes"] == PRESET["graph_batch_sizes"]
    model = json.loads(taper["model"])
    assert model["c0"] == pytest.approx(FLOOR_MS / 1e3, rel=0.05), model
    assert model["c_seq"] == pytest.approx(PRESET["per_row_ms"] / 1e3, rel=0.05), model
