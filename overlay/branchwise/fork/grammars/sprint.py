"""SPRINT detector: rounds of planning and parallel execution (tags via SprintTags).
Design: docs/design/branch-grammars.md."""

from __future__ import annotations

import re
from dataclasses import dataclass

from branchwise.fork.grammars.base import (
    BranchClosed,
    Detector,
    GrammarError,
    Lexeme,
    Mode,
    Node,
    PhaseClosed,
    PhaseOpened,
)
from branchwise.fork.phases import ReduceFormat


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
        tags = self.tags = tags or SprintTags()
        names = frozenset((tags.plan, tags.task, tags.execution, tags.answer))
        super().__init__(names, frozenset((tags.task, tags.execution)), mode, dict(tags=tags))
        self._attr = re.compile(rf"{re.escape(tags.id_attr)}\s*=\s*([\"']?)([\w.]+)\1")
        self.fmt = ReduceFormat(close=f"\n</{tags.execution}>", sep="\n", suffix="")
        self.index, self.depth = index, depth
        self._own: Node | None = None
        self._round: list[str] = []  # task ids of the plan being executed
        self._done = 0  # executions of that plan seen so far
        if self.mode is Mode.BRANCH:  # we start just after "<Execution id=K>\n"
            self._own = self._push(tags.execution, Lexeme(start=0, end=0), label, depth)

    def header(self, label: str) -> str:
        return f"<{self.tags.execution} {self.tags.id_attr}={label}>\n"

    def _id(self, tag: str, lexeme: Lexeme) -> str:
        if not lexeme.attrs:
            raise GrammarError(f"<{tag}> without {self.tags.id_attr}", lexeme.start)
        match = self._attr.fullmatch(lexeme.attrs)
        if match is None:
            raise GrammarError(f"<{tag} {lexeme.attrs}>: expected {self.tags.id_attr}=K", lexeme.start)
        return match[2]

    def _open(self, tag: str, lexeme: Lexeme) -> None:
        tags, top = self.tags, self.stack[-1]
        pending = len(self._round) - self._done
        if tag == tags.task:
            if top.tag != tags.plan:
                raise GrammarError(f"<{tag}> outside <{tags.plan}>", lexeme.start)
            task_id = self._id(tag, lexeme)
            if task_id in (task.label for task in top.kids(tags.task)):
                raise GrammarError(f"duplicate task id {task_id!r}", lexeme.start)
            self._push(tag, lexeme, task_id)
            return
        if top is not self.root:
            what = "nested plans are not supported" if tag == tags.plan else "only at top level"
            raise GrammarError(f"<{tag}> inside <{top.tag}>: {what}", lexeme.start)
        if tag == tags.execution:
            task_id = self._id(tag, lexeme)
            if not pending:
                raise GrammarError(
                    f"<{tag} {tags.id_attr}={task_id}> without an open task (more executions than tasks)",
                    lexeme.start,
                )
            if task_id != self._round[self._done]:
                raise GrammarError(
                    f"execution id {task_id!r} out of order, expected {self._round[self._done]!r}",
                    lexeme.start,
                )
            self._push(tag, lexeme, task_id)
        else:  # plan, answer
            if pending:
                raise GrammarError(
                    f"<{tag}> before the {pending} remaining executions of the last plan", lexeme.start
                )
            self._push(tag, lexeme)

    def _close(self, tag: str, lexeme: Lexeme) -> None:
        tags = self.tags
        node = self._pop(tag, lexeme)
        if tag == tags.plan:
            ids = tuple(task.label for task in node.kids(tags.task))
            if not ids:
                raise GrammarError(f"<{tag}> with zero tasks", node.start)
            self._round, self._done = list(ids), 0
            self._fork(PhaseOpened(n=len(ids), headers=tuple(self.header(label) for label in ids), labels=ids,
                                   header=self._inner(node, lexeme.start), depth=self.depth, at=lexeme.end))
        elif tag == tags.execution:
            if node is self._own:
                return self._branch_done(BranchClosed(index=self.index, label=node.label, depth=self.depth,
                                                      at=lexeme.end))
            self._emit(BranchClosed(index=self._done, label=node.label, depth=self.depth, at=lexeme.end))
            self._done += 1
            if self._done == len(self._round):
                self._emit(PhaseClosed(depth=self.depth, at=lexeme.end))

    def _eof(self) -> None:
        top = self.stack[-1]
        if top is self._own:
            raise GrammarError(f"branch {top.label} ended without </{top.tag}>", self.pos)
        if top is not self.root:
            raise GrammarError(f"unclosed <{top.tag}> at end of stream (opened at {top.start})", self.pos)
        if self._done < len(self._round):
            raise GrammarError(f"stream ended after {self._done} of {len(self._round)} executions", self.pos)
