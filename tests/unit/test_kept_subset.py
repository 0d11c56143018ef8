"""What a deferring step may reuse from the last one (no SGLang): the kept sub-batch serves only
the batch exactly as that step left it, and a request's row fields are derived again when what
they came from changes. tests/integration/test_deferral_scheduler.py runs both on a real scheduler."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from branchwise import deferral, request_meta
from branchwise import scheduler_hook as sh
from branchwise.config import BranchwiseConfig


def batch() -> SimpleNamespace:
    return SimpleNamespace(seq_lens=torch.tensor([5, 6, 7]), req_pool_indices=torch.tensor([1, 2, 3]))


def kept_for(b: SimpleNamespace, idx: list[int]) -> deferral.KeptSubset:
    return deferral.KeptSubset(batch=b, seq_lens=b.seq_lens, pool_indices=b.req_pool_indices, idx=idx,
                               sub=object())


def test_the_kept_sub_batch_serves_only_the_batch_as_the_last_step_left_it():
    b = batch()
    assert kept_for(b, [0, 2]).serves(b, [0, 2])
    assert not kept_for(b, [0, 2]).serves(b, [0, 1])  # other rows run
    assert not kept_for(b, [0, 2]).serves(batch(), [0, 2])  # another batch object
    prepared = kept_for(b, [0, 2])
    b.seq_lens = b.seq_lens + 1  # a full prepare_for_decode (or a filter, a merge) replaced it
    assert not prepared.serves(b, [0, 2])
    b = batch()
    merged = kept_for(b, [0, 2])
    b.req_pool_indices = torch.cat([b.req_pool_indices, torch.tensor([4])])
    assert not merged.serves(b, [0, 2])
    cleared = kept_for(b, [0, 2])
    cleared.clear()
    assert not cleared.serves(b, [0, 2]) and cleared.sub is None


def test_row_fields_follow_the_request_metadata_fork_and_config():
    cfg = BranchwiseConfig(branch_slo_tpot_ms=50.0)
    r = SimpleNamespace(rid="r", bw_meta=request_meta.SERIAL, kv=SimpleNamespace(kv_committed_len=9), to_finish=None)
    assert sh._row(r, cfg).key == "rid:r"
    r.bw_meta = request_meta.RequestMeta(phase="ph", branch=2, fanout=4, slo_tpot_ms=80.0)
    row = sh._row(r, cfg)
    assert (row.key, row.order, row.in_phase, row.slo_s) == ("phase:ph", 2, True, 0.08)
    r.bw_fork = SimpleNamespace(branch=True)  # a server-side branch's phase
    assert sh._row(r, cfg).key == "fork:ph"
    other = BranchwiseConfig(branch_slo_tpot_ms=50.0, branch_min_slo_tpot_ms=100.0)
    assert sh._row(r, other).slo_s == 0.1
    r.kv.kv_committed_len, r.to_finish = 10, "abort"
    row = sh._row(r, other)
    assert row.ctx == 10 and row.forced  # per-step fields are read every step
