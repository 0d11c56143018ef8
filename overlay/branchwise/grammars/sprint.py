"""SPRINT detector: rounds of planning and parallel execution (tags configurable via SprintTags).

    <Plan>
    free planner text
    <Task id=1>
    prompt for task 1
    </Task>
    <Task id=2>
    prompt for task 2
    </Task>
    </Plan>
    <Execution id=1>
    executor 1's work
    </Execution>
    <Execution id=2>
    executor 2's work
    </Execution>
    <Plan>
    ... next round ...
    </Plan>
    ...
    <Answer>
    final answer
    </Answer>

Fork point: the end of the `</Plan>` line; fanout = number of tasks; branch i's header is
"<Execution id=K>\\n" with K the i-th task id. Every executor sees the cumulative context (all earlier
rounds) plus the plan, which is the shared prefix, plus its own header. Branch end: `</Execution>`.
Join: executions are appended in task order (`fmt`), then the planner continues freely with the next
<Plan> or <Answer>; the phase closes when the last execution of the round is in (PhaseClosed).
`id=K`, `id="K"` and `id='K'` are accepted; ids are digits/dots/word characters.

Checks: a plan announces >= 1 task, each with a unique id; tasks only inside a plan; executions come
after their plan, one per task, in task order with matching ids; no new <Plan> or <Answer> before the
round's executions are all in; no <Plan> inside an execution (SPRINT does not nest); nothing left open
and no round half-executed at end of stream. Free text is allowed anywhere.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from branchwise.grammars.base import (
    BranchClosed,
    Detector,
    GrammarError,
    Lexeme,
    Mode,
    Node,
    PhaseClosed,
    PhaseOpened,
)
from branchwise.phases import ReduceFormat


@dataclass(frozen=True, slots=True)
class SprintTags:
    plan: str = "Plan"
    task: str = "Task"
    execution: str = "Execution"
    answer: str = "Answer"
    id_attr: str = "id"


class SprintDetector(Detector):
    name = "sprint"

    def __init__(
        self,
        tags: SprintTags | None = None,
        *,
        mode: Mode | str = Mode.PARENT,
        index: int = 0,
        label: str = "1",
        depth: int = 0,
    ) -> None:
        t = self.tags = tags or SprintTags()
        names = frozenset((t.plan, t.task, t.execution, t.answer))
        super().__init__(names, frozenset((t.task, t.execution)), mode, dict(tags=t))
        self._attr = re.compile(rf"{re.escape(t.id_attr)}\s*=\s*([\"']?)([\w.]+)\1")
        self.fmt = ReduceFormat(f"\n</{t.execution}>", "\n", "")
        self.index, self.depth = index, depth
        self._own: Node | None = None
        self._round: list[str] = []  # task ids of the plan being executed
        self._done = 0  # executions of that plan seen so far
        if self.mode is Mode.BRANCH:  # we start just after "<Execution id=K>\n"
            self._own = self._push(t.execution, Lexeme(0, 0), label, depth)

    def header(self, label: str) -> str:
        return f"<{self.tags.execution} {self.tags.id_attr}={label}>\n"

    def _id(self, tag: str, lx: Lexeme) -> str:
        if not lx.attrs:
            raise GrammarError(f"<{tag}> without {self.tags.id_attr}", lx.start)
        m = self._attr.fullmatch(lx.attrs)
        if m is None:
            raise GrammarError(f"<{tag} {lx.attrs}>: expected {self.tags.id_attr}=K", lx.start)
        return m[2]

    def _open(self, tag: str, lx: Lexeme) -> None:
        t, top = self.tags, self.stack[-1]
        pending = len(self._round) - self._done
        if tag == t.task:
            if top.tag != t.plan:
                raise GrammarError(f"<{tag}> outside <{t.plan}>", lx.start)
            k = self._id(tag, lx)
            if k in (c.label for c in top.kids(t.task)):
                raise GrammarError(f"duplicate task id {k!r}", lx.start)
            self._push(tag, lx, k)
            return
        if top is not self.root:
            what = "nested plans are not supported" if tag == t.plan else "only at top level"
            raise GrammarError(f"<{tag}> inside <{top.tag}>: {what}", lx.start)
        if tag == t.execution:
            k = self._id(tag, lx)
            if not pending:
                raise GrammarError(
                    f"<{tag} {t.id_attr}={k}> without an open task (more executions than tasks)", lx.start
                )
            if k != self._round[self._done]:
                raise GrammarError(
                    f"execution id {k!r} out of order, expected {self._round[self._done]!r}", lx.start
                )
            self._push(tag, lx, k)
        else:  # plan, answer
            if pending:
                raise GrammarError(
                    f"<{tag}> before the {pending} remaining executions of the last plan", lx.start
                )
            self._push(tag, lx)

    def _close(self, tag: str, lx: Lexeme) -> None:
        t = self.tags
        node = self._pop(tag, lx)
        if tag == t.plan:
            ids = tuple(c.label for c in node.kids(t.task))
            if not ids:
                raise GrammarError(f"<{tag}> with zero tasks", node.start)
            self._round, self._done = list(ids), 0
            hdr = tuple(self.header(k) for k in ids)
            self._fork(PhaseOpened(len(ids), hdr, ids, self._inner(node, lx.start), self.depth, lx.end))
        elif tag == t.execution:
            if node is self._own:
                return self._branch_done(BranchClosed(self.index, node.label, self.depth, lx.end))
            self._emit(BranchClosed(self._done, node.label, self.depth, lx.end))
            self._done += 1
            if self._done == len(self._round):
                self._emit(PhaseClosed(self.depth, lx.end))

    def _eof(self) -> None:
        top = self.stack[-1]
        if top is self._own:
            raise GrammarError(f"branch {top.label} ended without </{top.tag}>", self.pos)
        if top is not self.root:
            raise GrammarError(f"unclosed <{top.tag}> at end of stream (opened at {top.start})", self.pos)
        if self._done < len(self._round):
            raise GrammarError(f"stream ended after {self._done} of {len(self._round)} executions", self.pos)
