"""The main job on the embedded default: serve the tiny model with Branchwise, run fork/join programs.

    python -m bench.demo [--model models/tiny] [--policies taper,serial] [--programs 4] [--fanout 4]

For each policy it starts a real SGLang server (CPU settings when there is no GPU), sends the same
serial -> fork(n) -> join -> serial programs at once (token ids, so a branch's shared prefix is
exactly the KV in the radix cache), their branches carrying Branchwise phase stamps, and stops the
server. It ends with the answer in small: under taper a phase's branches decode side by side and
finish together, under serial one at a time; per policy the wall time, the programs' latency, when
each branch of program 0 finished after its fork, and the shared-prefix tokens the branches got
from the radix cache instead of prefilling them again.
"""

from __future__ import annotations

import argparse
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from bench.cli import policy_list
from bench.programs import SEP_ID, branch_head, prompt_ids
from branchwise.request_meta import stamp
from branchwise.tools.launch import LocalServer, branchwise_report, post_json


def gen(url: str, ids: list[int], tokens: int, rid: str | None = None, **meta) -> dict:
    sampling = {"max_new_tokens": tokens, "temperature": 0, "ignore_eos": True}
    payload = {"input_ids": ids, "sampling_params": stamp(sampling, **meta) if meta else sampling}
    if rid:
        payload["rid"] = rid
    return post_json(url + "/generate", payload)


@dataclass(frozen=True, slots=True)
class Program:
    index: int
    text: str  # the final stage's output
    latency_s: float  # first request sent -> last token of the final stage
    branch_done_s: list[float]  # each branch's end, from the fork
    prefix_tokens: int  # shared-prefix tokens the branches ask for
    cached_tokens: int  # ... of which the radix cache served


def program(url: str, index: int, fanout: int, tokens: int, tag: str) -> Program:
    """serial gen -> fork(fanout) gen -> join -> serial gen, like an SGLang frontend program. It sends
    token ids, so every branch's shared prefix is exactly the KV the radix cache holds."""
    start = time.perf_counter()
    shared = prompt_ids(f"demo{index}", 24, "demo")
    shared += gen(url, shared, tokens)["output_ids"]
    t_fork = time.perf_counter()

    def branch(order: int) -> tuple[dict, float]:
        res = gen(url, shared + branch_head(order), tokens, rid=f"demo-{tag}{index}/b{order}",
                  phase=f"demo-{tag}{index}", branch=order, fanout=fanout)
        return res, time.perf_counter() - t_fork

    with ThreadPoolExecutor(fanout) as pool:
        branches = list(pool.map(branch, range(fanout)))
    joined = shared + [tok for order, (res, _) in enumerate(branches)
                       for tok in branch_head(order) + res["output_ids"]] + [SEP_ID]
    tail = gen(url, joined, tokens)
    cached = sum(min(res["meta_info"].get("cached_tokens", 0), len(shared)) for res, _ in branches)
    return Program(index, tail["text"], time.perf_counter() - start, [done_s for _, done_s in branches],
                   fanout * len(shared), cached)


@dataclass(frozen=True, slots=True)
class Result:
    policy: str
    wall_s: float
    programs: list[Program]


def run(url: str, policy: str, count: int, fanout: int, tokens: int) -> Result:
    program(url, count, fanout, tokens, f"warmup-{policy}")  # a fresh server's first forwards are slow
    start = time.perf_counter()
    with ThreadPoolExecutor(count) as pool:
        progs = list(pool.map(lambda index: program(url, index, fanout, tokens, policy), range(count)))
    return Result(policy, time.perf_counter() - start, progs)


def summary(results: list[Result]) -> str:
    """The answer in small: one line per policy, then the ratio of each to the first."""
    lines = [f"{'policy':<8}{'wall s':>8}{'program P50 s':>15}{'max s':>7}"
             f"{'branches done after the fork, s':>36}{'shared prefix from cache':>26}"]
    for result in results:
        lat = [prog.latency_s for prog in result.programs]
        prefix = sum(prog.prefix_tokens for prog in result.programs)
        cached = sum(prog.cached_tokens for prog in result.programs)
        done = " ".join(f"{done_s:.2f}" for done_s in sorted(result.programs[0].branch_done_s))
        lines.append(f"{result.policy:<8}{result.wall_s:>8.2f}{statistics.median(lat):>15.2f}{max(lat):>7.2f}"
                     f"{done + ' (program 0)':>36}{f'{cached} of {prefix} tokens':>26}")
    first = results[0]
    p50 = statistics.median(prog.latency_s for prog in first.programs)
    for result in results[1:]:
        p50_ratio = statistics.median(prog.latency_s for prog in result.programs) / p50
        lines.append(f"{result.policy} / {first.policy}: wall {result.wall_s / first.wall_s:.2f}x, "
                     f"program P50 {p50_ratio:.2f}x")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="models/tiny")
    parser.add_argument("--policies", type=policy_list, default="taper,serial", help="one server each, in this order")
    parser.add_argument("--programs", type=int, default=4)
    parser.add_argument("--fanout", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--url", help="use a running server (its own policy) instead of starting them")
    args = parser.parse_args(argv)
    results = []
    for policy in ([None] if args.url else args.policies):
        server = None if args.url else LocalServer(args.model, ["--branch-policy", policy]).start()
        url = args.url or server.url
        try:
            label = policy or (branchwise_report(url) or {}).get("policy") or "server"
            result = run(url, label, args.programs, args.fanout, args.tokens)
            for prog in result.programs:
                print(f"--- {label}, program {prog.index}: ...{prog.text[:60]!r}")
            results.append(result)
        finally:
            if server:
                server.stop()
    print(f"\n{args.programs} programs x fork({args.fanout}), {args.tokens} tokens per stage and branch:")
    print(summary(results))


if __name__ == "__main__":
    main()
