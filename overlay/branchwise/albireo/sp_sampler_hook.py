"""--parallel-sampling: Albireo's sequence-parallel sampling inside SGLang's ModelRunner.sample.

Stock SGLang samples the whole batch on every TP rank after the logits all-gather.
With --parallel-sampling each rank samples only its block of rows and the token ids are
all-gathered (`parallel_sampler.sp_sample_full`), so the sampling work per rank drops by t.

Where it plugs in (AROUND ModelRunner.sample): SGLang's own pre-processing still runs on the full
gathered rows first (logit_bias, penalties, NaN sanitising), so those features keep their exact
semantics; only the sampler call is replaced. Rows are sampled with per-request seeds through the
counter-based `multinomial_with_seed` noise (bit-exact with SGLang's seeded sampler), so a row's
token does not depend on the rank that samples it or on the batch around it: outputs equal
single-rank sampling with the same seeds, at any TP degree, including tp=1. SGLang fills
`SamplingBatchInfo.sampling_seed` only under --enable-deterministic-inference; otherwise an AFTER
hook on `SamplingBatchInfo.from_schedule_batch` fills it, and SGLang's filter/merge keep it aligned
with the rows. A request's `sampling_seed` is used as given (same seed, same text, at any TP
degree). An unseeded request gets its own seed, `request_seed(nonce, rid)`: rids are unique per
request (SGLang gives each of the n samples of an `n > 1` request its own), so unseeded requests,
and the n samples of one, draw independently, as with SGLang's own sampler. The nonce is drawn on
TP rank 0 from --random-seed and broadcast once at start-up, so every rank (also on other nodes)
gives a row the same seed; with a fixed --random-seed a request with a fixed rid is reproducible.

Batches SP does not cover fall back to SGLang's sampler (logged once per reason): logprobs,
grammar, custom logit processors, watermarks, sampling observers/masks, speculative decoding.
On fallback the injected seeds are hidden, so the stock sampler behaves exactly as without
--parallel-sampling.

The logits exchange (Albireo's all-to-all, tp > 1): for a decode batch that SP covers, an AROUND on
ModelRunner.forward arms a plan and an AROUND on LogitsProcessor._get_logits swaps SGLang's logits
all-gatherer for the all-to-all (`parallel_sampler.exchange_rows`: vocab-sharded in, batch-sharded
out, batch padded to a multiple of t) for that one call. Each rank then holds full-vocab logits for
its ceil(bs/t) rows only and `around_sample` samples them and all-gathers the ids. Penalties and
logit_bias are applied to those rows only (`apply_row_transforms`: SGLang's own per-row tensors
sliced to the block, the same ops in the same order as SamplingBatchInfo.apply_logits_bias), so
each row gets exactly the floats it gets at tp=1. The penalizer state itself (orchestrator,
accumulators, cumulate_output_tokens on the gathered ids) stays SGLang's, full rows on every rank:
the sampler only reads it, so TAPER's sliced orchestrators (deferral.py) work unchanged. The choice
is a function of the batch (and of server settings), so every TP rank makes the same collective
call. Extend and input-logprob paths keep the all-gather. CUDA graphs: the hooks only run in eager
Python, so a graph captures SGLang's all-gather and its replays keep it (then the gathered rows are
sampled as before); the all-to-all runs for eager decode batches (all of them on CPU, or with
--disable-cuda-graph).

Where the state lives: `build` returns the scheduler's `SPState` (`scheduler.branchwise.sampler`)
and attaches it, as `_branchwise_sp`, to the objects the hooks receive: the model runner (forward,
sample), the model's LogitsProcessors (_get_logits; re-attached when a weight update replaces the
model) and the tree cache, which every ScheduleBatch references (from_schedule_batch). The exchange
plan is armed on the SPState for one ModelRunner.forward: forwards never run concurrently (with the
CPU forward thread they run in order on its worker, inline ones after draining it).
"""

from __future__ import annotations

import copy
import hashlib
import logging
import random
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from branchwise.albireo.parallel_sampler import (
    RowParams,
    exchange_rows,
    rows_per_rank,
    sample_own_rows,
    sample_rows,
    sp_sample_full,
    transform_own_rows,
)

logger = logging.getLogger("branchwise")


