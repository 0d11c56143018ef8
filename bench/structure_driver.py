"""Deterministic branch-structure driver: a SGLang CustomLogitProcessor that forces a tag skeleton.

A random tiny model never writes `<Parallel>` or `<Plan>`. This processor (server flag
`--enable-custom-logit-processor`) forces a Multiverse or SPRINT skeleton token by token while the
free text in between is the model's own choice: at a forced position it masks every other token, at
a free position it only masks tags, EOS and angle brackets (so free text cannot fake structure).
Greedy requests are therefore deterministic and their free text depends on the context exactly as
the model's does, which is what the schedule-invariance oracle needs.

The skeleton is the *serial* text of the whole program (all paths / executions written in order).
The driver finds its place by counting tag tokens in its own region, so it works unchanged for
  * a client request (region: everything after the prompt), whether or not the server forks it;
  * a server-side branch, which inherits the parent's processor and params: its input ends with an
    open header (`<Path>\\nK: ` / `<Execution id=K>\\n`), so it drives that path's sub-skeleton;
  * the client-side equivalents used as oracles: prompt + prefix + header_i (a branch), and
    prompt + prefix + joined paths with `prompt_len` given (the parent's continuation).
Under the overlap scheduler the processor runs before the previous step's token reaches
`req.output_ids`; that token is inferred from the skeleton (`kv_committed_len` counts it).

    payload = request(prompt, spec(g="multiverse", n=3, lens=[6, 4, 5]), max_new_tokens=200)
    requests.post(url + "/generate", json=payload)
"""

from __future__ import annotations

import json
import threading
from typing import Any

from sglang.srt.sampling.custom_logit_processor import CustomLogitProcessor


def spec(g: str = "multiverse", n: int = 2, lens: list[int] | None = None, *, pre: int = 3, goal: int = 2,
         post: int = 3, nest: int = 1, nest_n: int = 1, rounds: int = 1, fault: str = "",
         prompt_len: int | None = None) -> str:
    """The skeleton as a JSON string (custom_params values must be flat JSON).

    g: multiverse | sprint; n: fanout; lens: free tokens of branch k (cycled); pre/goal/post: free
    tokens before the structure, in each outline/task/plan, in the conclusion/answer; nest: parallel
    levels (2 = every top-level path holds one nested <Parallel> with nest_n paths); rounds: SPRINT
    plan/execute rounds; fault: "" | unclosed | extra_path | extra_exec; prompt_len: where the
    driver's region starts in the input (only for continuation requests)."""
    d: dict[str, Any] = dict(g=g, n=n, lens=lens or [4], pre=pre, goal=goal, post=post, nest=nest,
                             nest_n=nest_n, rounds=rounds, fault=fault)
    if prompt_len is not None:
        d["prompt_len"] = prompt_len
    return json.dumps(d, sort_keys=True)


def request(prompt: str | list[int], spec_json: str, *, grammar: str | None = None, rid: str | None = None,
            stream: bool = False, **sampling: Any) -> dict[str, Any]:
    """A /generate payload driven by `spec_json`, greedy unless `sampling` says otherwise."""
    cp: dict[str, Any] = {StructureDriver.KEY: spec_json}
    if grammar is not None:
        cp["branchwise"] = {"grammar": grammar}
    sp = {"temperature": 0, "max_new_tokens": 256} | sampling | {"custom_params": cp}
    payload: dict[str, Any] = {"sampling_params": sp, "custom_logit_processor": StructureDriver.to_str(),
                               "stream": stream}
    payload["input_ids" if isinstance(prompt, list) else "text"] = prompt
    if rid is not None:
        payload["rid"] = rid
    return payload


