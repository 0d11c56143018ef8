"""--parallel-sampling (Albireo): sequence-parallel sampling (docs/design/albireo-parallel-sampling.md)."""

from __future__ import annotations

import copy
import hashlib
import logging
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

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
from branchwise.hostcopy import to_device

if TYPE_CHECKING:
    from sglang.srt.distributed.parallel_state import GroupCoordinator
    from sglang.srt.layers.logits_processor import LogitsMetadata, LogitsProcessor, LogitsProcessorOutput
    from sglang.srt.layers.vocab_parallel_embedding import VocabParallelEmbedding
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.sampling.penaltylib.orchestrator import _BatchedPenalizer
    from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo

    from branchwise.config import BranchwiseConfig

Hook = Callable[..., Any]  # the hooked SGLang function an AROUND body wraps
logger = logging.getLogger("branchwise")


@dataclass(slots=True)
class SPState:
    """Per-scheduler state of --parallel-sampling: the TP group, the seed nonce, the armed plan, stats."""

    tp_size: int
    tp_group: GroupCoordinator | None  # SGLang's coordinator of the TP group (None: tp = 1 in tests)
    inject_seeds: bool  # False under --enable-deterministic-inference: SGLang's seeds are used
    tp_rank: int = 0
    nonce: int = 0  # the same on every TP rank (broadcast at start-up): unseeded rows' seeds
    sp_steps: int = 0
    a2a_steps: int = 0  # decode steps whose logits came through the all-to-all
    a2a_transform_steps: int = 0  # ... of which penalties or logit_bias were applied to the row block
    fallbacks: dict[str, int] = field(default_factory=dict)  # stock sampler, by reason
    gathered: dict[str, int] = field(default_factory=dict)  # SP decode steps that kept the all-gather
    plan: ExchangePlan | None = None  # armed for the ModelRunner.forward in progress
    model: torch.nn.Module | None = None  # the model whose LogitsProcessors carry this state (tp > 1)

    @property
    def id_group(self) -> dist.ProcessGroup:
        """The group sampled ids gather on: the forward's own, never cpu_group (code-notes.md)."""
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

    batch_size: int
    done: bool = False  # the last _get_logits of this forward exchanged: logits are [rows_per_rank, V]


ATTR = "_branchwise_sp"  # on the model runner, its model's LogitsProcessors and the tree cache


def _attach_model(state: SPState, model: torch.nn.Module) -> None:
    """Give every LogitsProcessor of `model` the state (_get_logits receives only the processor)."""
    from sglang.srt.layers.logits_processor import LogitsProcessor

    for module in model.modules():
        if isinstance(module, LogitsProcessor):
            setattr(module, ATTR, state)
    state.model = model


def _unsupported_mode(scheduler: Scheduler) -> str | None:
    """Modes SP does not cover (refused in support.py); a guard: build stops a scheduler that gets here."""
    from sglang.srt.runtime_context import get_parallel

    if not scheduler.spec_algorithm.is_none():
        return "speculative decoding"
    if scheduler.disaggregation_mode.name != "NULL":
        return "PD disaggregation"
    if getattr(scheduler, "enable_pdmux", False):
        return "PD multiplexing"
    if get_parallel().pp_size > 1:
        return "pipeline parallelism"
    if scheduler.require_mlp_sync:  # attention DP (--attn-dp-size), MoE all-to-all, dense-TP MLP
        return "attention DP or batches synced across ranks"
    if getattr(scheduler.server_args, "rl_on_policy_target", None):
        return "RL on-policy sampling"
    if getattr(scheduler.server_args, "sampling_backend", None) == "ascend":
        return "the ascend sampling backend"
    return _graph_reason(str(scheduler.device))


def _graph_reason(device: str) -> str | None:
    """Decode batches replayed from CUDA graphs keep SGLang's captured logits all-gather."""
    from sglang.srt.model_executor.cuda_graph_config import Backend
    from sglang.srt.runtime_context import get_exec, get_parallel

    graphs = get_exec().graph.cuda_graph_config
    if (device.startswith("cuda") and get_parallel().tp_size > 1 and graphs is not None
            and graphs.decode.backend != Backend.DISABLED):
        return "decode CUDA graphs at TP > 1 (add --cuda-graph-backend-decode=disabled)"
    return None


def _batch_reason(runner: ModelRunner, forward_batch: ForwardBatch) -> str | None:
    """Why this batch takes SGLang's sampler, from the batch alone (None: SP covers it)."""
    info = forward_batch.sampling_info
    if forward_batch.return_logprob:
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


