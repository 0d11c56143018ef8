"""Sequence-parallel sampling (from Albireo) for SGLang's torch sampling path.

Stock SGLang all-gathers the vocab-sharded logits and every TP rank samples the whole batch.
Here each of the t ranks samples only its block of ceil(bs/t) rows and the token ids are
all-gathered, so the sampler's cost per rank drops by ~t:

    vocab-sharded [bs, V/t] --all_to_all_single--> batch-sharded [bs/t, V] --sample--> ids
    --all_gather--> [bs] on every rank

Sampling math mirrors SGLang 0.5.23 `Sampler.forward` (srt/layers/sampler.py): argmax when the
whole batch is greedy; else temperature, softmax, then `sampling_from_probs_torch` (no filters)
or `top_k_top_p_min_p_sampling_from_probs_torch`. With per-request seeds the noise is the
counter-based `multinomial_with_seed` (seeded_rng.py), so a row's token does not depend on which
rank samples it, and t = 1, 2, 4 ... give identical tokens. Deviations from stock, both needed for
that guarantee: the descending sort is stable (ties ordered by token id, whatever the batch
shape), and min-p works with seeds (stock asserts; Gumbel-max needs no renormalisation).
Without seeds each rank uses its own torch RNG: still one draw per row and consistent ids on all
ranks (they are gathered), just not reproducible across t.
"""

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.distributed as dist

from branchwise.albireo.seeded_rng import multinomial_with_seed

# In place on a row block's logits [k, V], given the block's batch rows (a slice of length k):
# what SGLang applies to full rows before sampling (penalties, logit_bias), restricted to the block.
RowTransform = Callable[[torch.Tensor, slice], None]

TOP_K_ALL = 1 << 30  # SGLang's "whole vocabulary" top_k (sampling_params.TOP_K_ALL)
_SAMPLING_EPS = 1e-6  # SamplingParams: temperature below this means greedy
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass(frozen=True)
class RowParams:
    """Per-row sampling parameters (SGLang's SamplingBatchInfo row tensors) + batch-wide switches.

    The switches must come from the FULL batch: SGLang picks the code path per batch (and with it
    the noise's column order: vocab id or sorted rank), so a row slice has to inherit them.
    """

    temperatures: torch.Tensor  # [n] float32, greedy rows already normalised to 1.0
    top_ps: torch.Tensor  # [n] float32
    top_ks: torch.Tensor  # [n] int32, TOP_K_ALL = no limit, 1 = greedy
    min_ps: torch.Tensor  # [n] float32
    seeds: torch.Tensor | None  # [n] int64 per-request seed; None = unseeded torch RNG
    positions: torch.Tensor | None  # [n] int64 token position, required with seeds
    all_greedy: bool
    need_top_k: bool
    need_top_p: bool
    need_min_p: bool

    @property
    def n(self) -> int:
        return self.top_ps.shape[0]

    @classmethod
    def make(
        cls,
        temperature: list[float],
        top_p: list[float] | None = None,
        top_k: list[int] | None = None,
        min_p: list[float] | None = None,
        seed: list[int] | None = None,
        position: list[int] | None = None,
        device: torch.device | str = "cpu",
    ) -> "RowParams":
        """From per-request values, normalised like SGLang's SamplingParams (temperature 0 -> greedy)."""
        n = len(temperature)
        top_p = top_p or [1.0] * n
        top_k = [TOP_K_ALL if k == -1 else k for k in top_k or [-1] * n]
        min_p = min_p or [0.0] * n
        greedy = [t < _SAMPLING_EPS for t in temperature]
        temps = [1.0 if g else t for g, t in zip(greedy, temperature, strict=True)]
        top_k = [1 if g else k for g, k in zip(greedy, top_k, strict=True)]

        def f32(v: list[float]) -> torch.Tensor:
            return torch.tensor(v, dtype=torch.float32, device=device)

        def i64(v: list[int] | None) -> torch.Tensor | None:
            return None if v is None else torch.tensor(v, dtype=torch.int64, device=device)

        return cls(
            temperatures=f32(temps),
            top_ps=f32(top_p),
            top_ks=torch.tensor(top_k, dtype=torch.int32, device=device),
            min_ps=f32(min_p),
            seeds=i64(seed),
            positions=i64(position),
            all_greedy=all(k <= 1 for k in top_k),
            need_top_k=any(k != TOP_K_ALL for k in top_k),
            need_top_p=any(p != 1.0 for p in top_p),
            need_min_p=any(p > 0 for p in min_p),
        )

    @classmethod
    def from_sampling_info(cls, info: Any, positions: torch.Tensor) -> "RowParams":
        """From SGLang's SamplingBatchInfo (duck-typed: no sglang import) and forward positions."""
        seeds = info.sampling_seed  # set only under --enable-deterministic-inference
        return cls(
            temperatures=info.temperatures.view(-1),
            top_ps=info.top_ps,
            top_ks=info.top_ks,
            min_ps=info.min_ps,
            seeds=seeds,
            positions=positions if seeds is not None else None,
            all_greedy=info.is_all_greedy,
            need_top_k=info.need_top_k_sampling,
            need_top_p=info.need_top_p_sampling,
            need_min_p=info.need_min_p_sampling,
        )

    def _map(self, fn: Any) -> "RowParams":
        vals = {f.name: getattr(self, f.name) for f in fields(self)}
        return RowParams(**{k: fn(k, v) if isinstance(v, torch.Tensor) else v for k, v in vals.items()})

    def rows(self, idx: slice | torch.Tensor) -> "RowParams":
        """A subset of rows (slice or index tensor); the batch-wide switches are kept."""
        return self._map(lambda _, v: v[idx])

    def to(self, device: torch.device | str) -> "RowParams":
        return self._map(lambda _, v: v.to(device))

    def padded(self, n: int) -> "RowParams":
        """Append n - self.n dummy greedy rows (they sample padding logits and are discarded)."""
        extra = n - self.n
        if extra <= 0:
            return self
        fill = {"temperatures": 1.0, "top_ps": 1.0, "top_ks": 1, "min_ps": 0.0, "seeds": 0, "positions": 0}
        return self._map(lambda k, v: torch.cat([v, v.new_full((extra,), fill[k])]))


