"""Latency predictor: NNLS fit, monotonicity under online refits, JSON, MAPE."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from branchwise.taper.predictor import (
    ConstantLatencyModel,
    LinearLatencyModel,
    OnlineRefit,
    default_model,
    load_model,
    mape,
    model_from_json,
)

TRUE = LinearLatencyModel(c0=14e-3, c_seq=2.5e-4, c_ctx=1e-7)


def grid_samples(model, noise=0.02, seed=0):
    """The paper's profiling grid (Appendix C): batch sizes 1..512 x context lengths 128..8192."""
    rng = np.random.default_rng(seed)
    out = []
    for bs in np.unique(np.geomspace(1, 512, 20).astype(int)):
        for cl in np.geomspace(128, 8192, 25).astype(int):
            out.append((int(bs), int(bs * cl), model.predict(bs, bs * cl) * (1 + rng.normal(0, noise))))
    return out


def test_fit_recovers_known_coefficients_from_noisy_grid():
    m = LinearLatencyModel.fit(grid_samples(TRUE))
    assert m.c0 == pytest.approx(TRUE.c0, rel=0.05)
    assert m.c_seq == pytest.approx(TRUE.c_seq, rel=0.05)
    assert m.c_ctx == pytest.approx(TRUE.c_ctx, rel=0.05)
    assert m.c_tok == 0.0  # no prefill tokens in the samples
    assert mape(m, grid_samples(TRUE, noise=0.0)) < 0.01


def test_fit_with_prefill_tokens():
    true = LinearLatencyModel(c0=5e-3, c_seq=1e-4, c_ctx=5e-8, c_tok=3e-5)
    rng = np.random.default_rng(1)
    samples = [(n, c, true.predict(n, c, e), e)
               for n, c, e in zip(rng.integers(1, 200, 300), rng.integers(100, 500_000, 300),
                                  rng.integers(0, 4096, 300), strict=True)]
    m = LinearLatencyModel.fit(samples)
    for got, want in zip(m.coefs(), true.coefs(), strict=True):
        assert got == pytest.approx(want, rel=1e-6)


def test_fit_is_non_negative_on_decreasing_data():
    samples = [(n, n * 1000, 0.05 - 1e-4 * n) for n in range(1, 100, 3)]
    samples += [(n, n * 3000, 0.05 - 1e-4 * n) for n in range(2, 100, 3)]
    m = LinearLatencyModel.fit(samples)
    assert min(m.coefs()) >= 0.0


@pytest.mark.parametrize("samples, why", [
    ([(8, 8000, 0.02)] * 50, "same number of rows"),
    ([(n, 4096, 0.02) for n in range(1, 50)], "same context size"),
    ([(n, 1000 * n, 0.01 + n * 1e-3) for n in range(1, 50)], "collinear"),
    ([(1, 10, 0.01), (2, 30, 0.02)], "fewer than 3"),
])
def test_fit_refuses_degenerate_samples(samples, why):
    with pytest.raises(ValueError, match=why):
        LinearLatencyModel.fit(samples)


def test_negative_coefficients_are_rejected():
    with pytest.raises(ValueError, match="c_seq"):
        LinearLatencyModel(c0=0.0, c_seq=-1e-4, c_ctx=0.0)
    with pytest.raises(ValueError, match="constant latency"):
        ConstantLatencyModel(float("nan"))


def test_predict_and_row_costs_are_separable_and_monotone():
    m = default_model()
    rows = np.array([0, 1, 4096, 100_000])
    assert np.allclose(m.row_costs(rows), [m.predict(n + 1, c + int(r)) - m.predict(n, c)
                                           for r, n, c in zip(rows, (1, 5, 10, 50), (10, 1000, 40_000, 9),
                                                              strict=True)])
    assert m.predict(10, 20_000) < m.predict(11, 20_000) < m.predict(11, 30_000)
    const = ConstantLatencyModel(0.02)
    assert const.predict(1, 1) == const.predict(500, 10**7) == 0.02
    assert not const.row_costs(rows).any()


def test_default_model_matches_the_papers_low_load_step():
    # IRP-Off at low load ~ 18 ms (TAPER §4.2) for the assumed ~10 rows x 2k context
    assert default_model().predict(10, 20_000) == pytest.approx(0.018, abs=0.001)


