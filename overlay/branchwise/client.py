"""Client side: branch stamps, structured rids, an async /generate client (docs/design/client-phases.md)."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from branchwise import request_meta
from branchwise.request_meta import affinity_key, branch_rid

ROUTING_HEADER = "X-SMG-Routing-Key"
MAX_ROUTING_KEY_BYTES = 128  # smg ignores a longer key (and routes by the prompt instead)


def new_group(prefix: str = "fork") -> str:
    """A fresh phase/group id. Fixed-length hex, so no group id prefixes another."""
    if not prefix or "/" in prefix:
        raise ValueError(f"group prefix must be non-empty and free of '/', got {prefix!r}")
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


def stamp_branch(sampling_params: dict[str, Any] | None, group: str, branch: int, fanout: int,
                 slo_tpot_ms: float | None = None, weight: float | None = None) -> dict[str, Any]:
    """sampling_params stamped as branch `branch` of `fanout` in phase `group` (validated here)."""
    return request_meta.stamp(sampling_params, phase=group, branch=branch, fanout=fanout,
                              slo_tpot_ms=slo_tpot_ms, weight=weight)


def stamp_serial(sampling_params: dict[str, Any] | None, slo_tpot_ms: float | None = None,
                 weight: float | None = None, grammar: str | None = None) -> dict[str, Any]:
    """sampling_params of a serial request, with its SLO/weight and optional server-side grammar."""
    return request_meta.stamp(sampling_params, slo_tpot_ms=slo_tpot_ms, weight=weight, grammar=grammar)


def routing_headers(sampling_params: dict[str, Any] | None, routing_key: str | None = None) -> dict[str, str]:
    """The router header of a request: its routing key or stamp's phase, to the first "/" ({} if neither)."""
    custom = sampling_params.get("custom_params") if isinstance(sampling_params, dict) else None
    key = affinity_key(None, routing_key) if routing_key is not None else affinity_key(custom)
    if key is None:
        return {}
    return {ROUTING_HEADER: key.encode()[:MAX_ROUTING_KEY_BYTES].decode(errors="ignore")}


class GenerateError(RuntimeError):
    """The server answered /generate with an error (HTTP status, or an error chunk in a stream)."""

    def __init__(self, url: str, status: int, message: str, path: str = "/generate") -> None:
        super().__init__(f"{url}{path} -> HTTP {status}: {message}")
        self.url, self.status, self.message = url, status, message


@dataclass(slots=True)
class Generation:
    """One /generate answer, with the client-side times a benchmark needs."""

    text: str
    output_ids: list[int]
    meta_info: dict[str, Any]
    rid: str | None = None
    start: float = 0.0  # time.perf_counter() when the request was sent
    end: float = 0.0  # ... when the last byte arrived
    chunk_times: list[float] = field(default_factory=list)  # streaming: arrival of each chunk
    chunk_tokens: list[int] = field(default_factory=list)  # streaming: new tokens in each chunk

    @property
    def prompt_tokens(self) -> int:
        return int(self.meta_info.get("prompt_tokens", 0))

    @property
    def completion_tokens(self) -> int:
        return int(self.meta_info.get("completion_tokens", len(self.output_ids)))

    @property
    def cached_tokens(self) -> int:
        return int(self.meta_info.get("cached_tokens", 0))

    @property
    def finish_reason(self) -> dict[str, Any]:
        return self.meta_info.get("finish_reason") or {}

    @property
    def aborted(self) -> bool:
        return self.finish_reason.get("type") == "abort"

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.start if self.chunk_times else None


def _error_message(body: str) -> str:
    try:
        err = json.loads(body).get("error", body)
    except (ValueError, AttributeError):
        return body.strip()
    return str(err.get("message", err)) if isinstance(err, dict) else str(err)


def _payload(text: str | None, input_ids: list[int] | None, sampling_params: dict[str, Any] | None,
             rid: str | None, stream: bool, check: bool) -> dict[str, Any]:
    if (text is None) == (input_ids is None):
        raise ValueError("pass exactly one of text and input_ids")
    if rid is not None and (not isinstance(rid, str) or not rid):
        raise ValueError(f"rid must be a non-empty string, got {rid!r}")
    if check:  # bad stamps fail here, not as a 400 from the server
        request_meta.parse((sampling_params or {}).get("custom_params"))
    body: dict[str, Any] = {"sampling_params": dict(sampling_params or {}), "stream": stream}
    body["text" if text is not None else "input_ids"] = text if text is not None else input_ids
    if rid is not None:
        body["rid"] = rid
    return body


