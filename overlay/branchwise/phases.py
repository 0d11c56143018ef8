"""The parallel-phase model (TAPER §3.1): phase = (prefix P, phase header H, branch headers h_i, fanout n).

Pure bookkeeping, no SGLang import. Two invariants make any branch schedule output-identical
(TAPER Lemma 1, Appendix A), and this module is where they are enforced:
  * visibility: branch i's input is P + h_i, never a sibling's text (`branch_prompt`);
  * canonical reduce: branch outputs are joined in branch-index order, never completion order
    (`reduce_text`).

Branch request ids are derived, not random: f"{parent_rid}/p{n}/b{i}". SGLang aborts every request
whose rid starts with the aborted rid, so aborting a parent reaches all its branches (and nested ones).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from enum import StrEnum


class PhaseError(RuntimeError):
    """A phase was driven out of order (double close, early reduce, over-fanout, too deep)."""


class Stage(StrEnum):
    SERIAL = "serial"  # request decodes one sequence (no open phase)
    PARALLEL = "parallel"  # branches decoding; parent waits
    REDUCE = "reduce"  # branches joined; parent decodes the reduce (e.g. <Conclusion>)
    DONE = "done"  # phase finished and released


@dataclass(frozen=True, slots=True)
class ReduceFormat:
    """How branch outputs are stitched back into the parent (per grammar).

    Each branch contributes header + output (+ `close` if the branch stopped without writing it,
    e.g. hit max tokens) + `sep`; `suffix` follows the last branch (Multiverse forces <Conclusion>).
    """

    close: str = ""
    sep: str = ""
    suffix: str = ""


@dataclass(slots=True)
class Branch:
    index: int
    rid: str
    header: str  # h_i: text appended to the shared prefix for this branch only
    label: str = ""  # grammar id, e.g. "2" or "1.1"
    output_text: str = ""  # what the branch generated (up to and including its close tag)
    output_ids: list[int] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None  # "tag" | "stop" | "length" | "abort" | ...


@dataclass(slots=True)
class ParallelPhase:
    phase_id: str
    parent_rid: str
    fanout: int
    prefix_text: str = ""  # P: everything the parent saw up to the fork point
    prefix_len: int = 0  # P in tokens (the server's radix-shared length)
    header: str = ""  # H: phase-level header (Multiverse goal, SPRINT plan)
    depth: int = 0  # 0 = top level; a phase opened inside a branch is one deeper
    fmt: ReduceFormat = field(default_factory=ReduceFormat)
    branches: list[Branch | None] = field(default_factory=list)
    state: Stage = Stage.PARALLEL
    completion_order: list[int] = field(default_factory=list)  # for metrics only, never for reduce

    def __post_init__(self) -> None:
        if self.fanout < 1:
            raise PhaseError(f"phase {self.phase_id}: fanout must be >= 1, got {self.fanout}")
        if not self.branches:
            self.branches = [None] * self.fanout

    def branch_rid(self, i: int) -> str:
        return f"{self.phase_id}/b{i}"

    def add_branch(self, index: int, header: str = "", *, rid: str | None = None, label: str = "") -> Branch:
        """Attach branch `index` (server-side: all at open; client-side: as sibling requests arrive)."""
        if not 0 <= index < self.fanout:
            raise PhaseError(
                f"phase {self.phase_id}: branch index {index} outside fanout {self.fanout} "
                "(more branches than announced)"
            )
        if self.branches[index] is not None:
            raise PhaseError(f"phase {self.phase_id}: branch {index} attached twice")
        b = Branch(index, rid or self.branch_rid(index), header, label)
        self.branches[index] = b
        return b

    def branch(self, i: int) -> Branch:
        b = self.branches[i] if 0 <= i < self.fanout else None
        if b is None:
            raise PhaseError(f"phase {self.phase_id}: no branch {i}")
        return b

    def close_branch(self, i: int, text: str = "", ids: list[int] | None = None, reason: str = "tag") -> bool:
        """Record branch i's final output. Returns True when this was the last open branch."""
        if self.state is not Stage.PARALLEL:
            raise PhaseError(f"phase {self.phase_id}: cannot close branch {i} in state {self.state}")
        b = self.branch(i)
        if b.finished:
            raise PhaseError(f"phase {self.phase_id}: branch {i} closed twice")
        b.output_text, b.output_ids = text, list(ids or [])
        b.finished, b.finish_reason = True, reason
        self.completion_order.append(i)
        return self.all_closed

    @property
    def all_closed(self) -> bool:
        return all(b is not None and b.finished for b in self.branches)

    @property
    def open_branches(self) -> list[int]:
        return [i for i, b in enumerate(self.branches) if b is None or not b.finished]

    def join(self) -> str:
        """All branches closed: move to REDUCE and return the text the parent continues from."""
        text = reduce_text(self)
        self.state = Stage.REDUCE
        return text


def branch_prompt(phase: ParallelPhase, i: int) -> str:
    """Visibility rule: shared prefix + this branch's own header; siblings are invisible."""
    return phase.prefix_text + phase.branch(i).header


def reduce_text(phase: ParallelPhase) -> str:
    """Canonical reduce: outputs in branch-index order regardless of completion order."""
    if not phase.all_closed:
        raise PhaseError(
            f"phase {phase.phase_id}: reduce before all branches closed (open: {phase.open_branches})"
        )
    f, parts = phase.fmt, []
    for b in phase.branches:
        assert b is not None
        out = b.output_text
        if f.close and not out.rstrip().endswith(f.close.strip()):
            out += f.close  # branch stopped early (length/EOS): keep the parent's text well formed
        parts.append(b.header + out + f.sep)
    return "".join(parts) + f.suffix