@dataclass(slots=True)
class SPState:
    tp_size: int
    tp_group: Any  # SGLang GroupCoordinator of the TP group
    inject_seeds: bool  # False under --enable-deterministic-inference: SGLang's seeds are used
    tp_rank: int = 0
    nonce: int = 0  # the same on every TP rank (broadcast at start-up): unseeded rows' seeds
    sp_steps: int = 0
    a2a_steps: int = 0  # decode steps whose logits came through the all-to-all
    a2a_transform_steps: int = 0  # ... of which penalties or logit_bias were applied to the row block
    fallbacks: dict[str, int] = field(default_factory=dict)  # stock sampler, by reason
    gathered: dict[str, int] = field(default_factory=dict)  # SP decode steps that kept the all-gather
    plan: ExchangePlan | None = None  # armed for the ModelRunner.forward in progress
    model: Any = None  # the model whose LogitsProcessors carry this state (tp > 1)

    @property
    def id_group(self) -> Any:
        """The group the sampled ids are gathered on: the forward's own (gloo on CPU), never cpu_group:
        with the CPU forward thread the sampler runs on the worker while the scheduler thread
        broadcasts requests on cpu_group."""
        return self.tp_group.device_group

    def report(self) -> dict[str, Any]:
        """`/server_info` internal_states[i]["branchwise_parallel_sampling"]."""
        return {"tp_size": self.tp_size, "sp_steps": self.sp_steps, "a2a_steps": self.a2a_steps,
                "a2a_transform_steps": self.a2a_transform_steps,
                "fallbacks": dict(self.fallbacks), "gathered": dict(self.gathered)}

    def fallback(self, reason: str) -> None:
        if reason not in self.fallbacks:
            logger.info("Branchwise parallel sampling: %s -> SGLang's sampler for such batches", reason)
        self.fallbacks[reason] = self.fallbacks.get(reason, 0) + 1

    def gather(self, reason: str) -> None:
        if reason not in self.gathered:
            logger.info("Branchwise parallel sampling: %s -> logits all-gathered for such batches", reason)
        self.gathered[reason] = self.gathered.get(reason, 0) + 1


@dataclass(slots=True)
class ExchangePlan:
    """One decode forward whose logits may come through the all-to-all."""

    bs: int
    done: bool = False  # the last _get_logits of this forward exchanged: logits are [rows_per_rank, V]


ATTR = "_branchwise_sp"  # on the model runner, its model's LogitsProcessors and the tree cache


def _attach_model(st: SPState, model: Any) -> None:
    """Give every LogitsProcessor of `model` the state (_get_logits receives only the processor)."""
    from sglang.srt.layers.logits_processor import LogitsProcessor

    for m in model.modules():
        if isinstance(m, LogitsProcessor):
            setattr(m, ATTR, st)
    st.model = model


def _unsupported_mode(scheduler: Any) -> str | None:
    if not scheduler.spec_algorithm.is_none():
        return "speculative decoding"
    if getattr(scheduler.server_args, "enable_dp_attention", False):
        return "DP attention"
    if getattr(scheduler.server_args, "rl_on_policy_target", None):
        return "RL on-policy sampling"
    if getattr(scheduler.server_args, "sampling_backend", None) == "ascend":
        return "the ascend sampling backend"
    return None


def _batch_reason(runner: Any, fb: Any) -> str | None:
    """Why this batch takes SGLang's sampler, from the batch alone (None: SP covers it)."""
    info = fb.sampling_info
    if fb.return_logprob:
        return "logprobs requested"
    if info.grammars is not None:
        return "grammar-constrained rows"
    if info.has_custom_logit_processor:
        return "custom logit processors"
    if runner.watermark_state is not None and info.has_watermark_candidates:
        return "watermarking"
    if runner.sampling_observer is not None and runner.sampling_observer.is_active(info):
        return "a sampling observer"
    if info.sampling_mask_batch_indices is not None:
        return "sampling masks requested"
    return None


def _fallback_reason(runner: Any, fb: Any, logits_output: Any) -> str | None:
    """Why this batch takes SGLang's sampler (None: SP covers it)."""
    if (why := _batch_reason(runner, fb)) is not None:
        return why
    if logits_output.next_token_logits is None:
        return "no next-token logits"
    n = logits_output.next_token_logits.shape[0]
    seeds = fb.sampling_info.sampling_seed
    if seeds is None or seeds.shape[0] != n:
        return "rows without seeds"
    return None


