"""Deterministic branch-structure driver: a SGLang CustomLogitProcessor that forces a tag skeleton.

A random tiny model never writes `<Parallel>` or `<Plan>`. This processor (server flag
`--enable-custom-logit-processor`) forces a Multiverse or SPRINT skeleton token by token while the
free text in between is the model's own choice (only tags, EOS and angle brackets are masked
there), so greedy requests are deterministic and their free text depends on the context exactly as
the model's does: what the schedule-invariance oracle (bench.fork_oracle) needs. How the driver
finds its place in a client request, a server-side branch or an oracle's request, and under the
overlap scheduler: docs/design/bench-micro.md.

    payload = request(prompt, spec(grammar="multiverse", fanout=3, lens=[6, 4, 5]), max_new_tokens=200)
    requests.post(url + "/generate", json=payload)
"""

from __future__ import annotations

import json
import threading
from typing import Any

from sglang.srt.sampling.custom_logit_processor import CustomLogitProcessor


def spec(grammar: str = "multiverse", fanout: int = 2, lens: list[int] | None = None, *, pre: int = 3,
         goal: int = 2, post: int = 3, nest: int = 1, nest_n: int = 1, rounds: int = 1, fault: str = "",
         prompt_len: int | None = None) -> str:
    """The skeleton as a JSON string (custom_params values must be flat JSON; `grammar` is its key
    "g", `fanout` its key "n").

    grammar: multiverse | sprint; lens: free tokens of branch k (cycled); pre/goal/post: free
    tokens before the structure, in each outline/task/plan, in the conclusion/answer; nest: parallel
    levels (2 = every top-level path holds one nested <Parallel> with nest_n paths); rounds: SPRINT
    plan/execute rounds; fault: "" | unclosed | extra_path | extra_exec; prompt_len: where the
    driver's region starts in the input (only for continuation requests)."""
    params: dict[str, Any] = dict(g=grammar, n=fanout, lens=lens or [4], pre=pre, goal=goal, post=post,
                                  nest=nest, nest_n=nest_n, rounds=rounds, fault=fault)
    if prompt_len is not None:
        params["prompt_len"] = prompt_len
    return json.dumps(params, sort_keys=True)


