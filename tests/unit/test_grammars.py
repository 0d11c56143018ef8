"""Branch-structure detectors: streaming == whole text, fork/join driving, malformed input."""

import random
import re
from array import array

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from branchwise.fork.grammars import (
    BranchClosed,
    GrammarError,
    Mode,
    MultiverseDetector,
    MultiverseTags,
    PhaseClosed,
    PhaseOpened,
    SprintDetector,
    get_detector,
    parse,
)
from branchwise.fork.phases import PhaseRegistry

MV = """<Think>
Let me split this. Note 3 < 4 and a<b> is not a tag, nor is <Pathway>.
<Parallel>
<Goal>
<Outline>
1: compute A
</Outline>
<Outline>
2: compute B
</Outline>
</Goal>
<Path>
1: A needs two parts.
<Parallel>
<Goal>
<Outline>
1.1: part a
</Outline>
<Outline>
1.2: part b
</Outline>
</Goal>
<Path>
1.1: a = 1
</Path>
<Path>
1.2: b = 2
</Path>
<Conclusion>
A = 3
</Conclusion>
</Parallel>
So A is 3.
</Path>
<Path>
2: B = 5
</Path>
<Conclusion>
A + B = 8
</Conclusion>
</Parallel>
Second round.
<Parallel>
<Goal>
<Outline>
1: check
</Outline>
</Goal>
<Path>
1: fine
</Path>
<Conclusion>
ok
</Conclusion>
</Parallel>
</Think>
The answer is 8."""

SP = """Problem: add things.
<Plan>
Two independent sums.
<Task id=1>
sum 1..3
</Task>
<Task id="2">
sum 4..5
</Task>
</Plan>
<Execution id=1>
6
</Execution>
<Execution id=2>
9
</Execution>
<Plan>
Combine.
<Task id=1>
6 + 9
</Task>
</Plan>
<Execution id=1>
15
</Execution>
<Answer>
15
</Answer>
"""


def observe(name: str, text: str, sizes=None, **kw):
    det = get_detector(name, mode=Mode.OBSERVE, **kw)
    evs, i, k = [], 0, 0
    while i < len(text):
        n = sizes[k % len(sizes)] if sizes else len(text)
        evs += det.feed(text[i : i + n])
        i, k = i + n, k + 1
    return evs + det.finish()


def error_of(fn):
    with pytest.raises(GrammarError) as ei:
        fn()
    return str(ei.value)


# ---- whole text / streaming equivalence ---------------------------------------------------------
def test_multiverse_events_whole_text():
    evs = observe("multiverse", MV)
    kinds = [type(e).__name__[0] + getattr(e, "label", "") for e in evs]
    assert kinds == ["P", "P", "B1.1", "B1.2", "P", "B1", "B2", "P", "P", "B1", "P"]
    top = evs[0]
    assert isinstance(top, PhaseOpened) and top.n == 2 and top.depth == 0 and top.labels == ("1", "2")
    assert top.headers == ("<Path>\n1: ", "<Path>\n2: ")
    assert MV[: top.at].endswith("</Goal>\n") and "1: compute A" in top.header
    nested = evs[1]
    assert nested.depth == 1 and nested.headers == ("<Path>\n1.1: ", "<Path>\n1.2: ")
    assert [e.index for e in evs if isinstance(e, BranchClosed)] == [0, 1, 0, 1, 0]
    assert all(MV[: e.at].endswith("</Path>") for e in evs if isinstance(e, BranchClosed))
    assert all(MV[: e.at].endswith("</Parallel>") for e in evs if isinstance(e, PhaseClosed))


def test_sprint_events_whole_text():
    evs = observe("sprint", SP)
    assert [type(e) for e in evs] == [
        PhaseOpened,
        BranchClosed,
        BranchClosed,
        PhaseClosed,
        PhaseOpened,
        BranchClosed,
        PhaseClosed,
    ]
    assert evs[0].headers == ("<Execution id=1>\n", "<Execution id=2>\n") and evs[0].labels == ("1", "2")
    assert SP[: evs[0].at].endswith("</Plan>\n") and "Two independent sums." in evs[0].header
    assert SP[: evs[3].at].endswith("9\n</Execution>")


