"""Thermal model: published throttling behaviour, fitting, determinism, validation."""

from __future__ import annotations

import dataclasses
import itertools
import math

import msgpack
import numpy as np
import pytest
from morphling.devices.models.thermal import (
    BUILTIN_THERMAL,
    COOLING,
    ThermalParams,
    ThermalState,
    Trace,
    clock_changes,
    fit,
    simulate,
    thermal_for,
)

RPI4 = BUILTIN_THERMAL["rpi4"]
TEN_MINUTES = 600.0


def _visited(freq_mhz: np.ndarray) -> list[float]:
    """The clock levels in the order visited, repeats collapsed."""
    keep = np.concatenate(([True], np.diff(freq_mhz) != 0))
    return freq_mhz[keep].tolist()


def _params(**changes: object) -> ThermalParams:
    return dataclasses.replace(RPI4, **changes)


# --- published behaviour ---------------------------------------------------------------------


def test_rpi4_without_cooling_throttles_as_published():
    assert RPI4.ambient_c == 25.0 and RPI4.cooling_scale == 1.0
    trace = simulate(RPI4, TEN_MINUTES, period_s=0.1)
    assert _visited(trace.freq_mhz) == [1500.0, 1000.0, 750.0, 600.0]
    first = int(np.flatnonzero(trace.freq_mhz < 1500.0)[0])
    assert trace.time_s[first] < 60.0
    assert trace.temp_c[first] >= 80.0
    assert (trace.temp_c[:first] < 80.0).all()  # held 1500 MHz until 80 °C, not before


@pytest.mark.parametrize("ambient_c", [25.0, 36.0])  # 36 °C: top of arXiv 2010.06291's range
def test_rpi4_with_fan_never_throttles(ambient_c):
    params = _params(ambient_c=ambient_c).with_cooling("fan")
    trace = simulate(params, TEN_MINUTES, period_s=0.1)
    assert set(trace.freq_mhz.tolist()) == {1500.0}


@pytest.mark.parametrize("name", sorted(BUILTIN_THERMAL))
def test_builtins_throttle_under_the_firmware_limit_and_not_with_a_fan(name):
    params = BUILTIN_THERMAL[name]
    hot = simulate(params, TEN_MINUTES, period_s=0.5)
    assert hot.freq_mhz.min() < params.levels_mhz[0]
    assert hot.temp_c.max() < 85.0  # Pi firmware limit; Orin Nano shuts down at 97 °C
    cool = simulate(params.with_cooling("fan"), TEN_MINUTES, period_s=0.5)
    assert set(cool.freq_mhz.tolist()) == {params.levels_mhz[0]}


def test_builtins_cover_the_device_profiles_and_say_where_they_come_from():
    expected = {"rpi4", "rpi5", "jetson-nano", "orin-nano", "orin-nano-super", "agx-orin"}
    assert set(BUILTIN_THERMAL) == expected
    for params in BUILTIN_THERMAL.values():
        assert params.source.startswith("derived from published figures: ")
        assert "REFERENCE.md" in params.source and "our calibration" in params.source


def test_thermal_for():
    assert thermal_for("rpi4", "none") == RPI4
    assert thermal_for("rpi4", "fan").cooling_scale == COOLING["fan"]
    assert thermal_for("host", "fan") is None
    with pytest.raises(ValueError, match=r"cooling.*'turbo'"):
        thermal_for("host", "turbo")


# --- the state the engine drives -------------------------------------------------------------


def _drive(state: ThermalState, seed: int) -> list:
    """A hard, irregular load: bursts of 1-400 ms with gaps of 0-50 ms."""
    rng = np.random.default_rng(seed)
    t, bursts = 0.0, []
    for nominal, gap in zip(rng.uniform(1e-3, 0.4, 3000), rng.uniform(0, 0.05, 3000), strict=True):
        burst = state.run(t + gap, float(nominal))
        bursts.append(burst)
        t += gap + burst.duration_s
    return bursts


