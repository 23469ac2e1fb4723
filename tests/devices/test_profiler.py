"""``morphling profile`` and its parts: shape sets, timing, the sustained trace, the TOML file."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import shutil
import threading
import time
import tomllib
from pathlib import Path

import numpy as np
import pytest
from morphling.devices.models.compute import ComputeModel, GemmShape, heldout_error
from morphling.devices.models.conv import FORM as CONV_FORM
from morphling.devices.models.conv import ConvModel
from morphling.devices.models.conv_shape import KINDS, ConvShape
from morphling.devices.models.profiles import DeviceProfile, load_profile
from morphling.devices.models.thermal import ThermalParams, ThermalState
from morphling.devices.profiler.conv_shapes import (
    CHANNEL_LEVELS,
    LEVELS,
    conv_grid_shapes,
    conv_heldout_shapes,
)
from morphling.devices.profiler.conv_timing import band_placement, geometry, measure_conv
from morphling.devices.profiler.host_cache import (
    HOST_KEY,
    HOST_THREADS_ENV,
    cache_dir,
    cached_host_profile,
    host_key,
    host_threads,
    why_stale,
)
from morphling.devices.profiler.profile_file import LARGE_GEMM, QUICK, Plan, profile
from morphling.devices.profiler.sensors import read_temperature_c, top_clock_mhz
from morphling.devices.profiler.shapes import K_LEVELS, MN_LEVELS, grid_shapes, heldout_shapes
from morphling.devices.profiler.sustained_load import clock_levels, run_bursts, sustained_trace
from morphling.devices.profiler.timing import measure
from morphling.devices.profiler.toml_writer import dump_toml

from morphling.commands.profile import add_parser

# Off the grid levels (200, 300, 700), so a profile predicts it from its fit, not its cache.
FRESH = GemmShape(200, 300, 700, False, True, 700, 700, "float32")
# Likewise off the levels (40 channels, 50 wide): a ResNet block's 3×3 convolution.
FRESH_CONV = ConvShape("forward", n=8, c=40, h=50, w=50, oc=40, kernel=(3, 3), padding=(1, 1, 1, 1))
HAS_SENSOR = read_temperature_c() is not None


def morphling_profile(*argv: str) -> int:
    """Run ``morphling profile ARGV`` through the real parser, as ``morphling`` does."""
    parser = argparse.ArgumentParser(prog="morphling")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["profile", *argv])
    return args.func(args)


@pytest.fixture(scope="module")
def quick_profile(tmp_path_factory):
    path = tmp_path_factory.mktemp("profile") / "host.toml"
    assert (
        morphling_profile("--quick", "--threads", "1", "--no-progress", "--output", str(path)) == 0
    )
    with path.open("rb") as f:
        return path, tomllib.load(f)


# --- the command ---------------------------------------------------------------------------


def test_quick_profile_writes_a_profile_the_loaders_accept(quick_profile):
    path, doc = quick_profile
    assert set(doc) == {"profile", "compute", "conv", "ops", "provenance", "trace"}
    profile = DeviceProfile.from_wire({"source": "test", **doc["profile"]})
    assert profile.kind == "cpu" and profile.name == "host"
    assert profile.source.startswith("measured on ") and "by morphling profile at" in profile.source
    assert profile.memory_bytes > 1 << 20
    assert profile.dl_lat_s > 0 and math.isfinite(profile.dl_bw)  # a LAN, not loopback
    loaded = load_profile(str(path))
    assert loaded.compute == doc["compute"] and loaded.conv == doc["conv"]
    assert loaded.ops == doc["ops"] and "measured:" in doc["provenance"]["ops"]
    model = ComputeModel.from_dict(doc["compute"])
    assert profile.flops == pytest.approx(LARGE_GEMM.flops / model.predict_s(LARGE_GEMM))


def test_quick_profile_is_the_fit_and_score_of_its_own_measurements(quick_profile):
    """Refitting the grid timings the file records gives the file's model, and scoring that
    on its held-out timings gives the errors its provenance reports. How well such a fit
    predicts the host is judged on a recorded measurement (``test_compute_model.py``) and
    live in ``bench_host.py``; a timed assertion here would fail whenever the shared host
    is busy while the profile measures."""
    compute, provenance = quick_profile[1]["compute"], quick_profile[1]["provenance"]
    model = ComputeModel.from_dict(compute)
    grid, held = grid_shapes(QUICK.grid, seed=0), heldout_shapes(QUICK.heldout, seed=1)
    assert set(model.exact) == {*grid, *held}
    refit = ComputeModel.fit([(s, model.exact[s]) for s in grid])
    params, again = model.to_dict(), refit.to_dict()
    assert params.keys() == again.keys() and params["kind"] == again["kind"]
    for key in params.keys() - {"exact", "kind"}:  # numbers and lists of them
        assert params[key] == pytest.approx(again[key], rel=1e-9), key
    error = heldout_error(refit, [(s, model.exact[s]) for s in held])
    for key in ("median_ape", "p90_ape", "max_ape"):
        assert error[key] == pytest.approx(provenance[f"heldout_{key}"], rel=1e-9), key
    assert FRESH not in model.exact
    assert model.predict_s(FRESH) == pytest.approx(refit.predict_s(FRESH), rel=1e-9)


def test_quick_profile_conv_model_is_the_fit_and_score_of_its_own_measurements(quick_profile):
    """As for the GEMM model: the file's convolution model is the fit of the grid timings it
    records, and its provenance the score of that fit on the held-out timings."""
    conv, provenance = quick_profile[1]["conv"], quick_profile[1]["provenance"]
    model = ConvModel.from_dict(conv)
    grid = conv_grid_shapes(QUICK.conv_grid, seed=0)
    held = conv_heldout_shapes(QUICK.conv_heldout, seed=1)
    assert set(model.exact) == {*grid, *held}
    assert provenance["conv_grid_shapes"] == QUICK.conv_grid
    assert provenance["conv_heldout_shapes"] == QUICK.conv_heldout
    # The fit, then PyTorch's own convolutions beside the kernels' (measured apart: the scale)
    refit = ConvModel.fit([(s, model.exact[s]) for s in grid]).with_native(model.native)
    params, again = model.to_dict(), refit.to_dict()
    assert params.keys() == again.keys()
    for key in params.keys() - {"exact", "kind", "popcount"}:
        assert params[key] == pytest.approx(again[key], rel=1e-9), key
    assert provenance["conv_native"].startswith("measured: PyTorch's time over the kernels'")
    assert model.native != dict.fromkeys(model.native, 1.0)
    # the score is of the kernels' model, before the scale
    unscaled = refit.with_native(dict.fromkeys(model.native, 1.0))
    error = heldout_error(unscaled, [(s, model.exact[s]) for s in held])
    for key in ("median_ape", "p90_ape", "max_ape"):
        assert error[key] == pytest.approx(provenance[f"conv_heldout_{key}"], rel=1e-9), key
    assert 0 <= provenance["conv_heldout_repeat_p90"] < 1


def test_quick_profile_describes_this_host(quick_profile):
    """Its prediction for a shape it did not time, against a fresh timing, within a factor
    of 3: wrong units, a wrong shape or thread count in ``measure`` would be far off, while
    a busy host (30 % in CI) is not. Fidelity itself is the tests and benchmark above."""
    model = ComputeModel.from_dict(quick_profile[1]["compute"])
    [(_, seconds)] = measure([FRESH], threads=1, rounds=3)
    assert 1 / 3 < model.predict_s(FRESH) / seconds < 3
    conv = ConvModel.from_dict(quick_profile[1]["conv"])
    assert FRESH_CONV not in conv.exact
    [(_, seconds)] = measure_conv([FRESH_CONV], threads=1, rounds=3)
    kernels = conv.with_native(dict.fromkeys(conv.native, 1.0))  # what measure_conv times
    assert 1 / 3 < kernels.predict_s(FRESH_CONV) / seconds < 3


def test_quick_profile_records_provenance_and_the_trace(quick_profile):
    provenance, trace = quick_profile[1]["provenance"], quick_profile[1]["trace"]
    assert provenance["threads"] == 1
    assert provenance["grid_shapes"] == QUICK.grid
    assert provenance["heldout_shapes"] == QUICK.heldout
    assert 0 < provenance["heldout_median_ape"] <= provenance["heldout_p90_ape"]
    assert 0 < provenance["conv_heldout_median_ape"] <= provenance["conv_heldout_p90_ape"]
    assert provenance["blas"] in ("mkl", "openblas")
    assert trace["bursts"] >= 2 and trace["duration_s"] >= QUICK.duration_s
    assert trace["fastest_latency_s"] <= min(trace["first_latency_s"], trace["last_latency_s"])
    assert trace["temperatures"] is HAS_SENSOR
    assert trace["cooldown_s"] == 0.0  # no --ambient: no thermal fit, so no cooldown
    assert trace["samples"] == trace["bursts"]
    why = "the room temperature was not given" if HAS_SENSOR else "no thermal zone"
    assert provenance["thermal"].startswith("not fitted: ") and why in provenance["thermal"]


def test_refuses_to_overwrite_without_force(tmp_path, capsys):
    path = tmp_path / "taken.toml"
    path.write_text("keep me\n")
    assert morphling_profile("--quick", "--output", str(path)) == 2
    assert "--force" in capsys.readouterr().err
    assert path.read_text() == "keep me\n"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--threads", "0"], "--threads"),
        (["--duration", "-1"], "--duration"),
        (["--cooldown", "-1"], "--cooldown"),
        (["--ambient", "-300"], "--ambient"),
        (["--name", ""], "--name"),
    ],
)
def test_usage_errors_exit_2(tmp_path, capsys, argv, message):
    assert morphling_profile(*argv, "--output", str(tmp_path / "p.toml")) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "p.toml").exists()


def test_missing_output_directory_and_flag_exit_2(tmp_path, capsys):
    assert morphling_profile("--output", str(tmp_path / "no" / "p.toml")) == 2
    assert "does not exist" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        morphling_profile("--quick")
    assert exc.value.code == 2


# --- the built-in ``host`` profile: measured once, cached ----------------------------------

# The least the fits take (132 distinct GEMM shapes, 45 convolutions): a few seconds.
SMALL = Plan(grid=160, heldout=10, conv_grid=50, conv_heldout=5, rounds=1, duration_s=0.1)
MEASURING = "measuring this host"


def measured(caplog: pytest.LogCaptureFixture) -> list[str]:
    """The 'measuring this host' warnings logged so far, and start again."""
    found = [r.getMessage() for r in caplog.records if MEASURING in r.getMessage()]
    caplog.clear()
    return found


class _Said(logging.Handler):
    """The profiler's warnings while it is attached (``caplog`` is one test's only)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture(scope="module")
