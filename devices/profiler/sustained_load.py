"""A sustained load and what it shows: a thermal trace, and the RC thermal model fitted to it.

Bursts of one GEMM shape run back to back while the sensors are read between them; an idle
spell after the load records the cooling. Where the host has cpufreq each burst's clock is
read, elsewhere it is inferred from the burst's latency.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from morphling.kernels import run_plan, set_threads
from numpy.typing import NDArray

from ..models.compute import GemmShape
from ..models.thermal import ThermalFit, Trace, clock_changes, fit
from .sensors import SYSFS, read_clock_mhz, read_temperature_c, top_clock_mhz
from .timing import calls_for, fresh_buffers, gemm_plan

log = logging.getLogger(__name__)

# The sustained load: a 256-block tile of nn.Linear's forward GEMM (x · Wᵀ), about 1 ms on
# one x86 core.
BURST_GEMM = GemmShape(256, 256, 1024, False, True, 1024, 1024, "float32")
# cpufreq readings within this fraction of each other are one clock level: a board's levels
# are far apart (Pi 4: 1500, 1000, 750, 600 MHz), while an x86 core's reported clock wanders.
LEVEL_TOLERANCE = 0.05

Floats = NDArray[np.float64]


@dataclass(frozen=True, slots=True)
class Bursts:
    """What a sustained run recorded: one sample per burst, then one per idle sample."""

    shape: GemmShape
    start_s: Floats  # each sample's time since the run began
    latency_s: Floats  # seconds per GEMM in each burst: the first latency_s.size samples
    temp_c: Floats  # NaN without a sensor
    clock_mhz: Floats  # cpufreq's, read as each burst ends; NaN without cpufreq
    top_clock_mhz: float
    elapsed_s: float  # of load
    cooldown_s: float  # of idle after it

    @property
    def busy(self) -> NDArray[np.bool_]:
        return np.arange(self.start_s.size) < self.latency_s.size

    @property
    def has_temperatures(self) -> bool:
        return bool(np.isfinite(self.temp_c).any())

    @property
    def has_clocks(self) -> bool:
        """Whether cpufreq gave every burst's clock."""
        return bool(np.isfinite(self.clock_mhz[self.busy]).all())

    def trace(self) -> Trace:
        """The thermal model's input. A burst's clock is cpufreq's where the host has it, else
        inferred from its latency, ``f = f_max × fastest / latency``."""
        freq = self.clock_mhz.copy()
        if not self.has_clocks:
            freq[self.busy] = self.top_clock_mhz * self.latency_s.min() / self.latency_s
        return Trace(self.start_s, self.temp_c, freq, self.busy)


def _reading(value: float | None) -> float:
    return math.nan if value is None else value


def _sample(begin: float, sysfs: Path) -> tuple[float, float, float]:
    """An idle sample: time since ``begin`` (once its temperature is read), temperature and
    clock (NaN for a missing sensor)."""
    temp = _reading(read_temperature_c(sysfs))
    return time.perf_counter() - begin, temp, _reading(read_clock_mhz(sysfs))


def run_bursts(
    duration_s: float,
    *,
    burst_shape: GemmShape = BURST_GEMM,
    threads: int = 1,
    burst_s: float = 0.1,
    cooldown_s: float = 0.0,
    sysfs: Path = SYSFS,
) -> Bursts:
    """Back-to-back bursts of ``burst_shape`` GEMMs (about ``burst_s`` each) for ``duration_s``,
    then ``cooldown_s`` idle with a sample every ``burst_s``: the cooling that tells the
    thermal fit the idle rise from the busy one and pins its time constant."""
    if not (math.isfinite(duration_s) and duration_s > 0):
        raise ValueError(f"duration_s must be finite and > 0, got {duration_s!r}")
    if not (math.isfinite(burst_s) and 0 < burst_s <= duration_s):
        raise ValueError(f"burst_s must be in (0, duration_s], got {burst_s!r}")
    if not (math.isfinite(cooldown_s) and cooldown_s >= 0):
        raise ValueError(f"cooldown_s must be finite and >= 0, got {cooldown_s!r}")
    set_threads(threads)
    plan = gemm_plan(burst_shape, fresh_buffers([burst_shape]))
    run_plan(plan)
    calls = calls_for(functools.partial(run_plan, plan), burst_s, time.perf_counter)
    rows: list[tuple[float, float, float]] = []
    latencies: list[float] = []
    log.info("sustained load for %g s", duration_s)
    begin = time.perf_counter()
    while True:
        # a burst's time is its reading's, taken after it: a process's first read of
        # sysfs can take tens of milliseconds, heating time the trace would not place
        temp = read_temperature_c(sysfs)
        if (now := time.perf_counter()) - begin >= duration_s and rows:
            break  # (after one burst at least: that first read may outlast a short load)
        for _ in range(calls):
            run_plan(plan)
        latencies.append((time.perf_counter() - now) / calls)
        rows.append((now - begin, _reading(temp), _reading(read_clock_mhz(sysfs))))
    load_end = idle_end = time.perf_counter()
    if cooldown_s > 0:
        log.info("idle for %g s, sampling every %g s", cooldown_s, burst_s)
    while time.perf_counter() - load_end < cooldown_s:
        rows.append(_sample(begin, sysfs))
        time.sleep(burst_s)
        idle_end = time.perf_counter()
    start_s, temp_c, clock_mhz = (np.array(column) for column in zip(*rows, strict=True))
    return Bursts(
        shape=burst_shape,
        start_s=start_s,
        latency_s=np.array(latencies),
        temp_c=temp_c,
        clock_mhz=clock_mhz,
        top_clock_mhz=top_clock_mhz(sysfs),
        elapsed_s=load_end - begin,
        cooldown_s=idle_end - load_end,
    )


