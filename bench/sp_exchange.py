"""Logits exchange per decode step on a gloo group: SGLang's all-gather vs Albireo's all-to-all.

    python -m bench.sp_exchange [--tp 2] [--vocabs 460,152064] [--batch-sizes 1,32,128]
                                [--iters 30] [--step-iters 5] [--dtype float32] [--penalties]
                                [--out runs/sp_exchange.json]

Forks --tp processes joined in a gloo group (what SGLang's TP group is on CPU) and, for every
(vocab, batch size), times one decode step's logits exchange as SGLang 0.5.23 does it on CPU
(`all_gather`) and as --parallel-sampling does it at tp > 1 (`all_to_all`), then the whole step
as served (exchange + sampling + token-id gather: `stock`, `sp_gather`, `sp_a2a`; with
--penalties also on a batch with penalties and logit_bias on every row). Prints a table and
writes its rows; bytes per rank are analytic, times the slowest rank's. What each arm runs and
how it is timed: docs/design/bench-micro.md. A figure for this box, not a test.
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

from branchwise.albireo import parallel_sampler as sampler
from branchwise.albireo.sp_sampler_hook import apply_row_transforms
from branchwise.tools.launch import free_port

WARMUP = 3
_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # SGLang's CPU call


def _all_gather(shard: torch.Tensor, tp_size: int) -> torch.Tensor:
    """GroupCoordinator.all_gather(x, dim=-1) as SGLang runs it on CPU (no shm kernel)."""
    batch_size, shard_vocab = shard.shape
    out = torch.empty((tp_size * batch_size, shard_vocab), dtype=shard.dtype)
    _GATHER(out, shard.contiguous())
    return (out.reshape(tp_size, batch_size, shard_vocab).movedim(0, 1)
            .reshape(batch_size, tp_size * shard_vocab))


def _a2a(shard: torch.Tensor, tp_size: int) -> torch.Tensor:
    return sampler.exchange_rows(shard, tp_size, lambda out, inp: dist.all_to_all_single(out, inp))


def _params(batch_size: int) -> sampler.RowParams:
    return sampler.RowParams.make(temperature=[0.8] * batch_size, top_p=[0.9] * batch_size,
                                  top_k=[50] * batch_size, seed=list(range(batch_size)),
                                  position=[100 + i for i in range(batch_size)])


def _penalties(batch_size: int, vocab: int) -> Any:
    """A forward's sampling_info penalty fields for batch_size rows that all have penalties and a bias."""
    from types import SimpleNamespace

    gen = torch.Generator().manual_seed(batch_size + 1)
    # frequency-like on ~2% of tokens
    add = -torch.rand(batch_size, vocab, generator=gen).lt_(0.02).float() * 1.5
    scale = 1 + torch.rand(batch_size, vocab, generator=gen).lt_(0.02).float() * 0.2  # repetition-like
    bias = torch.zeros(batch_size, vocab)
    bias[:, :8] = -30.0
    return SimpleNamespace(acc_additive_penalties=add, acc_scaling_penalties=scale, logit_bias=bias,
                           penalizer_orchestrator=None)


def _timed(fn: Callable[[], Any], iters: int, warmup: int = WARMUP) -> float:
    """Median over iters of the slowest rank's wall time, ms."""
    times = []
    for i in range(warmup + iters):
        dist.barrier()
        start = time.perf_counter()
        fn()
        took = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        dist.all_reduce(took, op=dist.ReduceOp.MAX)
        if i >= warmup:
            times.append(took.item() * 1e3)
    return statistics.median(times)


