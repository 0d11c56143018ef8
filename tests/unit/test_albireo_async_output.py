"""--async-output pieces without a server: ordered sender, stop-string lookup table, finish gate."""

from __future__ import annotations

import os
import random
import threading
from array import array
from types import SimpleNamespace

import pytest

from branchwise.albireo.async_output import (
    AsyncOutput,
    OrderedSender,
    TableTokenizer,
    TokenTable,
    _may_finish,
    check_match_stop_str_prefix,
)
from branchwise.tools.tiny_model import build_tokenizer


class Recorder:
    """Stands in for SGLang's SenderWrapper; records the thread each send ran on."""

    def __init__(self, socket: object = object(), fail_on: object = None) -> None:
        self.socket = socket
        self.fail_on = fail_on
        self.got: list[tuple[object, object, str]] = []

    def send_output(self, output: object, recv_obj: object = None) -> None:
        if output == self.fail_on:
            raise OSError("socket gone")
        self.got.append((output, recv_obj, threading.current_thread().name))


def sender(inner: Recorder) -> OrderedSender:
    return OrderedSender(inner, name="test-sender")


def test_sender_keeps_order_and_sends_off_the_calling_thread():
    rec = Recorder()
    s = sender(rec)
    for i in range(500):
        s.send_output(i, f"r{i}")
    assert s.drain()
    assert [(o, r) for o, r, _ in rec.got] == [(i, f"r{i}") for i in range(500)]
    assert {t for _, _, t in rec.got} == {"test-sender"}
    assert s.sent == 500
    s.close()


def test_sender_without_socket_sends_nothing():
    rec = Recorder(socket=None)  # non-entry TP ranks: SGLang's SenderWrapper drops everything
    s = sender(rec)
    s.send_output("x")
    assert s.drain() and rec.got == [] and s.sent == 0
    s.close()


def test_failed_send_is_raised_on_the_next_send():
    rec = Recorder(fail_on="bad")
    s = sender(rec)
    s.send_output("ok")
    s.send_output("bad")
    s.thread.join(timeout=10)  # the worker stops at the failure
    assert not s.thread.is_alive() and [o for o, _, _ in rec.got] == ["ok"]
    with pytest.raises(RuntimeError, match="send failed") as e:
        s.send_output("after")
    assert isinstance(e.value.__cause__, OSError)


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(seed=0)


def test_table_decode_equals_tokenizer_decode(tok):
    table, why = TokenTable.build(tok)
    assert table is not None, why
    rng = random.Random(1)
    n = len(tok)
    specials = list(tok.all_special_ids)
    for _ in range(2000):  # random ids cut multi-byte characters: replacement characters must agree
        ids = [rng.randrange(n) for _ in range(rng.randint(0, 12))]
        if rng.random() < 0.2:
            ids.insert(rng.randint(0, len(ids)), rng.choice(specials))
        assert table.decode(ids) == tok.decode(ids), ids
    text = "héllo wörld — ünïcode ✓ 東京 the plan is"
    ids = tok.encode(text)
    assert table.decode(ids) == tok.decode(ids) == text


def test_table_tokenizer_delegates_everything_else(tok):
    table, _ = TokenTable.build(tok)
    tt = TableTokenizer(tok, table)
    ids = tok.encode("the plan is")
    assert tt.decode(ids) == tok.decode(ids)
    assert tt.decode(ids + [10**6]) == tok.decode(ids + [10**6])  # unknown id: the tokenizer decides
    assert tt.decode(ids, skip_special_tokens=True) == tok.decode(ids, skip_special_tokens=True)
    assert tt.eos_token_id == tok.eos_token_id and len(tt) == len(tok)
    assert tt.encode("abc") == tok.encode("abc")
    plain = TableTokenizer(tok, None)  # no table (not byte-level): every decode is the tokenizer's
    assert plain.decode(ids) == tok.decode(ids) and plain.eos_token_id == tok.eos_token_id


def test_stop_prefix_scan_runs_for_requests_of_an_enabled_async_output_scheduler(tok):
    from branchwise.albireo.async_output import around_check_match_stop_str_prefix

    calls = []

    def stock(req):
        calls.append(req)
        return "stock"

    tail = SimpleNamespace(sampling_params=SimpleNamespace(stop_strs=["ab"]), tail_str=lambda: "xa")
    tt = TableTokenizer(tok, None)  # the scheduler's tokenizer under --async-output: req.tokenizer
    assert around_check_match_stop_str_prefix(stock, SimpleNamespace(**vars(tail), tokenizer=tt)) is True
    tt.enabled = False  # the runtime switch
    assert around_check_match_stop_str_prefix(stock, SimpleNamespace(**vars(tail), tokenizer=tt)) == "stock"
    assert around_check_match_stop_str_prefix(stock, SimpleNamespace(**vars(tail), tokenizer=tok)) == "stock"
    assert len(calls) == 2


