"""One client must not be able to hurt the others: per-request SLOs and weights are bounded, and
TAPER's grouping keys keep rids, client phase ids and server-side fork phases apart. The rows are
built by the scheduler hook's own `_row` from request-shaped objects, as in the server."""

from __future__ import annotations

from types import SimpleNamespace

from branchwise import request_meta
from branchwise import scheduler_hook as sh
from branchwise.config import BranchwiseConfig
from branchwise.fork import manager
from branchwise.fork.phases import fork_limit_error
from branchwise.taper.controller import Delivery, StepController
from branchwise.taper.policies import parse_policy
from branchwise.taper.predictor import LinearLatencyModel

MODEL = LinearLatencyModel(c0=2e-3, c_seq=1e-3, c_ctx=0.0)
CFG = BranchwiseConfig(branch_policy="taper", branch_slo_tpot_ms=50.0)  # floor: 25 ms


def req(rid: str, phase: str | None = None, branch: int = 0, fanout: int = 4, slo_ms: float | None = None,
        weight: float = 1.0, server_branch: bool = False) -> SimpleNamespace:
    meta = request_meta.RequestMeta(phase=phase, branch=branch, fanout=fanout if phase else 1,
                                     slo_tpot_ms=slo_ms, weight=weight)
    r = SimpleNamespace(rid=rid, bw_meta=meta, kv=SimpleNamespace(kv_committed_len=100), to_finish=None)
    if server_branch:
        r.bw_fork = SimpleNamespace(branch=True)
    return r


def widths(reqs: list, policy: str = "taper", cfg: BranchwiseConfig = CFG) -> dict[str, int]:
    """Rows run per key in one step planned from fresh requests (slack = each request's SLO)."""
    rows = [sh._row(r, cfg) for r in reqs]
    active = StepController(parse_policy(policy, model=MODEL, rho=0.8)).select(rows, 0.0)
    out: dict[str, int] = {}
    for i in active:
        out[rows[i].key] = out.get(rows[i].key, 0) + 1
    return out


def victim() -> list:
    return [req(f"v/{b}", "victim-phase", b) for b in range(4)]


def test_too_tight_slo_cannot_change_other_requests_widths():
    honest = widths(victim() + [req("t", slo_ms=CFG.min_slo_tpot_ms)])  # at the server's floor
    hostile = widths(victim() + [req("t", slo_ms=0.001)])
    assert honest["phase:victim-phase"] == 4  # 25 ms x rho leaves room for every branch
    assert hostile == honest
    # the floor is what protects it: with a 0.001 ms floor the same request switches admission off
    loose = BranchwiseConfig(branch_policy="taper", branch_slo_tpot_ms=50.0, branch_min_slo_tpot_ms=1e-3)
    assert widths(victim() + [req("t", slo_ms=0.001)], cfg=loose)["phase:victim-phase"] == 1


def test_requests_without_an_slo_get_the_default():
    row = sh._row(req("a"), CFG)
    assert row.slo_s == 0.05 and row.weight == 1.0
    assert sh._row(req("b", slo_ms=80.0), CFG).slo_s == 0.08


def test_weights_are_bounded_in_rows():
    assert sh._row(req("a", weight=1e300), CFG).weight == 10.0
    assert sh._row(req("b", weight=0.0), CFG).weight == 0.0


def test_client_phase_named_like_another_rid_does_not_group_with_it():
    """Phase rows first: were they one group with the serial request `victim`, policy serial would
    run only the lowest-ordered row of the group and defer the victim's only row."""
    hostile = [req(f"h/{b}", "victim", b) for b in range(3)]
    reqs = [*hostile, req("victim")]
    rows = [sh._row(r, CFG) for r in reqs]
    assert rows[-1].key == "rid:victim" and rows[0].key == "phase:victim"
    active = StepController(parse_policy("serial", model=MODEL)).select(rows, 0.0)
    assert len(reqs) - 1 in active  # the victim's row runs
    assert active == [0, 3]


def test_client_phase_named_like_a_server_fork_phase_does_not_group_with_it():
    server = [req(f"p/p0/b{b}", "p/p0", b, fanout=2, server_branch=True) for b in range(2)]
    client = [req(f"c/{b}", "p/p0", b, fanout=2) for b in range(2)]
    keys = {sh._key(r) for r in server} | {sh._key(r) for r in client}
    assert keys == {"fork:p/p0", "phase:p/p0"}
    assert widths([*client, *server], policy="serial") == {"fork:p/p0": 1, "phase:p/p0": 1}


def test_deliveries_use_the_same_keys_and_bounds():
    st = sh.BranchwiseState(config=CFG)
    reqs = [req("victim"), req("h/0", "victim", 0, slo_ms=0.001), req("h/1", "victim", 1, slo_ms=0.001)]
    delivered, ctx = sh._deliveries(st, reqs)
    assert delivered == {"rid:victim": Delivery(1, 0.05, False), "phase:victim": Delivery(2, 0.025, True)}
    assert ctx == 300
    assert set(delivered) == {sh._row(r, CFG).key for r in reqs}


# ---- server-side fork limits (pure parts; tests/integration/test_server_fork.py runs them live)


def test_fork_limit_error():
    assert fork_limit_error(16, [100] * 16, 0, 16, 10_000) is None
    assert "exceeds --branch-max-fanout 16" in fork_limit_error(17, [1] * 17, 0, 16, 10_000)
    msg = fork_limit_error(3, [4000] * 3, 0, 16, 10_000)
    assert "would grant 12000 decode tokens" in msg and "--branch-max-branch-tokens 10000" in msg
    # live branches of the same request (an enclosing phase, an earlier round) count too
    assert fork_limit_error(2, [3000] * 2, 3000, 16, 10_000) is None
    assert fork_limit_error(2, [3000] * 2, 4001, 16, 10_000) is not None


def test_fork_manager_encode_cache_is_bounded():
    calls = []

    class Tok:
        def encode(self, text, add_special_tokens=False):
            calls.append(text)
            return [len(text)]

    sched = SimpleNamespace(tokenizer=Tok(), max_total_num_tokens=16384)
    mgr = manager.ForkManager(sched, BranchwiseConfig())
    assert mgr.max_branch_tokens == 16384  # auto: the KV pool size
    assert mgr.cfg.branch_max_fanout == 16
    for i in range(3 * manager.ENC_CACHE):  # headers carry client text: one new text per request
        assert mgr.encode(f"<Path>\n{i}: ") == [len(f"<Path>\n{i}: ")]
    assert mgr.report()["sizes"]["enc_cache"] == manager.ENC_CACHE
    n = len(calls)
    assert mgr.encode("</Path>") == mgr.encode("</Path>") == [7] and len(calls) == n + 1  # still a cache
    assert mgr.encode("") == []
