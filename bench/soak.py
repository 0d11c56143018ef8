"""Soak: a mixed load on one server under --branch-policy taper, then checks that nothing was lost.

    python -m bench.soak --launch [--minutes 1] [--concurrency 12] [--seed 0]
    python -m bench.soak --launch --async-output                   # Albireo's async output
    python -m bench.soak --launch --forward-thread                 # --async-output + the CPU forward thread
    python -m bench.soak --launch --deferring                      # an SLO at which TAPER defers rows
    python -m bench.soak --url http://127.0.0.1:30000   # a server with --enable-custom-logit-processor

The load (MIX: serial requests, client, frontend and server-side forks, disconnects, aborts,
parallel sampling, malformed requests) is deterministic from --seed; --concurrency workers keep that
many jobs in flight until the time is up. The checks at the end: lost, duplicated, healthy, idle,
rss, dicts, and deferred with --deferring; the exit status is 0 only if every check passes. What
each job sends and each check requires: docs/benchmarks.md ("Correctness under load").
"""

from __future__ import annotations

import argparse
import asyncio
import faulthandler
import json
import os
import random
import shlex
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from bench.cli import add_server_source
from bench.structure_driver import request as driven_request
from bench.structure_driver import spec
from branchwise import client
from branchwise.tools.launch import LocalServer, get_json, merged_state
from branchwise.tools.tiny_model import WORDS

SERVER_ARGS = ["--branch-policy", "taper", "--enable-custom-logit-processor", "--max-running-requests", "12"]
JSON_HEADERS = {"Content-Type": "application/json"}
IDLE_DEADLINE_S = 90.0
STALL_MARGIN_S = 120.0  # past a job's timeout with nothing done: the client itself is stuck
POLL_S = 0.5

# Job kinds and their weights in the mix (fixed before any run; see docs/benchmarks.md,
# "Correctness under load").
MIX: dict[str, int] = {
    "serial": 16, "client_fork": 8, "frontend": 5, "server_fork": 12, "disconnect": 6,
    "abort_parent": 7, "abort_branch": 5, "bad_meta": 5, "bad_sampling": 5, "bad_json": 4, "wide_fork": 3,
    "n_sampling": 8,
}
DEFERRING_ARGS = ["--branch-min-slo-tpot-ms", "0.1"]  # --deferring: the measured SLO must be allowed
MAX_FANOUT = 16  # the server's --branch-max-fanout default

# Malformed custom_params: (payload value, a word the 4xx must name).
BAD_META: list[tuple[Any, str]] = [
    ({"branchwise": {"fanout": 0}}, "fanout"),
    ({"branchwise": {"grammar": "klingon"}}, "grammar"),
    ({"branchwise": {"bogus": 1}}, "bogus"),
    ({"branchwise": {"phase": "", "branch": 0, "fanout": 2}}, "phase"),
    ({"branchwise": {"phase": "g", "branch": 3, "fanout": 2}}, "branch"),
    ({"branchwise": {"weight": -1}}, "weight"),
    ({"branchwise": {"slo_tpot_ms": "fast"}}, "slo_tpot_ms"),
    ({"branchwise": 5}, "branchwise"),
    (["branchwise"], "custom_params"),
    ("xbranchwisex", "custom_params"),
    ({"branchwise": {"fanout": 10**300}}, "fanout"),
    ({"branchwise": {"weight": 10**400}}, ""),  # past float range: the JSON decoder may reject it first
]
BAD_SAMPLING: list[tuple[dict[str, Any], str]] = [
    ({"temperature": -1}, "temperature"), ({"top_p": 1.5}, "top_p"), ({"min_p": 2}, "min_p"),
    ({"top_k": 0}, "top_k"), ({"frequency_penalty": 3}, "frequency_penalty"),
    ({"presence_penalty": -5}, "presence_penalty"), ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"max_new_tokens": -3}, "max_new_tokens"),
    ({"min_new_tokens": 9, "max_new_tokens": 4}, "min_new_tokens"),
    ({"logit_bias": {"999999": 1.0}}, "logit_bias"),
    ({"sampling_seed": 2**70}, ""),  # SGLang's message does not name it
]
BAD_JSON: list[tuple[bytes | dict[str, Any], str]] = [
    (b'{"text": "a", "sampling_params": {', ""),
    (b"", ""),
    (b"[1, 2]", ""),
    ({"sampling_params": {"max_new_tokens": 4}}, "input_ids"),
    ({"text": "hi", "sampling_params": "fast"}, "sampling_params"),
    ({"input_ids": [1, 10**9], "sampling_params": {"max_new_tokens": 4}}, "input_ids"),
    ({"input_ids": [-5, 1], "sampling_params": {"max_new_tokens": 4}}, "input_ids"),
]


class Unexpected(AssertionError):
    """A job got an answer outside its expected class."""


@dataclass(slots=True)
class Reply:
    status: int
    body: dict[str, Any] | None = None  # JSON body, or a stream's last chunk
    raw: str = ""  # body text of a non-streamed answer
    chunks: int = 0
    finals: int = 0  # answers carrying a finish_reason (a stream must have exactly one)
    ids: set[str] = field(default_factory=set)
    disconnected: bool = False

    @property
    def meta(self) -> dict[str, Any]:
        return (self.body or {}).get("meta_info") or {}

    @property
    def finish(self) -> dict[str, Any]:
        return self.meta.get("finish_reason") or {}


@dataclass
class Outcome:
    idx: int
    kind: str
    result: str  # ok | aborted | finished_before_abort | rejected | disconnected | LOST | FAIL
    detail: str = ""
    seconds: float = 0.0


