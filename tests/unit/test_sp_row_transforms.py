"""Penalties and logit_bias on a row block (sp_sampler_hook.apply_row_transforms) vs SGLang's full rows.

Real SGLang SamplingBatchInfo and penalizers (stand-in requests): for every TP degree and rank, the
rank's block of rows transformed alone must be bit-identical to the same rows of stock
`apply_logits_bias` on the whole batch, in both forms SGLang feeds the sampler (the orchestrator
itself, and copy_for_forward's accumulated tensors, which every 0.5.23 forward uses), also for a
TAPER sub-batch (deferral's sliced orchestrator). The penalizer state is only read.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch
from sglang.srt.sampling import penaltylib
from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo

from branchwise import deferral
from branchwise.albireo import sp_sampler_hook as sp
from branchwise.albireo.parallel_sampler import own_rows, rows_per_rank, transform_own_rows

V = 97
EOS = 3
# per row: frequency, presence, repetition, min_new_tokens (row 4 has none: a neutral row in the batch)
PARAMS = [(1.5, 0.0, 1.0, 0), (0.0, 0.7, 1.3, 0), (0.4, 0.2, 0.8, 6), (0.0, 0.0, 1.0, 9), (0.0, 0.0, 1.0, 0),
          (2.0, 1.0, 1.1, 2), (0.3, 0.0, 1.0, 0)]


class Batch:  # the orchestrator holds a weakref to its ScheduleBatch and reads .reqs
    def __init__(self, reqs: list[SimpleNamespace]) -> None:
        self.reqs, self.device = reqs, "cpu"


def req(freq: float, pres: float, rep: float, min_new: int) -> SimpleNamespace:
    sp_ = SimpleNamespace(frequency_penalty=freq, presence_penalty=pres, repetition_penalty=rep,
                          min_new_tokens=min_new, stop_token_ids={7})
    return SimpleNamespace(sampling_params=sp_, eos_token_ids={EOS},
                           tokenizer=SimpleNamespace(additional_stop_token_ids=None, eos_token_id=EOS))


def make_info(n: int, bias: bool = True, steps: int = 4) -> tuple[SamplingBatchInfo, Batch]:
    batch = Batch([req(*PARAMS[i % len(PARAMS)]) for i in range(n)])
    orch = penaltylib.BatchedPenalizerOrchestrator(
        vocab_size=V, batch=batch,
        penalizers={penaltylib.BatchedFrequencyPenalizer, penaltylib.BatchedMinNewTokensPenalizer,
                    penaltylib.BatchedPresencePenalizer, penaltylib.BatchedRepetitionPenalizer})
    g = torch.Generator().manual_seed(n)
    for _ in range(steps):  # some output tokens, repeats included
        orch.cumulate_output_tokens(torch.randint(0, 12, (n,), generator=g))
    logit_bias = None
    if bias:
        logit_bias = torch.zeros(n, V)
        logit_bias[::2, 5] = -30.0
        logit_bias[1::3, 11] = 4.25
    info = SamplingBatchInfo(
        temperatures=torch.ones(n, 1), top_ps=torch.ones(n), top_ks=torch.ones(n, dtype=torch.int32),
        min_ps=torch.zeros(n), is_all_greedy=True, is_any_greedy=True, need_top_p_sampling=False,
        need_top_k_sampling=False, need_min_p_sampling=False, vocab_size=V, penalizer_orchestrator=orch,
        device="cpu", logit_bias=logit_bias)
    return info, batch  # the caller keeps `batch` alive (weakref)


def logits_for(n: int) -> torch.Tensor:
    return torch.randn(n, V, generator=torch.Generator().manual_seed(100 + n)) * 3


def snapshot(info: SamplingBatchInfo) -> dict[str, torch.Tensor]:
    orch = info.penalizer_orchestrator
    return {f"{type(p).__name__}.{k}": v.clone() for p in orch.penalizers.values()
            for k, v in vars(p).items() if isinstance(v, torch.Tensor)}


def check_blocks(info: SamplingBatchInfo, full_stock: torch.Tensor, logits: torch.Tensor) -> None:
    n = logits.shape[0]
    for t in (1, 2, 3, 4):
        for rank in range(t):
            r = rows_per_rank(n, t)
            block = torch.zeros(r, V)  # padding rows past n stay untouched
            rows = own_rows(n, t, rank)
            block[: rows.stop - rows.start] = logits[rows]
            transform_own_rows(block, n, t, rank, lambda x, rr: sp.apply_row_transforms(info, x, rr))
            real = rows.stop - rows.start
            assert torch.equal(block[:real], full_stock[rows]), (t, rank)  # bitwise, -inf included
            assert not block[real:].any()


@pytest.mark.parametrize("n", [5, 7])
@pytest.mark.parametrize("bias", [True, False])
def test_row_blocks_equal_stock_full_rows(n, bias):
    info, batch = make_info(n, bias=bias)
    before = snapshot(info)
    logits = logits_for(n)
    assert info.penalizer_orchestrator.is_required
    # non-overlap form: the orchestrator applies its penalizers to the logits
    stock = logits.clone()
    info.apply_logits_bias(stock)
    assert not torch.equal(stock, logits) and torch.isinf(stock).any()  # min_new_tokens masks EOS
    check_blocks(info, stock, logits)
    # the form every forward gets: copy_for_forward's accumulated penalties, orchestrator None
    fwd = info.copy_for_forward()
    assert fwd.penalizer_orchestrator is None and fwd.acc_scaling_penalties is not None
    stock_fwd = logits.clone()
    fwd.apply_logits_bias(stock_fwd)
    check_blocks(fwd, stock_fwd, logits)
    after = snapshot(info)  # the sampler only reads the penalizer state
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


def test_taper_sub_batch_orchestrator():
    """deferral.run_subset gives the sub-batch a forked orchestrator filtered to the rows that run."""
    info, batch = make_info(7)
    keep = [0, 2, 3, 6]
    sub_batch = Batch([batch.reqs[i] for i in keep])
    sub = dataclasses.replace(info, penalizer_orchestrator=deferral._fork_penalizers(info.penalizer_orchestrator,
                                                                                      sub_batch))
    sub.filter_batch(keep, torch.tensor(keep))
    logits = logits_for(4)
    for form in (sub, sub.copy_for_forward()):
        stock = logits.clone()
        form.apply_logits_bias(stock)
        check_blocks(form, stock, logits)


def test_unknown_penalizer_keeps_the_all_gather():
    info, batch = make_info(5)

    class CustomPenalizer(penaltylib.BatchedFrequencyPenalizer):
        pass

    orch = info.penalizer_orchestrator
    assert sp._row_wise_penalizers(info)
    custom = CustomPenalizer(orch)
    orch.penalizers[CustomPenalizer] = custom
    assert sp._row_wise_penalizers(info)  # not prepared: never applied
    custom.prepare()
    assert not sp._row_wise_penalizers(info)
    assert sp._row_wise_penalizers(info.copy_for_forward())  # accumulated tensors are per row anyway