# Penalizers whose `_filter` accepts a row slice and whose `apply` is row-wise (sampling/penaltylib/*).
# Another (prepared) class keeps the all-gather: its apply may not be per row.
ROW_WISE_PENALIZERS = frozenset({"BatchedFrequencyPenalizer", "BatchedPresencePenalizer",
                                 "BatchedRepetitionPenalizer", "BatchedMinNewTokensPenalizer"})
UNKNOWN_PENALIZER = "a penalizer not known to be row-wise (applied to full rows)"


def _has_row_transforms(info: Any) -> bool:
    orch = info.penalizer_orchestrator
    return (info.logit_bias is not None or info.acc_additive_penalties is not None
            or info.acc_scaling_penalties is not None or (orch is not None and orch.is_required))


def _row_wise_penalizers(info: Any) -> bool:
    orch = info.penalizer_orchestrator
    return (orch is None or not orch.is_required
            or all(type(p).__name__ in ROW_WISE_PENALIZERS for p in orch.penalizers.values() if p.is_prepared()))


def _row_view(pen: Any, rows: slice) -> Any:
    """A shallow copy of a penalizer restricted to `rows`: stock `_filter` re-binds each per-row tensor
    to `t[rows]` (a view, no copy) on the copy; the original keeps its full rows for the scheduler."""
    view = copy.copy(pen)
    view._filter(keep_indices=rows)
    return view


def apply_row_transforms(info: Any, logits: torch.Tensor, rows: slice) -> None:
    """SamplingBatchInfo.apply_logits_bias for the batch rows `rows` only, whose logits are `logits`.

    Same tensors (sliced), same in-place ops, same order as stock on the full [bs, V] logits, so each
    row's floats are bit-identical: accumulated additive penalties, scaling penalties, the penalizers
    themselves (non-overlap style, orchestrator present), then logit_bias. No grammar mask: grammar
    batches are not covered.
    """
    if info.acc_additive_penalties is not None:
        logits.add_(info.acc_additive_penalties[rows])
    if info.acc_scaling_penalties is not None:
        from sglang.srt.sampling.penaltylib.repetition_penalty import apply_scaling_penalties

        apply_scaling_penalties(logits, info.acc_scaling_penalties[rows])
    orch = info.penalizer_orchestrator
    if orch is not None and orch.is_required:
        for pen in orch.penalizers.values():  # the orchestrator's order, as its apply()
            if pen.is_prepared():
                _row_view(pen, rows).apply(logits)
    if info.logit_bias is not None:
        logits.add_(info.logit_bias[rows])


def _gather_reason(runner: Any, fb: Any) -> str | None:
    """Why this decode batch keeps the logits all-gather (None: the all-to-all). Batch-only, so every
    TP rank decides the same; it must imply `_fallback_reason(...) is None` at sample time."""
    info = fb.sampling_info
    if info is None:
        return "no sampling info"
    if (why := _batch_reason(runner, fb)) is not None:
        return why  # counted as a fallback when the batch is sampled
    if not _row_wise_penalizers(info):
        return UNKNOWN_PENALIZER
    bs = fb.batch_size
    if info.temperatures.shape[0] != bs or info.sampling_seed is None or info.sampling_seed.shape[0] != bs:
        return "rows without sampling params or seeds"
    return None


def _positions(fb: Any) -> torch.Tensor:
    # As ModelRunner.sample: decode rows use their position, prefill rows their last token's.
    return fb.positions if fb.forward_mode.is_decode() else fb.seq_lens - 1


def request_seed(nonce: int, rid: Any) -> int:
    """An unseeded request's seed: a keyed hash of its rid, as a signed int64 (SGLang's seed dtype)."""
    h = hashlib.blake2b(str(rid).encode(), digest_size=8, key=(nonce & (2**64 - 1)).to_bytes(8, "little"))
    return int.from_bytes(h.digest(), "little", signed=True)