def first_use(tmp_path_factory) -> tuple[Path, Path, list[str]]:
    """This host measured once on one thread into an empty cache: the cache directory, the
    profile (for tests to copy) and what the profiler warned of."""
    directory, said = tmp_path_factory.mktemp("cache"), _Said()
    logger = logging.getLogger("morphling.devices.profiler")
    level = logger.level
    logger.setLevel(logging.WARNING)
    logger.addHandler(said)
    try:
        path = cached_host_profile(threads=1, directory=directory, plan=SMALL)
    finally:
        logger.removeHandler(said)
        logger.setLevel(level)
    return directory, path, said.messages


@pytest.fixture(scope="module")
def host_1t(first_use) -> Path:
    return first_use[1]


def test_host_profile_is_measured_on_first_use_then_loaded_from_the_cache(first_use, caplog):
    caplog.set_level(logging.WARNING, logger="morphling.devices.profiler")
    tmp_path, path, said = first_use
    [message] = [m for m in said if MEASURING in m]
    assert path == tmp_path / "host-1t.toml" and str(path) in message and "no cached" in message
    with path.open("rb") as f:
        doc = tomllib.load(f)
    assert {key: doc["provenance"][key] for key in HOST_KEY} == host_key(1)
    assert doc["provenance"]["grid_shapes"] == SMALL.grid
    assert "ideal preset" in doc["provenance"]["links"]
    profile = load_profile(str(path))
    assert profile.name == "host" and profile.compute["kind"] == "fitted"
    assert profile.dl_bw == profile.ul_bw == math.inf and profile.dl_lat_s == profile.ul_lat_s == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["host-1t.toml", "host.lock"]

    written = path.stat().st_mtime_ns
    assert cached_host_profile(threads=1, directory=tmp_path, plan=SMALL) == path
    assert measured(caplog) == [] and path.stat().st_mtime_ns == written