def test_table_refuses_non_byte_level_tokenizers(tok):
    from tokenizers import decoders

    other = build_tokenizer(seed=0)
    other.backend_tokenizer.decoder = decoders.Metaspace()
    table, why = TokenTable.build(other)
    assert table is None and "Metaspace" in why
    cleanup = build_tokenizer(seed=0)
    cleanup.clean_up_tokenization_spaces = True
    assert TokenTable.build(cleanup)[0] is None


# ---- the finish gate against SGLang's own Req.update_finish_state (imports sglang: slower)

@pytest.fixture(scope="module")
def sglang_req():
    os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    return Req, SamplingParams


def test_gate_never_skips_a_row_sglang_would_finish(sglang_req):
    """Whenever _may_finish says "cannot finish", SGLang's update_finish_state leaves the row running."""
    Req, SamplingParams = sglang_req
    tok = build_tokenizer(seed=0)
    tok.additional_stop_token_ids = {5}  # SGLang's get_tokenizer sets this (e.g. <|im_end|>)
    st = AsyncOutput(sender=None, stop_ids=frozenset({tok.eos_token_id, 5}), think=False, plain_streamer=True,
                     force_interval=50, no_mamba=True, check_all=False)
    rng = random.Random(7)
    vocab = len(tok)
    finished = skipped = 0
    for k in range(3000):
        kw = {"max_new_tokens": rng.randint(1, 12), "ignore_eos": rng.random() < 0.3}
        if rng.random() < 0.3:
            kw["stop_token_ids"] = [rng.randrange(vocab) for _ in range(2)]
        if rng.random() < 0.2:
            kw["stop"] = [tok.decode([rng.randrange(6, vocab)])]
        sp = SamplingParams(**kw)
        sp.normalize(tok)
        req = Req(f"r{k}", "x", array("q", [1, 2, 3]), sp, vocab_size=vocab - rng.randint(0, 20),
                  eos_token_ids={tok.eos_token_id} if rng.random() < 0.5 else None)
        req.tokenizer = tok
        while not req.finished():
            t = rng.randrange(-1, vocab + 5) if rng.random() < 0.05 else rng.randrange(vocab)
            req.output_ids.append(t)
            if _may_finish(st, req, t):
                req.update_finish_state(1)
            else:
                skipped += 1
                req.update_finish_state(1)
                assert not req.finished(), (kw, list(req.output_ids))
            if rng.random() < 0.02 and not req.finished():
                req.to_finish = SimpleNamespace(to_json=lambda: {"type": "abort"})
        finished += 1
    assert finished == 3000 and skipped > 1000  # the gate does skip most rows


def test_stop_prefix_scan_equals_sglang(sglang_req):
    Req, _ = sglang_req
    rng = random.Random(3)
    alphabet = "ab c\n</>é"
    hits = 0
    for _ in range(20000):
        tail = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 12)))
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 6))) for _ in range(rng.randint(0, 3))]
        req = SimpleNamespace(sampling_params=SimpleNamespace(stop_strs=stops), tail_str=lambda t=tail: t)
        want = Req.check_match_stop_str_prefix(req)
        assert check_match_stop_str_prefix(req) == want, (tail, stops)
        hits += want
    assert 2000 < hits < 18000  # both outcomes well covered


def test_send_thread_unless_inline_or_rust_egress(monkeypatch):
    from branchwise.albireo.async_output import SEND_ENV, _send_on_thread

    def sched(rust: object = None) -> SimpleNamespace:
        return SimpleNamespace(server_args=SimpleNamespace(device="cpu"), rust_server=rust)

    monkeypatch.delenv(SEND_ENV, raising=False)
    assert _send_on_thread(sched())
    assert not _send_on_thread(sched(rust=object()))  # the Rust egress ring has its own thread
    monkeypatch.setenv(SEND_ENV, "inline")
    assert not _send_on_thread(sched())
    monkeypatch.setenv(SEND_ENV, "sometimes")
    with pytest.raises(ValueError, match="auto, thread or inline"):
        _send_on_thread(sched())