def shared_nonce(random_seed: int | None, tp_size: int, tp_group: Any) -> int:
    """Rank 0's nonce (from --random-seed) on every TP rank: a gloo broadcast on the CPU group,
    once, at start-up, where every rank runs this hook in the same order."""
    seed = random_seed if random_seed is not None else random.SystemRandom().getrandbits(62)
    nonce = random.Random(f"branchwise-sp-{seed}").getrandbits(63)
    if tp_size == 1:
        return nonce
    t = torch.tensor([nonce], dtype=torch.int64)
    dist.broadcast(t, src=tp_group.ranks[0], group=tp_group.cpu_group)
    return int(t.item())


# ---------------------------------------------------------------- hook bodies (targets in plugin.py)

def build(scheduler: Any, config: Any) -> SPState | None:
    """The scheduler's --parallel-sampling component (None when off or unsupported here)."""
    from sglang.srt.runtime_context import get_parallel

    if not config.parallel_sampling:
        return None
    if (why := _unsupported_mode(scheduler)) is not None:
        logger.warning("Branchwise parallel sampling off: not supported with %s", why)
        return None
    par = get_parallel()
    args = scheduler.server_args
    det = bool(getattr(args, "enable_deterministic_inference", False))
    st = SPState(tp_size=par.tp_size, tp_group=par.tp_group, inject_seeds=not det,
                 tp_rank=par.tp_group.rank_in_group,
                 nonce=shared_nonce(getattr(args, "random_seed", None), par.tp_size, par.tp_group))
    logger.info("Branchwise parallel sampling on: %d rank(s), per-request seeds%s%s",
                par.tp_size, " (unseeded: from the rid)" if st.inject_seeds else " from SGLang",
                ", decode logits exchanged with an all-to-all" if par.tp_size > 1 else "")
    if par.tp_size > 1 and args.device == "cuda" and not getattr(args, "disable_cuda_graph", False):
        logger.warning("Branchwise parallel sampling: decode batches replayed from CUDA graphs keep "
                       "SGLang's captured logits all-gather (rows still sampled in parallel); the "
                       "all-to-all runs only for eager decode batches (--disable-cuda-graph for all)")
    runner = scheduler.tp_worker.model_runner
    setattr(runner, ATTR, st)
    setattr(scheduler.tree_cache, ATTR, st)
    if par.tp_size > 1:
        _attach_model(st, runner.model)
    return st


