"""Run a chosen subset of a decode batch for one step; the rest stay in running_batch, untouched."""

from __future__ import annotations

import copy
import dataclasses
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING

import torch

from branchwise.hostcopy import to_device

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.sampling.penaltylib.orchestrator import BatchedPenalizerOrchestrator

# Per-row state SGLang's penalizers change in cumulate_output_tokens; a class missing here
# (a new SGLang, a custom penalizer) makes the step run in full rather than risk its state.
PENALIZER_ACCUMULATORS: Mapping[str, tuple[str, ...]] = MappingProxyType({
    "BatchedFrequencyPenalizer": ("cumulated_frequency_penalties",),
    "BatchedPresencePenalizer": ("cumulated_presence_penalties",),
    "BatchedRepetitionPenalizer": ("cumulated_repetition_penalties",),
    "BatchedMinNewTokensPenalizer": ("len_output_tokens",),
})


def why_unsupported(scheduler: Scheduler) -> str | None:
    """Modes in which returning a sub-batch from update_running_batch is unsafe (refused: support.py)."""
    from sglang.srt.disaggregation.utils import DisaggregationMode
    from sglang.srt.runtime_context import get_parallel

    if scheduler.disaggregation_mode != DisaggregationMode.NULL:
        return "PD disaggregation"
    if getattr(scheduler, "enable_pdmux", False):
        return "PD multiplexing"
    if get_parallel().pp_size > 1:
        return "pipeline parallelism"
    if not scheduler.spec_algorithm.is_none():
        return "speculative decoding"
    if scheduler.require_mlp_sync:  # attention DP (--attn-dp-size), MoE all-to-all, dense-TP MLP
        return "attention DP or batches synced across ranks"
    if scheduler.is_mixed_chunk:  # mixed steps prepare the running batch themselves: every row runs
        return "mixed chunked prefill"
    return None


def batch_needs_full_step(batch: ScheduleBatch) -> str | None:
    """Per-step conditions under which the whole batch runs (no deferral this step)."""
    orch = batch.sampling_info.penalizer_orchestrator
    if orch.is_required and any(pen.is_prepared() and type(pen).__name__ not in PENALIZER_ACCUMULATORS
                                for pen in orch.penalizers.values()):
        return "unknown penalizer"
    if any(req.beam_group is not None for req in batch.reqs):
        return "beam search"
    return None


@dataclass(slots=True)
class KeptSubset:
    """The last deferring step's sub-batch, prepared again at the next step while the same rows run."""

    batch: ScheduleBatch | None = None
    seq_lens: torch.Tensor | None = None
    pool_indices: torch.Tensor | None = None
    idx: list[int] | None = None
    rows: torch.Tensor | None = None  # idx as an int64 tensor on the batch's device
    sub: ScheduleBatch | None = None

    def serves(self, batch: ScheduleBatch, idx: list[int]) -> bool:
        return (self.batch is batch and batch.seq_lens is self.seq_lens
                and batch.req_pool_indices is self.pool_indices and self.idx == idx)

    def clear(self) -> None:
        self.batch = self.seq_lens = self.pool_indices = self.idx = self.rows = self.sub = None


def run_subset(scheduler: Scheduler, batch: ScheduleBatch, active: set[Req], finishing: list[Req],
               kept: KeptSubset) -> ScheduleBatch | None:
    """Prepare and return a sub-batch of the `active` reqs; None means "use the full path"."""
    idx = [i for i, req in enumerate(batch.reqs) if req in active]
    if not batch.check_decode_mem(selected_indices=idx):
        kept.clear()
        return None
    if finishing:
        initial_bs = batch.batch_size()
        batch.filter_batch(reqs_to_exclude=finishing)
        if batch.batch_size() < initial_bs:
            batch.batch_is_full = False
        idx = [i for i, req in enumerate(batch.reqs) if req in active]
    orch = batch.sampling_info.penalizer_orchestrator
    penalties = orch.is_required
    if kept.serves(batch, idx):
        sub = kept.sub
    else:
        sub = _cut(batch, idx, penalties)
        kept.batch, kept.idx, kept.sub = batch, idx, sub
        kept.rows = to_device(idx, torch.int64, batch.seq_lens.device)
        kept.pool_indices = batch.req_pool_indices
    sub.input_ids = None  # decode inputs come from the FutureMap slot of each row
    sub.prepare_for_decode()
    _write_back(batch, sub, idx, kept.rows)
    kept.seq_lens = batch.seq_lens
    if penalties:
        _write_back_penalizers(orch, sub.sampling_info.penalizer_orchestrator, kept.rows)
    scheduler.new_token_ratio_tracker.decay_step()
    return sub