def _cached_for_another(path: Path, key: str) -> object:
    """Rewrite the profile at ``path`` as measured with another ``key``; this host's value."""
    now = host_key(1)[key]
    stale = now + 1 if isinstance(now, int) else "another one"
    text = path.read_text()
    line = f"{key} = {json.dumps(now)}\n"
    assert line in text
    path.write_text(text.replace(line, f"{key} = {json.dumps(stale)}\n"))
    return now


def test_a_profile_cached_for_another_host_is_measured_again(tmp_path, caplog, host_1t):
    """Each key is checked (another revision of the convolution kernels is another host too:
    the model fitted to the old one's timings does not describe the new one); one stale key
    is measured again end to end."""
    for key in HOST_KEY:
        path = Path(shutil.copy(host_1t, tmp_path / f"{key}.toml"))
        _cached_for_another(path, key)
        assert why_stale(path, host_key(1)) == f"the cached profile was measured with another {key}"
    caplog.set_level(logging.WARNING, logger="morphling.devices.profiler")
    path = Path(shutil.copy(host_1t, tmp_path / "host-1t.toml"))
    now = _cached_for_another(path, "conv_kernels")
    measured(caplog)
    cached_host_profile(threads=1, directory=tmp_path, plan=SMALL)
    [message] = measured(caplog)
    assert "another conv_kernels" in message
    with path.open("rb") as f:
        assert tomllib.load(f)["provenance"]["conv_kernels"] == now