@pytest.mark.parametrize("model", [TRUE, default_model(), ConstantLatencyModel(0.031)])
def test_json_round_trip(model, tmp_path):
    assert model_from_json(model.to_json()) == model
    path = tmp_path / "lat.json"
    model.save(path)
    assert load_model(path) == model
    assert json.loads(path.read_text())["units"] == "seconds"
    assert type(model).load(path) == model == type(model).from_json(model.to_json())
    other = ConstantLatencyModel if isinstance(model, LinearLatencyModel) else LinearLatencyModel
    with pytest.raises(ValueError, match=f"expected a {other.__name__}"):
        other.load(path)


@pytest.mark.parametrize("text, msg", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "must be an object"),
    ('{"kind": "cubic"}', "kind must be"),
    ('{"kind": "linear", "c0": 0.01, "c_seq": 0.001}', "lacks c_ctx"),
    ('{"c0": 0.01, "c_seq": "fast", "c_ctx": 0}', "must be numbers"),
    ('{"c0": 0.01, "c_seq": true, "c_ctx": 0}', "must be numbers"),
    ('{"c0": -0.01, "c_seq": 0.001, "c_ctx": 0}', "c0 must be finite and >= 0"),
    ('{"kind": "constant"}', "lacks value_s"),
])
def test_bad_json_gives_clear_value_error(text, msg, tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=msg) as e:
        load_model(path)
    assert str(path) in str(e.value)


def test_missing_file_is_a_value_error(tmp_path):
    with pytest.raises(ValueError, match="cannot read latency model"):
        load_model(tmp_path / "nope.json")


def test_mape():
    assert mape(TRUE, [(1, 100, TRUE.predict(1, 100))]) == 0.0
    assert mape(ConstantLatencyModel(0.011), [(1, 1, 0.01), (1, 1, 0.02)]) == pytest.approx((0.1 + 0.45) / 2)
    with pytest.raises(ValueError):
        mape(TRUE, [])


def test_online_refit_tracks_a_drifted_model_in_place():
    model = LinearLatencyModel(c0=14e-3, c_seq=2.5e-4, c_ctx=1e-7)
    drifted = LinearLatencyModel(c0=20e-3, c_seq=3e-4, c_ctx=1.5e-7)
    refit = OnlineRefit(model, every=50, blend=1.0)
    rng = np.random.default_rng(0)
    for _ in range(200):
        n, per = int(rng.integers(1, 256)), int(rng.integers(128, 8192))
        refit.observe(n, n * per, drifted.predict(n, n * per))
    assert refit.model is model and refit.refits == 4
    for got, want in zip(model.coefs()[:3], drifted.coefs()[:3], strict=True):
        assert got == pytest.approx(want, rel=1e-6)


def test_online_refit_blends_toward_the_fit():
    model = LinearLatencyModel(c0=10e-3, c_seq=2e-4, c_ctx=1e-7)
    target = LinearLatencyModel(c0=20e-3, c_seq=4e-4, c_ctx=2e-7)
    refit = OnlineRefit(model, every=50, blend=0.5)
    rng = np.random.default_rng(3)
    for _ in range(50):
        n, c = int(rng.integers(1, 256)), int(rng.integers(1000, 2_000_000))
        refit.observe(n, c, target.predict(n, c))
    assert model.c0 == pytest.approx(15e-3) and model.c_seq == pytest.approx(3e-4)
    assert model.c_ctx == pytest.approx(1.5e-7)


def test_online_refit_ignores_mixed_and_broken_steps():
    model = default_model()
    coefs = model.coefs()
    refit = OnlineRefit(model, every=10, min_samples=10)
    for i in range(100):
        assert not refit.observe(1 + i % 7, 1000 * (1 + i % 7), 0.01, extra_tokens=512)  # mixed prefill
        assert not refit.observe(5, 100, float("nan"))
    assert model.coefs() == coefs and refit.refits == 0