def sustained_trace(
    duration_s: float,
    *,
    burst_shape: GemmShape = BURST_GEMM,
    threads: int = 1,
    cooldown_s: float = 0.0,
    sysfs: Path = SYSFS,
) -> Trace:
    """A sustained-load ``Trace``: time, clock and temperature (NaN where the host has no
    thermal zone) per burst, then per idle sample."""
    bursts = run_bursts(
        duration_s, burst_shape=burst_shape, threads=threads, cooldown_s=cooldown_s, sysfs=sysfs
    )
    return bursts.trace()


def clock_levels(clocks_mhz: Floats) -> tuple[float, ...]:
    """The distinct clocks in ``clocks_mhz``, highest first, readings within
    ``LEVEL_TOLERANCE`` of a level's top one merged into it."""
    levels: list[float] = []
    readings: list[float] = clocks_mhz.tolist()
    for clock in sorted(set(readings), reverse=True):
        if not levels or clock < levels[-1] * (1 - LEVEL_TOLERANCE):
            levels.append(clock)
    return tuple(levels)


def fit_thermal(bursts: Bursts, *, ambient_c: float, source: str) -> ThermalFit:
    """The RC thermal model of ``bursts`` (see ``thermal.fit``), ``source`` leading its own.

    Clock levels are the distinct clocks cpufreq reported under load; without cpufreq (clocks
    inferred from latency are noise on a shared host, not levels) the top clock is the only
    level. What the trace does not show is said in the source, not guessed: without a clock
    drop, ``throttle_c`` is the hottest reading (a lower bound: the device ran at one level
    up to there, so the controller never acts); without a rise, ``hysteresis_c`` is 0;
    with fewer than two changes, ``dwell_s`` is 0.
    """
    trace = bursts.trace()
    if bursts.has_clocks:
        levels = clock_levels(trace.freq_mhz[trace.busy])
        clocks = f"clock levels {'/'.join(f'{f:g}' for f in levels)} MHz from cpufreq"
    else:
        levels = (bursts.top_clock_mhz,)
        clocks = "one clock level: no cpufreq, so throttling is not observable"
    events = clock_changes(trace, levels)
    hottest = float(np.nanmax(trace.temp_c))
    # None: fitted from the trace; a number: what the trace cannot show, given.
    throttle_c: float | None = None
    hysteresis_c: float | None = None
    dwell_s: float | None = None
    notes = [clocks]
    if events.drops.size == 0:
        throttle_c = hottest
        notes.append(f"no clock drop up to {hottest:.1f} C, so throttle_c is that bound")
    if events.rises.size == 0:
        hysteresis_c = 0.0
        notes.append("no clock rise, so hysteresis_c is 0")
    if events.changes.size < 2:
        dwell_s = 0.0
        notes.append("fewer than two clock changes, so dwell_s is 0")
    result = fit(
        trace,
        levels_mhz=levels,
        ambient_c=ambient_c,
        throttle_c=throttle_c,
        hysteresis_c=hysteresis_c,
        dwell_s=dwell_s,
    )
    said = (
        f"{source}: RC model fitted to {bursts.elapsed_s:.1f} s of load then "
        f"{bursts.cooldown_s:.1f} s idle, {trace.time_s.size} samples, {result.readings} "
        f"temperature readings, residual {result.rms_c:.3g} C rms, ambient {ambient_c:g} C "
        f"given; {'; '.join(notes)}"
    )
    return result._replace(params=dataclasses.replace(result.params, source=said))
