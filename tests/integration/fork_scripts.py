"""Scripts that SGLang's scripted runtime (sglang.test.scripted_runtime) runs inside the scheduler
process of test_fork_lifecycle.py's server.

A script is a generator the scheduler advances once per loop iteration, at the top of
`ingest_requests` (before the iteration receives its requests and before Branchwise's scheduling
point runs at its end). So a script can stop a server-side fork at a chosen point of its life, make
an abort arrive that this very iteration ingests, and then read what the scheduler and Branchwise
hold. Every wait is a condition on the scheduler's own state, checked once per iteration; the only
clock is a bound that turns a hang into a failure.
"""

from __future__ import annotations

import http.client
import json
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

from sglang.srt.managers.io_struct import AbortReq

from branchwise.fork.phases import Stage

HANG_S = 60.0  # a condition not reached by then fails the script (never reached on a working server)


class Stream(threading.Thread):
    """A streaming /generate client living in the scheduler process: it reads every chunk and
    keeps the last one that carries a finish reason; `drop` closes the TCP connection."""

    def __init__(self, host: str, port: int, payload: dict[str, Any]) -> None:
        super().__init__(daemon=True)
        self.host, self.port, self.payload = host, port, dict(payload, stream=True)
        self.final: dict[str, Any] | None = None
        self.error: str | None = None
        self.conn: http.client.HTTPConnection | None = None
        self.connected = threading.Event()

    def run(self) -> None:
        try:
            self.conn = http.client.HTTPConnection(self.host, self.port, timeout=HANG_S)
            self.conn.connect()
            self.connected.set()
            self.conn.request("POST", "/generate", json.dumps(self.payload), {"Content-Type": "application/json"})
            resp = self.conn.getresponse()
            for raw in resp:
                line = raw.decode().strip()
                if line.startswith("data:") and line != "data: [DONE]":
                    chunk = json.loads(line[len("data:"):])
                    if (chunk.get("meta_info") or {}).get("finish_reason") or "error" in chunk:
                        self.final = chunk
        except (OSError, http.client.HTTPException, ValueError) as e:
            self.error = repr(e)
        finally:
            self.connected.set()

    def drop(self) -> None:
        assert self.conn is not None and self.conn.sock is not None
        self.conn.sock.shutdown(socket.SHUT_RDWR)
        self.conn.close()

    @property
    def finish(self) -> dict[str, Any]:
        return ((self.final or {}).get("meta_info") or {}).get("finish_reason") or {}


def until(cond: Callable[[], Any], what: str, sched: Any = None) -> Iterator[None]:
    """Advance the scheduler one iteration at a time until `cond()` holds."""
    deadline = time.monotonic() + HANG_S
    while not cond():
        if time.monotonic() > deadline:
            state = f"; holding {residue(sched)}, phases {_phases(sched)}" if sched is not None else ""
            raise AssertionError(f"not reached within {HANG_S:.0f} s: {what}{state}")
        yield


def _phases(sched: Any) -> dict[str, str]:
    reg = sched.branchwise.fork.reg
    return {pid: f"{ph.state} open {ph.open_branches}" for pid, ph in reg.phases.items()}


def start(ctx: Any, payload: dict[str, Any]) -> Iterator[Stream]:
    args = ctx.scheduler.server_args
    s = Stream(args.host, args.port, payload)
    s.start()
    rid = payload["rid"]
    yield from until(lambda: ctx.find_req_by_rid(rid) is not None or s.error is not None, f"{rid} arrives")
    assert s.error is None, s.error
    return s


def residue(sched: Any) -> dict[str, int]:
    """Per-request state left behind: Branchwise's maps, and KV, request rows and tree locks."""
    rep = sched.branchwise.fork.report()
    left = {"parked": rep["parked"], "open_phases": rep["open_phases"], "live_branches": rep["live_branches"]}
    left |= {k: v for k, v in rep["sizes"].items() if k != "enc_cache"}
    left["kv_used_tokens"] = sched.pool_stats_observer.get_pool_stats().get_kv_token_stats()[0]
    left["kv_locked_tokens"] = sched.tree_cache.protected_size()
    pool = sched.req_to_token_pool
    left["req_rows"] = pool.size - pool.available_size()
    return {k: v for k, v in left.items() if v}


# ---- the points of a server-side fork's life, as conditions on the scheduler's state ----------
def _phase(mgr: Any, rid: str) -> Any:
    return mgr.reg.of_parent(rid)


def _nested(mgr: Any, rid: str) -> Any:
    return next((p for p in mgr.reg.phases.values() if p.depth == 1 and p.parent_rid.startswith(rid + "/")), None)


def _branch_reqs(ctx: Any, ph: Any) -> list[Any]:
    return [ctx.find_req_by_rid(b.rid) for b in ph.branches]


def _running(ctx: Any, ph: Any) -> bool:
    reqs = _branch_reqs(ctx, ph)
    return all(r is not None and len(r.output_ids) >= 2 and not r.finished() for r in reqs)


def _in(ph: Any, *stages: Stage) -> bool:
    return ph is not None and ph.state in stages


