"""Sequence-parallel sampling (Albireo) for SGLang's torch sampling path; no SGLang import.
Design: docs/design/albireo-parallel-sampling.md."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from branchwise.albireo.seeded_rng import multinomial_with_seed

if TYPE_CHECKING:
    from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo

# In place on a row block's logits [k, V], given the block's batch rows (a slice of length k):
# what SGLang applies to full rows before sampling (penalties, logit_bias), restricted to the block.
RowTransform = Callable[[torch.Tensor, slice], None]

TOP_K_ALL = 1 << 30  # SGLang's "whole vocabulary" top_k (sampling_params.TOP_K_ALL)
_SAMPLING_EPS = 1e-6  # SamplingParams: temperature below this means greedy
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass(frozen=True)
class RowParams:
    """Per-row sampling parameters (SGLang's SamplingBatchInfo row tensors) + batch-wide switches."""

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
    ) -> RowParams:
        """From per-request values, normalised like SGLang's SamplingParams (temperature 0 -> greedy)."""
        rows = len(temperature)
        top_p = top_p or [1.0] * rows
        top_k = [TOP_K_ALL if k == -1 else k for k in top_k or [-1] * rows]
        min_p = min_p or [0.0] * rows
        greedy = [temp < _SAMPLING_EPS for temp in temperature]
        temps = [1.0 if is_greedy else temp for is_greedy, temp in zip(greedy, temperature, strict=True)]
        top_k = [1 if is_greedy else k for is_greedy, k in zip(greedy, top_k, strict=True)]

        def f32(values: list[float]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.float32, device=device)

        def i64(values: list[int] | None) -> torch.Tensor | None:
            return None if values is None else torch.tensor(values, dtype=torch.int64, device=device)

        return cls(
            temperatures=f32(temps),
            top_ps=f32(top_p),
            top_ks=torch.tensor(top_k, dtype=torch.int32, device=device),
            min_ps=f32(min_p),
            seeds=i64(seed),
            positions=i64(position),
            all_greedy=all(k <= 1 for k in top_k),
            need_top_k=any(k != TOP_K_ALL for k in top_k),
            need_top_p=any(prob != 1.0 for prob in top_p),
            need_min_p=any(prob > 0 for prob in min_p),
        )

    @classmethod
    def from_sampling_info(cls, info: SamplingBatchInfo, positions: torch.Tensor) -> RowParams:
        """From SGLang's SamplingBatchInfo (read by attribute: no sglang import) and forward positions."""
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

    def _map(self, fn: Callable[[str, torch.Tensor], torch.Tensor]) -> RowParams:
        """A copy with `fn(field name, tensor)` applied to every tensor field."""
        values = {fld.name: getattr(self, fld.name) for fld in fields(self)}
        return RowParams(**{name: fn(name, value) if isinstance(value, torch.Tensor) else value
                            for name, value in values.items()})

    def rows(self, index: slice | torch.Tensor) -> RowParams:
        """A subset of rows (slice or index tensor); the batch-wide switches are kept."""
        return self._map(lambda _, tensor: tensor[index])

    def to(self, device: torch.device | str) -> RowParams:
        return self._map(lambda _, tensor: tensor.to(device))

    def padded(self, rows: int) -> RowParams:
        """Append rows - self.n dummy greedy rows (they sample padding logits and are discarded)."""
        extra = rows - self.n
        if extra <= 0:
            return self
        fill = {"temperatures": 1.0, "top_ps": 1.0, "top_ks": 1, "min_ps": 0.0, "seeds": 0, "positions": 0}
        return self._map(lambda name, tensor: torch.cat([tensor, tensor.new_full((extra,), fill[name])]))


def sample_rows(logits: torch.Tensor, params: RowParams) -> torch.Tensor:
    """[n, V] logits (penalties, logit_bias, grammar masks already applied) -> [n] token ids."""
    assert logits.shape[0] == params.n, (logits.shape, params.n)
    if params.all_greedy:
        return torch.argmax(logits, -1)
    # SGLang divides in place (logits.div_): same rounding as dividing then casting back.
    scaled = torch.div(logits, params.temperatures.view(-1, 1)).to(logits.dtype)
    probs = torch.softmax(scaled, dim=-1)
    if params.need_top_k or params.need_top_p or params.need_min_p:
        return _sample_filtered(probs, params)
    return _sample_plain(probs, params)


def _sample_plain(probs: torch.Tensor, params: RowParams) -> torch.Tensor:
    """sampling_from_probs_torch: noise indexed by vocab id."""
    if params.seeds is None:  # SGLang's default Gumbel trick (SGLANG_OPT_USE_GUMBEL_SAMPLE)
        noise = torch.empty_like(probs, dtype=torch.float32).exponential_(1.0)
        ids = (probs.float() / noise.clamp_min_(torch.finfo(torch.float32).tiny)).argmax(-1)
    else:
        assert params.positions is not None, "seeded sampling needs positions"
        ids = multinomial_with_seed(torch.log(probs), params.seeds, params.positions)
    return ids.view(-1).to(torch.int32)