@dataclass
class Soak:
    url: str
    seed: int
    http: aiohttp.ClientSession
    run_id: str
    job_timeout_s: float
    mix: dict[str, int]
    pool: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(8, "soak-frontend"))
    sent: set[str] = field(default_factory=set)
    answered: Counter[str] = field(default_factory=Counter)
    foreign: list[str] = field(default_factory=list)
    stream_extra: list[str] = field(default_factory=list)  # rids whose stream went on after its final
    endpoint: Any = None
    slo_ms: float | None = None  # --deferring: every request's TPOT SLO (measured after warm-up)
    stall_exit: bool = False  # a stuck client exits after dumping its stacks (the CLI), or only dumps

    def rid(self, idx: int, suffix: str = "") -> str:
        """Fixed-width job numbers: no job's rid prefixes another's (abort is by rid prefix)."""
        return f"{self.run_id}-{idx:06d}{suffix}"

    def answer(self, rep: Reply, sent_rid: str | None) -> None:
        """Count a final answer against its rid (None: a frontend program's own rid)."""
        rid = rep.meta.get("id")
        if rid is None:
            return
        self.answered[rid] += 1
        if sent_rid is not None and rid != sent_rid:
            self.foreign.append(f"sent {sent_rid}, answered as {rid}")

    async def post(self, payload: dict[str, Any] | bytes, stream: bool = False,
                   stop_after: int | None = None) -> Reply:
        """POST /generate; with stop_after, close the connection after that many stream chunks."""
        rid = payload.get("rid") if isinstance(payload, dict) else None
        if rid is not None:
            self.sent.add(rid)
        data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        async with self.http.post(self.url + "/generate", data=data, headers=JSON_HEADERS) as resp:
            if resp.status != 200 or not stream:
                raw = await resp.text()
                try:
                    body = json.loads(raw)
                except ValueError:
                    body = None
                rep = Reply(resp.status, body if isinstance(body, dict) else None, raw)
                if resp.status == 200 and rep.meta:
                    rep.finals = 1
                    self.answer(rep, rid)
                return rep
            return await self._read_stream(resp, rid, stop_after)

    async def _read_stream(self, resp: aiohttp.ClientResponse, rid: str | None,
                           stop_after: int | None) -> Reply:
        rep, buf = Reply(200), b""
        async for piece in resp.content.iter_any():
            *events, buf = (buf + piece).split(b"\n\n")
            for event in events:
                data = event.decode().strip().removeprefix("data:").strip()
                if not data or data == "[DONE]":
                    continue
                chunk = json.loads(data)
                rep.chunks += 1
                if rep.finals:
                    self.stream_extra.append(str(rid))
                rep.body = chunk
                if "error" in chunk:  # SGLang streams late errors as a chunk inside HTTP 200
                    rep.finals += 1
                    continue
                rep.ids.add(str(rep.meta.get("id")))
                if rep.finish:
                    rep.finals += 1
                    self.answer(rep, rid)
            if stop_after is not None and rep.chunks >= stop_after and not rep.finals:
                resp.close()  # drop the TCP connection: the server sees a client disconnect
                rep.disconnected = True
                return rep
        if len(rep.ids) > 1:
            raise Unexpected(f"one stream carried several rids: {sorted(rep.ids)}")
        return rep

    async def post_n(self, payload: dict[str, Any], stream: bool, abort_after: int | None,
                     victims: set[int]) -> tuple[dict[str, Reply], set[str]]:
        """POST one /generate with sampling_params.n > 1. SGLang answers each sample under a rid of
        its own (stock 0.5.23: a fresh uuid, not derived from ours), so samples are told apart by
        those and n distinct ones must answer. With abort_after, the samples whose index is in
        `victims` and that have streamed by then are aborted by their rid. Returns the replies by
        rid and the rids aborted."""
        n_samples = payload["sampling_params"]["n"]
        reps: dict[str, Reply] = {}
        index: dict[int, str] = {}
        aborted: set[str] = set()
        async with self.http.post(self.url + "/generate", data=json.dumps(payload).encode(),
                                  headers=JSON_HEADERS) as resp:
            if resp.status != 200:
                raise Unexpected(f"HTTP {resp.status}: {(await resp.text())[:300]}")
            if not stream:
                body = json.loads(await resp.text())
                if not isinstance(body, list):
                    raise Unexpected(f"n={n_samples}: expected a list of answers, got {str(body)[:200]}")
                for order, part in enumerate(body):
                    self._take(reps, index, part, order)
            else:
                buf, chunks, aborts = b"", 0, None
                async for piece in resp.content.iter_any():
                    *events, buf = (buf + piece).split(b"\n\n")
                    for event in events:
                        data = event.decode().strip().removeprefix("data:").strip()
                        if data and data != "[DONE]":
                            chunks += 1
                            self._take(reps, index, json.loads(data), None)
                    if abort_after is not None and chunks >= abort_after and aborts is None:
                        aborted = {index[sample] for sample in victims if sample in index}
                        aborts = asyncio.ensure_future(asyncio.gather(*[self.abort(rid) for rid in aborted]))
                if aborts is not None:
                    await aborts
        if len(reps) != n_samples:
            raise Unexpected(f"n={n_samples}: answers under {len(reps)} rids ({sorted(reps)[:5]})")
        return reps, aborted

    def _take(self, reps: dict[str, Reply], index: dict[int, str], chunk: dict[str, Any],
              order: int | None) -> None:
        rid = (chunk.get("meta_info") or {}).get("id")
        if rid is None:
            raise Unexpected(f"an n>1 answer without a rid: {str(chunk)[:200]}")
        if rid not in reps:  # a sample's own rid: the server chose it for this request
            reps[rid] = Reply(200)
            self.sent.add(rid)
            index[chunk.get("index", order if order is not None else len(index))] = rid
        rep = reps[rid]
        if rep.finals:
            self.stream_extra.append(rid)
        rep.body, rep.chunks = chunk, rep.chunks + 1
        if rep.finish or "error" in chunk:
            rep.finals += 1
            self.answer(rep, rid)

    async def abort(self, rid: str) -> None:
        async with self.http.post(self.url + "/abort_request", json={"rid": rid}) as resp:
            if resp.status != 200:
                raise Unexpected(f"/abort_request {rid} -> HTTP {resp.status}: {await resp.text()}")

    async def in_thread(self, fn: Callable[[], Any]) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn)


