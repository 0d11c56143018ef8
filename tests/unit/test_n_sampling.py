"""n > 1 samples as one phase (n_sampling.py): the plan per prompt and the hooks, on stand-in objects
that have the attributes SGLang's TokenizerManager / GenerateReqInput hooks read."""

from __future__ import annotations

import copy
from types import SimpleNamespace

from branchwise.ingress import n_sampling as ns
from branchwise.request_meta import KEY, parse


def test_plan_stamps_a_phase_per_prompt_and_keeps_the_clients_slo():
    exp = ns.plan("req_0", 4, {"custom_params": {KEY: {"slo_tpot_ms": 30, "weight": 2, "branch": 3}, "x": 1}})
    assert exp.phase == "req_0" and exp.fanout == 4 and exp.routing_key == "req_0"
    assert exp.stamp == {"slo_tpot_ms": 30, "weight": 2, "phase": "req_0", "fanout": 4}
    assert ns.plan("g/b1/0_0", 2, {}).routing_key == "g"  # an n > 1 request inside a phase stays with it


def test_plan_leaves_sglang_alone_for_opt_outs_and_odd_input():
    assert ns.plan("r", 4, {"custom_params": {KEY: {"phase": None}}}) is None  # the documented opt-out
    for rid, n, sp in (("r", 1, {}), ("", 4, {}), (None, 4, {}), ("r", True, {}), ("r", 2.0, {}),
                       ("r", 4, {"custom_params": {KEY: "x"}})):
        assert ns.plan(rid, n, sp) is None, (rid, n, sp)


def test_a_client_stamped_request_keeps_its_phase():
    cp = {KEY: {"phase": "mine/b2", "branch": 2, "fanout": 3}}
    exp = ns.plan("r_0", 4, {"custom_params": cp})
    assert exp.stamp is None and exp.phase == "mine/b2" and exp.routing_key == "mine"
    child = ns.Sample(expansion=exp, branch=1)
    assert ns.custom_params_for(child, cp) is cp
    assert ns.custom_params_for(ns.Sample(expansion=exp, branch=None), cp) is None  # the prefix pass is in no phase


def test_samples_follow_sglangs_order_prefix_pass_first():
    exp = ns.plan("p", 3, None)
    got = [ns.next_sample(exp).branch for _ in range(4)]
    assert got == [None, 0, 1, 2]
    cps = [ns.custom_params_for(ns.Sample(expansion=exp, branch=b), {"other": 1}) for b in (None, 0, 2)]
    assert cps[0] == {"other": 1}
    assert [parse(cp) for cp in cps[1:]] == [parse({KEY: {"phase": "p", "branch": b, "fanout": 3}}) for b in (0, 2)]


class Obj:
    """A GenerateReqInput as the hooks see it: a rid, batch indexing with cached sub-requests."""

    def __init__(self, rids: list[str], n: int, sp: dict) -> None:
        self.rid, self.parallel_sample_num, self.batch_size = rids, n, len(rids)
        self.sampling_params = [sp] * len(rids)
        self.subs = [SimpleNamespace(rid=r, sampling_params=sp) for r in rids]

    def __getitem__(self, i: int) -> SimpleNamespace:
        return self.subs[i]


def sglang_expansion(tm: SimpleNamespace, obj: Obj) -> list[SimpleNamespace]:
    """What TokenizerManager._handle_batch_request does for n > 1, reduced to what the hooks see:
    per prompt a prefix pass, then the samples; each a copy with a regenerated rid and its state."""
    sent = []

    def regenerate_rid(o: SimpleNamespace) -> str:
        o.rid = f"uuid{len(sent)}"
        return o.rid

    def send(tm_: SimpleNamespace, tok: SimpleNamespace) -> None:
        sent.append(tok)

    def run(tm_: SimpleNamespace, obj_: Obj) -> None:
        for passes in ([1] * obj_.batch_size, [obj_.parallel_sample_num] * obj_.batch_size):
            for i, k in enumerate(passes):
                for _ in range(k):
                    tmp = copy.copy(obj_[i])
                    tok = SimpleNamespace(rid=ns.around_regenerate_rid(regenerate_rid, tmp), routing_key=None,
                                          sampling_params=SimpleNamespace(custom_params=tmp.sampling_params.get(
                                              "custom_params")))
                    tm_.rid_to_state[tok.rid] = SimpleNamespace(obj=tmp)
                    ns.around_send_one_request(send, tm_, tok)

    ns.around_handle_batch_request(run, tm, obj)
    return sent


def test_hooks_stamp_each_prompts_samples_and_route_its_prefix_pass():
    tm = SimpleNamespace(rid_to_state={})
    sent = sglang_expansion(tm, Obj(["a", "b"], 2, {"custom_params": {KEY: {"weight": 3}}}))
    assert [t.rid for t in sent] == ["uuid0", "uuid1", "a/b0/0", "a/b1/0", "b/b0/0", "b/b1/0"]
    assert [t.routing_key for t in sent] == ["a", "b", "a", "a", "b", "b"]
    assert [t.sampling_params.custom_params for t in sent[:2]] == [{KEY: {"weight": 3}}] * 2
    metas = [parse(t.sampling_params.custom_params) for t in sent[2:]]
    assert [(m.phase, m.branch, m.fanout, m.weight) for m in metas] == [
        ("a", 0, 2, 3), ("a", 1, 2, 3), ("b", 0, 2, 3), ("b", 1, 2, 3)]


def test_requests_without_n_pass_untouched():
    tm = SimpleNamespace(rid_to_state={"x": SimpleNamespace(obj=SimpleNamespace())})
    tok = SimpleNamespace(rid="x", routing_key=None, sampling_params=SimpleNamespace(custom_params=None))
    ns.around_send_one_request(lambda tm_, t: None, tm, tok)
    assert tok.routing_key is None and tok.sampling_params.custom_params is None
    assert sglang_expansion(SimpleNamespace(rid_to_state={}), Obj(["c"], 2, {"custom_params": {KEY: {"phase": None}}}))[
        2].rid == "uuid2"  # opted out: SGLang's uuids, nothing stamped


def test_an_abort_of_the_clients_rid_reaches_every_live_sample():
    tm = SimpleNamespace(rid_to_state={})
    sglang_expansion(tm, Obj(["q_0"], 3, {}))
    tm.rid_to_state["q_other"] = SimpleNamespace(obj=SimpleNamespace())  # a plain request: not a sample
    aborted = []
    ns.around_abort_request(lambda tm_, rid, abort_all=False: aborted.append(rid), tm, rid="q")
    assert aborted == ["q_0/b0/0", "q_0/b1/0", "q_0/b2/0", "q"]
    aborted.clear()
    ns.around_abort_request(lambda tm_, rid, abort_all=False: aborted.append(rid), tm, rid="q_0/b1/0")
    assert aborted == ["q_0/b1/0"]  # a known rid: SGLang's own abort only
