"""--async-output: Albireo's output processing for SGLang's scheduler, outputs unchanged.

SGLang runs result processing (T5) on the scheduler thread, serial with scheduling the next step.
It has two halves:

* The send half (payload serialisation + ZMQ send to the detokenizer) reads only the payload the
  streamer just built (fresh lists, slices of the requests' state), so it can move to an ordered
  worker thread: `OrderedSender` replaces the scheduler's detokenizer sender, so every message on
  that socket goes through one FIFO thread. Step order and order with control messages are kept,
  and only the worker ever touches the socket (ZMQ sockets are not thread-safe). On GPU the worker
  runs while the overlap loop waits with the GIL released; on CPU the forward holds the GIL most of
  the time, so the worker partly contends with it (still a net gain when streaming large batches;
  env BRANCHWISE_ASYNC_SEND=inline keeps the send on the scheduler thread).
* The state half (output_ids, finish state, KV release, send offsets) mutates requests, the
  radix tree and the allocator, so it stays on the scheduler thread. It gets cheaper instead:
  `fast_decode_result` replaces SGLang's per-request decode loop for plain batches (no logprobs,
  grammar, speculative, beam, hidden states, ...) by a lean one that only calls SGLang's finish
  check for rows that can finish this step, and SGLang's finish handling (KV release) for rows
  that did; `TableTokenizer` turns the stop-string checks' `tokenizer.decode(tail)` into a byte
  lookup table (exact for byte-level BPE tokenizers; verified at start-up, else not used), and
  the streaming hold-back check (does the tail end in a stop string's prefix?) scans only where
  the stop string's first character occurs instead of every suffix length.

Everything else, and every batch the fast path does not qualify for, runs SGLang's own code.
Overlap mode is unchanged: a row that finished at step k is still in step k+1 (its KV slot is
over-allocated) and is skipped by result processing there, as in SGLang; its KV is released once,
by SGLang's `release_kv_cache`, when the finish is processed.

Where the state lives: `build` returns the scheduler's `AsyncOutput` (`scheduler.branchwise.
async_output`, read by the Scheduler hooks) and attaches it, as `_branchwise_async_output`, to the
result processor's tree cache: the processor is a frozen slotted dataclass, so its hook reaches the
component through that field. Requests reach the stop-string switch through their tokenizer
(`req.tokenizer` is the scheduler's `TableTokenizer`).
"""

from __future__ import annotations

import logging
import os
import queue
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger("branchwise")
_STOP = object()
SEND_ENV = "BRANCHWISE_ASYNC_SEND"  # auto (default) | thread | inline


# ---------------------------------------------------------------- send half: ordered worker

class OrderedSender:
    """Drop-in for SGLang's SenderWrapper: send_output() enqueues, one worker thread sends in order.

    A send that fails in the worker is re-raised on the scheduler thread at the next send (SGLang
    would have raised in place), so a broken socket still stops the scheduler.
    """

    def __init__(self, inner: Any, name: str = "branchwise-output") -> None:
        self.inner = inner
        self.socket = inner.socket  # SGLang code reads .socket to test "am I the sending rank"
        self.q: queue.SimpleQueue = queue.SimpleQueue()
        self.error: BaseException | None = None
        self.inline = False  # set_enabled(False): send on the calling thread (queue drained first)
        self.sent = 0
        self.timer: Any = None  # the step timer (bench), set by its build
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def send_output(self, output: Any, recv_obj: Any = None) -> None:
        if self.error is not None:
            raise RuntimeError("Branchwise async output: a send failed in the worker") from self.error
        if self.inline:
            self.inner.send_output(output, recv_obj)
        elif self.socket is not None:  # non-entry TP ranks have no socket: nothing to send, as in SGLang
            self.q.put((output, recv_obj))

    def _run(self) -> None:
        while (item := self.q.get()) is not _STOP:
            if isinstance(item[0], _Marker):
                item[0].done.set()
                continue
            t0 = time.perf_counter()
            try:
                self.inner.send_output(*item)
                self.sent += 1
            except BaseException as e:  # noqa: BLE001 - handed to the scheduler thread
                logger.exception("Branchwise async output: send failed")
                self.error = e
                return
            if self.timer is not None:
                self.timer.add_worker(time.perf_counter() - t0)

    def drain(self, timeout_s: float = 10.0) -> bool:
        """Block until everything queued so far is sent; False if it was not within `timeout_s`
        (or the worker stopped at a failed send: what is queued will never be sent)."""
        if self.error is not None or not self.thread.is_alive():
            return False
        done = threading.Event()
        self.q.put((_Marker(done), None))
        return done.wait(timeout_s)

    def close(self) -> None:
        self.q.put(_STOP)
        self.thread.join(timeout=10)


