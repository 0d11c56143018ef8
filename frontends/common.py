"""Shared pieces of the frontend programs: backend, per-request records, prompts, CLI plumbing.

Importing this installs Branchwise's frontend hook (branch stamps + the fork race fix) before
SGLang's frontend is imported; `use_hook(False)` switches back to stock SGLang for A/B runs.
"""

from __future__ import annotations

import argparse
import random
import urllib.error
from dataclasses import dataclass, field
from typing import Any

from branchwise import client, frontend_hook
from branchwise.tools.tiny_model import WORDS

frontend_hook.install()

import sglang as sgl  # noqa: E402  (after install: the hook must see the frontend's import)


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """One /generate request of a program, from its meta_info."""

    name: str  # the program's name for it: "head", "branch2", "plan1", ...
    rid: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    latency_s: float
    finish: str
    phase: int | None = None  # branch requests: index of their phase in ProgramResult.fork_texts

    @classmethod
    def of(cls, name: str, meta: dict[str, Any] | None, phase: int | None = None) -> RequestRecord:
        m = meta or {}
        fr = m.get("finish_reason") or {}
        return cls(name, str(m.get("id", "")), int(m.get("prompt_tokens", 0)),
                   int(m.get("completion_tokens", 0)), int(m.get("cached_tokens", 0)),
                   float(m.get("e2e_latency") or 0.0), str(fr.get("type", "")), phase)


@dataclass(slots=True)
class ProgramResult:
    text: str  # the program's final text (prompt included)
    requests: list[RequestRecord] = field(default_factory=list)
    fork_texts: list[str] = field(default_factory=list)  # per phase: the parent's text at the fork

    def named(self, prefix: str) -> list[RequestRecord]:
        return [r for r in self.requests if r.name.startswith(prefix)]

    @property
    def branches(self) -> list[RequestRecord]:
        return [r for r in self.requests if r.phase is not None]


def prefix_hits(url: str, results: list[ProgramResult]) -> tuple[int, int]:
    """(branch requests whose cached_tokens cover their whole fork-point prefix, branch requests).
    Prefix lengths come from the server's own tokenizer (prompt_tokens of a max_new_tokens=0 probe,
    sent after the run so it cannot help the measurement)."""
    lens: dict[str, int] = {}
    hits = total = 0
    for res in results:
        for r in res.branches:
            text = res.fork_texts[r.phase]
            if text not in lens:
                lens[text] = client.generate_sync(url, text, {"max_new_tokens": 0}).prompt_tokens
            hits += r.cached_tokens >= lens[text]
            total += 1
    return hits, total


def use_hook(on: bool) -> None:
    """True: Branchwise frontend hook (default). False: stock SGLang frontend in this process."""
    if on:
        frontend_hook.install()
    else:
        frontend_hook.uninstall()


def backend(url: str) -> Any:
    """SGLang's RuntimeEndpoint, with a ConnectionError naming the url if nothing answers."""
    try:
        return sgl.RuntimeEndpoint(url.rstrip("/"))
    except (urllib.error.URLError, ConnectionError) as e:
        raise ConnectionError(f"SGLang server at {url} unreachable: {e}") from e


def prompt(seed: int, words: int = 24) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choices(WORDS, k=words)) + "."


def gen_kwargs(max_tokens: int, temperature: float = 0.0, stop: list[str] | None = None) -> dict[str, Any]:
    """sgl.gen arguments: greedy by default; fixed length (ignore_eos) unless a stop string ends it."""
    return dict(max_tokens=max_tokens, temperature=temperature, ignore_eos=True, stop=stop or None)


def tag_stops(names: list[str]) -> list[str]:
    """Stop strings that end a generated span at any grammar tag: the program owns the structure."""
    return [f"<{n}" for n in names] + [f"</{n}" for n in names]


def add_common_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--url", required=True, help="SGLang server, e.g. http://127.0.0.1:30000")
    p.add_argument("--seed", type=int, default=0, help="prompt seed")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--stock", action="store_true", help="run without the Branchwise frontend hook")
    return p


def print_result(res: ProgramResult, title: str = "") -> None:
    if title:
        print(f"== {title}")
    print(res.text)
    print(f"{'request':<14} {'rid':<34} {'prompt':>6} {'cached':>6} {'out':>5} finish")
    for r in res.requests:
        print(f"{r.name:<14} {r.rid:<34} {r.prompt_tokens:>6} {r.cached_tokens:>6} "
              f"{r.completion_tokens:>5} {r.finish}")
