"""Multiverse Map/Process/Reduce detector for the tag format below.

    <Parallel>
    <Goal>
    <Outline>
    1: ...
    </Outline>
    ...
    </Goal>
    <Path>
    1: ...              (may nest a <Parallel> whose outline ids are 1.1:, 1.2:, ...)
    </Path>
    ...
    <Conclusion>
    ...
    </Conclusion>
    </Parallel>

Fork point: the end of the `</Goal>` line (fanout = number of outlines; branch i's header is
"<Path>\\nK: " with K the i-th outline id). Branch end: its own `</Path>`. Join: the parent resumes
from prefix + paths in outline order + "<Conclusion>\\n" (`fmt`).

Checks: <Goal> first and <Conclusion> last, exactly one each; <Goal>/<Path>/<Conclusion> only directly
in <Parallel>, <Outline> only in <Goal>; every outline starts with an id "K:"; paths never outnumber
outlines and equal them before <Conclusion>; path ids match outline ids (strict_ids); <Parallel> only
under <Think> or <Path> (or at top level unless require_think); nesting depth < max_depth; no
<Parallel> left open at end of stream.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass

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
        t = self.tags = tags or MultiverseTags()
        cfg = dict(
            tags=t,
            max_depth=max_depth,
            require_think=require_think,
            strict_ids=strict_ids,
            force_conclusion=force_conclusion,
        )
        super().__init__(frozenset(asdict(t).values()), frozenset(), mode, cfg)
        self.max_depth, self.require_think, self.strict_ids = max_depth, require_think, strict_ids
        self.fmt = ReduceFormat(f"\n</{t.path}>", "\n", f"<{t.conclusion}>\n" if force_conclusion else "")
        self.index, self.depth = index, depth
        self._own: Node | None = None
        self._base = 0  # depth of a <Parallel> opened with no enclosing <Parallel> on the stack
        if self.mode is Mode.BRANCH:  # we start just after "<Path>\nK: " of a phase at `depth`
            self._own = self._push(t.path, Lexeme(0, 0), label, depth)
            self._base = depth + 1

    def header(self, label: str) -> str:
        return f"<{self.tags.path}>\n{label}: "

    def _depth(self) -> int:
        return self._base + sum(n.tag == self.tags.parallel for n in self.stack)

    def _check_path_id(self, path: Node, upto: int) -> None:
        if not self.strict_ids or path is self._own:
            return
        m = _ID.match(self._inner(path, upto))
        if m is None:
            raise GrammarError(f"<{path.tag}> {path.label} has no id (expected '{path.label}: ')", path.inner)
        if m[1] != path.label:
            raise GrammarError(f"path id {m[1]!r} does not match outline id {path.label!r}", path.inner)

    def _open(self, tag: str, lx: Lexeme) -> None:
        t, top = self.tags, self.stack[-1]
        if tag == t.think:
            if top is not self.root:
                raise GrammarError(f"<{tag}> only at top level, found inside <{top.tag}>", lx.start)
            self._push(tag, lx)
        elif tag == t.parallel:
            ok = {t.path, t.think} | (set() if self.require_think else {"root"})
            if top.tag not in ok:
                raise GrammarError(f"<{tag}> not allowed inside <{top.tag}>", lx.start)
            if top.tag == t.path:
                self._check_path_id(top, lx.start)
            d = self._depth()
            if d >= self.max_depth:
                raise GrammarError(
                    f"<{tag}> nested {d + 1} deep exceeds max_depth {self.max_depth}", lx.start
                )
            self._push(tag, lx, depth=d)
        elif tag == t.outline:
            if top.tag != t.goal:
                raise GrammarError(f"<{tag}> only inside <{t.goal}>", lx.start)
            self._push(tag, lx)
        else:  # goal, path, conclusion: direct children of <Parallel>
            if top.tag != t.parallel:
                raise GrammarError(f"<{tag}> only directly inside <{t.parallel}>", lx.start)
            kids = top.children
            if tag == t.goal:
                if kids:
                    raise GrammarError(f"<{tag}> must come first in <{t.parallel}>", lx.start)
                self._push(tag, lx, depth=top.depth)
                return
            if not kids or kids[0].tag != t.goal:
                raise GrammarError(f"<{tag}> before <{t.goal}>", lx.start)
            if top.kids(t.conclusion):
                raise GrammarError(f"<{tag}> after <{t.conclusion}> (it must be last)", lx.start)
            ids, n_paths = [o.label for o in kids[0].kids(t.outline)], len(top.kids(t.path))
            if tag == t.path:
                if n_paths >= len(ids):
                    raise GrammarError(f"more <{tag}> than <{t.outline}> ({len(ids)})", lx.start)
                self._push(tag, lx, ids[n_paths], top.depth)
            else:
                if n_paths != len(ids):
                    raise GrammarError(f"path count mismatch: {len(ids)} outlines, {n_paths} paths", lx.start)
                self._push(tag, lx, depth=top.depth)

    def _close(self, tag: str, lx: Lexeme) -> None:
        t = self.tags
        node = self._pop(tag, lx)
        if tag == t.outline:
            m = _ID.match(self._inner(node, lx.start))
            if m is None:
                raise GrammarError(f"<{tag}> without id (expected 'K: ...')", node.inner)
            goal = self.stack[-1]
            if m[1] in (o.label for o in goal.kids(t.outline)):
                raise GrammarError(f"duplicate outline id {m[1]!r}", node.inner)
            node.label = m[1]
        elif tag == t.goal:
            ids = tuple(o.label for o in node.kids(t.outline))
            if not ids:
                raise GrammarError(f"<{tag}> with zero <{t.outline}>", node.start)
            hdr = tuple(self.header(k) for k in ids)
            self._fork(PhaseOpened(len(ids), hdr, ids, self._inner(node, lx.start), node.depth, lx.end))
        elif tag == t.path:
            if node is self._own:
                return self._branch_done(BranchClosed(self.index, node.label, node.depth, lx.end))
            self._check_path_id(node, lx.start)
            i = len(self.stack[-1].kids(t.path)) - 1
            self._emit(BranchClosed(i, node.label, node.depth, lx.end))
        elif tag == t.parallel:
            kids = node.children
            if not kids or kids[-1].tag != t.conclusion:
                raise GrammarError(f"<{tag}> closed without a final <{t.conclusion}>", lx.start)
            self._emit(PhaseClosed(node.depth, lx.end))

    def _text(self, text: str, start: int) -> None:
        if self.stack[-1].tag == self.tags.parallel and (lead := len(text) - len(text.lstrip())) < len(text):
            t = self.tags
            msg = (
                f"text directly inside <{t.parallel}> (only <{t.goal}>, <{t.path}>, <{t.conclusion}> allowed)"
            )
            raise GrammarError(msg, start + lead)

    def _eof(self) -> None:
        for n in reversed(self.stack):
            if n is self._own:
                raise GrammarError(f"branch {n.label} ended without </{n.tag}>", self.pos)
            if n.tag == self.tags.parallel:
                raise GrammarError(f"unclosed <{n.tag}> at end of stream (opened at {n.start})", self.pos)
