"""Deferring decode steps on a real SGLang scheduler (no server): the kept sub-batch and the
running limit. Each scenario runs in its own child process (tests/integration/scheduler_scenarios.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from branchwise.tools.launch import cpu_env

ROOT = Path(__file__).resolve().parents[2]


def scenario(name: str, tiny_model: str, *flags: str) -> dict[str, Any]:
    env = os.environ | cpu_env() | {"BRANCHWISE_TEST_MODEL": tiny_model}
    proc = subprocess.run([sys.executable, "-m", "tests.integration.scheduler_scenarios", name, *flags],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    return json.loads(lines[-1].removeprefix("RESULT "))


def test_a_kept_sub_batch_gives_the_tokens_of_a_new_cut_and_never_serves_a_changed_batch(tiny_model):
    kept = scenario("kept_subset", tiny_model)
    fresh = scenario("kept_subset", tiny_model, "--no-kept")
    counts = {k: v for k, v in kept.items() if k != "tokens"}
    assert kept["finished"] == kept["requests"] == fresh["finished"], counts
    # a few events change the batch; between them the same rows run and the kept sub-batch serves
    assert kept["subset_steps"] >= 40 and kept["served"] >= kept["subset_steps"] // 2, counts
    assert fresh["served"] == 0
    assert kept["stale"] == 0, counts  # never after a merge, a finish, a retraction or a full step
    assert kept["tokens"] == fresh["tokens"]


def test_a_branch_that_finishes_in_a_deferring_step_frees_its_slot_for_the_queue(tiny_model):
    """Under a running limit a batch marked full admits nothing until a request leaves; SGLang
    clears the mark when its batch shrinks, and so must a deferring step."""
    got = scenario("admission", tiny_model)
    assert got["full_before"], got and got["queued_before"]  # the limit binds
    assert got["deferred_steps"] > 0 and got["siblings_left"] == 2  # it left while its siblings defer
    assert got["after_finish"] is not None and got["after_finish"] <= 3