@pytest.mark.parametrize("name,text", [("multiverse", MV), ("sprint", SP)])
def test_one_char_at_a_time(name, text):
    assert observe(name, text, [1]) == observe(name, text)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(["multiverse", "sprint"]), st.lists(st.integers(1, 40), min_size=1, max_size=30))
def test_random_chunkings(name, sizes):
    text = MV if name == "multiverse" else SP
    assert observe(name, text, sizes) == observe(name, text)


def test_parse_tree():
    root = parse("multiverse", MV)
    par = next(root.iter("Parallel"))
    assert [c.tag for c in par.children] == ["Goal", "Path", "Path", "Conclusion"]
    assert [p.label for p in root.iter("Path")] == ["1", "1.1", "1.2", "2", "1"]
    assert par.kids("Conclusion")[0].text.strip() == "A + B = 8"
    sp = parse("sprint", SP)
    assert [(n.tag, n.label) for n in sp.children] == [
        ("Plan", ""),
        ("Execution", "1"),
        ("Execution", "2"),
        ("Plan", ""),
        ("Execution", "1"),
        ("Answer", ""),
    ]


def test_custom_tags_and_factory():
    tags = MultiverseTags(parallel="par", goal="goal", outline="o", path="p", conclusion="c", think="think")
    text = "<think>\n<par>\n<goal>\n<o>\n1: x\n</o>\n</goal>\n<p>\n1: y\n</p>\n<c>\nz\n</c>\n</par>\n</think>"
    evs = observe("multiverse", text, tags=tags)
    assert evs[0].headers == ("<p>\n1: ",) and isinstance(evs[-1], PhaseClosed)
    assert get_detector("multiverse", tags=tags).branch(0, "1", 0).tags is tags
    assert observe("multiverse", MV, tags=tags) == []  # default tag names are plain text now
    with pytest.raises(ValueError, match="unknown grammar 'nope'; valid: multiverse, sprint"):
        get_detector("nope")
    assert isinstance(get_detector("Sprint"), SprintDetector)


def test_lexer_edge_text():
    # a "<" that never becomes a tag is released as text; held-back tails flush at finish
    for tail in ["<", "<Pat", "a < b", "x" * 100 + "<" + "y" * 80 + ">"]:
        assert observe("multiverse", "hello " + tail, [1]) == []
    det = MultiverseDetector(mode=Mode.OBSERVE)
    det.feed("ab<Pa")
    assert det.lexer.buf == "<Pa"
    det.feed("thway>cd")
    assert det.lexer.buf == "" and det.text == "ab<Pathway>cd"


# ---- server-side driving: parent pause, branch streams, join ------------------------------------
def drive(name: str, text: str, rng: random.Random, **kw):
    """Serve `text` the way the server would: a parent stream that forks at each PhaseOpened, branch
    streams that stop at BranchClosed, canonical join. The 'model' is an oracle that continues the
    serial text; chunks are random, so a chunk overshooting a stop point is dropped like an
    overlap-scheduler token. Returns the parent's final text and every branch prompt."""
    reg, prompts = PhaseRegistry(), []
    root = get_detector(name, **kw)

    def run(det, rid: str, start: int) -> str:
        # invariant: det.text == text[start : start + det.pos]
        while True:
            if det.done:
                return det.text
            cur = start + det.pos
            if cur >= len(text):
                assert det.mode is Mode.PARENT
                det.finish()
                return det.text
            for ev in det.feed(text[cur : cur + rng.randint(1, 25)]):
                if isinstance(ev, PhaseOpened):
                    fork(det, rid, start, ev)
            assert det.text == text[start : start + det.pos]

    def ids(s: str) -> list[int]:  # a character-level "tokenizer"
        return [ord(c) for c in s]

    def fork(det, rid, start, ev):
        f = start + ev.at
        ph = reg.open(rid, ev.headers, ev.labels, prefix_text=text[:f], header=ev.header, fmt=det.fmt,
                      header_ids=[ids(h) for h in ev.headers])
        ph.park()
        assert ph.depth == ev.depth
        cursor, starts = f, []
        for i in range(ph.fanout):  # where branch i's continuation sits in the serial text
            assert text.startswith(ev.headers[i], cursor)
            starts.append(cursor + len(ev.headers[i]))
            sub = det.branch(i, ev.labels[i], ev.depth)
            out = run(sub, ph.branches[i].rid, starts[-1])
            cursor = starts[-1] + len(out) + len(det.fmt.sep)
            ph.branches[i].output_text = out  # stash; closed below in a random completion order
        for i in rng.sample(range(ph.fanout), ph.fanout):
            ph.close_branch(i, ph.branches[i].output_text)
        for i in range(ph.fanout):
            p = "".join(map(chr, ph.branch_input(i, array("q", ids(text[:f])))))
            prompts.append(p)
            assert p == text[:f] + ev.headers[i]
            for j in range(ph.fanout):  # visibility: no sibling's body
                if j != i and ph.branches[j].output_text.strip():
                    assert ph.branches[j].output_text not in p
        red = ph.join()
        assert text.startswith(red, f), "reduce text must equal the serial text"
        for e in det.join(red):
            assert isinstance(e, PhaseClosed) and e.depth == ev.depth
        reg.release(ph.phase_id)

    return run(root, "req", 0), prompts, reg


