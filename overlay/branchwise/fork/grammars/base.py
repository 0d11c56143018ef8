"""Shared machinery of the branch-structure detectors: events, tag lexer, stack machine (pure).
Design: docs/design/branch-grammars.md."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, ClassVar

from branchwise.fork.phases import ReduceFormat


class GrammarError(ValueError):
    """Malformed branch structure. `at` is the character offset where it became certain."""

    def __init__(self, msg: str, at: int = -1) -> None:
        super().__init__(f"{msg} (at offset {at})" if at >= 0 else msg)
        self.at = at


class Mode(StrEnum):
    OBSERVE = "observe"
    PARENT = "parent"
    BRANCH = "branch"


@dataclass(frozen=True, slots=True, kw_only=True)
class PhaseOpened:
    """Fork point. The parent keeps text[:at]; branch i continues from it plus headers[i]."""

    n: int  # fanout: the number of branches
    headers: tuple[str, ...]
    labels: tuple[str, ...]  # grammar ids, e.g. ("1", "2") or ("1.1", "1.2")
    header: str  # phase-level header H (goal / plan inner text)
    depth: int
    at: int


@dataclass(frozen=True, slots=True, kw_only=True)
class BranchClosed:
    """Branch `index` wrote its close tag; its output is this stream's text[:at]."""

    index: int
    label: str
    depth: int
    at: int


@dataclass(frozen=True, slots=True, kw_only=True)
class PhaseClosed:
    """The phase at `depth` is complete (its close tag, or SPRINT's last execution of a round)."""

    depth: int
    at: int


Event = PhaseOpened | BranchClosed | PhaseClosed


@dataclass(slots=True)
class Node:
    """Element of the parse tree. Offsets: start of open tag, inner start, close tag start, end."""

    tag: str
    start: int
    inner: int
    label: str = ""
    depth: int = 0
    close: int = -1
    end: int = -1
    text: str = ""  # inner raw text; filled by parse()
    children: list[Node] = field(default_factory=list)

    def iter(self, tag: str | None = None) -> Iterator[Node]:
        """Descendants in document order, optionally only one tag."""
        for child in self.children:
            if tag is None or child.tag == tag:
                yield child
            yield from child.iter(tag)

    def kids(self, tag: str) -> list[Node]:
        return [child for child in self.children if child.tag == tag]


_TAG = re.compile(r"<(/?)([A-Za-z][\w-]*)(\s[^<>\n]*)?>")
MAX_TAG = 64  # longer "<...>" runs are text; bounds how long a "<" can be held back


@dataclass(slots=True)
class Lexeme:
    start: int
    end: int
    text: str = ""  # plain text (tag is None)
    tag: str | None = None
    closing: bool = False
    attrs: str = ""


class TagLexer:
    """Splits a stream into text and known tags. Holds back only a possible tag prefix ("<Pa")."""

    def __init__(self, names: frozenset[str], attr_names: frozenset[str] = frozenset()) -> None:
        self.names, self.attr_names = names, attr_names
        self.buf, self.base = "", 0  # base: offset of buf[0]

    def _tag(self, cand: str) -> re.Match[str] | None:
        match = _TAG.fullmatch(cand)
        if match is None or match[2] not in self.names:
            return None
        if match[3] and match[3].strip() and (match[1] or match[2] not in self.attr_names):
            return None
        return match

    def push(self, text: str, final: bool = False) -> list[Lexeme]:
        buf, out = self.buf + text, []
        scan = tstart = 0  # scan position; start of the current text run
        hold = len(buf)  # buf[hold:] is kept back for the next chunk
        while (lt := buf.find("<", scan)) >= 0:
            gt = buf.find(">", lt)
            if gt < 0 and not final and len(buf) - lt < MAX_TAG and "\n" not in buf[lt:]:
                hold = lt  # "<Pa": undecidable until more text arrives
                break
            match = self._tag(buf[lt : gt + 1]) if 0 <= gt - lt < MAX_TAG else None
            if match is None:
                scan = lt + 1
                continue
            if lt > tstart:
                out.append(Lexeme(start=self.base + tstart, end=self.base + lt, text=buf[tstart:lt]))
            attrs = (match[3] or "").strip()
            out.append(Lexeme(start=self.base + lt, end=self.base + gt + 1, tag=match[2],
                              closing=bool(match[1]), attrs=attrs))
            scan = tstart = gt + 1
        if hold > tstart:
            out.append(Lexeme(start=self.base + tstart, end=self.base + hold, text=buf[tstart:hold]))
            tstart = hold
        self.buf, self.base = buf[tstart:], self.base + tstart
        return out

    def reset(self, base: int) -> None:
        self.buf, self.base = "", base