def _fallback_reason(runner: ModelRunner, forward_batch: ForwardBatch,
                     logits_output: LogitsProcessorOutput) -> str | None:
    """Why this batch takes SGLang's sampler (None: SP covers it)."""
    if (why := _batch_reason(runner, forward_batch)) is not None:
        return why
    if logits_output.next_token_logits is None:
        return "no next-token logits"
    rows = logits_output.next_token_logits.shape[0]
    seeds = forward_batch.sampling_info.sampling_seed
    if seeds is None or seeds.shape[0] != rows:
        return "rows without seeds"
    return None


# Penalizers whose `_filter` accepts a row slice and whose `apply` is row-wise (sampling/penaltylib/*).
# Another (prepared) class keeps the all-gather: its apply may not be per row.
ROW_WISE_PENALIZERS = frozenset({"BatchedFrequencyPenalizer", "BatchedPresencePenalizer",
                                 "BatchedRepetitionPenalizer", "BatchedMinNewTokensPenalizer"})
UNKNOWN_PENALIZER = "a penalizer not known to be row-wise (applied to full rows)"


def _has_row_transforms(info: SamplingBatchInfo) -> bool:
    orch = info.penalizer_orchestrator
    return (info.logit_bias is not None or info.acc_additive_penalties is not None
            or info.acc_scaling_penalties is not None or (orch is not None and orch.is_required))


def _row_wise_penalizers(info: SamplingBatchInfo) -> bool:
    orch = info.penalizer_orchestrator
    return (orch is None or not orch.is_required
            or all(type(penalizer).__name__ in ROW_WISE_PENALIZERS
                   for penalizer in orch.penalizers.values() if penalizer.is_prepared()))


def _row_view(penalizer: _BatchedPenalizer, rows: slice) -> _BatchedPenalizer:
    """A shallow copy of a penalizer restricted to `rows` (views); the original keeps its full rows."""
    view = copy.copy(penalizer)
    view._filter(keep_indices=rows)
    return view


def apply_row_transforms(info: SamplingBatchInfo, logits: torch.Tensor, rows: slice) -> None:
    """SamplingBatchInfo.apply_logits_bias for the batch rows `rows` only, whose logits are `logits`."""
    if info.acc_additive_penalties is not None:
        logits.add_(info.acc_additive_penalties[rows])
    if info.acc_scaling_penalties is not None:
        from sglang.srt.sampling.penaltylib.repetition_penalty import apply_scaling_penalties

        apply_scaling_penalties(logits, info.acc_scaling_penalties[rows])
    orch = info.penalizer_orchestrator
    if orch is not None and orch.is_required:
        for penalizer in orch.penalizers.values():  # the orchestrator's order, as its apply()
            if penalizer.is_prepared():
                _row_view(penalizer, rows).apply(logits)
    if info.logit_bias is not None:
        logits.add_(info.logit_bias[rows])


NO_ROW_SEEDS = "rows without sampling params or seeds"


def _gather_reason(runner: ModelRunner, forward_batch: ForwardBatch) -> str | None:
    """Why this decode batch keeps the all-gather (None: the all-to-all); batch-only, so TP ranks agree."""
    info = forward_batch.sampling_info
    if info is None:
        return "no sampling info"
    if (why := _batch_reason(runner, forward_batch)) is not None:
        return why  # counted as a fallback when the batch is sampled
    if not _row_wise_penalizers(info):
        return UNKNOWN_PENALIZER
    rows = forward_batch.batch_size
    if (info.temperatures.shape[0] != rows or info.sampling_seed is None
            or info.sampling_seed.shape[0] != rows):
        return NO_ROW_SEEDS
    return None


def _positions(forward_batch: ForwardBatch) -> torch.Tensor:
    # As ModelRunner.sample: decode rows use their position, prefill rows their last token's.
    if forward_batch.forward_mode.is_decode():
        return forward_batch.positions
    return forward_batch.seq_lens - 1


def request_seed(nonce: int, rid: str) -> int:
    """An unseeded request's seed: a keyed hash of its rid, as a signed int64 (SGLang's seed dtype)."""
    digest = hashlib.blake2b(str(rid).encode(), digest_size=8,
                             key=(nonce & (2**64 - 1)).to_bytes(8, "little"))
    return int.from_bytes(digest.digest(), "little", signed=True)


