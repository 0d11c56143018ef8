"""Schedule invariance (TAPER Lemma 1): greedy outputs must not depend on the branch policy.

    python -m bench.invariance --launch --programs 8 --policies serial,cap:2,eager,taper
    python -m bench.invariance --url http://127.0.0.1:30000 --programs 8

Programs mix serial requests, client-side fork/join (frontends.fork_join: the SGLang frontend with
the Branchwise fork hook) and server-side Multiverse / SPRINT requests driven by
bench.structure_driver. --launch starts a server per policy (branchwise.tools.launch) and runs all
programs concurrently on each, so batch composition and branch deferral differ per policy; --url
runs them on the given server twice, all at once and one at a time. Server-side programs are also
checked against their client-side serial equivalent (bench.fork_oracle). Prints `identical: K/N`
and exits 1 unless every program is identical everywhere.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from bench import fork_oracle
from bench.cli import add_server_source, policy_list
from bench.structure_driver import request, spec
from branchwise.tools.launch import LocalServer, get_json, merged_state, post_json

KINDS = ("serial", "client-fork", "multiverse", "sprint")
PROMPT_WORDS = "the plan is to check the cache prefix and then".split()


@dataclass(frozen=True, slots=True)
class Program:
    kind: str
    seed: int

    @property
    def rng(self) -> random.Random:
        return random.Random(self.seed)

    def prompt(self) -> str:
        rng = self.rng
        return " ".join(rng.choices(PROMPT_WORDS, k=rng.randint(3, 8)))

    def spec(self) -> tuple[str, str]:
        rng = self.rng
        fanout = rng.randint(2, 4) if self.kind == "multiverse" else rng.randint(2, 3)
        lens = [rng.randint(2, 9) for _ in range(fanout)]
        if self.kind == "multiverse":
            return spec("multiverse", fanout, lens), "multiverse"
        return spec("sprint", fanout, lens, rounds=rng.randint(1, 2)), "sprint"

    def run(self, url: str, tok: Any) -> dict[str, Any]:
        """Run once; `out` is what must be identical across policies."""
        if self.kind == "serial":
            sampling = {"max_new_tokens": self.rng.randint(16, 48), "temperature": 0, "ignore_eos": True}
            payload = {"text": self.prompt(), "sampling_params": sampling}
            res = post_json(url + "/generate", payload, timeout=600)
            return {"out": res["output_ids"]}
        if self.kind == "client-fork":
            from frontends import fork_join

            rng = self.rng
            res = fork_join.run(url, fanout=rng.randint(2, 3), head_tokens=rng.randint(4, 12),
                                branch_tokens=rng.randint(4, 12), tail_tokens=rng.randint(0, 8),
                                seed=self.seed)
            return {"out": res.text}
        spec_json, grammar = self.spec()
        ids = tok.encode(self.prompt(), add_special_tokens=False)  # ids: the oracle needs the same prompt
        res = post_json(url + "/generate", request(ids, spec_json, grammar=grammar, max_new_tokens=600),
                        timeout=600)
        return {"out": res["output_ids"], "finish": res["meta_info"]["finish_reason"]}

    def oracle(self, url: str, tok: Any, out: list[int]) -> list[str]:
        """Server-side programs: mismatches against the client-side serial equivalent."""
        if self.kind not in ("multiverse", "sprint"):
            return []
        spec_json, grammar = self.spec()
        prompt = tok.encode(self.prompt(), add_special_tokens=False)
        return fork_oracle.check(lambda payload: post_json(url + "/generate", payload, timeout=600), tok,
                                 prompt, out, spec_json, grammar)


def deferred(url: str) -> Any:
    """Branch rows the policy kept out of decode steps so far (0 would make the check vacuous)."""
    state = merged_state(url)
    rep, forks = state.get("branchwise", {}), state.get("branchwise_fork", {})
    return {"rows_deferred": (rep.get("taper") or {}).get("rows_deferred"),
            "server_forks": (forks.get("counters") or {}).get("forks")}


def programs(count: int, seed: int) -> list[Program]:
    return [Program(KINDS[index % len(KINDS)], seed * 1000 + index) for index in range(count)]


def run_all(url: str, tok: Any, progs: list[Program], concurrent: bool) -> list[dict[str, Any]]:
    if not concurrent:
        return [prog.run(url, tok) for prog in progs]
    with ThreadPoolExecutor(max_workers=len(progs)) as pool:
        return list(pool.map(lambda prog: prog.run(url, tok), progs))


def check(runs: dict[str, list[dict[str, Any]]], progs: list[Program],
          oracle_bad: list[list[str]]) -> list[bool]:
    """Per program: identical under every run and the oracle; one line printed for each."""
    names = list(runs)
    verdicts = []
    for index, prog in enumerate(progs):
        ref = runs[names[0]][index]["out"]
        diff = [name for name in names[1:] if runs[name][index]["out"] != ref]
        good = not diff and not oracle_bad[index]
        verdicts.append(good)
        what = ("identical" if good else f"DIFFERS under {diff}" if diff
                else f"oracle: {oracle_bad[index][:2]}")
        print(f"  program {index:>3} {prog.kind:<12} {what}")
    return verdicts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_server_source(parser, "a running server (with --enable-custom-logit-processor)",
                      "start a server per policy")
    parser.add_argument("--programs", type=int, default=8)
    parser.add_argument("--policies", type=policy_list, default="serial,cap:2,eager,taper")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-oracle", action="store_true")
    args = parser.parse_args(argv)
    from transformers import AutoTokenizer

    progs = programs(args.programs, args.seed)
    runs: dict[str, list[dict[str, Any]]] = {}
    oracle_bad: list[list[str]] = [[] for _ in progs]
    if args.url:
        info = get_json(args.url + "/server_info")
        tok = AutoTokenizer.from_pretrained(info["tokenizer_path"])
        policy = merged_state(args.url).get("branchwise", {}).get("config", {}).get("branch_policy")
        print(f"server {args.url} (policy {policy}): runs concurrent and serial")
        runs["concurrent"] = run_all(args.url, tok, progs, True)
        runs["one-at-a-time"] = run_all(args.url, tok, progs, False)
        print(f"  {deferred(args.url)}")
        if not args.no_oracle:
            oracle_bad = [prog.oracle(args.url, tok, res["out"])
                          for prog, res in zip(progs, runs["concurrent"], strict=True)]
    else:
        tok = AutoTokenizer.from_pretrained(args.model)
        for i, pol in enumerate(args.policies):
            srv = LocalServer(args.model, ["--branch-policy", pol, "--enable-custom-logit-processor"]).start()
            try:
                print(f"policy {pol}: {srv.url}", flush=True)
                runs[pol] = run_all(srv.url, tok, progs, True)
                print(f"  {deferred(srv.url)}", flush=True)
                if i == 0 and not args.no_oracle:
                    oracle_bad = [prog.oracle(srv.url, tok, res["out"])
                                  for prog, res in zip(progs, runs[pol], strict=True)]
            finally:
                srv.stop()
    verdicts = check(runs, progs, oracle_bad)
    print(f"identical: {sum(verdicts)}/{len(verdicts)}")
    print(json.dumps({"runs": list(runs), "programs": [prog.kind for prog in progs]}))
    return 0 if all(verdicts) else 1


if __name__ == "__main__":
    sys.exit(main())
