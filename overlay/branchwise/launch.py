"""Start and stop a real SGLang server with Branchwise (used by tests, bench and the demo).

On a machine without an NVIDIA GPU it adds the CPU settings from cpu-sglang.md: the CPU engine
gate, torch_native attention, fp32 and --sleep-on-idle (else the idle scheduler spins a core).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


def has_gpu() -> bool:
    try:
        return subprocess.run(["nvidia-smi", "-L"], capture_output=True).returncode == 0
    except FileNotFoundError:
        return False


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_env(tp: int = 1) -> dict[str, str]:
    env = {"SGLANG_USE_CPU_ENGINE": "1", "TORCHDYNAMO_DISABLE": "1"}
    if tp > 1:  # gloo TP on CPU: see cpu-sglang.md "Tensor parallelism on CPU"
        env |= {"SGLANG_CPU_OMP_THREADS_BIND": "|".join(str(i) for i in range(tp)),
                "SGLANG_NCCL_SO_PATH": "/nonexistent/libnccl.so", "OMP_NUM_THREADS": "1"}
    return env


class ServerError(RuntimeError):
    pass


@dataclass
class LocalServer:
    model: str
    args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    port: int = 0
    max_total_tokens: int = 16384
    tp: int = 1
    log_path: Path | None = None
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", self.model,
               "--host", "127.0.0.1", "--port", str(self.port)]
        if not has_gpu():
            cmd += ["--device", "cpu", "--attention-backend", "torch_native", "--dtype", "float32",
                    "--max-total-tokens", str(self.max_total_tokens), "--sleep-on-idle"]
        if self.tp > 1:
            cmd += ["--tp", str(self.tp)] + (["--disable-custom-all-reduce"] if not has_gpu() else [])
        return cmd + self.args

    def start(self, timeout_s: float = 240.0) -> LocalServer:
        self.port = self.port or free_port()
        env = os.environ.copy() | ({} if has_gpu() else cpu_env(self.tp)) | self.env
        if self.log_path is None:
            fd, name = tempfile.mkstemp(prefix="branchwise-server-", suffix=".log")
            os.close(fd)
            self.log_path = Path(name)
        log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(self.command(), env=env, stdout=log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        log.close()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerError(f"server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if get_json(self.url + "/health", timeout=2) is not None:
                    return self
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            time.sleep(0.5)
        self.stop()
        raise ServerError(f"server not healthy after {timeout_s:.0f} s:\n{self.log_tail()}")

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        try:  # the whole process group: tokenizer, scheduler and detokenizer processes
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
        except ProcessLookupError:
            pass

    def log_tail(self, n: int = 40) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def __enter__(self) -> LocalServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def get_json(url: str, timeout: float = 30) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        body = r.read()
        return json.loads(body) if body.strip() else {}


def post_json(url: str, payload: dict, timeout: float = 120) -> Any:
    req = urllib.request.Request(url, data=json.dumps(payload).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        body = r.read()
        return json.loads(body) if body.strip() else {}


def branchwise_reports(url: str) -> dict[int, dict[str, Any]]:
    """Every scheduler's Branchwise report (config, pid, process title, counters, taper stats), by
    DP rank. /server_info lists one internal state per DP rank, in no order a caller should rely
    on, so each report is keyed by the dp_rank it carries."""
    states = get_json(url + "/server_info")["internal_states"]
    reports = [st["branchwise"] for st in states if "branchwise" in st]
    return {rep.get("dp_rank", 0): rep for rep in reports}


def branchwise_report(url: str, dp_rank: int = 0) -> dict[str, Any]:
    """The Branchwise report of DP rank `dp_rank`'s scheduler (the only one without --dp-size)."""
    return branchwise_reports(url)[dp_rank]
