"""The prefill budget in the real scheduler (overlap on, the default): long prompts that arrive while
requests decode are prefilled in chunks the slack rule limits, and every request completes at its
length; a policy other than taper refuses the opt-in at start."""

from __future__ import annotations

import json
import os
import subprocess
import threading
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from branchwise.config import PREFILL_ENV
from branchwise.tools.launch import LocalServer, branchwise_report, cpu_env, free_port, has_gpu, post_json

CHUNK = 512
# a 2 ms SLO no CPU step meets: every decoding request is behind its pace, so its chunks are the floor
ARGS = ("--branch-policy", "taper", "--branch-slo-tpot-ms", "2", "--chunked-prefill-size", str(CHUNK))
DECODERS, DECODE = 4, 200
LONGS, PROMPT, ANSWER = 3, 1500, 8


def ids(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 400 + 20 for i in range(n)]


def body(seed: int, prompt: int, tokens: int) -> dict:
    return {"input_ids": ids(seed, prompt), "rid": f"pb{seed}",
            "sampling_params": {"max_new_tokens": tokens, "temperature": 0, "ignore_eos": True}}


def streamed(url: str, payload: dict, first: threading.Event) -> dict:
    """The last chunk of a streamed request; `first` is set once its first token has arrived."""
    req = urllib.request.Request(url + "/generate", data=json.dumps(payload | {"stream": True}).encode(),
                                 headers={"Content-Type": "application/json"})
    last: dict = {}
    with urllib.request.urlopen(req, timeout=600) as resp:
        for line in resp:
            if line.startswith(b"data:") and b"[DONE]" not in line:
                last = json.loads(line[5:])
                first.set()
    return last


def test_long_prompts_beside_decoding_requests_get_limited_chunks(servers):
    server = servers.get(*ARGS, env={PREFILL_ENV: "1"})
    firsts = [threading.Event() for _ in range(DECODERS)]
    with ThreadPoolExecutor(DECODERS + LONGS) as pool:
        decoding = [pool.submit(streamed, server.url, body(i, 16, DECODE), first) for i, first in enumerate(firsts)]
        assert all(first.wait(300) for first in firsts)  # every decoder is decoding: then the long prompts
        longs = [pool.submit(post_json, server.url + "/generate", body(100 + i, PROMPT, ANSWER))
                 for i in range(LONGS)]
        answers, finals = [job.result() for job in longs], [job.result() for job in decoding]
    assert [len(out["output_ids"]) for out in answers] == [ANSWER] * LONGS
    assert [out["meta_info"]["completion_tokens"] for out in answers] == [ANSWER] * LONGS
    assert [out["meta_info"]["prompt_tokens"] for out in answers] == [PROMPT] * LONGS
    assert [out["meta_info"]["completion_tokens"] for out in finals] == [DECODE] * DECODERS

    rep = branchwise_report(server.url)
    assert rep["config"]["prefill_budget"] is True
    pre = rep["taper"]["prefill"]
    assert pre["errors"] == 0 and pre["chunk_max"] == CHUNK and pre["decode_interval"] == 1
    assert 0 < pre["floor"] < CHUNK
    assert pre["limited_steps"] > 0 and pre["floor_steps"] > 0  # chunks cut while requests decoded
    assert pre["steps"] > pre["limited_steps"]  # with nothing decoding, SGLang's chunk
    assert pre["tokens_mean"] < CHUNK
    assert pre["tokens_mean"] * pre["steps"] >= LONGS * PROMPT  # every prompt token in a ruled chunk


def test_another_policy_refuses_the_budget_at_start(tiny_model):
    server = LocalServer(tiny_model, ["--branch-policy", "eager"], port=free_port())
    env = os.environ.copy() | ({} if has_gpu() else cpu_env()) | {PREFILL_ENV: "1"}
    out = subprocess.run(server.command(), env=env, capture_output=True, text=True, timeout=180,
                         stdin=subprocess.DEVNULL)
    text = out.stdout + out.stderr
    assert out.returncode != 0, text[-2000:]
    assert f"Branchwise: {PREFILL_ENV}=1 (the prefill budget) runs with --branch-policy taper" in text
    assert "Load weight begin" not in text
