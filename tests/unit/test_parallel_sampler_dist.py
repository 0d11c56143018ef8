"""sp_sample over real gloo process groups: t = 1, 2, 4 give the same tokens as one process,
also with row-wise penalties/bias applied to each rank's own rows after the exchange.

One start of 4 processes serves every case: the world group is t = 4, two disjoint pairs are t = 2.
Each rank writes its ids to a file; the parent compares. Fork, not spawn: spawned children re-import
torch (4 x ~3 s of CPU, 30 s+ on a busy 2-core box); forked ones start in ~0.1 s. Children run
torch single-threaded (set_num_threads(1)), so the parent's OpenMP pool is never re-entered.
"""

import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from branchwise.albireo.parallel_sampler import RowParams, sample_rows, sp_sample, sp_sample_full
from branchwise.tools.launch import free_port

WORLD = 4
# (name, bs, vocab, row kinds): bs and vocab not multiples of t; bs = 3 leaves a t=4 rank only padding.
CASES = [
    ("mixed7", 7, 1001, "gtkpm"),
    ("mixed13", 13, 997, "tkpmg"),
    ("greedy5", 5, 1001, "g"),
    ("plain9", 9, 997, "t"),
    ("tiny3", 3, 1001, "pt"),
]


def _case(bs: int, vocab: int, kinds: str, seed: int) -> tuple[torch.Tensor, RowParams]:
    """Same tensors in every process. Logits padded to a multiple of 8 with huge junk columns."""
    g = torch.Generator().manual_seed(seed)
    vpad = -(-vocab // 8) * 8
    logits = torch.cat([torch.randn(bs, vocab, generator=g) * 2.5, torch.full((bs, vpad - vocab), 1e4)], 1)
    rows = [kinds[i % len(kinds)] for i in range(bs)]
    p = RowParams.make(
        temperature=[0.0 if r == "g" else 0.6 + 0.1 * (i % 5) for i, r in enumerate(rows)],
        top_p=[0.7 if r == "p" else 1.0 for r in rows],
        top_k=[2 + i % 6 if r == "k" else -1 for i, r in enumerate(rows)],
        min_p=[0.1 if r == "m" else 0.0 for r in rows],
        seed=[seed * 100 + i for i in range(bs)],
        position=[5 + 11 * i for i in range(bs)],
    )
    return logits, p


def _transform(bs: int, vocab: int, seed: int):
    """Row-wise penalties + bias as SGLang's forward applies them (accumulated additive, scaling, bias):
    each rank applies them to its own rows only, after the exchange."""
    g = torch.Generator().manual_seed(1000 + seed)
    add = -torch.rand(bs, vocab, generator=g).mul_(4).round_()  # frequency/presence-like steps
    add[::3, 0] = float("-inf")  # min_new_tokens masks a stop token
    scale = 1 + torch.rand(bs, vocab, generator=g).lt_(0.2) * 0.3  # repetition penalty on some tokens
    bias = torch.zeros(bs, vocab)
    bias[1::2, 7] = 25.0

    def fn(x: torch.Tensor, rows: slice) -> None:
        x.add_(add[rows])
        x[:] = torch.where(x < 0, x * scale[rows], x / scale[rows])
        x.add_(bias[rows])

    return fn


def _shard(logits: torch.Tensor, t: int, rank: int) -> torch.Tensor:
    vs = logits.shape[1] // t
    return logits[:, rank * vs : (rank + 1) * vs].contiguous()


def _worker(rank: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=WORLD,
        timeout=timedelta(seconds=30),
    )
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates every group
    groups = {4: (None, rank), 2: (pairs[rank // 2], rank % 2)}
    results = {}
    for i, (name, bs, vocab, kinds) in enumerate(CASES):
        logits, p = _case(bs, vocab, kinds, seed=i)
        for t, (group, grank) in groups.items():
            results[(name, t, "a2a")] = sp_sample(_shard(logits, t, grank), p, vocab, group)
            results[(name, t, "full")] = sp_sample_full(logits[:, :vocab], p, group)
            fn = _transform(bs, vocab, i)
            results[(name, t, "a2a+penalties")] = sp_sample(_shard(logits, t, grank), p, vocab, group, fn)
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


def test_sp_sample_same_tokens_for_t_1_2_4(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # for anything the children exec
    ctx = mp.start_processes(
        _worker, args=(free_port(), str(tmp_path)), nprocs=WORLD, join=False, start_method="fork"
    )
    deadline = time.monotonic() + 90
    try:
        while not ctx.join(timeout=1):
            assert time.monotonic() < deadline, "gloo workers hung"
    finally:
        for proc in ctx.processes:
            if proc.is_alive():
                proc.kill()
    per_rank = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    for i, (name, bs, vocab, kinds) in enumerate(CASES):
        logits, p = _case(bs, vocab, kinds, seed=i)
        want = sample_rows(logits[:, :vocab], p)
        assert torch.equal(sp_sample(logits, p, vocab), want)  # t = 1, no process group
        assert int(want.max()) < vocab
        penalised = logits[:, :vocab].clone()
        _transform(bs, vocab, i)(penalised, slice(0, bs))
        want_pen = sample_rows(penalised, p)
        kept = logits.clone()
        assert torch.equal(sp_sample(logits, p, vocab, transform=_transform(bs, vocab, i)), want_pen)
        assert torch.equal(logits, kept)  # t = 1 leaves the caller's logits alone
        if kinds != "g":  # the bias moves sampled rows (greedy rows may already pick the same id)
            assert not torch.equal(want_pen, want), name
        for res in per_rank:
            for t in (2, 4):
                for how in ("a2a", "full", "a2a+penalties"):
                    w = want_pen if how == "a2a+penalties" else want
                    got = res[(name, t, how)]
                    assert got.dtype == w.dtype and torch.equal(got, w), (name, t, how, got, w)