@pytest.mark.parametrize("seed", range(8))
def test_drive_multiverse(seed):
    out, prompts, reg = drive("multiverse", MV, random.Random(seed))
    assert out == MV and len(reg) == 0
    assert len(prompts) == 5 and prompts[0].endswith("</Goal>\n<Path>\n1.1: ")  # nested fork runs first


@settings(max_examples=30, deadline=None)
@given(st.sampled_from(["multiverse", "sprint"]), st.randoms(use_true_random=False))
def test_drive_random_schedules(name, rnd):
    text = MV if name == "multiverse" else SP
    assert drive(name, text, rnd)[0] == text


@pytest.mark.parametrize("seed", range(8))
def test_drive_sprint(seed):
    out, prompts, reg = drive("sprint", SP, random.Random(seed))
    assert out == SP and len(reg) == 0
    assert prompts[1] == SP[: SP.index("</Plan>") + 8] + "<Execution id=2>\n"


def test_parent_mode_pauses_and_drops_overshoot():
    det = MultiverseDetector()
    evs = det.feed(MV)  # the whole serial text at once: only the fork is reported
    assert len(evs) == 1 and det.paused and det.text == MV[: evs[0].at]
    assert det.feed("more tokens") == [] and det.pos == evs[0].at
    with pytest.raises(GrammarError, match="stream ended at a fork"):
        det.finish()
    with pytest.raises(GrammarError, match="join\\(\\) without a pending fork"):
        MultiverseDetector().join("x")


def test_fork_waits_for_the_newline_after_goal():
    det = MultiverseDetector()
    assert not det.deciding
    assert det.feed("<Parallel>\n<Goal>\n<Outline>\n1: a\n</Outline>\n</Goal>") == []
    assert det.deciding  # the fork point is not known yet: the server holds the text back
    (ev,) = det.feed("\n<Pa")
    assert ev.at == det.pos and det.text.endswith("</Goal>\n") and not det.deciding
    det2 = MultiverseDetector()  # no newline: fork right after the tag
    (ev2,) = det2.feed("<Parallel>\n<Goal>\n<Outline>\n1: a\n</Outline>\n</Goal><Path>")
    assert det2.text.endswith("</Goal>") and ev2.at == det2.pos


def test_branch_mode_nested_and_done():
    bdet = MultiverseDetector(mode=Mode.BRANCH, index=1, label="2", depth=0)
    assert bdet.feed("B = 5\n") == []
    (ev,) = bdet.feed("</Path>\n<Path>\n3: sibling text")
    assert ev == BranchClosed(index=1, label="2", depth=0, at=len("B = 5\n</Path>")) and bdet.done
    assert bdet.text == "B = 5\n</Path>" and bdet.feed("x") == [] and bdet.finish() == []
    nested = MultiverseDetector(mode=Mode.BRANCH, index=0, label="1", depth=0)
    (op,) = nested.feed("x\n<Parallel>\n<Goal>\n<Outline>\n1.1: a\n</Outline>\n</Goal>\n")
    assert op.depth == 1 and op.headers == ("<Path>\n1.1: ",) and nested.paused
    assert nested.join("<Path>\n1.1: y\n</Path>\n<Conclusion>\n") == []
    assert nested.feed("done\n</Conclusion>\n</Parallel>\n") == [PhaseClosed(depth=1, at=nested.pos - 1)]
    assert nested.feed("end\n</Path>") == [BranchClosed(index=0, label="1", depth=0, at=nested.pos)]
    sb = SprintDetector(mode="branch", index=2, label="3")
    assert sb.feed("r\n</Execution>\n") == [BranchClosed(index=2, label="3", depth=0, at=len("r\n</Execution>"))]