def shared_nonce(random_seed: int | None, tp_size: int, tp_group: GroupCoordinator) -> int:
    """Rank 0's nonce (--random-seed) on every TP rank: one gloo broadcast on the CPU group at start-up."""
    seed = random_seed if random_seed is not None else random.SystemRandom().getrandbits(62)
    nonce = random.Random(f"branchwise-sp-{seed}").getrandbits(63)
    if tp_size == 1:
        return nonce
    shared = torch.tensor([nonce], dtype=torch.int64)
    dist.broadcast(shared, src=tp_group.ranks[0], group=tp_group.cpu_group)
    return int(shared.item())


# ---------------------------------------------------------------- hook bodies (targets in plugin.py)

def build(scheduler: Scheduler, config: BranchwiseConfig) -> SPState | None:
    """The scheduler's --parallel-sampling component (None when off); an uncovered mode stops it."""
    from sglang.srt.runtime_context import get_parallel

    if not config.parallel_sampling:
        return None
    if (why := _unsupported_mode(scheduler)) is not None:
        raise RuntimeError(f"Branchwise: --parallel-sampling does not run with {why}; drop --parallel-sampling")
    par = get_parallel()
    args = scheduler.server_args
    deterministic = bool(getattr(args, "enable_deterministic_inference", False))
    state = SPState(tp_size=par.tp_size, tp_group=par.tp_group, inject_seeds=not deterministic,
                    tp_rank=par.tp_group.rank_in_group,
                    nonce=shared_nonce(getattr(args, "random_seed", None), par.tp_size, par.tp_group))
    logger.info("Branchwise parallel sampling on: %d rank(s), per-request seeds%s%s",
                par.tp_size, " (unseeded: from the rid)" if state.inject_seeds else " from SGLang",
                ", decode logits exchanged with an all-to-all" if par.tp_size > 1 else "")
    runner = scheduler.tp_worker.model_runner
    setattr(runner, ATTR, state)
    setattr(scheduler.tree_cache, ATTR, state)
    if par.tp_size > 1:
        _attach_model(state, runner.model)
    return state


def after_from_schedule_batch(info: SamplingBatchInfo, cls: type[SamplingBatchInfo],
                              batch: ScheduleBatch | None, *args: Any, **kwargs: Any) -> SamplingBatchInfo:
    """SamplingBatchInfo.from_schedule_batch: give every row its request's seed (unseeded: request_seed)."""
    state = getattr(batch.tree_cache, ATTR, None) if batch is not None else None
    if state is not None and state.inject_seeds and info.sampling_seed is None:
        seeds = [seed if (seed := req.sampling_params.sampling_seed) is not None
                 else request_seed(state.nonce, req.rid) for req in batch.reqs]
        info.sampling_seed = to_device(seeds, torch.int64, info.temperatures.device)
    return info


