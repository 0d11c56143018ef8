"""The prefill budget on the server (BRANCHWISE_PREFILL_BUDGET=1, taper): each prefill's chunk sized by
taper/prefill_budget.py for one `_get_new_batch_prefill_raw` call, decode rounds between chunks
(SGLang's --prefill-decode-interval, 1 unless given); docs/design/prefill-budget.md."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from branchwise import request_meta
from branchwise.config import PREFILL_ENV, BranchwiseConfig
from branchwise.taper.controller import StepController
from branchwise.taper.predictor import LinearLatencyModel
from branchwise.taper.prefill_budget import (
    PrefillRule,
    PrefillStep,
    min_chunk_for,
    prefill_tokens,
    stage_slack,
    ttft_due,
)

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
    from sglang.srt.managers.scheduler import Scheduler

logger = logging.getLogger("branchwise")


class HookState(Protocol):
    """What the hook reads of scheduler_hook.BranchwiseState (named here: that module imports this one)."""

    prefill: PrefillBudget | None
    controller: StepController
    config: BranchwiseConfig
    tp_rank: int
    tp_size: int


@dataclass(frozen=True, slots=True)
class PricedModel:
    """The live T(S) with a prefill-token price: its own c_tok, else c_seq (a probed fit has no c_tok)."""

    model: LinearLatencyModel

    @property
    def c_tok(self) -> float:
        return self.model.c_tok or self.model.c_seq

    def predict(self, n_seqs: int, ctx_tokens: int, extra_tokens: int = 0) -> float:
        return self.model.predict(n_seqs, ctx_tokens) + self.c_tok * extra_tokens


@dataclass(slots=True, kw_only=True)
class PrefillBudget:
    """One scheduler's prefill rule (SGLang's chunk as its cap) and what it did (`taper.prefill`)."""

    model: LinearLatencyModel  # the controller's, refit in place
    chunk_max: int
    slo_s: float
    rho: float
    ttft_s: float | None = None
    align: int = 1  # the least chunk SGLang can take (page size, truncation alignment)
    interval: int = 1  # decode rounds after each chunk (SGLang's prefill_decode_interval)
    steps: int = 0  # prefill batches built under the rule
    limited_steps: int = 0  # of them, under a chunk below chunk_max
    floor_steps: int = 0  # of them, at the progress floor
    due_steps: int = 0  # of them, with the head TTFT-due (chunk_max)
    budget: int = 0  # sums over `steps`: the chunks allowed, the tokens prefilled
    tokens: int = 0
    errors: int = 0

    def rule(self) -> PrefillRule:
        floor = min_chunk_for(self.slo_s, self.rho, PricedModel(self.model).c_tok, self.chunk_max)
        return PrefillRule(self.chunk_max, min(max(floor, self.align), self.chunk_max), self.rho, self.ttft_s)

    def chunk(self, rows: int, ctx: int, slack_s: float, due: bool) -> int:
        """A decoding request's next token waits for the chunk's forward and then its decode step:
        T(0, 0, chunk) + T(rows, ctx, 0) within rho x slack (the chunk's fixed cost as `host`)."""
        priced = PricedModel(self.model)
        return prefill_tokens(self.rule(), priced, PrefillStep(rows, ctx, slack_s, due, priced.predict(0, 0)))

    def record(self, chunk: int, due: bool, tokens: int) -> None:
        self.steps += 1
        self.limited_steps += chunk < self.chunk_max
        self.floor_steps += chunk == self.rule().min_chunk < self.chunk_max
        self.due_steps += due
        self.budget += chunk
        self.tokens += tokens

    def report(self) -> dict[str, Any]:
        steps = max(self.steps, 1)
        return {"steps": self.steps, "limited_steps": self.limited_steps, "floor_steps": self.floor_steps,
                "due_steps": self.due_steps, "budget_mean": self.budget / steps, "tokens_mean": self.tokens / steps,
                "chunk_max": self.chunk_max, "floor": self.rule().min_chunk, "decode_interval": self.interval,
                "c_tok_us": 1e6 * PricedModel(self.model).c_tok, "ttft_s": self.ttft_s, "errors": self.errors}


def build(scheduler: Scheduler, cfg: BranchwiseConfig, ctl: StepController) -> PrefillBudget:
    model, chunk = ctl.policy.model, scheduler.chunked_prefill_size
    if not isinstance(model, LinearLatencyModel) or chunk is None:
        raise RuntimeError(f"Branchwise: {PREFILL_ENV}=1 needs chunked prefill (--chunked-prefill-size N > 0) "
                           "and a linear latency model; unset it or add those")
    if not scheduler.prefill_decode_interval:  # back-to-back chunks: a smaller one would only delay decode
        scheduler.prefill_decode_interval = 1
        scheduler.prefill_decode_interval_min_bs = max(scheduler.prefill_decode_interval_min_bs, 1)
    align = max(int(scheduler.page_size or 1), int(getattr(scheduler, "truncation_align_size", None) or 1))
    return PrefillBudget(model=model, chunk_max=chunk, slo_s=cfg.slo_s(None), rho=cfg.taper_rho,
                         ttft_s=cfg.prefill_ttft_s, align=align, interval=scheduler.prefill_decode_interval)


def least_slack(ctl: StepController, cfg: BranchwiseConfig, reqs: Iterable[Req], lag: int,
                now: tuple[float, float]) -> float:
    """The decoding requests' least slack: a phase's clock in the controller, else the request's own
    stage since its first token on the mean pace (stage_slack); `now`: (monotonic, perf_counter)."""
    least = math.inf
    for req in reqs:
        if req.finished():
            continue
        fields = getattr(req, "bw_row", None)
        tracker = ctl.trackers.get(fields.key) if fields is not None else None
        if tracker is not None and tracker.in_phase:
            least = min(least, tracker.slack(now[0]))
            continue
        start = req.time_stats.prefill_finished_time
        if start > 0.0:
            slo_s = cfg.slo_s(request_meta.of(req).slo_tpot_ms)
            least = min(least, stage_slack(slo_s, max(len(req.output_ids) - 1, 0) + lag, now[1] - start))
    return least


def head_due(budget: PrefillBudget, scheduler: Scheduler, perf_s: float) -> bool:
    """The FCFS head (the chunked request first) is TTFT-due (prefill_budget.ttft_due)."""
    head = scheduler.chunked_req
    if head is None and scheduler.waiting_queue:
        head = scheduler.waiting_queue[0]
    if budget.ttft_s is None or head is None or head.time_stats.wait_queue_entry_time <= 0.0:
        return False
    left = max(len(head.origin_input_ids) - head.kv.kv_committed_len, 0)
    return ttft_due(budget.ttft_s, perf_s - head.time_stats.wait_queue_entry_time, left,
                    PricedModel(budget.model).c_tok)


def _overlap_lag(scheduler: Scheduler) -> int:
    """Overlap: a decode step in flight delivers one more token to every running request."""
    last = getattr(scheduler, "last_batch", None)
    return int(bool(getattr(scheduler, "enable_overlap", False)) and last is not None
               and last.forward_mode.is_decode())


def decide(state: HookState, scheduler: Scheduler, running: ScheduleBatch) -> tuple[int, bool]:
    """(chunk, head due) on rank 0, broadcast to the other TP ranks; a failure gives SGLang's chunk."""
    budget = state.prefill
    chunk, due = budget.chunk_max, False
    if state.tp_rank == 0:
        try:
            now = (time.monotonic(), time.perf_counter())
            due = head_due(budget, scheduler, now[1])
            live = [req for req in running.reqs if not req.finished()]
            slack = least_slack(state.controller, state.config, live, _overlap_lag(scheduler), now)
            chunk = budget.chunk(len(live), sum(req.kv.kv_committed_len for req in live), slack, due)
        except Exception:  # noqa: BLE001 - a rule bug must not stall the loop or the TP broadcast
            budget.errors += 1
            if budget.errors == 1:
                logger.exception("Branchwise: the prefill budget failed; SGLang's chunk instead (logged once)")
            chunk, due = budget.chunk_max, False
    if state.tp_size > 1:
        import torch
        import torch.distributed as dist

        box = torch.tensor([chunk, int(due)], dtype=torch.int64)
        dist.broadcast(box, src=scheduler.tp_group.ranks[0], group=scheduler.tp_cpu_group)
        chunk, due = int(box[0]), bool(box[1])
    return chunk, due


def around_get_new_batch_prefill_raw(orig: Callable[..., Any], scheduler: Scheduler, *args: Any,
                                     **kwargs: Any) -> Any:
    """SGLang's prefill batch under the rule's chunk for this call only (its own chunk restored after)."""
    bw = getattr(scheduler, "branchwise", None)
    state = bw.state if bw is not None else None
    if state is None or state.prefill is None or not (scheduler.waiting_queue or scheduler.chunked_req is not None):
        return orig(scheduler, *args, **kwargs)
    stock = scheduler.chunked_prefill_size
    running = kwargs["running_batch"] if "running_batch" in kwargs else args[-1] if args else scheduler.running_batch
    chunk, due = decide(state, scheduler, running)
    scheduler.chunked_prefill_size = chunk
    try:
        out = orig(scheduler, *args, **kwargs)
    finally:
        scheduler.chunked_prefill_size = stock
    batch = out[0] if isinstance(out, tuple) else None
    if batch is not None:
        state.prefill.record(chunk, due, int(getattr(batch, "extend_num_tokens", 0) or 0))
    return out