async def _read_stream(resp: aiohttp.ClientResponse, url: str, gens: list[Generation]) -> None:
    """Parse SGLang's SSE stream into gens, one per sample (why events are split here: code-notes.md)."""
    last: list[dict[str, Any]] = [{} for _ in gens]
    seen = [0] * len(gens)  # tokens so far (meta_info.completion_tokens is cumulative)
    buf = b""
    async for piece in resp.content.iter_any():
        now = time.perf_counter()
        *events, buf = (buf + piece).split(b"\n\n")
        for event in events:
            data = event.decode().strip().removeprefix("data:").strip()
            if not data or data == "[DONE]":
                continue
            chunk = json.loads(data)
            if "error" in chunk:  # SGLang streams errors as a chunk inside an HTTP 200
                err = chunk["error"]
                raise GenerateError(url, int(err.get("code", 400)), str(err.get("message", err)))
            i = int(chunk.get("index", 0))
            n = int(chunk.get("meta_info", {}).get("completion_tokens", seen[i]))
            gens[i].chunk_times.append(now)
            gens[i].chunk_tokens.append(n - seen[i])
            seen[i], last[i] = n, chunk
    for gen, chunk in zip(gens, last, strict=True):
        gen.text, gen.meta_info = chunk.get("text", ""), chunk.get("meta_info", {})
        gen.output_ids = list(chunk.get("output_ids", []))  # cumulative in every chunk
        fr = gen.finish_reason
        if fr.get("type") == "abort" and fr.get("status_code"):  # rejected (e.g. a bad stamp): HTTP 200 here
            raise GenerateError(url, int(fr["status_code"]), str(fr.get("message", "aborted")))


async def generate(url: str, text: str | None = None, sampling_params: dict[str, Any] | None = None,
                   rid: str | None = None, stream: bool = False, *, input_ids: list[int] | None = None,
                   session: aiohttp.ClientSession | None = None, timeout_s: float | None = 600,
                   check: bool = True, routing_key: str | None = None) -> Generation:
    """POST url/generate; ConnectionError if nothing listens, GenerateError on an error answer."""
    body = _payload(text, input_ids, sampling_params, rid, stream, check)
    headers = routing_headers(sampling_params, routing_key)
    return (await _post(url, body, headers, 1, rid, session, timeout_s))[0]


async def generate_samples(url: str, text: str | None = None, sampling_params: dict[str, Any] | None = None,
                           rid: str | None = None, *, input_ids: list[int] | None = None,
                           session: aiohttp.ClientSession | None = None,
                           timeout_s: float | None = 600) -> list[Generation]:
    """One streamed request for `sampling_params["n"]` samples of one prompt: one Generation per sample."""
    n = (sampling_params or {}).get("n", 1)
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"sampling_params.n must be an integer >= 1, got {n!r}")
    body = _payload(text, input_ids, sampling_params, rid, True, True)
    return await _post(url, body, routing_headers(sampling_params), n, rid, session, timeout_s)


async def _post(url: str, body: dict[str, Any], headers: dict[str, str], n: int, rid: str | None,
                session: aiohttp.ClientSession | None, timeout_s: float | None) -> list[Generation]:
    url = url.rstrip("/")
    own = session is None
    session = session or aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s))
    start = time.perf_counter()
    gens = [Generation("", [], {}, rid, start=start) for _ in range(n)]
    try:
        async with session.post(url + "/generate", json=body, headers=headers) as resp:
            if resp.status != 200:
                raise GenerateError(url, resp.status, _error_message(await resp.text()))
            if body["stream"]:
                await _read_stream(resp, url, gens)
            else:
                out = await resp.json()
                for gen, o in zip(gens, out if isinstance(out, list) else [out], strict=True):
                    gen.text, gen.meta_info = o["text"], o["meta_info"]
                    gen.output_ids = list(o.get("output_ids", []))
    except (TimeoutError, aiohttp.ClientConnectionError) as e:
        raise ConnectionError(f"SGLang server at {url} unreachable or timed out: {e!r}") from e
    finally:
        if own:
            await session.close()
    end = time.perf_counter()
    for gen in gens:
        gen.end = end
        gen.rid = gen.meta_info.get("id", rid)
    return gens


def generate_sync(url: str, text: str | None = None, sampling_params: dict[str, Any] | None = None,
                  rid: str | None = None, stream: bool = False, **kw: Any) -> Generation:
    """Blocking generate() for scripts and threads that have no event loop."""
    return asyncio.run(generate(url, text, sampling_params, rid, stream, **kw))


async def fork(url: str, texts: list[str], sampling_params: dict[str, Any] | None = None, *,
               group: str | None = None, stream: bool = False, slo_tpot_ms: float | None = None,
               session: aiohttp.ClientSession | None = None) -> list[Generation]:
    """One parallel phase: send texts[i] as branch i of a fresh group, concurrently; results in order."""
    group = group or new_group()
    fanout = len(texts)
    if fanout < 1:
        raise ValueError("fork needs at least one branch text")
    reqs = [generate(url, text, stamp_branch(sampling_params, group, branch, fanout, slo_tpot_ms),
                     branch_rid(group, branch), stream, session=session) for branch, text in enumerate(texts)]
    return list(await asyncio.gather(*reqs))


async def abort(url: str, rid: str, session: aiohttp.ClientSession | None = None) -> None:
    """Abort in-flight requests by exact rid (branch_rid), one per request: SGLang aborts by prefix."""
    url = url.rstrip("/")
    own = session is None
    session = session or aiohttp.ClientSession()
    try:
        async with session.post(url + "/abort_request", json={"rid": rid}) as resp:
            if resp.status != 200:
                raise GenerateError(url, resp.status, _error_message(await resp.text()), "/abort_request")
    except aiohttp.ClientConnectionError as e:
        raise ConnectionError(f"SGLang server at {url} unreachable: {e!r}") from e
    finally:
        if own:
            await session.close()
