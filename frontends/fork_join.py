"""Plain SGLang fork/join program: serial gen -> fork(n) -> gen per branch -> join -> serial gen.

Unchanged SGLang frontend code: with the Branchwise frontend hook installed (frontends.common does
it) every branch request carries custom_params.branchwise {phase, branch, fanout} and a structured
rid, and the fork-point prefix is always committed to the radix cache before the branches start.

    python -m frontends.fork_join --url http://127.0.0.1:30000 --fanout 4 --programs 16 [--stock]

--out FILE writes every program's final text and branch texts as JSON (compare two servers' runs
with `cmp`). Under data parallelism it prints how many phases ran on one DP rank (meta_info.dp_rank).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from typing import Any

from frontends.common import (
    ProgramResult,
    RequestRecord,
    add_common_args,
    backend,
    gen_kwargs,
    prefix_hits,
    print_result,
    prompt,
    sgl,
    use_hook,
)


@dataclass(slots=True)
class ForkJoinResult(ProgramResult):
    branch_texts: list[str] = field(default_factory=list)
    branch_dp_ranks: list[int | None] = field(default_factory=list)  # meta_info.dp_rank (DP servers)

    @property
    def fork_text(self) -> str:  # the parent's text at the fork: every branch prompt starts with it
        return self.fork_texts[0]


@sgl.function
def fork_join_program(s: Any, prompt: str, fanout: int, head_tokens: int, branch_tokens: int,
                      tail_tokens: int, temp: float) -> Any:
    s += prompt
    s += sgl.gen("head", **gen_kwargs(head_tokens, temp))
    forks = s.fork(fanout)  # no explicit s.sync(): stock SGLang races here, the hook does not
    for i in range(fanout):
        forks[i] += f"\nbranch {i}:"
        forks[i] += sgl.gen("branch", **gen_kwargs(branch_tokens, temp))
    forks.join()
    s += "\nmerge:" + "".join(f"\n{i}:{forks[i]['branch']}" for i in range(fanout))  # fork order
    if tail_tokens > 0:
        s += "\nso:"
        s += sgl.gen("tail", **gen_kwargs(tail_tokens, temp))
    return forks


def _result(state: Any) -> ForkJoinResult:
    if state.error() is not None:
        raise RuntimeError(f"fork/join program failed: {state.error()!r}")
    forks = state.ret_value
    exes = [f.stream_executor for f in forks.states]
    recs = [RequestRecord.of("head", state.get_meta_info("head"))]
    recs += [RequestRecord.of(f"branch{i}", e.meta_info.get("branch"), 0) for i, e in enumerate(exes)]
    if state.get_meta_info("tail") is not None:
        recs.append(RequestRecord.of("tail", state.get_meta_info("tail")))
    fork_text = exes[0].text_[: exes[0].fork_start_text_pos]
    ranks = [(e.meta_info.get("branch") or {}).get("dp_rank") for e in exes]
    return ForkJoinResult(state.text(), recs, [fork_text], [e.variables["branch"] for e in exes], ranks)


def one_rank_phases(results: list[ForkJoinResult]) -> tuple[int, int] | None:
    """(phases whose branches all ran on one DP rank, phases), or None if the server reports no rank."""
    if not any(r is not None for res in results for r in res.branch_dp_ranks):
        return None
    return sum(len(set(res.branch_dp_ranks)) == 1 for res in results), len(results)


def run_batch(url: str, programs: int = 16, *, fanout: int = 4, head_tokens: int = 64,
              branch_tokens: int = 64, tail_tokens: int = 16, temperature: float = 0.0,
              hook: bool = True, seed: int = 0, endpoint: Any = None) -> list[ForkJoinResult]:
    """`programs` concurrent fork/join programs (one thread each, like SGLang's run_batch), each on
    its own prompt (seed + index). hook=False runs stock SGLang for comparison."""
    use_hook(hook)
    args = [dict(prompt=prompt(seed + k), fanout=fanout, head_tokens=head_tokens,
                 branch_tokens=branch_tokens, tail_tokens=tail_tokens, temp=temperature)
            for k in range(programs)]
    states = fork_join_program.run_batch(args, backend=endpoint or backend(url), num_threads=programs)
    return [_result(st) for st in states]


def run(url: str, *, fanout: int = 4, head_tokens: int = 64, branch_tokens: int = 64,
        tail_tokens: int = 16, temperature: float = 0.0, hook: bool = True, seed: int = 0) -> ForkJoinResult:
    return run_batch(url, 1, fanout=fanout, head_tokens=head_tokens, branch_tokens=branch_tokens,
                     tail_tokens=tail_tokens, temperature=temperature, hook=hook, seed=seed)[0]


def main(argv: list[str] | None = None) -> None:
    p = add_common_args(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    p.add_argument("--fanout", type=int, default=4)
    p.add_argument("--programs", type=int, default=1)
    p.add_argument("--head-tokens", type=int, default=64)
    p.add_argument("--branch-tokens", type=int, default=64)
    p.add_argument("--tail-tokens", type=int, default=16, help="0: end at the join")
    p.add_argument("--quiet", action="store_true", help="print only the cache summary")
    p.add_argument("--out", help="write the programs' final and branch texts to this JSON file")
    a = p.parse_args(argv)
    results = run_batch(a.url, a.programs, fanout=a.fanout, head_tokens=a.head_tokens,
                        branch_tokens=a.branch_tokens, tail_tokens=a.tail_tokens,
                        temperature=a.temperature, hook=not a.stock, seed=a.seed)
    for k, res in enumerate(results if not a.quiet else []):
        print_result(res, f"program {k}")
        print(f"branch cached_tokens: {[r.cached_tokens for r in res.branches]}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump([{"text": r.text, "branches": r.branch_texts} for r in results], f, indent=1)
    if (one := one_rank_phases(results)) is not None:
        print(f"phases with all branches on one DP rank: {one[0]}/{one[1]}")
    hits, total = prefix_hits(a.url, results)
    print(f"branch prompts with the whole fork prefix cached: {hits}/{total} = {hits / total:.1%} "
          f"({'stock SGLang' if a.stock else 'Branchwise frontend hook'})")


if __name__ == "__main__":
    main()
