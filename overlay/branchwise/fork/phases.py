"""The parallel-phase lifecycle, pure (no SGLang import): what a phase is, the one state machine it
goes through from fork to join, and the text a sequence's detector reads (docs/design/server-fork.md).
"""

from __future__ import annotations

import hashlib
from array import array
from bisect import bisect_right
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any


class PhaseError(RuntimeError):
    """A phase was driven out of order (double close, early reduce, over-fanout, too deep)."""


class Stage(StrEnum):
    FORKING = "forking"
    PARALLEL = "parallel"
    REDUCE = "reduce"
    DONE = "done"


WAITING = frozenset({Stage.FORKING, Stage.PARALLEL})  # the parent does not decode


@dataclass(frozen=True, slots=True)
class ReduceFormat:
    """How branch outputs are stitched back into the parent (per grammar)."""

    close: str = ""
    sep: str = ""
    suffix: str = ""


def needs_close(text: str, close: str) -> bool:
    """A branch that stopped without its close tag gets one appended (keeps the parent well formed)."""
    return bool(close) and not text.rstrip().endswith(close.strip())


def reduce(fmt: ReduceFormat, headers: Sequence[str], outputs: Sequence[str]) -> str:
    """Canonical reduce: branch i's header and output, in branch-index order, then the suffix."""
    parts = [header + out + (fmt.close if needs_close(out, fmt.close) else "") + fmt.sep
             for header, out in zip(headers, outputs, strict=True)]
    return "".join(parts) + fmt.suffix


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


@dataclass(slots=True, kw_only=True)
class ParallelPhase:
    """One phase from fork to release; `state` is its lifecycle (`Stage`)."""

    phase_id: str
    parent_rid: str
    fanout: int
    prefix_text: str = ""  # P: everything the parent saw up to the fork point
    prefix_len: int = 0  # P in tokens (the server's radix-shared length)
    header: str = ""  # H: phase-level header (Multiverse goal, SPRINT plan)
    depth: int = 0  # 0 = top level; a phase opened inside a branch is one deeper
    fmt: ReduceFormat = field(default_factory=ReduceFormat)
    branches: list[Branch] = field(default_factory=list)
    state: Stage = Stage.FORKING
    # the fork point in the parent's output: whole tokens kept, the text of a token it cuts through
    keep: int = 0
    leftover: str = ""
    header_ids: list[list[int]] = field(default_factory=list)  # branch i's header (with leftover) in ids
    shared: int = 0  # prefix tokens the parent left in the prefix cache when it was parked
    grants: list[int] = field(default_factory=list)  # decode tokens branch i may use (granted at the fork)
    owner: Any = field(default=None, repr=False, compare=False)  # the parent sequence (opaque here)
    pin: Any = field(default=None, repr=False, compare=False)  # what holds the parked prefix (opaque here)

    def __post_init__(self) -> None:
        if self.fanout < 1:
            raise PhaseError(f"phase {self.phase_id}: fanout must be >= 1, got {self.fanout}")

    def add_branch(self, header: str, label: str) -> Branch:
        """Branch number len(branches), with rid f"{phase_id}/b{i}"."""
        i = len(self.branches)
        if i >= self.fanout:
            raise PhaseError(f"phase {self.phase_id}: branch {i} outside fanout {self.fanout}")
        branch = Branch(index=i, rid=f"{self.phase_id}/b{i}", header=header, label=label)
        self.branches.append(branch)
        return branch

    def branch(self, i: int) -> Branch:
        if not 0 <= i < len(self.branches):
            raise PhaseError(f"phase {self.phase_id}: no branch {i}")
        return self.branches[i]

    def branch_input(self, i: int, prefix: array) -> array:
        """Isolation: branch i reads the shared prefix and its own header ids, nothing of a sibling."""
        return prefix + array("q", self.header_ids[i])

    def park(self) -> None:
        """FORKING -> PARALLEL: the parent is parked (its branches are queued next)."""
        self._expect(Stage.FORKING, "park")
        self.state = Stage.PARALLEL

    def close_branch(self, i: int, text: str = "", ids: list[int] | None = None, reason: str = "tag") -> bool:
        """Record branch i's final output. Returns True when this was the last open branch."""
        self._expect(Stage.PARALLEL, f"close branch {i}")
        branch = self.branch(i)
        if branch.finished:
            raise PhaseError(f"phase {self.phase_id}: branch {i} closed twice")
        branch.output_text, branch.output_ids = text, list(ids or [])
        branch.finished, branch.finish_reason = True, reason
        return self.all_closed

    @property
    def all_closed(self) -> bool:
        return len(self.branches) == self.fanout and all(branch.finished for branch in self.branches)

    @property
    def open_branches(self) -> list[int]:
        return [branch.index for branch in self.branches if not branch.finished]

    @property
    def waiting(self) -> bool:
        """The parent waits at the fork (FORKING) or on its branches (PARALLEL)."""
        return self.state in WAITING

    @property
    def pending(self) -> bool:
        """Work for the next scheduling point: park and spawn (FORKING), or join (all closed)."""
        return self.state is Stage.FORKING or (self.state is Stage.PARALLEL and self.all_closed)

    def granted(self) -> int:
        """Decode tokens still granted: all until the branches are spawned, then those not ended."""
        if self.state is Stage.FORKING:
            return sum(self.grants)
        if self.state is not Stage.PARALLEL:
            return 0
        return sum(grant for grant, branch in zip(self.grants, self.branches, strict=False)
                   if not branch.finished)

    def join(self) -> str:
        """PARALLEL -> REDUCE: all branches closed; the text the parent continues from."""
        self._expect(Stage.PARALLEL, "join")
        if not self.all_closed:
            raise PhaseError(f"phase {self.phase_id}: reduce before all branches closed "
                             f"(open: {self.open_branches})")
        self.state = Stage.REDUCE
        return reduce(self.fmt, [branch.header for branch in self.branches],
                      [branch.output_text for branch in self.branches])

    def _expect(self, stage: Stage, what: str) -> None:
        if self.state is not stage:
            raise PhaseError(f"phase {self.phase_id}: cannot {what} in state {self.state}")


