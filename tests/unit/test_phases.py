"""Phase model: derived rids, registry lookups, visibility rule, canonical reduce, error cases."""

import random

import pytest

from branchwise.phases import (
    ParallelPhase,
    PhaseError,
    PhaseRegistry,
    ReduceFormat,
    Stage,
    branch_prompt,
    branch_seed,
    reduce_text,
)

MV = ReduceFormat(close="\n</Path>", sep="\n", suffix="<Conclusion>\n")
HDRS = ("<Path>\n1: ", "<Path>\n2: ", "<Path>\n3: ")


def open3(reg: PhaseRegistry, rid: str = "r") -> ParallelPhase:
    return reg.open(rid, HDRS, labels=("1", "2", "3"), prefix_text="PREFIX</Goal>\n", prefix_len=7, fmt=MV)


def test_open_derives_ids_and_indexes():
    reg = PhaseRegistry()
    ph = open3(reg)
    assert ph.phase_id == "r/p0" and ph.fanout == 3 and ph.depth == 0
    assert [b.rid for b in ph.branches] == ["r/p0/b0", "r/p0/b1", "r/p0/b2"]
    assert all(b.rid.startswith("r") for b in ph.branches)  # SGLang abort-by-prefix reaches them
    assert reg.phase("r/p0") is ph and reg.of_parent("r") is ph
    got = reg.of_branch("r/p0/b1")
    assert got is not None and got[0] is ph and got[1].index == 1 and got[1].label == "2"
    assert reg.of_branch("nope") is None and reg.of_parent("r/p0/b0") is None
    assert reg.stage("r") is Stage.PARALLEL and reg.stage("other") is Stage.SERIAL


def test_visibility_rule_hides_siblings():
    reg = PhaseRegistry()
    ph = open3(reg)
    ph.close_branch(0, "SECRET-ZERO\n</Path>")
    ph.close_branch(2, "SECRET-TWO\n</Path>")
    p = branch_prompt(ph, 1)
    assert p == "PREFIX</Goal>\n<Path>\n2: "
    assert "SECRET" not in p and "1: " not in p and "3: " not in p


@pytest.mark.parametrize("seed", range(6))
def test_reduce_order_is_canonical(seed):
    outs = ["alpha\n</Path>", "beta\n</Path>", "gamma\n</Path>"]
    order = list(range(3))
    random.Random(seed).shuffle(order)
    reg = PhaseRegistry()
    ph = open3(reg)
    for k, i in enumerate(order):
        last = ph.close_branch(i, outs[i], [i, i])
        assert last == (k == 2)
    assert ph.completion_order == order
    want = "<Path>\n1: alpha\n</Path>\n<Path>\n2: beta\n</Path>\n<Path>\n3: gamma\n</Path>\n<Conclusion>\n"
    assert reduce_text(ph) == want
    assert ph.join() == want and ph.state is Stage.REDUCE and reg.stage("r") is Stage.REDUCE


def test_reduce_closes_branch_cut_short():
    reg = PhaseRegistry()
    ph = open3(reg)
    ph.close_branch(0, "ok\n</Path>")
    ph.close_branch(1, "cut by max tokens", reason="length")
    ph.close_branch(2, "ok2\n</Path>\n")
    assert reduce_text(ph) == (
        "<Path>\n1: ok\n</Path>\n<Path>\n2: cut by max tokens\n</Path>\n<Path>\n3: ok2\n</Path>\n\n<Conclusion>\n"
    )
    assert ph.branch(1).finish_reason == "length"


def test_errors():
    reg = PhaseRegistry(max_depth=2)
    ph = open3(reg)
    ph.close_branch(0, "x")
    with pytest.raises(PhaseError, match="closed twice"):
        ph.close_branch(0, "x")
    with pytest.raises(PhaseError, match=r"reduce before all branches closed \(open: \[1, 2\]\)"):
        reduce_text(ph)
    with pytest.raises(PhaseError, match="more branches than announced"):
        ph.add_branch(3, "h")
    with pytest.raises(PhaseError, match="attached twice"):
        ph.add_branch(1, "h")
    with pytest.raises(PhaseError, match="no branch 7"):
        ph.branch(7)
    with pytest.raises(PhaseError, match="already waits"):
        open3(reg)
    with pytest.raises(PhaseError, match="unknown phase"):
        reg.phase("zz")
    with pytest.raises(PhaseError, match="not a registered branch"):
        reg.close_branch("zz")
    with pytest.raises(PhaseError, match="fanout must be >= 1"):
        ParallelPhase("x", "r", 0)
    # nesting: branch of r/p0 opens r/p0/b1/p0 at depth 1; one more level exceeds max_depth=2
    inner = reg.open("r/p0/b1", ("a", "b"))
    assert inner.phase_id == "r/p0/b1/p0" and inner.depth == 1
    with pytest.raises(PhaseError, match="nesting depth 2 exceeds limit 1"):
        reg.open("r/p0/b1/p0/b0", ("a",))
    ph.close_branch(1, "y")
    ph.close_branch(2, "z")
    ph.join()
    with pytest.raises(PhaseError, match="cannot close branch"):
        ph.close_branch(1, "again")


def test_client_side_announce_attach():
    reg = PhaseRegistry()
    ph = reg.announce("grp42", "client-parent", 2)
    assert ph.phase_id == "grp42" and ph.open_branches == [0, 1]
    b1 = reg.attach("grp42", 1, "uuid-b")  # siblings may arrive out of order
    reg.attach("grp42", 0, "uuid-a")
    assert reg.of_branch("uuid-b") == (ph, b1)
    with pytest.raises(PhaseError, match="more branches than announced"):
        reg.attach("grp42", 2, "uuid-c")
    with pytest.raises(PhaseError, match="already registered"):
        reg.attach(reg.announce("g2", "p2", 3).phase_id, 0, "uuid-a")
    reg.close_branch("uuid-b", "B")
    assert not ph.all_closed
    reg.close_branch("uuid-a", "A")
    assert ph.all_closed and reduce_text(ph) == "AB"


def test_release_and_drop_request():
    reg = PhaseRegistry()
    ph = open3(reg, "r1")
    reg.open("r1/p0/b0", ("x", "y"))  # nested phase under branch 0
    open3(reg, "r10")  # shares the textual prefix "r1" but is another request
    assert len(reg) == 3
    assert sorted(reg.drop_request("r1")) == ["r1/p0", "r1/p0/b0/p0"]
    assert ph.state is Stage.DONE and reg.of_branch("r1/p0/b0") is None
    assert reg.of_parent("r10") is not None and len(reg) == 1
    # phase names restart for a new request with the same rid; a finished parent can fork again
    ph2 = open3(reg, "r1")
    assert ph2.phase_id == "r1/p0"
    for i in range(3):
        ph2.close_branch(i, "o")
    ph2.join()
    reg.release(ph2.phase_id)
    assert open3(reg, "r1").phase_id == "r1/p1"
    with pytest.raises(PhaseError, match="unknown phase"):
        reg.release("r1/p0")


def test_branch_seed_is_stable_and_distinct():
    assert branch_seed(7, "r/p0/b0") == branch_seed(7, "r/p0/b0")
    seeds = {branch_seed(7, f"r/p0/b{i}") for i in range(16)}
    assert len(seeds) == 16 and all(0 <= s < 2**63 for s in seeds)
    assert branch_seed(8, "r/p0/b0") != branch_seed(7, "r/p0/b0")
