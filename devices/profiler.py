"""Measure this host for a device profile: a GEMM shape grid, a held-out set, a sustained load.

``profile`` is what ``morphling profile`` runs: it times a grid of tile shapes with the real
kernels, fits a ``ComputeModel`` to it, scores the fit on held-out shapes measured in the
same rounds, records a sustained-load trace (temperatures and clocks from sysfs where the host
has them) and fits the RC thermal model to it, and writes it all as a TOML profile that
``devices.profiles.load_profile`` reads.

``cached_host_profile`` is the built-in ``host`` profile behind that: this host measured once
(the quick plan) and kept in the user's cache directory until the CPU, the BLAS library or
the thread count it was measured with changes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import fcntl
import json
import logging
import math
import mmap
import os
import socket
import time
import tomllib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from morphling.kernels import GemmPlan, blas_info, plan_explicit, run_plan, set_threads
from tqdm import tqdm

from .models.compute import ComputeModel, GemmShape, heldout_error
from .models.links import LINKS, Link
from .models.profiles import HOST
from .models.thermal import ThermalFit, Trace, clock_changes, fit

log = logging.getLogger(__name__)

# Shapes of interest: the tiles a transformer training step issues. A tile is at most
# block × block (blocks of 64-512), an edge tile any size below; K is the full inner
# dimension; an operand is contiguous or a block of a wider matrix, whose width is a model
# dimension (GPT-2: 768, 2304, 3072; BERT-large, GPT-2 medium: 1024, 4096).
WIDTHS = (768, 1024, 2048, 2304, 3072, 4096)
# (ta, tb): a transformer step issues x·Wᵀ (forward), g·W (input gradient) and gᵀ·x (weight
# gradient), in attention too; both operands transposed comes only from user code.
TRANSPOSES = ((False, True), (False, False), (True, False), (True, True))
TRANSPOSE_SHARES = (0.3, 0.3, 0.3, 0.1)
MN_RANGE = (1, 512)
BLOCK_RANGE = (64, 512)
K_RANGE = (16, 4096)
FLOAT64_SHARE = 0.25

# Grid levels: four per octave, rounded, so sizes fall on many residues modulo the vector
# width (the fit must see edge tiles); held-out shapes use only sizes between the levels.
MN_LEVELS = tuple(sorted({round(2 ** (i / 4)) for i in range(37)}))
K_LEVELS = tuple(sorted({round(2 ** (i / 4)) for i in range(16, 49)}))

# The large-GEMM rate the profile's ``flops`` reports: a full 512-block of nn.Linear's
# forward GEMM (x · Wᵀ) with K = 4096, both operands contiguous.
LARGE_GEMM = GemmShape(512, 512, 4096, False, True, 4096, 4096, "float32")
# The sustained load: a 256-block tile of the same kind, about 1 ms on one x86 core.
BURST_GEMM = GemmShape(256, 256, 1024, False, True, 1024, 1024, "float32")

# Where the sensors are read: a parameter everywhere, so a test can hand a directory tree that
# stands in for sysfs. Temperatures are millidegrees C, clocks kHz.
SYSFS = Path("/sys")
TEMPERATURES = "class/thermal/thermal_zone*/temp"
CLOCKS = "devices/system/cpu/cpu*/cpufreq/scaling_cur_freq"
MAX_CLOCK = "devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq"
UNKNOWN_CLOCK_MHZ = 1000.0
# cpufreq readings within this fraction of each other are one clock level: a board's levels
# are far apart (Pi 4: 1500, 1000, 750, 600 MHz), while an x86 core's reported clock wanders.
LEVEL_TOLERANCE = 0.05


@dataclass(frozen=True, slots=True)
class Plan:
    """How much to measure: grid and held-out shapes, interleaved rounds, trace seconds."""

    grid: int
    heldout: int
    rounds: int
    duration_s: float


FULL = Plan(grid=3000, heldout=300, rounds=5, duration_s=60.0)  # about 2 minutes
QUICK = Plan(grid=800, heldout=100, rounds=3, duration_s=2.0)  # about 10 s: for tests


# --- shapes ----------------------------------------------------------------------------------


def _log_uniform(rng: np.random.Generator, lo: int, hi: int) -> int:
    return round(math.exp(rng.uniform(math.log(lo), math.log(hi))))


def _tile_size(rng: np.random.Generator) -> int:
    """A full block (log-uniform in BLOCK_RANGE) or an edge tile (uniform in MN_RANGE)."""
    if rng.random() < 0.5:
        return _log_uniform(rng, *BLOCK_RANGE)
    return int(rng.integers(MN_RANGE[0], MN_RANGE[1] + 1))


def _leading(rng: np.random.Generator, row: int) -> int:
    """Contiguous half the time, else the width of a wider matrix the operand is a block of."""
    wider = [w for w in WIDTHS if w >= row]
    if rng.random() < 0.5 or not wider:
        return row
    return int(rng.choice(wider))


def _snap(value: int, levels: Sequence[int]) -> int:
    return min(levels, key=lambda level: abs(math.log(level / value)))


def _draw(rng: np.random.Generator, grid: bool) -> GemmShape:
    while True:
        m, n, k = _tile_size(rng), _tile_size(rng), _log_uniform(rng, *K_RANGE)
        if grid:
            m, n, k = _snap(m, MN_LEVELS), _snap(n, MN_LEVELS), _snap(k, K_LEVELS)
            break
        if m not in MN_LEVELS and n not in MN_LEVELS and k not in K_LEVELS:
            break
    ta, tb = TRANSPOSES[rng.choice(len(TRANSPOSES), p=TRANSPOSE_SHARES)]
    dtype = "float64" if rng.random() < FLOAT64_SHARE else "float32"
    return GemmShape(
        m, n, k, ta, tb, _leading(rng, m if ta else k), _leading(rng, k if tb else n), dtype
    )


def _distinct(count: int, seed: int, grid: bool) -> list[GemmShape]:
    if count < 0:
        raise ValueError(f"count must be >= 0, got {count}")
    rng = np.random.default_rng(seed)
    shapes: dict[GemmShape, None] = {}
    while len(shapes) < count:
        shapes[_draw(rng, grid)] = None
    return list(shapes)


def grid_shapes(count: int, *, seed: int = 0) -> list[GemmShape]:
    """``count`` distinct shapes of interest, sizes snapped to the grid levels."""
    return _distinct(count, seed, grid=True)


def heldout_shapes(count: int, *, seed: int = 1) -> list[GemmShape]:
    """``count`` distinct shapes from the same distribution with no size on a grid level."""
    return _distinct(count, seed, grid=False)


# --- timing ----------------------------------------------------------------------------------


def _fresh(nbytes: int) -> np.ndarray:
    """Anonymous pages as the device's buffer pool gets them (no huge-page advice: with it,
    page-multiple strides ran 40 % slower or not depending on the allocation), filled with a
    normal number in both float widths (0x3F bytes) so no denormal slows the kernel."""
    memory = np.frombuffer(mmap.mmap(-1, max(nbytes, 1)), np.uint8)
    memory[:] = 0x3F
    return memory


def _buffers(shapes: Sequence[GemmShape]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Fresh A, B and C buffers, each page-aligned and large enough for every shape."""

    def span(rows: int, cols: int, ld: int, itemsize: int) -> int:
        return ((rows - 1) * ld + cols) * itemsize

    a = max(span(s.a_rows, s.a_cols, s.lda, s.itemsize) for s in shapes)
    b = max(span(s.b_rows, s.b_cols, s.ldb, s.itemsize) for s in shapes)
    c = max(s.m * s.n * s.itemsize for s in shapes)
    return _fresh(a), _fresh(b), _fresh(c)