def sample_rows(logits: torch.Tensor, p: RowParams) -> torch.Tensor:
    """[n, V] logits (penalties, logit_bias, grammar masks already applied) -> [n] token ids.

    int64 ids when the batch is all greedy, int32 otherwise, as SGLang returns. Does not modify
    `logits`.
    """
    assert logits.shape[0] == p.n, (logits.shape, p.n)
    if p.all_greedy:
        return torch.argmax(logits, -1)
    # SGLang divides in place (logits.div_): same rounding as dividing then casting back.
    x = torch.div(logits, p.temperatures.view(-1, 1)).to(logits.dtype)
    probs = torch.softmax(x, dim=-1)
    if p.need_top_k or p.need_top_p or p.need_min_p:
        return _sample_filtered(probs, p)
    return _sample_plain(probs, p)


def _sample_plain(probs: torch.Tensor, p: RowParams) -> torch.Tensor:
    """sampling_from_probs_torch: noise indexed by vocab id."""
    if p.seeds is None:  # SGLang's default Gumbel trick (SGLANG_OPT_USE_GUMBEL_SAMPLE)
        q = torch.empty_like(probs, dtype=torch.float32).exponential_(1.0)
        idx = (probs.float() / q.clamp_min_(torch.finfo(torch.float32).tiny)).argmax(-1)
    else:
        assert p.positions is not None, "seeded sampling needs positions"
        idx = multinomial_with_seed(torch.log(probs), p.seeds, p.positions)
    return idx.view(-1).to(torch.int32)


def _sample_filtered(probs: torch.Tensor, p: RowParams) -> torch.Tensor:
    """top_k_top_p_min_p_sampling_from_probs_torch: noise indexed by sorted rank."""
    probs_sort, probs_idx = probs.sort(dim=-1, descending=True, stable=True)
    probs_sum = torch.cumsum(probs_sort, dim=-1)
    rank = torch.arange(probs_sort.shape[-1], device=probs.device).view(1, -1)
    # SGLang assigns through boolean masks; masked_fill_ is the same without a host sync.
    probs_sort.masked_fill_(rank >= p.top_ks.view(-1, 1), 0.0)
    probs_sort.masked_fill_((probs_sum - probs_sort) > p.top_ps.view(-1, 1), 0.0)
    if p.need_min_p:
        probs_sort.masked_fill_(probs_sort < (probs_sort[:, 0] * p.min_ps).view(-1, 1), 0.0)
    if p.seeds is None:
        idx = torch.multinomial(probs_sort, num_samples=1)
    else:
        assert p.positions is not None, "seeded sampling needs positions"
        idx = multinomial_with_seed(probs_sort.to(torch.float64).log_(), p.seeds, p.positions)
    return torch.gather(probs_idx.to(torch.int32), 1, idx).view(-1)