def branch_seed(seed: int, branch_rid: str) -> int:
    """Per-branch sampling seed from (seed, rid) only: a branch's draws never depend on the schedule."""
    digest = hashlib.blake2b(f"{seed}:{branch_rid}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & 0x7FFF_FFFF_FFFF_FFFF


class PhaseRegistry:
    """Open phases keyed by phase id, branch rid and parent rid."""

    def __init__(self, max_depth: int = 3) -> None:
        self.max_depth = max_depth
        self.phases: dict[str, ParallelPhase] = {}
        self.by_branch: dict[str, tuple[str, int]] = {}  # branch rid -> (phase id, index)
        self.by_parent: dict[str, str] = {}  # parent rid -> its open phase id
        self.counts: dict[str, int] = {}  # parent rid -> phases opened so far (names p0, p1, ...)

    def __len__(self) -> int:
        return len(self.phases)

    def open(self, parent_rid: str, headers: Sequence[str], labels: Sequence[str], **kw) -> ParallelPhase:
        """A fork: the phase (FORKING) and all its branches, with derived rids."""
        if parent_rid in self.by_parent:
            raise PhaseError(f"request {parent_rid} already waits on phase {self.by_parent[parent_rid]}")
        owner = self.of_branch(parent_rid)
        depth = owner[0].depth + 1 if owner is not None else 0
        if depth >= self.max_depth:
            raise PhaseError(f"request {parent_rid}: nesting depth {depth} exceeds limit "
                             f"{self.max_depth - 1}")
        opened = self.counts.get(parent_rid, 0)
        self.counts[parent_rid] = opened + 1
        phase = ParallelPhase(phase_id=f"{parent_rid}/p{opened}", parent_rid=parent_rid, fanout=len(headers),
                              depth=depth, **kw)
        for header, label in zip(headers, labels, strict=True):
            branch = phase.add_branch(header, label)
            self.by_branch[branch.rid] = (phase.phase_id, branch.index)
        self.phases[phase.phase_id], self.by_parent[parent_rid] = phase, phase.phase_id
        return phase

    def of_branch(self, rid: str) -> tuple[ParallelPhase, Branch] | None:
        if (hit := self.by_branch.get(rid)) is None:
            return None
        phase = self.phases[hit[0]]
        return phase, phase.branch(hit[1])

    def of_parent(self, rid: str) -> ParallelPhase | None:
        pid = self.by_parent.get(rid)
        return self.phases[pid] if pid else None

    def release(self, phase_id: str) -> list[ParallelPhase]:
        """Forget a closed or dropped phase and those nested in it; returns them outermost first."""
        phase = self.phases.pop(phase_id, None)
        if phase is None:
            raise PhaseError(f"unknown phase {phase_id}")
        phase.state = Stage.DONE
        if self.by_parent.get(phase.parent_rid) == phase_id:
            del self.by_parent[phase.parent_rid]
        out = [phase]
        for branch in phase.branches:
            self.by_branch.pop(branch.rid, None)
            self.counts.pop(branch.rid, None)
            if (nested := self.by_parent.get(branch.rid)) is not None:
                out += self.release(nested)
        return out

    def drop_request(self, rid: str) -> list[ParallelPhase]:
        """Abort/finish of exactly `rid`: release its open phase and every phase nested under it."""
        self.counts.pop(rid, None)
        pid = self.by_parent.get(rid)
        return self.release(pid) if pid is not None else []

    def in_state(self, *stages: Stage) -> list[ParallelPhase]:
        return [phase for phase in self.phases.values() if phase.state in stages]

    def subtree(self, rid: str) -> list[ParallelPhase]:
        """The open phase of `rid` and every phase nested in it."""
        out, todo = [], [rid]
        while todo:
            if (phase := self.of_parent(todo.pop())) is not None:
                out.append(phase)
                todo += [branch.rid for branch in phase.branches]
        return out

    def root_of(self, rid: str) -> str:
        """The client request a (possibly nested) server-side branch belongs to."""
        while (hit := self.by_branch.get(rid)) is not None:
            rid = self.phases[hit[0]].parent_rid
        return rid




@dataclass(slots=True)
class TextStream:
    """Incremental detokenizer for one sequence's output ids, with per-token character ends."""

    HOLD = 4

    decode: Callable[[Sequence[int]], str]
    fed: int = 0  # output ids consumed
    read: int = 0  # output ids whose text was emitted (fed - read: held back)
    prefix: int = 0  # window start: decoding context for the next ids
    pos: int = 0  # characters emitted
    ends: list[int] = field(default_factory=list)

    def feed(self, ids: Sequence[int]) -> str:
        n = len(ids)
        if n <= self.fed:
            return ""
        self.fed = n
        full = self.decode(ids[self.prefix : n])
        if full.endswith("\ufffd") and n - self.read < self.HOLD:
            return ""
        new = full[len(self.decode(ids[self.prefix : self.read])) :]
        self.pos += len(new)
        self.ends.extend([self.pos] * (n - self.read))
        self.prefix, self.read = max(self.read - 4, 0), n
        return new

    def cut(self, at: int) -> int:
        """Number of whole output tokens whose text ends at or before character `at`."""
        return bisect_right(self.ends, at, 0, self.read)

    def split(self, at: int, text: str) -> tuple[int, str]:
        """A cut at character `at`: the whole tokens kept, and the kept text of the token it cuts."""
        keep = self.cut(at)
        return keep, text[(self.ends[keep - 1] if keep else 0) : at]

    def truncate(self, keep: int, pos: int) -> None:
        """Forget ids past `keep`; the detector keeps `pos` characters (a cut inside a token)."""
        del self.ends[keep:]
        self.fed = self.read = keep
        self.prefix = max(keep - 4, 0)
        self.pos = pos

    def skip(self, n: int, pos: int) -> None:
        """`n` ids were appended whose text the detector got otherwise (a join)."""
        self.ends.extend([pos] * n)
        self.fed = self.read = self.fed + n
        self.prefix = max(self.read - 4, 0)
        self.pos = pos




def branch_budget(parent_max_new: int, kept: int, header_len: int) -> int:
    """Tokens a branch may decode: what the parent's budget has left after prefix and header."""
    return parent_max_new - kept - header_len


def fork_limit_error(fanout: int, grants: Sequence[int], granted: int, max_fanout: int,
                     max_tokens: int) -> str | None:
    """Why a fork may not be taken (the request then continues serially), or None."""
    if fanout > max_fanout:
        return f"fork of {fanout} branches exceeds --branch-max-fanout {max_fanout}; continued serially"
    total = sum(grants)
    if granted + total > max_tokens:
        return (f"fork of {fanout} branches would grant {total} decode tokens ({granted} already held by "
                f"live branches), over --branch-max-branch-tokens {max_tokens}; continued serially")
    return None