def _plan(s: GemmShape, buffers: tuple[np.ndarray, np.ndarray, np.ndarray]) -> GemmPlan:
    a, b, c = buffers
    return plan_explicit(s.dtype, s.ta, s.tb, s.m, s.n, s.k, a, s.lda, b, s.ldb, c, s.n)


def _calls_for(plan: GemmPlan, seconds: float, clock: Callable[[], float]) -> int:
    """Back-to-back calls of ``plan`` that take about ``seconds`` (from one timed call)."""
    start = clock()
    run_plan(plan)
    return math.ceil(seconds / max(clock() - start, 1e-7))


def measure(
    shapes: Sequence[GemmShape],
    *,
    threads: int = 1,
    rounds: int = 5,
    min_batch_s: float = 2e-4,
    seed: int = 0,
    progress: Callable[[int], None] | None = None,
) -> list[tuple[GemmShape, float]]:
    """Seconds per GEMM of each shape, timed with the real kernels on ``threads`` threads.

    Each round gets fresh operand buffers and visits the shapes in a new random order; a
    shape's time in a round is the mean of a batch of back-to-back calls (at least
    ``min_batch_s``) after one warm-up call, and its result is the fastest round. Other
    processes on a shared machine only ever slow a round down, and interleaving spreads a
    slow spell over many shapes instead of ruining a few. ``progress`` is called with 1
    after each shape in each round. Sets the calling thread's BLAS thread count.
    """
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    if not shapes:
        return []
    set_threads(threads)
    # One thread computes in the calling thread, so its CPU time leaves out the time the OS
    # gave other processes; more threads need the wall clock.
    clock = time.thread_time if threads == 1 else time.perf_counter
    rng = np.random.default_rng(seed)
    best = np.full(len(shapes), math.inf)
    calls = np.zeros(len(shapes), dtype=np.int64)
    for _ in range(rounds):
        buffers = _buffers(shapes)
        for i in rng.permutation(len(shapes)):
            plan = _plan(shapes[i], buffers)
            run_plan(plan)  # warm-up: operands into cache, pages faulted in
            if calls[i] == 0:
                calls[i] = _calls_for(plan, min_batch_s, clock)
            count = int(calls[i])
            start = clock()
            for _ in range(count):
                run_plan(plan)
            best[i] = min(best[i], (clock() - start) / count)
            if progress is not None:
                progress(1)
    return list(zip(shapes, best.tolist(), strict=True))


