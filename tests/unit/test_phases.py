"""Phase model: derived rids, registry lookups, the lifecycle (FORKING -> PARALLEL -> REDUCE -> DONE),
branch isolation, canonical reduce, error cases."""

import random
from array import array

import pytest

from branchwise.fork.phases import (
    ParallelPhase,
    PhaseError,
    PhaseRegistry,
    ReduceFormat,
    Stage,
    branch_seed,
    reduce,
)

MV = ReduceFormat(close="\n</Path>", sep="\n", suffix="<Conclusion>\n")
HDRS = ("<Path>\n1: ", "<Path>\n2: ", "<Path>\n3: ")


def open3(reg: PhaseRegistry, rid: str = "r", spawn: bool = True) -> ParallelPhase:
    ph = reg.open(rid, HDRS, ("1", "2", "3"), prefix_text="PREFIX</Goal>\n", prefix_len=7, fmt=MV,
                  header_ids=[[100 + i, 200 + i] for i in range(3)])
    if spawn:
        ph.park()
    return ph


def test_open_derives_ids_and_indexes():
    reg = PhaseRegistry()
    ph = open3(reg, spawn=False)
    assert ph.phase_id == "r/p0" and ph.fanout == 3 and ph.depth == 0 and ph.state is Stage.FORKING
    assert [b.rid for b in ph.branches] == ["r/p0/b0", "r/p0/b1", "r/p0/b2"]
    assert all(b.rid.startswith("r") for b in ph.branches)  # SGLang abort-by-prefix reaches them
    assert reg.phases["r/p0"] is ph and reg.of_parent("r") is ph
    got = reg.of_branch("r/p0/b1")
    assert got is not None and got[0] is ph and got[1].index == 1 and got[1].label == "2"
    assert reg.of_branch("nope") is None and reg.of_parent("r/p0/b0") is None
    ph.park()
    assert ph.state is Stage.PARALLEL


def test_branch_input_is_the_prefix_and_its_own_header_only():
    reg = PhaseRegistry()
    ph = open3(reg)
    ph.close_branch(0, "SECRET-ZERO\n</Path>", [900])
    ph.close_branch(2, "SECRET-TWO\n</Path>", [902])
    prefix = array("q", [1, 2, 3])
    got = ph.branch_input(1, prefix)
    assert list(got) == [1, 2, 3, 101, 201]  # no sibling's header or output ids
    assert list(prefix) == [1, 2, 3]  # the shared prefix is not modified


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
    want = "<Path>\n1: alpha\n</Path>\n<Path>\n2: beta\n</Path>\n<Path>\n3: gamma\n</Path>\n<Conclusion>\n"
    assert reduce(MV, HDRS, outs) == want
    assert ph.join() == want and ph.state is Stage.REDUCE and reg.of_parent("r") is ph


def test_reduce_closes_branch_cut_short():
    reg = PhaseRegistry()
    ph = open3(reg)
    ph.close_branch(0, "ok\n</Path>")
    ph.close_branch(1, "cut by max tokens", reason="length")
    ph.close_branch(2, "ok2\n</Path>\n")
    assert ph.join() == (
        "<Path>\n1: ok\n</Path>\n<Path>\n2: cut by max tokens\n</Path>\n<Path>\n3: ok2\n</Path>\n\n<Conclusion>\n"
    )
    assert ph.branch(1).finish_reason == "length"


