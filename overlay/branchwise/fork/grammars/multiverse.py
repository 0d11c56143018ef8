"""Multiverse detector: Map / Process / Reduce phases in <Parallel> blocks (tags via MultiverseTags).
Design: docs/design/branch-grammars.md."""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass

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

_ID = re.compile(r"\s*(\d+(?:\.\d+)*)\s*:")


@dataclass(frozen=True, slots=True)
class MultiverseTags:
    """Tag names (written as <name> / </name>)."""

    parallel: str = "Parallel"
    goal: str = "Goal"
    outline: str = "Outline"
    path: str = "Path"
    conclusion: str = "Conclusion"
    think: str = "Think"


class MultiverseDetector(Detector):
    name = "multiverse"

    def __init__(
        self,
        tags: MultiverseTags | None = None,
        *,
        mode: Mode | str = Mode.PARENT,
        index: int = 0,
        label: str = "1",
        depth: int = 0,
        max_depth: int = 3,
        require_think: bool = False,
        strict_ids: bool = True,
        force_conclusion: bool = True,
    ) -> None:
        tags = self.tags = tags or MultiverseTags()
        cfg = dict(
            tags=tags,
            max_depth=max_depth,
            require_think=require_think,
            strict_ids=strict_ids,
            force_conclusion=force_conclusion,
        )
        super().__init__(frozenset(asdict(tags).values()), frozenset(), mode, cfg)
        self.max_depth, self.require_think, self.strict_ids = max_depth, require_think, strict_ids
        self.fmt = ReduceFormat(close=f"\n</{tags.path}>", sep="\n",
                                suffix=f"<{tags.conclusion}>\n" if force_conclusion else "")
        self.index, self.depth = index, depth
        self._own: Node | None = None
        self._base = 0  # depth of a <Parallel> opened with no enclosing <Parallel> on the stack
        if self.mode is Mode.BRANCH:  # we start just after "<Path>\nK: " of a phase at `depth`
            self._own = self._push(tags.path, Lexeme(start=0, end=0), label, depth)
            self._base = depth + 1

    def header(self, label: str) -> str:
        return f"<{self.tags.path}>\n{label}: "

    def _depth(self) -> int:
        return self._base + sum(node.tag == self.tags.parallel for node in self.stack)

    def _check_path_id(self, path: Node, upto: int) -> None:
        if not self.strict_ids or path is self._own:
            return
        match = _ID.match(self._inner(path, upto))
        if match is None:
            raise GrammarError(f"<{path.tag}> {path.label} has no id (expected '{path.label}: ')", path.inner)
        if match[1] != path.label:
            raise GrammarError(f"path id {match[1]!r} does not match outline id {path.label!r}", path.inner)

    def _open(self, tag: str, lexeme: Lexeme) -> None:
        tags, top = self.tags, self.stack[-1]
        if tag == tags.think:
            if top is not self.root:
                raise GrammarError(f"<{tag}> only at top level, found inside <{top.tag}>", lexeme.start)
            self._push(tag, lexeme)
        elif tag == tags.parallel:
            ok = {tags.path, tags.think} | (set() if self.require_think else {"root"})
            if top.tag not in ok:
                raise GrammarError(f"<{tag}> not allowed inside <{top.tag}>", lexeme.start)
            if top.tag == tags.path:
                self._check_path_id(top, lexeme.start)
            depth = self._depth()
            if depth >= self.max_depth:
                raise GrammarError(
                    f"<{tag}> nested {depth + 1} deep exceeds max_depth {self.max_depth}", lexeme.start
                )
            self._push(tag, lexeme, depth=depth)
        elif tag == tags.outline:
            if top.tag != tags.goal:
                raise GrammarError(f"<{tag}> only inside <{tags.goal}>", lexeme.start)
            self._push(tag, lexeme)
        else:  # goal, path, conclusion: direct children of <Parallel>
            if top.tag != tags.parallel:
                raise GrammarError(f"<{tag}> only directly inside <{tags.parallel}>", lexeme.start)
            kids = top.children
            if tag == tags.goal:
                if kids:
                    raise GrammarError(f"<{tag}> must come first in <{tags.parallel}>", lexeme.start)
                self._push(tag, lexeme, depth=top.depth)
                return
            if not kids or kids[0].tag != tags.goal:
                raise GrammarError(f"<{tag}> before <{tags.goal}>", lexeme.start)
            if top.kids(tags.conclusion):
                raise GrammarError(f"<{tag}> after <{tags.conclusion}> (it must be last)", lexeme.start)
            ids, n_paths = [o.label for o in kids[0].kids(tags.outline)], len(top.kids(tags.path))
            if tag == tags.path:
                if n_paths >= len(ids):
                    raise GrammarError(f"more <{tag}> than <{tags.outline}> ({len(ids)})", lexeme.start)
                self._push(tag, lexeme, ids[n_paths], top.depth)
            else:
                if n_paths != len(ids):
                    raise GrammarError(f"path count mismatch: {len(ids)} outlines, {n_paths} paths",
                                       lexeme.start)
                self._push(tag, lexeme, depth=top.depth)

    def _close(self, tag: str, lexeme: Lexeme) -> None:
        tags = self.tags
        node = self._pop(tag, lexeme)
        if tag == tags.outline:
            match = _ID.match(self._inner(node, lexeme.start))
            if match is None:
                raise GrammarError(f"<{tag}> without id (expected 'K: ...')", node.inner)
            goal = self.stack[-1]
            if match[1] in (outline.label for outline in goal.kids(tags.outline)):
                raise GrammarError(f"duplicate outline id {match[1]!r}", node.inner)
            node.label = match[1]
        elif tag == tags.goal:
            ids = tuple(o.label for o in node.kids(tags.outline))
            if not ids:
                raise GrammarError(f"<{tag}> with zero <{tags.outline}>", node.start)
            self._fork(PhaseOpened(n=len(ids), headers=tuple(self.header(label) for label in ids), labels=ids,
                                   header=self._inner(node, lexeme.start), depth=node.depth, at=lexeme.end))
        elif tag == tags.path:
            if node is self._own:
                return self._branch_done(BranchClosed(index=self.index, label=node.label, depth=node.depth,
                                                      at=lexeme.end))
            self._check_path_id(node, lexeme.start)
            index = len(self.stack[-1].kids(tags.path)) - 1
            self._emit(BranchClosed(index=index, label=node.label, depth=node.depth, at=lexeme.end))
        elif tag == tags.parallel:
            kids = node.children
            if not kids or kids[-1].tag != tags.conclusion:
                raise GrammarError(f"<{tag}> closed without a final <{tags.conclusion}>", lexeme.start)
            self._emit(PhaseClosed(depth=node.depth, at=lexeme.end))

    def _text(self, text: str, start: int) -> None:
        if self.stack[-1].tag == self.tags.parallel and (lead := len(text) - len(text.lstrip())) < len(text):
            tags = self.tags
            msg = (
                f"text directly inside <{tags.parallel}> (only <{tags.goal}>, <{tags.path}>, "
                f"<{tags.conclusion}> allowed)"
            )
            raise GrammarError(msg, start + lead)

    def _eof(self) -> None:
        for node in reversed(self.stack):
            if node is self._own:
                raise GrammarError(f"branch {node.label} ended without </{node.tag}>", self.pos)
            if node.tag == self.tags.parallel:
                raise GrammarError(f"unclosed <{node.tag}> at end of stream (opened at {node.start})",
                                   self.pos)