# ---- expectations --------------------------------------------------------------------------------
def expect_ok(rep: Reply, rid: str | None = None, abort_ok: bool = False,
              limit_error: str | None = None) -> str:
    """A complete answer (stop/length), once; abort_ok: an abort result also counts ("aborted");
    limit_error: the answer must carry a branchwise_error naming that limit."""
    if rep.status != 200:
        raise Unexpected(f"HTTP {rep.status}: {rep.raw[:300]}")
    if rep.finals != 1:
        raise Unexpected(f"{rep.finals} final answers for {rid} ({rep.chunks} chunks)")
    if "error" in (rep.body or {}):
        raise Unexpected(f"error chunk: {rep.body}")
    finish = rep.finish
    if rid is not None and rep.meta.get("id") != rid:
        raise Unexpected(f"answer for {rep.meta.get('id')}, sent {rid}")
    if finish.get("type") == "abort" and abort_ok and not finish.get("status_code"):
        return "aborted"
    if finish.get("type") not in ("stop", "length"):
        raise Unexpected(f"finish_reason {finish}")
    if limit_error is not None:
        if limit_error not in str(finish.get("branchwise_error")):
            raise Unexpected(f"expected a branchwise_error naming {limit_error}, finish_reason {finish}")
    elif "branchwise_error" in finish:
        raise Unexpected(f"branchwise_error on a well-formed request: {finish['branchwise_error']}")
    return "ok"


def expect_rejected(rep: Reply, needle: str) -> str:
    """A 4xx (or, streamed, an abort chunk with a 4xx status) whose message names `needle`."""
    if 400 <= rep.status < 500:
        msg = rep.raw
    elif rep.status == 200 and rep.finals == 1 and "error" in (rep.body or {}):
        msg = json.dumps(rep.body["error"])
    elif (rep.status == 200 and rep.finish.get("type") == "abort"
          and 400 <= (rep.finish.get("status_code") or 0) < 500):
        msg = str(rep.finish.get("message"))
    else:
        raise Unexpected(f"expected a 4xx naming {needle!r}, got HTTP {rep.status}: "
                         f"{rep.raw[:200] or rep.body}")
    if needle.lower() not in msg.lower():
        raise Unexpected(f"the error does not name {needle!r}: {msg[:300]}")
    return "rejected"


# ---- jobs ----------------------------------------------------------------------------------------
def text(rng: random.Random, words: tuple[int, int] = (6, 30)) -> str:
    return " ".join(rng.choices(WORDS, k=rng.randint(*words))) + "."


def sampling(rng: random.Random, min_tokens: int = 4, max_tokens: int = 48) -> dict[str, Any]:
    params: dict[str, Any] = {"max_new_tokens": rng.randint(min_tokens, max_tokens),
                              "ignore_eos": rng.random() < 0.5}
    if rng.random() < 0.3:
        params |= {"temperature": 0.8, "sampling_seed": rng.randrange(1 << 30)}
    else:
        params["temperature"] = 0.0
    if rng.random() < 0.15:
        params["frequency_penalty"] = 0.5
    return params


def server_fork_payload(soak: Soak, rng: random.Random, rid: str, stream: bool, branch_len: tuple[int, int],
                        max_new: int) -> dict[str, Any]:
    grammar = rng.choice(["multiverse", "sprint"])
    branches = rng.randint(2, 4)
    lens = [rng.randint(*branch_len) for _ in range(branches)]
    if grammar == "sprint":
        skeleton = spec("sprint", branches, lens, rounds=rng.randint(1, 2))
    elif rng.random() < 0.2:  # nested phases: every path opens its own <Parallel>
        skeleton = spec("multiverse", 2, lens[:2], nest=2, nest_n=2)
    else:
        skeleton = spec("multiverse", branches, lens)
    payload = driven_request(text(rng), skeleton, grammar=grammar, rid=rid, stream=stream,
                             max_new_tokens=max_new)
    if soak.slo_ms is not None:
        payload["sampling_params"]["custom_params"]["branchwise"]["slo_tpot_ms"] = soak.slo_ms
    return payload


async def job_serial(soak: Soak, idx: int, rng: random.Random) -> str:
    rid, stream = soak.rid(idx), rng.random() < 0.5
    slo = rng.choice([None, 30.0, 200.0])
    params = client.stamp_serial(sampling(rng), slo_tpot_ms=slo if soak.slo_ms is None else soak.slo_ms)
    payload = {"text": text(rng), "sampling_params": params, "rid": rid, "stream": stream}
    return expect_ok(await soak.post(payload, stream), rid)


async def job_client_fork(soak: Soak, idx: int, rng: random.Random) -> str:
    """head -> n stamped branches on head's text (branchwise.client rids) -> tail on the joined text."""
    group = soak.rid(idx)
    head_rid, prompt = f"{group}.h", text(rng)
    head = await soak.post({"text": prompt, "sampling_params": sampling(rng, 4, 16), "rid": head_rid})
    expect_ok(head, head_rid)
    fork_text = prompt + head.body["text"]
    fanout, branch_params = rng.randint(2, 4), sampling(rng, 4, 32)
    streams = [rng.random() < 0.4 for _ in range(fanout)]
    reps = await asyncio.gather(*[
        soak.post({"text": fork_text + f" branch {branch}:",
                   "sampling_params": client.stamp_branch(branch_params, group, branch, fanout,
                                                          slo_tpot_ms=soak.slo_ms),
                   "rid": client.branch_rid(group, branch), "stream": streams[branch]}, streams[branch])
        for branch in range(fanout)])
    for branch, rep in enumerate(reps):
        expect_ok(rep, client.branch_rid(group, branch))
    joined = fork_text + "".join(f"\n{branch}:{rep.body['text']}" for branch, rep in enumerate(reps))
    tail_rid = f"{group}.t"
    tail = {"text": joined, "sampling_params": sampling(rng, 2, 8), "rid": tail_rid}
    return expect_ok(await soak.post(tail), tail_rid)