@pytest.mark.parametrize("shape", ["one batch size", "collinear"])
def test_degenerate_windows_correct_only_the_intercept(shape):
    """Real decode windows rarely separate rows from context; c0 alone still tracks drift."""
    model = LinearLatencyModel(c0=14e-3, c_seq=2.5e-4, c_ctx=1e-7)
    slopes = model.coefs()[1:]
    slower = LinearLatencyModel(c0=30e-3, c_seq=2.5e-4, c_ctx=1e-7)  # e.g. other load on the box
    refit = OnlineRefit(model, every=50, blend=0.5)
    for i in range(200):
        n = 32 if shape == "one batch size" else 8 + i % 40
        ctx = 32 * 2048 + 7 * i if shape == "one batch size" else 2048 * n  # collinear: ctx = 2048 rows
        refit.observe(n, ctx, slower.predict(n, ctx))
    assert refit.intercept_refits == refit.refits == 4 and model.coefs()[1:] == slopes
    assert model.c0 == pytest.approx(30e-3 - 16e-3 / 2 ** 4)  # halfway to the truth at every refit
    assert ("same number of rows" if shape == "one batch size" else "collinear") in refit.last_skip


def test_intercept_correction_never_goes_negative():
    model = LinearLatencyModel(c0=5e-3, c_seq=1e-3, c_ctx=0.0)
    refit = OnlineRefit(model, every=10, min_samples=10, blend=1.0)
    for _ in range(40):
        refit.observe(16, 16 * 100, 1e-3)  # faster than the slope alone predicts: c0 would be < 0
    assert model.c0 == 0.0 and model.c_seq == 1e-3
    assert model.predict(17, 1700) >= model.predict(16, 1600)
    assert "intercept already fits" in refit.last_skip  # later windows: c0 stays at its floor


window = st.lists(st.tuples(st.integers(1, 512), st.integers(1, 4_000_000), st.floats(1e-4, 1.0)),
                  min_size=1, max_size=120)


@settings(max_examples=40, deadline=None)
@given(window, st.floats(0.05, 1.0))
def test_online_refit_never_goes_non_monotone(steps, blend):
    model = default_model()
    refit = OnlineRefit(model, window=50, every=7, blend=blend, min_samples=5)
    for n, c, lat in steps:
        refit.observe(n, c, lat)
        assert min(model.coefs()) >= 0.0
        assert model.predict(n + 1, c + 1) >= model.predict(n, c)


def test_online_refit_sets_a_constant_model_to_the_slowest_recent_step():
    const = ConstantLatencyModel(0.05)
    refit = OnlineRefit(const, window=20, every=10, min_samples=10)
    for i in range(30):
        refit.observe(8, 8000, 0.02 + 0.001 * (i % 10))
    assert const.value_s == pytest.approx(0.029)


def test_online_refit_rejects_bad_blend():
    with pytest.raises(ValueError, match="blend"):
        OnlineRefit(default_model(), blend=0.0)


def test_a_calibrated_model_keeps_its_slopes_and_tracks_drift_in_c0():
    """--latency-model: the file's shape stays; a slower box moves only the intercept."""
    model = LinearLatencyModel(c0=4e-3, c_seq=4e-4, c_ctx=3e-7)
    slopes = model.coefs()[1:]
    truth = LinearLatencyModel(c0=7e-3, c_seq=6e-4, c_ctx=1e-7)  # separable window: a full fit would move all
    refit = OnlineRefit(model, every=50, blend=1.0, slopes_fixed=True)
    rng = np.random.default_rng(1)
    for _ in range(100):
        n, c = int(rng.integers(1, 64)), int(rng.integers(100, 50_000))
        refit.observe(n, c, truth.predict(n, c))
    assert model.coefs()[1:] == slopes and refit.intercept_refits == refit.refits >= 1
    assert model.c0 > 5e-3 and "slopes fixed" in refit.last_skip


def test_a_deferral_price_above_a_steps_latency_does_not_break_the_refit():
    """A --latency-model price (c_defer) larger than some quick deferring steps: their T part is
    clipped at 0 instead of failing the fit (which would escape into the scheduler loop)."""
    model = LinearLatencyModel(c0=1e-3, c_seq=1e-4, c_ctx=1e-8, c_defer=2e-3)
    refit = OnlineRefit(model, deferral=True, every=10, min_samples=10)
    rng = np.random.default_rng(0)
    for _ in range(60):  # every step defers and is quicker than the price: no split, the model's price
        rows, ctx = int(rng.integers(2, 30)), int(rng.integers(100, 5000))
        refit.observe(rows, ctx, 0.5e-3 + 1e-5 * rows, deferred=int(rng.integers(1, 5)))
    assert refit.refits + refit.skipped >= 5
    assert all(np.isfinite(model.coefs())) and min(model.coefs()) >= 0.0


