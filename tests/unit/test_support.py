"""support.py: every SGLang mode x every policy, and --parallel-sampling's modes, refused or allowed."""

from __future__ import annotations

import ast
import inspect

import pytest

from branchwise import support
from branchwise.config import STOCK, BranchwiseConfig
from branchwise.support import POLICY_MODES, SAMPLING_MODES, ServingModes, refusals
from branchwise.taper.policies import POLICY_NAMES

POLICIES = [name.replace("cap:K", "cap:2") for name in POLICY_NAMES]

# one ServingModes per refused mode, turning that mode (and only it) on
MODE_ON: dict[str, ServingModes] = {
    "attention DP": ServingModes(attn_dp_size=2, mlp_sync=True, tp_size=2),
    "batches synced across ranks": ServingModes(mlp_sync=True, tp_size=2),
    "PD disaggregation": ServingModes(disaggregation_mode="decode"),
    "PD multiplexing": ServingModes(pdmux=True),
    "pipeline parallelism": ServingModes(pp_size=2),
    "speculative decoding": ServingModes(speculative_algorithm="EAGLE"),
    "mixed chunked prefill": ServingModes(mixed_chunk=True),
    "RL on-policy sampling": ServingModes(rl_on_policy_target=True),
    "the ascend sampling backend": ServingModes(sampling_backend="ascend"),
    "decode CUDA graphs at TP > 1": ServingModes(device="cuda", tp_size=2, decode_cuda_graph=True),
}
# SGLang settings every feature runs with (stock and every policy, with or without --parallel-sampling)
ALLOWED = [
    ServingModes(),
    ServingModes(tp_size=2),  # plain TP: decisions made on rank 0 and broadcast
    ServingModes(device="cuda", tp_size=1, decode_cuda_graph=True),
    ServingModes(device="cuda", tp_size=2, decode_cuda_graph=False),
    ServingModes(speculative_algorithm="none"),
    ServingModes(disaggregation_mode="null"),
]


def test_every_mode_has_a_case():
    assert {mode.name for mode in POLICY_MODES + SAMPLING_MODES} == set(MODE_ON)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("mode", POLICY_MODES, ids=lambda mode: mode.name)
def test_a_step_controller_is_refused_in_each_mode_stock_is_not(policy, mode):
    got = refusals(BranchwiseConfig(branch_policy=policy), MODE_ON[mode.name])
    if policy == STOCK:
        assert got == []
        return
    assert len(got) == 1
    msg = got[0]
    assert msg.startswith("Branchwise: ") and f"--branch-policy {policy} " in msg
    assert mode.name in msg and mode.flags in msg and "Use --branch-policy stock" in msg


@pytest.mark.parametrize("mode", SAMPLING_MODES, ids=lambda mode: mode.name)
def test_parallel_sampling_is_refused_in_each_of_its_modes(mode):
    got = refusals(BranchwiseConfig(parallel_sampling=True), MODE_ON[mode.name])
    assert len(got) == 1 and got[0].startswith("Branchwise: --parallel-sampling does not run with ")
    assert mode.name in got[0] and "Drop --parallel-sampling" in got[0]
    assert refusals(BranchwiseConfig(parallel_sampling=False), MODE_ON[mode.name]) == []


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("modes", ALLOWED)
def test_plain_modes_start_under_every_policy(policy, modes):
    for sampling in (False, True):
        assert refusals(BranchwiseConfig(branch_policy=policy, parallel_sampling=sampling), modes) == []


def test_check_raises_with_every_refusal():
    modes = ServingModes(pp_size=2, mixed_chunk=True, speculative_algorithm="NGRAM")
    with pytest.raises(ValueError) as err:
        support.check(BranchwiseConfig(branch_policy="taper", parallel_sampling=True), modes)
    lines = str(err.value).splitlines()
    assert len(lines) == 5  # pp, spec, mixed chunk for the policy; spec, pp for parallel sampling
    assert all(line.startswith("Branchwise: ") for line in lines)
    support.check(BranchwiseConfig(), modes)  # stock: SGLang's every mode


def test_the_check_wraps_sglangs_last_resolution_step():
    """The refusal reads resolved values (speculative algorithm, attention DP width, CUDA graphs):
    it must run after every other step of SGLang's pipeline."""
    from sglang.srt.arg_groups import pipeline

    tree = ast.parse(inspect.getsource(pipeline.run_resolution_pipeline))
    steps = sorted((node.lineno, node.args[0].id) for node in ast.walk(tree)
                   if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "run_hook")
    assert len(steps) > 50 and steps[-1][1] == support.LAST_RESOLUTION_STEP


def test_register_adds_the_check_once(monkeypatch):
    from sglang.srt.arg_groups import resolution_hooks
    from sglang.srt.plugins.hook_registry import HookRegistry

    from branchwise import plugin
    from branchwise.patcher import SGLANG_VERSION

    monkeypatch.setattr(resolution_hooks, "_HOOKS", {})
    monkeypatch.setattr(HookRegistry, "register", lambda target, fn, kind: None)
    monkeypatch.setattr(plugin, "_installed_sglang", lambda: SGLANG_VERSION)
    plugin.register()
    plugin.register()
    assert resolution_hooks._HOOKS == {support.LAST_RESOLUTION_STEP: [support.around_last_resolution_step]}


@pytest.mark.parametrize("policy", ["taper", "serial", STOCK])
def test_a_scheduler_that_meets_a_refused_mode_stops(monkeypatch, policy):
    """The guard behind the start-time check: a step controller never serves a refused mode."""
    from branchwise import deferral

    monkeypatch.setattr(deferral, "why_unsupported", lambda scheduler: "pipeline parallelism")
    config = BranchwiseConfig(branch_policy=policy)
    if policy == STOCK:
        support.guard_scheduler(object(), config)  # SGLang's own schedule: every mode
        return
    with pytest.raises(RuntimeError, match=f"--branch-policy {policy} does not run with pipeline parallelism"):
        support.guard_scheduler(object(), config)
    monkeypatch.setattr(deferral, "why_unsupported", lambda scheduler: None)
    support.guard_scheduler(object(), config)
