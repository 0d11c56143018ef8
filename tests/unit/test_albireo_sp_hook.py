"""--parallel-sampling hook bodies with stand-ins for SGLang's ModelRunner and batch (tp=1); the
state reaches them as build attaches it (on the runner, on the tree cache the batch references)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from branchwise.albireo import sp_sampler_hook as sp
from branchwise.albireo.parallel_sampler import RowParams, sample_rows


@pytest.fixture
def state():
    return sp.SPState(tp_size=1, tp_group=None, inject_seeds=True)


def batch_info(n: int, greedy: bool = False, seeds: list[int] | None = None) -> SimpleNamespace:
    temps = torch.full((n, 1), 1.0 if greedy else 0.8)
    return SimpleNamespace(
        temperatures=temps, top_ps=torch.full((n,), 0.9), top_ks=torch.full((n,), 1 if greedy else 20, dtype=torch.int32),
        min_ps=torch.zeros(n), sampling_seed=None if seeds is None else torch.tensor(seeds),
        is_all_greedy=greedy, need_top_k_sampling=not greedy, need_top_p_sampling=not greedy,
        need_min_p_sampling=False, grammars=None, has_custom_logit_processor=False,
        has_watermark_candidates=False, sampling_mask_batch_indices=None)


class Runner:
    """What around_sample touches on ModelRunner."""

    def __init__(self, st: sp.SPState | None = None) -> None:
        if st is not None:
            setattr(self, sp.ATTR, st)
        self.preprocessed = 0
        self.watermark_state = self.sampling_observer = None
        self.sampler = SimpleNamespace(_preprocess_logits=lambda logits, info: logits)
        self.ngram_embedding_manager = SimpleNamespace(update_after_decode=lambda **kw: None)

    def _preprocess_logits(self, logits_output, info) -> None:
        self.preprocessed += 1


def forward_batch(info, n: int, logprob: bool = False) -> SimpleNamespace:
    return SimpleNamespace(sampling_info=info, return_logprob=logprob, positions=torch.arange(n) + 10,
                           seq_lens=torch.arange(n) + 11, forward_mode=SimpleNamespace(is_decode=lambda: True))


def _reqs(st: sp.SPState | None, *rid_seed: tuple[str, int | None]) -> SimpleNamespace:
    """A ScheduleBatch: its rows, and the scheduler's tree cache (where build put the state)."""
    tree = SimpleNamespace(**({sp.ATTR: st} if st is not None else {}))
    return SimpleNamespace(tree_cache=tree,
                           reqs=[SimpleNamespace(rid=rid, sampling_params=SimpleNamespace(sampling_seed=s))
                                 for rid, s in rid_seed])


def test_seeded_rows_keep_their_seed_unseeded_rows_get_one_per_request(state):
    state.nonce = 99
    info = sp.after_from_schedule_batch(batch_info(4), None, _reqs(state, ("a", None), ("b", 123), ("c", None), ("d", -5)), 460)
    seeds = info.sampling_seed.tolist()
    assert info.sampling_seed.dtype == torch.int64
    assert seeds[1] == 123 and seeds[3] == -5  # as given
    assert seeds[0] == sp.request_seed(99, "a") and seeds[2] == sp.request_seed(99, "c") and seeds[0] != seeds[2]
    # a function of (nonce, rid) only: the same rid gets the same seed in any batch, another nonce another one
    again = sp.after_from_schedule_batch(batch_info(2), None, _reqs(state, ("x", 1), ("c", None)), 460)
    assert again.sampling_seed.tolist() == [1, seeds[2]]
    state.nonce = 100
    assert sp.after_from_schedule_batch(batch_info(1), None, _reqs(state, ("c", None)), 460).sampling_seed.item() != seeds[2]


def test_request_seeds_are_distinct_int64():
    seeds = {sp.request_seed(7, f"{i:032x}") for i in range(10_000)}
    assert len(seeds) == 10_000
    assert all(-(2**63) <= s < 2**63 for s in seeds) and min(seeds) < 0 < max(seeds)