def _group_info(group: dist.ProcessGroup | None) -> tuple[int, int]:
    if group is None and not (dist.is_available() and dist.is_initialized()):
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def rows_per_rank(bs: int, t: int) -> int:
    """Row block of each rank: bs padded up to a multiple of t (collectives want equal blocks)."""
    return -(-bs // t)


def own_rows(bs: int, t: int, rank: int) -> slice:
    """The batch rows `rank` samples: its block of rows_per_rank rows, less padding past bs (maybe empty)."""
    r = rows_per_rank(bs, t)
    return slice(min(rank * r, bs), min((rank + 1) * r, bs))


def transform_own_rows(mine: torch.Tensor, bs: int, t: int, rank: int, fn: RowTransform) -> None:
    """Apply `fn` to the real rows of my block [r, V] (padding rows are sampled, then discarded)."""
    rows = own_rows(bs, t, rank)
    if rows.stop > rows.start:
        fn(mine[: rows.stop - rows.start], rows)


def _pad_rows(x: torch.Tensor, n: int) -> torch.Tensor:
    return x if x.shape[0] == n else torch.cat([x, x.new_zeros((n - x.shape[0], *x.shape[1:]))])


def _gather_ids(ids: torch.Tensor, bs: int, t: int, group: dist.ProcessGroup | None) -> torch.Tensor:
    out = ids.new_empty((t * ids.shape[0],))
    _all_gather(out, ids.contiguous(), group=group)
    return out[:bs]


def exchange_rows(
    shard: torch.Tensor, t: int, a2a: Callable[[torch.Tensor, torch.Tensor], Any]
) -> torch.Tensor:
    """Vocab-sharded [bs, Vs] (every row, my columns) -> batch-sharded [r, t*Vs] (my rows, every column).

    The batch is padded to r*t rows (r = ceil(bs/t)); row block j is sent to rank j and block j of
    what arrives is rank j's columns of my rows, so the reassembly is SGLang's
    `_reassemble_tp_lm_head_all_to_all_output`. Each rank sends and receives bs*Vs*(t-1)/t values
    instead of the all-gather's bs*Vs*(t-1), and keeps r*t*Vs instead of bs*t*Vs.
    `a2a(out, inp)` is an `all_to_all_single` with equal splits over the TP group.
    """
    r = rows_per_rank(shard.shape[0], t)
    send = _pad_rows(shard, r * t).contiguous()
    recv = torch.empty_like(send)
    a2a(recv, send)
    return recv.view(t, r, -1).transpose(0, 1).reshape(r, -1)


def sample_own_rows(
    mine: torch.Tensor, p: RowParams, bs: int, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """My row block [r, V] of a bs-row batch (full-batch `p`) -> [bs] ids on every rank."""
    t, rank = _group_info(group)
    r = rows_per_rank(bs, t)
    assert mine.shape[0] == r, (mine.shape, bs, t)
    ids = sample_rows(mine, p.padded(r * t).rows(slice(rank * r, (rank + 1) * r)))
    return _gather_ids(ids, bs, t, group)


def sp_sample(
    shard: torch.Tensor,
    p: RowParams,
    vocab_size: int,
    group: dist.ProcessGroup | None = None,
    transform: RowTransform | None = None,
) -> torch.Tensor:
    """Albireo path: this rank's vocab shard [bs, Vpad/t] of the lm_head -> [bs] ids on every rank.

    Shards are contiguous column blocks in rank order (SGLang's ParallelLMHead layout); columns past
    `vocab_size` are padding and trimmed. `p` holds the FULL batch's rows (every TP rank has them).
    `transform` (penalties, bias) runs on each rank's own rows only, after the exchange.
    """
    t, rank = _group_info(group)
    bs = shard.shape[0]
    if t == 1 or bs == 0:
        logits = shard[:, :vocab_size]
        if transform is not None:
            logits = logits.clone()  # the caller's shard stays as it was, as on t > 1
            transform_own_rows(logits, bs, 1, 0, transform)
        return sample_rows(logits, p)
    mine = exchange_rows(shard, t, lambda out, inp: dist.all_to_all_single(out, inp, group=group))[:, :vocab_size]
    if transform is not None:
        transform_own_rows(mine, bs, t, rank, transform)
    return sample_own_rows(mine, p, bs, group)


def sp_sample_full(
    logits: torch.Tensor, p: RowParams, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Simpler path: logits already all-gathered ([bs, V] on every rank); sample own rows, gather ids."""
    t, rank = _group_info(group)
    bs = logits.shape[0]
    if t == 1 or bs == 0:
        return sample_rows(logits, p)
    r = rows_per_rank(bs, t)
    return sample_own_rows(_pad_rows(logits[rank * r : (rank + 1) * r], r), p, bs, group)