@dataclass(slots=True)
class _Marker:
    """A queue item that sets an event instead of sending (drain)."""

    done: threading.Event


# ---------------------------------------------------------------- stop strings: byte lookup table

def _byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode (the ByteLevel pre-tokenizer's alphabet)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


@dataclass(slots=True)
class TokenTable:
    """token id -> raw bytes; decode(ids) = concatenated bytes decoded as UTF-8 with replacement.

    A dict, not a list: an id outside the table (negative, padded vocab) raises KeyError.
    """

    table: dict[int, bytes]

    def decode(self, ids: Any) -> str:
        t = self.table
        return b"".join([t[i] for i in ids]).decode("utf-8", "replace")

    @classmethod
    def build(cls, tokenizer: Any, checks: int = 400, seed: int = 0) -> tuple[TokenTable | None, str]:
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
        for i, p in enumerate(pieces):
            if p is None:
                return None, f"token {i} has no string"
            byte_ok = i not in added and all(c in inv for c in p)
            table[i] = bytes(inv[c] for c in p) if byte_ok else p.encode("utf-8")
        tt = cls(table)
        rng = random.Random(seed)
        n = len(table)
        singles = sorted(added | {rng.randrange(n) for _ in range(min(checks * 4, n))})
        seqs = [[i] for i in singles] + [[rng.randrange(n) for _ in range(rng.randint(2, 10))] for _ in range(checks)]
        seqs += [[rng.choice(singles)] + s for s in seqs[-checks // 4:]]  # added tokens next to bytes
        for s in seqs:
            if tt.decode(s) != tokenizer.decode(s):
                return None, f"table decode differs from tokenizer.decode on {s}"
        return tt, "ok"


def suffix_is_prefix(tail: str, stop: str) -> bool:
    """Whether some non-empty suffix of `tail` is a prefix of `stop` (SGLang's streaming hold-back).

    Same answer as SGLang's loop `any(tail[-i:] == stop[:i] for i in 1..min(len))`, but it only
    visits the places where `stop[0]` occurs in the window, found by str.find.
    """
    n = min(len(tail), len(stop))
    if n == 0:
        return False
    first, j = stop[0], tail.find(stop[0], len(tail) - n)
    while j != -1:
        if stop.startswith(tail[j:]):
            return True
        j = tail.find(first, j + 1)
    return False


def check_match_stop_str_prefix(req: Any) -> bool:
    """Req.check_match_stop_str_prefix with the prefix scan above (called per streamed row per step)."""
    stops = req.sampling_params.stop_strs
    if not stops:
        return False
    tail = req.tail_str()
    if not tail:
        return False
    return any(s and (s in tail or suffix_is_prefix(tail, s)) for s in stops)


class TableTokenizer:
    """The scheduler's tokenizer under --async-output, with decode(ids) served by a TokenTable when
    there is one (plain calls only); everything else is delegated unchanged.

    Requests use the scheduler's tokenizer for stop-string checks (`Req.tail_str` and friends call
    `tokenizer.decode(output_ids[-k:])` every step). It also carries the runtime switch of the
    stop-string paths: `enabled` turns the table and the prefix scan (`around_check_match_stop_str_prefix`,
    which finds it as `req.tokenizer`) off together.
    """

    def __init__(self, tokenizer: Any, table: TokenTable | None) -> None:
        self._tok = tokenizer
        self.table = table
        self.enabled = True

    def decode(self, ids: Any, *args: Any, **kwargs: Any) -> str:
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


def build(scheduler: Any, config: Any) -> AsyncOutput | None:
    """The scheduler's --async-output component (None when the flag is off)."""
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.managers.scheduler_components import output_streamer as os_mod

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
    st = AsyncOutput(
        sender=sender,
        stop_ids=stop_ids,
        think=bool(getattr(scheduler.model_config, "self_opened_think_start_ids", None)),
        plain_streamer=type(scheduler.output_streamer) is os_mod.SchedulerOutputStreamer,
        force_interval=os_mod.DEFAULT_FORCE_STREAM_INTERVAL,
        no_mamba=getattr(scheduler.req_to_token_pool, "mamba_pool", None) is None,
        check_all=_foreign_finish_hooks(Req),
        table_tok=table_tok,
    )
    setattr(scheduler.batch_result_processor.tree_cache, ATTR, st)
    logger.info("Branchwise async output on: sends on %s, stop-string lookup table %s",
                "a worker thread" if sender else "the scheduler thread", "on" if st.has_table else "off")
    return st


def _stop_ids(scheduler: Any) -> frozenset[int]:
    """The model's and the tokenizer's EOS and extra stop ids (the finish gate's superset test)."""
    ids = set(scheduler.model_config.hf_eos_token_id or ())
    tok = scheduler.tokenizer
    if tok is not None:
        if tok.eos_token_id is not None:
            ids.add(tok.eos_token_id)
        ids |= set(getattr(tok, "additional_stop_token_ids", None) or ())
    return frozenset(ids)


def _wrap_tokenizer(scheduler: Any) -> TableTokenizer | None:
    """Put a TableTokenizer in front of the scheduler's tokenizer (requests get it as req.tokenizer)."""
    tok = scheduler.tokenizer
    if tok is None:
        return None
    table, why = TokenTable.build(tok)
    if table is None:
        logger.info("Branchwise async output: stop strings keep tokenizer.decode (%s)", why)
    scheduler.tokenizer = wrapped = TableTokenizer(tok, table)
    return wrapped


def _send_on_thread(scheduler: Any) -> bool:
    """Whether sends go to the worker thread (env BRANCHWISE_ASYNC_SEND: auto = thread | inline).

    The worker takes the payload's pickling and send off the scheduler thread, at the price of some
    GIL waiting there (`python -m bench.overhead --ab --stream` compares both); `inline` keeps
    SGLang's placement (the other savings stay)."""
    if getattr(scheduler, "rust_server", None) is not None:  # the Rust egress ring has its own thread
        return False
    mode = os.environ.get(SEND_ENV, "auto").strip().lower()
    if mode not in ("auto", "thread", "inline"):
        raise ValueError(f"{SEND_ENV} must be auto, thread or inline, got {mode!r}")
    return mode != "inline"


def _foreign_finish_hooks(req_cls: Any) -> bool:
    """Whether a non-Branchwise plugin hooks Req.update_finish_state (it may expect every call)."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    hooks = getattr(HookRegistry, "_hooks", None)
    if hooks is None:
        return hasattr(req_cls.update_finish_state, "__wrapped__")
    mine = ("branchwise.", "branchwise")
    return any(not getattr(fn, "__module__", "").startswith(mine)
               for _, fn, _ in hooks.get(f"{req_cls.__module__}.Req.update_finish_state", []))


SWITCH_DRAIN_S = 10.0  # how long a runtime switch waits for the queued sends


def set_enabled(st: AsyncOutput, on: bool, drain_timeout_s: float = SWITCH_DRAIN_S,
                forward: Any = None) -> str | None:
    """Switch every part at once, between steps; None when switched, else why not (nothing changed).

    `forward` is the CPU forward thread (forward_thread.ForwardExecutor), part of --async-output:
    it stops taking new batches (queued ones finish). The sender drains first, so order is kept and only one thread ever sends on the socket: sends
    move to the scheduler thread only once the worker has sent everything queued. Called on the
    scheduler thread, the only one that queues sends, so nothing is queued after the drain."""
    if st.sender is not None:
        if not st.sender.drain(drain_timeout_s):
            why = "its send worker failed" if st.sender.error is not None else \
                f"sends still queued after {drain_timeout_s:g} s"
            return f"Branchwise async output: switch {'on' if on else 'off'} refused, {why}; nothing changed"
        st.sender.inline = not on
    if st.table_tok is not None:
        st.table_tok.enabled = on
    st.enabled = on
    if forward is not None:
        forward.enabled = on
    return None


def _qualifies(st: AsyncOutput, proc: Any, batch: Any, result: Any) -> bool:
    """Batches whose SGLang decode loop reduces to append + finish check + finish handling."""
    from sglang.srt.runtime_context import get_disagg

    lo = result.logits_output
    if not (st.no_mamba and batch.spec_algorithm.is_none() and not batch.return_logprob
            and batch.mamba_track_mask_cpu is None and result.auxiliary_host_output is None
            and result.routed_experts_output is None and result.indexer_topk_output is None
            and lo is not None and lo.customized_info is None and lo.sampling_mask_output is None
            and not get_disagg().disaggregation_decode_enable_offload_kvcache):
        return False
    return not any(r.beam_group is not None or r.grammar is not None or r.return_sampling_mask
                   or r.return_hidden_states or r.return_routed_experts or r.return_indexer_topk
                   for r in batch.reqs)


def _may_finish(st: AsyncOutput, req: Any, tok: int) -> bool:
    """A superset of Req.update_finish_state's conditions (grammar excluded by _qualifies).

    Rows tracked by Branchwise's server-side fork (`req.bw_fork`) always qualify: its hook on
    update_finish_state scans every step's tokens for branch tags.
    """
    sp = req.sampling_params
    return (req.to_finish is not None or getattr(req, "bw_fork", None) is not None
            or sp.max_new_tokens is None or len(req.output_ids) >= sp.max_new_tokens
            or tok < 0 or (req.vocab_size is not None and tok >= req.vocab_size)
            or tok in st.stop_ids
            or bool(sp.stop_token_ids and tok in sp.stop_token_ids)
            or bool(req.eos_token_ids and tok in req.eos_token_ids)
            or bool(sp.stop_strs) or bool(sp.stop_regex_strs))


def fast_decode_result(st: AsyncOutput, proc: Any, batch: Any, result: Any) -> None:
    """SchedulerBatchResultProcessor.process_batch_result_decode for a qualifying batch.

    Mirrors SGLang 0.5.23 step by step (batch_result_processor.py:952-1109); the per-row calls it
    skips are no-ops for such batches (mamba, customized info, logprobs, hidden states, grammar,
    beam commit), and rows that can finish go through SGLang's own finish check and handling.
    """
    from sglang.srt.runtime_context import get_observability

    if result.copy_done is not None:
        result.copy_done.synchronize()
    lo = result.logits_output
    ids = result.next_token_ids
    ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)
    bs = batch.batch_size()
    n_gen = result.get_num_generated_tokens(bs)
    proc.metrics_reporter.num_generated_tokens += n_gen
    if get_observability().enable_metrics:
        proc.metrics_collector.increment_decode_cuda_graph_pass(value=result.can_run_cuda_graph)

    allocator = proc.token_to_kv_pool_allocator
    allocator.free_group_begin()
    skip_done = proc.enable_overlap or proc.enable_overlap_mlx
    now = time.perf_counter()  # one clock read per step (SGLang reads it per row)
    for i, (req, tok) in enumerate(zip(batch.reqs, ids, strict=True)):
        if skip_done and (req.finished() or req.is_retracted):
            continue  # overlap: finished at the previous step, KV freed there (SGLang does the same)
        req.time_stats.set_last_decode_finish_time(now)
        req.output_ids.append(tok)
        if st.think or req.require_reasoning:
            proc._maybe_update_reasoning_tokens(req, [tok])
        if st.check_all or req.finished() or _may_finish(st, req, tok):  # finished: non-overlap
            req.update_finish_state(1)
            if req.finished():
                proc._handle_finish_state_updated_req(req, batch, result, i, lo)

    reqs = batch.reqs
    if st.plain_streamer:  # rows that would not emit (non-streaming, between force intervals)
        f = st.force_interval
        reqs = [r for r in reqs if r.stream or r.finished() or len(r.output_ids) % f == 0]
    proc.output_streamer.stream_output(reqs, batch.return_logprob)
    allocator.free_group_end()
    mr = proc.metrics_reporter
    mr.forward_ct_decode = (mr.forward_ct_decode + 1) % (1 << 30)
    mr.report_decode_stats(result.can_run_cuda_graph, running_batch=batch, num_generated_tokens=n_gen)
    st.stats["fast"] += 1


def around_process_batch_result_decode(orig: Any, self: Any, batch: Any, result: Any) -> Any:
    st = getattr(self.tree_cache, ATTR, None)
    if result.copy_done is not None:  # the forward thread fills the result in: qualify what it produced
        result.copy_done.synchronize()
    if st is None or not st.enabled or not _qualifies(st, self, batch, result):
        if st is not None:
            st.stats["stock"] += 1
        return orig(self, batch, result)
    return fast_decode_result(st, self, batch, result)


# ---------------------------------------------------------------- hook bodies (targets in plugin.py)

def around_check_match_stop_str_prefix(orig: Any, req: Any) -> bool:
    tok = req.tokenizer
    return check_match_stop_str_prefix(req) if type(tok) is TableTokenizer and tok.enabled else orig(req)


SWITCH_KEY = "branchwise_async_output"  # POST /set_internal_state {"server_args": {SWITCH_KEY: 0 | 1}}


def around_set_internal_state(orig: Any, self: Any, recv_req: Any, *args: Any, **kwargs: Any) -> Any:
    """Runtime on/off switch of --async-output (bench A/B in one server); other keys go to SGLang.

    A switch that cannot drain the queued sends is refused as a whole (updated=False to the caller,
    the reason in the log, like SGLang's own rejected updates); the caller may retry."""
    req_args = getattr(recv_req, "server_args", None) or {}
    if SWITCH_KEY not in req_args:
        return orig(self, recv_req, *args, **kwargs)
    from sglang.srt.managers.io_struct import SetInternalStateReqOutput

    bw = self.branchwise
    st = bw.async_output
    why = None if st is None else set_enabled(st, bool(req_args[SWITCH_KEY]), SWITCH_DRAIN_S, bw.forward)
    if why is not None:
        logger.warning(why)
        return SetInternalStateReqOutput(updated=False)
    rest = {k: v for k, v in req_args.items() if k != SWITCH_KEY}
    if rest:
        recv_req.server_args = rest
        return orig(self, recv_req, *args, **kwargs)
    return SetInternalStateReqOutput(updated=st is not None)