def test_shared_nonce_follows_random_seed_and_is_rank_0s_under_tp(monkeypatch):
    assert sp.shared_nonce(0, 1, None) == sp.shared_nonce(0, 1, None) != sp.shared_nonce(1, 1, None)
    assert sp.shared_nonce(None, 1, None) != sp.shared_nonce(None, 1, None)  # no --random-seed: fresh
    sent = []

    def broadcast(t, src, group):  # what rank 1 receives: rank 0's value
        sent.append((src, group))
        t.fill_(1234)

    monkeypatch.setattr(sp.dist, "broadcast", broadcast)
    group = SimpleNamespace(ranks=[4, 5], cpu_group="gloo-cpu")
    assert sp.shared_nonce(0, 2, group) == 1234 and sent == [(4, "gloo-cpu")]


def test_seeds_left_alone_when_sglang_provides_them(state):
    state.inject_seeds = False
    info = batch_info(2, seeds=[7, 8])
    assert sp.after_from_schedule_batch(info, None, _reqs(state, ("a", None), ("b", None)), 460).sampling_seed.tolist() == [7, 8]


def test_sp_path_samples_every_row_with_its_seed(state):
    torch.manual_seed(0)
    n, v = 5, 460
    logits = torch.randn(n, v)
    info = batch_info(n, seeds=[1, 2, 3, 4, 5])
    runner, fb = Runner(state), forward_batch(info, n)
    out = SimpleNamespace(next_token_logits=logits.clone(), auxiliary_device_output="stale")

    def orig(*a, **k):
        raise AssertionError("SGLang's sampler must not run for a covered batch")

    ids = sp.around_sample(orig, runner, out, fb)
    want = sample_rows(logits, RowParams.from_sampling_info(info, fb.positions))
    assert ids.tolist() == want.tolist() and runner.preprocessed == 1
    assert out.auxiliary_device_output is None and state.sp_steps == 1
    # a row's token does not depend on the rows around it
    one = sample_rows(logits[2:3], RowParams.from_sampling_info(batch_info(1, seeds=[3]), fb.positions[2:3]))
    assert one.tolist() == [ids[2].item()]


def test_fallback_hides_injected_seeds_and_counts_once_per_reason(state):
    info = batch_info(3, seeds=[1, 2, 3])
    seen = []

    def orig(runner, out, fb):
        seen.append(fb.sampling_info.sampling_seed)
        return torch.zeros(3, dtype=torch.int64)

    for _ in range(2):
        sp.around_sample(orig, Runner(state), SimpleNamespace(next_token_logits=torch.zeros(3, 8)),
                         forward_batch(info, 3, logprob=True))
    assert seen == [None, None]  # the stock sampler ran unseeded, as without the flag
    assert info.sampling_seed.tolist() == [1, 2, 3]  # and the rows keep their seeds afterwards
    assert state.fallbacks == {"logprobs requested": 2} and state.sp_steps == 0


def test_fallback_reasons(state):
    runner = Runner()
    out = SimpleNamespace(next_token_logits=torch.zeros(2, 8))
    info = batch_info(2, seeds=[1, 2])
    assert sp._fallback_reason(runner, forward_batch(info, 2), out) is None
    info.grammars = [None, object()]
    assert "grammar" in sp._fallback_reason(runner, forward_batch(info, 2), out)
    info.grammars, info.has_custom_logit_processor = None, True
    assert "custom" in sp._fallback_reason(runner, forward_batch(info, 2), out)
    info.has_custom_logit_processor, info.sampling_seed = False, torch.tensor([1])
    assert "seeds" in sp._fallback_reason(runner, forward_batch(info, 2), out)


def test_flag_off_is_a_pass_through():
    sentinel = object()
    assert sp.around_sample(lambda *a, **k: sentinel, Runner(), None, None) is sentinel
    assert sp.around_forward(lambda *a, **k: sentinel, Runner(), None) is sentinel
    info = batch_info(2)
    assert sp.after_from_schedule_batch(info, None, _reqs(None, ("a", None)), 460).sampling_seed is None
