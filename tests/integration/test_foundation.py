"""Foundation: flags, patch series, plugin inside the scheduler process, pass-through equality."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

from branchwise import patcher
from branchwise.tools.launch import branchwise_report, cpu_env, post_json, scheduler_states

PROMPTS = ["the plan is", "first compute the sum of", "check the cache prefix and then", "a b c d e f"]


def greedy(url: str, prompt: str, n: int = 24) -> list[int]:
    out = post_json(url + "/generate", {"text": prompt, "sampling_params": {
        "max_new_tokens": n, "temperature": 0, "ignore_eos": True}})
    return out["output_ids"]


def test_help_lists_branchwise_flags():
    env = os.environ | cpu_env()
    out = subprocess.run([sys.executable, "-m", "sglang.launch_server", "--help"], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0
    for flag in ("--branch-policy", "--branch-slo-tpot-ms", "--taper-rho", "--taper-utility",
                 "--latency-model", "--async-output", "--parallel-sampling", "--branch-max-fanout",
                 "--branch-max-branch-tokens", "--branch-grammar-clients", "--branch-min-slo-tpot-ms"):
        assert flag in out.stdout


def test_bad_flag_values_fail_at_parse_time(tiny_model):
    env = os.environ | cpu_env()
    for bad, needle in ((["--branch-policy", "bogus"], "valid: serial, cap:K"),
                        (["--branch-policy", "cap:0"], "valid: serial, cap:K"),
                        (["--branch-policy", "off"], "'off' is ambiguous and no longer accepted: use 'stock' for "
                                                     "SGLang's own schedule (Branchwise's step controller off) or "
                                                     "'serial' for one branch per phase per step"),
                        (["--taper-rho", "1.5"], "(0, 1]")):
        out = subprocess.run([sys.executable, "-m", "sglang.launch_server", "--model-path", tiny_model, *bad],
                             env=env, capture_output=True, text=True, timeout=120)
        assert out.returncode != 0
        assert needle in out.stderr, out.stderr[-2000:]
        assert "Load weight" not in out.stderr + out.stdout  # failed before any model was loaded


def test_patch_series_apply_revert_check():
    target = patcher.find_target()
    files = list(patcher.file_states(target, patcher.DEFAULT_PATCHES))
    assert patcher.check()[0].startswith("state: applied")
    assert "already applied" in patcher.apply()  # second apply is a no-op
    try:
        assert "reverted" in patcher.revert()
        for rel in files:  # byte-identical to the wheel, by sglang's own RECORD
            assert patcher._sha(target.site / rel) == target.record[rel]
        assert patcher.check()[0].startswith("state: not applied")
    finally:
        assert "applied" in patcher.apply()
    assert patcher.check()[0].startswith("state: applied")


def test_an_upgraded_patch_series_replaces_the_applied_one(tmp_path):
    """An environment patched by another version of the series (an upgraded checkout) is patched
    again from the pristine files, not left as it was because every file looks applied."""
    old = tmp_path / "patches"
    shutil.copytree(patcher.DEFAULT_PATCHES, old)
    first = patcher.series(old)[0]
    text = first.read_text()
    assert '] = "stock"' in text
    first.write_text(text.replace('] = "stock"', '] = "serial"', 1))
    target = patcher.find_target()
    rel = patcher.touched_files(first)[0]
    try:
        assert "replacing" in patcher.apply(old)
        assert '] = "serial"' in (target.site / rel).read_text().split("branch_policy", 1)[1][:600]
        assert "already applied" in patcher.apply(old)
    finally:
        assert "replacing" in patcher.apply()
    assert "already applied" in patcher.apply()
    assert '] = "stock"' in (target.site / rel).read_text().split("branch_policy", 1)[1][:600]


def test_plugin_runs_inside_scheduler_process(servers):
    srv = servers.get("--branch-policy", "serial")
    rep = branchwise_report(srv.url)
    assert rep["proctitle"] == "sglang::scheduler"
    assert rep["pid"] != srv.proc.pid  # not the launcher/HTTP process
    assert rep["config"]["branch_policy"] == "serial"
    before = rep["counters"]
    greedy(srv.url, PROMPTS[0], 4)
    after = branchwise_report(srv.url)["counters"]
    assert after["requests_created"] == before.get("requests_created", 0) + 1
    assert after["batch_results"] > before.get("batch_results", 0)  # the hooks saw its steps
    assert "Branchwise active: branch_policy=serial" in srv.log_path.read_text()


def test_policy_serial_equals_plugin_disabled(servers):
    on = servers.get("--branch-policy", "serial")
    outputs_on = [greedy(on.url, p) for p in PROMPTS]
    off = servers.get(env={"SGLANG_PLUGINS": "none-but-branchwise-excluded"})
    assert not any("branchwise" in st for st in scheduler_states(off.url))  # the plugin really is disabled
    assert [greedy(off.url, p) for p in PROMPTS] == outputs_on


def test_unchanged_frontend_programs_get_the_fork_hook():
    """The install's .pth makes `s.fork` branch-aware without importing branchwise (opt out: env)."""
    code = "from sglang.lang.interpreter import StreamExecutor as S; print(hasattr(S.fork, '__wrapped__'))"
    on = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    off = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env=os.environ | {"BRANCHWISE_FRONTEND_HOOK": "0"})
    assert (on.stdout.strip(), off.stdout.strip()) == ("True", "False"), on.stderr + off.stderr