def test_same_calls_give_identical_results():
    one, two = ThermalState(RPI4), ThermalState(RPI4)
    assert _drive(one, seed=7) == _drive(two, seed=7)
    assert one.changes == two.changes and len(one.changes) == 3


def test_idle_cooling_approaches_the_idle_steady_state():
    state = ThermalState(RPI4)
    end = state.run(0.0, 120.0).duration_s
    idle = RPI4.ambient_c + RPI4.idle_rise_c
    temps = [state.temperature(end + k * RPI4.tau_s) for k in range(40)]
    assert temps[0] > 80.0
    assert all(a > b for a, b in itertools.pairwise(temps[:20]))
    assert temps[-1] == pytest.approx(idle, abs=1e-9)
    assert state.temperature(end) == temps[0]  # reading it changed nothing
    assert state.run(end + 40 * RPI4.tau_s, 0.0).temp_c_start == temps[-1]


def test_a_fan_scales_the_rises_and_the_time_constant():
    # A fan lowers the thermal resistance R; rises are R·P and τ is R·C.
    scale = COOLING["fan"]
    fan = RPI4.with_cooling("fan")
    state = ThermalState(fan)
    end = state.run(0.0, 30.0).duration_s
    idle = RPI4.ambient_c + scale * RPI4.idle_rise_c
    assert fan.steady_state_c(None) == idle
    assert fan.steady_state_c(1500.0) == RPI4.ambient_c + scale * RPI4.busy_rise_c
    ratio = (state.temperature(end + scale * RPI4.tau_s) - idle) / (state.temperature(end) - idle)
    assert ratio == pytest.approx(math.exp(-1.0), rel=1e-12)


def test_duration_scales_with_the_clock_exactly():
    # Throttle at 0 °C with no dwell: every burst steps down one level until the floor.
    state = ThermalState(_params(throttle_c=0.0, dwell_s=0.0))
    nominal = 0.0123
    bursts = [state.run(float(i), nominal) for i in range(5)]
    assert [b.freq_mhz for b in bursts] == [1000.0, 750.0, 600.0, 600.0, 600.0]
    for burst in bursts:
        assert burst.duration_s == nominal * (1500.0 / burst.freq_mhz)
    assert bursts[2].duration_s / nominal == 2.5


def test_controller_waits_the_dwell_and_steps_back_up_after_cooling():
    state = ThermalState(_params(throttle_c=0.0, dwell_s=5.0))
    for i in range(20):
        state.run(float(i), 0.01)
    times = [t for t, _, _ in state.changes]
    assert times == [0.0, 5.0, 10.0]
    assert state.freq_mhz == 600.0
    hot, t = ThermalState(RPI4), 0.0
    while t < 120.0:  # sustained load: down to the 600 MHz floor
        t += hot.run(t, 0.1).duration_s
    assert hot.freq_mhz == 600.0
    t += 600.0  # idle: cools below throttle − hysteresis (77 °C)
    ups = [hot.run(t + RPI4.dwell_s * i, 0.01) for i in range(4)]
    assert ups[0].temp_c_start < 77.0
    assert [b.freq_mhz for b in ups] == [750.0, 1000.0, 1500.0, 1500.0]


def test_run_rejects_a_start_before_the_previous_burst_ended():
    state = ThermalState(RPI4)
    state.run(1.0, 2.0)
    with pytest.raises(ValueError, match="start_s"):
        state.run(2.5, 1.0)
    with pytest.raises(ValueError, match="nominal_s"):
        state.run(5.0, -1.0)


# --- fitting ---------------------------------------------------------------------------------

_QUIET = ThermalParams(
    ambient_c=30.0,
    tau_s=25.0,
    idle_rise_c=8.0,
    busy_rise_c=40.0,
    levels_mhz=(2000.0, 1000.0),
    throttle_c=95.0,
    hysteresis_c=3.0,
    dwell_s=2.0,
    cooling_scale=1.0,
    source="test: never throttles",
)