class GatedRecorder(Recorder):
    """A socket whose sends block until `gate` opens; records (thread, concurrent senders) per send."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.inside = 0
        self.overlaps = 0

    def send_output(self, output: object, recv_obj: object = None) -> None:
        self.inside += 1
        self.overlaps += self.inside > 1
        try:
            assert self.gate.wait(10)
            super().send_output(output, recv_obj)
        finally:
            self.inside -= 1


def _state(s: OrderedSender) -> AsyncOutput:
    return AsyncOutput(sender=s, stop_ids=frozenset(), think=False, plain_streamer=True, force_interval=1,
                       no_mamba=True, check_all=False)


def test_switch_off_is_refused_until_the_queue_drains_then_sends_move_to_the_caller():
    from branchwise.albireo.async_output import set_enabled

    rec = GatedRecorder()
    s = sender(rec)
    st = _state(s)
    forward = SimpleNamespace(enabled=True)  # the CPU forward thread switches with the rest
    s.send_output("a")
    s.send_output("b")  # the worker is stuck sending "a": "b" stays queued
    why = set_enabled(st, False, drain_timeout_s=0.05, forward=forward)
    assert why is not None and "refused" in why and "still queued" in why
    assert st.enabled and not s.inline and forward.enabled  # nothing changed: sends stay on the worker
    s.send_output("c")
    rec.gate.set()
    assert set_enabled(st, False, drain_timeout_s=10, forward=forward) is None
    assert not st.enabled and s.inline and not forward.enabled
    s.send_output("d")  # now on the calling thread
    assert [(o, t) for o, _, t in rec.got] == [("a", "test-sender"), ("b", "test-sender"), ("c", "test-sender"),
                                               ("d", threading.current_thread().name)]
    assert rec.overlaps == 0  # never two threads on the socket
    assert set_enabled(st, True) is None and st.enabled and not s.inline
    s.close()


def test_switch_is_refused_after_a_failed_send():
    from branchwise.albireo.async_output import set_enabled

    rec = Recorder(fail_on="bad")
    s = sender(rec)
    st = _state(s)
    s.send_output("bad")
    s.thread.join(timeout=10)
    why = set_enabled(st, False, drain_timeout_s=10)  # returns at once: the worker is gone
    assert why is not None and "failed" in why and not s.inline and st.enabled


def test_set_internal_state_reports_a_refused_switch(monkeypatch):
    from branchwise.albireo import async_output as ao

    rec = GatedRecorder()
    s = sender(rec)
    monkeypatch.setattr(ao, "SWITCH_DRAIN_S", 0.05)
    scheduler = SimpleNamespace(branchwise=SimpleNamespace(async_output=_state(s), forward=None))
    s.send_output("a")
    s.send_output("b")

    def orig(*a, **k):
        raise AssertionError("a refused switch must not apply the request's other keys")

    req = SimpleNamespace(server_args={ao.SWITCH_KEY: 0, "pp_max_micro_batch_size": 4})
    assert ao.around_set_internal_state(orig, scheduler, req).updated is False
    assert not s.inline
    rec.gate.set()
    assert ao.around_set_internal_state(orig, scheduler, SimpleNamespace(server_args={ao.SWITCH_KEY: 0})).updated
    assert s.inline and rec.overlaps == 0
    s.close()


def test_decode_results_take_the_fast_path_only_through_the_state_build_attached(monkeypatch):
    """The result processor (a frozen slotted dataclass in SGLang) reaches the state through its tree
    cache; without one, or switched off, SGLang's own decode loop runs."""
    from branchwise.albireo import async_output as ao

    st = _state(None)
    fast = []
    monkeypatch.setattr(ao, "_qualifies", lambda *a: True)
    monkeypatch.setattr(ao, "fast_decode_result", lambda st, proc, batch, result: fast.append(batch))
    result = SimpleNamespace(copy_done=None)

    def stock(proc, batch, result):
        return "stock"

    plain = SimpleNamespace(tree_cache=SimpleNamespace())
    assert ao.around_process_batch_result_decode(stock, plain, "b0", result) == "stock"
    proc = SimpleNamespace(tree_cache=SimpleNamespace(**{ao.ATTR: st}))
    assert ao.around_process_batch_result_decode(stock, proc, "b1", result) is None and fast == ["b1"]
    st.enabled = False
    assert ao.around_process_batch_result_decode(stock, proc, "b2", result) == "stock"
    assert fast == ["b1"] and st.stats["stock"] == 1