def after_from_schedule_batch(info: Any, cls: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
    """SamplingBatchInfo.from_schedule_batch: give every row its request's seed (unseeded: request_seed)."""
    st = getattr(batch.tree_cache, ATTR, None) if batch is not None else None
    if st is not None and st.inject_seeds and info.sampling_seed is None:
        seeds = [s if (s := r.sampling_params.sampling_seed) is not None else request_seed(st.nonce, r.rid)
                 for r in batch.reqs]
        info.sampling_seed = torch.tensor(seeds, dtype=torch.int64).to(info.temperatures.device)
    return info


class _AllToAll:
    """Stands in for LogitsProcessor._logits_gatherer during one decode _get_logits call."""

    __slots__ = ("group", "t", "called")

    def __init__(self, group: Any, t: int) -> None:
        self.group, self.t, self.called = group, t, False

    def __call__(self, shard: torch.Tensor) -> torch.Tensor:
        self.called = True
        return exchange_rows(shard, self.t, self._a2a)

    def _a2a(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        if inp.device.type == "cpu":  # SGLang's registered op has no CPU kernel; its all-gather uses gloo too
            dist.all_to_all_single(out, inp, group=self.group.device_group)
        else:  # pynccl or NCCL, as SGLang's own _tp_lm_head_all_to_all
            self.group.all_to_all_single(out, inp)


def around_forward(orig: Any, runner: Any, fb: Any, *args: Any, **kwargs: Any) -> Any:
    """ModelRunner.forward: arm the all-to-all for a covered decode batch; tag fb with the outcome."""
    st = getattr(runner, ATTR, None)
    if st is None or st.tp_size == 1 or not fb.forward_mode.is_decode():
        return orig(runner, fb, *args, **kwargs)
    if (why := _gather_reason(runner, fb)) is not None:
        if why in (UNKNOWN_PENALIZER, "rows without sampling params or seeds"):  # others: fallbacks
            st.gather(why)
        fb._branchwise_sp_exchange = None
        return orig(runner, fb, *args, **kwargs)
    if runner.model is not st.model:  # a weight update replaced the model
        _attach_model(st, runner.model)
    plan = st.plan = ExchangePlan(bs=fb.batch_size)
    try:
        out = orig(runner, fb, *args, **kwargs)
    finally:
        st.plan = None
    fb._branchwise_sp_exchange = plan if plan.done else None
    if not plan.done:
        st.gather("CUDA graph replay" if getattr(out, "can_run_graph", False) else "all-gather kept in the model")
    return out


def around_get_logits(orig: Any, lp: Any, hidden_states: Any, lm_head: Any, metadata: Any,
                      *args: Any, **kwargs: Any) -> Any:
    """LogitsProcessor._get_logits: the all-to-all instead of the all-gather, when armed."""
    st = lp.__dict__.get(ATTR)  # not getattr: a miss on an nn.Module raises inside Module.__getattr__
    plan = st.plan if st is not None else None
    if plan is None:
        return orig(lp, hidden_states, lm_head, metadata, *args, **kwargs)
    plan.done = False  # the last call of the forward decides what the sampler gets
    if (not lp.do_tensor_parallel_all_gather or lp.use_attn_tp_group
            or lp.do_tensor_parallel_all_gather_dp_attn or not metadata.forward_mode.is_decode()
            or hidden_states.shape[0] != plan.bs):
        return orig(lp, hidden_states, lm_head, metadata, *args, **kwargs)
    stock, a2a = lp._logits_gatherer, _AllToAll(st.tp_group, st.tp_size)
    lp._logits_gatherer = a2a
    try:
        logits = orig(lp, hidden_states, lm_head, metadata, *args, **kwargs)
    finally:
        lp._logits_gatherer = stock
    plan.done = a2a.called
    return logits


def around_sample(orig: Any, runner: Any, logits_output: Any, fb: Any, *args: Any, **kwargs: Any) -> Any:
    st = getattr(runner, ATTR, None)
    if st is None:
        return orig(runner, logits_output, fb, *args, **kwargs)
    info = fb.sampling_info
    plan: ExchangePlan | None = getattr(fb, "_branchwise_sp_exchange", None)
    if plan is not None:  # next_token_logits holds my block of rows only
        logits_output.auxiliary_device_output = None
        logits = logits_output.next_token_logits
        assert logits.shape[0] == rows_per_rank(plan.bs, st.tp_size), (logits.shape, plan.bs)
        if _has_row_transforms(info):  # ModelRunner._preprocess_logits, on my rows
            transform_own_rows(logits, plan.bs, st.tp_size, st.tp_rank,
                               lambda x, rows: apply_row_transforms(info, x, rows))
            st.a2a_transform_steps += 1
        logits = runner.sampler._preprocess_logits(logits, info)  # NaN sanitising
        p = RowParams.from_sampling_info(info, _positions(fb))
        ids = sample_own_rows(logits, p, plan.bs, st.id_group)
        runner.ngram_embedding_manager.update_after_decode(next_token_ids=ids, forward_batch=fb)
        st.sp_steps += 1
        st.a2a_steps += 1
        return ids
    reason = _fallback_reason(runner, fb, logits_output)
    if reason is not None:
        st.fallback(reason)
        if not st.inject_seeds:
            return orig(runner, logits_output, fb, *args, **kwargs)
        seeds, info.sampling_seed = info.sampling_seed, None  # stock sampling, as without the flag
        try:
            return orig(runner, logits_output, fb, *args, **kwargs)
        finally:
            info.sampling_seed = seeds
    # ModelRunner.sample up to the sampler call: bias, penalties (grammar/watermark/observer excluded)
    logits_output.auxiliary_device_output = None
    runner._preprocess_logits(logits_output, info)
    logits = runner.sampler._preprocess_logits(logits_output.next_token_logits, info)  # NaN sanitising
    p = RowParams.from_sampling_info(info, _positions(fb))
    ids = sp_sample_full(logits, p, st.id_group) if st.tp_size > 1 else sample_rows(logits, p)
    runner.ngram_embedding_manager.update_after_decode(next_token_ids=ids, forward_batch=fb)
    st.sp_steps += 1
    return ids