def test_a_cached_profile_without_an_op_model_is_stale(tmp_path, host_1t):
    """A profile cached before the other ops were measured could not coordinate: it is
    measured again, as a stale key is (above)."""
    path = Path(shutil.copy(host_1t, tmp_path))
    assert why_stale(path, host_key(1)) is None
    with path.open("rb") as f:
        doc = tomllib.load(f)
    del doc["ops"]
    path.write_text(dump_toml(doc))
    assert why_stale(path, host_key(1)) == "the cached profile has no op model"


def test_a_cached_profile_whose_conv_model_is_of_another_form_is_stale(tmp_path, host_1t):
    """The same kernels' revision, but a convolution model whose θ counts other work terms
    (one written before ``form`` existed): measured again, not refused at use."""
    path = Path(shutil.copy(host_1t, tmp_path))
    with path.open("rb") as f:
        doc = tomllib.load(f)
    assert doc["conv"]["form"] == CONV_FORM
    del doc["conv"]["form"]
    path.write_text(dump_toml(doc))
    assert why_stale(path, host_key(1)) == (
        "the cached profile's convolution model counts another form of work terms"
    )


def test_each_thread_count_has_its_own_cached_profile(tmp_path, caplog, host_1t):
    caplog.set_level(logging.WARNING, logger="morphling.devices.profiler")
    one = Path(shutil.copy(host_1t, tmp_path))
    two = cached_host_profile(threads=2, directory=tmp_path, plan=SMALL)
    assert len(measured(caplog)) == 1 and two == tmp_path / "host-2t.toml"
    with two.open("rb") as f:
        assert tomllib.load(f)["provenance"]["threads"] == 2
    assert cached_host_profile(threads=1, directory=tmp_path, plan=SMALL) == one
    assert measured(caplog) == []


def test_host_threads_and_cache_dir_come_from_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv(HOST_THREADS_ENV, raising=False)
    assert host_threads() >= 1
    monkeypatch.setenv(HOST_THREADS_ENV, "3")
    assert host_threads() == 3
    for bad in ("0", "two", "-1", ""):
        monkeypatch.setenv(HOST_THREADS_ENV, bad)
        with pytest.raises(ValueError, match=HOST_THREADS_ENV):
            host_threads()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cache_dir() == tmp_path / "morphling"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert cache_dir() == tmp_path / ".cache" / "morphling"


# --- shape sets ----------------------------------------------------------------------------


def test_grid_is_on_levels_and_heldout_is_off_them():
    grid = grid_shapes(300, seed=3)
    held = heldout_shapes(300, seed=4)
    assert len(set(grid)) == 300 and len(set(held)) == 300
    assert all(s.m in MN_LEVELS and s.n in MN_LEVELS and s.k in K_LEVELS for s in grid)
    assert not any(s.m in MN_LEVELS or s.n in MN_LEVELS or s.k in K_LEVELS for s in held)
    for shapes in (grid, held):
        assert {(s.ta, s.tb) for s in shapes} == {(a, b) for a in (0, 1) for b in (0, 1)}
        assert {s.dtype for s in shapes} == {"float32", "float64"}
        contiguous = [s.lda == s.a_cols for s in shapes]
        assert 0.2 < np.mean(contiguous) < 0.8  # strided views and contiguous operands
    assert grid_shapes(50, seed=3) == grid[:50]  # seeded


