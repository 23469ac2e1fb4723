"""The convolution model: call validation, serialisation, the exact cache, and fidelity.

The fidelity tests fit and score the model on one recorded measurement of the reference
host (one thread, ``scripts/record_conv_timings.py``): real timings, the same every run, so
a busy moment on a shared CI host can neither fail nor skip them. ``bench_host.py``
measures the same figures live.
"""

from __future__ import annotations

import gzip
import json
import math
import platform
import subprocess
import sys
import tomllib
from pathlib import Path

import numpy as np
import pytest
from morphling.devices.models.conv import (
    FORM,
    NATIVE_KEYS,
    ConvModel,
    heldout_error,
    native_key,
    traffic_bytes,
)
from morphling.devices.models.conv_shape import KINDS, ConvShape
from morphling.devices.profiler.conv_native import measure_native_scale
from morphling.devices.profiler.conv_shapes import conv_grid_shapes, conv_heldout_shapes
from morphling.devices.profiler.conv_timing import (
    conv_call,
    fresh_conv_buffers,
    geometry,
    operand_dims,
)
from morphling.devices.profiler.toml_writer import dump_toml
from morphling.kernels import conv as conv_kernels
from morphling.kernels.conv import conv_flops

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from record_conv_timings import DEFAULT_OUTPUT, GRID, HELDOUT

MEDIAN, P90 = 0.05, 0.12  # the targets, as for GEMM shapes


def shape(**changes: object) -> ConvShape:
    base = dict(kind="forward", n=2, c=16, h=10, w=12, oc=32, kernel=(3, 3), padding=(1, 1, 1, 1))
    return ConvShape(**{**base, **changes})


def _samples(records: list[dict]) -> list[tuple[ConvShape, float]]:
    return [
        (ConvShape.from_dict({k: v for k, v in r.items() if k != "seconds"}), r["seconds"])
        for r in records
    ]


@pytest.fixture(scope="module")
def measured():
    """(model, held-out samples): the recorded host, fitted once."""
    with gzip.open(DEFAULT_OUTPUT, "rt") as f:
        recorded = json.load(f)
    grid, held = _samples(recorded["grid"]), _samples(recorded["heldout"])
    stale = "the recording's calls are not the ones asked for: run scripts/record_conv_timings.py"
    assert recorded["meta"].get("conv_kernels") == conv_kernels.REVISION, stale
    assert [s for s, _ in grid] == conv_grid_shapes(GRID, seed=0), stale
    assert [s for s, _ in held] == conv_heldout_shapes(HELDOUT, seed=1), stale
    return ConvModel.fit(grid), held


# --- ConvShape -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"kind": "backward"}, "'kind'"),
        ({"n": 0}, "'n'"),
        ({"c": 2.0}, "'c'"),
        ({"oc": True}, "'oc'"),
        ({"h": -1}, "'h'"),
        ({"kind": "grad_weight", "h": 0}, "'h'"),  # only a forward region may be empty
        ({"w": 2**31}, "'w'"),
        ({"kernel": (3,)}, "'kernel'"),
        ({"kernel": (0, 3)}, "'kernel'"),
        ({"stride": (1, 0)}, "'stride'"),
        ({"dilation": "11"}, "'dilation'"),
        ({"padding": (1, 1, 1)}, "'padding'"),
        ({"padding": (-1, 0, 0, 0)}, "'padding'"),
        ({"groups": 0}, "'groups'"),
        ({"groups": 3}, "'c'"),  # 16 channels do not split into 3 groups
        ({"c": 12, "groups": 4, "oc": 30}, "'oc'"),
        ({"dtype": "float16"}, "'dtype'"),
        ({"h": 1, "padding": (0, 0, 1, 1)}, "'h'"),  # 1 row is shorter than 3 kernel rows
        ({"w": 4, "padding": (1, 1, 0, 0), "dilation": (1, 3)}, "'w'"),
        ({"rows": 2}, "'rows'"),  # forward: no band
        ({"kind": "grad_input", "rows": 0, "dy_rows": 3}, "'rows'"),
        ({"kind": "grad_input", "rows": 11, "dy_rows": 3}, "'rows'"),  # h = 10
        ({"kind": "grad_input", "rows": 2, "dy_rows": 11}, "'dy_rows'"),  # OH = 10
    ],
)
def test_shape_validation_names_the_field(changes, field):
    with pytest.raises(ValueError, match=field):
        shape(**changes)


def test_shape_accepts_lists_and_an_empty_forward_region():
    s = shape(h=0, padding=[3, 0, 1, 1], kernel=[3, 3])
    assert s.kernel == (3, 3) and s.padding == (3, 0, 1, 1) and s.out_size == (1, 12)
    assert hash(s) == hash(shape(h=0, padding=(3, 0, 1, 1)))