# ---- malformed input: clear errors, identical when streamed -------------------------------------
def mv(goal_body: str, paths: str = "", tail: str = "<Conclusion>\nc\n</Conclusion>\n</Parallel>\n") -> str:
    return f"<Parallel>\n<Goal>\n{goal_body}</Goal>\n{paths}{tail}"


O1, O2 = "<Outline>\n1: a\n</Outline>\n", "<Outline>\n2: b\n</Outline>\n"
P1, P2 = "<Path>\n1: x\n</Path>\n", "<Path>\n2: y\n</Path>\n"
NEST = "<Parallel>\n<Goal>\n<Outline>\n1.1: n\n</Outline>\n</Goal>\n<Path>\n1.1: m\n</Path>\n<Conclusion>\nk\n</Conclusion>\n</Parallel>\n"

MV_BAD = {
    "unclosed": (mv(O1 + O2, P1 + P2, ""), r"unclosed <Parallel> at end of stream", {}),
    "unclosed-early": ("<Parallel>\n<Goal>\n<Outline>\n1: a", r"unclosed <Parallel>", {}),
    "no-id": (mv("<Outline>\nfirst thing\n</Outline>\n", P1), r"<Outline> without id", {}),
    "dup-id": (mv(O1 + O1, P1 + P1), r"duplicate outline id '1'", {}),
    "zero-outlines": (mv("just a goal\n"), r"<Goal> with zero <Outline>", {}),
    "too-few-paths": (mv(O1 + O2, P1), r"path count mismatch: 2 outlines, 1 paths", {}),
    "too-many-paths": (mv(O1, P1 + P2), r"more <Path> than <Outline> \(1\)", {}),
    "too-deep": (
        mv(O1, f"<Path>\n1: x\n{NEST}</Path>\n"),
        r"nested 2 deep exceeds max_depth 1",
        {"max_depth": 1},
    ),
    "goal-not-first": ("<Parallel>\n" + P1, r"<Path> before <Goal>", {}),
    "text-in-parallel": ("<Parallel>\nhello\n<Goal>", r"text directly inside <Parallel>", {}),
    "conclusion-not-last": (
        mv(O1, P1, "<Conclusion>\nc\n</Conclusion>\n" + P1),
        r"<Path> after <Conclusion>",
        {},
    ),
    "no-conclusion": (mv(O1, P1, "</Parallel>\n"), r"closed without a final <Conclusion>", {}),
    "two-goals": (mv(O1, "<Goal>\n"), r"<Goal> must come first", {}),
    "path-id": (
        mv(O1 + O2, P1 + "<Path>\n3: y\n</Path>\n"),
        r"path id '3' does not match outline id '2'",
        {},
    ),
    "path-no-id": (mv(O1, "<Path>\nno id\n</Path>\n"), r"<Path> 1 has no id", {}),
    "mismatch-close": ("<Parallel>\n<Goal>\n</Path>", r"unexpected </Path> inside <Goal>", {}),
    "stray-close": ("text </Parallel>", r"unexpected </Parallel> at top level", {}),
    "parallel-in-goal": ("<Parallel>\n<Goal>\n<Parallel>", r"<Parallel> not allowed inside <Goal>", {}),
    "outline-outside": ("<Outline>", r"<Outline> only inside <Goal>", {}),
    "require-think": (mv(O1, P1), r"<Parallel> not allowed inside <root>", {"require_think": True}),
    "think-nested": (
        "<Think>\n<Parallel>\n<Goal>\n<Outline>\n1: a\n</Outline>\n</Goal>\n<Path>\n1: <Think>",
        r"<Think> only at top level",
        {},
    ),
}


@pytest.mark.parametrize("case", sorted(MV_BAD))
def test_multiverse_malformed(case):
    text, msg, kw = MV_BAD[case]
    whole = error_of(lambda: observe("multiverse", text, **kw))
    streamed = error_of(lambda: observe("multiverse", text, [1], **kw))
    assert whole == streamed
    assert re.search(msg, whole), whole