@dataclass(frozen=True, slots=True)
class Timed:
    """A grid to fit and a held-out set to score the fit, timed in the same rounds."""

    grid: list[tuple[GemmShape, float]]
    heldout: list[tuple[GemmShape, float]]
    repeat_p90: float  # how far the held-out set's two timings differ, at p90 (0.03 = 3 %)


def measure_grid_and_heldout(
    grid: Sequence[GemmShape],
    heldout: Sequence[GemmShape],
    *,
    threads: int = 1,
    rounds: int = 5,
    progress: Callable[[int], None] | None = None,
) -> Timed:
    """Time both sets interleaved, so a slow spell on a shared host hits both alike.

    Held-out shapes are listed twice: their reference time is the faster of two independent
    timings (twice the rounds), and how far the two differ says how well this host
    reproduces its own measurements, which bounds how well any fit can be judged on it.
    """
    timed = measure([*grid, *heldout, *heldout], threads=threads, rounds=rounds,
                    progress=progress)  # fmt: skip
    first, second = timed[len(grid) : len(grid) + len(heldout)], timed[len(grid) + len(heldout) :]
    once = np.array([t for _, t in first])
    twice = np.array([t for _, t in second])
    return Timed(
        timed[: len(grid)],
        [(s, min(a, b)) for s, a, b in zip(heldout, once.tolist(), twice.tolist(), strict=True)],
        float(np.percentile(np.abs(twice / once - 1.0), 90)) if heldout else 0.0,
    )


# --- sustained load --------------------------------------------------------------------------


def _largest(sysfs: Path, pattern: str, scale: float) -> float | None:
    """The largest number in the files ``pattern`` matches under ``sysfs``, times ``scale``;
    None where there is none (unreadable files, as a sensor being rewritten, are skipped)."""
    readings = []
    for path in sorted(sysfs.glob(pattern)):
        try:
            readings.append(int(path.read_text().strip()) * scale)
        except (OSError, ValueError):
            continue
    return max(readings) if readings else None


def read_temperature_c(sysfs: Path = SYSFS) -> float | None:
    """The hottest thermal zone in °C, or None where there is no sensor."""
    return _largest(sysfs, TEMPERATURES, 1e-3)


def read_clock_mhz(sysfs: Path = SYSFS) -> float | None:
    """The fastest core's current clock (cpufreq) in MHz, or None without cpufreq."""
    return _largest(sysfs, CLOCKS, 1e-3)


