"""branchwise.tools.launch without servers: ports, a lost bind, merging several schedulers' reports, and
the router flags."""

from __future__ import annotations

import os
import re
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from branchwise.tools import launch
from branchwise.tools.launch import ROUTER_ARGS, ServerError, ephemeral_ports, free_port, merge_reports

ROOT = Path(__file__).resolve().parents[2]


def test_merge_sums_counts_joins_lists_and_keeps_settings():
    a = {"config": {"branch_max_fanout": 16}, "pid": 11, "dp_rank": 0, "counters": {"branch_requests": 3},
         "taper": {"admitted": 1, "candidates": 4, "admission_rate": 0.25, "planner_ms_mean": 1.0,
                   "last_budget_s": None, "policy": "taper"},
         "recent": [{"parent": "a"}], "phase_rows": {"p": 4}, "enabled": True, "disabled_reason": None}
    b = {"config": {"branch_max_fanout": 16}, "pid": 12, "dp_rank": 1, "counters": {"branch_requests": 5, "x": 1},
         "taper": {"admitted": 3, "candidates": 4, "admission_rate": 0.75, "planner_ms_mean": 3.0,
                   "last_budget_s": 0.02, "policy": "taper"},
         "recent": [{"parent": "b"}], "phase_rows": {"p": 1, "q": 2}, "enabled": True, "disabled_reason": "why"}
    m = merge_reports([a, b])
    assert m["config"] == {"branch_max_fanout": 16} and (m["pid"], m["dp_rank"]) == (11, 0)  # kept, not summed
    assert m["counters"] == {"branch_requests": 8, "x": 1}
    assert m["taper"]["admission_rate"] == 0.5  # recomputed from the summed counts, not averaged
    assert m["taper"]["planner_ms_mean"] == 2.0 and m["taper"]["last_budget_s"] == 0.02  # a None is no value
    assert m["taper"]["policy"] == "taper" and m["enabled"] is True and m["disabled_reason"] == "why"
    assert m["recent"] == [{"parent": "a"}, {"parent": "b"}] and m["phase_rows"] == {"p": 5, "q": 2}
    assert merge_reports([a]) == a and merge_reports([{"pid": None}]) == {"pid": None}
    idle = {"admitted": 0, "candidates": 0, "admission_rate": 1.0}  # nothing offered: nothing refused
    assert merge_reports([idle, idle]) == idle


def test_makefile_serve_cluster_uses_the_router_flags_of_launch():
    text = (ROOT / "Makefile").read_text().replace("\\\n", " ")
    (line,) = re.findall(r"^ROUTER_ARGS := (.*)$", text, re.M)
    assert tuple(line.split()) == ROUTER_ARGS
    assert "$(ROUTER_ARGS)" in text and "-m smg launch" in text


def test_cluster_rows_per_scheduler_and_split_phases():
    from bench.cluster import cluster_rows

    def st(worker: str, rank: int, branch: int, phases: dict[str, int]) -> dict:
        return {"worker": worker, "branchwise": {"dp_rank": rank, "counters": {"branch_requests": branch},
                                                 "taper": {"rows_deferred": 2}, "phase_rows": phases}}

    rows, phases = cluster_rows([st("w1", 0, 4, {"a": 4}), st("w2", 0, 6, {"b": 4, "c": 1}),
                                 st("w2", 1, 1, {"c": 1}), {"worker": "w3"}])
    assert list(rows) == ["w1 dp=0", "w2 dp=0", "w2 dp=1", "cluster"]
    assert rows["cluster"]["branch_req"] == 11 and rows["cluster"]["deferred"] == 6
    assert rows["w2 dp=0"]["phases"] == 2 and rows["cluster"]["phases"] == 3
    assert phases == {"phases": 3, "split": 1}  # phase c reached two ranks


# Binds its port like uvicorn does: on failure it logs the error and then never exits.
LISTENER = """
import os, socket, sys, time
sock = socket.socket()
try:
    sock.bind(("127.0.0.1", int(sys.argv[1])))
except OSError as exc:
    print("ERROR:", exc, flush=True)
    time.sleep(600)
sock.listen()
while True:
    conn = sock.accept()[0]
    conn.sendall(str(os.getpid()).encode())
    conn.close()
"""


@dataclass(kw_only=True)
class Listener(launch._Process):
    def command(self) -> list[str]:
        return [sys.executable, "-c", LISTENER, str(self.port)]

    def ready(self) -> bool:  # this process answers, not whoever holds the port
        with socket.create_connection(("127.0.0.1", self.port), timeout=1) as sock:
            return sock.recv(16) == str(self.proc.pid).encode()

    def start(self) -> Listener:
        self._spawn(dict(os.environ), 60, "listener")
        return self


@pytest.fixture
def taken():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", free_port()))
        sock.listen()
        yield sock.getsockname()[1]


def test_free_port_is_below_the_ephemeral_range_and_free():
    low, _ = ephemeral_ports()
    for _ in range(20):
        port = free_port()
        assert port < low and launch._can_bind(port)


def test_a_lost_bind_on_a_picked_port_starts_again_on_another(taken, monkeypatch, tmp_path):
    picks = iter([taken, taken])
    monkeypatch.setattr(launch, "free_port", lambda: next(picks, None) or free_port())
    with Listener(log_path=tmp_path / "log") as proc:
        assert proc.port != taken and proc.ready()
        assert "ERROR" not in proc.log_tail()  # the log is the last try's, not the failed ones'


def test_a_lost_bind_on_a_given_port_fails_at_once_with_the_port(taken, tmp_path):
    with pytest.raises(ServerError, match=f"port {taken}") as err:
        Listener(port=taken, log_path=tmp_path / "log").start()
    assert "already in use" in str(err.value)


def test_a_port_that_stays_taken_fails_after_the_tries(taken, monkeypatch, tmp_path):
    monkeypatch.setattr(launch, "free_port", lambda: taken)
    with pytest.raises(ServerError, match=f"try {launch.BIND_TRIES}"):
        Listener(log_path=tmp_path / "log").start()