@pytest.mark.parametrize("kind", KINDS)
def test_shape_flops_and_output_are_the_kernels(kind):
    """The models restate the kernels' output-size rule (they cannot import them): check it
    and the FLOPs against ``kernels.conv`` on every kind of call the profiler draws."""
    shapes = [s for s in conv_grid_shapes(300, seed=5) if s.kind == kind]
    assert len(shapes) > 50
    for s in shapes:
        first, second, out = operand_dims(s)
        assert geometry(s).output_size(s.h, s.w) == s.out_size
        dy = out if kind == "forward" else second if kind == "grad_weight" else first
        weight = second if kind != "grad_weight" else out
        assert s.flops == conv_flops(dy, weight), s


def test_a_stride_1_grad_input_is_computed_as_the_forward_call_the_kernels_make(monkeypatch):
    """``ConvShape.computed`` is the call ``kernels.conv`` really makes for a stride-1 grad
    input off the depthwise path (the models price that one): watch the kernels make it for
    every such call the profiler draws; every other call is itself."""
    made = []
    forward = conv_kernels.conv_forward

    def watched(x, w, geom, out=None):
        made.append((x.shape, w.shape, geom))
        return forward(x, w, geom, out)

    monkeypatch.setattr(conv_kernels, "conv_forward", watched)
    shapes = conv_grid_shapes(600, seed=7)
    assert all(s.computed() is s for s in shapes if s.kind != "grad_input" or s.stride != (1, 1))
    mapped = [s for s in shapes if s.computed() is not s]
    assert len(mapped) > 30 and not any(s.direct for s in mapped)
    for s in mapped:
        made.clear()
        conv_call(s, fresh_conv_buffers([s]))()
        [(x, w, geom)] = made
        c = s.computed()
        assert (c.kind, c.stride, c.out_size) == ("forward", (1, 1), (s.rows, s.w))
        assert x == (c.n, c.c, c.h, c.w) and w == (c.oc, c.c // c.groups, *c.kernel), s
        top, bottom, left, right = geom.padding
        assert (top + bottom, left, right) == (c.padding[0], *c.padding[2:]), s


def test_shape_round_trips_and_parses_strictly():
    s = shape(kind="grad_input", rows=4, dy_rows=6, groups=4, dtype="float64")
    assert ConvShape.from_dict(s.to_dict()) == s
    assert json.loads(json.dumps(s.to_dict())) == s.to_dict()
    with pytest.raises(ValueError, match="'frobnicate'"):
        ConvShape.from_dict({**s.to_dict(), "frobnicate": 1})
    with pytest.raises(ValueError, match="'dy_rows'"):
        ConvShape.from_dict({k: v for k, v in s.to_dict().items() if k != "dy_rows"})


# --- the analytic model --------------------------------------------------------------------


def test_analytic_model_is_flops_over_rate_plus_traffic_over_bandwidth():
    s32, s64 = shape(), shape(dtype="float64")
    flops_only = ConvModel.analytic(1e10, fp64_ratio=0.25)
    assert flops_only.predict_s(s32) == pytest.approx(s32.flops / 1e10)
    assert flops_only.predict_s(s64) == pytest.approx(s64.flops / 2.5e9)
    with_memory = ConvModel.analytic(1e10, mem_bw=5e9)
    extra = with_memory.predict_s(s32) - flops_only.predict_s(s32)
    assert extra == pytest.approx(traffic_bytes(s32) / 5e9)
    assert traffic_bytes(s64) == 2 * traffic_bytes(s32)
    for bad in (-1.0, math.inf, math.nan, True):
        with pytest.raises(ValueError, match="mem_bw"):
            ConvModel.analytic(1e10, mem_bw=bad)
    with pytest.raises(ValueError, match="flops"):
        ConvModel.analytic(0.0)


def test_a_single_input_channel_is_priced_at_the_dense_rate_not_the_depthwise_one():
    """PyTorch runs a convolution of one input channel (audio, a grayscale image) as any
    other; the kernels take their direct path for it, as for a depthwise one."""
    model = ConvModel.analytic(2e10, depthwise_flops=2e8)
    audio = ConvShape(kind="forward", n=4, c=1, h=1, w=16000, oc=128, kernel=(1, 80),
                      stride=(1, 4))  # fmt: skip
    depthwise = ConvShape(kind="forward", n=4, c=32, h=56, w=56, oc=32, kernel=(3, 3),
                          padding=(1, 1, 1, 1), groups=32)  # fmt: skip
    assert audio.direct and not audio.depthwise and depthwise.direct and depthwise.depthwise
    assert model.predict_s(audio) == pytest.approx(audio.flops / 2e10)
    assert model.predict_s(depthwise) == pytest.approx(depthwise.flops / 2e8)
    assert native_key(audio) == "forward" and native_key(depthwise) == "forward_depthwise"


def test_analytic_round_trip():
    model = ConvModel.analytic(3e9, mem_bw=4e9)
    again = ConvModel.from_dict(model.to_dict())
    assert again.to_dict() == model.to_dict()
    assert again.predict_s(shape(n=3)) == model.predict_s(shape(n=3))


# --- the native scale: the board's PyTorch beside the kernels ------------------------------


def test_native_scale_multiplies_each_kind_and_class(measured):
    model, held = measured
    native = {key: 0.5 + i / 10 for i, key in enumerate(NATIVE_KEYS)}
    scaled = model.with_native(native)
    shapes = [s for s, _ in held][:60] + list(model.exact)[:60]  # modelled and exact
    assert {native_key(s) for s in shapes} == set(NATIVE_KEYS)
    expected = [model.predict_s(s) * native[native_key(s)] for s in shapes]
    assert [scaled.predict_s(s) for s in shapes] == pytest.approx(expected, rel=1e-12)
    assert scaled.predict_many(shapes) == pytest.approx(expected, rel=1e-12)
    again = ConvModel.from_dict(scaled.to_dict())
    assert again.native == native and again.predict_s(shapes[0]) == scaled.predict_s(shapes[0])


def test_a_malformed_native_scale_is_refused_naming_it(measured):
    good = measured[0].to_dict()
    with pytest.raises(ValueError, match=r"conv field 'native' is missing key\(s\): 'forward'"):
        ConvModel.from_dict({**good, "native": {k: v for k, v in good["native"].items()
                                                if k != "forward"}})  # fmt: skip
    with pytest.raises(ValueError, match=r"'native\.grad_weight_depthwise' must be finite and > 0"):
        ConvModel.from_dict({**good, "native": {**good["native"], "grad_weight_depthwise": 0}})
    with pytest.raises(ValueError, match="only a fitted ConvModel has a native scale"):
        ConvModel({}, flops=1e9, native=good["native"])


def test_a_fitted_model_of_another_form_is_refused(measured):
    """θ prices the work terms of the form it was fitted under: a table of another form
    (one written before ``form`` existed is form 1) is refused, saying what to do."""
    good = measured[0].to_dict()
    assert good["form"] == FORM and ConvModel.from_dict(good).to_dict() == good
    old = {k: v for k, v in good.items() if k != "form"}
    for table, shown in ((old, "1"), ({**good, "form": FORM + 1}, str(FORM + 1))):
        with pytest.raises(ValueError, match=rf"'form' is {shown} .*measure the device again"):
            ConvModel.from_dict(table)


def test_native_scale_is_measured_against_this_hosts_pytorch():
    """Real PyTorch beside the real kernels: a ratio for every kind and class."""
    native = measure_native_scale(threads=1, rounds=1)
    assert set(native) == set(NATIVE_KEYS)
    assert all(0 < r < 100 and math.isfinite(r) for r in native.values()), native


_FAULTS = """
import resource, sys
from morphling.devices.profiler import conv_native

def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt

if sys.argv[1] == "fresh":
    conv_native._settle_allocator = lambda: None
timed, best = [0], conv_native._best

def counted(call, rounds):
    call()  # the operands' and the BLAS's first pages are the setup's, not the timings'
    before = faults()
    seconds = best(call, rounds)
    timed[0] += faults() - before
    return seconds

conv_native._best = counted
conv_native.measure_native_scale(threads=1, rounds=1)
print(timed[0])
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mmap threshold")
def test_the_native_scale_is_timed_with_the_allocator_settled():
    """A fresh process takes many of the outputs from fresh pages, as a training process
    past its first step does not: settled first, the timings fault a fraction as often."""

    def faults(state: str) -> int:
        run = [sys.executable, "-c", _FAULTS, state]
        return int(subprocess.run(run, capture_output=True, text=True, check=True).stdout)

    fresh, settled = faults("fresh"), faults("settled")
    assert settled < fresh / 2, (fresh, settled)


# --- strict parsing ------------------------------------------------------------------------


def test_from_dict_refuses_unknown_missing_and_malformed_keys(measured):
    good = measured[0].to_dict()
    with pytest.raises(ValueError, match="'frobnicate'"):
        ConvModel.from_dict({**good, "frobnicate": 1})
    for key in ("gemm_compute", "popcount", "exact"):
        with pytest.raises(ValueError, match=repr(key)):
            ConvModel.from_dict({k: v for k, v in good.items() if k != key})
    with pytest.raises(ValueError, match="'fold_bytes'"):
        ConvModel.from_dict({**good, "fold_bytes": good["fold_bytes"][:-1]})
    with pytest.raises(ValueError, match="'direct_loops'"):
        ConvModel.from_dict({**good, "direct_loops": [math.nan] * len(good["direct_loops"])})
    with pytest.raises(ValueError, match="'kind'"):
        ConvModel.from_dict({**good, "kind": "magic"})
    with pytest.raises(ValueError, match="'popcount'"):
        ConvModel.from_dict({**good, "popcount": 1})
    with pytest.raises(ValueError, match="'vector_bytes'"):
        ConvModel.from_dict({**good, "vector_bytes": 0})
    record = good["exact"][0]
    with pytest.raises(ValueError, match="'groups'"):
        ConvModel.from_dict({**good, "exact": [{k: v for k, v in record.items() if k != "groups"}]})
    with pytest.raises(ValueError, match="seconds"):
        ConvModel.from_dict({**good, "exact": [{**record, "seconds": 0}]})
    with pytest.raises(ValueError, match="'stride'"):
        ConvModel.from_dict({**good, "exact": [{**record, "stride": [1]}]})
    with pytest.raises(ValueError, match="map"):
        ConvModel.from_dict([good])


def test_fitted_round_trip_through_toml(measured):
    model, held = measured
    d = model.to_dict()
    loaded = tomllib.loads(dump_toml({"conv": d}))["conv"]
    again = ConvModel.from_dict(loaded)
    assert again.to_dict() == d
    shapes = [s for s, _ in held]
    assert np.array_equal(again.predict_many(shapes), model.predict_many(shapes))


# --- the exact cache -----------------------------------------------------------------------


def test_exact_cache_wins_over_the_fit(measured):
    model, held = measured
    target, seconds = held[0]
    assert target not in model.exact
    fitted = model.predict_s(target)
    d = model.to_dict()
    d["exact"] = [{**target.to_dict(), "seconds": seconds * 3}]
    cached = ConvModel.from_dict(d)
    assert cached.predict_s(target) == cached.predict_many([target])[0] == seconds * 3
    other = held[1][0]
    assert cached.predict_s(other) == pytest.approx(model.predict_s(other), rel=1e-12)
    assert fitted != seconds * 3


def test_fit_keeps_every_measured_shape_exactly(measured):
    model, _ = measured
    assert len(model.exact) == GRID
    grid_shape, seconds = next(iter(model.exact.items()))
    assert model.predict_s(grid_shape) == seconds


def test_fit_needs_enough_distinct_shapes():
    with pytest.raises(ValueError, match="distinct shapes"):
        ConvModel.fit([(shape(), 1e-4)] * 100)
    with pytest.raises(ValueError, match="seconds"):
        ConvModel.fit([(shape(n=n), 0.0) for n in range(1, 80)])
    with pytest.raises(ValueError, match="ConvShape"):
        ConvModel.fit([("forward", 1e-4)])


# --- what the fit says ---------------------------------------------------------------------


def test_predicted_time_grows_with_the_batch(measured):
    """More images is more of every stage's work, whatever the kind and path."""
    model = measured[0]
    for base, _ in measured[1][:60]:
        batches = [ConvShape.from_dict({**base.to_dict(), "n": n}) for n in (1, 4, 16, 64)]
        times = [model.predict_s(s) for s in batches]
        assert np.all(np.diff(times) > 0), (base, times)


# --- fidelity ------------------------------------------------------------------------------


def _error_by_kind(model: ConvModel, held: list[tuple[ConvShape, float]]) -> dict[str, dict]:
    return {k: heldout_error(model, [(s, t) for s, t in held if s.kind == k]) for k in KINDS}


def test_heldout_calls_are_predicted_within_5_percent_median(measured):
    model, held = measured
    assert not any(s in model.exact for s, _ in held)
    error = heldout_error(model, held)
    assert error["count"] == HELDOUT
    assert error["median_ape"] <= MEDIAN, (error, _error_by_kind(model, held))


@pytest.mark.xfail(
    strict=True,
    reason="issue 21's p90 target is not met yet: 12.9 % on this recording (repeat timings "
    "within 4.5 % at p90; 11.9-14.0 % on four recordings of two hosts): the general path's "
    "forward and grad weight within 10 %, its grad input and the depthwise kernels 14 %; see "
    "BENCHMARKS.md (heldout.conv_*)",
)
def test_heldout_calls_are_predicted_within_12_percent_p90(measured):
    model, held = measured
    error = heldout_error(model, held)
    assert error["p90_ape"] <= P90, (error, _error_by_kind(model, held))