# (params, simulate keywords, fit keywords): a Pi 4 throttling to its floor, a small board that
# never throttles fitted from a cold start with ambient unknown, and an Orin Nano that cycles
# between two clocks (so the hysteresis shows in the trace).
_FIT_CASES = {
    "rpi4": (
        RPI4,
        {"period_s": 0.5, "cooldown_s": 600.0},
        {"ambient_c": 25.0, "hysteresis_c": 3.0},
    ),
    "quiet-cold": (
        _QUIET,
        {"period_s": 0.25, "cooldown_s": 200.0, "cold_start": True},
        {"cold_start": True, "throttle_c": 95.0, "hysteresis_c": 3.0, "dwell_s": 2.0},
    ),
    "orin-nano": (
        BUILTIN_THERMAL["orin-nano"],
        {"period_s": 0.5, "cooldown_s": 900.0},
        {"ambient_c": 25.0, "dwell_s": 5.0},
    ),
}


def _largest_step_c(params: ThermalParams, sim: dict) -> float:
    """The most the true temperature moves between two samples: how late a threshold shows."""
    clean = simulate(params, TEN_MINUTES * 2, **sim)
    return float(np.abs(np.diff(clean.temp_c)).max())


@pytest.mark.parametrize("case", sorted(_FIT_CASES))
def test_fit_recovers_the_parameters_from_a_noisy_trace(case):
    params, sim, kwargs = _FIT_CASES[case]
    trace = simulate(params, TEN_MINUTES * 2, noise_c=0.5, seed=3, **sim)
    result = fit(trace, levels_mhz=params.levels_mhz, **kwargs)
    fitted = result.params
    assert result.readings == trace.time_s.size
    assert result.rms_c == pytest.approx(0.5, rel=0.1)  # the sensor noise, no more
    for key in ("tau_s", "idle_rise_c", "busy_rise_c", "ambient_c"):
        assert getattr(fitted, key) == pytest.approx(getattr(params, key), rel=0.05), key
    assert fitted.levels_mhz == params.levels_mhz and fitted.cooling_scale == 1.0
    late = _largest_step_c(params, sim) + 0.25  # + the fitted curve's own error, 0.5σ
    assert params.throttle_c - 0.25 <= fitted.throttle_c <= params.throttle_c + late
    assert params.hysteresis_c - late <= fitted.hysteresis_c <= params.hysteresis_c + 0.25
    longest = sim["period_s"] * params.levels_mhz[0] / params.levels_mhz[-1]
    assert params.dwell_s <= fitted.dwell_s <= params.dwell_s + longest


def test_fit_works_through_sensor_dropouts():
    params, sim, kwargs = _FIT_CASES["rpi4"]
    trace = simulate(params, TEN_MINUTES, noise_c=0.5, seed=4, **sim)
    temp = trace.temp_c.copy()
    temp[::3] = np.nan
    holey = Trace(trace.time_s, temp, trace.freq_mhz, trace.busy)
    result = fit(holey, levels_mhz=params.levels_mhz, **kwargs)
    fitted = result.params
    assert result.readings == int(np.isfinite(temp).sum())
    for key in ("tau_s", "idle_rise_c", "busy_rise_c"):
        assert getattr(fitted, key) == pytest.approx(getattr(params, key), rel=0.05), key


def test_clock_changes_are_the_busy_clock_drops_and_rises():
    params = BUILTIN_THERMAL["orin-nano"]  # cycles between its top two clocks
    trace = simulate(params, TEN_MINUTES, period_s=0.5, cooldown_s=60.0)
    drops, rises, changes = clock_changes(trace, params.levels_mhz)
    assert drops.size > 0 and rises.size > 0
    assert changes.tolist() == sorted([*drops, *rises])
    assert trace.busy[changes].all()  # the cooldown's clocks are not events
    freq = trace.freq_mhz  # every busy sample follows a busy one here
    assert (freq[drops] < freq[drops - 1]).all() and (freq[rises] > freq[rises - 1]).all()