def _cut(batch: ScheduleBatch, idx: list[int], penalties: bool) -> ScheduleBatch:
    """A new sub-batch of rows `idx` of `batch`; the full batch and its penalty state stay intact."""
    sub = copy.copy(batch)
    sub.sampling_info = dataclasses.replace(batch.sampling_info)
    if penalties:
        sub.sampling_info.penalizer_orchestrator = _fork_penalizers(
            batch.sampling_info.penalizer_orchestrator, sub)
    sub.filter_batch(keep_indices=idx)
    return sub


def _write_back(batch: ScheduleBatch, sub: ScheduleBatch, idx: list[int], rows: torch.Tensor) -> None:
    """Out of place: the previous tensors may still be read by the in-flight overlap forward."""
    batch.seq_lens = batch.seq_lens.clone().index_copy_(0, rows, sub.seq_lens)
    batch.orig_seq_lens = batch.orig_seq_lens.clone().index_copy_(0, rows, sub.orig_seq_lens)
    if batch.seq_lens_cpu is not None:
        batch.seq_lens_cpu = batch.seq_lens_cpu.clone()
        batch.seq_lens_cpu[idx] = sub.seq_lens_cpu
    batch.seq_lens_sum = None
    batch.out_cache_loc = None
    batch.input_ids = None
    batch.forward_mode = sub.forward_mode  # the merged prefill batch may still say EXTEND


def _fork_penalizers(orch: BatchedPenalizerOrchestrator, sub: ScheduleBatch) -> BatchedPenalizerOrchestrator:
    """A shallow copy of the orchestrator (and each penalizer) bound to `sub`."""
    forked = copy.copy(orch)
    forked.penalizers = {}
    ref = weakref.ref(forked)
    for cls, pen in orch.penalizers.items():
        clone = copy.copy(pen)
        clone._orchestrator_ref = ref
        forked.penalizers[cls] = clone
    forked.batch = sub
    return forked


def _write_back_penalizers(orch: BatchedPenalizerOrchestrator, forked: BatchedPenalizerOrchestrator,
                           rows: torch.Tensor) -> None:
    """Copy the sub's updated accumulators into the rows of the full batch that ran."""
    for cls, pen in orch.penalizers.items():
        mine = forked.penalizers.get(cls)
        if not pen.is_prepared() or mine is None or not mine.is_prepared():
            continue
        for name in PENALIZER_ACCUMULATORS[cls.__name__]:
            getattr(pen, name).index_copy_(0, rows, getattr(mine, name))


def _pinned_cumulate(batch: ScheduleBatch) -> None:
    """Cumulate, per row, the token an every-step (eager) schedule would cumulate at this step."""
    tokens = []
    for req in batch.reqs:
        out = req.output_ids
        produced = req.kv.kv_committed_len - len(req.origin_input_ids) + 1  # tokens sampled so far
        pos = -1 if len(out) < produced else -2  # shorter: the newest is still in flight
        tokens.append(out[pos] if len(out) >= -pos else req.origin_input_ids[-1])
    ids = to_device(tokens, torch.int64, batch.device)  # as SGLang's own cumulate: pinned, non-blocking
    batch.sampling_info.penalizer_orchestrator.cumulate_output_tokens(ids)


# Set on the scheduler's ReqToTokenPool by scheduler_hook.build (overlap, a step controller): the
# hook receives only the ScheduleBatch, and a scheduler's batches share its pool.
PIN_ATTR = "_branchwise_pin_penalty_tokens"


def pin_penalty_tokens(scheduler: Scheduler) -> None:
    setattr(scheduler.req_to_token_pool, PIN_ATTR, True)


def around_cumulate_penalty_output_tokens(orig: Callable[[ScheduleBatch], None],
                                          batch: ScheduleBatch) -> None:
    """AROUND ScheduleBatch.cumulate_penalty_output_tokens (only called when penalties are on)."""
    if getattr(batch.req_to_token_pool, PIN_ATTR, False):
        _pinned_cumulate(batch)
    else:
        orig(batch)