def top_clock_mhz(sysfs: Path = SYSFS) -> float:
    """The CPU's top clock: cpufreq's maximum, else /proc/cpuinfo's fastest core, else
    ``UNKNOWN_CLOCK_MHZ`` (then a trace's clocks are ratios scaled to it)."""
    top = _largest(sysfs, MAX_CLOCK, 1e-3)
    if top is not None:
        return top
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return UNKNOWN_CLOCK_MHZ
    clocks = [float(line.split(":")[1]) for line in lines if line.startswith("cpu MHz")]
    return max(clocks) if clocks else UNKNOWN_CLOCK_MHZ


@dataclass(frozen=True, slots=True)
class Bursts:
    """What a sustained run recorded: one sample per burst, then one per idle sample."""

    shape: GemmShape
    start_s: np.ndarray  # each sample's time since the run began
    latency_s: np.ndarray  # seconds per GEMM in each burst: the first latency_s.size samples
    temp_c: np.ndarray  # NaN without a sensor
    clock_mhz: np.ndarray  # cpufreq's, read as each burst ends; NaN without cpufreq
    top_clock_mhz: float
    elapsed_s: float  # of load
    cooldown_s: float  # of idle after it

    @property
    def busy(self) -> np.ndarray:
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


def run_bursts(
    duration_s: float, *, burst_shape: GemmShape = BURST_GEMM, threads: int = 1,
    burst_s: float = 0.1, cooldown_s: float = 0.0, sysfs: Path = SYSFS,
) -> Bursts:  # fmt: skip
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
    plan = _plan(burst_shape, _buffers([burst_shape]))
    run_plan(plan)
    calls = _calls_for(plan, burst_s, time.perf_counter)
    rows: list[tuple[float, float, float]] = []
    latencies: list[float] = []
    log.info("sustained load for %g s", duration_s)
    begin = time.perf_counter()
    while (now := time.perf_counter()) - begin < duration_s:
        temp = read_temperature_c(sysfs)
        for _ in range(calls):
            run_plan(plan)
        latencies.append((time.perf_counter() - now) / calls)
        rows.append((now - begin, _reading(temp), _reading(read_clock_mhz(sysfs))))
    load_end = idle_end = time.perf_counter()
    if cooldown_s > 0:
        log.info("idle for %g s, sampling every %g s", cooldown_s, burst_s)
    while (now := time.perf_counter()) - load_end < cooldown_s:
        rows.append((now - begin, _reading(read_temperature_c(sysfs)),
                     _reading(read_clock_mhz(sysfs))))  # fmt: skip
        time.sleep(burst_s)
        idle_end = time.perf_counter()
    start_s, temp_c, clock_mhz = (np.array(column) for column in zip(*rows, strict=True))
    return Bursts(burst_shape, start_s, np.array(latencies), temp_c, clock_mhz,
                  top_clock_mhz(sysfs), load_end - begin, idle_end - load_end)  # fmt: skip


def sustained_trace(
    duration_s: float, *, burst_shape: GemmShape = BURST_GEMM, threads: int = 1,
    cooldown_s: float = 0.0, sysfs: Path = SYSFS,
) -> Trace:  # fmt: skip
    """A sustained-load ``Trace``: time, clock and temperature (NaN where the host has no
    thermal zone) per burst, then per idle sample."""
    return run_bursts(duration_s, burst_shape=burst_shape, threads=threads,
                      cooldown_s=cooldown_s, sysfs=sysfs).trace()  # fmt: skip


def clock_levels(clocks_mhz: np.ndarray) -> tuple[float, ...]:
    """The distinct clocks in ``clocks_mhz``, highest first, readings within
    ``LEVEL_TOLERANCE`` of a level's top one merged into it."""
    levels: list[float] = []
    for clock in sorted(set(clocks_mhz.tolist()), reverse=True):
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
    given: dict[str, float] = {}
    notes = [clocks]
    if events.drops.size == 0:
        given["throttle_c"] = hottest
        notes.append(f"no clock drop up to {hottest:.1f} C, so throttle_c is that bound")
    if events.rises.size == 0:
        given["hysteresis_c"] = 0.0
        notes.append("no clock rise, so hysteresis_c is 0")
    if events.changes.size < 2:
        given["dwell_s"] = 0.0
        notes.append("fewer than two clock changes, so dwell_s is 0")
    result = fit(trace, levels_mhz=levels, ambient_c=ambient_c, **given)
    said = (
        f"{source}: RC model fitted to {bursts.elapsed_s:.1f} s of load then "
        f"{bursts.cooldown_s:.1f} s idle, {trace.time_s.size} samples, {result.readings} "
        f"temperature readings, residual {result.rms_c:.3g} C rms, ambient {ambient_c:g} C "
        f"given; {'; '.join(notes)}"
    )
    return result._replace(params=dataclasses.replace(result.params, source=said))


