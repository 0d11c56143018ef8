"""The deployer's path, from a copy of the checkout: a fresh virtual environment that has sglang 0.5.23
first (the CPU recipe: make sglang-cpu), then Branchwise by a plain `pip install` of the repository
(not editable), the bundled patch series applied by `branchwise-patch apply`, and a server started with
--branch-policy taper answering /generate with branch stamps.

Slow (a fresh torch and sglang, ~4 GB unpacked): BRANCHWISE_INSTALL_PYTHON picks the interpreter of the
fresh environment (default python3.11; sglang 0.5.23 supports >= 3.11).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from branchwise.patcher import SGLANG_VERSION
from branchwise.tools.launch import LocalServer, branchwise_report, post_json

ROOT = Path(__file__).resolve().parents[2]
PYTHON = os.environ.get("BRANCHWISE_INSTALL_PYTHON", "python3.11")
SLOW_S = 1200  # cold (nothing downloaded yet) on 2 busy cores; see the report of this test's cost

pytestmark = pytest.mark.timeout(SLOW_S + 300)


def copy_checkout(dst: Path) -> Path:
    """The files a fresh clone would have (tracked, plus new ones git does not ignore), links kept."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                         cwd=ROOT, capture_output=True, check=True).stdout
    for name in sorted({os.fsdecode(n) for n in out.split(b"\0") if n}):
        src, to = ROOT / name, dst / name
        if not (src.exists() or src.is_symlink()):
            continue  # deleted in the working tree
        to.parent.mkdir(parents=True, exist_ok=True)
        if src.is_symlink():
            to.symlink_to(os.readlink(src))
        else:
            shutil.copy2(src, to)
    return dst


def run(cmd: list[str], cwd: Path, env: dict[str, str], timeout: float = SLOW_S) -> str:
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}" \
                                 f"\n{proc.stderr[-3000:]}"
    return proc.stdout


def freeze(python: Path, env: dict[str, str]) -> set[str]:
    out = run([str(python), "-m", "pip", "freeze", "--all"], cwd=python.parent, env=env, timeout=120)
    return set(out.splitlines())


@dataclass
class VenvServer(LocalServer):
    """LocalServer run by another environment's interpreter."""

    python: str = ""

    def command(self) -> list[str]:
        return [self.python, *super().command()[1:]]


def clean_env() -> dict[str, str]:
    """This process's environment without the paths of the checkout's own venv or sources."""
    drop = {"VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME", "PYTEST_CURRENT_TEST"}
    env = {k: v for k, v in os.environ.items() if k not in drop}
    venv_bin = str(Path(sys.prefix) / "bin")
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if p != venv_bin)
    return env


@pytest.fixture
def scratch(tmp_path):
    """tmp_path, emptied afterwards: the fresh environment is ~6 GB."""
    yield tmp_path
    shutil.rmtree(tmp_path, ignore_errors=True)


def test_pip_install_into_an_sglang_env_then_one_command_and_one_flag(scratch, tiny_model, monkeypatch):
    tmp_path, env = scratch, clean_env()
    src = copy_checkout(tmp_path / "clone")
    venv = tmp_path / "venv"
    py = venv / "bin" / "python"
    t0 = time.monotonic()
    run(["make", "-s", "-C", str(src), "sglang-cpu", f"VENV={venv}", f"PYTHON={PYTHON}"], cwd=src, env=env)
    t_sglang = time.monotonic() - t0
    before = freeze(py, env)
    assert f"sglang=={SGLANG_VERSION}" in before and not any(p.startswith("branchwise") for p in before)

    run([str(py), "-m", "pip", "install", "-q", str(src)], cwd=tmp_path, env=env)
    after = freeze(py, env)
    added, removed = sorted(after - before), sorted(before - after)
    names = [line.split("@")[0].split("==")[0].strip() for line in added]
    assert names == ["branchwise"] and not removed, f"pip install changed more than Branchwise: +{added} -{removed}"
    where = run([str(py), "-c", "import branchwise; print(branchwise.__file__)"], cwd=tmp_path, env=env)
    assert where.startswith(str(venv)), where  # the wheel's copy, not the checkout's sources

    patch = str(venv / "bin" / "branchwise-patch")
    assert run([patch, "check"], cwd=tmp_path, env=env).startswith("state: not applied")
    assert run([patch, "apply"], cwd=tmp_path, env=env).startswith("applied ")
    assert run([patch, "check"], cwd=tmp_path, env=env).startswith("state: applied")
    hooked = "from sglang.lang.interpreter import StreamExecutor as S; print(hasattr(S.fork, '__wrapped__'))"
    assert run([str(py), "-c", hooked], cwd=tmp_path, env=env).strip() == "True"  # frontend programs' fork hook
    t_branchwise = time.monotonic() - t0 - t_sglang

    monkeypatch.chdir(tmp_path)  # the server imports nothing from the checkout
    for name in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME"):
        monkeypatch.delenv(name, raising=False)
    with VenvServer(tiny_model, ["--branch-policy", "taper"], python=str(py)) as srv:
        stamp = {"branchwise": {"phase": "p", "branch": 0, "fanout": 2}}
        out = post_json(srv.url + "/generate", {
            "text": "The capital of France is",
            "sampling_params": {"max_new_tokens": 4, "temperature": 0, "custom_params": stamp}})
        assert out["meta_info"]["completion_tokens"] == 4
        rep = branchwise_report(srv.url)
        assert rep["config"]["branch_policy"] == "taper"
        assert rep["counters"]["branch_requests"] == 1
    print(f"\ninstall cost: sglang env {t_sglang:.0f} s, Branchwise + patch {t_branchwise:.0f} s, "
          f"all {time.monotonic() - t0:.0f} s")
