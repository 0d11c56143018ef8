"""Branch phases for unchanged SGLang frontend programs (`s.fork(n)` ... `join`).
Design: docs/design/client-phases.md."""

from __future__ import annotations

import functools
import importlib.abc
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any

from branchwise import request_meta

if TYPE_CHECKING:
    from collections.abc import Iterator
    from importlib.machinery import ModuleSpec

    from sglang.lang.backend.runtime_endpoint import RuntimeEndpoint
    from sglang.lang.interpreter import StreamExecutor

INTERPRETER = "sglang.lang.interpreter"
ENDPOINT = "sglang.lang.backend.runtime_endpoint"
MODULES = (INTERPRETER, ENDPOINT)
EXTRA = ("slo_tpot_ms", "weight")  # fields install() may add to every branch stamp
ROUTE = "_branchwise_route"  # body field that carries the program's router key to http_request


@dataclass(frozen=True, slots=True, kw_only=True)
class BranchTag:
    """A forked child executor's place in its phase."""

    group: str  # phase id shared by the siblings
    index: int
    fanout: int

    @property
    def base(self) -> str:  # rid prefix of everything this branch sends
        return f"{self.group}/b{self.index}"


def _next_group(parent: StreamExecutor) -> str:
    from branchwise.client import new_group

    parent_tag: BranchTag | None = getattr(parent, "_bw_tag", None)
    forks = getattr(parent, "_bw_forks", 0)
    parent._bw_forks = forks + 1
    return f"{parent_tag.base}/f{forks}" if parent_tag else new_group()


def _tag_children(group: str, children: list[StreamExecutor]) -> None:
    for index, child in enumerate(children):
        child._bw_tag = BranchTag(group=group, index=index, fanout=len(children))
        child._bw_turn = 0


def _route(executor: StreamExecutor) -> str:
    """The router key of the executor's program: made at its first request, inherited at fork()."""
    route = getattr(executor, "_bw_route", None)
    if route is None:
        from branchwise.client import new_group

        route = executor._bw_route = new_group("prog")
    return route


def _stamp_body(executor: StreamExecutor, data: object) -> None:
    """Complete a /generate body in place: the stamp the executor's generate call queued, and the
    routing_key of a fork's prefix hint (set on the parent executor while fork() sends it)."""
    if not isinstance(data, dict):
        return
    data[ROUTE] = _route(executor)  # taken out again by the http_request wrapper: it becomes the header
    if (group := getattr(executor, "_bw_prefix_group", None)) is not None:
        data["routing_key"] = group
    pending = getattr(executor, "_bw_stamp", None)
    if pending is not None and isinstance(data.get("text"), str):
        executor._bw_stamp = None  # one stamp per gen call
        rid, fields = pending
        data["rid"] = rid
        data["sampling_params"] = request_meta.stamp(data.get("sampling_params"), **fields)


class _Loader(importlib.abc.Loader):
    """The real loader of a frontend module, with the patch applied right after the module runs."""

    def __init__(self, inner: importlib.abc.Loader, hook: FrontendHook, name: str) -> None:
        self.inner, self.hook, self.name = inner, hook, name

    def create_module(self, spec: ModuleSpec) -> ModuleType | None:
        return self.inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.inner.exec_module(module)
        self.hook.apply(self.name, module)

    def __getattr__(self, attr: str) -> Any:  # get_source, get_filename, ... of the real loader
        return getattr(self.inner, attr)


class FrontendHook(importlib.abc.MetaPathFinder):
    """The installed frontend patch of this process (it lives in sys.meta_path while installed)."""

    def __init__(self) -> None:
        self.defaults: dict[str, float] = {}
        self.undo: list[tuple[object, str, object]] = []  # (owner, attribute, original)
        self.patched: set[str] = set()
        self.lock = threading.RLock()

    # ---- lazy application ----------------------------------------------------------------------
    def find_spec(self, name: str, path: list[str] | None,
                  target: ModuleType | None = None) -> ModuleSpec | None:
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

    def apply(self, name: str, mod: ModuleType) -> None:
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
    def _set(self, owner: object, name: str, new: object) -> None:
        self.undo.append((owner, name, getattr(owner, name)))
        setattr(owner, name, new)

    def _patch_interpreter(self, mod: ModuleType) -> None:
        orig = mod.StreamExecutor.fork

        @functools.wraps(orig)
        def fork(executor: StreamExecutor, size: int = 1,
                 position_ids_offset: list[int] | None = None) -> list[StreamExecutor]:
            executor.sync()  # the race fix: text_ is final before stock fork decides on the prefix hint
            # the hint's routing_key
            executor._bw_prefix_group = _next_group(executor) if int(size) > 1 else None
            try:
                children = orig(executor, size, position_ids_offset)
            finally:
                group, executor._bw_prefix_group = executor._bw_prefix_group, None
            for child in children:
                child._bw_route = _route(executor)
            if len(children) > 1:
                _tag_children(group, children)
            return children

        self._set(mod.StreamExecutor, "fork", fork)

    def _arm(self, executor: StreamExecutor) -> None:
        """Queue the stamp for the next /generate body the executor sends (a tagged branch only)."""
        tag: BranchTag | None = getattr(executor, "_bw_tag", None)
        if tag is None:
            return
        rid = request_meta.branch_rid(tag.group, tag.index, executor._bw_turn)
        executor._bw_turn += 1
        executor._bw_stamp = (rid, {"phase": tag.group, "branch": tag.index, "fanout": tag.fanout,
                                    **self.defaults})

    def _patch_endpoint(self, mod: ModuleType) -> None:
        cls = mod.RuntimeEndpoint
        gen, gen_stream, add_images = cls.generate, cls.generate_stream, cls._add_images
        arm = self._arm

        @functools.wraps(gen)
        def generate(endpoint: RuntimeEndpoint, executor: StreamExecutor, *args: Any, **kw: Any) -> Any:
            arm(executor)
            try:
                return gen(endpoint, executor, *args, **kw)
            finally:
                executor._bw_stamp = None

        @functools.wraps(gen_stream)
        def generate_stream(endpoint: RuntimeEndpoint, executor: StreamExecutor, *args: Any,
                            **kw: Any) -> Iterator[Any]:
            arm(executor)  # the request is sent at the first next(), in this same worker thread
            try:
                yield from gen_stream(endpoint, executor, *args, **kw)
            finally:
                executor._bw_stamp = None

        @functools.wraps(add_images)
        def _add_images(endpoint: RuntimeEndpoint, executor: StreamExecutor, data: object) -> None:
            _stamp_body(executor, data)
            return add_images(endpoint, executor, data)

        self._set(cls, "generate", generate)
        self._set(cls, "generate_stream", generate_stream)
        self._set(cls, "_add_images", _add_images)
        self._set(mod, "http_request", _routed(mod.http_request))


def _routed(http_request: Callable[..., Any]) -> Callable[..., Any]:
    """The endpoint module's http_request, sending a body's ROUTE as the router header (requests'
    Response has the status_code/json()/iter_lines() that RuntimeEndpoint reads from either kind)."""

    @functools.wraps(http_request)
    def send(url: str, json: object = None, stream: bool = False, api_key: str | None = None,
             verify: bool | str | None = None, method: str | None = None) -> Any:
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


def install(**defaults: float | None) -> None:
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
