"""A step controller with a mode Branchwise does not run with fails the real launcher at argument
resolution: non-zero exit, the message naming Branchwise, the mode and what to do, no model loaded."""

from __future__ import annotations

import os
import subprocess
import time

from branchwise.tools.launch import LocalServer, cpu_env, free_port, has_gpu

# SGLang logs this once it starts loading weights (model_runner); a refusal at start never gets there
WEIGHTS_LINE = "Load weight begin"
CASES = {  # extra launch arguments -> (mode named in the message, flag named in it)
    ("--enable-mixed-chunk",): ("mixed chunked prefill", "--enable-mixed-chunk"),
    ("--pp-size", "2"): ("pipeline parallelism", "--pp-size N"),
}


def test_refused_modes_fail_at_start(tiny_model):
    env = os.environ.copy() | ({} if has_gpu() else cpu_env())
    started = time.monotonic()
    procs = {}
    for extra in CASES:  # both launches at once: each is seconds of imports and resolution
        server = LocalServer(tiny_model, ["--branch-policy", "taper", *extra], port=free_port())
        procs[extra] = subprocess.Popen(server.command(), env=env, stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True)
    for extra, proc in procs.items():
        out, _ = proc.communicate(timeout=120)
        mode, flag = CASES[extra]
        assert proc.returncode not in (0, None), out[-2000:]
        want = (f"Branchwise: --branch-policy taper does not run with {mode} ({flag})")
        assert want in out and "Use --branch-policy stock" in out, out[-2000:]
        assert WEIGHTS_LINE not in out
    assert time.monotonic() - started < 90  # resolution only: no model load, no server start
