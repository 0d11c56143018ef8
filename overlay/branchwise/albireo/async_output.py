"""--async-output (Albireo): result processing off the scheduler's critical path, outputs unchanged.
Design: docs/design/albireo-async-output.md."""

from __future__ import annotations

import logging
import os
import queue
import random
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sglang.srt.managers.io_struct import SetInternalStateReq, SetInternalStateReqOutput
    from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.managers.scheduler_components.batch_result_processor import SchedulerBatchResultProcessor
    from sglang.srt.managers.scheduler_components.output_sender import SenderWrapper
    from sglang.srt.managers.utils import GenerationBatchResult
    from transformers import PreTrainedTokenizerBase

    from branchwise.albireo.forward_thread import ForwardExecutor
    from branchwise.config import BranchwiseConfig
    from branchwise.step_timer import StepTimer

logger = logging.getLogger("branchwise")
_STOP = object()
SEND_ENV = "BRANCHWISE_ASYNC_SEND"  # auto (default) | thread | inline


# ---------------------------------------------------------------- send half: ordered worker

class OrderedSender:
    """Drop-in for SGLang's SenderWrapper: send_output() enqueues, one worker thread sends in order."""

    def __init__(self, inner: SenderWrapper, name: str = "branchwise-output") -> None:
        self.inner = inner
        self.socket = inner.socket  # SGLang code reads .socket to test "am I the sending rank"
        self.queue: queue.SimpleQueue[tuple[object, object] | object] = queue.SimpleQueue()
        self.error: BaseException | None = None
        self.inline = False  # set_enabled(False): send on the calling thread (queue drained first)
        self.sent = 0
        self.timer: StepTimer | None = None
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def send_output(self, output: object, recv_obj: object = None) -> None:
        if self.error is not None:
            raise RuntimeError("Branchwise async output: a send failed in the worker") from self.error
        if self.inline:
            self.inner.send_output(output, recv_obj)
        elif self.socket is not None:  # non-entry TP ranks have no socket: nothing to send, as in SGLang
            self.queue.put((output, recv_obj))

    def _run(self) -> None:
        while (item := self.queue.get()) is not _STOP:
            if isinstance(item[0], _Marker):
                item[0].done.set()
                continue
            start = time.perf_counter()
            try:
                self.inner.send_output(*item)
                self.sent += 1
            except BaseException as e:  # noqa: BLE001 - handed to the scheduler thread
                logger.exception("Branchwise async output: send failed")
                self.error = e
                return
            if self.timer is not None:
                self.timer.add_worker(time.perf_counter() - start)

    def drain(self, timeout_s: float = 10.0) -> bool:
        """Block until everything queued so far is sent; False if it was not within `timeout_s`
        (or the worker stopped at a failed send: what is queued will never be sent)."""
        if self.error is not None or not self.thread.is_alive():
            return False
        done = threading.Event()
        self.queue.put((_Marker(done=done), None))
        return done.wait(timeout_s)

    def close(self) -> None:
        self.queue.put(_STOP)
        self.thread.join(timeout=10)


@dataclass(slots=True)
class _Marker:
    """A queue item that sets an event instead of sending (drain)."""

    done: threading.Event


# ---------------------------------------------------------------- stop strings: byte lookup table

