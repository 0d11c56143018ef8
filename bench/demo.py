"""The main job on the embedded default: serve the tiny model with Branchwise, run fork/join programs.

    python -m bench.demo [--model models/tiny] [--policy taper] [--programs 4] [--fanout 4]

Starts a real SGLang server (CPU settings when there is no GPU), sends serial -> fork(n) -> join
programs whose branches carry Branchwise phase stamps, prints each program's output and the
scheduler-side Branchwise report, and stops the server.
"""

from __future__ import annotations

import argparse
import json
import time
from concurrent.futures import ThreadPoolExecutor

from branchwise.launch import LocalServer, branchwise_report, post_json
from branchwise.request_meta import stamp


def gen(url: str, text: str, n: int, rid: str | None = None, **meta) -> dict:
    sp = {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}
    payload = {"text": text, "sampling_params": stamp(sp, **meta) if meta else sp}
    if rid:
        payload["rid"] = rid
    return post_json(url + "/generate", payload)


def program(url: str, i: int, fanout: int, tokens: int) -> dict:
    """serial gen -> fork(fanout) gen -> join -> serial gen, like an SGLang frontend program."""
    prefix = f"program {i}: plan the steps then"
    head = gen(url, prefix, tokens)
    shared = prefix + head["text"]
    with ThreadPoolExecutor(fanout) as pool:
        branches = list(pool.map(lambda b: gen(url, shared + f"\nbranch {b}:", tokens, rid=f"demo{i}/b{b}",
                                               phase=f"demo{i}", branch=b, fanout=fanout), range(fanout)))
    joined = shared + "".join(f"\nbranch {b}:" + r["text"] for b, r in enumerate(branches))
    tail = gen(url, joined + "\nso", tokens)
    return {"program": i, "text": joined + "\nso" + tail["text"],
            "branch_cached_tokens": [r["meta_info"]["cached_tokens"] for r in branches]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="models/tiny")
    ap.add_argument("--policy", default="taper")
    ap.add_argument("--programs", type=int, default=4)
    ap.add_argument("--fanout", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--url", help="use a running server instead of starting one")
    args = ap.parse_args()
    server = None if args.url else LocalServer(args.model, ["--branch-policy", args.policy]).start()
    url = args.url or server.url
    try:
        t0 = time.perf_counter()
        with ThreadPoolExecutor(args.programs) as pool:
            results = list(pool.map(lambda i: program(url, i, args.fanout, args.tokens), range(args.programs)))
        wall = time.perf_counter() - t0
        for r in results:
            print(f"--- program {r['program']} (branch cached tokens {r['branch_cached_tokens']})")
            print(r["text"][:300].replace("\n", " | "))
        print(f"\n{args.programs} programs x fork({args.fanout}) in {wall:.2f} s")
        print("scheduler-side Branchwise report:", json.dumps(branchwise_report(url)))
    finally:
        if server:
            server.stop()


if __name__ == "__main__":
    main()
