"""Run a chosen subset of a decode batch for one step; the rest stay in running_batch, untouched.

Measured design (shared/design/decode-deferral.md, "design (a)"): deferred rows never leave
`running_batch`, so aborts, retraction, prefill reservation and SGLang's memory checks still see
them; their KV, radix locks and pending next token (FutureMap slot keyed by req_pool_idx) stay
put. Only the sub-batch is prepared; its new seq_lens are written back into the full batch.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import torch


def why_unsupported(scheduler: Any) -> str | None:
    """Modes in which returning a sub-batch from update_running_batch is unsafe (map §1.5, §1.8)."""
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
    if getattr(scheduler.server_args, "enable_dp_attention", False):
        return "DP attention"
    return None


def batch_needs_full_step(batch: Any) -> str | None:
    """Per-step conditions under which the whole batch runs (no deferral this step)."""
    if batch.sampling_info.penalizer_orchestrator.is_required:
        return "penalties"  # the orchestrator is shared and filtered in place (decode-deferral.md §2)
    if any(r.beam_group is not None for r in batch.reqs):
        return "beam search"
    return None


def run_subset(scheduler: Any, batch: Any, active: set[Any], finishing: list[Any]) -> Any:
    """Prepare and return a sub-batch of the `active` reqs; None means "use the full path".

    Mirrors Scheduler.update_running_batch for the subset: the memory check covers only the rows
    that run (on failure the caller takes SGLang's own retract path over the full batch), finishing
    rows leave the running batch as there, and the allocator only gives slots to active rows.
    """
    idx = [i for i, r in enumerate(batch.reqs) if r in active]
    if not batch.check_decode_mem(selected_indices=idx):
        return None
    batch.filter_batch(reqs_to_exclude=finishing)
    idx = [i for i, r in enumerate(batch.reqs) if r in active]
    sub = copy.copy(batch)
    sub.sampling_info = dataclasses.replace(batch.sampling_info)
    sub.input_ids = None  # decode inputs come from the FutureMap slot of each row
    sub.filter_batch(keep_indices=idx)
    sub.prepare_for_decode()
    _write_back(batch, sub, idx)
    scheduler.new_token_ratio_tracker.decay_step()
    return sub


def _write_back(batch: Any, sub: Any, idx: list[int]) -> None:
    """Out of place: the previous tensors may still be read by the in-flight overlap forward."""
    dev = torch.tensor(idx, dtype=torch.int64, device=batch.seq_lens.device)
    batch.seq_lens = batch.seq_lens.clone().index_copy_(0, dev, sub.seq_lens)
    batch.orig_seq_lens = batch.orig_seq_lens.clone().index_copy_(0, dev, sub.orig_seq_lens)
    if batch.seq_lens_cpu is not None:
        batch.seq_lens_cpu = batch.seq_lens_cpu.clone()
        batch.seq_lens_cpu[idx] = sub.seq_lens_cpu
    batch.seq_lens_sum = None
    batch.out_cache_loc = None
    batch.input_ids = None
    batch.forward_mode = sub.forward_mode  # the merged prefill batch may still say EXTEND