class Detector:
    """Base stack machine. Subclasses implement _open/_close/_text/_eof and call _fork/_emit."""

    name: ClassVar[str] = ""
    fmt: ReduceFormat

    def __init__(
        self, names: frozenset[str], attr_names: frozenset[str], mode: Mode | str, cfg: dict[str, Any]
    ) -> None:
        self.mode = Mode(mode)
        self._cfg = cfg  # constructor kwargs, so branch() builds a sibling with the same config
        self.lexer = TagLexer(names, attr_names)
        self.root = Node(tag="root", start=0, inner=0)
        self.stack: list[Node] = [self.root]
        self.paused = False  # at a fork, waiting for join()
        self.done = False  # branch mode: own close tag seen
        self.error: GrammarError | None = None
        self._chunks: list[str] = []
        self._len = 0
        self._stop: int | None = None  # offset where this feed stops keeping text
        self._pending: PhaseOpened | None = None  # fork seen; waiting to swallow one "\n"
        self._fork_depth = 0
        self._joining: int | None = None  # depth of the phase being joined
        self._out: list[Event] = []

    # ---- public API ------------------------------------------------------------------------------
    @property
    def text(self) -> str:
        if len(self._chunks) > 1:
            self._chunks = ["".join(self._chunks)]
        return self._chunks[0] if self._chunks else ""

    @property
    def pos(self) -> int:
        return self._len

    @property
    def deciding(self) -> bool:
        """A fork tag closed and the next character decides the fork point (a newline after the tag
        belongs to the prefix): text already read may still be cut."""
        return self._pending is not None

    def feed(self, text: str) -> list[Event]:
        """Consume generated text. Text fed while paused or done is dropped (the server drops it too)."""
        if self.error is not None:
            raise self.error
        if self.paused or self.done or not text:
            return []
        self._keep(text)
        return self._run(self.lexer.push(text))

    def join(self, text: str) -> list[Event]:
        """Resume after a fork with the reduce text (phases.ParallelPhase.join). Validates it; only the
        joined phase's own PhaseClosed (SPRINT) is reported, the branches' events were theirs."""
        if self.error is not None:
            raise self.error
        if not self.paused:
            raise GrammarError("join() without a pending fork", self._len)
        self.paused, self._joining = False, self._fork_depth
        try:
            self._keep(text)
            return self._run(self.lexer.push(text))
        finally:
            self._joining = None

    def finish(self) -> list[Event]:
        """End of stream: flush held-back text and check nothing is left open."""
        if self.error is not None:
            raise self.error
        if self.done:
            return []
        if self.paused:
            raise self._fail(GrammarError("stream ended at a fork before join()", self._len))
        out = self._run(self.lexer.push("", final=True))
        try:
            if self._pending is not None:
                self._fire(self._pending)
            self._eof()
        except GrammarError as e:
            raise self._fail(e) from None
        return out  # _fire appended to the same list

    def branch(self, index: int, label: str, depth: int) -> Detector:
        """Detector for branch `index` of a phase this stream opened (same grammar config)."""
        return type(self)(
            **{**self._cfg, "mode": Mode.BRANCH, "index": index, "label": label, "depth": depth}
        )

    # ---- machinery --------------------------------------------------------------------------------
    def _keep(self, text: str) -> None:
        self._chunks.append(text)
        self._len += len(text)

    def _fail(self, e: GrammarError) -> GrammarError:
        self.error = e
        return e

    def _run(self, lexemes: list[Lexeme]) -> list[Event]:
        self._out, self._stop = [], None
        try:
            for lexeme in lexemes:
                if self._stop is not None:
                    break
                self._lexeme(lexeme)
        except GrammarError as e:
            raise self._fail(e) from None
        if self._stop is not None:  # paused or done: forget everything after the stop point
            kept = self.text[: self._stop]
            self._chunks, self._len = [kept], self._stop
            self.lexer.reset(self._stop)
        return self._out

    def _lexeme(self, lexeme: Lexeme) -> None:
        if self._pending is not None:
            event = self._pending
            if lexeme.tag is None and lexeme.text.startswith("\n"):
                self._fire(dataclasses.replace(event, at=event.at + 1))  # the newline joins the prefix
                lexeme = Lexeme(start=lexeme.start + 1, end=lexeme.end, text=lexeme.text[1:])
                if not lexeme.text or self._stop is not None:
                    return
            else:
                self._fire(event)
                if self._stop is not None:
                    return
        if lexeme.tag is None:
            self._text(lexeme.text, lexeme.start)
        elif lexeme.closing:
            self._close(lexeme.tag, lexeme)
        else:
            self._open(lexeme.tag, lexeme)

    def _emit(self, event: Event) -> None:
        if (self._joining is not None
                and not (isinstance(event, PhaseClosed) and event.depth == self._joining)):
            return  # structure inside joined branches was reported by the branches themselves
        self._out.append(event)

    def _fork(self, event: PhaseOpened) -> None:
        """Fork tag closed. Fire once we know whether a newline follows (tags sit on own lines)."""
        if self._joining is None:
            self._pending = event

    def _fire(self, event: PhaseOpened) -> None:
        self._pending = None
        self._emit(event)
        if self.mode is not Mode.OBSERVE:
            self.paused, self._stop, self._fork_depth = True, event.at, event.depth

    def _branch_done(self, event: BranchClosed) -> None:
        self._emit(event)
        self.done, self._stop = True, event.at

    def _push(self, tag: str, lexeme: Lexeme, label: str = "", depth: int = 0) -> Node:
        node = Node(tag=tag, start=lexeme.start, inner=lexeme.end, label=label, depth=depth)
        self.stack[-1].children.append(node)
        self.stack.append(node)
        return node

    def _pop(self, tag: str, lexeme: Lexeme) -> Node:
        top = self.stack[-1]
        if top.tag != tag:
            where = "at top level" if top is self.root else f"inside <{top.tag}>"
            raise GrammarError(f"unexpected </{tag}> {where}", lexeme.start)
        top.close, top.end = lexeme.start, lexeme.end
        self.stack.pop()
        return top

    def _inner(self, node: Node, upto: int) -> str:
        return self.text[node.inner : upto]

    # ---- grammar hooks ----------------------------------------------------------------------------
    def _open(self, tag: str, lexeme: Lexeme) -> None:
        raise NotImplementedError

    def _close(self, tag: str, lexeme: Lexeme) -> None:
        raise NotImplementedError

    def _text(self, text: str, start: int) -> None:
        pass

    def _eof(self) -> None:
        pass


def fill_text(root: Node, src: str) -> Node:
    """Set every node's inner text (parse() output)."""
    for node in [root, *root.iter()]:
        node.text = src[node.inner : node.close if node.close >= 0 else len(src)]
    return root
