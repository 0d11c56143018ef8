"""The isolation flags and --latency-model fail at argument parsing, before any model loads, under
every policy (the real `sglang.launch_server` parser with the patch series applied)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from branchwise.tools.launch import cpu_env


def launch_fails(model: str, args: list[str]) -> str:
    env = os.environ | cpu_env()
    out = subprocess.run([sys.executable, "-m", "sglang.launch_server", "--model-path", model, *args],
                         env=env, capture_output=True, text=True, timeout=180)
    assert out.returncode != 0
    assert "Load weight" not in out.stderr + out.stdout  # failed before any model was loaded
    return out.stderr


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("latency")
    ms = d / "ms.json"  # a profile written in milliseconds without saying so
    ms.write_text(json.dumps({"c0": 14, "c_seq": 0.25, "c_ctx": 1e-4}))
    extra = d / "extra.json"
    extra.write_text(json.dumps({"kind": "linear", "units": "seconds", "c0": 0.01, "c_seq": 1e-3,
                                 "c_ctx": 0, "intercept": 0.01}))
    return ms, extra


@pytest.mark.parametrize("case", ["fanout", "tokens", "clients", "ms_serial", "unknown_key_taper"])
def test_bad_values_fail_at_parse_time(tiny_model, models, case):
    ms, extra = models
    args, needle = {
        "fanout": (["--branch-max-fanout", "0"], "--branch-max-fanout must be an integer >= 1"),
        "tokens": (["--branch-max-branch-tokens", "many"], "--branch-max-branch-tokens must be an integer"),
        "clients": (["--branch-grammar-clients", "some"], "invalid choice: 'some'"),
        "ms_serial": (["--branch-policy", "serial", "--latency-model", str(ms)], '"units": "ms"'),
        "unknown_key_taper": (["--branch-policy", "taper", "--latency-model", str(extra)],
                              "unknown linear latency model keys ['intercept']"),
    }[case]
    assert needle in launch_fails(tiny_model, args)
