"""The patcher's default series is the one bundled in the package, and it is the checkout's patches/."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from branchwise import patcher

ROOT = Path(__file__).resolve().parents[2]
REPO_SERIES = ROOT / "patches" / f"sglang-{patcher.SGLANG_VERSION}"


def test_default_series_lives_in_the_package_and_is_the_repos():
    package = Path(patcher.__file__).resolve().parent
    assert patcher.DEFAULT_PATCHES.parent.parent == package
    assert patcher.bundled_patches() == patcher.DEFAULT_PATCHES
    assert patcher.series_digest(patcher.DEFAULT_PATCHES) == patcher.series_digest(REPO_SERIES)
    assert [p.name for p in patcher.series(patcher.DEFAULT_PATCHES)] == [p.name for p in patcher.series(REPO_SERIES)]


def test_the_wheel_takes_every_file_of_the_series():
    """package-data's pattern covers each file under patches/, so a built wheel has the series."""
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    package = ROOT / "overlay" / "branchwise"
    shipped = {p for pattern in data["branchwise"] for p in package.glob(pattern)}
    files = {package / "patches" / p.relative_to(ROOT / "patches") for p in (ROOT / "patches").rglob("*")
             if p.is_file()}
    assert files and files <= shipped
    assert (package / "patches").resolve() == (ROOT / "patches").resolve()


def _record_calls(monkeypatch) -> list[tuple[str, Path]]:
    calls: list[tuple[str, Path]] = []
    monkeypatch.setattr(patcher, "apply", lambda d: calls.append(("apply", d)) or "applied")
    monkeypatch.setattr(patcher, "revert", lambda d: calls.append(("revert", d)) or "reverted")
    monkeypatch.setattr(patcher, "check", lambda d: (calls.append(("check", d)) or "state: x", 0))
    return calls


@pytest.mark.parametrize("action", ["apply", "revert", "check"])
def test_each_command_defaults_to_the_bundled_series(monkeypatch, capsys, action):
    calls = _record_calls(monkeypatch)
    assert patcher.main([action]) == 0
    assert calls == [(action, patcher.DEFAULT_PATCHES)]


def test_patches_dir_overrides_the_bundle(monkeypatch, tmp_path):
    calls = _record_calls(monkeypatch)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mine").mkdir()
    assert patcher.main(["apply", "--patches", "mine"]) == 0
    assert calls == [("apply", tmp_path / "mine")]


def test_a_package_without_its_series_says_what_to_do(monkeypatch, capsys, tmp_path):
    calls = _record_calls(monkeypatch)
    monkeypatch.setattr(patcher, "DEFAULT_PATCHES", tmp_path / "patches" / "sglang-x")
    assert patcher.main(["apply"]) == 2
    err = capsys.readouterr().err
    assert "no bundled patch series" in err and "--patches DIR" in err and calls == []


def test_a_directory_that_is_no_series_is_refused(tmp_path, capsys):
    assert patcher.main(["check", "--patches", str(tmp_path)]) == 2
    assert f"{tmp_path} is not a patch series" in capsys.readouterr().err