# --- the profile file ------------------------------------------------------------------------


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return repr(float(value))  # Python's float spellings are TOML's (inf, nan too)
    if isinstance(value, str):
        return json.dumps(value)  # JSON string escapes are a subset of TOML's
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {_toml_value(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        if value and isinstance(value[0], dict):  # a list of records: one per line
            return "[\n" + "".join(f"  {_toml_value(v)},\n" for v in value) + "]"
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise ValueError(f"cannot write {type(value).__name__} to TOML")


def dump_toml(tables: dict[str, dict[str, Any]]) -> str:
    """TOML for top-level tables of str/int/float/bool values and lists of them or of flat
    records (the standard library reads TOML but does not write it)."""
    return "\n".join(
        f"[{name}]\n" + "".join(f"{key} = {_toml_value(value)}\n" for key, value in table.items())
        for name, table in tables.items()
    )


def _memory_bytes() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024  # kB
    raise ValueError("/proc/meminfo has no MemTotal line")


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("model name", "Model")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return os.uname().machine


@dataclass(frozen=True, slots=True)
class ProfileResult:
    """What ``profile`` wrote, for the command to report."""

    path: Path
    model: ComputeModel
    flops: float
    heldout: dict[str, float]
    bursts: Bursts
    thermal: ThermalFit | None  # None: not fitted, ``thermal_status`` says why
    thermal_status: str


def plan_size(plan: Plan) -> int:
    """Timed shape-rounds ``profile`` reports to its progress callback."""
    return (plan.grid + 2 * plan.heldout) * plan.rounds


def profile(
    output: str | Path,
    *,
    threads: int = 1,
    plan: Plan = FULL,
    duration_s: float | None = None,
    cooldown_s: float | None = None,
    ambient_c: float | None = None,
    name: str = "host",
    force: bool = False,
    link: Link = LINKS["lan"],
    progress: Callable[[int], None] | None = None,
    sysfs: Path = SYSFS,
) -> ProfileResult:
    """Measure, fit and score, trace, and write the profile TOML to ``output``.

    The grid and the held-out set are timed in the same interleaved rounds
    (``measure_grid_and_heldout``). The written exact cache holds both sets (the fit and
    its score use the grid only). ``duration_s`` defaults to the plan's. The links are
    not measured here: ``link`` is a preset, named in the provenance.

    Where ``sysfs`` has a thermal zone and the room temperature ``ambient_c`` is given, the
    load is followed by ``cooldown_s`` idle (default: as long as the load) and the RC thermal
    model fitted to the whole trace goes into a ``[thermal]`` table (``fit_thermal``).
    Otherwise, or when the fit fails, there is no ``[thermal]`` table and the provenance and
    the log say why: a profile never carries thermal parameters its trace did not give.
    """
    duration = plan.duration_s if duration_s is None else duration_s
    path = Path(output)
    if path.exists() and not force:
        raise FileExistsError(f"{path} exists (overwrite it with force)")
    why_not = None
    if read_temperature_c(sysfs) is None:  # the usual server or VM: worth a note, no more
        why_not = (f"not fitted: no thermal zone on this host (nothing readable matches "
                   f"{sysfs / TEMPERATURES}), so the trace has no temperatures")  # fmt: skip
        log.info("thermal model %s", why_not)
    elif ambient_c is None:
        why_not = ("not fitted: the room temperature was not given (--ambient), and a trace "
                   "that starts warm fixes only ambient + idle rise, not each")  # fmt: skip
        log.warning("thermal model %s", why_not)
    info = blas_info()
    grid = grid_shapes(plan.grid, seed=0)
    heldout = heldout_shapes(plan.heldout, seed=1)
    log.info("timing %d grid and %d held-out GEMM shapes, %d rounds, %d BLAS thread(s)",
             len(grid), len(heldout), plan.rounds, threads)  # fmt: skip
    timed = measure_grid_and_heldout(grid, heldout, threads=threads, rounds=plan.rounds,
                                     progress=progress)  # fmt: skip
    model = ComputeModel.fit(timed.grid)
    error = heldout_error(model, timed.heldout)
    log.info("fitted; held-out error median %.1f %%, p90 %.1f %% (repeat timings differ "
             "%.1f %% at p90)", 100 * error["median_ape"], 100 * error["p90_ape"],
             100 * timed.repeat_p90)  # fmt: skip
    model.exact.update(timed.heldout)
    flops = LARGE_GEMM.flops / model.predict_s(LARGE_GEMM)
    cooldown = 0.0 if why_not is not None else duration if cooldown_s is None else cooldown_s
    bursts = run_bursts(duration, threads=threads, cooldown_s=cooldown, sysfs=sysfs)
    host = socket.gethostname()
    now = datetime.datetime.now(datetime.UTC).replace(microsecond=0)
    source = f"measured on {host} by morphling profile at {now.isoformat()}"
    if why_not is None and ambient_c is not None:  # (no why_not implies an ambient)
        thermal, status = _fit_or_say_why(bursts, ambient_c, source)
    else:
        thermal, status = None, str(why_not)
    tables = {
        "profile": {
            "name": name,
            "flops": flops,
            "memory_bytes": _memory_bytes(),
            "dl_bw": link.dl_bw,
            "ul_bw": link.ul_bw,
            "dl_lat_s": link.dl_lat_s,
            "ul_lat_s": link.ul_lat_s,
            "kind": "cpu",
            "blas": f"{info.name} {info.version}",
            "source": source,
        },
        "compute": model.to_dict(),
        "provenance": {
            "host": host,
            "cpu": _cpu_model(),
            "blas": info.name,
            "blas_version": info.version,
            "blas_path": info.path,
            "threads": threads,
            "date": now.isoformat(),
            "grid_shapes": len(grid),
            "heldout_shapes": len(heldout),
            "rounds": plan.rounds,
            "heldout_median_ape": error["median_ape"],
            "heldout_p90_ape": error["p90_ape"],
            "heldout_max_ape": error["max_ape"],
            "heldout_repeat_p90": timed.repeat_p90,
            "links": f"{link.name} preset, not measured: {link.source}",
            "thermal": status,
        },
        "trace": _trace_summary(bursts, thermal),
    }
    if thermal is not None:
        tables["thermal"] = thermal.params.to_dict()
    with path.open("w" if force else "x") as f:  # "x": never clobber without force
        f.write(dump_toml(tables))
    return ProfileResult(path, model, flops, error, bursts, thermal, status)


def _fit_or_say_why(bursts: Bursts, ambient_c: float, source: str) -> tuple[ThermalFit | None, str]:
    """``fit_thermal``, or None where the trace cannot give the model; what happened, logged.

    A failed fit is a warning, not an error: the compute model measured before it stands."""
    try:
        thermal = fit_thermal(bursts, ambient_c=ambient_c, source=source)
    except ValueError as exc:
        status = f"not fitted: {exc}"
        log.warning("thermal model %s", status)
        return None, status
    status = (f"fitted: tau {thermal.params.tau_s:.3g} s, residual {thermal.rms_c:.3g} C rms "
              f"over {thermal.readings} temperature readings (see [thermal])")  # fmt: skip
    log.info("thermal model %s", status)
    return thermal, status


def _trace_summary(bursts: Bursts, thermal: ThermalFit | None) -> dict[str, Any]:
    """The trace for people: how long, how many samples, what it read, how the fit did
    (whether there is a fit, and why not, is in ``[provenance] thermal``)."""
    latency = bursts.latency_s
    s = bursts.shape
    summary: dict[str, Any] = {
        "duration_s": bursts.elapsed_s,
        "cooldown_s": bursts.cooldown_s,
        "bursts": int(latency.size),
        "samples": int(bursts.start_s.size),
        "burst_gemm": f"{s.m}x{s.n}x{s.k} {s.dtype} ta={s.ta} tb={s.tb}",
        "first_latency_s": float(latency[0]),
        "last_latency_s": float(latency[-1]),
        "fastest_latency_s": float(latency.min()),
        "top_clock_mhz": bursts.top_clock_mhz,
        "clocks": "cpufreq" if bursts.has_clocks else "inferred from burst latency",
        "temperatures": bursts.has_temperatures,
        "temperature_readings": int(np.isfinite(bursts.temp_c).sum()),
    }
    if thermal is not None:
        summary["thermal_fit_rms_c"] = thermal.rms_c
    return summary


# --- the built-in ``host`` profile -----------------------------------------------------------

HOST_THREADS_ENV = "MORPHLING_HOST_THREADS"
# What a cached ``host`` profile must have been measured with ([provenance] keys) to stand for
# this host now: another CPU, BLAS build or thread count computes at another speed.
HOST_KEY = ("cpu", "blas", "blas_version", "threads")


def host_threads() -> int:
    """BLAS threads the ``host`` profile is measured with: ``MORPHLING_HOST_THREADS``, else
    every core (as ``morphling profile`` defaults). Compare it with a script on as many."""
    text = os.environ.get(HOST_THREADS_ENV)
    if text is None:
        return os.cpu_count() or 1
    if not text.strip().isdigit() or int(text) < 1:
        raise ValueError(f"{HOST_THREADS_ENV}={text!r}: expected a positive integer")
    return int(text)


def cache_dir() -> Path:
    """Morphling's directory in the user cache: ``$XDG_CACHE_HOME/morphling``, else
    ``~/.cache/morphling``."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "morphling"


def host_key(threads: int) -> dict[str, Any]:
    """``HOST_KEY`` for this host now, measuring on ``threads`` threads."""
    info = blas_info()
    return {"cpu": _cpu_model(), "blas": info.name, "blas_version": info.version,
            "threads": threads}  # fmt: skip


def _stale(path: Path, key: dict[str, Any]) -> str | None:
    """Why the cached profile at ``path`` cannot be used for ``key``; None when it can."""
    try:
        with path.open("rb") as f:
            provenance = tomllib.load(f).get("provenance", {})
    except FileNotFoundError:
        return "no cached profile"
    except (OSError, tomllib.TOMLDecodeError) as exc:
        return f"the cached profile is unreadable ({exc})"
    changed = [name for name in HOST_KEY if provenance.get(name) != key[name]]
    if changed:
        return f"the cached profile was measured with another {', '.join(changed)}"
    return None


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive lock on ``path``: two processes measuring at once would time each other."""
    with path.open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def cached_host_profile(
    *, threads: int | None = None, directory: Path | None = None, plan: Plan = QUICK
) -> Path:
    """The file of the built-in ``host`` profile: this host on ``threads`` BLAS threads
    (default ``host_threads()``), cached in ``directory`` (default ``cache_dir()``).

    A cached file is used while its ``HOST_KEY`` matches this host; otherwise the host is
    measured first (``plan``, the quick one by default: about 30 s on one x86 core) and the
    file replaced atomically. Its links are the ``ideal`` preset: the host is its own device.
    """
    threads = host_threads() if threads is None else threads
    directory = cache_dir() if directory is None else directory
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{HOST}-{threads}t.toml"
    key = host_key(threads)
    with _locked(directory / f"{HOST}.lock"):
        why = _stale(path, key)
        if why is None:
            log.debug("host profile: using the cached %s", path)
            return path
        log.warning("measuring this host for the %r profile (%s; %d BLAS thread(s), once): "
                    "cached in %s", HOST, why, threads, path)  # fmt: skip
        partial = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        try:
            with tqdm(total=plan_size(plan), desc=f"{HOST} profile", unit="shape",
                      disable=None, leave=False) as bar:  # fmt: skip
                profile(partial, threads=threads, plan=plan, name=HOST, force=True,
                        link=LINKS["ideal"], progress=bar.update)  # fmt: skip
            os.replace(partial, path)
        finally:
            partial.unlink(missing_ok=True)
    return path