def test_errors():
    reg = PhaseRegistry(max_depth=2)
    ph = open3(reg, spawn=False)
    with pytest.raises(PhaseError, match="cannot close branch 0 in state forking"):
        ph.close_branch(0, "x")
    ph.park()
    with pytest.raises(PhaseError, match="cannot park in state parallel"):
        ph.park()
    ph.close_branch(0, "x")
    with pytest.raises(PhaseError, match="closed twice"):
        ph.close_branch(0, "x")
    with pytest.raises(PhaseError, match=r"reduce before all branches closed \(open: \[1, 2\]\)"):
        ph.join()
    with pytest.raises(PhaseError, match="branch 3 outside fanout 3"):
        ph.add_branch("h", "4")
    with pytest.raises(PhaseError, match="no branch 7"):
        ph.branch(7)
    with pytest.raises(PhaseError, match="already waits"):
        open3(reg)
    with pytest.raises(PhaseError, match="unknown phase"):
        reg.release("zz")
    with pytest.raises(PhaseError, match="fanout must be >= 1"):
        ParallelPhase(phase_id="x", parent_rid="r", fanout=0)
    with pytest.raises(ValueError):  # a label per header
        reg.open("q", ("a", "b"), ("1",))
    # nesting: branch of r/p0 opens r/p0/b1/p0 at depth 1; one more level exceeds max_depth=2
    inner = reg.open("r/p0/b1", ("a", "b"), ("1", "2"))
    assert inner.phase_id == "r/p0/b1/p0" and inner.depth == 1
    with pytest.raises(PhaseError, match="nesting depth 2 exceeds limit 1"):
        reg.open("r/p0/b1/p0/b0", ("a",), ("1",))
    ph.close_branch(1, "y")
    ph.close_branch(2, "z")
    ph.join()
    with pytest.raises(PhaseError, match="cannot close branch 1 in state reduce"):
        ph.close_branch(1, "again")
    with pytest.raises(PhaseError, match="cannot join in state reduce"):
        ph.join()


def test_release_and_drop_request():
    reg = PhaseRegistry()
    ph = open3(reg, "r1")
    reg.open("r1/p0/b0", ("x", "y"), ("1", "2"))  # nested phase under branch 0
    open3(reg, "r10")  # shares the textual prefix "r1" but is another request
    assert len(reg) == 3
    assert [p.phase_id for p in reg.drop_request("r1")] == ["r1/p0", "r1/p0/b0/p0"]  # outermost first
    assert ph.state is Stage.DONE and reg.of_branch("r1/p0/b0") is None
    assert reg.of_parent("r10") is not None and len(reg) == 1
    # phase names restart for a new request with the same rid; a finished parent can fork again
    ph2 = open3(reg, "r1")
    assert ph2.phase_id == "r1/p0"
    for i in range(3):
        ph2.close_branch(i, "o")
    ph2.join()
    reg.release(ph2.phase_id)
    assert ph2.state is Stage.DONE and reg.of_parent("r1") is None
    assert open3(reg, "r1").phase_id == "r1/p1"
    with pytest.raises(PhaseError, match="unknown phase"):
        reg.release("r1/p0")


def test_branch_seed_is_stable_and_distinct():
    assert branch_seed(7, "r/p0/b0") == branch_seed(7, "r/p0/b0")
    seeds = {branch_seed(7, f"r/p0/b{i}") for i in range(16)}
    assert len(seeds) == 16 and all(0 <= s < 2**63 for s in seeds)
    assert branch_seed(8, "r/p0/b0") != branch_seed(7, "r/p0/b0")


def test_the_phase_state_is_the_record_the_lifecycle_reads():
    """Parked parents, pending work and granted tokens are read off the phases, never kept beside them."""
    reg = PhaseRegistry()
    ph = reg.open("r", HDRS, ("1", "2", "3"), grants=[10, 20, 30])
    assert ph.waiting and ph.pending and ph.granted() == 60  # cut at the fork: park and spawn pending
    ph.park()
    assert ph.waiting and not ph.pending and ph.granted() == 60
    ph.close_branch(1, "x")
    assert ph.granted() == 40 and not ph.pending  # an ended branch gives its grant back by ending
    inner = reg.open("r/p0/b0", ("a", "b"), ("1", "2"), grants=[5, 5])  # branch 0 forks again
    assert [p.phase_id for p in reg.subtree("r")] == ["r/p0", "r/p0/b0/p0"]
    assert reg.root_of("r/p0/b0/p0/b1") == "r" and reg.root_of("r") == "r"
    assert sum(p.granted() for p in reg.subtree("r")) == 50
    assert reg.in_state(Stage.FORKING) == [inner]
    ph.close_branch(2, "y")
    assert not ph.pending  # branch 0 is parked on its own phase
    inner.park()
    inner.close_branch(0, "a")
    inner.close_branch(1, "b")
    assert inner.pending and inner.granted() == 0  # join pending
    released = reg.drop_request("r")  # an abort of the parent ends the nested phase with it
    assert [p.phase_id for p in released] == ["r/p0", "r/p0/b0/p0"]
    assert all(p.state is Stage.DONE and not p.waiting and not p.pending for p in released)
    assert len(reg) == 0 and not reg.by_branch and not reg.by_parent and not reg.counts