async def job_frontend(soak: Soak, idx: int, rng: random.Random) -> str:
    """An SGLang frontend program (threads, RuntimeEndpoint) with fork/join: frontends/."""
    from frontends import fork_join, multiverse, sprint
    from frontends.common import backend

    if soak.endpoint is None:
        soak.endpoint = await soak.in_thread(lambda: backend(soak.url))
    which = rng.choice(["fork_join", "fork_join", "multiverse", "sprint"])
    if which == "fork_join":
        kwargs = dict(fanout=rng.randint(2, 4), head_tokens=rng.randint(4, 16),
                      branch_tokens=rng.randint(4, 24), tail_tokens=rng.randint(0, 8), seed=idx,
                      endpoint=soak.endpoint)
        res = await soak.in_thread(lambda: fork_join.run_batch(soak.url, 1, **kwargs)[0])
    elif which == "multiverse":
        kwargs = dict(paths=rng.randint(2, 3), path_tokens=rng.randint(6, 24), seed=idx,
                      endpoint=soak.endpoint)
        res = await soak.in_thread(lambda: multiverse.run(soak.url, **kwargs))
    else:
        kwargs = dict(rounds=rng.randint(1, 2), tasks=rng.randint(2, 3), exec_tokens=rng.randint(6, 24),
                      seed=idx, endpoint=soak.endpoint)
        res = await soak.in_thread(lambda: sprint.run(soak.url, **kwargs))
    for req in res.requests:
        if req.finish not in ("stop", "length") or not req.rid:
            raise Unexpected(f"frontend {which} request {req.name} ({req.rid}): finish {req.finish!r}")
        soak.sent.add(req.rid)
        soak.answered[req.rid] += 1
    return "ok"


async def job_server_fork(soak: Soak, idx: int, rng: random.Random) -> str:
    rid, stream = soak.rid(idx), rng.random() < 0.5
    rep = await soak.post(server_fork_payload(soak, rng, rid, stream, (2, 16), 900), stream)
    return expect_ok(rep, rid)


async def job_wide_fork(soak: Soak, idx: int, rng: random.Random) -> str:
    """A server-side fork wider than --branch-max-fanout: not taken, the request runs serially to
    its end and says why in finish_reason.branchwise_error."""
    rid, stream = soak.rid(idx), rng.random() < 0.5
    skeleton = spec("multiverse", rng.randint(MAX_FANOUT + 1, MAX_FANOUT + 8), [rng.randint(1, 4)])
    rep = await soak.post(driven_request(text(rng), skeleton, grammar="multiverse", rid=rid, stream=stream,
                                         max_new_tokens=1200), stream)
    expect_ok(rep, rid, limit_error="--branch-max-fanout")
    return "ok_serial"


async def job_disconnect(soak: Soak, idx: int, rng: random.Random) -> str:
    """Read 1-3 chunks of a long stream (serial or server fork), then drop the connection."""
    rid = soak.rid(idx)
    if rng.random() < 0.5:
        payload = {"text": text(rng), "rid": rid, "stream": True,
                   "sampling_params": {"max_new_tokens": 400, "ignore_eos": True, "temperature": 0}}
    else:
        payload = server_fork_payload(soak, rng, rid, True, (100, 300), 1500)
    rep = await soak.post(payload, stream=True, stop_after=rng.randint(1, 3))
    return "disconnected" if rep.disconnected else expect_ok(rep, rid)


async def _abort_after(soak: Soak, payload: dict[str, Any], stream: bool, delay_s: float, abort_rid: str,
                       expect_abort: bool) -> str:
    task = asyncio.ensure_future(soak.post(payload, stream))
    await asyncio.sleep(delay_s)
    await soak.abort(abort_rid)
    res = expect_ok(await task, payload["rid"], abort_ok=expect_abort)
    if not expect_abort:
        return res
    return "aborted" if res == "aborted" else "finished_before_abort"


async def job_abort_parent(soak: Soak, idx: int, rng: random.Random) -> str:
    """Abort a server-fork parent (its branches go with it) or a serial stream, by its rid; or send an
    abort for a server-side branch rid, which SGLang ignores (the client never owned that rid)."""
    rid, stream, delay = soak.rid(idx), rng.random() < 0.5, rng.uniform(0.1, 2.5)
    which = rng.choice(["fork", "fork", "serial", "branch_rid"])
    if which == "serial":
        payload = {"text": text(rng), "rid": rid, "stream": stream,
                   "sampling_params": {"max_new_tokens": 400, "ignore_eos": True, "temperature": 0}}
        return await _abort_after(soak, payload, stream, delay, rid, True)
    if which == "fork":
        payload = server_fork_payload(soak, rng, rid, stream, (100, 300), 1500)
        return await _abort_after(soak, payload, stream, delay, rid, True)
    payload = server_fork_payload(soak, rng, rid, stream, (2, 16), 900)
    return await _abort_after(soak, payload, stream, delay, f"{rid}/p0/b0", False)