def test_conv_grid_is_on_levels_and_heldout_is_off_them():
    grid = conv_grid_shapes(600, seed=3)
    held = conv_heldout_shapes(300, seed=4)
    assert len(set(grid)) == 600 and len(set(held)) == 300 and not set(grid) & set(held)
    assert all(s.w in LEVELS and s.n in LEVELS for s in grid)
    assert not any(s.w in LEVELS for s in held)
    assert all(s.c in CHANNEL_LEVELS for s in grid if s.groups == 1 and s.c >= 8)
    assert not any(s.c in CHANNEL_LEVELS for s in held if s.groups == 1 and s.c >= 8)
    for shapes in (grid, held):
        seen = {
            "kind": {s.kind for s in shapes},
            "dtype": {s.dtype for s in shapes},
            "depthwise": {s.depthwise for s in shapes},
            "grouped": {1 < s.groups < s.c for s in shapes},
            "1x1": {s.kernel == (1, 1) for s in shapes},
            "strided": {s.stride != (1, 1) for s in shapes},
            "dilated": {s.dilation != (1, 1) for s in shapes},
            "1-D": {s.h == 1 and s.kernel[0] == 1 for s in shapes},
            "band": {s.kind == "grad_input" and s.rows < s.h for s in shapes},
        }
        assert seen["kind"] == set(KINDS) and seen["dtype"] == {"float32", "float64"}
        for name in ("depthwise", "grouped", "1x1", "strided", "dilated", "1-D", "band"):
            assert seen[name] == {False, True}, name
        forward = [s for s in shapes if s.kind == "forward"]
        assert any(s.padding[0] != s.padding[1] for s in forward)  # bands cut the padding
    assert conv_grid_shapes(50, seed=3) == grid[:50]  # seeded


# --- timing and the trace ------------------------------------------------------------------


def test_measure_times_each_shape_in_order():
    small = GemmShape(64, 64, 64, False, False, 64, 64, "float32")
    large = GemmShape(256, 256, 2048, True, True, 256, 2048, "float64")
    [(first, t_small), (second, t_large)] = measure([small, large], threads=1, rounds=2)
    assert (first, second) == (small, large)
    assert 0 < t_small < t_large
    with pytest.raises(ValueError, match="rounds"):
        measure([small], rounds=0)


def test_measure_conv_times_each_call_in_order():
    small = ConvShape("forward", n=1, c=8, h=8, w=8, oc=8, kernel=(3, 3))
    large = ConvShape("grad_input", 8, 64, 32, 32, 64, (3, 3), padding=(1, 1, 1, 1), rows=20,
                      dy_rows=21, dtype="float64")  # fmt: skip
    depthwise = ConvShape("grad_weight", 4, 32, 16, 16, 32, (3, 3), (2, 2), groups=32)
    timed = measure_conv([small, large, depthwise], threads=1, rounds=2)
    assert [s for s, _ in timed] == [small, large, depthwise]
    seconds = [t for _, t in timed]
    assert 0 < seconds[0] < seconds[1] and seconds[2] > 0
    with pytest.raises(ValueError, match="rounds"):
        measure_conv([small], rounds=0)


def test_a_grad_input_call_is_timed_on_a_band_that_needs_all_its_dy_rows():
    """As the emulator's tiles do: the depthwise kernel's work depends on where the band
    lies, and the first band the dy rows merely cover is at the top edge, where fewer taps
    reach (it timed a 1-row band of a 5x5 convolution reaching 1 dy row of the 4 given)."""
    shapes = [s for s in conv_grid_shapes(400, seed=3) if s.kind == "grad_input"]
    assert len(shapes) > 100
    for shape in shapes:
        i0, oh_lo = band_placement(shape)
        lo, hi = geometry(shape).grad_output_rows(shape.h, i0, i0 + shape.rows)
        assert (lo, hi) == (oh_lo, oh_lo + shape.dy_rows), shape


