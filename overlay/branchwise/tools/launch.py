"""Start and stop a real SGLang server with Branchwise, or an smg router in front of several (used
by tests, bench and the demo), and read their schedulers' Branchwise reports.
"""

from __future__ import annotations

import json
import os
import random
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
from typing import Any, ClassVar, Self


def has_gpu() -> bool:
    try:
        return subprocess.run(["nvidia-smi", "-L"], capture_output=True).returncode == 0
    except FileNotFoundError:
        return False


def ephemeral_ports() -> tuple[int, int]:
    """The kernel's range for bind(0) and outgoing sockets (Linux; its default elsewhere)."""
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        low, high = 32768, 60999
    return low, high


def _can_bind(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A port nothing listens on, below the ephemeral range (a bind(0) port may be handed to another
    socket before the server binds it)."""
    low, _ = ephemeral_ports()
    rng = random.SystemRandom()
    for _ in range(100 if low > 12000 else 0):
        port = rng.randrange(10000, low - 1000)  # SGLang puts its own ports up to 1000 above ours
        if _can_bind(port):
            return port
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def cpu_env(tp: int = 1) -> dict[str, str]:
    env = {"SGLANG_USE_CPU_ENGINE": "1", "TORCHDYNAMO_DISABLE": "1"}
    if tp > 1:  # gloo TP on CPU: see cpu-sglang.md "Tensor parallelism on CPU"
        env |= {"SGLANG_CPU_OMP_THREADS_BIND": "|".join(str(core) for core in range(tp)),
                "SGLANG_NCCL_SO_PATH": "/nonexistent/libnccl.so", "OMP_NUM_THREADS": "1"}
    return env


class ServerError(RuntimeError):
    pass


BIND_FAILED = "address already in use"  # uvicorn's and smg's log line, lower-cased
BIND_TRIES = 3


@dataclass(kw_only=True)
class _Process:
    """A child process group with a log file, ready once `ready()` says so (server or router)."""

    port: int = 0
    log_path: Path | None = None
    proc: subprocess.Popen | None = None
    auto_ports: ClassVar[tuple[str, ...]] = ("port",)  # port fields a start picks itself when they are 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        raise NotImplementedError

    def ready(self) -> bool:
        raise NotImplementedError

    def start(self) -> Self:
        raise NotImplementedError

    def _spawn(self, env: dict[str, str], timeout_s: float, what: str) -> None:
        """Start and wait until ready; a port this start picked and lost to another process is picked
        again, up to BIND_TRIES times (a caller's port fails at once)."""
        picked = [name for name in self.auto_ports if not getattr(self, name)]
        for attempt in range(1, BIND_TRIES + 1):
            for name in picked:
                setattr(self, name, free_port())
            if self._spawn_once(env, timeout_s, what):
                return
            if not picked or attempt == BIND_TRIES:
                ports = ", ".join(f"{name} {getattr(self, name)}" for name in self.auto_ports)
                raise ServerError(f"{what} could not bind its port ({ports}), try {attempt}:\n"
                                  f"{self.log_tail()}")

    def _spawn_once(self, env: dict[str, str], timeout_s: float, what: str) -> bool:
        """True once ready; False when the process failed to bind a port (it is stopped)."""
        if self.log_path is None:
            fd, name = tempfile.mkstemp(prefix=f"branchwise-{what}-", suffix=".log")
            os.close(fd)
            self.log_path = Path(name)
        log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(self.command(), env=env, stdout=log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        log.close()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.bind_failed():
                self.stop()
                return False
            if self.proc.poll() is not None:
                raise ServerError(f"{what} exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if self.ready():
                    return True
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError, ValueError):
                pass
            time.sleep(0.5)
        self.stop()
        raise ServerError(f"{what} not ready after {timeout_s:.0f} s:\n{self.log_tail()}")

    def bind_failed(self) -> bool:
        return BIND_FAILED in self.log_tail(200).lower()

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

    def log_tail(self, lines: int = 40) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@dataclass
class LocalServer(_Process):
    model: str
    args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    max_total_tokens: int = 16384
    tp: int = 1

    def command(self) -> list[str]:
        cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", self.model,
               "--host", "127.0.0.1", "--port", str(self.port)]
        if not has_gpu():
            cmd += ["--device", "cpu", "--attention-backend", "torch_native", "--dtype", "float32",
                    "--max-total-tokens", str(self.max_total_tokens), "--sleep-on-idle"]
        if self.tp > 1:
            cmd += ["--tp", str(self.tp)] + (["--disable-custom-all-reduce"] if not has_gpu() else [])
        return cmd + self.args

    def ready(self) -> bool:
        return get_json(self.url + "/health", timeout=2) is not None

    def start(self, timeout_s: float = 240.0) -> LocalServer:
        env = os.environ.copy() | ({} if has_gpu() else cpu_env(self.tp)) | self.env
        self._spawn(env, timeout_s, "server")
        return self


# smg in front of Branchwise servers (the Makefile's ROUTER_ARGS are the same): a request with an
# X-SMG-Routing-Key goes to its key's worker and never spills, so a phase never splits.
ROUTER_ARGS = ("--policy", "prefix_hash", "--prefix-hash-load-factor", "1000000",
               "--disable-worker-overload-protection", "--disable-tokenizer-autoload",
               "--worker-startup-check-interval", "1")


@dataclass
class LocalRouter(_Process):
    """`smg launch` in front of `workers` (server URLs); ready once every worker is registered."""

    workers: list[str]
    args: list[str] = field(default_factory=list)
    metrics_port: int = 0
    auto_ports: ClassVar[tuple[str, ...]] = ("port", "metrics_port")

    def command(self) -> list[str]:
        return [sys.executable, "-m", "smg", "launch", "--host", "127.0.0.1", "--port", str(self.port),
                "--prometheus-host", "127.0.0.1", "--prometheus-port", str(self.metrics_port),
                "--log-level", "warn", *ROUTER_ARGS, *self.args, "--worker-urls", *self.workers]

    def ready(self) -> bool:
        ready = {worker["url"] for worker in get_json(self.url + "/workers", timeout=2)["workers"]
                 if worker.get("is_healthy") and worker.get("status") == "ready"}
        return ready >= set(self.workers)

    def start(self, timeout_s: float = 60.0) -> LocalRouter:
        self._spawn(os.environ.copy(), timeout_s, "router")
        return self


def get_json(url: str, timeout: float = 30) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        body = resp.read()
        return json.loads(body) if body.strip() else {}


def post_json(url: str, payload: dict[str, Any], timeout: float = 120) -> Any:
    req = urllib.request.Request(url, data=json.dumps(payload).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        body = resp.read()
        return json.loads(body) if body.strip() else {}


def router_workers(url: str) -> list[str] | None:
    """The worker URLs of the smg router at `url`, or None when `url` is a server (no /workers)."""
    try:
        body = get_json(url.rstrip("/") + "/workers", timeout=10)
    except urllib.error.HTTPError:
        return None
    workers = body.get("workers") if isinstance(body, dict) else None
    return [worker["url"] for worker in workers] if isinstance(workers, list) else None


def metrics_url(url: str) -> str:
    """Where the Prometheus series of the schedulers behind `url` are: a server's /metrics, or an smg
    router's /engine_metrics (every worker's /metrics, each series with a `worker_addr` label)."""
    url = url.rstrip("/")
    try:
        return url + ("/engine_metrics" if router_workers(url) is not None else "/metrics")
    except (OSError, ValueError):  # nothing answers (yet): a server's place
        return url + "/metrics"


def scheduler_states(url: str) -> list[dict[str, Any]]:
    """Every scheduler's /server_info internal state behind `url` (each DP rank of the server, or of
    every worker of a router), each with "worker": its server's URL; in worker, then DP rank order."""
    states = []
    for worker in router_workers(url) or [url.rstrip("/")]:
        for state in get_json(worker + "/server_info")["internal_states"]:
            states.append(state | {"worker": worker})
    return sorted(states, key=lambda state: (state["worker"],
                                             (state.get("branchwise") or {}).get("dp_rank", 0)))


# merge_reports keeps these from the first scheduler: settings, identities and fitted models, not counts
KEPT = frozenset({"config", "limits", "model", "dp_rank", "pid", "proctitle", "tp_size", "worker"})


def merge_reports(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """Several schedulers' reports as one: counts (ints) summed, levels (floats) averaged, lists
    joined, dicts merged key by key; a ratio `admission_rate` is recomputed from the summed
    `admitted`/`candidates`; anything else (and every KEPT key) is the first scheduler's value."""
    out: dict[str, Any] = {}
    for key in dict.fromkeys(key for rep in reports for key in rep):
        vals = [rep[key] for rep in reports if rep.get(key) is not None]
        out[key] = None if not vals else vals[0] if key in KEPT else _merge_values(vals)
    if {"admitted", "candidates", "admission_rate"} <= out.keys():
        # as StepStats
        out["admission_rate"] = out["admitted"] / out["candidates"] if out["candidates"] else 1.0
    return out


def _merge_values(vals: list[Any]) -> Any:
    if all(isinstance(val, dict) for val in vals):
        return merge_reports(vals)
    if all(isinstance(val, list) for val in vals):
        return [item for val in vals for item in val]
    if all(isinstance(val, int) and not isinstance(val, bool) for val in vals):
        return sum(vals)
    if all(isinstance(val, int | float) and not isinstance(val, bool) for val in vals):
        return sum(vals) / len(vals)
    return vals[0]


def merged_state(url: str) -> dict[str, Any]:
    """Every scheduler's internal state behind `url` (a server, its DP ranks, or a router's workers),
    merged (merge_reports)."""
    return merge_reports(scheduler_states(url))


def branchwise_report(url: str) -> dict[str, Any]:
    """The Branchwise report (config, counters, taper stats) of every scheduler behind `url`,
    merged; "ranks" lists each one's worker, dp_rank and pid. KeyError: no scheduler reports one."""
    states = [state for state in scheduler_states(url) if "branchwise" in state]
    if not states:
        raise KeyError(f"no Branchwise report at {url}/server_info")
    rep = merge_reports([state["branchwise"] for state in states])
    rep["ranks"] = [{"worker": state["worker"], "dp_rank": state["branchwise"].get("dp_rank", 0),
                     "pid": state["branchwise"].get("pid")} for state in states]
    return rep


def branchwise_reports(url: str) -> dict[int, dict[str, Any]]:
    """One server's per-scheduler Branchwise reports, by DP rank."""
    reports = [state["branchwise"] for state in get_json(url + "/server_info")["internal_states"]
               if "branchwise" in state]
    return {rep.get("dp_rank", 0): rep for rep in reports}