def _byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode (the ByteLevel pre-tokenizer's alphabet)."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), 256)))
    byte_values, code_points, shifted = printable, printable[:], 0
    for byte in range(256):
        if byte not in byte_values:
            byte_values.append(byte)
            code_points.append(256 + shifted)
            shifted += 1
    return {chr(point): byte for byte, point in zip(byte_values, code_points, strict=True)}


@dataclass(slots=True)
class TokenTable:
    """token id -> raw bytes; decode(ids) = concatenated bytes decoded as UTF-8 with replacement."""

    table: dict[int, bytes]

    def decode(self, ids: Iterable[int]) -> str:
        table = self.table
        return b"".join([table[token] for token in ids]).decode("utf-8", "replace")

    @classmethod
    def build(cls, tokenizer: PreTrainedTokenizerBase, checks: int = 400,
              seed: int = 0) -> tuple[TokenTable | None, str]:
        """The table, or None and why not: only byte-level BPE without clean-up, and only if it
        reproduces tokenizer.decode on every added token, a sample of ids and random sequences."""
        backend = getattr(tokenizer, "backend_tokenizer", None)
        decoder = getattr(backend, "decoder", None)
        if type(decoder).__name__ != "ByteLevel":
            return None, f"decoder is {type(decoder).__name__}, not ByteLevel"
        if getattr(tokenizer, "clean_up_tokenization_spaces", False):
            return None, "clean_up_tokenization_spaces is on"
        inv = _byte_decoder()
        pieces = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
        added = set(getattr(tokenizer, "added_tokens_decoder", {}) or {})
        table = {}
        for token, piece in enumerate(pieces):
            if piece is None:
                return None, f"token {token} has no string"
            byte_ok = token not in added and all(char in inv for char in piece)
            table[token] = bytes(inv[char] for char in piece) if byte_ok else piece.encode("utf-8")
        built = cls(table=table)
        rng = random.Random(seed)
        vocab = len(table)
        singles = sorted(added | {rng.randrange(vocab) for _ in range(min(checks * 4, vocab))})
        seqs = [[token] for token in singles]
        seqs += [[rng.randrange(vocab) for _ in range(rng.randint(2, 10))] for _ in range(checks)]
        seqs += [[rng.choice(singles)] + seq for seq in seqs[-checks // 4:]]  # added tokens next to bytes
        for seq in seqs:
            if built.decode(seq) != tokenizer.decode(seq):
                return None, f"table decode differs from tokenizer.decode on {seq}"
        return built, "ok"


def suffix_is_prefix(tail: str, stop: str) -> bool:
    """Whether some non-empty suffix of `tail` is a prefix of `stop` (SGLang's streaming hold-back)."""
    window = min(len(tail), len(stop))
    if window == 0:
        return False
    first, at = stop[0], tail.find(stop[0], len(tail) - window)
    while at != -1:
        if stop.startswith(tail[at:]):
            return True
        at = tail.find(first, at + 1)
    return False


def check_match_stop_str_prefix(req: Req) -> bool:
    """Req.check_match_stop_str_prefix with the prefix scan above (called per streamed row per step)."""
    stops = req.sampling_params.stop_strs
    if not stops:
        return False
    tail = req.tail_str()
    if not tail:
        return False
    return any(stop and (stop in tail or suffix_is_prefix(tail, stop)) for stop in stops)


class TableTokenizer:
    """The scheduler's tokenizer under --async-output: plain decode(ids) calls (every step's tail
    decodes) served by a TokenTable when there is one, everything else delegated unchanged."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, table: TokenTable | None) -> None:
        self._tok = tokenizer
        self.table = table
        self.enabled = True

    def decode(self, ids: Iterable[int], *args: Any, **kwargs: Any) -> str:
        if self.enabled and self.table is not None and not (args or kwargs):
            try:
                return self.table.decode(ids)
            except KeyError:  # an id the table does not know: the tokenizer decides
                pass
        return self._tok.decode(ids, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tok, name)

    def __len__(self) -> int:
        return len(self._tok)


# ---------------------------------------------------------------- state half: lean decode loop

@dataclass(slots=True)
class AsyncOutput:
    """Per-scheduler state of --async-output."""

    sender: OrderedSender | None
    stop_ids: frozenset[int]  # tokenizer/model EOS + additional stop ids: a superset gate
    think: bool  # the model has self-opened reasoning tokens: SGLang's reasoning count runs
    plain_streamer: bool  # the stock streamer class (no customized info): sends can be pre-filtered
    force_interval: int
    no_mamba: bool
    check_all: bool  # Req.update_finish_state has a foreign hook: call it on every row
    table_tok: TableTokenizer | None = None
    enabled: bool = True  # runtime switch (bench A/B in one process): False = SGLang's own paths
    stats: dict[str, int] = field(default_factory=lambda: {"fast": 0, "stock": 0})

    @property
    def has_table(self) -> bool:
        return self.table_tok is not None and self.table_tok.table is not None

    def report(self) -> dict[str, Any]:
        """`/server_info` internal_states[i]["branchwise_async_output"]."""
        return {**self.stats, "enabled": self.enabled, "sent": self.sender.sent if self.sender else 0,
                "table": self.has_table}


ATTR = "_branchwise_async_output"  # on the result processor's tree cache


def build(scheduler: Scheduler, config: BranchwiseConfig) -> AsyncOutput | None:
    """The scheduler's --async-output component (None when the flag is off)."""
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.managers.scheduler_components import output_streamer

    if not config.async_output:
        return None
    sender = None
    if _send_on_thread(scheduler):
        inner = scheduler.ipc_channels.send_to_detokenizer
        sender = OrderedSender(inner)
        object.__setattr__(scheduler.ipc_channels, "send_to_detokenizer", sender)  # frozen dataclass
        scheduler.output_streamer.send_to_detokenizer = sender
    stop_ids = _stop_ids(scheduler)
    table_tok = _wrap_tokenizer(scheduler)
    state = AsyncOutput(
        sender=sender,
        stop_ids=stop_ids,
        think=bool(getattr(scheduler.model_config, "self_opened_think_start_ids", None)),
        plain_streamer=type(scheduler.output_streamer) is output_streamer.SchedulerOutputStreamer,
        force_interval=output_streamer.DEFAULT_FORCE_STREAM_INTERVAL,
        no_mamba=getattr(scheduler.req_to_token_pool, "mamba_pool", None) is None,
        check_all=_foreign_finish_hooks(Req),
        table_tok=table_tok,
    )
    setattr(scheduler.batch_result_processor.tree_cache, ATTR, state)
    logger.info("Branchwise async output on: sends on %s, stop-string lookup table %s",
                "a worker thread" if sender else "the scheduler thread", "on" if state.has_table else "off")
    return state


def _stop_ids(scheduler: Scheduler) -> frozenset[int]:
    """The model's and the tokenizer's EOS and extra stop ids (the finish gate's superset test)."""
    ids = set(scheduler.model_config.hf_eos_token_id or ())
    tokenizer = scheduler.tokenizer
    if tokenizer is not None:
        if tokenizer.eos_token_id is not None:
            ids.add(tokenizer.eos_token_id)
        ids |= set(getattr(tokenizer, "additional_stop_token_ids", None) or ())
    return frozenset(ids)


def _wrap_tokenizer(scheduler: Scheduler) -> TableTokenizer | None:
    """Put a TableTokenizer in front of the scheduler's tokenizer (requests get it as req.tokenizer)."""
    tokenizer = scheduler.tokenizer
    if tokenizer is None:
        return None
    table, why = TokenTable.build(tokenizer)
    if table is None:
        logger.info("Branchwise async output: stop strings keep tokenizer.decode (%s)", why)
    scheduler.tokenizer = wrapped = TableTokenizer(tokenizer, table)
    return wrapped


def _send_on_thread(scheduler: Scheduler) -> bool:
    """Whether sends go to the worker thread (env BRANCHWISE_ASYNC_SEND: auto = thread | inline)."""
    if getattr(scheduler, "rust_server", None) is not None:  # the Rust egress ring has its own thread
        return False
    mode = os.environ.get(SEND_ENV, "auto").strip().lower()
    if mode not in ("auto", "thread", "inline"):
        raise ValueError(f"{SEND_ENV} must be auto, thread or inline, got {mode!r}")
    return mode != "inline"


def _foreign_finish_hooks(req_cls: type[Req]) -> bool:
    """Whether a non-Branchwise plugin hooks Req.update_finish_state (it may expect every call)."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    hooks = getattr(HookRegistry, "_hooks", None)
    if hooks is None:
        return hasattr(req_cls.update_finish_state, "__wrapped__")
    mine = ("branchwise.", "branchwise")
    return any(not getattr(fn, "__module__", "").startswith(mine)
               for _, fn, _ in hooks.get(f"{req_cls.__module__}.Req.update_finish_state", []))


SWITCH_DRAIN_S = 10.0  # how long a runtime switch waits for the queued sends


def set_enabled(state: AsyncOutput, on: bool, drain_timeout_s: float = SWITCH_DRAIN_S,
                forward: ForwardExecutor | None = None) -> str | None:
    """Switch every part at once, between steps; None when switched, else why not (nothing changed)."""
    if state.sender is not None:
        if not state.sender.drain(drain_timeout_s):
            why = "its send worker failed" if state.sender.error is not None else \
                f"sends still queued after {drain_timeout_s:g} s"
            return f"Branchwise async output: switch {'on' if on else 'off'} refused, {why}; nothing changed"
        state.sender.inline = not on
    if state.table_tok is not None:
        state.table_tok.enabled = on
    state.enabled = on
    if forward is not None:
        forward.enabled = on
    return None


def _qualifies(state: AsyncOutput, batch: ScheduleBatch, result: GenerationBatchResult) -> bool:
    """Batches whose SGLang decode loop reduces to append + finish check + finish handling."""
    from sglang.srt.runtime_context import get_disagg

    logits_output = result.logits_output
    if not (state.no_mamba and batch.spec_algorithm.is_none() and not batch.return_logprob
            and batch.mamba_track_mask_cpu is None and result.auxiliary_host_output is None
            and result.routed_experts_output is None and result.indexer_topk_output is None
            and logits_output is not None and logits_output.customized_info is None
            and logits_output.sampling_mask_output is None
            and not get_disagg().disaggregation_decode_enable_offload_kvcache):
        return False
    return not any(req.beam_group is not None or req.grammar is not None or req.return_sampling_mask
                   or req.return_hidden_states or req.return_routed_experts or req.return_indexer_topk
                   for req in batch.reqs)


def _may_finish(state: AsyncOutput, req: Req, token: int) -> bool:
    """A superset of Req.update_finish_state's conditions (grammar excluded by _qualifies)."""
    params = req.sampling_params
    return (req.to_finish is not None or getattr(req, "bw_fork", None) is not None
            or params.max_new_tokens is None or len(req.output_ids) >= params.max_new_tokens
            or token < 0 or (req.vocab_size is not None and token >= req.vocab_size)
            or token in state.stop_ids
            or bool(params.stop_token_ids and token in params.stop_token_ids)
            or bool(req.eos_token_ids and token in req.eos_token_ids)
            or bool(params.stop_strs) or bool(params.stop_regex_strs))


def fast_decode_result(state: AsyncOutput, proc: SchedulerBatchResultProcessor, batch: ScheduleBatch,
                       result: GenerationBatchResult) -> None:
    """SchedulerBatchResultProcessor.process_batch_result_decode for a qualifying batch."""
    from sglang.srt.runtime_context import get_observability

    if result.copy_done is not None:
        result.copy_done.synchronize()
    logits_output = result.logits_output
    ids = result.next_token_ids
    ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)
    rows = batch.batch_size()
    n_generated = result.get_num_generated_tokens(rows)
    proc.metrics_reporter.num_generated_tokens += n_generated
    if get_observability().enable_metrics:
        proc.metrics_collector.increment_decode_cuda_graph_pass(value=result.can_run_cuda_graph)

    allocator = proc.token_to_kv_pool_allocator
    allocator.free_group_begin()
    skip_done = proc.enable_overlap or proc.enable_overlap_mlx
    now = time.perf_counter()  # one clock read per step (SGLang reads it per row)
    for row, (req, token) in enumerate(zip(batch.reqs, ids, strict=True)):
        if skip_done and (req.finished() or req.is_retracted):
            continue  # overlap: finished at the previous step, KV freed there (SGLang does the same)
        req.time_stats.set_last_decode_finish_time(now)
        req.output_ids.append(token)
        if state.think or req.require_reasoning:
            proc._maybe_update_reasoning_tokens(req, [token])
        if state.check_all or req.finished() or _may_finish(state, req, token):  # finished: non-overlap
            req.update_finish_state(1)
            if req.finished():
                proc._handle_finish_state_updated_req(req, batch, result, row, logits_output)

    reqs = batch.reqs
    if state.plain_streamer:  # rows that would not emit (non-streaming, between force intervals)
        interval = state.force_interval
        reqs = [req for req in reqs if req.stream or req.finished() or len(req.output_ids) % interval == 0]
    proc.output_streamer.stream_output(reqs, batch.return_logprob)
    allocator.free_group_end()
    reporter = proc.metrics_reporter
    reporter.forward_ct_decode = (reporter.forward_ct_decode + 1) % (1 << 30)
    reporter.report_decode_stats(result.can_run_cuda_graph, running_batch=batch,
                                 num_generated_tokens=n_generated)
    state.stats["fast"] += 1


def around_process_batch_result_decode(orig: Callable[..., Any], processor: SchedulerBatchResultProcessor,
                                       batch: ScheduleBatch, result: GenerationBatchResult) -> Any:
    state = getattr(processor.tree_cache, ATTR, None)
    if result.copy_done is not None:  # the forward thread fills the result in: qualify what it produced
        result.copy_done.synchronize()
    if state is None or not state.enabled or not _qualifies(state, batch, result):
        if state is not None:
            state.stats["stock"] += 1
        return orig(processor, batch, result)
    return fast_decode_result(state, processor, batch, result)


# ---------------------------------------------------------------- hook bodies (targets in plugin.py)

def around_check_match_stop_str_prefix(orig: Callable[[Req], bool], req: Req) -> bool:
    tokenizer = req.tokenizer
    if type(tokenizer) is TableTokenizer and tokenizer.enabled:
        return check_match_stop_str_prefix(req)
    return orig(req)


SWITCH_KEY = "branchwise_async_output"  # POST /set_internal_state {"server_args": {SWITCH_KEY: 0 | 1}}


def around_set_internal_state(orig: Callable[..., Any], scheduler: Scheduler, recv_req: SetInternalStateReq,
                              *args: Any, **kwargs: Any) -> SetInternalStateReqOutput:
    """Runtime on/off switch of --async-output (bench A/B in one server); other keys go to SGLang."""
    req_args = getattr(recv_req, "server_args", None) or {}
    if SWITCH_KEY not in req_args:
        return orig(scheduler, recv_req, *args, **kwargs)
    from sglang.srt.managers.io_struct import SetInternalStateReqOutput

    branchwise = scheduler.branchwise
    state = branchwise.async_output
    why = None if state is None else set_enabled(state, bool(req_args[SWITCH_KEY]), SWITCH_DRAIN_S,
                                                 branchwise.forward)
    if why is not None:
        logger.warning(why)
        return SetInternalStateReqOutput(updated=False)
    rest = {key: value for key, value in req_args.items() if key != SWITCH_KEY}
    if rest:
        recv_req.server_args = rest
        return orig(scheduler, recv_req, *args, **kwargs)
    return SetInternalStateReqOutput(updated=state is not None)
