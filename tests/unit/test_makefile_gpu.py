"""make install decides GPU or CPU when its recipe runs, and a GPU install checks the driver first.

Runs the real Makefile against a stand-in nvidia-smi and a stand-in venv python that logs what it is
asked to do, so no package is installed.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _script(path: Path, body: str) -> None:
    path.write_text("#!/bin/bash\n" + body)
    path.chmod(0o755)


@pytest.fixture
def box(tmp_path):
    """A bin/ for the stand-in nvidia-smi and a venv whose python logs its argv."""
    (tmp_path / "bin").mkdir()
    (tmp_path / "venv" / "bin").mkdir(parents=True)
    log = tmp_path / "python.log"
    _script(tmp_path / "venv" / "bin" / "python",
            f'echo "$*" >> {log}\n[ "$1" = -c ] && echo {tmp_path}\nexit 0\n')
    return tmp_path


def make(box: Path, target: str, *, gpu: bool, driver: str = "") -> subprocess.CompletedProcess:
    _script(box / "bin" / "nvidia-smi",
            f'case "$1" in -L) exit {0 if gpu else 1};; --query-gpu=driver_version) echo "{driver}";; esac\n')
    env = {**os.environ, "PATH": f"{box / 'bin'}:{os.environ['PATH']}"}
    env.pop("MAKEFLAGS", None)
    return subprocess.run(["make", "-s", "-C", str(ROOT), target, f"VENV={box / 'venv'}"],
                          env=env, capture_output=True, text=True, timeout=60)


def pip_calls(box: Path) -> list[str]:
    log = box / "python.log"
    return [line for line in log.read_text().splitlines() if " pip " in f" {line} "] if log.exists() else []


def test_a_gpu_with_a_new_driver_gets_the_normal_sglang_install(box):
    proc = make(box, "install", gpu=True, driver="580.95.05")
    assert proc.returncode == 0, proc.stderr
    assert "NVIDIA driver 580.95.05" in proc.stdout
    assert pip_calls(box) == ["-m pip install -q -e .[sglang,dev]"]


@pytest.mark.parametrize("driver", ["550.163.01", "", "NVIDIA-SMI has failed"])
def test_a_gpu_install_refuses_an_old_or_unreadable_driver_before_installing(box, driver):
    proc = make(box, "install", gpu=True, driver=driver)
    assert proc.returncode != 0
    assert f"NVIDIA driver '{driver.replace(' ', '')}'" in proc.stderr and "needs driver >= 580" in proc.stderr
    assert pip_calls(box) == [] and not (box / "venv" / ".branchwise-installed").exists()


def test_no_gpu_at_recipe_time_gets_the_cpu_recipe(box):
    proc = make(box, "install", gpu=False)
    assert proc.returncode == 0, proc.stderr
    calls = pip_calls(box)
    assert calls[:3] == ["-m pip install -q torch==2.14.1",
                         "-m pip install -q --no-deps sglang==0.5.23 torchvision==0.29.1",
                         "-m pip install -q -r overlay/branchwise/cpu_compat/requirements-cpu.txt"]
    assert "-m pip install -q --no-deps -e ." in calls
    assert (box / "branchwise_cpu_compat.pth").read_text().strip() == str(ROOT / "overlay/branchwise/cpu_compat")


def test_check_driver_alone(box):
    assert make(box, "check-driver", gpu=True, driver="590.1").returncode == 0
    assert make(box, "check-driver", gpu=True, driver="579.99").returncode != 0