def test_lenient_think_and_valid_nesting_ok():
    assert len(observe("multiverse", mv(O1, P1))) == 3  # no <Think>: accepted by default
    assert len(observe("multiverse", "<Think>\n" + mv(O1, P1) + "</Think>", require_think=True)) == 3
    ok = mv(O1, f"<Path>\n1: x\n{NEST}</Path>\n")
    assert len(observe("multiverse", ok, max_depth=2)) == 6


def test_error_is_sticky_and_branch_eof():
    det = MultiverseDetector(mode=Mode.OBSERVE)
    with pytest.raises(GrammarError):
        det.feed("</Goal>")
    with pytest.raises(GrammarError, match="unexpected </Goal>"):
        det.feed("fine text")
    b = MultiverseDetector(mode=Mode.BRANCH, label="2")
    b.feed("never closes")
    with pytest.raises(GrammarError, match="branch 2 ended without </Path>"):
        b.finish()
    with pytest.raises(GrammarError, match="at offset 0"):
        observe("multiverse", "</Path>")


SP_BAD = {
    "task-no-id": ("<Plan>\n<Task>\nx\n</Task>\n</Plan>\n", r"<Task> without id"),
    "task-bad-attr": ("<Plan>\n<Task name=a>\n", r"<Task name=a>: expected id=K"),
    "zero-tasks": ("<Plan>\njust thinking\n</Plan>\n", r"<Plan> with zero tasks"),
    "dup-task": ("<Plan>\n<Task id=1>\n</Task>\n<Task id=1>\n", r"duplicate task id '1'"),
    "task-outside": ("<Task id=1>\n", r"<Task> outside <Plan>"),
    "exec-order": (
        "<Plan>\n<Task id=1>\na\n</Task>\n<Task id=2>\nb\n</Task>\n</Plan>\n<Execution id=2>\n",
        r"execution id '2' out of order, expected '1'",
    ),
    "too-many-exec": (
        "<Plan>\n<Task id=1>\na\n</Task>\n</Plan>\n<Execution id=1>\nx\n</Execution>\n<Execution id=2>\n",
        r"more executions than tasks",
    ),
    "exec-without-plan": ("<Execution id=1>\n", r"without an open task"),
    "plan-too-early": (
        "<Plan>\n<Task id=1>\na\n</Task>\n</Plan>\n<Plan>\n",
        r"<Plan> before the 1 remaining executions",
    ),
    "answer-too-early": (
        "<Plan>\n<Task id=1>\na\n</Task>\n</Plan>\n<Answer>\n",
        r"<Answer> before the 1 remaining",
    ),
    "nested-plan": (
        "<Plan>\n<Task id=1>\na\n</Task>\n</Plan>\n<Execution id=1>\n<Plan>\n",
        r"<Plan> inside <Execution>: nested plans are not supported",
    ),
    "unclosed-plan": ("<Plan>\n<Task id=1>\na\n</Task>\n", r"unclosed <Plan> at end of stream"),
    "half-round": (
        "<Plan>\n<Task id=1>\na\n</Task>\n<Task id=2>\nb\n</Task>\n</Plan>\n<Execution id=1>\nx\n</Execution>\n",
        r"stream ended after 1 of 2 executions",
    ),
    "mismatch-close": ("<Plan>\n<Task id=1>\na\n</Plan>", r"unexpected </Plan> inside <Task>"),
}


@pytest.mark.parametrize("case", sorted(SP_BAD))
def test_sprint_malformed(case):
    text, msg = SP_BAD[case]
    whole = error_of(lambda: observe("sprint", text))
    assert whole == error_of(lambda: observe("sprint", text, [1]))
    assert re.search(msg, whole), whole


def test_sprint_ok_without_answer_and_quoted_ids():
    evs = observe(
        "sprint", "<Plan>\n<Task id='a1'>\nq\n</Task>\n</Plan>\n<Execution id=a1>\nr\n</Execution>\nbye"
    )
    assert [type(e) for e in evs] == [PhaseOpened, BranchClosed, PhaseClosed] and evs[0].labels == ("a1",)
