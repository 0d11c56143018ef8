"""branchwise.client and the frontend fork hook, against a fake /generate endpoint (no SGLang server)."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator

import pytest
from aiohttp import web

from branchwise import client, frontend_hook, request_meta
from branchwise.tools.launch import free_port


# ---- stamps and rids ----------------------------------------------------------------------------
def test_branch_rids_are_structured_and_never_prefix_a_sibling():
    g = client.new_group()
    assert g.startswith("fork-") and len(g) == len("fork-") + 12 and g != client.new_group()
    rids = [client.branch_rid(g, i, t) for i in range(12) for t in range(3)]
    assert client.branch_rid(g, 3) == f"{g}/b3/0"
    assert len(set(rids)) == len(rids) and all(r.startswith(g + "/") for r in rids)
    for a in rids:  # SGLang aborts every rid that startswith the aborted one: hit only itself
        assert [b for b in rids if b.startswith(a)] == [a]


def test_bad_rid_inputs_fail():
    for bad in (("", 0), ("g", -1)):
        with pytest.raises(ValueError):
            client.branch_rid(*bad)
    with pytest.raises(ValueError, match="free of '/'"):
        client.new_group("a/b")


def test_stamp_branch_merges_and_validates():
    sp = {"max_new_tokens": 8, "custom_params": {"other": 1}}
    out = client.stamp_branch(sp, "grp", 2, 4, slo_tpot_ms=40)
    assert out["custom_params"] == {"other": 1, "branchwise": {"phase": "grp", "branch": 2, "fanout": 4,
                                                               "slo_tpot_ms": 40}}
    assert sp == {"max_new_tokens": 8, "custom_params": {"other": 1}}  # input untouched
    meta = request_meta.parse(out["custom_params"])
    assert (meta.phase, meta.branch, meta.fanout, meta.slo_tpot_ms) == ("grp", 2, 4, 40.0)
    with pytest.raises(request_meta.MetaError, match="branch 4 must be < fanout 4"):
        client.stamp_branch(None, "grp", 4, 4)
    with pytest.raises(request_meta.MetaError, match="slo_tpot_ms"):
        client.stamp_branch(None, "grp", 0, 2, slo_tpot_ms=-1)


def test_stamp_serial_grammar():
    assert client.stamp_serial({}, grammar="sprint")["custom_params"]["branchwise"] == {"grammar": "sprint"}
    with pytest.raises(request_meta.MetaError, match="grammar 'bogus'"):
        client.stamp_serial({}, grammar="bogus")


def test_dead_server_is_a_connection_error_naming_the_url():
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(ConnectionError, match=url):
        client.generate_sync(url, "hi", {"max_new_tokens": 1})


def test_bad_input_fails_before_sending():
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens: a ConnectionError would mean we sent it
    with pytest.raises(ValueError, match="exactly one of text and input_ids"):
        client.generate_sync(url, "hi", input_ids=[1, 2])
    with pytest.raises(request_meta.MetaError, match="unknown custom_params.branchwise keys"):
        client.generate_sync(url, "hi", {"custom_params": {"branchwise": {"group": "x"}}})
    with pytest.raises(ValueError, match="rid"):
        client.generate_sync(url, "hi", rid="")


# ---- fake /generate -------------------------------------------------------------------------------
class Fake:
    """A minimal SGLang-shaped HTTP server in a background thread; records every /generate body."""

    def __init__(self) -> None:
        self.bodies: list[dict] = []
        self.routes: list[str | None] = []  # each request's router header
        self.port = free_port()
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _meta(self, body: dict, n: int) -> dict:
        return {"id": body.get("rid", "auto"), "prompt_tokens": len(body.get("text", "")),
                "completion_tokens": n, "cached_tokens": 0, "finish_reason": {"type": "length"}}

    async def generate(self, req: web.Request) -> web.StreamResponse:
        body = await req.json()
        self.bodies.append(body)
        self.routes.append(req.headers.get(client.ROUTING_HEADER))
        n = int(body.get("sampling_params", {}).get("max_new_tokens", 4))
        if body.get("text") == "bad":
            return web.json_response({"error": {"message": "Branchwise: nope"}}, status=400)
        if not body.get("stream"):
            return web.json_response({"text": "x" * n, "output_ids": list(range(n)), "meta_info": self._meta(body, n)})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(req)
        for k in range(1, n + 1):
            meta = self._meta(body, k)
            if body.get("text") == "badstream" and k == n:
                meta["finish_reason"] = {"type": "abort", "message": "Branchwise: bad", "status_code": 400}
            text = "y" * 100_000 * k if body.get("text") == "long" else "x" * k  # > aiohttp's line limit
            chunk = {"text": text, "output_ids": list(range(k)), "meta_info": meta}
            await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def model_info(self, req: web.Request) -> web.Response:
        return web.json_response({"model_path": "fake", "is_generation": True})

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        app = web.Application()
        app.router.add_post("/generate", self.generate)
        app.router.add_get("/get_model_info", self.model_info)
        self.runner = web.AppRunner(app)
        self.loop.run_until_complete(self.runner.setup())
        self.loop.run_until_complete(web.TCPSite(self.runner, "127.0.0.1", self.port).start())
        self.ready.set()
        self.loop.run_forever()

    def __enter__(self) -> Fake:
        self.thread.start()
        self.ready.wait(10)
        return self

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture
def fake() -> Iterator[Fake]:
    with Fake() as f:
        yield f


def test_generate_plain_and_streaming(fake):
    g = client.generate_sync(fake.url, "hi", {"max_new_tokens": 3}, rid="g/b0/0")
    assert (g.text, g.output_ids, g.rid, g.completion_tokens) == ("xxx", [0, 1, 2], "g/b0/0", 3)
    assert g.chunk_times == [] and fake.bodies[-1]["rid"] == "g/b0/0"
    s = client.generate_sync(fake.url, "hi", {"max_new_tokens": 5}, stream=True)
    assert (s.text, s.output_ids, s.chunk_tokens) == ("xxxxx", [0, 1, 2, 3, 4], [1] * 5)
    assert len(s.chunk_times) == 5 and s.start <= s.chunk_times[0] <= s.chunk_times[-1] <= s.end
    assert s.ttft is not None and s.ttft >= 0
    big = client.generate_sync(fake.url, "long", {"max_new_tokens": 3}, stream=True)
    assert len(big.text) == 300_000 and big.chunk_tokens == [1, 1, 1]


def test_server_errors_raise_generate_error(fake):
    with pytest.raises(client.GenerateError, match="HTTP 400: Branchwise: nope") as e:
        client.generate_sync(fake.url, "bad", {"max_new_tokens": 2})
    assert e.value.status == 400 and e.value.url == fake.url
    with pytest.raises(client.GenerateError, match="HTTP 400: Branchwise: bad"):  # error inside HTTP 200
        client.generate_sync(fake.url, "badstream", {"max_new_tokens": 2}, stream=True)


def test_fork_sends_stamped_siblings(fake):
    gens = asyncio.run(client.fork(fake.url, ["a", "b", "c"], {"max_new_tokens": 2}, group="grp"))
    assert [g.rid for g in gens] == ["grp/b0/0", "grp/b1/0", "grp/b2/0"]
    stamps = sorted((b["text"], b["sampling_params"]["custom_params"]["branchwise"]) for b in fake.bodies)
    assert stamps == [(t, {"phase": "grp", "branch": i, "fanout": 3}) for i, t in enumerate("abc")]
    assert fake.routes == ["grp"] * 3  # behind a router the phase goes to one worker


def test_routing_header_is_the_phase_root_or_the_given_key(fake):
    nested = client.stamp_branch({}, "g/b1/f0", 0, 2)
    assert client.routing_headers(nested) == {client.ROUTING_HEADER: "g"}  # follows its parent phase
    assert client.routing_headers(nested, routing_key="conv-7") == {client.ROUTING_HEADER: "conv-7"}
    assert client.routing_headers({"max_new_tokens": 1}) == {} and client.routing_headers(None) == {}
    long = client.routing_headers(None, "k" * 300)[client.ROUTING_HEADER]
    assert long == "k" * client.MAX_ROUTING_KEY_BYTES  # smg would ignore a longer key
    client.generate_sync(fake.url, "hi", {"max_new_tokens": 1}, routing_key="conv-7")
    client.generate_sync(fake.url, "hi", {"max_new_tokens": 1})
    assert fake.routes == ["conv-7", None]


# ---- the frontend hook on an unchanged SGLang program ----------------------------------------------
def _program():
    import sglang as sgl

    @sgl.function
    def prog(s):
        s += "question"
        s += sgl.gen("head", max_tokens=3)
        forks = s.fork(3)  # no explicit sync
        for i in range(3):
            forks[i] += f" b{i}"
            forks[i] += sgl.gen("x", max_tokens=2)
            inner = forks[i].fork(2) if i == 1 else None  # nested phase inside branch 1
            if inner is not None:
                for j in range(2):
                    inner[j] += sgl.gen("y", max_tokens=1)
                inner.join()
            forks[i] += sgl.gen("z", max_tokens=1)  # second request of the same branch
        forks.join()
        s += sgl.gen("tail", max_tokens=2)

    return prog


@pytest.mark.parametrize("stream", [False, True])
def test_hook_stamps_branches_and_commits_the_prefix_first(fake, stream):
    import sglang as sgl

    frontend_hook.install()
    frontend_hook.install()  # idempotent
    assert frontend_hook.installed()  # sglang's frontend is imported: patched now
    state = _program().run(backend=sgl.RuntimeEndpoint(fake.url), stream=stream)
    if stream:
        assert "".join(state.text_iter()).endswith("xx")  # runs to the end (generate_stream path)
    assert state.error() is None
    bodies = fake.bodies
    head, commit = bodies[0], bodies[1]
    assert "custom_params" not in head["sampling_params"] and "rid" not in head
    assert commit["sampling_params"] == {"max_new_tokens": 0} and commit["text"] == "questionxxx"
    stamped = [b for b in bodies if "custom_params" in b.get("sampling_params", {})]
    assert bodies.index(stamped[0]) > 1  # every branch request after the prefix hint
    assert all(b.get("stream", False) is stream for b in stamped)  # generate / generate_stream path
    group = stamped[0]["rid"].split("/")[0]
    by_rid = {b["rid"]: b["sampling_params"]["custom_params"]["branchwise"] for b in stamped}
    expect = {f"{group}/b{i}/{t}": {"phase": group, "branch": i, "fanout": 3} for i in range(3) for t in (0, 1)}
    nested = f"{group}/b1/f0"
    expect |= {f"{nested}/b{j}/0": {"phase": nested, "branch": j, "fanout": 2} for j in range(2)}
    assert by_rid == expect
    hints = [b["routing_key"] for b in bodies if b["sampling_params"] == {"max_new_tokens": 0}]
    assert hints == [group, nested]  # each fork's prefix hint routes with its phase (dp_dispatch)
    assert not any("routing_key" in b for b in bodies if b["sampling_params"] != {"max_new_tokens": 0})
    tail = bodies[-1]
    assert tail["text"].startswith("questionxxx") and "custom_params" not in tail["sampling_params"]
    # one router key for every request of the program (children inherit it), never in a body
    assert len(set(fake.routes)) == 1 and fake.routes[0].startswith("prog-")
    assert not any(frontend_hook.ROUTE in b for b in bodies)
    n = len(bodies)
    assert _program().run(backend=sgl.RuntimeEndpoint(fake.url)).error() is None
    assert len(set(fake.routes[n:])) == 1 and fake.routes[n] != fake.routes[0]  # another program


def test_uninstall_restores_stock_sglang(fake):
    import sglang as sgl
    from sglang.lang import interpreter

    frontend_hook.uninstall()
    try:
        assert not frontend_hook.installed() and not hasattr(interpreter.StreamExecutor.fork, "__wrapped__")
        assert _program().run(backend=sgl.RuntimeEndpoint(fake.url)).error() is None
        assert not any("custom_params" in b["sampling_params"] or "rid" in b for b in fake.bodies)
    finally:
        frontend_hook.install()


def test_install_defaults_reach_every_branch_stamp(fake):
    import sglang as sgl

    with pytest.raises(ValueError, match="install\\(\\) takes only"):
        frontend_hook.install(phase="x")
    with pytest.raises(request_meta.MetaError):
        frontend_hook.install(weight=-1)
    frontend_hook.uninstall()
    try:
        frontend_hook.install(slo_tpot_ms=25, weight=2)
        assert _program().run(backend=sgl.RuntimeEndpoint(fake.url)).error() is None
    finally:
        frontend_hook.uninstall()
        frontend_hook.install()
    stamps = [b["sampling_params"]["custom_params"]["branchwise"] for b in fake.bodies
              if "custom_params" in b["sampling_params"]]
    assert len(stamps) == 8 and all(st["slo_tpot_ms"] == 25 and st["weight"] == 2 for st in stamps)


def test_no_import_cycles_and_no_hook_state_outside_sys_meta_path():
    """client does not import the frontend hook (it imports client lazily, one way), and fork does
    not import plugin; the installed hook is the one FrontendHook in sys.meta_path."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "BRANCHWISE_FRONTEND_HOOK": "0"}  # the venv's .pth would import the hook
    code = ("import sys, branchwise.client, branchwise.fork.hooks; "
            "assert 'branchwise.frontend_hook' not in sys.modules, 'client imports frontend_hook'; "
            "assert 'branchwise.plugin' not in sys.modules, 'fork imports plugin'")
    subprocess.run([sys.executable, "-c", code], check=True, env=env)
    hooks = [f for f in sys.meta_path if isinstance(f, frontend_hook.FrontendHook)]
    assert len(hooks) == 1
    frontend_hook.install()
    assert [f for f in sys.meta_path if isinstance(f, frontend_hook.FrontendHook)] == hooks