async def job_abort_branch(soak: Soak, idx: int, rng: random.Random) -> str:
    """Client fork of long branches; abort one branch by its rid: it ends aborted, its siblings do not."""
    group, fanout = soak.rid(idx), rng.randint(2, 4)
    victim = rng.randrange(fanout)
    prompt = text(rng)
    params = {"max_new_tokens": rng.randint(100, 300), "ignore_eos": True, "temperature": 0}
    streams = [rng.random() < 0.4 for _ in range(fanout)]
    tasks = [asyncio.ensure_future(soak.post(
        {"text": prompt + f" branch {branch}:",
         "sampling_params": client.stamp_branch(params, group, branch, fanout),
         "rid": client.branch_rid(group, branch), "stream": streams[branch]}, streams[branch]))
        for branch in range(fanout)]
    await asyncio.sleep(rng.uniform(0.1, 2.0))
    await soak.abort(client.branch_rid(group, victim))
    reps = await asyncio.gather(*tasks)
    res = "finished_before_abort"
    for branch, rep in enumerate(reps):
        got = expect_ok(rep, client.branch_rid(group, branch), abort_ok=branch == victim)
        if branch == victim and got == "aborted":
            res = "aborted"
    return res


async def job_n_sampling(soak: Soak, idx: int, rng: random.Random) -> str:
    """sampling_params.n in 2..4 on one /generate (SGLang's parallel sampling), streamed or not.
    A third of the streamed ones are long and get some of their samples aborted by rid after the
    first chunks: those end aborted (or finished first), the others complete."""
    rid, n_samples, stream = soak.rid(idx), rng.randint(2, 4), rng.random() < 0.5
    cut = stream and rng.random() < 0.35
    params = sampling(rng, 4, 32) | {"n": n_samples}
    if params["temperature"] == 0.0:  # n greedy samples are one answer n times: sample them
        params |= {"temperature": 0.8, "sampling_seed": rng.randrange(1 << 30)}
    if cut:
        params |= {"max_new_tokens": rng.randint(100, 300), "ignore_eos": True}
    params = client.stamp_serial(params, slo_tpot_ms=soak.slo_ms)
    victims = set(rng.sample(range(n_samples), rng.randint(1, n_samples))) if cut else set()
    payload = {"text": text(rng), "sampling_params": params, "rid": rid, "stream": stream}
    reps, aborted = await soak.post_n(payload, stream, rng.randint(1, 3) if cut else None, victims)
    res = "ok"
    for sample_rid, rep in reps.items():
        if expect_ok(rep, sample_rid, abort_ok=sample_rid in aborted) == "aborted":
            res = "aborted"
    return res if not cut or res == "aborted" else "finished_before_abort"


async def job_bad_meta(soak: Soak, idx: int, rng: random.Random) -> str:
    custom, needle = rng.choice(BAD_META)
    stream = rng.random() < 0.3
    payload = {"text": text(rng), "rid": soak.rid(idx), "stream": stream,
               "sampling_params": {"max_new_tokens": 8, "custom_params": custom}}
    return expect_rejected(await soak.post(payload, stream), needle)


async def job_bad_sampling(soak: Soak, idx: int, rng: random.Random) -> str:
    bad, needle = rng.choice(BAD_SAMPLING)
    stream = rng.random() < 0.3
    payload = {"text": text(rng), "rid": soak.rid(idx), "stream": stream,
               "sampling_params": {"max_new_tokens": 8} | bad}
    return expect_rejected(await soak.post(payload, stream), needle)


async def job_bad_json(soak: Soak, idx: int, rng: random.Random) -> str:
    body, needle = rng.choice(BAD_JSON)
    stream = False
    if isinstance(body, dict):
        # streamed: refused after the stream started (an error chunk in HTTP 200), and the route's
        # abort task then runs for a request that was never normalized
        stream = rng.random() < 0.4
        body = dict(body, rid=soak.rid(idx), stream=stream)
    return expect_rejected(await soak.post(body, stream), needle)


JOBS: dict[str, Callable[[Soak, int, random.Random], Awaitable[str]]] = {
    "serial": job_serial, "client_fork": job_client_fork, "frontend": job_frontend,
    "server_fork": job_server_fork, "disconnect": job_disconnect, "abort_parent": job_abort_parent,
    "abort_branch": job_abort_branch, "bad_meta": job_bad_meta, "bad_sampling": job_bad_sampling,
    "bad_json": job_bad_json, "wide_fork": job_wide_fork, "n_sampling": job_n_sampling,
}


def job_kind(seed: int, idx: int, mix: dict[str, int]) -> str:
    kinds = sorted(mix)
    return random.Random(f"{seed}/{idx}/kind").choices(kinds, [mix[kind] for kind in kinds])[0]


def arm_stall_dump(soak: Soak) -> None:
    """A job ends within its timeout while the event loop runs, so no job ending for longer than
    that means the loop is blocked (a lock, an import, a blocking call): print every thread's
    stack to stderr (and with stall_exit, exit rather than hang). Each ending job re-arms it."""
    faulthandler.dump_traceback_later(soak.job_timeout_s + STALL_MARGIN_S, exit=soak.stall_exit)


async def run_job(soak: Soak, idx: int, kind: str) -> Outcome:
    rng = random.Random(f"{soak.seed}/{idx}/params")
    start = time.monotonic()
    try:
        res = await asyncio.wait_for(JOBS[kind](soak, idx, rng), soak.job_timeout_s)
        return Outcome(idx, kind, res, seconds=time.monotonic() - start)
    except TimeoutError:
        return Outcome(idx, kind, "LOST", f"no final answer within {soak.job_timeout_s:.0f} s",
                       time.monotonic() - start)
    except Exception as exc:  # noqa: BLE001 - every failure is reported with its job
        return Outcome(idx, kind, "FAIL", f"{type(exc).__name__}: {exc}"[:500], time.monotonic() - start)
    finally:
        arm_stall_dump(soak)


