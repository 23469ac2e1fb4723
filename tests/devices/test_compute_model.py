"""The GEMM compute model: shape validation, serialisation, the exact cache, and fidelity.

The fidelity tests fit and score the model on one recorded measurement of the reference
host (MKL on one thread, ``scripts/record_host_timings.py``): real timings, the same every
run, so a busy moment on a shared CI host can neither fail nor skip them. ``bench_host.py``
measures the same figures live.
"""

from __future__ import annotations

import copy
import dataclasses
import gzip
import json
import math
import sys
import tomllib
from pathlib import Path

import numpy as np
import pytest
from morphling.devices.models.compute import ComputeModel, GemmShape, heldout_error
from morphling.devices.profiler.shapes import grid_shapes, heldout_shapes
from morphling.devices.profiler.toml_writer import dump_toml

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from record_host_timings import DEFAULT_OUTPUT, GRID, HELDOUT, STRIDE_PAIRS

SMALL_PATH, PACKED_PATH = STRIDE_PAIRS["small"], STRIDE_PAIRS["packed"]


def shape(**changes: object) -> GemmShape:
    base = dict(m=64, n=32, k=128, ta=False, tb=False, lda=128, ldb=32, dtype="float32")
    return GemmShape(**{**base, **changes})


def _samples(records: list[dict]) -> list[tuple[GemmShape, float]]:
    return [
        (GemmShape(**{k: v for k, v in r.items() if k != "seconds"}), r["seconds"]) for r in records
    ]


@pytest.fixture(scope="module")
def measured():
    """(model, held-out samples, stride pairs' timings): the recorded host, fitted once."""
    with gzip.open(DEFAULT_OUTPUT, "rt") as f:
        recorded = json.load(f)
    grid, held = _samples(recorded["grid"]), _samples(recorded["heldout"])
    stale = "the recording's shapes are not the ones asked for: run scripts/record_host_timings.py"
    assert [s for s, _ in grid] == grid_shapes(GRID, seed=0), stale
    assert [s for s, _ in held] == heldout_shapes(HELDOUT, seed=1), stale
    pairs = dict(_samples(recorded["stride_pairs"]))
    assert set(pairs) == {*SMALL_PATH, *PACKED_PATH}, stale
    return ComputeModel.fit(grid), held, pairs


# --- GemmShape -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"m": 0}, "'m'"),
        ({"n": -3}, "'n'"),
        ({"k": 2.0}, "'k'"),
        ({"m": True}, "'m'"),
        ({"ta": 1}, "'ta'"),
        ({"dtype": "float16"}, "'dtype'"),
        ({"lda": 127}, "'lda'"),  # A is m rows of k = 128
        ({"ldb": 31}, "'ldb'"),  # B is k rows of n = 32
        ({"ta": True, "lda": 63}, "'lda'"),  # Aᵀ: k rows of m = 64
        ({"tb": True, "ldb": 127}, "'ldb'"),  # Bᵀ: n rows of k = 128
        ({"lda": 2**31}, "'lda'"),
    ],
)
def test_shape_validation_names_the_field(changes, field):
    with pytest.raises(ValueError, match=field):
        shape(**changes)


def test_shape_accepts_the_minimum_leading_dimensions():
    assert shape(ta=True, lda=64, tb=True, ldb=128).flops == 2 * 64 * 32 * 128


# --- the analytic model --------------------------------------------------------------------


def test_analytic_model_is_flops_over_rate_with_fp64_at_its_ratio():
    model = ComputeModel.analytic(1e10, fp64_ratio=0.25)
    s32 = shape()
    s64 = shape(dtype="float64")
    assert model.predict_s(s32) == pytest.approx(s32.flops / 1e10)
    assert model.predict_s(s64) == pytest.approx(s64.flops / 2.5e9)
    assert model.traffic_cost(s32) == (0.0, 0.0)
    for bad in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="flops"):
            ComputeModel.analytic(bad)


def test_analytic_round_trip():
    model = ComputeModel.analytic(3e9, fp64_ratio=0.5)
    again = ComputeModel.from_dict(model.to_dict())
    assert again.to_dict() == model.to_dict()
    assert again.predict_s(shape(m=99)) == model.predict_s(shape(m=99))


# --- strict parsing ------------------------------------------------------------------------


def test_from_dict_refuses_unknown_missing_and_malformed_keys(measured):
    good = measured[0].to_dict()
    with pytest.raises(ValueError, match="'frobnicate'"):
        ComputeModel.from_dict({**good, "frobnicate": 1})
    for key in ("compute", "regime_min", "exact"):
        with pytest.raises(ValueError, match=repr(key)):
            ComputeModel.from_dict({k: v for k, v in good.items() if k != key})
    with pytest.raises(ValueError, match="'b_traffic'"):
        ComputeModel.from_dict({**good, "b_traffic": good["b_traffic"][:-1]})
    with pytest.raises(ValueError, match="'compute'"):
        ComputeModel.from_dict({**good, "compute": [math.nan] * len(good["compute"])})
    with pytest.raises(ValueError, match="'kind'"):
        ComputeModel.from_dict({**good, "kind": "magic"})
    record = good["exact"][0]
    with pytest.raises(ValueError, match="'ldb'"):
        ComputeModel.from_dict({**good, "exact": [{k: v for k, v in record.items() if k != "ldb"}]})
    with pytest.raises(ValueError, match="seconds"):
        ComputeModel.from_dict({**good, "exact": [{**record, "seconds": -1.0}]})
    with pytest.raises(ValueError, match="'lda'"):
        ComputeModel.from_dict({**good, "exact": [{**record, "ta": False, "lda": 1}]})
    with pytest.raises(ValueError, match="map"):
        ComputeModel.from_dict([good])


