"""Aborts at every point of a server-side fork's life, each driven deterministically.

One real server (the tiny model, Branchwise, --branch-policy eager: every ready row runs each step,
a schedule without clocks) started by SGLang's scripted runtime (sglang.test.scripted_runtime): the scripts in
fork_scripts.py run inside its scheduler, one step per scheduler iteration, so each abort reaches
the scheduler in the iteration the test chose, not after a sleep. Every case ends with the KV pool,
request rows and tree locks idle and every Branchwise map empty, without the idle leak check having
had to free anything; one case makes SGLang lose a branch on purpose and checks that the leak check
frees, logs and counts the orphan.

The scripted runtime's tree-core inspector needs SGLang's Rust sources, which a wheel does not ship,
so this server uses SGLang's Python TreeCore (same radix-cache interface as the bundled Rust one).
"""

from __future__ import annotations

import os
import urllib.request

import pytest

from bench.structure_driver import request, spec
from branchwise.tools.launch import cpu_env, has_gpu
from tests.integration import fork_scripts

POINTS = list(fork_scripts.POINTS)
HOW = ["parent", "branch", "dropped", "abort_all"]
FLAT = spec("multiverse", 3, [3, 40, 40], pre=6)  # one short branch, two long ones
NESTED = spec("multiverse", 2, [4, 30], nest=2, nest_n=2)  # every top-level path forks again


@pytest.fixture(scope="module")
def scripted(tiny_model):
    from sglang.test.scripted_runtime import http_server
    from sglang.test.scripted_runtime.http_server import ScriptedHttpServer

    kw = dict(model_path=tiny_model, branch_policy="eager", enable_custom_logit_processor=True, enable_metrics=True,
              kv_canary="none", kv_canary_real_data="none", kv_canary_sweep_interval=0)
    if not has_gpu():
        kw |= dict(device="cpu", attention_backend="torch_native", dtype="float32", max_total_tokens=16384)
    env = (cpu_env() if not has_gpu() else {}) | {"SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND": "python"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # the server process is spawned with this environment
    try:
        srv = ScriptedHttpServer.start(**kw)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    yield srv
    http_server.SHUTDOWN_JOIN_TIMEOUT_S = 5.0  # its scheduler exits at its next iteration, which never comes
    try:
        srv.shutdown()
    except AssertionError:
        pass  # the terminated server has no out-of-band error to report; a script's failure failed its test


@pytest.mark.parametrize("how", HOW)
@pytest.mark.parametrize("point", POINTS)
def test_abort_at_every_point_leaves_nothing(scripted, point, how):
    sj = NESTED if point.startswith("nested") else FLAT
    payload = request("the plan is", sj, grammar="multiverse", rid=f"lc-{point}-{how}", max_new_tokens=600)
    scripted.execute_script(fork_scripts.abort_at, args=(payload, point, how))


def test_idle_leak_check_frees_logs_and_counts_an_orphan(scripted):
    payload = request("the plan is", FLAT, grammar="multiverse", rid="lc-orphan", max_new_tokens=600)
    scripted.execute_script(fork_scripts.orphan, args=(payload,))
    with urllib.request.urlopen(scripted._base_url + "/metrics", timeout=30) as r:
        metrics = r.read().decode()
    series = [line for line in metrics.splitlines() if line.startswith("branchwise:orphans_freed")]
    assert any(line.split()[-1] == "1.0" for line in series), series
