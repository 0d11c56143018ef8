"""Pure parts of server-side fork/join: incremental text with token offsets, budgets, close rule,
the structure driver's skeletons and the client-side oracle's split."""

from __future__ import annotations

import json

import pytest

from bench import fork_oracle
from bench.structure_driver import StructureDriver, spec
from branchwise.fork.grammars import Mode, get_detector, parse
from branchwise.fork.phases import ReduceFormat, TextStream, branch_budget, needs_close
from branchwise.tools.tiny_model import build_tokenizer


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(0)


def stream(tok) -> TextStream:
    return TextStream(lambda ids: tok.decode(list(ids), skip_special_tokens=True))


def test_text_stream_offsets_and_cut(tok):
    ids = tok.encode("ab <Path>\n1: cd", add_special_tokens=False)
    ts, text = stream(tok), ""
    for n in range(1, len(ids) + 1):  # one token per step, as the scheduler feeds it
        text += ts.feed(ids[:n])
    assert text == tok.decode(ids)
    assert ts.ends[-1] == len(text) and ts.ends == sorted(ts.ends)
    at = text.index("<Path>")
    keep = ts.cut(at)
    assert tok.decode(ids[:keep]) == text[:at]  # whole tokens before the cut point
    assert ts.split(at, text) == (keep, "")  # the cut falls between tokens: nothing left over
    k2, left = ts.split(at + 2, text)  # inside "<Path>": the kept part of the token it cuts
    assert tok.decode(ids[:k2]) + left == text[: at + 2] and k2 <= keep + 1
    ts.truncate(keep, at)
    assert (ts.fed, ts.read, ts.pos) == (keep, keep, at)
    ts.skip(3, at + 10)  # a join appended 3 ids whose text the detector got via join()
    assert ts.fed == keep + 3 and ts.ends[-3:] == [at + 10] * 3


def test_text_stream_holds_incomplete_utf8_but_not_forever(tok):
    ids = tok.encode("é", add_special_tokens=False)  # byte-level: two byte tokens
    assert len(ids) == 2
    ts = stream(tok)
    assert ts.feed(ids[:1]) == ""  # half a character: wait
    assert ts.feed(ids) == "é" and ts.ends == [1, 1]
    bad = stream(tok)
    lone = ids[:1] * (2 * TextStream.HOLD)  # invalid bytes never complete a character
    out = "".join(bad.feed(lone[:n]) for n in range(1, len(lone) + 1))
    assert out and bad.fed - bad.read < TextStream.HOLD  # held back, but never more than HOLD ids


def test_budget_and_close_rule():
    assert branch_budget(100, 30, 5) == 65
    fmt = ReduceFormat("\n</Path>", "\n", "<Conclusion>\n")
    assert needs_close("1: partial text", fmt.close)
    assert not needs_close("1: done\n</Path>", fmt.close)
    assert not needs_close("anything", "")


@pytest.mark.parametrize("sj", [spec("multiverse", 3, [3, 4, 5]), spec("sprint", 2, [3], rounds=2),
                                spec("multiverse", 2, [2], nest=3, nest_n=2)])
def test_driver_skeleton_is_valid_serial_text(tok, sj):
    g = json.loads(sj)["g"]
    items, tpos = StructureDriver.skeleton(tok, sj, "root", "")
    assert items[-1] == StructureDriver.EOS and all(items[i] >= 0 for i in tpos)
    text = tok.decode([7 if x == StructureDriver.FREE else x for x in items[:-1]])
    parse(g, text)  # the forced structure is well formed
    # the server forks where the skeleton says: the parent detector pauses at the first fork
    det = get_detector(g, mode=Mode.PARENT)
    (ev,) = [e for e in det.feed(text) if type(e).__name__ == "PhaseOpened"]
    assert ev.n == json.loads(sj)["n"]


def test_driver_branch_skeleton_matches_the_serial_path(tok):
    sj = spec("multiverse", 2, [3, 5], nest=2)
    root, _ = StructureDriver.skeleton(tok, sj, "root", "")
    branch, _ = StructureDriver.skeleton(tok, sj, "branch", "2")
    body = branch[:-1]  # the branch's items after its <Path> tag, without the final EOS
    assert any(root[i : i + len(body)] == body for i in range(len(root)))


def test_oracle_splits_phases(tok):
    """A synthetic server output: prefix, two branches, conclusion. Pieces are tokenized apart, as
    the server does (headers and joins are encoded on their own, free text is sampled)."""
    pieces = ["x", "\n<Parallel>\n<Goal>\n<Outline>\n1: ", "a", "\n</Outline>\n<Outline>\n2: ", "b",
              "\n</Outline>\n</Goal>\n", "<Path>\n1: ", "p", "\n</Path>", "\n", "<Path>\n2: ", "q r",
              "\n</Path>", "\n", "<Conclusion>\n", "c", "\n</Conclusion>\n</Parallel>\n"]
    out = [i for p in pieces for i in tok.encode(p, add_special_tokens=False)] + [tok.eos_token_id]
    prompt = tok.encode("hi", add_special_tokens=False)
    ps = fork_oracle.probes(tok, prompt, out, spec("multiverse", 2), "multiverse")
    assert [p.kind for p in ps] == ["segment", "branch", "branch", "segment"]
    assert tok.decode(ps[1].input_ids).endswith("</Goal>\n<Path>\n1: ")
    assert tok.decode(ps[2].input_ids).endswith("</Goal>\n<Path>\n2: ")  # sibling 1 invisible
    assert tok.decode(ps[2].expect) == "q r\n</Path>"
    assert tok.decode(ps[3].expect).startswith("<Conclusion>") and ps[3].eos_after
    assert json.loads(ps[3].spec)["prompt_len"] == len(prompt)