@pytest.mark.parametrize("price", [(0.0, 0.0), (0.6e-3, 0.05e-3)])
def test_a_slope_error_is_not_read_as_a_price_of_deferral(price):
    """The model's row slope is half the box's and stays so (a calibrated model keeps its slopes),
    and the steps that defer run more rows than the others of their window (they come at high
    load). Against the model's slopes every deferring step looks ~1.2 ms slow where deferring is
    free; the price, estimated jointly with the steps' composition, is 0 there, and where deferring
    does cost it is that price, under the same slope error."""
    box = LinearLatencyModel(c0=2e-3, c_seq=0.2e-3, c_ctx=1e-8, c_defer=price[0], c_deferred=price[1])
    model = LinearLatencyModel(c0=2e-3, c_seq=0.1e-3, c_ctx=1e-8)
    refit = OnlineRefit(model, window=64, every=16, slopes_fixed=True, deferral=True)
    rng = np.random.default_rng(3)
    for i in range(3000):
        d = int(rng.integers(1, 12)) if i % 2 else 0
        rows = int(rng.integers(16, 32)) if d else int(rng.integers(4, 20))
        ctx = rows * int(rng.integers(500, 3000))
        refit.observe(rows, ctx, (box.predict(rows, ctx) + box.deferral_s(d)) * rng.lognormal(0.0, 0.02),
                      deferred=d)
    if price == (0.0, 0.0):
        assert model.deferral() == (0.0, 0.0)
    else:
        assert model.c_defer == pytest.approx(price[0], rel=0.1)
        assert model.c_deferred == pytest.approx(price[1], rel=0.1)


def test_without_a_believed_price_the_deferral_refit_is_the_plain_one():
    """Deferring is free (2% noise on every step): the refit that learns the price never believes
    one, and its model is the one the refit without the price term reaches, coefficient for
    coefficient (taper plans as taper-no-defer-cost there)."""
    learn, plain = LinearLatencyModel(1e-3, 0.1e-3, 1e-7), LinearLatencyModel(1e-3, 0.1e-3, 1e-7)
    refits = [OnlineRefit(learn, deferral=True), OnlineRefit(plain)]
    rng = np.random.default_rng(4)
    for i in range(4000):
        d = int(rng.integers(1, 12)) if i % 3 == 0 else 0
        rows = int(rng.integers(8, 40))
        ctx = rows * int(rng.integers(500, 3000))
        lat = TRUE.predict(rows, ctx) * rng.lognormal(0.0, 0.02)
        for rf in refits:
            rf.observe(rows, ctx, lat, deferred=d)
    assert learn.deferral() == (0.0, 0.0) and learn == plain and refits[0].refits == refits[1].refits > 0


def test_long_noisy_deferring_steps_are_not_read_as_a_price():
    """Noise scales with the step (10%), and the steps that defer are ~7x longer than the others:
    deferring is free. Weighted by 1 / T the regression's standard error holds for both, and a
    price is believed in at most a few of 100 runs (each tested at every refit). Unweighted, the
    short steps' small noise would set the error bar: 17 of these 100 runs find a price."""
    box = LinearLatencyModel(c0=0.5e-3, c_seq=0.1e-3, c_ctx=1e-8)
    believed = 0
    for rep in range(100):
        rng = np.random.default_rng(100 + rep)
        model = LinearLatencyModel(*box.coefs())
        refit = OnlineRefit(model, window=64, every=16, slopes_fixed=True, deferral=True)
        for i in range(480):
            d = int(rng.integers(1, 12)) if i % 4 == 0 else 0
            rows = int(rng.integers(60, 80)) if d else int(rng.integers(2, 10))
            ctx = rows * int(rng.integers(200, 2000))
            refit.observe(rows, ctx, box.predict(rows, ctx) * rng.lognormal(0.0, 0.1), deferred=d)
            if model.deferral() != (0.0, 0.0):
                believed += 1
                break
    assert believed <= 3