POINTS: dict[str, Callable[[Any, Any, str], bool]] = {
    # the parent decodes; its fork point is still ahead
    "decoding": lambda ctx, mgr, rid: (r := ctx.find_req_by_rid(rid)) is not None and len(r.output_ids) >= 2
    and _phase(mgr, rid) is None,
    # the fork was seen and the parent cut there; park and spawn run at this iteration's scheduling point
    "forking": lambda ctx, mgr, rid: _in(_phase(mgr, rid), Stage.FORKING),
    # the first iteration after the park and spawn (one step, at one scheduling point): branches queued
    "spawned": lambda ctx, mgr, rid: _in(_phase(mgr, rid), Stage.PARALLEL),
    "running": lambda ctx, mgr, rid: _in(ph := _phase(mgr, rid), Stage.PARALLEL) and _running(ctx, ph),
    "some_closed": lambda ctx, mgr, rid: _in(ph := _phase(mgr, rid), Stage.PARALLEL)
    and 0 < len(ph.open_branches) < ph.fanout,
    # every branch ended (none left in a queue or batch); the join runs at this iteration's scheduling point
    "join_ready": lambda ctx, mgr, rid: _in(ph := _phase(mgr, rid), Stage.PARALLEL)
    and all(r is None or r.finished() for r in _branch_reqs(ctx, ph)),
    # the parent was joined and re-queued
    "joined": lambda ctx, mgr, rid: _in(_phase(mgr, rid), Stage.REDUCE),
    # a branch's own fork, seen while the parent is parked
    "nested_forking": lambda ctx, mgr, rid: _in(_nested(mgr, rid), Stage.FORKING),
    # a branch is parked on its own branches, inside the parked parent
    "nested_parked": lambda ctx, mgr, rid: _in(_nested(mgr, rid), Stage.PARALLEL) and _running(ctx, _nested(mgr, rid)),
}


def _victim(mgr: Any, rid: str, point: str) -> str:
    """The branch an abort of a branch targets: the nested parent at the nested points, else the
    last (a long) branch."""
    if point.startswith("nested"):
        return _nested(mgr, rid).parent_rid
    ph = _phase(mgr, rid)
    return ph.branches[-1].rid if ph is not None else f"{rid}/p0/b2"


def abort_at(ctx: Any, payload: dict[str, Any], point: str, how: str) -> Iterator[None]:
    """Drive one request to `point`, abort it there (`how`: parent, branch, dropped, abort_all),
    and check that it ends as expected and leaves nothing behind."""
    sched, rid = ctx.scheduler, payload["rid"]
    mgr = sched.branchwise.fork
    orphans = mgr.stats["orphans_freed"]
    s = yield from start(ctx, payload)
    yield from until(lambda: POINTS[point](ctx, mgr, rid), f"{rid} at {point}", sched)
    victim = _victim(mgr, rid, point)
    if how == "parent":  # /abort_request {"rid": parent}: returns once the AbortReq reached the scheduler
        ctx.abort(SimpleNamespace(rid=rid))  # the context reads the handle's rid only
    elif how == "abort_all":
        ctx.abort_all()
    elif how == "dropped":  # the client goes away; the tokenizer manager aborts its rid
        s.drop()
        ctx._tokenizer_recv_proxy.wait_until_arrived(lambda o: isinstance(o, AbortReq) and o.rid == rid,
                                                     timeout_s=HANG_S, description=f"the abort of {rid}")
    else:  # a branch's rid is internal: the tokenizer manager drops aborts of rids it does not know, so
        # it is handed to the scheduler as a multi-worker tokenizer or the scheduler's timeout abort would
        sched.abort_request(AbortReq(rid=victim))
    yield  # this iteration ingests the abort, then runs the scheduling point
    yield from until(lambda: not s.is_alive(), f"{rid}: the client's stream ends", sched)
    yield from until(lambda: sched.is_fully_idle(), "scheduler idle, nothing parked", sched)
    if how == "dropped":
        assert s.final is None, s.final
    elif how == "branch":  # the parent goes on; a nested parent cut mid-structure leaves it malformed
        assert s.finish.get("type") == "stop", s.final
        err = s.finish.get("branchwise_error")
        assert (err is None) if not point.startswith("nested") else err.startswith("grammar:"), s.final
        rec = next(r for r in reversed(mgr.recent) if r["parent"] == rid)
        reached = point in ("spawned", "running", "some_closed") or point.startswith("nested")
        assert (rec["reasons"][int(victim.rsplit("/b", 1)[1])] == "abort") == reached, (victim, rec)
    else:
        assert s.finish.get("type") == "abort", s.final
    assert mgr.stats["orphans_freed"] == orphans, "the idle leak check had to free what the lifecycle left"
    left = residue(sched)
    assert not left, f"left after the abort at {point} ({how}): {left}"


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def orphan(ctx: Any, payload: dict[str, Any]) -> Iterator[None]:
    """Make SGLang lose a branch behind Branchwise's back (its end is never reported: the per-request
    finish hook is taken off), and check that the idle leak check frees the parked parent, logs its
    rid, counts it, and leaves nothing behind."""
    sched, rid = ctx.scheduler, payload["rid"]
    mgr = sched.branchwise.fork
    orphans = mgr.stats["orphans_freed"]
    log = Records()
    logging.getLogger("branchwise.fork").addHandler(log)
    try:
        s = yield from start(ctx, payload)
        yield from until(lambda: POINTS["running"](ctx, mgr, rid), f"{rid} running")
        lost = _phase(mgr, rid).branches[-1]
        del ctx.find_req_by_rid(lost.rid).update_finish_state  # Branchwise never hears of its end
        yield from until(lambda: not s.is_alive(), f"{rid}: the client's stream ends")
        yield from until(lambda: sched.is_fully_idle(), "scheduler idle")
    finally:
        logging.getLogger("branchwise.fork").removeHandler(log)
    assert s.finish.get("type") == "abort" and s.finish.get("status_code") == 500, s.final
    assert "leak check" in s.finish.get("message", ""), s.final
    assert mgr.stats["orphans_freed"] == orphans + 1
    assert any(rid in line and lost.rid in line for line in log.lines), log.lines
    left = residue(sched)
    assert not left, left
