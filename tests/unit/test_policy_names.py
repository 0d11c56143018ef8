"""Policy names a user can guess: `serial` is one branch per phase per step, `stock` is SGLang's own
schedule, and the retired `off` (which meant serial, and reads as "Branchwise off") is refused,
naming both, by the server flag's parser and by every bench tool that takes --policies."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from bench import capacity, demo, invariance, replay, sim_sweep, simulate, sweep
from branchwise import config
from branchwise.taper.policies import parse_policy, parse_policy_name

ROOT = Path(__file__).resolve().parents[2]
AZURE = ROOT / "bench" / "data" / "AzureLLMInferenceTrace_conv.csv"
NAMES_BOTH = r"'off' is ambiguous and no longer accepted: use 'stock' .* or 'serial' for one branch per phase per step"


def test_serial_is_one_branch_per_phase_per_step():
    policy = parse_policy(" Serial ")
    assert (policy.name, policy.cap, policy.static) == ("serial", 1, True)


@pytest.mark.parametrize("parse", [parse_policy_name, parse_policy])
def test_off_is_refused_naming_stock_and_serial(parse):
    with pytest.raises(ValueError, match=NAMES_BOTH):
        parse(" OFF ")


def test_the_server_flag_refuses_off_at_argument_parsing():
    with pytest.raises(argparse.ArgumentTypeError, match=NAMES_BOTH):
        config.policy_arg("off")
    assert config.policy_arg("serial") == "serial"


def _exits(main, argv, capsys) -> str:
    """argv fails at argument parsing (argparse's exit 2); its stderr."""
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("main,argv", [
    (sweep.parse_args, ["--launch", "--out", "o"]),
    (replay.parse_args, ["--launch", "--compare", "--out", "o"]),
    (invariance.main, ["--launch"]),
    (demo.main, []),
], ids=["sweep", "replay", "invariance", "demo"])
def test_bench_tools_that_start_servers_refuse_off_before_any_starts(main, argv, capsys):
    err = _exits(main, [*argv, "--policies", "eager,off"], capsys)
    assert re.search(NAMES_BOTH, err), err


@pytest.mark.parametrize("main,argv", [
    (capacity.main, ["--trace", str(AZURE)]),
    (simulate.main, ["--trace", str(AZURE)]),
    (sim_sweep.main, []),
], ids=["capacity", "simulate", "sim_sweep"])
def test_simulator_tools_refuse_off(main, argv, tmp_path, capsys):
    assert main([*argv, "--policies", "serial,off", "--out", str(tmp_path / "o")]) == 2
    assert re.search(NAMES_BOTH, capsys.readouterr().err)
    assert not (tmp_path / "o").exists() or not any((tmp_path / "o").iterdir())


def test_bench_defaults_name_serial_not_off():
    assert sweep.parse_args(["--launch", "--out", "o"]).policies == ("serial", "eager", "taper")
    assert replay.parse_args(["--launch", "--out", "o"]).policies[0] == "serial"
    assert "serial" in capacity.parse_args(["--trace", str(AZURE), "--out", "o"]).policies.split(",")


def test_make_serve_defaults_to_the_servers_policy():
    """`make serve` without POLICY= runs what the server runs without --branch-policy."""
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^POLICY \?= (\S+)$", makefile, re.M).group(1) == config.BranchwiseConfig().branch_policy
    patch = (ROOT / "patches" / "sglang-0.5.23" / "0001-branchwise-server-args.patch").read_text()
    assert f'] = "{config.STOCK}"' in patch.split("branch_policy: A[", 1)[1][:1200]
    for line in re.findall(r"--policies (\S+)", makefile):
        assert "off" not in line.split(","), line


def test_a_step_controller_is_refused_where_sglang_plugins_leaves_branchwise_out(monkeypatch):
    monkeypatch.setenv("SGLANG_PLUGINS", "someone_else")
    with pytest.raises(argparse.ArgumentTypeError, match="add branchwise to SGLANG_PLUGINS"):
        config.policy_arg("taper")
    assert config.policy_arg("stock") == "stock"  # stock needs no hook
    monkeypatch.setenv("SGLANG_PLUGINS", "someone_else, branchwise")
    assert config.policy_arg("taper") == "taper"
    monkeypatch.setenv("SGLANG_PLUGINS", "")  # SGLang loads every plugin for an empty value
    assert config.policy_arg("taper") == "taper"
