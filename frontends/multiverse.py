"""Multiverse (Map / Process / Reduce) as an SGLang frontend program.

client mode: the program writes the skeleton itself (<Think>, <Parallel>, <Goal> with one <Outline>
per path), forks one branch per path with the path header the server-side grammar would give it
("<Path>\\nK: "), joins the paths in outline order exactly as the server's reduce does
(phases.reduce with the grammar's format, which forces <Conclusion>) and writes the conclusion.
A Multiverse detector follows the parent's text, so the fork point, headers and final text are
checked against the grammar the server uses.

server mode: one request stamped custom_params.branchwise.grammar="multiverse"; the server forks when
the model writes the structure itself (server-side fork; with the tiny model this is plain decoding).

    python -m frontends.multiverse --url http://127.0.0.1:30000 --paths 3 [--mode server]
"""

from __future__ import annotations

import argparse
from dataclasses import astuple, dataclass, field
from typing import Any

from branchwise import client
from branchwise.fork import phases
from branchwise.fork.grammars import Mode, MultiverseDetector, MultiverseTags, PhaseOpened
from frontends.common import (
    ProgramResult,
    RequestRecord,
    add_common_args,
    backend,
    gen_kwargs,
    print_result,
    prompt,
    sgl,
    tag_stops,
    use_hook,
)

STOPS = tag_stops(list(astuple(MultiverseTags())))


@dataclass(slots=True)
class MultiverseResult(ProgramResult):
    mode: str = "client"
    outlines: list[str] = field(default_factory=list)
    paths: list[str] = field(default_factory=list)  # branch outputs, outline order


def _feed(det: MultiverseDetector, s: Any, fed: int) -> tuple[list[Any], str]:
    text = s.text()  # syncs: the detector follows exactly what the parent holds
    return det.feed(text[fed:]), text


@sgl.function
def multiverse_program(s: Any, question: str, paths: int, think_tokens: int, outline_tokens: int,
                       path_tokens: int, conclusion_tokens: int, temp: float) -> Any:
    det = MultiverseDetector(mode=Mode.PARENT)
    s += question + "\n"
    fed = len(s.text())  # the grammar follows generated text only, as on the server
    s += "<Think>\n" + sgl.gen("think", **gen_kwargs(think_tokens, temp, STOPS)) + "\n<Parallel>\n<Goal>\n"
    for k in range(paths):
        s += f"<Outline>\n{k + 1}: "
        s += sgl.gen(f"outline{k}", **gen_kwargs(outline_tokens, temp, [*STOPS, "\n"]))
        s += "\n</Outline>\n"
    s += "</Goal>\n"
    events, fork_text = _feed(det, s, fed)
    fed = len(fork_text)
    fork = next(e for e in events if isinstance(e, PhaseOpened))  # the server would fork here
    forks = s.fork(fork.n)
    for i in range(fork.n):
        forks[i] += fork.headers[i]
        forks[i] += sgl.gen("path", **gen_kwargs(path_tokens, temp, STOPS))
    forks.join()
    # outline order, "</Path>" closed, "<Conclusion>\n" appended
    reduce = phases.reduce(det.fmt, fork.headers, [forks[i]["path"] for i in range(fork.n)])
    det.join(reduce)
    s += reduce
    s += sgl.gen("conclusion", **gen_kwargs(conclusion_tokens, temp, STOPS))
    s += "\n</Conclusion>\n</Parallel>\n</Think>\n"
    _feed(det, s, fed + len(reduce))
    det.finish()  # raises GrammarError if the text is not well-formed Multiverse
    return forks, fork_text


def _client(url: str, question: str, paths: int, tokens: dict[str, int], temperature: float,
            endpoint: Any) -> MultiverseResult:
    state = multiverse_program.run(question=question, paths=paths, temp=temperature,
                                   backend=endpoint or backend(url), **tokens)
    if state.error() is not None:
        raise RuntimeError(f"multiverse program failed: {state.error()!r}")
    forks, fork_text = state.ret_value
    names = ["think", *(f"outline{k}" for k in range(paths))]
    recs = [RequestRecord.of(n, state.get_meta_info(n)) for n in names]
    recs += [RequestRecord.of(f"path{i}", f.get_meta_info("path"), 0) for i, f in enumerate(forks.states)]
    recs.append(RequestRecord.of("conclusion", state.get_meta_info("conclusion")))
    return MultiverseResult(state.text(), recs, [fork_text], "client",
                            [state[f"outline{k}"] for k in range(paths)], [f["path"] for f in forks.states])


def _server(url: str, question: str, max_tokens: int, temperature: float) -> MultiverseResult:
    sp = client.stamp_serial({"max_new_tokens": max_tokens, "temperature": temperature},
                             grammar="multiverse")
    g = client.generate_sync(url, question + "\n<Think>\n", sp)
    return MultiverseResult(question + "\n<Think>\n" + g.text, [RequestRecord.of("request", g.meta_info)],
                            mode="server")


def run(url: str, *, mode: str = "client", paths: int = 3, question: str | None = None,
        think_tokens: int = 16, outline_tokens: int = 12, path_tokens: int = 48,
        conclusion_tokens: int = 24, temperature: float = 0.0, hook: bool = True, seed: int = 0,
        endpoint: Any = None) -> MultiverseResult:
    question = question or prompt(seed)
    if mode == "server":
        total = think_tokens + paths * (outline_tokens + path_tokens) + conclusion_tokens
        return _server(url, question, total, temperature)
    if mode != "client":
        raise ValueError(f"mode must be 'client' or 'server', got {mode!r}")
    if paths < 1:
        raise ValueError(f"paths must be >= 1, got {paths}")
    use_hook(hook)
    tokens = dict(think_tokens=think_tokens, outline_tokens=outline_tokens, path_tokens=path_tokens,
                  conclusion_tokens=conclusion_tokens)
    return _client(url, question, paths, tokens, temperature, endpoint)


def main(argv: list[str] | None = None) -> None:
    p = add_common_args(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    p.add_argument("--mode", choices=("client", "server"), default="client")
    p.add_argument("--paths", type=int, default=3)
    p.add_argument("--path-tokens", type=int, default=48)
    a = p.parse_args(argv)
    res = run(a.url, mode=a.mode, paths=a.paths, path_tokens=a.path_tokens, temperature=a.temperature,
              hook=not a.stock, seed=a.seed)
    print_result(res, f"multiverse ({res.mode})")


if __name__ == "__main__":
    main()
