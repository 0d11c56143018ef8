"""--parallel-sampling: Albireo's sequence-parallel sampling (§6) inside SGLang's ModelRunner.sample.

Stock SGLang samples the whole batch on every TP rank after the logits all-gather (map §3.2).
With --parallel-sampling each rank samples only its block of rows and the token ids are
all-gathered (`parallel_sampler.sp_sample_full`), so the sampling work per rank drops by t.

Where it plugs in (AROUND ModelRunner.sample): SGLang's own pre-processing still runs on the full
gathered rows first (logit_bias, penalties, NaN sanitising), so those features keep their exact
semantics; only the sampler call is replaced. Rows are sampled with per-request seeds through the
counter-based `multinomial_with_seed` noise (bit-exact with SGLang's seeded sampler), so a row's
token does not depend on the rank that samples it or on the batch around it: outputs equal
single-rank sampling with the same seeds, at any TP degree, including tp=1. SGLang fills
`SamplingBatchInfo.sampling_seed` only under --enable-deterministic-inference; otherwise an AFTER
hook on `SamplingBatchInfo.from_schedule_batch` fills it (a request's `sampling_seed`, else 42,
SGLang's default), and SGLang's filter/merge keep it aligned with the rows.

Batches SP does not cover fall back to SGLang's sampler (logged once per reason): logprobs,
grammar, custom logit processors, watermarks, sampling observers/masks, speculative decoding.
On fallback the injected seeds are hidden, so the stock sampler behaves exactly as without
--parallel-sampling. Logits stay all-gathered (the all-to-all `sp_sample` path is not wired).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from branchwise.albireo.parallel_sampler import RowParams, sample_rows, sp_sample_full

logger = logging.getLogger("branchwise")
DEFAULT_SEED = 42  # SGLang's seed for rows without sampling_params.sampling_seed


@dataclass(slots=True)
class SPState:
    tp_size: int
    tp_group: Any  # SGLang GroupCoordinator of the TP group
    inject_seeds: bool  # False under --enable-deterministic-inference: SGLang's seeds are used
    sp_steps: int = 0
    fallbacks: dict[str, int] = field(default_factory=dict)

    def group_for(self, t: torch.Tensor) -> Any:
        return self.tp_group.cpu_group if t.device.type == "cpu" else self.tp_group.device_group

    def fallback(self, reason: str) -> None:
        if reason not in self.fallbacks:
            logger.info("Branchwise parallel sampling: %s -> SGLang's sampler for such batches", reason)
        self.fallbacks[reason] = self.fallbacks.get(reason, 0) + 1


_STATE: SPState | None = None  # one scheduler (and model runner) per process


def state() -> SPState | None:
    return _STATE


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


def _fallback_reason(runner: Any, fb: Any, logits_output: Any) -> str | None:
    """Why this batch takes SGLang's sampler (None: SP covers it)."""
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
    if logits_output.next_token_logits is None:
        return "no next-token logits"
    n = logits_output.next_token_logits.shape[0]
    if info.sampling_seed is None or info.sampling_seed.shape[0] != n:
        return "rows without seeds"
    return None


def _positions(fb: Any) -> torch.Tensor:
    # As ModelRunner.sample: decode rows use their position, prefill rows their last token's.
    return fb.positions if fb.forward_mode.is_decode() else fb.seq_lens - 1


# ---------------------------------------------------------------- hook bodies (targets in plugin.py)

def after_scheduler_init(result: None, self: Any, *args: Any, **kwargs: Any) -> None:
    global _STATE
    from sglang.srt.runtime_context import get_parallel

    from branchwise.config import BranchwiseConfig

    if not BranchwiseConfig.from_server_args(self.server_args).parallel_sampling:
        return
    if (why := _unsupported_mode(self)) is not None:
        logger.warning("Branchwise parallel sampling off: not supported with %s", why)
        return
    par = get_parallel()
    det = bool(getattr(self.server_args, "enable_deterministic_inference", False))
    _STATE = SPState(tp_size=par.tp_size, tp_group=par.tp_group, inject_seeds=not det)
    logger.info("Branchwise parallel sampling on: %d rank(s), per-request seeds (default %d)%s",
                par.tp_size, DEFAULT_SEED, "" if _STATE.inject_seeds else " from SGLang")


def after_from_schedule_batch(info: Any, cls: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
    """SamplingBatchInfo.from_schedule_batch: give every row its request's seed."""
    st = _STATE
    if st is not None and st.inject_seeds and info.sampling_seed is None:
        seeds = [s if (s := r.sampling_params.sampling_seed) is not None else DEFAULT_SEED for r in batch.reqs]
        info.sampling_seed = torch.tensor(seeds, dtype=torch.int64).to(info.temperatures.device)
    return info


def around_sample(orig: Any, runner: Any, logits_output: Any, fb: Any, *args: Any, **kwargs: Any) -> Any:
    st = _STATE
    if st is None:
        return orig(runner, logits_output, fb, *args, **kwargs)
    info = fb.sampling_info
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
    ids = sp_sample_full(logits, p, st.group_for(logits)) if st.tp_size > 1 else sample_rows(logits, p)
    runner.ngram_embedding_manager.update_after_decode(next_token_ids=ids, forward_batch=fb)
    st.sp_steps += 1
    return ids


def after_get_internal_state(result: Any, self: Any, *args: Any, **kwargs: Any) -> Any:
    st = _STATE
    if st is not None and isinstance(getattr(result, "internal_state", None), dict):
        result.internal_state["branchwise_parallel_sampling"] = {
            "tp_size": st.tp_size, "sp_steps": st.sp_steps, "fallbacks": dict(st.fallbacks)}
    return result