def _measure(rank: int, tp_size: int, vocab: int, batch_size: int, cfg: dict) -> dict:
    shard_vocab = -(-vocab // (64 * tp_size)) * 64  # ParallelLMHead pads the vocab; one shard per rank
    gen = torch.Generator().manual_seed(batch_size * 7 + vocab)
    full = torch.randn(batch_size, shard_vocab * tp_size, generator=gen).to(getattr(torch, cfg["dtype"]))
    shard = full[:, rank * shard_vocab : (rank + 1) * shard_vocab].contiguous()
    own = sampler.rows_per_rank(batch_size, tp_size)
    # the exchange itself, every configuration: my rows, bit-identical to the gathered ones
    want = full[rank * own : (rank + 1) * own]
    assert torch.equal(_a2a(shard, tp_size)[: want.shape[0]], want)
    assert torch.equal(_all_gather(shard, tp_size), full)
    elem, iters, params = full.element_size(), cfg["iters"], _params(batch_size)
    row = {"vocab": vocab, "vocab_padded": shard_vocab * tp_size, "bs": batch_size, "t": tp_size,
           "rows_per_rank": own, "elem_bytes": elem,
           "bytes_in_all_gather": (tp_size - 1) * batch_size * shard_vocab * elem,
           "bytes_in_all_to_all": (tp_size - 1) * own * shard_vocab * elem,
           "ms_all_gather": _timed(lambda: _all_gather(shard, tp_size), iters),
           "ms_all_to_all": _timed(lambda: _a2a(shard, tp_size), iters)}
    if cfg["steps"]:
        step_iters = cfg["step_iters"]
        row["ms_stock"] = _timed(
            lambda: sampler.sample_rows(_all_gather(shard, tp_size)[:, :vocab], params), step_iters, 1)
        row["ms_sp_gather"] = _timed(
            lambda: sampler.sp_sample_full(_all_gather(shard, tp_size)[:, :vocab], params), step_iters, 1)
        row["ms_sp_a2a"] = _timed(
            lambda: sampler.sample_own_rows(_a2a(shard, tp_size)[:, :vocab], params, batch_size),
            step_iters, 1)
    if cfg["steps"] and cfg["penalties"]:
        info = _penalties(batch_size, vocab)

        def full_rows() -> torch.Tensor:  # ModelRunner._preprocess_logits on the gathered rows
            logits = _all_gather(shard, tp_size)[:, :vocab]
            apply_row_transforms(info, logits, slice(0, batch_size))
            return logits

        def stock() -> torch.Tensor:
            return sampler.sample_rows(full_rows(), params)

        def sp_gather() -> torch.Tensor:
            return sampler.sp_sample_full(full_rows(), params)

        def sp_a2a() -> torch.Tensor:
            mine = _a2a(shard, tp_size)[:, :vocab]
            sampler.transform_own_rows(mine, batch_size, tp_size, rank,
                                       lambda logits, rows: apply_row_transforms(info, logits, rows))
            return sampler.sample_own_rows(mine, params, batch_size)

        want = stock()
        assert torch.equal(sp_gather(), want) and torch.equal(sp_a2a(), want)
        row["ms_stock_pen"] = _timed(stock, step_iters, 1)
        row["ms_sp_gather_pen"] = _timed(sp_gather, step_iters, 1)
        row["ms_sp_a2a_pen"] = _timed(sp_a2a, step_iters, 1)
    return row


def _worker(rank: int, tp_size: int, port: int, cfg: dict, out_path: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=tp_size,
                            timeout=timedelta(seconds=120))
    rows = [_measure(rank, tp_size, vocab, batch_size, cfg)
            for vocab in cfg["vocabs"] for batch_size in cfg["batch_sizes"]]
    if rank == 0:
        Path(out_path).write_text(json.dumps(rows))
    dist.barrier()
    dist.destroy_process_group()


def run(tp_size: int, vocabs: list[int], batch_sizes: list[int], iters: int, dtype: str, step_iters: int,
        penalties: bool = False) -> list[dict]:
    if tp_size < 2:
        raise ValueError("--tp must be at least 2 (there is nothing to exchange at tp=1)")
    cfg = {"vocabs": vocabs, "batch_sizes": batch_sizes, "iters": iters, "dtype": dtype,
           "steps": step_iters > 0, "step_iters": step_iters, "penalties": penalties}
    if penalties:  # import SGLang's scaling op once here, not in every forked rank; eager, as the CPU
        torch._dynamo.config.disable = True  # servers run it (branchwise.tools.launch: TORCHDYNAMO_DISABLE=1)
        from sglang.srt.sampling.penaltylib.repetition_penalty import apply_scaling_penalties  # noqa: F401
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rows.json"
        mp.start_processes(_worker, args=(tp_size, free_port(), cfg, str(out)), nprocs=tp_size, join=True,
                           start_method="fork")
        return json.loads(out.read_text())


def _table(rows: list[dict]) -> str:
    head = (f"{'vocab':>7} {'bs':>4} | {'MB in/rank AG':>13} {'A2A':>7} | {'ms AG':>7} {'A2A':>7}"
            f" {'A2A/AG':>6} | {'step stock':>10} {'sp+AG':>7} {'sp+A2A':>7}")
    if any("ms_stock_pen" in row for row in rows):
        head += f" | {'pen: stock':>10} {'sp+AG':>7} {'sp+A2A':>7}"
    lines = [head, "-" * len(head)]
    for row in rows:
        step = (f" | {row['ms_stock']:>10.3f} {row['ms_sp_gather']:>7.3f} {row['ms_sp_a2a']:>7.3f}"
                if "ms_stock" in row else "")
        if "ms_stock_pen" in row:
            step += (f" | {row['ms_stock_pen']:>10.3f} {row['ms_sp_gather_pen']:>7.3f}"
                     f" {row['ms_sp_a2a_pen']:>7.3f}")
        lines.append(f"{row['vocab']:>7} {row['bs']:>4} | {row['bytes_in_all_gather'] / 1e6:>13.3f}"
                     f" {row['bytes_in_all_to_all'] / 1e6:>7.3f} | {row['ms_all_gather']:>7.3f}"
                     f" {row['ms_all_to_all']:>7.3f}"
                     f" {row['ms_all_to_all'] / row['ms_all_gather']:>6.2f}{step}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--vocabs", default="460,152064")
    parser.add_argument("--batch-sizes", default="1,32,128")
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--step-iters", type=int, default=5,
                        help="iterations of the whole step (0: exchange only)")
    parser.add_argument("--penalties", action="store_true",
                        help="also whole steps with penalties + logit_bias")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    rows = run(args.tp, [int(vocab) for vocab in args.vocabs.split(",")],
               [int(size) for size in args.batch_sizes.split(",")], args.iters, args.dtype, args.step_iters,
               args.penalties)
    print(f"gloo, tp={args.tp}, {args.dtype}, median of {args.iters} exchanges / {args.step_iters} steps "
          "(slowest rank per iteration), ms per decode step")
    print(_table(rows))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
