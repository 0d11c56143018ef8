"""Per-decode-step time split of SGLang's scheduler process (Albireo §3.1: T1..T5 + exposed CPU).

    python -m bench.overhead --launch [--batch-sizes 1,32,128] [--steps 96] [--tp 1] [--stream] [--stop]
                             [--configs stock,bw-off,branchwise] [--overlap on,off] [--out runs/overhead.json]
    python -m bench.overhead --ab [--rounds 3] [--send auto|thread|inline] [--stream] [--stop] [--regex RE] ...
    python -m bench.overhead --ab --arrivals 8 [--arrival-gap-ms 50] ...   # requests arrive in waves
    python -m bench.overhead --ab --no-forward-thread ...     # --async-output without the forward thread
    python -m bench.overhead --url http://127.0.0.1:PORT      # a server started with BRANCHWISE_STEP_TIMER=1

--launch starts one real server per (config, overlap) pair, one at a time: `stock` is SGLang with
only the timing hooks (env BRANCHWISE_STEP_TIMER=stock: no Branchwise hook at all), `albireo`
stock + Albireo's hooks only with --async-output (+ --parallel-sampling when --tp > 1;
`albireo-inline`: sends stay on the scheduler thread), `bw-off`
the whole plugin with every feature flag off (the cost of Branchwise's always-on hooks: TAPER
with policy off, fork), `branchwise` the whole plugin with the Albireo flags on. For each batch
size it sends bs greedy requests in one /generate call (ignore_eos, --steps new tokens each), so
decode runs at exactly bs rows (--stream: streamed, every step sends every row's output; --stop:
stop strings that never match, every row's tail is decoded every step), and reads the scheduler's
per-iteration records (branchwise/step_timer.py). Only steady-state iterations count: the one that runs a decode batch of bs rows and processes a
decode result of bs rows. Reported per step (median over those iterations, or --quantile; ms):

  T1 sched    get_next_batch_to_run (filter, update_running_batch, prepare_for_decode)
  T2 prep     run_batch minus forward and sample (ForwardBatch build, FutureMap, D2H)
  T3 fwd      ModelRunner.forward
  T4 sample   ModelRunner.sample
  T5 result   process_batch_result incl. the output stream (the `stream` column is its send part)
  other       receive/broadcast + loop glue (wall minus the spans)
  exposed     time the forward waits for the CPU per step. Without the forward thread the forward
              runs on the scheduler thread, so exposed = wall minus forward (all of the scheduler's
              non-forward work is on the critical path). With it (--async-output on CPU,
              albireo/forward_thread.py) exposed = the time the forward thread sat idle before this
              step's decode forward (T1/T5 that overlap the previous forward no longer count);
              T3/T4 are then the forward thread's spans.
  worker      time the async-output worker thread spent per step (off the scheduler thread)
  tok/s       bs / median step (steady decode); e2e tok/s: bs * steps / the whole request's time
              (prefill and ramp included) as the client saw it

--arrivals W (with --ab): the bs requests arrive in W waves --arrival-gap-ms apart, each wave one
/generate call from its own thread, so prefills are planned while earlier waves decode (the
sync boundary the forward thread removes for prefill and mixed batches). e2e tok/s then covers
the whole workload from the first wave to the last response; the step columns still count only
the steady steps once every wave runs.
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
from branchwise.launch import LocalServer, merged_state, post_json  # noqa: E402
from branchwise.step_timer import PARENT, records_path  # noqa: E402

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


def _prompts(bs: int) -> list[str]:
    return [f"request {i}: the plan is to count {i % 7} and" for i in range(bs)]


def _read_until(path: str, offset: int, bs: int, timeout_s: float = 60.0) -> tuple[list[dict], int]:
    """Records after `offset` up to the first idle one after a bs-row decode result (the request's end)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with open(path) as f:
            f.seek(offset)
            text = f.read()
        lines = text.splitlines()
        recs = [json.loads(x) for x in lines if x.strip()]
        seen = False
        for i, r in enumerate(recs):
            seen = seen or r["res"] == ["decode", bs]
            if seen and r["run"] is None and r["res"] is None:
                return recs[: i + 1], offset + len("".join(x + "\n" for x in lines[: i + 1]).encode())
        time.sleep(0.2)
    raise TimeoutError(f"no finished bs={bs} decode in {path} after {timeout_s:.0f} s")


def _quantile(xs: list[float], q: float) -> float:
    return statistics.median(xs) if q == 0.5 else statistics.quantiles(xs, n=100, method="inclusive")[round(q * 100) - 1]


def summarize(records: list[dict], bs: int, clock: str = "wall",
              q: float = 0.5) -> tuple[int, dict[str, float], dict[str, float]]:
    steady = [r for r in records if r["run"] == ["decode", bs] and r["res"] == ["decode", bs]]
    if not steady:
        raise RuntimeError(f"no steady decode iteration at bs={bs} (max running requests too low?)")
    idle = [r["fthread"]["idle"] if "fthread" in r else None for r in steady]
    if clock == "cpu":
        steady = [r["cpu"] | {"worker": r["worker"]} for r in steady]
    else:
        steady = [dict(r) for r in steady]
    for r, fidle in zip(steady, idle, strict=True):
        for span, parent in PARENT.items():  # T1/T5 include Branchwise's TAPER work
            r[parent] = r.get(parent, 0.0) + r.get(span, 0.0)
        r["result"] += r["stream"]  # T5 includes its send part; `stream` stays as a sub-column
        if fidle is None:  # forward on the scheduler thread: every non-forward ms is exposed
            spans = r["sched"] + r["prep"] + r["forward"] + r["sample"] + r["result"]
            r["other"] = max(r["wall"] - spans, 0.0)
            r["exposed"] = r["wall"] - r["forward"]
        else:  # forward thread: T3/T4 ran concurrently with the scheduler thread's spans
            r["other"] = max(r["wall"] - r["sched"] - r["prep"] - r["result"], 0.0)
            r["exposed"] = fidle
    med = {c: 1e3 * _quantile([r.get(c, 0.0) for r in steady], q) for c in COLUMNS}
    wall = statistics.fmean(r["wall"] for r in steady)
    share = {c: statistics.fmean(r.get(c, 0.0) for r in steady) / wall for c in COLUMNS}
    return len(steady), med, share


def _post(url: str, payload: dict, stream: bool) -> None:
    if not stream:
        post_json(url + "/generate", payload, timeout=600)
        return
    req = urllib.request.Request(url + "/generate", data=json.dumps(payload | {"stream": True}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        for _ in r:  # drain the SSE stream: one chunk per request per step
            pass


def _sampling(steps: int, extra: dict | None = None) -> dict:
    """Greedy, exactly `steps` new tokens, plus --stop / --regex's parameters."""
    return {"max_new_tokens": steps, "temperature": 0, "ignore_eos": True} | (extra or {})


def _start(url: str, path: str) -> int:
    """Warm up; returns the records offset after it."""
    with open(path) as f:
        offset = len(f.read().encode())
    post_json(url + "/generate", {"text": _prompts(4), "sampling_params": _sampling(8, False)})
    return _read_until(path, offset, 4)[1]


def _row(config: str, overlap: bool, bs: int, records: list[dict], q: float, e2e_tok_s: float = 0.0) -> Row:
    n, med, share = summarize(records, bs, q=q)
    _, cpu, _ = summarize(records, bs, "cpu", q=q)
    nf = sum(1 for r in records if r["run"] == ["decode", bs] and r["res"] == ["decode", bs] and "fthread" in r)
    print(f"  {config:10s} overlap={'on ' if overlap else 'off'} bs={bs:4d}: step {med['wall']:.2f} ms, "
          f"exposed {med['exposed']:.2f} ms ({n} steps, {nf} on the forward thread), "
          f"e2e {e2e_tok_s:.0f} tok/s", flush=True)
    return Row(config, overlap, bs, n, med, cpu, share, bs / (med["wall"] / 1e3), e2e_tok_s, nf)


def measure(url: str, path: str, config: str, overlap: bool, batch_sizes: list[int], steps: int,
            stream: bool = False, extra: dict | None = None, q: float = 0.5) -> list[Row]:
    offset, rows = _start(url, path), []
    for bs in batch_sizes:
        t0 = time.perf_counter()
        _post(url, {"text": _prompts(bs), "sampling_params": _sampling(steps, extra)}, stream)
        e2e = bs * steps / (time.perf_counter() - t0)
        records, offset = _read_until(path, offset, bs)
        rows.append(_row(config, overlap, bs, records, q, e2e))
    return rows


def _post_waves(url: str, bs: int, sampling: dict, stream: bool, waves: int, gap_s: float) -> None:
    """bs requests in `waves` /generate calls, each from its own thread, gap_s apart."""
    prompts = _prompts(bs)
    cuts = [round(k * bs / waves) for k in range(waves + 1)]
    threads = []
    for k in range(waves):
        if k:
            time.sleep(gap_s)  # the arrival process itself, not a wait for a result
        part = prompts[cuts[k]:cuts[k + 1]]
        th = threading.Thread(target=_post, args=(url, {"text": part, "sampling_params": sampling}, stream))
        th.start()
        threads.append(th)
    for th in threads:
        th.join()


def measure_ab(url: str, path: str, overlap: bool, batch_sizes: list[int], steps: int, rounds: int,
               stream: bool = False, extra: dict | None = None, q: float = 0.5, waves: int = 1,
               gap_s: float = 0.05) -> list[Row]:
    """One server with --async-output, switched off/on at runtime in alternating rounds: both arms
    see the same machine load, so the comparison survives a shared, noisy machine."""
    offset, rows = _start(url, path), []
    for bs in batch_sizes:
        got: dict[str, list[dict]] = {"stock": [], "albireo": []}
        secs = {"stock": 0.0, "albireo": 0.0}
        for r in range(rounds):
            for arm in (("stock", "albireo") if r % 2 == 0 else ("albireo", "stock")):
                if not all(post_json(url + "/set_internal_state", {"server_args": {SWITCH_KEY: int(arm == "albireo")}})):
                    raise RuntimeError(f"the server refused to switch to {arm} (see its log)")
                t0 = time.perf_counter()
                if min(waves, bs) > 1:
                    _post_waves(url, bs, _sampling(steps, extra), stream, min(waves, bs), gap_s)
                else:
                    _post(url, {"text": _prompts(bs), "sampling_params": _sampling(steps, extra)}, stream)
                secs[arm] += time.perf_counter() - t0
                records, offset = _read_until(path, offset, bs)
                got[arm] += records
        rows += [_row(arm, overlap, bs, recs, q, rounds * bs * steps / secs[arm]) for arm, recs in got.items()]
    return rows


def launch_args(config: str, overlap: bool, tp: int) -> tuple[list[str], dict[str, str]]:
    args = [] if overlap else ["--disable-overlap-schedule"]
    modes = {"stock": "stock", "albireo": "albireo", "albireo-inline": "albireo", "bw-off": "1", "branchwise": "1",
             "bw-nofwd": "1"}
    if config not in modes:
        raise ValueError(f"unknown config {config!r}: {', '.join(modes)}")
    env = {"BRANCHWISE_STEP_TIMER": modes[config], "OMP_NUM_THREADS": "1"}
    if config in ("albireo", "albireo-inline", "branchwise", "bw-nofwd"):
        args += ["--async-output"] + (["--parallel-sampling"] if tp > 1 else [])
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
    for r in rows:
        m, s = (r.ms if clock == "wall" else r.cpu_ms), r.share
        out.append(f"{r.config:10s} {'on' if r.overlap else 'off':7s} {r.bs:4d} | {m['sched']:8.3f} {m['prep']:8.3f} "
                   f"{m['forward']:8.3f} {m['sample']:8.3f} {m['result']:8.3f} {m['stream']:7.3f} "
                   f"{m['other']:7.3f} | {m['wall']:7.3f} {m['exposed']:8.3f} {m['worker']:7.3f} | "
                   f"{100 * s['forward']:5.1f} {100 * (s['sched'] + s['sample'] + s['result']):8.1f} "
                   f"{r.tok_s:8.0f} {r.e2e_tok_s:9.0f}")
    return "\n".join(out)


def ratios(rows: list[Row]) -> str:
    """Exposed time and throughput of each config against stock and against bw-off."""
    by = {(r.config, r.overlap, r.bs): r for r in rows}
    out = []
    for (cfg, ov, bs), r in by.items():
        for ref in ("stock", "bw-off"):
            if cfg.startswith("albireo") and ref == "bw-off":
                continue
            base = by.get((ref, ov, bs))
            if cfg in ("stock", ref) or base is None:
                continue
            cpu = ("n/a (forward thread: exposed is its idle time)" if r.fthread_steps else
                   f"{base.cpu_ms['exposed'] / max(r.cpu_ms['exposed'], 1e-9):.2f}x")
            out.append(f"overlap {'on ' if ov else 'off'} bs {bs:4d}: {cfg} vs {ref}: exposed "
                       f"{base.ms['exposed'] / max(r.ms['exposed'], 1e-9):.2f}x lower (wall), {cpu} (cpu); "
                       f"throughput {r.tok_s / base.tok_s:.2f}x (step), "
                       f"{r.e2e_tok_s / max(base.e2e_tok_s, 1e-9):.2f}x (e2e)")
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
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = add_server_source(ap, "a running server started with env BRANCHWISE_STEP_TIMER=1 or =stock",
                            "start stock and Branchwise servers, overlap on/off")
    ap.add_argument("--batch-sizes", default="1,32,128")
    ap.add_argument("--steps", type=int, default=96, help="new tokens per request")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--configs", default="stock,albireo,bw-off,branchwise")
    ap.add_argument("--overlap", default="on,off")
    ap.add_argument("--label", default="server", help="config name in --url mode")
    ap.add_argument("--stream", action="store_true", help="streaming requests: one output message per step")
    ap.add_argument("--stop", action="store_true", help="requests carry stop strings (checked every step)")
    ap.add_argument("--regex", help="requests are constrained by this regex (grammar batches: SGLang's delayed "
                                    "sampling; e.g. '[a-z ]+', which never has to end)")
    src.add_argument("--ab", action="store_true",
                     help="A/B in one server per overlap setting: --async-output switched off/on at runtime "
                          "in alternating rounds (rows `stock` = switched off: SGLang's own paths)")
    ap.add_argument("--rounds", type=int, default=3, help="--ab: rounds per batch size (each runs both arms)")
    ap.add_argument("--send", choices=("auto", "thread", "inline"), default="auto",
                    help="--ab: where --async-output sends (BRANCHWISE_ASYNC_SEND)")
    ap.add_argument("--no-forward-thread", action="store_true",
                    help="--ab: the albireo arm without the CPU forward thread (--async-output's default)")
    ap.add_argument("--arrivals", type=int, default=1,
                    help="--ab: the bs requests arrive in this many waves (prefills under decode load)")
    ap.add_argument("--arrival-gap-ms", type=float, default=50.0, help="--arrivals: time between waves")
    ap.add_argument("--quantile", type=float, default=0.5,
                    help="per-column statistic over the steady steps (0.5 = median; lower = less disturbed "
                         "by other load on a shared machine)")
    ap.add_argument("--out", help="write the rows as JSON here")
    a = ap.parse_args(argv)
    extra = ({"stop": STOP} if a.stop else {}) | ({"regex": a.regex} if a.regex else {})
    return Options(a.url, a.ab, a.model, [int(x) for x in a.batch_sizes.split(",")], a.steps, a.tp,
                   a.configs.split(","), [x.strip() == "on" for x in a.overlap.split(",")], a.label, a.stream,
                   extra, a.rounds, a.send, not a.no_forward_thread, a.arrivals, a.arrival_gap_ms / 1e3,
                   a.quantile, a.out)


def _server(o: Options, config: str, overlap: bool, env: dict[str, str] | None = None) -> LocalServer:
    args, base_env = launch_args(config, overlap, o.tp)
    return LocalServer(o.model, args, env=base_env | (env or {}), tp=o.tp,
                       max_total_tokens=max(16384, max(o.batch_sizes) * (o.steps + 64)))


def run_ab(o: Options) -> list[Row]:
    """--ab: one albireo server per overlap setting, --async-output switched off and on in rounds."""
    rows: list[Row] = []
    env = {"BRANCHWISE_ASYNC_SEND": o.send} | ({} if o.forward_thread else {"BRANCHWISE_FORWARD_THREAD": "0"})
    for overlap in o.overlaps:
        srv = _server(o, "albireo", overlap, env)
        try:
            srv.start()
            rows += measure_ab(srv.url, records_path(srv.port), overlap, o.batch_sizes, o.steps, o.rounds,
                               o.stream, o.extra, o.quantile, o.arrivals, o.arrival_gap_s)
            ft = merged_state(srv.url).get("branchwise_forward_thread")
            if ft is not None:  # where the forward-thread arm's batches ran
                print(f"  forward thread: jobs by mode {ft['modes']}, inline {ft['inline']} {ft['reasons']}")
        finally:
            srv.stop()
    return rows


def run_configs(o: Options) -> list[Row]:
    """--launch: a server per (overlap setting, config), one after another."""
    rows: list[Row] = []
    for overlap in o.overlaps:
        for config in o.configs:
            srv = _server(o, config, overlap)
            try:
                srv.start()
                rows += measure(srv.url, records_path(srv.port), config, overlap, o.batch_sizes, o.steps,
                                o.stream, o.extra, o.quantile)
            finally:
                srv.stop()
    return rows


def main(argv: list[str] | None = None) -> None:
    o = parse_args(argv)
    if o.url:
        rows = measure(o.url, records_path(urllib.parse.urlparse(o.url).port), o.label, True, o.batch_sizes,
                       o.steps, o.stream, o.extra, o.quantile)
    else:
        rows = run_ab(o) if o.ab else run_configs(o)
    stat = "median" if o.quantile == 0.5 else f"p{round(o.quantile * 100)}"
    print(f"\nwall clock, ms per decode step ({stat} over steady-state steps, per column):\n" + table(rows))
    print(f"\nscheduler-thread CPU time, ms per decode step ({stat}):\n" + table(rows, "cpu"))
    if any(r.config == "stock" for r in rows) and any(r.config != "stock" for r in rows):
        print("\n" + ratios(rows))
    if o.out:
        write_json(Path(o.out), [asdict(r) for r in rows], indent=1)


if __name__ == "__main__":
    main()
