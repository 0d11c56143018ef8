"""Branch phases for unchanged SGLang frontend programs (`s.fork(n)` ... `join`).

`import branchwise.frontend_hook` (or `install()`, which `frontends.*` call)
patches SGLang's frontend in this process:

- `StreamExecutor.fork` syncs first. Stock fork reads `text_` before it syncs:
  while the worker thread still has the parent's ops queued, `text_` is "" and the prefix hint
  (SglCommitLazy, a max_new_tokens=0 request) is skipped, so the n siblings arrive together with an
  uncached fork-point prefix and FCFS prefills it redundantly. Syncing first always sends the hint.
- Each child of a fork(n > 1) is tagged (phase, branch, fanout); `RuntimeEndpoint.generate` and
  `generate_stream` of a tagged executor stamp `custom_params.branchwise` and a structured rid
  (branchwise.client.branch_rid). A fork inside a branch is a nested phase under the branch's rid.
- The fork-point prefix request carries SGLang's `routing_key` = the fork's phase id, so under data
  parallelism it lands on the DP rank its branches go to (branchwise.dp_dispatch).
- Every /generate of a program carries the program's key as the `X-SMG-Routing-Key` header (a fork's
  children inherit it), so behind an smg router the whole program (serial requests, fork prefix,
  branches) runs on one worker; a server ignores the header.

SGLang's plugin entry point runs only in server processes and the frontend never calls
`load_plugins()`, so client programs opt in by importing this module. The patch is lazy: when
`sglang.lang` is not imported yet, it is applied the moment it is, so importing Branchwise never
pulls in torch. install() is idempotent; uninstall() restores SGLang.

State: the installed hook is one `FrontendHook` object that sits in `sys.meta_path` (the finder
that patches the two frontend modules as they load); it holds the stamp defaults and what to
restore, and install()/uninstall() find it there. A pending stamp travels on the executor that
sends it (`_bw_stamp`, set by the generate wrapper and consumed by `_add_images`, which SGLang
calls with the executor and the request body right before each /generate), so nothing is kept per
thread or per module.
"""

from __future__ import annotations

import functools
import importlib.abc
import sys
import threading
from dataclasses import dataclass
from typing import Any

from branchwise import request_meta

INTERPRETER = "sglang.lang.interpreter"
ENDPOINT = "sglang.lang.backend.runtime_endpoint"
MODULES = (INTERPRETER, ENDPOINT)
EXTRA = ("slo_tpot_ms", "weight")  # fields install() may add to every branch stamp
ROUTE = "_branchwise_route"  # body field that carries the program's router key to http_request


@dataclass(frozen=True, slots=True)
class BranchTag:
    group: str  # phase id shared by the siblings
    index: int
    fanout: int

    @property
    def base(self) -> str:  # rid prefix of everything this branch sends
        return f"{self.group}/b{self.index}"


def _next_group(parent: Any) -> str:
    from branchwise.client import new_group

    ptag: BranchTag | None = getattr(parent, "_bw_tag", None)
    k = getattr(parent, "_bw_forks", 0)
    parent._bw_forks = k + 1
    return f"{ptag.base}/f{k}" if ptag else new_group()


def _tag_children(group: str, exes: list[Any]) -> None:
    for i, exe in enumerate(exes):
        exe._bw_tag, exe._bw_turn = BranchTag(group, i, len(exes)), 0


def _route(s: Any) -> str:
    """The router key of executor `s`'s program: made at its first request, inherited at fork()."""
    route = getattr(s, "_bw_route", None)
    if route is None:
        from branchwise.client import new_group

        route = s._bw_route = new_group("prog")
    return route


def _stamp_body(s: Any, data: Any) -> None:
    """Complete a /generate body in place: the stamp the executor's generate call queued, and the
    routing_key of a fork's prefix hint (set on the parent executor while fork() sends it)."""
    if not isinstance(data, dict):
        return
    data[ROUTE] = _route(s)  # taken out again by the http_request wrapper: it becomes the header
    if (group := getattr(s, "_bw_prefix_group", None)) is not None:
        data["routing_key"] = group
    pending = getattr(s, "_bw_stamp", None)
    if pending is not None and isinstance(data.get("text"), str):
        s._bw_stamp = None  # one stamp per gen call
        rid, fields = pending
        data["rid"] = rid
        data["sampling_params"] = request_meta.stamp(data.get("sampling_params"), **fields)


class _Loader(importlib.abc.Loader):
    def __init__(self, inner: Any, hook: FrontendHook, name: str) -> None:
        self.inner, self.hook, self.name = inner, hook, name

    def create_module(self, spec: Any) -> Any:
        return self.inner.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self.inner.exec_module(module)
        self.hook.apply(self.name, module)

    def __getattr__(self, attr: str) -> Any:  # get_source, get_filename, ... of the real loader
        return getattr(self.inner, attr)


