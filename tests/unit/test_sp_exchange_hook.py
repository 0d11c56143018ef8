"""The all-to-all wiring of --parallel-sampling (sp_sampler_hook) with stand-ins for SGLang objects.

The collective itself is tested over real gloo groups (test_parallel_sampler_dist.py) and inside a
real tp=2 server (tests/integration/test_sp_logits.py); here: which batches arm it, that SGLang's
gatherer is swapped for exactly one decode _get_logits call and restored, what the sampler gets,
and how the hooks find the state build attached (runner, the model's LogitsProcessors).
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

from branchwise.albireo import sp_sampler_hook as sp
from branchwise.albireo.parallel_sampler import rows_per_rank

V = 50


def mode(decode: bool) -> SimpleNamespace:
    return SimpleNamespace(is_decode=lambda: decode)


def info(n: int, **kw) -> SimpleNamespace:
    base = dict(temperatures=torch.ones(n, 1), top_ps=torch.ones(n), top_ks=torch.full((n,), 1, dtype=torch.int32),
                min_ps=torch.zeros(n), sampling_seed=torch.arange(n), is_all_greedy=True,
                need_top_k_sampling=False, need_top_p_sampling=False, need_min_p_sampling=False,
                grammars=None, has_custom_logit_processor=False, has_watermark_candidates=False,
                sampling_mask_batch_indices=None, logit_bias=None, acc_additive_penalties=None,
                acc_scaling_penalties=None, penalizer_orchestrator=None)
    return SimpleNamespace(**(base | kw))


def fbatch(n: int, decode: bool = True, logprob: bool = False, **kw) -> SimpleNamespace:
    return SimpleNamespace(batch_size=n, forward_mode=mode(decode), sampling_info=info(n, **kw),
                           return_logprob=logprob, positions=torch.arange(n), seq_lens=torch.arange(n) + 1)


def runner(st: sp.SPState | None = None, *lps: torch.nn.Module) -> SimpleNamespace:
    """What the hooks touch on ModelRunner; `st` attached as build does, `lps` make up its model."""
    r = SimpleNamespace(watermark_state=None, sampling_observer=None, model=torch.nn.ModuleList(lps),
                        sampler=SimpleNamespace(_preprocess_logits=lambda logits, info: logits),
                        ngram_embedding_manager=SimpleNamespace(update_after_decode=lambda **kw: None))
    if st is not None:
        setattr(r, sp.ATTR, st)
    return r


RUNNER = runner()  # for the batch-only decisions


@pytest.fixture
def st(monkeypatch):
    state = sp.SPState(tp_size=2, tp_group=None, inject_seeds=True)
    # rank 0 of 2, the other rank's columns left out: the plumbing is under test, not the collective
    monkeypatch.setattr(sp, "exchange_rows", lambda shard, t, a2a: shard[: rows_per_rank(shard.shape[0], t)])
    return state


class Custom:
    def __init__(self, prepared: bool = True) -> None:
        self.prepared = prepared

    def is_prepared(self) -> bool:
        return self.prepared


class StockPenalizer(Custom):
    pass


StockPenalizer.__name__ = "BatchedFrequencyPenalizer"


def orch_of(pen: Custom, required: bool = True) -> SimpleNamespace:
    return SimpleNamespace(is_required=required, penalizers={type(pen): pen})


def test_gather_reason_is_a_function_of_the_batch():
    assert sp._gather_reason(RUNNER, fbatch(5)) is None
    assert sp._gather_reason(RUNNER, fbatch(5, logprob=True)) == "logprobs requested"
    assert sp._gather_reason(RUNNER, fbatch(5, grammars=[None] * 5)) == "grammar-constrained rows"
    # penalties and logit_bias: applied to each rank's row block, so the all-to-all
    assert sp._gather_reason(RUNNER, fbatch(5, logit_bias=torch.zeros(5, V))) is None
    assert sp._gather_reason(RUNNER, fbatch(5, acc_additive_penalties=torch.zeros(5, V))) is None
    assert sp._gather_reason(RUNNER, fbatch(5, acc_scaling_penalties=torch.ones(5, V))) is None
    assert sp._gather_reason(RUNNER, fbatch(5, penalizer_orchestrator=orch_of(StockPenalizer()))) is None
    assert sp._gather_reason(RUNNER, fbatch(5, penalizer_orchestrator=orch_of(Custom()))) == sp.UNKNOWN_PENALIZER
    assert sp._gather_reason(RUNNER, fbatch(5, penalizer_orchestrator=orch_of(Custom(), required=False))) is None
    assert sp._gather_reason(RUNNER, fbatch(5, penalizer_orchestrator=orch_of(Custom(prepared=False)))) is None
    tail = fbatch(5)
    tail.batch_size = 7  # rows past the requests (a beam tail): no sampling params for them
    assert sp._gather_reason(RUNNER, tail) == "rows without sampling params or seeds"
    assert sp._gather_reason(RUNNER, fbatch(5, sampling_seed=None)) == "rows without sampling params or seeds"


@pytest.fixture(scope="module")
def LP():
    os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
    from sglang.srt.layers.logits_processor import LogitsProcessor

    class LP(LogitsProcessor):
        """SGLang's LogitsProcessor (an nn.Module, as build finds it in the model) with what
        around_get_logits touches set by hand; get_logits mirrors the stock _get_logits call shape."""

        def __init__(self) -> None:
            torch.nn.Module.__init__(self)
            self.do_tensor_parallel_all_gather = True
            self.use_attn_tp_group = self.do_tensor_parallel_all_gather_dp_attn = False
            self.stock_calls = 0
            self._logits_gatherer = self.stock_gather
            self.used: list[object] = []  # the gatherer each _get_logits call ran with

        def stock_gather(self, x: torch.Tensor) -> torch.Tensor:
            self.stock_calls += 1
            return x

        def get_logits(self, hidden: torch.Tensor, metadata) -> torch.Tensor:
            def orig(lp, h, _lm, _md):
                lp.used.append(lp._logits_gatherer)
                return lp._logits_gatherer(h * 2)

            return sp.around_get_logits(orig, self, hidden, None, metadata)

    return LP


def test_armed_decode_forward_exchanges_once_and_restores_the_gatherer(st, monkeypatch, LP):
    lp, fb, hidden = LP(), fbatch(5), torch.randn(5, V)
    r = runner(st, lp)
    got = {}

    def forward(runner, fb):
        got["logits"] = lp.get_logits(hidden, SimpleNamespace(forward_mode=mode(True)))
        return SimpleNamespace(can_run_graph=False)

    sp.around_forward(forward, r, fb)
    assert vars(lp)[sp.ATTR] is st and st.model is r.model  # the model's processors found the state
    assert isinstance(lp.used[0], sp._AllToAll)  # swapped for the call, then restored
    assert lp._logits_gatherer == lp.stock_gather and lp.stock_calls == 0
    assert fb._branchwise_sp_exchange.done and fb._branchwise_sp_exchange.batch_size == 5
    assert torch.equal(got["logits"], hidden[:3] * 2)  # rank 0's ceil(5/2) rows
    assert lp.get_logits(hidden, SimpleNamespace(forward_mode=mode(True))).shape == (5, V)  # not armed
    assert lp.stock_calls == 1

    seen = {}

    def own_rows(mine, p, bs, group):
        seen.update(mine=mine, bs=bs, n=p.n, group=group)
        return torch.zeros(bs, dtype=torch.int64)

    def orig(*a, **k):
        raise AssertionError("SGLang's sampler must not see a row block")

    st.tp_group = SimpleNamespace(cpu_group="cpu", device_group="dev")
    monkeypatch.setattr(sp, "sample_own_rows", own_rows)
    ids = sp.around_sample(orig, r, SimpleNamespace(next_token_logits=got["logits"]), fb)
    assert ids.shape == (5,) and seen["bs"] == 5 and seen["n"] == 5 and seen["mine"].shape == (3, V)
    assert seen["group"] == "dev"  # the forward's group: cpu_group belongs to the scheduler thread
    assert st.a2a_steps == 1 and st.sp_steps == 1


def test_a_model_replaced_by_a_weight_update_gets_the_state_at_its_next_decode_forward(st, LP):
    old, new, hidden = LP(), LP(), torch.randn(4, V)
    r = runner(st, old)
    decode = SimpleNamespace(forward_mode=mode(True))
    sp.around_forward(lambda runner, fb: old.get_logits(hidden, decode), r, fbatch(4))
    r.model = torch.nn.ModuleList([new])  # ModelRunner.update_model_fields
    fb = fbatch(4)
    sp.around_forward(lambda runner, fb: new.get_logits(hidden, decode), r, fb)
    assert isinstance(new.used[0], sp._AllToAll) and fb._branchwise_sp_exchange.done
    assert st.model is r.model and st.a2a_steps == 0  # counted when sampled


def test_batches_that_keep_the_all_gather(st, LP):
    lp, hidden = LP(), torch.randn(4, V)
    r = runner(st, lp)

    def forward_with(metadata_decode: bool, rows: int):
        def forward(runner, fb):
            lp.get_logits(hidden[:rows], SimpleNamespace(forward_mode=mode(metadata_decode)))
            return SimpleNamespace(can_run_graph=False)
        return forward

    fb = fbatch(4, penalizer_orchestrator=orch_of(Custom()))  # an unknown penalizer: never armed, counted
    sp.around_forward(forward_with(True, 4), r, fb)
    assert fb._branchwise_sp_exchange is None and st.gathered == {sp.UNKNOWN_PENALIZER: 1}
    fb = fbatch(4, logprob=True)  # a stock-sampler batch: counted as a fallback when sampled, not here
    sp.around_forward(forward_with(True, 4), r, fb)
    assert fb._branchwise_sp_exchange is None and len(st.gathered) == 1
    fb = fbatch(4)  # armed, but the model's logits call is not the batch's decode rows
    sp.around_forward(forward_with(True, 3), r, fb)
    assert fb._branchwise_sp_exchange is None and st.gathered["all-gather kept in the model"] == 1
    fb = fbatch(4)
    sp.around_forward(lambda runner, fb: SimpleNamespace(can_run_graph=True), r, fb)  # graph replay
    assert fb._branchwise_sp_exchange is None and st.gathered["CUDA graph replay"] == 1
    assert lp.stock_calls == 3 and lp._logits_gatherer == lp.stock_gather
    fb = fbatch(4, decode=False)  # extend: untouched
    sp.around_forward(lambda runner, fb: None, r, fb)
    assert not hasattr(fb, "_branchwise_sp_exchange")
    st.tp_size = 1  # nothing is gathered at tp=1
    fb = fbatch(4)
    sp.around_forward(lambda runner, fb: None, r, fb)
    assert not hasattr(fb, "_branchwise_sp_exchange")


def test_row_block_gets_its_own_rows_of_bias_and_penalties(st, monkeypatch):
    """Rank 1 of 2, bs = 5: its block is batch rows 3, 4 plus one padding row (left as it came)."""
    st.tp_rank = 1
    st.tp_group = SimpleNamespace(cpu_group="cpu", device_group="dev")
    bias = torch.arange(5 * V, dtype=torch.float32).view(5, V)
    add = torch.full((5, V), -0.5)
    fb = fbatch(5, logit_bias=bias, acc_additive_penalties=add)
    fb._branchwise_sp_exchange = sp.ExchangePlan(batch_size=5, done=True)
    block = torch.ones(3, V)
    seen = {}

    def own_rows(mine, p, bs, group):
        seen["mine"] = mine.clone()
        return torch.zeros(bs, dtype=torch.int64)

    monkeypatch.setattr(sp, "sample_own_rows", own_rows)
    sp.around_sample(None, runner(st), SimpleNamespace(next_token_logits=block), fb)
    assert torch.equal(seen["mine"][:2], 1.0 + add[3:] + bias[3:])  # stock order: penalties, then bias
    assert torch.equal(seen["mine"][2], torch.ones(V))
    assert st.a2a_steps == 1 and st.a2a_transform_steps == 1
