"""Shared machinery for incremental branch-structure detectors: events, tag lexer, stack machine.

A detector reads one sequence's generated text in arbitrary chunks (one character at a time works)
and reports structure as events. Decisions depend only on the text, never on how it was chunked, so
streaming and whole-text runs give the same events. Offsets (`at`) count characters of everything
this detector kept: fed text plus joined reduce text, minus text dropped after a pause.

Modes (one detector per sequence):
  OBSERVE  watch a complete serial text; every phase/branch/close event, never pauses (parse, clients)
  PARENT   serial stream; at a fork point emit PhaseOpened and pause until `join(reduce text)`
  BRANCH   a branch's own stream, starting just after its header; emits BranchClosed at its close
           tag and stops; a nested phase inside it pauses/joins exactly like PARENT

What the server side (branchwise.fork) uses: feed, join, finish, branch, and the read-only state
text, pos, fmt, done (branch mode: own close tag seen) and deciding (a fork tag closed, the next
character places the fork point). The pause between a fork and its join is the detector's own
parsing state; the phase's lifecycle lives in branchwise.phases.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, ClassVar

from branchwise.phases import ReduceFormat


class GrammarError(ValueError):
    """Malformed branch structure. `at` is the character offset where it became certain."""

    def __init__(self, msg: str, at: int = -1) -> None:
        super().__init__(f"{msg} (at offset {at})" if at >= 0 else msg)
        self.at = at


class Mode(StrEnum):
    OBSERVE = "observe"
    PARENT = "parent"
    BRANCH = "branch"


@dataclass(frozen=True, slots=True)
class PhaseOpened:
    """Fork point. The parent keeps text[:at]; branch i continues from it plus headers[i]."""

    n: int
    headers: tuple[str, ...]
    labels: tuple[str, ...]  # grammar ids, e.g. ("1", "2") or ("1.1", "1.2")
    header: str  # phase-level header H (goal / plan inner text)
    depth: int
    at: int


@dataclass(frozen=True, slots=True)
class BranchClosed:
    """Branch `index` wrote its close tag; its output is this stream's text[:at]."""

    index: int
    label: str
    depth: int
    at: int


@dataclass(frozen=True, slots=True)
class PhaseClosed:
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
        for c in self.children:
            if tag is None or c.tag == tag:
                yield c
            yield from c.iter(tag)

    def kids(self, tag: str) -> list[Node]:
        return [c for c in self.children if c.tag == tag]


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
        m = _TAG.fullmatch(cand)
        if m is None or m[2] not in self.names:
            return None
        if m[3] and m[3].strip() and (m[1] or m[2] not in self.attr_names):
            return None
        return m

    def push(self, text: str, final: bool = False) -> list[Lexeme]:
        buf, out = self.buf + text, []
        i = tstart = 0  # scan position; start of the current text run
        hold = len(buf)  # buf[hold:] is kept back for the next chunk
        while (j := buf.find("<", i)) >= 0:
            k = buf.find(">", j)
            if k < 0 and not final and len(buf) - j < MAX_TAG and "\n" not in buf[j:]:
                hold = j  # "<Pa": undecidable until more text arrives
                break
            m = self._tag(buf[j : k + 1]) if 0 <= k - j < MAX_TAG else None
            if m is None:
                i = j + 1
                continue
            if j > tstart:
                out.append(Lexeme(self.base + tstart, self.base + j, buf[tstart:j]))
            attrs = (m[3] or "").strip()
            out.append(Lexeme(self.base + j, self.base + k + 1, tag=m[2], closing=bool(m[1]), attrs=attrs))
            i = tstart = k + 1
        if hold > tstart:
            out.append(Lexeme(self.base + tstart, self.base + hold, buf[tstart:hold]))
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
        self.root = Node("root", 0, 0)
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
            for lx in lexemes:
                if self._stop is not None:
                    break
                self._lexeme(lx)
        except GrammarError as e:
            raise self._fail(e) from None
        if self._stop is not None:  # paused or done: forget everything after the stop point
            kept = self.text[: self._stop]
            self._chunks, self._len = [kept], self._stop
            self.lexer.reset(self._stop)
        return self._out

    def _lexeme(self, lx: Lexeme) -> None:
        if self._pending is not None:
            ev = self._pending
            if lx.tag is None and lx.text.startswith("\n"):
                self._fire(PhaseOpened(ev.n, ev.headers, ev.labels, ev.header, ev.depth, ev.at + 1))
                lx = Lexeme(lx.start + 1, lx.end, lx.text[1:])
                if not lx.text or self._stop is not None:
                    return
            else:
                self._fire(ev)
                if self._stop is not None:
                    return
        if lx.tag is None:
            self._text(lx.text, lx.start)
        elif lx.closing:
            self._close(lx.tag, lx)
        else:
            self._open(lx.tag, lx)

    def _emit(self, ev: Event) -> None:
        if self._joining is not None and not (isinstance(ev, PhaseClosed) and ev.depth == self._joining):
            return  # structure inside joined branches was reported by the branches themselves
        self._out.append(ev)

    def _fork(self, ev: PhaseOpened) -> None:
        """Fork tag closed. Fire once we know whether a newline follows (tags sit on own lines)."""
        if self._joining is None:
            self._pending = ev

    def _fire(self, ev: PhaseOpened) -> None:
        self._pending = None
        self._emit(ev)
        if self.mode is not Mode.OBSERVE:
            self.paused, self._stop, self._fork_depth = True, ev.at, ev.depth

    def _branch_done(self, ev: BranchClosed) -> None:
        self._emit(ev)
        self.done, self._stop = True, ev.at

    def _push(self, tag: str, lx: Lexeme, label: str = "", depth: int = 0) -> Node:
        node = Node(tag, lx.start, lx.end, label, depth)
        self.stack[-1].children.append(node)
        self.stack.append(node)
        return node

    def _pop(self, tag: str, lx: Lexeme) -> Node:
        top = self.stack[-1]
        if top.tag != tag:
            where = "at top level" if top is self.root else f"inside <{top.tag}>"
            raise GrammarError(f"unexpected </{tag}> {where}", lx.start)
        top.close, top.end = lx.start, lx.end
        self.stack.pop()
        return top

    def _inner(self, node: Node, upto: int) -> str:
        return self.text[node.inner : upto]

    # ---- grammar hooks ----------------------------------------------------------------------------
    def _open(self, tag: str, lx: Lexeme) -> None:
        raise NotImplementedError

    def _close(self, tag: str, lx: Lexeme) -> None:
        raise NotImplementedError

    def _text(self, text: str, start: int) -> None:
        pass

    def _eof(self) -> None:
        pass


def fill_text(root: Node, src: str) -> Node:
    """Set every node's inner text (parse() output)."""
    for n in [root, *root.iter()]:
        n.text = src[n.inner : n.close if n.close >= 0 else len(src)]
    return root