def branch_seed(seed: int, branch_rid: str) -> int:
    """Per-branch sampling seed that depends only on (seed, rid): stochastic decoding stays
    schedule-invariant (Appendix A) because no branch's draws depend on when siblings ran."""
    h = hashlib.blake2b(f"{seed}:{branch_rid}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") & 0x7FFF_FFFF_FFFF_FFFF


class PhaseRegistry:
    """Open phases keyed by phase id, branch rid and parent rid.

    A parent has at most one open phase at a time (it waits at the fork until reduce); a branch may
    itself be the parent of a nested phase, one level deeper.
    """

    def __init__(self, max_depth: int = 3) -> None:
        self.max_depth = max_depth
        self.phases: dict[str, ParallelPhase] = {}
        self.by_branch: dict[str, tuple[str, int]] = {}  # branch rid -> (phase id, index)
        self.by_parent: dict[str, str] = {}  # parent rid -> its open phase id
        self._count: dict[str, int] = {}  # parent rid -> phases opened so far (names p0, p1, ...)

    def __len__(self) -> int:
        return len(self.phases)

    def _new(self, parent_rid: str, fanout: int, phase_id: str | None, **kw) -> ParallelPhase:
        if parent_rid in self.by_parent:
            raise PhaseError(f"request {parent_rid} already waits on phase {self.by_parent[parent_rid]}")
        depth = 0
        if (owner := self.of_branch(parent_rid)) is not None:
            depth = owner[0].depth + 1
        if depth >= self.max_depth:
            raise PhaseError(
                f"request {parent_rid}: nesting depth {depth} exceeds limit {self.max_depth - 1}"
            )
        n = self._count.get(parent_rid, 0)
        self._count[parent_rid] = n + 1
        pid = phase_id or f"{parent_rid}/p{n}"
        if pid in self.phases:
            raise PhaseError(f"phase {pid} already open")
        ph = ParallelPhase(pid, parent_rid, fanout, depth=depth, **kw)
        self.phases[pid], self.by_parent[parent_rid] = ph, pid
        return ph

    def open(
        self,
        parent_rid: str,
        headers: list[str] | tuple[str, ...],
        *,
        labels: list[str] | tuple[str, ...] = (),
        **kw,
    ) -> ParallelPhase:
        """Server-side fork: create the phase and all its branches with derived rids."""
        ph = self._new(parent_rid, len(headers), None, **kw)
        for i, h in enumerate(headers):
            self._index(ph, ph.add_branch(i, h, label=labels[i] if i < len(labels) else str(i + 1)))
        return ph

    def announce(self, phase_id: str, parent_rid: str, fanout: int, **kw) -> ParallelPhase:
        """Client-side fork (frontend s.fork): the phase is known before its sibling requests."""
        return self._new(parent_rid, fanout, phase_id, **kw)

    def attach(self, phase_id: str, index: int, rid: str, header: str = "") -> Branch:
        ph = self.phase(phase_id)
        b = ph.add_branch(index, header, rid=rid)
        self._index(ph, b)
        return b

    def _index(self, ph: ParallelPhase, b: Branch) -> None:
        if b.rid in self.by_branch:
            raise PhaseError(f"branch rid {b.rid} already registered")
        self.by_branch[b.rid] = (ph.phase_id, b.index)

    def phase(self, phase_id: str) -> ParallelPhase:
        try:
            return self.phases[phase_id]
        except KeyError:
            raise PhaseError(f"unknown phase {phase_id}") from None

    def of_branch(self, rid: str) -> tuple[ParallelPhase, Branch] | None:
        if (hit := self.by_branch.get(rid)) is None:
            return None
        ph = self.phases[hit[0]]
        return ph, ph.branch(hit[1])

    def of_parent(self, rid: str) -> ParallelPhase | None:
        pid = self.by_parent.get(rid)
        return self.phases[pid] if pid else None

    def stage(self, rid: str) -> Stage:
        """Stage of a request (parent or branch) as its own sequence sees it."""
        ph = self.of_parent(rid)
        return ph.state if ph is not None else Stage.SERIAL

    def close_branch(
        self, rid: str, text: str = "", ids: list[int] | None = None, reason: str = "tag"
    ) -> ParallelPhase:
        """Close the branch with request id `rid`; caller joins when `phase.all_closed`."""
        hit = self.of_branch(rid)
        if hit is None:
            raise PhaseError(f"{rid} is not a registered branch")
        hit[0].close_branch(hit[1].index, text, ids, reason)
        return hit[0]

    def release(self, phase_id: str) -> ParallelPhase:
        """Forget a finished phase (after its reduce), or an aborted one. Nested phases go too."""
        ph = self.phases.pop(phase_id, None)
        if ph is None:
            raise PhaseError(f"unknown phase {phase_id}")
        ph.state = Stage.DONE
        if self.by_parent.get(ph.parent_rid) == phase_id:
            del self.by_parent[ph.parent_rid]
        for b in ph.branches:
            if b is None:
                continue
            self.by_branch.pop(b.rid, None)
            self._count.pop(b.rid, None)
            if (nested := self.by_parent.get(b.rid)) is not None:
                self.release(nested)
        return ph

    def drop_request(self, rid: str) -> list[str]:
        """Abort/finish of `rid`: release its phases and every phase under its derived rids.
        Matches `rid` and `rid/...` only, so finishing "r1" never touches "r10"."""

        def mine(k: str) -> bool:
            return k == rid or k.startswith(rid + "/")

        before = list(self.phases)
        for pid in [pid for pid, ph in self.phases.items() if mine(ph.parent_rid)]:
            if pid in self.phases:  # may have gone with an enclosing phase
                self.release(pid)
        self._count = {k: v for k, v in self._count.items() if not mine(k)}
        return [pid for pid in before if pid not in self.phases]
