"""bench/gpu_check.py's logic on CPU with tiny shapes (the real run needs a lent GPU)."""

import json
import sys
from pathlib import Path

import pytest

from bench import gpu_check


def test_dry_run_writes_fitted_report(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # decode_hf only imports transformers on top of what decode exercises: left out for speed.
    argv = ["gpu_check.py", "--dry-run", "--out", str(tmp_path), "--parts", "sampler_check,sampler,decode"]
    monkeypatch.setattr(sys, "argv", argv)
    assert gpu_check.main() == 0
    rep = json.loads((tmp_path / "gpu_check.json").read_text())
    assert rep["errors"] == {}
    assert all(v is True or v == 1.0 for v in rep["sampler_check"].values())
    assert {(r["bs"], r["t"]) for r in rep["sampler"]["records"]} == {
        (b, t) for b in (8, 16) for t in (1, 2, 4)
    }
    assert len(rep["decode"]["points"]) == 6 and set(rep["fit"]) == {"c0", "c_seq", "c_ctx", "source"}
    assert min(rep["fit"][k] for k in ("c0", "c_seq", "c_ctx")) >= 0


def test_fit_nonneg_recovers_coefficients() -> None:
    pts = [
        {"bs": b, "sum_ctx": b * c, "t": 2e-3 + 1e-5 * b + 3e-8 * b * c}
        for b in (1, 8, 64)
        for c in (128, 1024)
    ]
    fit = gpu_check.fit_nonneg(pts, "t", relative=True)
    assert fit is not None and fit["max_rel_err"] < 1e-9
    assert (
        fit["c0"] == pytest.approx(2e-3)
        and fit["c_seq"] == pytest.approx(1e-5)
        and fit["c_ctx"] == pytest.approx(3e-8)
    )
    # A negative true slope is clamped to 0, never returned negative.
    neg = [{"bs": b, "sum_ctx": b * 10, "t": 1.0 - 1e-3 * b} for b in (1, 2, 4, 8)]
    assert gpu_check.fit_nonneg(neg, "t", relative=False)["c_seq"] == 0.0