# ---- server observation --------------------------------------------------------------------------
@dataclass
class Watch:
    """/health and /v1/loads polled for the whole run."""

    polls: int = 0
    unhealthy: list[str] = field(default_factory=list)
    busy: int = 0  # polls with a request running or waiting
    waiting: int = 0  # polls with a non-empty waiting queue
    max_running: int = 0
    max_waiting: int = 0


async def watch(soak: Soak, watched: Watch, stop: asyncio.Event) -> None:
    while not stop.is_set():
        try:
            async with soak.http.get(soak.url + "/health", timeout=aiohttp.ClientTimeout(total=30)) as resp:
                if resp.status != 200:
                    watched.unhealthy.append(f"/health -> {resp.status}")
            async with soak.http.get(soak.url + "/v1/loads", timeout=aiohttp.ClientTimeout(total=30)) as resp:
                load = (await resp.json())["loads"][0]
            watched.polls += 1
            run, wait = load["num_running_reqs"], load["num_waiting_reqs"]
            watched.busy += bool(run or wait)
            watched.waiting += bool(wait)
            watched.max_running = max(watched.max_running, run)
            watched.max_waiting = max(watched.max_waiting, wait)
        except (aiohttp.ClientError, TimeoutError, KeyError, ValueError) as exc:
            watched.unhealthy.append(f"poll failed: {exc!r}")
        try:
            await asyncio.wait_for(stop.wait(), POLL_S)
        except TimeoutError:
            pass


def reports(url: str) -> tuple[dict[str, Any], dict[str, Any]]:
    state = merged_state(url)
    return state["branchwise"], state.get("branchwise_fork") or {}


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def residue(branchwise: dict[str, Any], fork: dict[str, Any]) -> dict[str, int]:
    """Non-empty per-request Branchwise state (name -> size). The encode cache is bounded, not
    per-request, and `recent`/counters are bounded histories: not listed."""
    sizes = {f"controller.{name}": size for name, size in (branchwise.get("sizes") or {}).items()}
    if fork:
        sizes |= {"fork.parked": fork["parked"], "fork.open_phases": fork["open_phases"],
                  "fork.live_branches": fork["live_branches"]}
        sizes |= {f"fork.{name}": size for name, size in (fork.get("sizes") or {}).items()
                  if name != "enc_cache"}
    return {name: size for name, size in sizes.items() if size}


async def wait_idle(soak: Soak) -> tuple[dict[str, Any], float]:
    """Poll until no KV is used and nothing runs, waits or is parked; returns the last load."""
    start = time.monotonic()
    while True:
        async with soak.http.get(soak.url + "/v1/loads") as resp:
            load = (await resp.json())["loads"][0]
        _, fork = await asyncio.to_thread(reports, soak.url)
        busy = (load["num_used_tokens"], load["num_running_reqs"], load["num_waiting_reqs"],
                fork.get("parked", 0), fork.get("live_branches", 0), fork.get("open_phases", 0))
        if not any(busy) or time.monotonic() - start > IDLE_DEADLINE_S:
            return load, time.monotonic() - start
        await asyncio.sleep(0.2)


# ---- the run -------------------------------------------------------------------------------------
@dataclass
class End:
    """What the server looked like: scheduler pid and RSS after warm-up, state after the load."""

    pid: int
    rss0: float
    rss1: float = float("nan")
    alive: bool = False
    load: dict[str, Any] = field(default_factory=dict)
    idle_s: float = 0.0
    bw: dict[str, Any] = field(default_factory=dict)
    fork: dict[str, Any] = field(default_factory=dict)
    load_s: float = 0.0
    deferred0: int = 0  # TAPER rows deferred before the load (warm-up)
    orphans0: int = 0  # orphans the idle leak check freed before the load