def test_a_load_shorter_than_a_sysfs_read_still_runs_one_burst(tmp_path):
    """The first temperature is read before the load's first burst, and a process's first
    sysfs read can take longer than a short load (seen at 0.1 s on a loaded host): a load
    of a microsecond still gives one burst, its reading, and a trace."""
    burst = GemmShape(64, 64, 64, False, True, 64, 64, "float32")
    bursts = run_bursts(1e-6, burst_shape=burst, burst_s=1e-6, sysfs=tmp_path)
    assert bursts.start_s.size == bursts.latency_s.size == 1
    assert bursts.latency_s[0] > 0


def test_sustained_trace_without_cpufreq_infers_clocks_from_latency(tmp_path):
    burst = GemmShape(128, 128, 512, False, True, 512, 512, "float32")
    trace = sustained_trace(0.5, burst_shape=burst, threads=1, cooldown_s=0.2, sysfs=tmp_path)
    top = top_clock_mhz(tmp_path)
    assert trace.time_s.size >= 4 and np.all(np.diff(trace.time_s) > 0)
    assert trace.busy[0] and not trace.busy[-1] and np.all(np.diff(trace.busy.astype(int)) <= 0)
    busy = trace.freq_mhz[trace.busy]
    assert busy.max() == pytest.approx(top)  # the fastest burst ran at the top clock
    assert np.all(busy <= top * (1 + 1e-12))
    assert np.isnan(trace.temp_c).all()  # an empty sysfs: no sensor


def test_clock_levels_merge_readings_a_few_percent_apart():
    readings = np.array([1500.0, 1498.0, 1000.0, 600.0, 1500.0, 750.0, 1010.0, 601.0])
    assert clock_levels(readings) == (1500.0, 1010.0, 750.0, 601.0)


# --- the TOML writer -----------------------------------------------------------------------


def test_toml_writer_round_trips_through_tomllib():
    tables = {
        "a": {
            "text": 'quote " backslash \\ newline \n unicode é',
            "n": -3,
            "x": 1e-300,
            "big": 1.5e300,
            "inf": math.inf,
            "yes": True,
            "xs": [1.0, 2.5],
            "empty": [],
        },
        "b": {
            "records": [
                {"m": 1, "ta": False, "dtype": "float32"},
                {"m": 2, "ta": True, "dtype": "float64"},
            ]
        },
    }
    assert tomllib.loads(dump_toml(tables)) == tables
    with pytest.raises(ValueError, match="NoneType"):
        dump_toml({"a": {"x": None}})


# --- the thermal fit, from a board's sysfs -------------------------------------------------

# A small board in a fast-forwarded world: τ of a third of a second, so heating and cooling
# fit in two seconds of trace. One clock, and it never throttles (the controller is not observable
# in so short a trace; thermal.fit's own tests recover it from simulated ones).
BOARD = ThermalParams(
    ambient_c=25.0,
    tau_s=0.35,
    idle_rise_c=10.0,
    busy_rise_c=40.0,
    levels_mhz=(1500.0,),
    throttle_c=200.0,
    hysteresis_c=0.0,
    dwell_s=0.0,
    cooling_scale=1.0,
    source="test: a board that follows a known RC curve",
)
# SMALL's grid, then 2 s of load and (the default) as long idle: 20 bursts, 20 idle samples
# (at least five even while the suite's other worker halves this one's core).
THERMAL = dataclasses.replace(SMALL, duration_s=2.0)


