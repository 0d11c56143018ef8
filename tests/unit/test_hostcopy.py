"""No overlay module builds a device tensor from pageable host memory; hostcopy.to_device is the way.

On a GPU such a copy is synchronous and, under SGLang's overlap schedule, waits for the forward in
flight (hostcopy.py). The scan reads every module's source (AST) and flags `torch.tensor(...,
device=...)` / `torch.as_tensor(..., device=...)`, `.to(<device>)` without `non_blocking=True`
(a `.to(<dtype>)` is a conversion, not a copy) and `.cuda()`. ALLOWED names the few functions
off the serving path that may, each with its reason.
"""

from __future__ import annotations

import ast
import pathlib

import pytest
import torch

import branchwise
from branchwise import hostcopy

ROOT = pathlib.Path(branchwise.__file__).parent
SKIPPED = ("cpu_compat",)  # a vendored stand-in for SGLang's sgl_kernel, not Branchwise code
# (module path under branchwise/, function qualname) -> why it may copy from pageable memory
ALLOWED: dict[tuple[str, str], str] = {
    ("albireo/parallel_sampler.py", "RowParams.make.<locals>.f32"):
        "builds rows for benches and tests; the server's rows come from SamplingBatchInfo",
    ("albireo/parallel_sampler.py", "RowParams.make.<locals>.i64"): "as f32",
    ("albireo/parallel_sampler.py", "RowParams.make"): "as f32",
    ("albireo/parallel_sampler.py", "RowParams.to"): "as f32 (moves bench rows to a device once)",
}
HOT = ("deferral.py", "albireo/sp_sampler_hook.py", "scheduler_hook.py")  # per-step paths, never allowed
_DTYPES = {name for name in dir(torch) if isinstance(getattr(torch, name, None), torch.dtype)}


def _is_dtype(node: ast.expr) -> bool:
    """`torch.int64`, `x.dtype`, `dtype`: the argument of a dtype conversion."""
    if isinstance(node, ast.Attribute):
        return node.attr == "dtype" or (node.attr in _DTYPES and isinstance(node.value, ast.Name)
                                         and node.value.id == "torch")
    return isinstance(node, ast.Name) and node.id.endswith("dtype")


def _non_blocking(call: ast.Call) -> bool:
    return any(kw.arg == "non_blocking" and not (isinstance(kw.value, ast.Constant) and not kw.value.value)
               for kw in call.keywords)


def blocking_copies(source: str) -> list[tuple[int, str, str]]:
    """(line, enclosing function, what) for each host-to-device copy from pageable memory."""
    found: list[tuple[int, str, str]] = []

    def visit(node: ast.AST, scope: list[str], in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner, inner_fn = scope, in_function
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):  # a __qualname__
                inner = [*scope, *(["<locals>"] if in_function else []), child.name]
                inner_fn = not isinstance(child, ast.ClassDef)
            if isinstance(child, ast.Call) and isinstance(child.func, ast.Attribute):
                what = _copy_kind(child)
                if what:
                    found.append((child.lineno, ".".join(scope), what))
            visit(child, inner, inner_fn)

    visit(ast.parse(source), [], False)
    return found


def _copy_kind(call: ast.Call) -> str | None:
    func = call.func
    name = func.attr
    on_torch = isinstance(func.value, ast.Name) and func.value.id == "torch"
    if on_torch and name in ("tensor", "as_tensor") and any(kw.arg == "device" for kw in call.keywords):
        return f"torch.{name}(..., device=...)"
    if name == "cuda":
        return ".cuda()"
    if name == "to" and not on_torch:
        dev = call.args[0] if call.args else next((kw.value for kw in call.keywords if kw.arg == "device"), None)
        if dev is not None and not _is_dtype(dev) and not _non_blocking(call):
            return ".to(<device>) without non_blocking=True"
    return None


def _modules() -> list[pathlib.Path]:
    return sorted(p for p in ROOT.rglob("*.py") if not p.relative_to(ROOT).parts[0].startswith(SKIPPED))


def test_the_hot_path_modules_are_scanned():
    scanned = {p.relative_to(ROOT).as_posix() for p in _modules()}
    assert set(HOT) <= scanned and len(scanned) > 30


@pytest.mark.parametrize("path", _modules(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_no_module_copies_from_pageable_memory(path):
    rel = path.relative_to(ROOT).as_posix()
    bad = [(line, scope, what) for line, scope, what in blocking_copies(path.read_text())
           if rel in HOT or (rel, scope) not in ALLOWED]
    assert not bad, f"{rel}: use branchwise.hostcopy.to_device: {bad}"


@pytest.mark.parametrize("snippet", [
    "kept.rows = torch.tensor(idx, dtype=torch.int64, device=batch.seq_lens.device)",  # deferral, before
    "ids = torch.tensor(tokens, dtype=torch.int64, device=batch.device)",  # _pinned_cumulate, before
    "s = torch.tensor(seeds, dtype=torch.int64).to(info.temperatures.device)",  # sp_sampler_hook, before
    "x = y.to(device='cuda')",
    "x = y.to(dev, non_blocking=False)",
    "x = y.cuda()",
    "x = torch.as_tensor(v, device=d)",
])
def test_the_scan_flags_each_pageable_copy(snippet):
    assert len(blocking_copies(snippet)) == 1


@pytest.mark.parametrize("snippet", [
    "x = y.to(torch.int64)", "x = y.to(other.dtype)", "x = y.to(dtype)", "x = y.to(dtype=torch.float32)",
    "x = y.to(dev, non_blocking=True)", "x = torch.arange(4, device=d)", "x = torch.tensor(v, dtype=t)",
    "x = hostcopy.to_device(v, torch.int64, d)",
])
def test_the_scan_passes_conversions_and_device_side_builds(snippet):
    assert blocking_copies(snippet) == []


def test_to_device_on_cpu_builds_the_tensor():
    got = hostcopy.to_device([3, 1, 2], torch.int64, torch.device("cpu"))
    assert got.dtype == torch.int64 and got.device.type == "cpu" and got.tolist() == [3, 1, 2]
    assert hostcopy.to_device([0.5], torch.float32, "cpu").dtype == torch.float32
