"""Phase-affine DP dispatch (dp_dispatch.py): affinity keys, the bounded phase -> rank map, and the
controller hook driven by a controller double that dispatches like SGLang's (the rank a method
picks is read as `self.workers[rank]` right before the send)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest

from branchwise import request_meta
from branchwise.ingress import dp_dispatch as dp


def cp(**fields: Any) -> dict:
    return {"branchwise": fields}


@pytest.mark.parametrize(("custom_params", "routing_key", "key"), [
    (cp(phase="fork-abc", branch=1, fanout=4), None, "fork-abc"),
    (cp(phase="fork-abc/b1/f0", branch=0, fanout=2), None, "fork-abc"),  # nested fork: parent's rank
    (None, "fork-abc", "fork-abc"),  # the frontend's fork-point prefix request
    (None, "fork-abc/b2/f1", "fork-abc"),
    (cp(phase="p1"), "other", "p1"),  # a stamp wins over routing_key
    (None, None, None),  # serial
    (cp(slo_tpot_ms=40), None, None),  # serial with an SLO
    ({"other": 1}, None, None),
])
def test_affinity_key(custom_params: Any, routing_key: Any, key: str | None) -> None:
    assert request_meta.affinity_key(custom_params, routing_key) == key


@pytest.mark.parametrize("custom_params", [
    "x", 3, [], {"branchwise": "x"}, {"branchwise": None}, cp(phase=5), cp(phase=""), cp(phase=None),
    cp(phase="/leading"), {"branchwise": {"phase": ["a"]}},
])
def test_affinity_key_is_total_over_malformed_input(custom_params: Any) -> None:
    assert request_meta.affinity_key(custom_params, routing_key=7) is None


def test_affinity_key_length_is_bounded() -> None:
    assert len(request_meta.affinity_key(cp(phase="x" * 10_000))) == request_meta.MAX_KEY_CHARS


def test_phase_ranks_remembers_and_routes() -> None:
    m = dp.PhaseRanks(capacity=8)
    assert m.lookup("a", active=[0, 1]) is None
    m.remember("a", 1)
    assert m.lookup("a", active=[0, 1]) == 1
    assert m.report() == {"keys": 1, "routed": 1, "placed": 1, "evicted": 0, "replaced": 0}


def test_phase_ranks_forgets_an_inactive_rank() -> None:
    m = dp.PhaseRanks()
    m.remember("a", 1)
    assert m.lookup("a", active=[0]) is None
    assert "a" not in m.ranks and m.replaced == 1


def test_phase_ranks_is_bounded_lru() -> None:
    m = dp.PhaseRanks(capacity=3)
    for k in "abc":
        m.remember(k, 0)
    assert m.lookup("a", active=[0]) == 0  # a is now the most recent
    m.remember("d", 1)
    assert list(m.ranks) == ["c", "a", "d"] and m.evicted == 1
    for i in range(10_000):
        m.remember(f"p{i}", i % 2)
    assert len(m.ranks) == 3 and m.evicted == 10_001


def test_phase_ranks_rejects_zero_capacity() -> None:
    with pytest.raises(ValueError, match="capacity"):
        dp.PhaseRanks(capacity=0)


def test_phase_rows_is_bounded() -> None:
    rows = dp.PhaseRows(capacity=2)
    for phase in ["a", "a", "b", "c"]:
        rows.add(phase)
    assert rows.rows == {"b": 1, "c": 1}


# ---- the controller hook on a double of SGLang's DataParallelController --------------------------
@dataclass
class Controller:
    """Round-robin and external routing as data_parallel_controller.py does them."""

    n: int = 2
    sent: list[tuple[int, Any]] = field(default_factory=list)
    workers: list[Any] = field(default_factory=list)
    counter: itertools.count = field(default_factory=itertools.count)

    def __post_init__(self) -> None:
        self.workers = [f"sock{i}" for i in range(self.n)]
        self._active_workers = list(range(self.n))

    def dispatching_with_trace(self, req: Any) -> None:
        if req.routed_dp_rank is not None:
            rank = req.routed_dp_rank
            if self.workers[rank] is None:
                raise ValueError(f"DP rank {rank} is not active.")
        else:
            rank = next(self.counter) % self.n
        self.sent.append((self.workers.index(self.workers[rank]), req))


def request(phase: str | None = None, routing_key: str | None = None, routed: int | None = None) -> Any:
    custom = cp(phase=phase, branch=0, fanout=4) if phase else None
    return SimpleNamespace(sampling_params=SimpleNamespace(custom_params=custom), routing_key=routing_key,
                           routed_dp_rank=routed, rid="r")


def dispatch(ctl: Controller, req: Any) -> int:
    dp.around_dispatching_with_trace(type(ctl).dispatching_with_trace, ctl, req)
    return ctl.sent[-1][0]


@pytest.fixture
def ctl() -> Controller:
    c = Controller()
    dp.after_controller_init(None, c)
    return c


def test_phase_requests_follow_the_first_one(ctl: Controller) -> None:
    # round robin would alternate ranks; a phase's requests all go where its first request went
    first = dispatch(ctl, request(routing_key="g1"))  # fork-point prefix request
    assert [dispatch(ctl, request(phase="g1")) for _ in range(4)] == [first] * 4
    assert dispatch(ctl, request(phase="g1/b2/f0")) == first  # nested fork in a branch


def test_serial_requests_keep_the_configured_method(ctl: Controller) -> None:
    dispatch(ctl, request(phase="g1"))
    ranks = [dispatch(ctl, request()) for _ in range(4)]
    assert ranks in ([1, 0, 1, 0], [0, 1, 0, 1])
    assert all(r.routed_dp_rank is None for _, r in ctl.sent)


def test_phases_are_spread_by_the_configured_method(ctl: Controller) -> None:
    firsts = [dispatch(ctl, request(phase=f"g{i}")) for i in range(4)]
    assert firsts == [0, 1, 0, 1]
    assert [dispatch(ctl, request(phase=f"g{i}")) for i in range(4)] == firsts


def test_client_routed_requests_are_untouched(ctl: Controller) -> None:
    assert dispatch(ctl, request(phase="g1", routed=1)) == 1
    assert "g1" not in ctl._branchwise_phase_ranks.ranks  # the client's choice is not remembered


def test_a_phase_whose_rank_left_is_placed_again(ctl: Controller) -> None:
    first = dispatch(ctl, request(phase="g1"))
    ctl._active_workers = [1 - first]
    assert dispatch(ctl, request(phase="g1")) in (0, 1)
    assert ctl._branchwise_phase_ranks.replaced == 1


def test_a_request_that_breaks_key_parsing_is_dispatched_plainly(ctl: Controller) -> None:
    class Hostile:
        @property
        def custom_params(self) -> Any:
            raise RuntimeError("boom")

    req = SimpleNamespace(sampling_params=Hostile(), routing_key=None, routed_dp_rank=None, rid="r")
    dispatch(ctl, req)
    assert req.routed_dp_rank is None and len(ctl.sent) == 1


def test_the_map_stays_bounded_over_many_phases(ctl: Controller) -> None:
    ctl._branchwise_phase_ranks = dp.PhaseRanks(capacity=16)
    for i in range(2000):
        for _ in range(3):
            dispatch(ctl, request(phase=f"g{i}"))
    assert len(ctl._branchwise_phase_ranks.ranks) == 16
    phase_ranks: dict[str, set[int]] = {}
    for rank, req in ctl.sent:
        phase_ranks.setdefault(req.sampling_params.custom_params["branchwise"]["phase"], set()).add(rank)
    assert all(len(r) == 1 for r in phase_ranks.values())


def test_internal_state_gains_rank_and_phase_rows() -> None:
    """The scheduler's part: rows per phase, merged into its "branchwise" report (runtime.Branchwise)."""
    from branchwise import runtime
    from branchwise import scheduler_hook as sh
    from branchwise.config import BranchwiseConfig

    part = dp.SchedulerDp(dp_rank=1)
    for phase in ["g1", "g1", None]:
        part.on_request_created(SimpleNamespace(bw_meta=SimpleNamespace(phase=phase)))
    cfg = BranchwiseConfig()
    rep = runtime.Branchwise(config=cfg, state=sh.BranchwiseState(config=cfg), dp=part).report()["branchwise"]
    assert rep["dp_rank"] == 1
    assert rep["phase_rows"] == {"g1": 2}
    assert rep["config"] == cfg.as_dict()  # the taper report it joins
