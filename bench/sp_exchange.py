"""Logits exchange per decode step on a gloo group: SGLang's all-gather vs Albireo's all-to-all.

    python -m bench.sp_exchange [--tp 2] [--vocabs 460,152064] [--batch-sizes 1,32,128]
                                [--iters 30] [--step-iters 5] [--dtype float32] [--penalties]
                                [--out runs/sp_exchange.json]

Forks --tp processes joined in a gloo group (what SGLang's TP group is on CPU) and, for every
(vocab, batch size), times one decode step's logits exchange as SGLang 0.5.23 does it on CPU and as
--parallel-sampling does it at tp > 1:

  all_gather   each rank's vocab shard [bs, V/t] -> [bs, V] on every rank (GroupCoordinator.all_gather
               on CPU: all_gather_single into [t*bs, V/t], then the movedim/reshape)
  all_to_all   parallel_sampler.exchange_rows: batch padded to r*t rows (r = ceil(bs/t)),
               all_to_all_single, reassembly -> [r, V], this rank's rows only

Also the whole step as served (exchange + sampling + token-id gather where SP needs it): `stock`
(all-gather, every rank samples every row), `sp_gather` (all-gather, each rank samples its rows,
ids all-gathered: --parallel-sampling without the all-to-all), `sp_a2a` (all-to-all, own
rows, ids all-gathered). Sampling is seeded top-k/top-p (the heaviest torch path). --penalties adds
the same three steps for a batch with penalties and logit_bias on every row (copy_for_forward's
accumulated additive and scaling tensors + logit_bias, `sp_sampler_hook.apply_row_transforms`):
stock and sp_gather apply them to all bs rows, sp_a2a to its own r rows; the three give the same ids
(checked). SGLang's accumulation of those tensors (scheduler side, full rows, every rank) is the
same in all three and not timed.

Bytes are per rank per step, analytic (what arrives from the other ranks; the same amount leaves):
all_gather (t-1)*bs*V/t elements, all_to_all (t-1)*r*V/t. Times: per iteration the slowest rank
(all_reduce MAX of its wall time), median over --iters after 3 warm-up iterations; ratios are
against the all-gather measured in the same run (whole steps: median of --step-iters after one
warm-up, they are slow at a 152k vocab on one thread). A figure for this box, not a test.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from branchwise.albireo import parallel_sampler as ps
from branchwise.albireo.sp_sampler_hook import apply_row_transforms
from branchwise.launch import free_port

WARMUP = 3
_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # SGLang's CPU call


def _all_gather(shard: torch.Tensor, t: int) -> torch.Tensor:
    """GroupCoordinator.all_gather(x, dim=-1) as SGLang runs it on CPU (no shm kernel)."""
    bs, vs = shard.shape
    out = torch.empty((t * bs, vs), dtype=shard.dtype)
    _GATHER(out, shard.contiguous())
    return out.reshape(t, bs, vs).movedim(0, 1).reshape(bs, t * vs)


def _a2a(shard: torch.Tensor, t: int) -> torch.Tensor:
    return ps.exchange_rows(shard, t, lambda out, inp: dist.all_to_all_single(out, inp))


def _params(bs: int) -> ps.RowParams:
    return ps.RowParams.make(temperature=[0.8] * bs, top_p=[0.9] * bs, top_k=[50] * bs,
                          seed=list(range(bs)), position=[100 + i for i in range(bs)])


def _penalties(bs: int, vocab: int) -> Any:
    """A forward's sampling_info penalty fields for bs rows that all have penalties and a bias."""
    from types import SimpleNamespace

    g = torch.Generator().manual_seed(bs + 1)
    add = -torch.rand(bs, vocab, generator=g).lt_(0.02).float() * 1.5  # frequency-like on ~2% of tokens
    scale = 1 + torch.rand(bs, vocab, generator=g).lt_(0.02).float() * 0.2  # repetition-like
    bias = torch.zeros(bs, vocab)
    bias[:, :8] = -30.0
    return SimpleNamespace(acc_additive_penalties=add, acc_scaling_penalties=scale, logit_bias=bias,
                           penalizer_orchestrator=None)


def _timed(fn: Callable[[], Any], iters: int, warmup: int = WARMUP) -> float:
    """Median over iters of the slowest rank's wall time, ms."""
    times = []
    for i in range(warmup + iters):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        if i >= warmup:
            times.append(dt.item() * 1e3)
    return statistics.median(times)