class _AllToAll:
    """Stands in for LogitsProcessor._logits_gatherer during one decode _get_logits call."""

    __slots__ = ("group", "tp_size", "called")

    def __init__(self, group: GroupCoordinator, tp_size: int) -> None:
        self.group, self.tp_size, self.called = group, tp_size, False

    def __call__(self, shard: torch.Tensor) -> torch.Tensor:
        self.called = True
        return exchange_rows(shard, self.tp_size, self._all_to_all)

    def _all_to_all(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        if inp.device.type == "cpu":  # SGLang's registered op has no CPU kernel; its all-gather uses gloo too
            dist.all_to_all_single(out, inp, group=self.group.device_group)
        else:  # pynccl or NCCL, as SGLang's own _tp_lm_head_all_to_all
            self.group.all_to_all_single(out, inp)


def around_forward(orig: Hook, runner: ModelRunner, forward_batch: ForwardBatch,
                   *args: Any, **kwargs: Any) -> Any:
    """ModelRunner.forward: arm the all-to-all for a covered decode batch; tag the batch with the outcome."""
    state = getattr(runner, ATTR, None)
    if state is None or state.tp_size == 1 or not forward_batch.forward_mode.is_decode():
        return orig(runner, forward_batch, *args, **kwargs)
    if (why := _gather_reason(runner, forward_batch)) is not None:
        if why in (UNKNOWN_PENALIZER, NO_ROW_SEEDS):  # the other reasons are counted as fallbacks
            state.gather(why)
        forward_batch._branchwise_sp_exchange = None
        return orig(runner, forward_batch, *args, **kwargs)
    if runner.model is not state.model:  # a weight update replaced the model
        _attach_model(state, runner.model)
    plan = state.plan = ExchangePlan(batch_size=forward_batch.batch_size)
    try:
        out = orig(runner, forward_batch, *args, **kwargs)
    finally:
        state.plan = None
    forward_batch._branchwise_sp_exchange = plan if plan.done else None
    if not plan.done:
        state.gather("CUDA graph replay" if getattr(out, "can_run_graph", False)
                     else "all-gather kept in the model")
    return out


def around_get_logits(orig: Hook, processor: LogitsProcessor, hidden_states: torch.Tensor,
                      lm_head: VocabParallelEmbedding, metadata: LogitsMetadata,
                      *args: Any, **kwargs: Any) -> torch.Tensor:
    """LogitsProcessor._get_logits: the all-to-all instead of the all-gather, when armed."""
    # not getattr: a miss on an nn.Module raises inside Module.__getattr__
    state = processor.__dict__.get(ATTR)
    plan = state.plan if state is not None else None
    if plan is None:
        return orig(processor, hidden_states, lm_head, metadata, *args, **kwargs)
    plan.done = False  # the last call of the forward decides what the sampler gets
    if (not processor.do_tensor_parallel_all_gather or processor.use_attn_tp_group
            or processor.do_tensor_parallel_all_gather_dp_attn or not metadata.forward_mode.is_decode()
            or hidden_states.shape[0] != plan.batch_size):
        return orig(processor, hidden_states, lm_head, metadata, *args, **kwargs)
    stock, all_to_all = processor._logits_gatherer, _AllToAll(state.tp_group, state.tp_size)
    processor._logits_gatherer = all_to_all
    try:
        logits = orig(processor, hidden_states, lm_head, metadata, *args, **kwargs)
    finally:
        processor._logits_gatherer = stock
    plan.done = all_to_all.called
    return logits


def around_sample(orig: Hook, runner: ModelRunner, logits_output: LogitsProcessorOutput,
                  forward_batch: ForwardBatch, *args: Any, **kwargs: Any) -> torch.Tensor:
    state = getattr(runner, ATTR, None)
    if state is None:
        return orig(runner, logits_output, forward_batch, *args, **kwargs)
    info = forward_batch.sampling_info
    plan: ExchangePlan | None = getattr(forward_batch, "_branchwise_sp_exchange", None)
    if plan is not None:  # next_token_logits holds my block of rows only
        logits_output.auxiliary_device_output = None
        logits = logits_output.next_token_logits
        assert logits.shape[0] == rows_per_rank(plan.batch_size, state.tp_size), (
            logits.shape, plan.batch_size)
        if _has_row_transforms(info):  # ModelRunner._preprocess_logits, on my rows
            transform_own_rows(logits, plan.batch_size, state.tp_size, state.tp_rank,
                               lambda block, rows: apply_row_transforms(info, block, rows))
            state.a2a_transform_steps += 1
        logits = runner.sampler._preprocess_logits(logits, info)  # NaN sanitising
        params = RowParams.from_sampling_info(info, _positions(forward_batch))
        ids = sample_own_rows(logits, params, plan.batch_size, state.id_group)
        runner.ngram_embedding_manager.update_after_decode(next_token_ids=ids, forward_batch=forward_batch)
        state.sp_steps += 1
        state.a2a_steps += 1
        return ids
    reason = _fallback_reason(runner, forward_batch, logits_output)
    if reason is not None:
        state.fallback(reason)
        if not state.inject_seeds:
            return orig(runner, logits_output, forward_batch, *args, **kwargs)
        seeds, info.sampling_seed = info.sampling_seed, None  # stock sampling, as without the flag
        try:
            return orig(runner, logits_output, forward_batch, *args, **kwargs)
        finally:
            info.sampling_seed = seeds
    # ModelRunner.sample up to the sampler call: bias, penalties (grammar/watermark/observer excluded)
    logits_output.auxiliary_device_output = None
    runner._preprocess_logits(logits_output, info)
    logits = runner.sampler._preprocess_logits(logits_output.next_token_logits, info)
    params = RowParams.from_sampling_info(info, _positions(forward_batch))
    ids = sp_sample_full(logits, params, state.id_group) if state.tp_size > 1 else sample_rows(logits, params)
    runner.ngram_embedding_manager.update_after_decode(next_token_ids=ids, forward_batch=forward_batch)
    state.sp_steps += 1
    return ids
