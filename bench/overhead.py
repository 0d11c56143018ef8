"""Per-decode-step time split of SGLang's scheduler process (Albireo §3.1: T1..T5 + exposed CPU).

    python -m bench.overhead --launch [--batch-sizes 1,32,128] [--steps 96] [--tp 1] [--stream]
        [--stop] [--configs stock,bw-off,branchwise] [--overlap on,off] [--out runs/overhead.json]
    python -m bench.overhead --ab [--rounds 3] [--send auto|thread|inline] [--stream] [--stop]
        [--regex RE] ...
    python -m bench.overhead --ab --arrivals 8 [--arrival-gap-ms 50] ...   # requests arrive in waves
    python -m bench.overhead --ab --no-forward-thread ...     # --async-output without the forward thread
    python -m bench.overhead --url http://127.0.0.1:PORT      # a server started with BRANCHWISE_STEP_TIMER=1

Each batch size sends bs greedy requests at once, so decode runs at exactly bs rows, and reads the
scheduler's per-iteration records (branchwise/step_timer.py). Per steady step it reports the median
of each span (T1 sched .. T5 result, other, exposed, worker) and tok/s. --launch starts a server per
(config, overlap); --ab switches --async-output off and on in one server, in alternating rounds.
The configs, the columns and --arrivals: docs/design/bench-tools.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
import urllib.parse
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

try:
    import branchwise  # noqa: F401
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "overlay"))

from bench.cli import add_server_source
from bench.report import write_json
from branchwise.albireo.async_output import SWITCH_KEY  # noqa: E402
from branchwise.step_timer import PARENT, records_path  # noqa: E402
from branchwise.tools.launch import LocalServer, merged_state, post_json  # noqa: E402

STOP = ["<|never-matching stop string|>", "~~~###~~~"]  # --stop: SGLang checks them every step
COLUMNS = ("sched", "prep", "forward", "sample", "result", "stream", "other", "wall", "exposed", "worker")


@dataclass
class Row:
    config: str
    overlap: bool
    bs: int
    steps: int  # steady-state iterations measured
    ms: dict[str, float]  # wall clock, median per column
    cpu_ms: dict[str, float]  # scheduler-thread CPU time, median per column
    share: dict[str, float]  # wall: mean span / mean step
    tok_s: float  # bs / median step (wall)
    e2e_tok_s: float = 0.0  # bs * steps / request wall time (client side)
    fthread_steps: int = 0  # steady steps whose forward ran on the forward thread


def _prompts(batch: int) -> list[str]:
    return [f"request {idx}: the plan is to count {idx % 7} and" for idx in range(batch)]


def _read_until(path: str, offset: int, batch: int, timeout_s: float = 60.0) -> tuple[list[dict], int]:
    """Records after `offset` up to the first idle one after a `batch`-row decode result (the
    request's end)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with open(path) as records_file:
            records_file.seek(offset)
            text = records_file.read()
        lines = text.splitlines()
        recs = [json.loads(line) for line in lines if line.strip()]
        seen = False
        for idx, rec in enumerate(recs):
            seen = seen or rec["res"] == ["decode", batch]
            if seen and rec["run"] is None and rec["res"] is None:
                consumed = "".join(line + "\n" for line in lines[: idx + 1])
                return recs[: idx + 1], offset + len(consumed.encode())
        time.sleep(0.2)
    raise TimeoutError(f"no finished bs={batch} decode in {path} after {timeout_s:.0f} s")


def _quantile(values: list[float], quantile: float) -> float:
    if quantile == 0.5:
        return statistics.median(values)
    return statistics.quantiles(values, n=100, method="inclusive")[round(quantile * 100) - 1]


def summarize(records: list[dict], batch: int, clock: str = "wall",
              quantile: float = 0.5) -> tuple[int, dict[str, float], dict[str, float]]:
    steady = [rec for rec in records if rec["run"] == ["decode", batch] and rec["res"] == ["decode", batch]]
    if not steady:
        raise RuntimeError(f"no steady decode iteration at bs={batch} (max running requests too low?)")
    idle = [rec["fthread"]["idle"] if "fthread" in rec else None for rec in steady]
    if clock == "cpu":
        steady = [rec["cpu"] | {"worker": rec["worker"]} for rec in steady]
    else:
        steady = [dict(rec) for rec in steady]
    for rec, fidle in zip(steady, idle, strict=True):
        for span, parent in PARENT.items():  # T1/T5 include Branchwise's TAPER work
            rec[parent] = rec.get(parent, 0.0) + rec.get(span, 0.0)
        rec["result"] += rec["stream"]  # T5 includes its send part; `stream` stays as a sub-column
        if fidle is None:  # forward on the scheduler thread: every non-forward ms is exposed
            spans = rec["sched"] + rec["prep"] + rec["forward"] + rec["sample"] + rec["result"]
            rec["other"] = max(rec["wall"] - spans, 0.0)
            rec["exposed"] = rec["wall"] - rec["forward"]
        else:  # forward thread: T3/T4 ran concurrently with the scheduler thread's spans
            rec["other"] = max(rec["wall"] - rec["sched"] - rec["prep"] - rec["result"], 0.0)
            rec["exposed"] = fidle
    med = {col: 1e3 * _quantile([rec.get(col, 0.0) for rec in steady], quantile) for col in COLUMNS}
    wall = statistics.fmean(rec["wall"] for rec in steady)
    share = {col: statistics.fmean(rec.get(col, 0.0) for rec in steady) / wall for col in COLUMNS}
    return len(steady), med, share


def _post(url: str, payload: dict, stream: bool) -> None:
    if not stream:
        post_json(url + "/generate", payload, timeout=600)
        return
    req = urllib.request.Request(url + "/generate", data=json.dumps(payload | {"stream": True}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as resp:
        for _ in resp:  # drain the SSE stream: one chunk per request per step
            pass


def _sampling(steps: int, extra: dict | None = None) -> dict:
    """Greedy, exactly `steps` new tokens, plus --stop / --regex's parameters."""
    return {"max_new_tokens": steps, "temperature": 0, "ignore_eos": True} | (extra or {})


def _start(url: str, path: str) -> int:
    """Warm up; returns the records offset after it."""
    with open(path) as records_file:
        offset = len(records_file.read().encode())
    post_json(url + "/generate", {"text": _prompts(4), "sampling_params": _sampling(8, False)})
    return _read_until(path, offset, 4)[1]


def _row(config: str, overlap: bool, batch: int, records: list[dict], quantile: float,
         e2e_tok_s: float = 0.0) -> Row:
    steps, med, share = summarize(records, batch, quantile=quantile)
    _, cpu, _ = summarize(records, batch, "cpu", quantile=quantile)
    steady = ["decode", batch]
    fthread_steps = sum(1 for rec in records
                        if rec["run"] == steady and rec["res"] == steady and "fthread" in rec)
    print(f"  {config:10s} overlap={'on ' if overlap else 'off'} bs={batch:4d}: step {med['wall']:.2f} ms, "
          f"exposed {med['exposed']:.2f} ms ({steps} steps, {fthread_steps} on the forward thread), "
          f"e2e {e2e_tok_s:.0f} tok/s", flush=True)
    return Row(config, overlap, batch, steps, med, cpu, share, batch / (med["wall"] / 1e3), e2e_tok_s,
               fthread_steps)


def measure(url: str, path: str, config: str, overlap: bool, batch_sizes: list[int], steps: int,
            stream: bool = False, extra: dict | None = None, quantile: float = 0.5) -> list[Row]:
    offset, rows = _start(url, path), []
    for batch in batch_sizes:
        start = time.perf_counter()
        _post(url, {"text": _prompts(batch), "sampling_params": _sampling(steps, extra)}, stream)
        e2e = batch * steps / (time.perf_counter() - start)
        records, offset = _read_until(path, offset, batch)
        rows.append(_row(config, overlap, batch, records, quantile, e2e))
    return rows


def _post_waves(url: str, batch: int, sampling: dict, stream: bool, waves: int, gap_s: float) -> None:
    """`batch` requests in `waves` /generate calls, each from its own thread, gap_s apart."""
    prompts = _prompts(batch)
    cuts = [round(wave * batch / waves) for wave in range(waves + 1)]
    threads = []
    for wave in range(waves):
        if wave:
            time.sleep(gap_s)  # the arrival process itself, not a wait for a result
        part = prompts[cuts[wave]:cuts[wave + 1]]
        payload = {"text": part, "sampling_params": sampling}
        thread = threading.Thread(target=_post, args=(url, payload, stream))
        thread.start()
        threads.append(thread)
    for thread in threads:
        thread.join()


def measure_ab(url: str, path: str, overlap: bool, batch_sizes: list[int], steps: int, rounds: int,
               stream: bool = False, extra: dict | None = None, quantile: float = 0.5, waves: int = 1,
               gap_s: float = 0.05) -> list[Row]:
    """One server with --async-output, switched off/on at runtime in alternating rounds: both arms
    see the same machine load, so the comparison survives a shared, noisy machine."""
    offset, rows = _start(url, path), []
    for batch in batch_sizes:
        got: dict[str, list[dict]] = {"stock": [], "albireo": []}
        secs = {"stock": 0.0, "albireo": 0.0}
        for round_idx in range(rounds):
            for arm in (("stock", "albireo") if round_idx % 2 == 0 else ("albireo", "stock")):
                switch = {"server_args": {SWITCH_KEY: int(arm == "albireo")}}
                if not all(post_json(url + "/set_internal_state", switch)):
                    raise RuntimeError(f"the server refused to switch to {arm} (see its log)")
                start = time.perf_counter()
                if min(waves, batch) > 1:
                    _post_waves(url, batch, _sampling(steps, extra), stream, min(waves, batch), gap_s)
                else:
                    _post(url, {"text": _prompts(batch), "sampling_params": _sampling(steps, extra)}, stream)
                secs[arm] += time.perf_counter() - start
                records, offset = _read_until(path, offset, batch)
                got[arm] += records
        rows += [_row(arm, overlap, batch, recs, quantile, rounds * batch * steps / secs[arm])
                 for arm, recs in got.items()]
    return rows


def launch_args(config: str, overlap: bool, tp_size: int) -> tuple[list[str], dict[str, str]]:
    args = [] if overlap else ["--disable-overlap-schedule"]
    modes = {"stock": "stock", "albireo": "albireo", "albireo-inline": "albireo", "bw-off": "1",
             "branchwise": "1", "bw-nofwd": "1"}
    if config not in modes:
        raise ValueError(f"unknown config {config!r}: {', '.join(modes)}")
    env = {"BRANCHWISE_STEP_TIMER": modes[config], "OMP_NUM_THREADS": "1"}
    if config in ("albireo", "albireo-inline", "branchwise", "bw-nofwd"):
        args += ["--async-output"] + (["--parallel-sampling"] if tp_size > 1 else [])
    if config == "albireo-inline":  # sends stay on the scheduler thread
        env["BRANCHWISE_ASYNC_SEND"] = "inline"
    # the CPU forward thread is opt-in; bw-nofwd = --async-output without it
    env["BRANCHWISE_FORWARD_THREAD"] = "0" if config == "bw-nofwd" else "1"
    return args, env


def table(rows: list[Row], clock: str = "wall") -> str:
    head = (f"{'config':10s} {'overlap':7s} {'bs':>4s} | {'T1 sched':>8s} {'T2 prep':>8s} {'T3 fwd':>8s} "
            f"{'T4 samp':>8s} {'T5 res':>8s} {'(send)':>7s} {'other':>7s} | {'step':>7s} {'exposed':>8s} "
            f"{'worker':>7s} | {'fwd %':>5s} {'T1+4+5 %':>8s} {'tok/s':>8s} {'e2e tok/s':>9s}")
    out = [head, "-" * len(head)]
    for row in rows:
        times, share = (row.ms if clock == "wall" else row.cpu_ms), row.share
        out.append(f"{row.config:10s} {'on' if row.overlap else 'off':7s} {row.bs:4d} | "
                   f"{times['sched']:8.3f} {times['prep']:8.3f} {times['forward']:8.3f} "
                   f"{times['sample']:8.3f} {times['result']:8.3f} {times['stream']:7.3f} "
                   f"{times['other']:7.3f} | {times['wall']:7.3f} {times['exposed']:8.3f} "
                   f"{times['worker']:7.3f} | "
                   f"{100 * share['forward']:5.1f} "
                   f"{100 * (share['sched'] + share['sample'] + share['result']):8.1f} "
                   f"{row.tok_s:8.0f} {row.e2e_tok_s:9.0f}")
    return "\n".join(out)


def ratios(rows: list[Row]) -> str:
    """Exposed time and throughput of each config against stock and against bw-off."""
    by_key = {(row.config, row.overlap, row.bs): row for row in rows}
    out = []
    for (config, overlap, batch), row in by_key.items():
        for ref in ("stock", "bw-off"):
            if config.startswith("albireo") and ref == "bw-off":
                continue
            base = by_key.get((ref, overlap, batch))
            if config in ("stock", ref) or base is None:
                continue
            cpu = ("n/a (forward thread: exposed is its idle time)" if row.fthread_steps else
                   f"{base.cpu_ms['exposed'] / max(row.cpu_ms['exposed'], 1e-9):.2f}x")
            out.append(f"overlap {'on ' if overlap else 'off'} bs {batch:4d}: {config} vs {ref}: exposed "
                       f"{base.ms['exposed'] / max(row.ms['exposed'], 1e-9):.2f}x lower (wall), {cpu} (cpu); "
                       f"throughput {row.tok_s / base.tok_s:.2f}x (step), "
                       f"{row.e2e_tok_s / max(base.e2e_tok_s, 1e-9):.2f}x (e2e)")
    return "\n".join(out)


@dataclass(frozen=True, slots=True)
class Options:
    """One `python -m bench.overhead` run (its flags, parsed)."""

    url: str | None
    ab: bool
    model: str
    batch_sizes: list[int]
    steps: int
    tp: int
    configs: list[str]
    overlaps: list[bool]
    label: str
    stream: bool
    extra: dict  # sampling params every request carries (--stop, --regex)
    rounds: int
    send: str
    forward_thread: bool
    arrivals: int
    arrival_gap_s: float
    quantile: float
    out: str | None


def parse_args(argv: list[str] | None) -> Options:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = add_server_source(parser, "a running server started with env BRANCHWISE_STEP_TIMER=1 or =stock",
                            "start stock and Branchwise servers, overlap on/off")
    parser.add_argument("--batch-sizes", default="1,32,128")
    parser.add_argument("--steps", type=int, default=96, help="new tokens per request")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--configs", default="stock,albireo,bw-off,branchwise")
    parser.add_argument("--overlap", default="on,off")
    parser.add_argument("--label", default="server", help="config name in --url mode")
    parser.add_argument("--stream", action="store_true",
                        help="streaming requests: one output message per step")
    parser.add_argument("--stop", action="store_true",
                        help="requests carry stop strings (checked every step)")
    parser.add_argument("--regex", help="requests are constrained by this regex (grammar batches: SGLang's "
                                        "delayed sampling; e.g. '[a-z ]+', which never has to end)")
    src.add_argument("--ab", action="store_true",
                     help="A/B in one server per overlap setting: --async-output switched off/on at runtime "
                          "in alternating rounds (rows `stock` = switched off: SGLang's own paths)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="--ab: rounds per batch size (each runs both arms)")
    parser.add_argument("--send", choices=("auto", "thread", "inline"), default="auto",
                        help="--ab: where --async-output sends (BRANCHWISE_ASYNC_SEND)")
    parser.add_argument("--no-forward-thread", action="store_true",
                        help="--ab: the albireo arm without the CPU forward thread "
                             "(--async-output's default)")
    parser.add_argument("--arrivals", type=int, default=1,
                        help="--ab: the bs requests arrive in this many waves (prefills under decode load)")
    parser.add_argument("--arrival-gap-ms", type=float, default=50.0, help="--arrivals: time between waves")
    parser.add_argument("--quantile", type=float, default=0.5,
                        help="per-column statistic over the steady steps (0.5 = median; lower = less "
                             "disturbed by other load on a shared machine)")
    parser.add_argument("--out", help="write the rows as JSON here")
    args = parser.parse_args(argv)
    extra = ({"stop": STOP} if args.stop else {}) | ({"regex": args.regex} if args.regex else {})
    return Options(args.url, args.ab, args.model, [int(size) for size in args.batch_sizes.split(",")],
                   args.steps, args.tp, args.configs.split(","),
                   [setting.strip() == "on" for setting in args.overlap.split(",")], args.label, args.stream,
                   extra, args.rounds, args.send, not args.no_forward_thread, args.arrivals,
                   args.arrival_gap_ms / 1e3, args.quantile, args.out)


def _server(opts: Options, config: str, overlap: bool, env: dict[str, str] | None = None) -> LocalServer:
    args, base_env = launch_args(config, overlap, opts.tp)
    return LocalServer(opts.model, args, env=base_env | (env or {}), tp=opts.tp,
                       max_total_tokens=max(16384, max(opts.batch_sizes) * (opts.steps + 64)))


def run_ab(opts: Options) -> list[Row]:
    """--ab: one albireo server per overlap setting, --async-output switched off and on in rounds."""
    rows: list[Row] = []
    env = {"BRANCHWISE_ASYNC_SEND": opts.send} | (
        {} if opts.forward_thread else {"BRANCHWISE_FORWARD_THREAD": "0"})
    for overlap in opts.overlaps:
        srv = _server(opts, "albireo", overlap, env)
        try:
            srv.start()
            rows += measure_ab(srv.url, records_path(srv.port), overlap, opts.batch_sizes, opts.steps,
                               opts.rounds, opts.stream, opts.extra, opts.quantile, opts.arrivals,
                               opts.arrival_gap_s)
            fthread = merged_state(srv.url).get("branchwise_forward_thread")
            if fthread is not None:  # where the forward-thread arm's batches ran
                print(f"  forward thread: jobs by mode {fthread['modes']}, inline {fthread['inline']} "
                      f"{fthread['reasons']}")
        finally:
            srv.stop()
    return rows


def run_configs(opts: Options) -> list[Row]:
    """--launch: a server per (overlap setting, config), one after another."""
    rows: list[Row] = []
    for overlap in opts.overlaps:
        for config in opts.configs:
            srv = _server(opts, config, overlap)
            try:
                srv.start()
                rows += measure(srv.url, records_path(srv.port), config, overlap, opts.batch_sizes,
                                opts.steps, opts.stream, opts.extra, opts.quantile)
            finally:
                srv.stop()
    return rows


def main(argv: list[str] | None = None) -> None:
    opts = parse_args(argv)
    if opts.url:
        rows = measure(opts.url, records_path(urllib.parse.urlparse(opts.url).port), opts.label, True,
                       opts.batch_sizes, opts.steps, opts.stream, opts.extra, opts.quantile)
    else:
        rows = run_ab(opts) if opts.ab else run_configs(opts)
    stat = "median" if opts.quantile == 0.5 else f"p{round(opts.quantile * 100)}"
    print(f"\nwall clock, ms per decode step ({stat} over steady-state steps, per column):\n" + table(rows))
    print(f"\nscheduler-thread CPU time, ms per decode step ({stat}):\n" + table(rows, "cpu"))
    if any(row.config == "stock" for row in rows) and any(row.config != "stock" for row in rows):
        print("\n" + ratios(rows))
    if opts.out:
        write_json(Path(opts.out), [asdict(row) for row in rows], indent=1)


if __name__ == "__main__":
    main()