class StructureDriver(CustomLogitProcessor):
    """Everything lives in the class: it is shipped to the server by value (see to_str)."""

    KEY = "bw_structure"  # custom_params key holding the JSON spec
    FREE = -1
    EOS = -2
    TAGS = ("<Think>", "</Think>", "<Parallel>", "</Parallel>", "<Goal>", "</Goal>", "<Outline>",
            "</Outline>", "<Path>", "</Path>", "<Conclusion>", "</Conclusion>", "<Plan>", "</Plan>",
            "<Task", "</Task>", "<Execution", "</Execution>", "<Answer>", "</Answer>")
    _cache: dict = {}

    _blob: str | None = None
    _lock = threading.Lock()

    @classmethod
    def to_str(cls) -> str:
        """Serialize by value, so the server needs no import path to this file. Done once: it
        briefly renames the class's module, which concurrent callers must not observe."""
        with cls._lock:
            if cls._blob is None:
                cls._blob = cls._serialize()
            return cls._blob

    @classmethod
    def _serialize(cls) -> str:
        import dill

        funcs = [getattr(v, "__func__", v) for v in vars(cls).values()]
        funcs = [f for f in funcs if hasattr(f, "__code__")]
        owners = [cls, *funcs]
        mods, cache = [o.__module__ for o in owners], cls._cache
        try:  # dill pickles __main__ objects by value, importable ones by reference
            for o in owners:
                o.__module__ = "__main__"
            cls._cache = {}  # client-side skeletons stay here
            blob = dill.dumps(cls, recurse=True)
        finally:
            cls._cache = cache
            for o, m in zip(owners, mods, strict=True):
                o.__module__ = m
        return json.dumps({"callable": blob.hex()})

    # ---- vocabulary ------------------------------------------------------------------------------
    @classmethod
    def vocab(cls, tok: Any) -> dict:
        key = ("vocab", id(tok))
        v = cls._cache.get(key)
        if v is None:
            tags = {t: tok.convert_tokens_to_ids(t) for t in cls.TAGS}
            n = len(tok)
            banned = set(tags.values()) | {tok.eos_token_id}
            for i in range(n):
                s = tok.decode([i])
                if "<" in s or ">" in s or "\ufffd" in s or not s:
                    banned.add(i)
            v = cls._cache[key] = {"tags": tags, "tag_ids": frozenset(tags.values()), "eos": tok.eos_token_id,
                                   "banned": sorted(banned)}
        return v

    # ---- skeletons -------------------------------------------------------------------------------
    @classmethod
    def pieces(cls, sp: dict, role: str, label: str) -> list:
        """('tag', name) | ('text', s) | ('free', k) | ('eos',) for the root or one branch."""
        g, fault = sp["g"], sp.get("fault", "")

        def length(lab: str) -> int:
            lens = sp["lens"]
            return lens[(int(lab.split(".")[-1]) - 1) % len(lens)]

        def tag(name: str) -> tuple:
            return ("tag", name)

        def mv_body(lab: str, depth: int) -> list:
            body = [("text", f"\n{lab}: "), ("free", length(lab)), ("text", "\n")]
            if depth + 1 < sp["nest"]:
                body += mv_parallel(lab, depth + 1) + [("text", "\n")]
            return body

        def mv_parallel(prefix: str, depth: int) -> list:
            n = sp["n"] if depth == 0 else sp["nest_n"]
            labs = [f"{prefix}.{k}" if prefix else str(k) for k in range(1, n + 1)]
            out = [tag("<Parallel>"), ("text", "\n"), tag("<Goal>"), ("text", "\n")]
            for lab in labs:
                out += [tag("<Outline>"), ("text", f"\n{lab}: "), ("free", sp["goal"]), ("text", "\n"),
                        tag("</Outline>"), ("text", "\n")]
            out += [tag("</Goal>"), ("text", "\n")]
            for lab in labs:
                out += [tag("<Path>"), *mv_body(lab, depth), tag("</Path>"), ("text", "\n")]
            out += [tag("<Conclusion>"), ("text", "\n"), ("free", sp["post"]), ("text", "\n"),
                    tag("</Conclusion>")]
            if depth == 0 and fault == "extra_path":
                out += [("text", "\n"), tag("<Path>"), ("text", "\n9: "), ("free", 2), ("text", "\n"),
                        tag("</Path>")]
            if depth == 0 and fault == "unclosed":
                return out
            return out + [("text", "\n"), tag("</Parallel>")]

        def sp_body(lab: str) -> list:
            return [("text", f" id={lab}>\n"), ("free", length(lab)), ("text", "\n")]

        if role == "branch":
            if g == "multiverse":
                return mv_body(label, label.count(".")) + [tag("</Path>"), ("eos",)]
            return sp_body(label) + [tag("</Execution>"), ("eos",)]
        out: list = [("free", sp["pre"]), ("text", "\n")]
        if g == "multiverse":
            return out + mv_parallel("", 0) + [("text", "\n"), ("eos",)]
        for r in range(sp["rounds"]):
            out += [tag("<Plan>"), ("text", "\n"), ("free", sp["goal"]), ("text", "\n")]
            for k in range(1, sp["n"] + 1):
                out += [tag("<Task"), ("text", f" id={k}>\n"), ("free", sp["goal"]), ("text", "\n"),
                        tag("</Task>"), ("text", "\n")]
            out += [tag("</Plan>"), ("text", "\n")]
            for k in range(1, sp["n"] + 1):
                out += [tag("<Execution"), *sp_body(str(k)), tag("</Execution>"), ("text", "\n")]
            if r == 0 and fault == "extra_exec":
                out += [tag("<Execution"), *sp_body("9"), tag("</Execution>"), ("text", "\n")]
        return out + [tag("<Answer>"), ("text", "\n"), ("free", sp["post"]), ("text", "\n"), tag("</Answer>"),
                      ("text", "\n"), ("eos",)]

    @classmethod
    def skeleton(cls, tok: Any, spec_json: str, role: str, label: str) -> tuple[list[int], list[int]]:
        """Token items (id, FREE or EOS) and the indices of tag items."""
        key = ("skel", id(tok), spec_json, role, label)
        hit = cls._cache.get(key)
        if hit is None:
            voc = cls.vocab(tok)
            items: list[int] = []
            for p in cls.pieces(json.loads(spec_json), role, label):
                if p[0] == "tag":
                    items.append(voc["tags"][p[1]])
                elif p[0] == "text":
                    items += tok.encode(p[1], add_special_tokens=False)
                elif p[0] == "free":
                    items += [cls.FREE] * p[1]
                else:
                    items.append(cls.EOS)
            tpos = [i for i, x in enumerate(items) if x in voc["tag_ids"]]
            hit = cls._cache[key] = (items, tpos)
        return hit

    # ---- per step --------------------------------------------------------------------------------
    @classmethod
    def locate(cls, req: Any, spec_json: str) -> tuple[list[int], int]:
        """(skeleton items, index of the item to produce now) for this request."""
        import re

        tok = req.tokenizer
        voc = cls.vocab(tok)
        tag_ids, tags = voc["tag_ids"], voc["tags"]
        inp, out = list(req.origin_input_ids), list(req.output_ids)
        sp = json.loads(spec_json)
        last = next((j for j in range(len(inp) - 1, -1, -1) if inp[j] in tag_ids), None)
        if last is not None and inp[last] in (tags["<Path>"], tags["<Execution"]):
            tail = tok.decode(inp[last + 1 :])
            m = re.search(r"([\d.]+)\s*:", tail) if inp[last] == tags["<Path>"] else re.search(
                r"id\s*=\s*['\"]?([\w.]+)", tail)
            role, label, start = "branch", m.group(1) if m else "1", last + 1
        else:
            role, label, start = "root", "", sp.get("prompt_len", len(inp))
        items, tpos = cls.skeleton(tok, spec_json, role, label)
        region = inp[start:] + out
        c = sum(1 for x in region if x in tag_ids)
        off = next((k for k in range(len(region)) if region[len(region) - 1 - k] in tag_ids), len(region))
        if c == 0:
            p = off
        elif c > len(tpos):
            p = len(items)
        else:
            p = tpos[c - 1] + 1 + off
        p = min(p, tpos[c] if c < len(tpos) else len(items))  # overlong free run: the tag is due
        # overlap scheduling: the previous step's token is in flight, not yet in output_ids
        kv = getattr(getattr(req, "kv", None), "kv_committed_len", 0) or 0
        p += max(0, kv - len(inp) - len(out))
        return items, p

    def __call__(self, logits: Any, custom_param_list: list | None = None) -> Any:
        if not custom_param_list:
            return logits
        for i, params in enumerate(custom_param_list):
            if not params or self.KEY not in params or "__req__" not in params:
                continue
            req = params["__req__"]
            items, p = self.locate(req, params[self.KEY])
            voc = self.vocab(req.tokenizer)
            want = items[p] if p < len(items) else self.EOS
            row = logits[i]
            if want == self.FREE:
                row[voc["banned"]] = float("-inf")
            else:
                forced = voc["eos"] if want == self.EOS else want
                row.fill_(float("-inf"))
                row[forced] = 0.0
        return logits


KEY = StructureDriver.KEY