@pytest.mark.parametrize("temp", [None, "nan"])
def test_fit_without_temperatures_says_the_rc_model_needs_a_sensor(temp):
    trace = simulate(RPI4, 120.0, period_s=0.5, cooldown_s=60.0)
    temp_c = None if temp is None else np.full_like(trace.temp_c, np.nan)
    blind = Trace(trace.time_s, temp_c, trace.freq_mhz, trace.busy)
    with pytest.raises(ValueError, match=r"no temperature readings \(no sensor\)"):
        fit(blind, levels_mhz=RPI4.levels_mhz, ambient_c=25.0)


def test_fit_refuses_what_the_trace_cannot_tell():
    quiet = simulate(_QUIET, 100.0, period_s=0.5, cooldown_s=100.0)
    with pytest.raises(ValueError, match="ambient_c is required unless cold_start"):
        fit(quiet, levels_mhz=_QUIET.levels_mhz, throttle_c=95.0)
    with pytest.raises(ValueError, match="no clock drop: give throttle_c"):
        fit(quiet, levels_mhz=_QUIET.levels_mhz, ambient_c=30.0)
    busy_only = simulate(_QUIET, 100.0, period_s=0.5)
    with pytest.raises(ValueError, match="cannot separate idle_rise_c from busy_rise_c"):
        fit(busy_only, levels_mhz=_QUIET.levels_mhz, ambient_c=30.0, throttle_c=95.0)


def test_simulated_noise_is_reproducible_from_its_seed():
    one, two, other = (
        simulate(RPI4, 60.0, period_s=0.5, noise_c=0.5, seed=s).temp_c for s in (1, 1, 2)
    )
    assert np.array_equal(one, two) and not np.array_equal(one, other)


# --- parameters: validation and round trips --------------------------------------------------


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"tau_s": -60.0}, "tau_s"),
        ({"tau_s": 0.0}, "tau_s"),
        ({"levels_mhz": (600.0, 1500.0)}, "levels_mhz"),
        ({"levels_mhz": (1500.0, 1500.0)}, "levels_mhz"),
        ({"levels_mhz": ()}, "levels_mhz"),
        ({"levels_mhz": (1500.0, -1.0)}, "levels_mhz"),
        ({"idle_rise_c": -1.0}, "idle_rise_c"),
        ({"busy_rise_c": 5.0}, "busy_rise_c"),
        ({"ambient_c": math.nan}, "ambient_c"),
        ({"throttle_c": True}, "throttle_c"),
        ({"dwell_s": "5"}, "dwell_s"),
        ({"hysteresis_c": -3.0}, "hysteresis_c"),
        ({"cooling_scale": 0.0}, "cooling_scale"),
        ({"source": ""}, "source"),
    ],
)
def test_bad_params_name_the_field(changes, field):
    with pytest.raises(ValueError, match=f"'{field}'"):
        _params(**changes)


def test_unknown_cooling_is_an_error():
    with pytest.raises(ValueError, match=r"cooling must be one of.*'turbo'"):
        RPI4.with_cooling("turbo")


def test_dict_round_trip_through_msgpack():
    d = RPI4.to_dict()
    assert isinstance(d["levels_mhz"], list)
    assert ThermalParams.from_dict(msgpack.unpackb(msgpack.packb(d))) == RPI4


def test_from_dict_is_strict():
    with pytest.raises(ValueError, match=r"unknown key.*'turbo'"):
        ThermalParams.from_dict({**RPI4.to_dict(), "turbo": True})
    d = RPI4.to_dict()
    del d["dwell_s"]
    with pytest.raises(ValueError, match=r"missing key.*'dwell_s'"):
        ThermalParams.from_dict(d)
    with pytest.raises(ValueError, match="must be a map"):
        ThermalParams.from_dict([1, 2])