def _measure(rank: int, t: int, vocab: int, bs: int, cfg: dict) -> dict:
    vs = -(-vocab // (64 * t)) * 64  # ParallelLMHead pads the vocab; one shard per rank
    g = torch.Generator().manual_seed(bs * 7 + vocab)
    full = torch.randn(bs, vs * t, generator=g).to(getattr(torch, cfg["dtype"]))
    shard = full[:, rank * vs : (rank + 1) * vs].contiguous()
    r = ps.rows_per_rank(bs, t)
    # the exchange itself, every configuration: my rows, bit-identical to the gathered ones
    want = full[rank * r : (rank + 1) * r]
    assert torch.equal(_a2a(shard, t)[: want.shape[0]], want) and torch.equal(_all_gather(shard, t), full)
    e, its, p = full.element_size(), cfg["iters"], _params(bs)
    row = {"vocab": vocab, "vocab_padded": vs * t, "bs": bs, "t": t, "rows_per_rank": r, "elem_bytes": e,
           "bytes_in_all_gather": (t - 1) * bs * vs * e, "bytes_in_all_to_all": (t - 1) * r * vs * e,
           "ms_all_gather": _timed(lambda: _all_gather(shard, t), its),
           "ms_all_to_all": _timed(lambda: _a2a(shard, t), its)}
    if cfg["steps"]:
        si = cfg["step_iters"]
        row["ms_stock"] = _timed(lambda: ps.sample_rows(_all_gather(shard, t)[:, :vocab], p), si, 1)
        row["ms_sp_gather"] = _timed(lambda: ps.sp_sample_full(_all_gather(shard, t)[:, :vocab], p), si, 1)
        row["ms_sp_a2a"] = _timed(lambda: ps.sample_own_rows(_a2a(shard, t)[:, :vocab], p, bs), si, 1)
    if cfg["steps"] and cfg["penalties"]:
        info = _penalties(bs, vocab)

        def full_rows() -> torch.Tensor:  # ModelRunner._preprocess_logits on the gathered rows
            x = _all_gather(shard, t)[:, :vocab]
            apply_row_transforms(info, x, slice(0, bs))
            return x

        def stock() -> torch.Tensor:
            return ps.sample_rows(full_rows(), p)

        def sp_gather() -> torch.Tensor:
            return ps.sp_sample_full(full_rows(), p)

        def sp_a2a() -> torch.Tensor:
            mine = _a2a(shard, t)[:, :vocab]
            ps.transform_own_rows(mine, bs, t, rank, lambda x, rows: apply_row_transforms(info, x, rows))
            return ps.sample_own_rows(mine, p, bs)

        want = stock()
        assert torch.equal(sp_gather(), want) and torch.equal(sp_a2a(), want)
        row["ms_stock_pen"] = _timed(stock, si, 1)
        row["ms_sp_gather_pen"] = _timed(sp_gather, si, 1)
        row["ms_sp_a2a_pen"] = _timed(sp_a2a, si, 1)
    return row


def _worker(rank: int, t: int, port: int, cfg: dict, out_path: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=t,
                            timeout=timedelta(seconds=120))
    rows = [_measure(rank, t, v, bs, cfg) for v in cfg["vocabs"] for bs in cfg["batch_sizes"]]
    if rank == 0:
        Path(out_path).write_text(json.dumps(rows))
    dist.barrier()
    dist.destroy_process_group()


def run(tp: int, vocabs: list[int], batch_sizes: list[int], iters: int, dtype: str, step_iters: int,
        penalties: bool = False) -> list[dict]:
    if tp < 2:
        raise ValueError("--tp must be at least 2 (there is nothing to exchange at tp=1)")
    cfg = {"vocabs": vocabs, "batch_sizes": batch_sizes, "iters": iters, "dtype": dtype,
           "steps": step_iters > 0, "step_iters": step_iters, "penalties": penalties}
    if penalties:  # import SGLang's scaling op once here, not in every forked rank; eager, as the CPU
        torch._dynamo.config.disable = True  # servers run it (branchwise.launch: TORCHDYNAMO_DISABLE=1)
        from sglang.srt.sampling.penaltylib.repetition_penalty import apply_scaling_penalties  # noqa: F401
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rows.json"
        mp.start_processes(_worker, args=(tp, free_port(), cfg, str(out)), nprocs=tp, join=True,
                           start_method="fork")
        return json.loads(out.read_text())


def _table(rows: list[dict]) -> str:
    head = (f"{'vocab':>7} {'bs':>4} | {'MB in/rank AG':>13} {'A2A':>7} | {'ms AG':>7} {'A2A':>7} {'A2A/AG':>6}"
            f" | {'step stock':>10} {'sp+AG':>7} {'sp+A2A':>7}")
    if any("ms_stock_pen" in r for r in rows):
        head += f" | {'pen: stock':>10} {'sp+AG':>7} {'sp+A2A':>7}"
    lines = [head, "-" * len(head)]
    for r in rows:
        step = (f" | {r['ms_stock']:>10.3f} {r['ms_sp_gather']:>7.3f} {r['ms_sp_a2a']:>7.3f}"
                if "ms_stock" in r else "")
        if "ms_stock_pen" in r:
            step += f" | {r['ms_stock_pen']:>10.3f} {r['ms_sp_gather_pen']:>7.3f} {r['ms_sp_a2a_pen']:>7.3f}"
        lines.append(f"{r['vocab']:>7} {r['bs']:>4} | {r['bytes_in_all_gather'] / 1e6:>13.3f}"
                     f" {r['bytes_in_all_to_all'] / 1e6:>7.3f} | {r['ms_all_gather']:>7.3f} {r['ms_all_to_all']:>7.3f}"
                     f" {r['ms_all_to_all'] / r['ms_all_gather']:>6.2f}{step}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--vocabs", default="460,152064")
    ap.add_argument("--batch-sizes", default="1,32,128")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--step-iters", type=int, default=5, help="iterations of the whole step (0: exchange only)")
    ap.add_argument("--penalties", action="store_true", help="also whole steps with penalties + logit_bias")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    rows = run(a.tp, [int(v) for v in a.vocabs.split(",")], [int(b) for b in a.batch_sizes.split(",")],
               a.iters, a.dtype, a.step_iters, a.penalties)
    print(f"gloo, tp={a.tp}, {a.dtype}, median of {a.iters} exchanges / {a.step_iters} steps (slowest rank"
          " per iteration), ms per decode step")
    print(_table(rows))
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
