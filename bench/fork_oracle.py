"""Client-side equivalent of a server-side fork/join run: the schedule-invariance oracle.

Given a request's prompt ids and the ids the server returned, split the output at its phases and
build the requests a client would send to produce the same text serially, one sequence at a time:
  * branch i of every phase:   prompt + text up to the fork + header_i   ->  branch i's tokens
  * every parent segment:      prompt + text up to the segment's start  ->  the segment's tokens
                               (up to the next fork point, or to the end)
With branch isolation and canonical reduce order (TAPER Lemma 1) every such request must return
exactly the tokens found in the server's output (greedy). Uses the structure driver, so the
parent's free text and the branches' free text are the model's own in both runs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from bench.structure_driver import StructureDriver, request


@dataclass(frozen=True, slots=True)
class Probe:
    kind: str  # "branch" | "segment"
    input_ids: list[int]
    expect: list[int]  # the tokens the server produced for this sequence
    spec: str
    eos_after: bool  # the sequence ended by itself: the probe must produce EOS next


def tag_ids(tok: Any) -> dict[str, int]:
    return {tag: tok.convert_tokens_to_ids(tag) for tag in StructureDriver.TAGS}


def probes(tok: Any, prompt: list[int], out: list[int], spec_json: str, grammar: str) -> list[Probe]:
    """Split `out` (one top-level response, no nesting) into branch and parent-segment probes."""
    tags = tag_ids(tok)
    newline = tok.encode("\n", add_special_tokens=False)
    eos = tok.eos_token_id
    fork_tag, open_tag, close_tag = (("</Goal>", "<Path>", "</Path>") if grammar == "multiverse"
                                     else ("</Plan>", "<Execution", "</Execution>"))
    ended = bool(out) and out[-1] == eos
    body = out[:-1] if ended else out
    res: list[Probe] = []
    seg_start, search_from = 0, 0
    while True:
        fork_at = _find(body, tags[fork_tag], search_from)
        if fork_at < 0:
            break
        fork = fork_at + 1 + len(newline)  # the fork point: after the fork tag's line
        res.append(Probe("segment", prompt + body[:seg_start], body[seg_start:fork],
                         _spec_at(spec_json, len(prompt)), False))
        pos = fork
        while pos < len(body) and body[pos] == tags[open_tag]:
            end = _find(body, tags[close_tag], pos)
            hdr_end = pos + 1 + _header_len(tok, body[pos + 1 : end], grammar)
            res.append(Probe("branch", prompt + body[:fork] + body[pos:hdr_end], body[hdr_end : end + 1],
                             spec_json, True))
            pos = end + 1 + len(newline)
        seg_start = search_from = pos
    res.append(Probe("segment", prompt + body[:seg_start], body[seg_start:], _spec_at(spec_json, len(prompt)),
                     ended))
    return res


def _find(ids: list[int], token: int, start: int) -> int:
    try:
        return ids.index(token, start)
    except ValueError:
        return -1


def _header_len(tok: Any, rest: list[int], grammar: str) -> int:
    """Tokens of the header after its tag: "\\nK: " (Multiverse) or " id=K>\\n" (SPRINT)."""
    stop = ": " if grammar == "multiverse" else ">\n"
    for count in range(1, min(len(rest), 16) + 1):
        if tok.decode(rest[:count]).endswith(stop):
            return count
    raise ValueError("no branch header found")


def _spec_at(spec_json: str, prompt_len: int) -> str:
    import json

    params = json.loads(spec_json)
    params["prompt_len"] = prompt_len
    return json.dumps(params, sort_keys=True)


def check(post: Callable[[dict], dict], tok: Any, prompt: list[int], out: list[int], spec_json: str,
          grammar: str, **sampling: Any) -> list[str]:
    """Run every probe serially (grammar off); return the mismatches (empty: invariant holds)."""
    bad = []
    for probe in probes(tok, prompt, out, spec_json, grammar):
        tokens = len(probe.expect) + (1 if probe.eos_after else 0)
        if tokens == 0:
            continue
        got = post(request(probe.input_ids, probe.spec, grammar="none",
                           **(sampling | {"max_new_tokens": tokens})))
        ids = list(got["output_ids"])
        want = probe.expect + ([tok.eos_token_id] if probe.eos_after else [])
        if ids[: len(want)] != want:
            bad.append(f"{probe.kind} at input {len(probe.input_ids)}: want {tok.decode(want)!r} "
                       f"got {tok.decode(ids)!r}")
    return bad