class FrontendHook(importlib.abc.MetaPathFinder):
    """The installed frontend patch of this process (it lives in sys.meta_path while installed).

    As a finder it wraps the real loader of the two frontend modules, so the patch runs right after
    they are imported; it keeps the stamp defaults and the (owner, attribute, original) triples that
    uninstall() restores."""

    def __init__(self) -> None:
        self.defaults: dict[str, Any] = {}
        self.undo: list[tuple[Any, str, Any]] = []
        self.patched: set[str] = set()
        self.lock = threading.RLock()

    # ---- lazy application ----------------------------------------------------------------------
    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name not in MODULES or name in self.patched:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _Loader(spec.loader, self, name)
                return spec
        return None

    def apply(self, name: str, mod: Any) -> None:
        with self.lock:
            if name not in self.patched:
                (self._patch_interpreter if name == INTERPRETER else self._patch_endpoint)(mod)
                self.patched.add(name)

    def restore(self) -> None:
        with self.lock:
            while self.undo:
                owner, name, orig = self.undo.pop()
                setattr(owner, name, orig)
            self.patched.clear()

    # ---- patches -------------------------------------------------------------------------------
    def _set(self, owner: Any, name: str, new: Any) -> None:
        self.undo.append((owner, name, getattr(owner, name)))
        setattr(owner, name, new)

    def _patch_interpreter(self, mod: Any) -> None:
        orig = mod.StreamExecutor.fork

        @functools.wraps(orig)
        def fork(s: Any, size: int = 1, position_ids_offset: Any = None) -> list[Any]:
            s.sync()  # the race fix: text_ is final before stock fork decides on the prefix hint
            s._bw_prefix_group = _next_group(s) if int(size) > 1 else None  # the hint's routing_key
            try:
                exes = orig(s, size, position_ids_offset)
            finally:
                group, s._bw_prefix_group = s._bw_prefix_group, None
            for exe in exes:
                exe._bw_route = _route(s)
            if len(exes) > 1:
                _tag_children(group, exes)
            return exes

        self._set(mod.StreamExecutor, "fork", fork)

    def _arm(self, s: Any) -> None:
        """Queue the stamp for the next /generate body executor `s` sends (a tagged branch only)."""
        from branchwise.client import branch_rid

        tag: BranchTag | None = getattr(s, "_bw_tag", None)
        if tag is None:
            return
        rid = branch_rid(tag.group, tag.index, s._bw_turn)
        s._bw_turn += 1
        s._bw_stamp = (rid, {"phase": tag.group, "branch": tag.index, "fanout": tag.fanout, **self.defaults})

    def _patch_endpoint(self, mod: Any) -> None:
        cls = mod.RuntimeEndpoint
        gen, gen_stream, add_images = cls.generate, cls.generate_stream, cls._add_images
        arm = self._arm

        @functools.wraps(gen)
        def generate(self: Any, s: Any, *args: Any, **kw: Any) -> Any:
            arm(s)
            try:
                return gen(self, s, *args, **kw)
            finally:
                s._bw_stamp = None

        @functools.wraps(gen_stream)
        def generate_stream(self: Any, s: Any, *args: Any, **kw: Any) -> Any:
            arm(s)  # the request is sent at the first next(), in this same worker thread
            try:
                yield from gen_stream(self, s, *args, **kw)
            finally:
                s._bw_stamp = None

        @functools.wraps(add_images)
        def _add_images(self: Any, s: Any, data: Any) -> Any:
            _stamp_body(s, data)
            return add_images(self, s, data)

        self._set(cls, "generate", generate)
        self._set(cls, "generate_stream", generate_stream)
        self._set(cls, "_add_images", _add_images)
        self._set(mod, "http_request", _routed(mod.http_request))


def _routed(http_request: Any) -> Any:
    """The endpoint module's http_request, sending a body's ROUTE as the router header (requests'
    Response has the status_code/json()/iter_lines() that RuntimeEndpoint reads from either kind)."""

    @functools.wraps(http_request)
    def send(url: str, json: Any = None, stream: bool = False, api_key: Any = None, verify: Any = None,
             method: Any = None) -> Any:
        route = json.pop(ROUTE, None) if isinstance(json, dict) else None
        if route is None:
            return http_request(url, json=json, stream=stream, api_key=api_key, verify=verify, method=method)
        import requests

        from branchwise.client import routing_headers

        headers = {"Content-Type": "application/json; charset=utf-8", **routing_headers(None, route)}
        if api_key is not None:
            headers["Authorization"] = f"Bearer {api_key}"
        return requests.post(url, json=json, stream=stream, headers=headers,
                             verify=verify if verify is not None else True)

    return send


def _current() -> FrontendHook | None:
    return next((f for f in sys.meta_path if isinstance(f, FrontendHook)), None)


def install(**defaults: Any) -> None:
    """Enable stamping + the fork race fix (idempotent). `defaults` (slo_tpot_ms, weight) are added
    to every branch stamp from now on."""
    bad = set(defaults) - set(EXTRA)
    if bad:
        raise ValueError(f"install() takes only {EXTRA}, got {sorted(bad)}")
    request_meta.stamp({}, **defaults)  # validate
    hook = _current()
    if hook is None:
        hook = FrontendHook()
        sys.meta_path.insert(0, hook)
    with hook.lock:
        hook.defaults.update({k: v for k, v in defaults.items() if v is not None})
        for name in MODULES:
            if name in sys.modules:
                hook.apply(name, sys.modules[name])


def uninstall() -> None:
    """Restore stock SGLang (for A/B measurements); executors keep their tags but send nothing."""
    hook = _current()
    if hook is not None:
        hook.restore()
        sys.meta_path.remove(hook)


def installed() -> bool:
    hook = _current()
    return hook is not None and hook.patched == set(MODULES)


install()
