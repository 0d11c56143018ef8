"""register() hooks only the SGLang version Branchwise is written for; any other gets one stderr line."""

from __future__ import annotations

import pytest
from sglang.srt.plugins.hook_registry import HookRegistry

from branchwise import plugin
from branchwise.patcher import SGLANG_VERSION


@pytest.fixture
def hooked(monkeypatch) -> list[str]:
    got: list[str] = []
    monkeypatch.setattr(HookRegistry, "register", lambda target, fn, kind: got.append(target))
    monkeypatch.setenv(plugin.VERSION_NOTED_ENV, "0")  # restored (removed) after the test
    monkeypatch.delenv("BRANCHWISE_STEP_TIMER", raising=False)
    return got


@pytest.mark.parametrize("version", ["0.5.24", "0.4.9", None])
def test_other_sglang_versions_get_no_hooks_and_one_line(monkeypatch, capsys, hooked, version):
    monkeypatch.setattr(plugin, "_installed_sglang", lambda: version)
    plugin.register()  # the launcher process
    plugin.register()  # its scheduler / detokenizer (they inherit the environment)
    err = capsys.readouterr().err
    assert hooked == []
    assert err.count("\n") == 1 and err.startswith("WARNING Branchwise: installed sglang is ")
    assert str(version) in err and f"sglang=={SGLANG_VERSION} only" in err and "no Branchwise hooks" in err


def test_the_supported_version_is_hooked_silently(monkeypatch, capsys, hooked):
    monkeypatch.setattr(plugin, "_installed_sglang", lambda: SGLANG_VERSION)
    plugin.register()
    assert f"{plugin.SCHEDULER}.__init__" in hooked and len(hooked) > 10
    assert capsys.readouterr().err == ""


def test_the_version_lookup_reads_the_installed_distribution():
    assert plugin._installed_sglang() == SGLANG_VERSION  # this venv: make install pins it


@pytest.mark.parametrize("timer", [None, "1", "stock", "albireo"])
def test_one_hook_per_shared_scheduler_target(monkeypatch, timer):
    """Scheduler targets that several components need are hooked once, by the composition root
    (runtime.py), which calls the components in a fixed order: no result depends on hook order."""
    from branchwise import runtime

    got: list[tuple[str, object]] = []
    monkeypatch.setattr(HookRegistry, "register", lambda target, fn, kind: got.append((target, fn)))
    monkeypatch.setattr(plugin, "_installed_sglang", lambda: SGLANG_VERSION)
    if timer is None:
        monkeypatch.delenv("BRANCHWISE_STEP_TIMER", raising=False)
    else:
        monkeypatch.setenv("BRANCHWISE_STEP_TIMER", timer)
    plugin.register()
    on = {name: [fn for target, fn in got if target == f"{plugin.SCHEDULER}.{name}"]
          for name in ("__init__", "get_internal_state", "_create_generation_req")}
    assert on["__init__"] == [runtime.after_scheduler_init]
    # on in every mode once the patch declares --emulate-device (its report is the bench's overrun count)
    reported = timer != "stock" or plugin._flag_declared("emulate_device")
    assert on["get_internal_state"] == ([runtime.after_get_internal_state] if reported else [])
    full = timer not in ("stock", "albireo")
    assert on["_create_generation_req"] == ([runtime.after_create_generation_req] if full else [])