async def measured_tpot_ms(soak: Soak, rows: int, tokens: int = 48) -> float:
    """The time per output token of `rows` serial requests decoding together, streamed and timed
    here (median over the requests): the step latency at that many rows on this server, now. As an
    SLO each request's own row meets it and extra branch rows push a step past it."""

    async def one(seq: int) -> float:
        payload = {"text": text(random.Random(seq)), "rid": f"{soak.run_id}-tpot{seq}", "stream": True,
                   "sampling_params": {"max_new_tokens": tokens, "ignore_eos": True, "temperature": 0}}
        marks: list[tuple[float, int]] = []
        async with soak.http.post(soak.url + "/generate", json=payload) as resp:
            if resp.status != 200:
                raise RuntimeError(f"TPOT probe: HTTP {resp.status}: {(await resp.text())[:300]}")
            async for line in resp.content:
                data = line.decode().strip().removeprefix("data:").strip()
                if data and data != "[DONE]":
                    marks.append((time.monotonic(), json.loads(data)["meta_info"]["completion_tokens"]))
        (first_s, first_tokens), (last_s, last_tokens) = marks[0], marks[-1]
        return (last_s - first_s) / max(last_tokens - first_tokens, 1)

    per_token = sorted(await asyncio.gather(*[one(seq) for seq in range(rows)]))
    return 1e3 * per_token[len(per_token) // 2]


@dataclass
class Result:
    outcomes: list[Outcome]
    checks: dict[str, tuple[bool, str]]
    info: list[str]
    end: End
    seconds: float

    @property
    def ok(self) -> bool:
        return all(passed for passed, _ in self.checks.values())


@dataclass(frozen=True, slots=True)
class SoakOptions:
    """One soak (its flags, parsed)."""

    url: str | None = None  # a running loopback server; None: --launch
    model: str = "models/tiny"
    server_args: str = ""
    minutes: float = 1.0
    concurrency: int = 12  # jobs in flight
    seed: int = 0
    max_jobs: int = 100_000
    job_timeout_s: float = 180.0  # a job without a final answer by then is lost
    rss_bound_mb: float = 256.0  # allowed scheduler VmRSS growth
    async_output: bool = False  # --launch with --async-output
    forward_thread: bool = False  # --launch with --async-output and env BRANCHWISE_FORWARD_THREAD=1
    deferring: bool = False  # every request carries the SLO measured after warm-up: TAPER defers


def run(url: str, opts: SoakOptions, server: LocalServer | None = None, stall_exit: bool = False) -> Result:
    """The soak against `url` (`server`: the launched server, for its process and log checks)."""
    return asyncio.run(_run(url, opts, server, stall_exit))


async def _run(url: str, opts: SoakOptions, server: LocalServer | None, stall_exit: bool) -> Result:
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as http:
        run_id = f"soak{os.getpid():x}{int(time.time()) % 100000:05d}"
        soak = Soak(url, opts.seed, http, run_id, opts.job_timeout_s, dict(MIX), stall_exit=stall_exit)
        try:
            start = time.monotonic()
            arm_stall_dump(soak)
            outcomes, watched, end = await _load(soak, opts)
            return Result(outcomes, checks(soak, opts, outcomes, watched, end, server), info(watched, end),
                          end, time.monotonic() - start)
        finally:
            faulthandler.cancel_dump_traceback_later()
            soak.pool.shutdown(wait=False, cancel_futures=True)


async def _load(soak: Soak, opts: SoakOptions) -> tuple[list[Outcome], Watch, End]:
    bw0, _ = await asyncio.to_thread(reports, soak.url)
    pid = int(bw0["pid"])
    # warm-up: one job of every kind (first frontend import, the driver's dill blob, first forks)
    warm_up = [run_job(soak, idx, kind) for idx, kind in enumerate(sorted(soak.mix))]
    outcomes = list(await asyncio.gather(*warm_up))
    await wait_idle(soak)
    end = End(pid, rss_mb(pid))
    print(f"warm-up: {len(outcomes)} jobs, scheduler pid {pid}, VmRSS {end.rss0:.0f} MiB", flush=True)
    bw1, fork1 = await asyncio.to_thread(reports, soak.url)
    end.deferred0 = (bw1.get("taper") or {}).get("rows_deferred", 0)
    end.orphans0 = (fork1.get("counters") or {}).get("orphans_freed", 0)
    if opts.deferring:
        running = (await asyncio.to_thread(get_json, soak.url + "/server_info")).get("max_running_requests")
        rows = min(opts.concurrency, running or opts.concurrency)
        soak.slo_ms = await measured_tpot_ms(soak, rows)
        await wait_idle(soak)
        print(f"deferring: every request's TPOT SLO {soak.slo_ms:.2f} ms (measured: {rows} serial requests "
              "decoding together)", flush=True)

    watched, stop = Watch(), asyncio.Event()
    watcher = asyncio.ensure_future(watch(soak, watched, stop))
    deadline = time.monotonic() + 60 * opts.minutes
    counter = iter(range(len(outcomes), len(outcomes) + opts.max_jobs))

    async def worker() -> None:
        for idx in counter:
            if time.monotonic() >= deadline:
                return
            outcomes.append(await run_job(soak, idx, job_kind(soak.seed, idx, soak.mix)))

    t_load = time.monotonic()
    await asyncio.gather(*[worker() for _ in range(opts.concurrency)])
    end.load_s = time.monotonic() - t_load
    stop.set()
    await watcher
    end.load, end.idle_s = await wait_idle(soak)
    end.bw, end.fork = await asyncio.to_thread(reports, soak.url)
    end.alive = Path(f"/proc/{pid}").exists()
    end.rss1 = rss_mb(pid) if end.alive else float("nan")
    return outcomes, watched, end


def checks(soak: Soak, opts: SoakOptions, outcomes: list[Outcome], watched: Watch, end: End,
           server: LocalServer | None) -> dict[str, tuple[bool, str]]:
    bad = [outcome for outcome in outcomes if outcome.result in ("LOST", "FAIL")]
    dup = {rid: count for rid, count in soak.answered.items() if count > 1}
    foreign = soak.foreign + [rid for rid in soak.answered if rid not in soak.sent]
    proc_ok = server is None or (server.proc is not None and server.proc.poll() is None)
    leaked = server is not None and server.log_path is not None and "Received output for" in \
        server.log_path.read_text(errors="replace")  # SGLang's line when an unknown rid reaches it
    res = residue(end.bw, end.fork)
    load, growth = end.load, end.rss1 - end.rss0
    orphans = end.fork.get("counters", {}).get("orphans_freed", 0) - end.orphans0
    deferred = end.bw.get("taper", {}).get("rows_deferred", 0) - end.deferred0
    out = {
        "lost": (not bad, f"{len(outcomes) - len(bad)}/{len(outcomes)} jobs ended as expected"
                 + "".join(f"\n    job {job.idx} {job.kind}: {job.result} {job.detail}" for job in bad[:20])),
        "duplicated": (not dup and not foreign and not soak.stream_extra and not leaked,
                       f"{sum(soak.answered.values())} final answers for {len(soak.answered)} rids; "
                       f"duplicated {len(dup)}, foreign {len(foreign)}, streams going on after their final "
                       f"{len(soak.stream_extra)}, branch output reaching the tokenizer {leaked}"
                       + (f"\n    {list(dup.items())[:5]} {foreign[:5]} {soak.stream_extra[:5]}"
                          if dup or foreign or soak.stream_extra else "")),
        "healthy": (not watched.unhealthy and int(end.bw["pid"]) == end.pid and end.alive and proc_ok,
                    f"{watched.polls} polls of /health and /v1/loads, {len(watched.unhealthy)} failed; "
                    f"scheduler pid {end.pid} -> {end.bw['pid']} (alive {end.alive}); "
                    f"server process alive {proc_ok}"
                    + "".join(f"\n    {failure}" for failure in watched.unhealthy[:5])),
        "idle": (not (load["num_used_tokens"] or load["num_running_reqs"] or load["num_waiting_reqs"]),
                 f"KV used {load['num_used_tokens']} tokens, running {load['num_running_reqs']}, waiting "
                 f"{load['num_waiting_reqs']} ({end.idle_s:.1f} s after the last job)"),
        "rss": (growth < opts.rss_bound_mb, f"scheduler VmRSS {end.rss0:.0f} -> {end.rss1:.0f} MiB "
                f"({growth:+.0f}, bound +{opts.rss_bound_mb:.0f})"),
        "dicts": (not res and orphans == 0,
                  ("Branchwise per-request state all empty" if not res else f"left: {res}")
                  + f"; idle leak check freed {orphans} orphans during the load"),
    }
    if opts.deferring:
        out["deferred"] = (deferred > 0,
                           f"TAPER deferred {deferred} rows during the load (SLO {soak.slo_ms:.2f} ms)")
    return out


def info(watched: Watch, end: End) -> list[str]:
    counters, taper = end.fork.get("counters", {}), end.bw.get("taper", {})
    return [
        f"load: {end.load_s:.0f} s; requests in flight at {watched.busy}/{watched.polls} polls, "
        f"waiting queue non-empty at {watched.waiting} "
        f"(max running {watched.max_running}, max waiting {watched.max_waiting})",
        f"server: {counters.get('forks', 0)} server-side forks, {counters.get('branches', 0)} branches, "
        f"{counters.get('joins', 0)} joins, {counters.get('parked_aborted', 0)} parked parents aborted, "
        f"{counters.get('orphans_freed', 0)} orphans freed; taper {taper.get('planned_steps', 0)} planned "
        f"steps, {taper.get('rows_deferred', 0)} rows deferred "
        f"({taper.get('rows_deferred', 0) - end.deferred0} during the load)",
    ]


def summary(result: Result) -> str:
    by_kind: dict[str, Counter[str]] = {}
    for outcome in result.outcomes:
        by_kind.setdefault(outcome.kind, Counter())[outcome.result] += 1
    lines = [f"soak: {len(result.outcomes)} jobs in {result.seconds:.0f} s", *result.info]
    for kind in sorted(by_kind):
        counts = by_kind[kind]
        lines.append(f"  {kind:<13} {sum(counts.values()):>5}  "
                     + ", ".join(f"{label} {count}" for label, count in sorted(counts.items())))
    for name, (passed, msg) in result.checks.items():
        lines.append(f"{'PASS' if passed else 'FAIL'} {name:<10} {msg}")
    lines.append("soak passed" if result.ok else "soak FAILED")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> SoakOptions:
    parser = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.split("\n\n")[0])
    add_server_source(parser, "a running server on this machine (loopback only)",
                      "start a server (the model is built if missing): " + " ".join(SERVER_ARGS))
    parser.add_argument("--server-args", default="",
                        help="extra flags for the --launch server, e.g. --async-output")
    parser.add_argument("--minutes", type=float, default=1.0)
    parser.add_argument("--concurrency", type=int, default=12, help="jobs in flight")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-jobs", type=int, default=100_000, help="stop after this many jobs in any case")
    parser.add_argument("--job-timeout-s", type=float, default=180.0,
                        help="a job without a final answer by then is lost")
    parser.add_argument("--rss-bound-mb", type=float, default=256.0, help="allowed scheduler VmRSS growth")
    parser.add_argument("--async-output", action="store_true", help="--launch with --async-output (Albireo)")
    parser.add_argument("--forward-thread", action="store_true",
                        help="--launch with --async-output and env BRANCHWISE_FORWARD_THREAD=1 "
                             "(the CPU forward thread)")
    parser.add_argument("--deferring", action="store_true",
                        help="stamp every request with the SLO measured after warm-up, at which TAPER "
                             "defers rows")
    args = parser.parse_args(argv)
    if args.url and not args.url.startswith(("http://127.0.0.1:", "http://localhost:", "http://[::1]:")):
        parser.error("--url must be a loopback address (the RSS check reads /proc of the scheduler)")
    if args.minutes <= 0 or args.concurrency < 1 or args.max_jobs < 1:
        parser.error("--minutes, --concurrency and --max-jobs must be positive")
    if (args.forward_thread or args.async_output) and args.url:
        parser.error("--async-output and --forward-thread are launch settings (a running server has its own)")
    return SoakOptions(args.url and args.url.rstrip("/"), args.model, args.server_args, args.minutes,
                       args.concurrency, args.seed, args.max_jobs, args.job_timeout_s, args.rss_bound_mb,
                       args.async_output, args.forward_thread, args.deferring)


def launch_args(opts: SoakOptions) -> list[str]:
    extra = shlex.split(opts.server_args)
    if (opts.async_output or opts.forward_thread) and "--async-output" not in extra:
        extra.append("--async-output")  # the forward thread runs under it
    return SERVER_ARGS + (DEFERRING_ARGS if opts.deferring else []) + extra


def launch_env(opts: SoakOptions) -> dict[str, str]:
    return {"BRANCHWISE_FORWARD_THREAD": "1"} if opts.forward_thread else {}


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(argv)
    server = None
    if opts.url is None:
        from branchwise.tools.tiny_model import build

        if not (Path(opts.model) / "config.json").exists():
            build(opts.model)
        server = LocalServer(str(opts.model), launch_args(opts), env=launch_env(opts)).start()
        print(f"server {server.url} (log {server.log_path})", flush=True)
    try:
        result = run(server.url if server else str(opts.url), opts, server, stall_exit=True)
        if server is not None and not result.ok:
            print(f"server log tail ({server.log_path}):\n{server.log_tail()}", flush=True)
    finally:
        if server is not None:
            server.stop()
    print(summary(result), flush=True)
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
