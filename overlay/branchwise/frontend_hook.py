"""Branch phases for unchanged SGLang frontend programs (`s.fork(n)` ... `join`).

`import branchwise.frontend_hook` (or `install()`; `branchwise.client` and `frontends.*` call it)
patches SGLang's frontend in this process:

- `StreamExecutor.fork` syncs first. Stock fork reads `text_` before it syncs (interpreter.py:375-378):
  while the worker thread still has the parent's ops queued, `text_` is "" and the prefix hint
  (SglCommitLazy, a max_new_tokens=0 request) is skipped, so the n siblings arrive together with an
  uncached fork-point prefix and FCFS prefills it redundantly. Syncing first always sends the hint.
- Each child of a fork(n > 1) is tagged (phase, branch, fanout); `RuntimeEndpoint.generate` and
  `generate_stream` of a tagged executor stamp `custom_params.branchwise` and a structured rid
  (branchwise.client.branch_rid). A fork inside a branch is a nested phase under the branch's rid.
- The fork-point prefix request carries SGLang's `routing_key` = the fork's phase id, so under data
  parallelism it lands on the DP rank its branches go to (branchwise.dp_dispatch).

SGLang's plugin entry point runs only in server processes and the frontend never calls
`load_plugins()`, so client programs opt in by importing this module. The patch is lazy: when
`sglang.lang` is not imported yet, it is applied the moment it is (a meta-path finder), so
importing Branchwise never pulls in torch. install() is idempotent; uninstall() restores SGLang.
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
_EXTRA = ("slo_tpot_ms", "weight")  # fields install() may add to every branch stamp

_lock = threading.RLock()
_local = threading.local()  # .pending: (rid, stamp fields) for this thread's next /generate
_defaults: dict[str, Any] = {}
_undo: list[tuple[Any, str, Any]] = []  # (owner, attribute, original) to restore
_patched: set[str] = set()
_installed = False


@dataclass(frozen=True, slots=True)
class BranchTag:
    group: str  # phase id shared by the siblings
    index: int
    fanout: int

    @property
    def base(self) -> str:  # rid prefix of everything this branch sends
        return f"{self.group}/b{self.index}"


# ---- patches --------------------------------------------------------------------------------------
def _set(owner: Any, name: str, new: Any) -> None:
    _undo.append((owner, name, getattr(owner, name)))
    setattr(owner, name, new)


def _patch_interpreter(mod: Any) -> None:
    orig = mod.StreamExecutor.fork

    @functools.wraps(orig)
    def fork(self: Any, size: int = 1, position_ids_offset: Any = None) -> list[Any]:
        self.sync()  # the race fix: text_ is final before stock fork decides on the prefix hint
        self._bw_prefix_group = _next_group(self) if int(size) > 1 else None  # the hint's routing_key
        try:
            exes = orig(self, size, position_ids_offset)
        finally:
            group, self._bw_prefix_group = self._bw_prefix_group, None
        if len(exes) > 1:
            _tag_children(group, exes)
        return exes

    _set(mod.StreamExecutor, "fork", fork)


def _next_group(parent: Any) -> str:
    from branchwise.client import new_group

    ptag: BranchTag | None = getattr(parent, "_bw_tag", None)
    k = getattr(parent, "_bw_forks", 0)
    parent._bw_forks = k + 1
    return f"{ptag.base}/f{k}" if ptag else new_group()


def _tag_children(group: str, exes: list[Any]) -> None:
    for i, exe in enumerate(exes):
        exe._bw_tag, exe._bw_turn = BranchTag(group, i, len(exes)), 0


def _arm(s: Any) -> bool:
    """Queue the stamp for the next /generate this thread sends on behalf of executor `s`."""
    from branchwise.client import branch_rid

    tag: BranchTag | None = getattr(s, "_bw_tag", None)
    if tag is None:
        return False
    rid = branch_rid(tag.group, tag.index, s._bw_turn)
    s._bw_turn += 1
    _local.pending = (rid, {"phase": tag.group, "branch": tag.index, "fanout": tag.fanout, **_defaults})
    return True


def _patch_endpoint(mod: Any) -> None:
    cls, http = mod.RuntimeEndpoint, mod.http_request
    gen, gen_stream, commit = cls.generate, cls.generate_stream, cls.commit_lazy_operations

    @functools.wraps(gen)
    def generate(self: Any, s: Any, *args: Any, **kw: Any) -> Any:
        _arm(s)
        try:
            return gen(self, s, *args, **kw)
        finally:
            _local.pending = None

    @functools.wraps(gen_stream)
    def generate_stream(self: Any, s: Any, *args: Any, **kw: Any) -> Any:
        _arm(s)  # the request is sent at the first next(), in this same worker thread
        try:
            yield from gen_stream(self, s, *args, **kw)
        finally:
            _local.pending = None

    @functools.wraps(commit)
    def commit_lazy_operations(self: Any, s: Any) -> Any:
        _local.route = getattr(s, "_bw_prefix_group", None)  # set while fork() sends its prefix hint
        try:
            return commit(self, s)
        finally:
            _local.route = None

    @functools.wraps(http)
    def http_request(url: str, json: Any = None, *args: Any, **kw: Any) -> Any:
        route = getattr(_local, "route", None)
        if route and isinstance(json, dict) and url.endswith("/generate"):
            _local.route = None
            json = {**json, "routing_key": route}
        pending = getattr(_local, "pending", None)
        if pending and isinstance(json, dict) and url.endswith("/generate") and isinstance(json.get("text"), str):
            _local.pending = None  # one stamp per gen call
            rid, fields = pending
            json = {**json, "rid": rid, "sampling_params": request_meta.stamp(json.get("sampling_params"), **fields)}
        return http(url, json, *args, **kw)

    _set(cls, "generate", generate)
    _set(cls, "generate_stream", generate_stream)
    _set(cls, "commit_lazy_operations", commit_lazy_operations)
    _set(mod, "http_request", http_request)


_PATCHES = {INTERPRETER: _patch_interpreter, ENDPOINT: _patch_endpoint}


def _apply(name: str, mod: Any) -> None:
    with _lock:
        if _installed and name not in _patched:
            _PATCHES[name](mod)
            _patched.add(name)


# ---- lazy application -----------------------------------------------------------------------------
class _Loader(importlib.abc.Loader):
    def __init__(self, inner: Any, name: str) -> None:
        self.inner, self.name = inner, name

    def create_module(self, spec: Any) -> Any:
        return self.inner.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self.inner.exec_module(module)
        _apply(self.name, module)

    def __getattr__(self, attr: str) -> Any:  # get_source, get_filename, ... of the real loader
        return getattr(self.inner, attr)


class _Finder(importlib.abc.MetaPathFinder):
    """Wraps the real loader of the two frontend modules so the patch runs right after import."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name not in _PATCHES or name in _patched:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _Loader(spec.loader, name)
                return spec
        return None


_finder = _Finder()


def install(**defaults: Any) -> None:
    """Enable stamping + the fork race fix (idempotent). `defaults` (slo_tpot_ms, weight) are added
    to every branch stamp from now on."""
    global _installed
    bad = set(defaults) - set(_EXTRA)
    if bad:
        raise ValueError(f"install() takes only {_EXTRA}, got {sorted(bad)}")
    request_meta.stamp({}, **defaults)  # validate
    with _lock:
        _defaults.update({k: v for k, v in defaults.items() if v is not None})
        if _installed:
            return
        _installed = True
        for name in _PATCHES:
            if name in sys.modules:
                _apply(name, sys.modules[name])
        if _finder not in sys.meta_path:
            sys.meta_path.insert(0, _finder)


def uninstall() -> None:
    """Restore stock SGLang (for A/B measurements); executors keep their tags but send nothing."""
    global _installed
    with _lock:
        while _undo:
            owner, name, orig = _undo.pop()
            setattr(owner, name, orig)
        _patched.clear()
        _defaults.clear()
        _installed = False
        if _finder in sys.meta_path:
            sys.meta_path.remove(_finder)


def installed() -> bool:
    return _installed and _patched == set(_PATCHES)


install()