def request(prompt: str | list[int], spec_json: str, *, grammar: str | None = None, rid: str | None = None,
            stream: bool = False, **sampling: Any) -> dict[str, Any]:
    """A /generate payload driven by `spec_json`, greedy unless `sampling` says otherwise."""
    custom_params: dict[str, Any] = {StructureDriver.KEY: spec_json}
    if grammar is not None:
        custom_params["branchwise"] = {"grammar": grammar}
    sampling_params = {"temperature": 0, "max_new_tokens": 256} | sampling | {"custom_params": custom_params}
    payload: dict[str, Any] = {"sampling_params": sampling_params,
                               "custom_logit_processor": StructureDriver.to_str(),
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

        funcs = [getattr(member, "__func__", member) for member in vars(cls).values()]
        funcs = [func for func in funcs if hasattr(func, "__code__")]
        owners = [cls, *funcs]
        mods, cache = [owner.__module__ for owner in owners], cls._cache
        try:  # dill pickles __main__ objects by value, importable ones by reference
            for owner in owners:
                owner.__module__ = "__main__"
            cls._cache = {}  # client-side skeletons stay here
            blob = dill.dumps(cls, recurse=True)
        finally:
            cls._cache = cache
            for owner, module in zip(owners, mods, strict=True):
                owner.__module__ = module
        return json.dumps({"callable": blob.hex()})

    # ---- vocabulary ------------------------------------------------------------------------------
    @classmethod
    def vocab(cls, tok: Any) -> dict:
        key = ("vocab", id(tok))
        entry = cls._cache.get(key)
        if entry is None:
            tags = {tag: tok.convert_tokens_to_ids(tag) for tag in cls.TAGS}
            banned = set(tags.values()) | {tok.eos_token_id}
            for token_id in range(len(tok)):
                text = tok.decode([token_id])
                if "<" in text or ">" in text or "\ufffd" in text or not text:
                    banned.add(token_id)
            entry = cls._cache[key] = {"tags": tags, "tag_ids": frozenset(tags.values()),
                                       "eos": tok.eos_token_id, "banned": sorted(banned)}
        return entry

    # ---- skeletons -------------------------------------------------------------------------------
    @classmethod
    def pieces(cls, skel: dict, role: str, label: str) -> list:
        """('tag', name) | ('text', s) | ('free', k) | ('eos',) for the root or one branch; `skel` is
        the parsed spec."""
        grammar, fault = skel["g"], skel.get("fault", "")

        def length(lab: str) -> int:
            lens = skel["lens"]
            return lens[(int(lab.split(".")[-1]) - 1) % len(lens)]

        def tag(name: str) -> tuple:
            return ("tag", name)

        def mv_body(lab: str, depth: int) -> list:
            body = [("text", f"\n{lab}: "), ("free", length(lab)), ("text", "\n")]
            if depth + 1 < skel["nest"]:
                body += mv_parallel(lab, depth + 1) + [("text", "\n")]
            return body

        def mv_parallel(prefix: str, depth: int) -> list:
            fanout = skel["n"] if depth == 0 else skel["nest_n"]
            labs = [f"{prefix}.{branch}" if prefix else str(branch) for branch in range(1, fanout + 1)]
            out = [tag("<Parallel>"), ("text", "\n"), tag("<Goal>"), ("text", "\n")]
            for lab in labs:
                out += [tag("<Outline>"), ("text", f"\n{lab}: "), ("free", skel["goal"]), ("text", "\n"),
                        tag("</Outline>"), ("text", "\n")]
            out += [tag("</Goal>"), ("text", "\n")]
            for lab in labs:
                out += [tag("<Path>"), *mv_body(lab, depth), tag("</Path>"), ("text", "\n")]
            out += [tag("<Conclusion>"), ("text", "\n"), ("free", skel["post"]), ("text", "\n"),
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
            if grammar == "multiverse":
                return mv_body(label, label.count(".")) + [tag("</Path>"), ("eos",)]
            return sp_body(label) + [tag("</Execution>"), ("eos",)]
        out: list = [("free", skel["pre"]), ("text", "\n")]
        if grammar == "multiverse":
            return out + mv_parallel("", 0) + [("text", "\n"), ("eos",)]
        for round_no in range(skel["rounds"]):
            out += [tag("<Plan>"), ("text", "\n"), ("free", skel["goal"]), ("text", "\n")]
            for task in range(1, skel["n"] + 1):
                out += [tag("<Task"), ("text", f" id={task}>\n"), ("free", skel["goal"]), ("text", "\n"),
                        tag("</Task>"), ("text", "\n")]
            out += [tag("</Plan>"), ("text", "\n")]
            for task in range(1, skel["n"] + 1):
                out += [tag("<Execution"), *sp_body(str(task)), tag("</Execution>"), ("text", "\n")]
            if round_no == 0 and fault == "extra_exec":
                out += [tag("<Execution"), *sp_body("9"), tag("</Execution>"), ("text", "\n")]
        return out + [tag("<Answer>"), ("text", "\n"), ("free", skel["post"]), ("text", "\n"),
                      tag("</Answer>"), ("text", "\n"), ("eos",)]

    @classmethod
    def skeleton(cls, tok: Any, spec_json: str, role: str, label: str) -> tuple[list[int], list[int]]:
        """Token items (id, FREE or EOS) and the indices of tag items."""
        key = ("skel", id(tok), spec_json, role, label)
        hit = cls._cache.get(key)
        if hit is None:
            voc = cls.vocab(tok)
            items: list[int] = []
            for piece in cls.pieces(json.loads(spec_json), role, label):
                if piece[0] == "tag":
                    items.append(voc["tags"][piece[1]])
                elif piece[0] == "text":
                    items += tok.encode(piece[1], add_special_tokens=False)
                elif piece[0] == "free":
                    items += [cls.FREE] * piece[1]
                else:
                    items.append(cls.EOS)
            tpos = [i for i, item in enumerate(items) if item in voc["tag_ids"]]
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
        skel = json.loads(spec_json)
        last = next((pos for pos in range(len(inp) - 1, -1, -1) if inp[pos] in tag_ids), None)
        if last is not None and inp[last] in (tags["<Path>"], tags["<Execution"]):
            tail = tok.decode(inp[last + 1 :])
            match = re.search(r"([\d.]+)\s*:", tail) if inp[last] == tags["<Path>"] else re.search(
                r"id\s*=\s*['\"]?([\w.]+)", tail)
            role, label, start = "branch", match.group(1) if match else "1", last + 1
        else:
            role, label, start = "root", "", skel.get("prompt_len", len(inp))
        items, tpos = cls.skeleton(tok, spec_json, role, label)
        region = inp[start:] + out
        tags_seen = sum(1 for token in region if token in tag_ids)
        off = next((back for back in range(len(region)) if region[len(region) - 1 - back] in tag_ids),
                   len(region))
        if tags_seen == 0:
            index = off
        elif tags_seen > len(tpos):
            index = len(items)
        else:
            index = tpos[tags_seen - 1] + 1 + off
        # overlong free run: the tag is due
        index = min(index, tpos[tags_seen] if tags_seen < len(tpos) else len(items))
        # overlap scheduling: the previous step's token is in flight, not yet in output_ids
        committed = getattr(getattr(req, "kv", None), "kv_committed_len", 0) or 0
        index += max(0, committed - len(inp) - len(out))
        return items, index

    def __call__(self, logits: Any, custom_param_list: list | None = None) -> Any:
        if not custom_param_list:
            return logits
        for i, params in enumerate(custom_param_list):
            if not params or self.KEY not in params or "__req__" not in params:
                continue
            req = params["__req__"]
            items, index = self.locate(req, params[self.KEY])
            voc = self.vocab(req.tokenizer)
            want = items[index] if index < len(items) else self.EOS
            row = logits[i]
            if want == self.FREE:
                row[voc["banned"]] = float("-inf")
            else:
                forced = voc["eos"] if want == self.EOS else want
                row.fill_(float("-inf"))
                row[forced] = 0.0
        return logits


KEY = StructureDriver.KEY