class Board(logging.Handler):
    """A board's sysfs under ``root``: a thermal zone whose ``temp`` a thread rewrites every
    millisecond along ``params``' RC curve, busy while the profiler says its sustained load
    runs (its log) and idle otherwise, and cpufreq files at a fixed clock."""

    def __init__(self, root: Path, params: ThermalParams) -> None:
        super().__init__(logging.INFO)
        self.root = root
        self.state = ThermalState(params, time.perf_counter())
        self.since = time.perf_counter()  # the state is up to date to here
        self.busy = False
        self.guard = threading.Lock()  # (Handler has its own .lock)
        self.stop = threading.Event()
        self.writer = threading.Thread(target=self._write, daemon=True)
        self.zone = root / "class/thermal/thermal_zone0"
        self.zone.mkdir(parents=True)
        cool = root / "class/thermal/thermal_zone1"  # a second, cooler zone: the hottest counts
        cool.mkdir()
        (cool / "temp").write_text(f"{round(1000 * (params.ambient_c + 1))}\n")
        for cpu, khz in (("cpu0", 1_500_000), ("cpu1", 600_000)):  # the busy core's is read
            cpufreq = root / f"devices/system/cpu/{cpu}/cpufreq"
            cpufreq.mkdir(parents=True)
            (cpufreq / "scaling_cur_freq").write_text(f"{khz}\n")
            (cpufreq / "cpuinfo_max_freq").write_text("1500000\n")

    def _advance(self, now: float) -> float:
        """Bring the state to ``now`` (under the lock); the temperature there."""
        if self.busy:
            self.state.run(self.since, now - self.since)
        self.since = now
        return self.state.temperature(now)

    def emit(self, record: logging.LogRecord) -> None:
        phase = record.getMessage()
        if phase.startswith(("sustained load", "idle for")):
            with self.guard:
                self._advance(time.perf_counter())
                self.busy = phase.startswith("sustained load")

    def _write(self) -> None:
        spare = self.root / "temp.new"  # written whole, then renamed over: no torn reads
        while not self.stop.wait(0.001):
            with self.guard:
                temp = self._advance(time.perf_counter())
            spare.write_text(f"{round(1000 * temp)}\n")
            os.replace(spare, self.zone / "temp")

    def __enter__(self) -> Board:
        self.writer.start()
        logger = logging.getLogger("morphling.devices.profiler")
        self.level = logger.level
        logger.setLevel(logging.INFO)
        logger.addHandler(self)
        return self

    def __exit__(self, *exc: object) -> None:
        logger = logging.getLogger("morphling.devices.profiler")
        logger.removeHandler(self)
        logger.setLevel(self.level)
        self.stop.set()
        self.writer.join()


def test_profile_fits_the_thermal_model_of_a_board_it_reads_from_sysfs(tmp_path):
    sysfs, path = tmp_path / "sys", tmp_path / "board.toml"
    with Board(sysfs, BOARD):
        result = profile(path, plan=THERMAL, ambient_c=BOARD.ambient_c, sysfs=sysfs)
    assert result.thermal is not None, result.thermal_status
    fitted = result.thermal.params
    for key in ("tau_s", "idle_rise_c", "busy_rise_c"):
        assert getattr(fitted, key) == pytest.approx(getattr(BOARD, key), rel=0.05), key
    assert fitted.ambient_c == BOARD.ambient_c and fitted.levels_mhz == (1500.0,)
    assert result.thermal.rms_c < 0.5  # millidegree files, a millisecond behind at worst

    with path.open("rb") as f:
        doc = tomllib.load(f)
    trace, provenance = doc["trace"], doc["provenance"]
    assert trace["duration_s"] >= THERMAL.duration_s and trace["cooldown_s"] >= THERMAL.duration_s
    assert trace["clocks"] == "cpufreq" and trace["temperatures"] is True
    assert trace["samples"] == trace["temperature_readings"] == result.thermal.readings
    assert trace["samples"] > trace["bursts"] >= 5
    assert trace["thermal_fit_rms_c"] == result.thermal.rms_c
    assert provenance["thermal"].startswith("fitted: ")
    assert fitted.source.startswith(doc["profile"]["source"])
    for said in (
        f"{trace['samples']} samples",
        "residual",
        "ambient 25 C given",
        "clock levels 1500 MHz from cpufreq",
        "no clock drop up to",
        "hysteresis_c is 0",
        "dwell_s is 0",
    ):
        assert said in fitted.source, said
    # A one-level model never throttles: throttle_c is only the hottest reading, a bound.
    assert fitted.throttle_c == np.nanmax(result.bursts.temp_c)

    loaded = load_profile(str(path))
    assert ThermalParams.from_dict(loaded.thermal) == fitted
    assert loaded.compute == doc["compute"]


def test_without_the_room_temperature_a_sensor_gives_no_thermal_model(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="morphling.devices.profiler")
    sysfs, path = tmp_path / "sys", tmp_path / "board.toml"
    with Board(sysfs, BOARD):
        result = profile(path, plan=SMALL, sysfs=sysfs)
    assert result.thermal is None and "--ambient" in result.thermal_status
    assert any("--ambient" in r.getMessage() for r in caplog.records)
    with path.open("rb") as f:
        doc = tomllib.load(f)
    assert "thermal" not in doc and doc["provenance"]["thermal"] == result.thermal_status
    assert doc["trace"]["temperatures"] is True and doc["trace"]["cooldown_s"] == 0.0
    assert load_profile(str(path)).thermal == {}