def test_fitted_round_trip_through_toml(measured):
    model, held, _ = measured
    d = model.to_dict()
    loaded = tomllib.loads(dump_toml({"compute": d}))["compute"]
    again = ComputeModel.from_dict(loaded)
    assert again.to_dict() == d
    shapes = [s for s, _ in held]
    assert np.array_equal(again.predict_many(shapes), model.predict_many(shapes))


# --- the exact cache -----------------------------------------------------------------------


def test_exact_cache_wins_over_the_fit(measured):
    model, held, _ = measured
    target, seconds = held[0]
    fitted = model.predict_s(target)
    assert target not in model.exact
    d = model.to_dict()
    d["exact"] = [{**target.to_dict(), "seconds": seconds * 3}]
    cached = ComputeModel.from_dict(d)
    assert cached.predict_s(target) == seconds * 3
    assert cached.predict_many([target])[0] == seconds * 3
    other = held[1][0]
    assert cached.predict_s(other) == pytest.approx(model.predict_s(other), rel=1e-12)
    assert fitted != seconds * 3


def test_fit_keeps_every_measured_shape_exactly(measured):
    model, _, _ = measured
    assert len(model.exact) == GRID
    grid_shape, seconds = next(iter(model.exact.items()))
    assert model.predict_s(grid_shape) == seconds


def test_fit_needs_enough_distinct_shapes():
    with pytest.raises(ValueError, match="distinct shapes"):
        ComputeModel.fit([(shape(), 1e-5)] * 100)
    with pytest.raises(ValueError, match="seconds"):
        ComputeModel.fit([(shape(k=k), 0.0) for k in range(16, 80)])


# --- what the fit says ---------------------------------------------------------------------


def test_predicted_time_grows_with_k(measured):
    model = measured[0]
    for base, _ in measured[1][:40]:
        for strided in (False, True):
            times = []
            for k in (16, 64, 256, 1024, 4096, 8192):
                lda = 8256 if strided else (base.m if base.ta else k)
                ldb = 8256 if strided else (k if base.tb else base.n)
                times.append(model.predict_s(dataclasses.replace(base, k=k, lda=lda, ldb=ldb)))
            assert np.all(np.diff(times) > 0), (base, strided, times)


@pytest.mark.parametrize("pair", ["small", "packed"])
def test_stride_penalty_is_the_fitted_traffic_cost_and_matches_the_host(measured, pair):
    model, _, timed = measured
    page, near = SMALL_PATH if pair == "small" else PACKED_PATH
    assert page not in model.exact and near not in model.exact
    # The prediction differs exactly by what the fitted traffic terms charge...
    charged = sum(model.traffic_cost(page)) - sum(model.traffic_cost(near))
    assert model.predict_s(page) - model.predict_s(near) == pytest.approx(charged, rel=1e-9)
    # ...and that reproduces the measured penalty: large below MKL's packing threshold,
    # small above it, where packing copies the strided operand once.
    predicted = model.predict_s(page) / model.predict_s(near)
    observed = timed[page] / timed[near]
    assert predicted == pytest.approx(observed, rel=0.2), (predicted, observed)
    if pair == "small":
        assert observed > 1.3 and predicted > 1.3


def test_traffic_parameters_read_back_drive_the_predictions(measured):
    """Triple every B traffic cost in the parameters: predictions grow by twice that cost."""
    model = measured[0]
    d = copy.deepcopy(model.to_dict())
    d["exact"] = []
    base = ComputeModel.from_dict(d)
    d["b_traffic"] = [x + math.log(3) if i % 4 == 0 else x for i, x in enumerate(d["b_traffic"])]
    slower = ComputeModel.from_dict(d)
    s = SMALL_PATH[0]
    b_cost = base.traffic_cost(s)[1]
    assert slower.traffic_cost(s)[1] == pytest.approx(3 * b_cost)
    assert slower.predict_s(s) - base.predict_s(s) == pytest.approx(2 * b_cost)


# --- fidelity ------------------------------------------------------------------------------


def test_heldout_error_reports_fractions():
    model = ComputeModel.analytic(1e10)
    samples = [(shape(k=k), shape(k=k).flops / 1e10 * f) for k, f in ((16, 2.0), (32, 0.5))]
    error = heldout_error(model, samples)
    assert error == {"median_ape": 0.75, "p90_ape": pytest.approx(0.95), "max_ape": 1.0, "count": 2}
    with pytest.raises(ValueError, match="at least one"):
        heldout_error(model, [])


def test_heldout_shapes_are_predicted_within_5_percent_median_12_percent_p90(measured):
    model, held, _ = measured
    assert not any(s in model.exact for s, _ in held)
    error = heldout_error(model, held)
    assert error["count"] == HELDOUT
    assert error["median_ape"] <= 0.05, error
    assert error["p90_ape"] <= 0.12, error