def _sample_filtered(probs: torch.Tensor, params: RowParams) -> torch.Tensor:
    """top_k_top_p_min_p_sampling_from_probs_torch: noise indexed by sorted rank."""
    # stable, unlike stock: ties ordered by token id whatever the batch shape (rank-independent noise)
    probs_sort, probs_idx = probs.sort(dim=-1, descending=True, stable=True)
    probs_sum = torch.cumsum(probs_sort, dim=-1)
    rank = torch.arange(probs_sort.shape[-1], device=probs.device).view(1, -1)
    # SGLang assigns through boolean masks; masked_fill_ is the same without a host sync.
    probs_sort.masked_fill_(rank >= params.top_ks.view(-1, 1), 0.0)
    probs_sort.masked_fill_((probs_sum - probs_sort) > params.top_ps.view(-1, 1), 0.0)
    if params.need_min_p:  # with seeds too (stock asserts): Gumbel-max needs no renormalisation
        probs_sort.masked_fill_(probs_sort < (probs_sort[:, 0] * params.min_ps).view(-1, 1), 0.0)
    if params.seeds is None:
        picked = torch.multinomial(probs_sort, num_samples=1)
    else:
        assert params.positions is not None, "seeded sampling needs positions"
        picked = multinomial_with_seed(probs_sort.to(torch.float64).log_(), params.seeds, params.positions)
    return torch.gather(probs_idx.to(torch.int32), 1, picked).view(-1)


def _group_info(group: dist.ProcessGroup | None) -> tuple[int, int]:
    if group is None and not (dist.is_available() and dist.is_initialized()):
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def rows_per_rank(batch_size: int, tp_size: int) -> int:
    """Row block of each rank: the batch padded up to a multiple of tp_size (collectives want equal
    blocks)."""
    return -(-batch_size // tp_size)


def own_rows(batch_size: int, tp_size: int, rank: int) -> slice:
    """The batch rows `rank` samples: its block of rows_per_rank rows, less padding past the batch
    (maybe empty)."""
    block = rows_per_rank(batch_size, tp_size)
    return slice(min(rank * block, batch_size), min((rank + 1) * block, batch_size))


def transform_own_rows(mine: torch.Tensor, batch_size: int, tp_size: int, rank: int,
                       transform: RowTransform) -> None:
    """Apply `transform` to the real rows of my block [r, V] (padding rows are sampled, then discarded)."""
    rows = own_rows(batch_size, tp_size, rank)
    if rows.stop > rows.start:
        transform(mine[: rows.stop - rows.start], rows)


def _pad_rows(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    if tensor.shape[0] == rows:
        return tensor
    return torch.cat([tensor, tensor.new_zeros((rows - tensor.shape[0], *tensor.shape[1:]))])


def _gather_ids(ids: torch.Tensor, batch_size: int, tp_size: int,
                group: dist.ProcessGroup | None) -> torch.Tensor:
    out = ids.new_empty((tp_size * ids.shape[0],))
    _all_gather(out, ids.contiguous(), group=group)
    return out[:batch_size]


AllToAll = Callable[[torch.Tensor, torch.Tensor], object]  # all_to_all_single(out, inp), equal splits


def exchange_rows(shard: torch.Tensor, tp_size: int, all_to_all: AllToAll) -> torch.Tensor:
    """Vocab-sharded [bs, Vs] (every row, my columns) -> batch-sharded [r, t*Vs] (my rows, every column)."""
    block = rows_per_rank(shard.shape[0], tp_size)
    send = _pad_rows(shard, block * tp_size).contiguous()
    recv = torch.empty_like(send)
    all_to_all(recv, send)
    return recv.view(tp_size, block, -1).transpose(0, 1).reshape(block, -1)


def sample_own_rows(mine: torch.Tensor, params: RowParams, batch_size: int,
                    group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """My row block [r, V] of a batch (full-batch `params`) -> [batch_size] ids on every rank."""
    tp_size, rank = _group_info(group)
    block = rows_per_rank(batch_size, tp_size)
    assert mine.shape[0] == block, (mine.shape, batch_size, tp_size)
    ids = sample_rows(mine, params.padded(block * tp_size).rows(slice(rank * block, (rank + 1) * block)))
    return _gather_ids(ids, batch_size, tp_size, group)


def sp_sample(
    shard: torch.Tensor,
    params: RowParams,
    vocab_size: int,
    group: dist.ProcessGroup | None = None,
    transform: RowTransform | None = None,
) -> torch.Tensor:
    """Albireo path: this rank's vocab shard [bs, Vpad/t] of the lm_head -> [bs] ids on every rank."""
    tp_size, rank = _group_info(group)
    batch_size = shard.shape[0]
    if tp_size == 1 or batch_size == 0:
        logits = shard[:, :vocab_size]
        if transform is not None:
            logits = logits.clone()  # the caller's shard stays as it was, as on t > 1
            transform_own_rows(logits, batch_size, 1, 0, transform)
        return sample_rows(logits, params)
    mine = exchange_rows(shard, tp_size,
                         lambda out, inp: dist.all_to_all_single(out, inp, group=group))[:, :vocab_size]
    if transform is not None:
        transform_own_rows(mine, batch_size, tp_size, rank, transform)
    return sample_own_rows(mine, params, batch_size, group)


def sp_sample_full(logits: torch.Tensor, params: RowParams,
                   group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Simpler path: logits already all-gathered ([bs, V] on every rank); sample own rows, gather ids."""
    tp_size, rank = _group_info(group)
    batch_size = logits.shape[0]
    if tp_size == 1 or batch_size == 0:
        return sample_rows(logits, params)
    block = rows_per_rank(batch_size, tp_size)
    return sample_own_rows(_pad_rows(logits[rank * block : (rank + 1) * block], block),
                           params, batch_size, group)
