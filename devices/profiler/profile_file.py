"""Measure this host and write it as a device profile file, what ``morphling profile`` runs.

It times a grid of GEMM tile shapes with the real kernels, fits a ``ComputeModel`` to it,
scores the fit on held-out shapes measured in the same rounds, does the same for a grid of
convolution calls and a ``ConvModel``, records a sustained-load trace and fits the RC
thermal model to it where the host has a sensor, and writes it all as a TOML profile that
``devices.models.profiles.load_profile`` reads.
"""

from __future__ import annotations

import datetime
import logging
import socket
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import numpy as np
from morphling.kernels import blas_info
from morphling.kernels import conv as conv_kernels

from ..models.compute import ComputeModel, GemmShape, heldout_error
from ..models.conv import ConvModel
from ..models.links import LINKS, Link
from ..models.ops import OpModel
from ..models.thermal import ThermalFit
from .conv_shapes import conv_grid_shapes, conv_heldout_shapes, describe
from .conv_timing import measure_conv
from .host_facts import cpu_model, memory_bytes
from .sensors import SYSFS, TEMPERATURES, read_temperature_c
from .shapes import grid_shapes, heldout_shapes
from .sustained_load import Bursts, fit_thermal, run_bursts
from .timing import Progress, measure, measure_grid_and_heldout
from .toml_writer import Table, TomlValue, dump_toml

op_timing: ModuleType | None
conv_native: ModuleType | None
try:  # the op model and the native scale time PyTorch's own ops: a board without torch has none
    from . import conv_native, op_timing
except ImportError:  # pragma: no cover - torch is installed wherever the tests run
    op_timing = conv_native = None

log = logging.getLogger(__name__)


def native_revision() -> int:
    """How this Morphling times the convolution model's native scale
    (``conv_native.REVISION``), or 0 where it cannot (torch absent)."""
    return 0 if conv_native is None else conv_native.REVISION


# The large-GEMM rate the profile's ``flops`` reports: a full 512-block of nn.Linear's
# forward GEMM (x · Wᵀ) with K = 4096, both operands contiguous.
LARGE_GEMM = GemmShape(512, 512, 4096, False, True, 4096, 4096, "float32")


@dataclass(frozen=True, slots=True)
class Plan:
    """How much to measure: GEMM grid and held-out shapes, convolution grid and held-out
    calls, interleaved rounds, trace seconds."""

    grid: int
    heldout: int
    conv_grid: int
    conv_heldout: int
    rounds: int
    duration_s: float


# About 4 minutes on one x86 core.
FULL = Plan(grid=3000, heldout=300, conv_grid=2000, conv_heldout=300, rounds=5, duration_s=60.0)
# About 30 s on one x86 core: the built-in ``host`` profile.
QUICK = Plan(grid=800, heldout=100, conv_grid=400, conv_heldout=60, rounds=3, duration_s=2.0)

# Why there is no thermal model, where the host cannot give one.
_NO_SENSOR = (
    "not fitted: no thermal zone on this host (nothing readable matches {pattern}), so the "
    "trace has no temperatures"
)
_NO_AMBIENT = (
    "not fitted: the room temperature was not given (--ambient), and a trace that starts "
    "warm fixes only ambient + idle rise, not each"
)


@dataclass(frozen=True, slots=True)
class ProfileResult:
    """What ``profile`` wrote, for the command to report."""

    path: Path
    model: ComputeModel
    flops: float
    heldout: dict[str, float]
    conv: ConvModel
    conv_heldout: dict[str, float]
    ops: OpModel | None  # None: torch is not installed, so no op to time
    ops_error: dict[str, float]
    bursts: Bursts
    thermal: ThermalFit | None  # None: not fitted, ``thermal_status`` says why
    thermal_status: str


def plan_size(plan: Plan) -> int:
    """Timed shape-rounds ``profile`` reports to its progress callback."""
    shapes = (plan.grid + 2 * plan.heldout + plan.conv_grid + 2 * plan.conv_heldout) * plan.rounds
    return shapes + (op_timing.items_count(plan.rounds) if op_timing is not None else 0)


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
    progress: Progress | None = None,
    sysfs: Path = SYSFS,
) -> ProfileResult:
    """Measure, fit and score, trace, and write the profile TOML to ``output``.

    The GEMM grid and held-out set are timed in the same interleaved rounds
    (``measure_grid_and_heldout``), and so are the convolution ones. Each written exact
    cache holds both sets (the fit and its score use the grid only). ``duration_s``
    defaults to the plan's. The links are not measured here: ``link`` is a preset, named
    in the provenance.

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
        why_not = _NO_SENSOR.format(pattern=sysfs / TEMPERATURES)
        log.info("thermal model %s", why_not)
    elif ambient_c is None:
        why_not = _NO_AMBIENT
        log.warning("thermal model %s", why_not)
    info = blas_info()
    grid = grid_shapes(plan.grid, seed=0)
    heldout = heldout_shapes(plan.heldout, seed=1)
    log.info(
        "timing %d grid and %d held-out GEMM shapes, %d rounds, %d BLAS thread(s)",
        len(grid),
        len(heldout),
        plan.rounds,
        threads,
    )
    timed = measure_grid_and_heldout(
        grid, heldout, measure=measure, threads=threads, rounds=plan.rounds, progress=progress
    )
    model = ComputeModel.fit(timed.grid)
    error = heldout_error(model, timed.heldout)
    log.info(
        "fitted; held-out error median %.1f %%, p90 %.1f %% (repeat timings differ %.1f %% at p90)",
        100 * error["median_ape"],
        100 * error["p90_ape"],
        100 * timed.repeat_p90,
    )
    model.exact.update(timed.heldout)
    flops = LARGE_GEMM.flops / model.predict_s(LARGE_GEMM)
    conv, conv_error, conv_provenance = _conv_model(plan, threads, progress)
    host = socket.gethostname()
    now = datetime.datetime.now(datetime.UTC).replace(microsecond=0)
    source = f"measured on {host} by morphling profile at {now.isoformat()}"
    ops, ops_error, ops_provenance = _op_model(plan, threads, progress, source)
    cooldown = 0.0 if why_not is not None else duration if cooldown_s is None else cooldown_s
    bursts = run_bursts(duration, threads=threads, cooldown_s=cooldown, sysfs=sysfs)
    if why_not is None and ambient_c is not None:  # (no why_not implies an ambient)
        thermal, status = _fit_or_say_why(bursts, ambient_c, source)
    else:
        thermal, status = None, str(why_not)
    tables: dict[str, Table] = {
        "profile": {
            "name": name,
            "flops": flops,
            "memory_bytes": memory_bytes(),
            "dl_bw": link.dl_bw,
            "ul_bw": link.ul_bw,
            "dl_lat_s": link.dl_lat_s,
            "ul_lat_s": link.ul_lat_s,
            "kind": "cpu",
            "blas": f"{info.name} {info.version}",
            "source": source,
        },
        "compute": model.to_dict(),
        "conv": conv.to_dict(),
        "provenance": {
            "host": host,
            "cpu": cpu_model(),
            "blas": info.name,
            "blas_version": info.version,
            "blas_path": info.path,
            "conv_kernels": conv_kernels.REVISION,
            "conv_native_revision": native_revision(),
            "threads": threads,
            "date": now.isoformat(),
            "grid_shapes": len(grid),
            "heldout_shapes": len(heldout),
            "rounds": plan.rounds,
            "heldout_median_ape": error["median_ape"],
            "heldout_p90_ape": error["p90_ape"],
            "heldout_max_ape": error["max_ape"],
            "heldout_repeat_p90": timed.repeat_p90,
            **conv_provenance,
            **ops_provenance,
            "links": f"{link.name} preset, not measured: {link.source}",
            "thermal": status,
        },
        "trace": _trace_summary(bursts, thermal),
    }
    if thermal is not None:
        tables["thermal"] = thermal.params.to_dict()
    if ops is not None:
        tables["ops"] = ops.to_dict()
    with path.open("w" if force else "x") as f:  # "x": never clobber without force
        f.write(dump_toml(tables))
    return ProfileResult(
        path, model, flops, error, conv, conv_error, ops, ops_error, bursts, thermal, status
    )


def _conv_model(
    plan: Plan, threads: int, progress: Progress | None
) -> tuple[ConvModel, dict[str, float], dict[str, TomlValue]]:
    """The convolution model: fitted to the plan's grid of calls, scored on its held-out
    calls timed in the same rounds, which then join its exact cache; its provenance."""
    grid = conv_grid_shapes(plan.conv_grid, seed=0)
    held = conv_heldout_shapes(plan.conv_heldout, seed=1)
    log.info(
        "timing %d grid and %d held-out convolution calls (%s), %d rounds",
        len(grid),
        len(held),
        ", ".join(f"{count} {kind}" for kind, count in describe(grid).items()),
        plan.rounds,
    )
    timed = measure_grid_and_heldout(
        grid, held, measure=measure_conv, threads=threads, rounds=plan.rounds, progress=progress
    )
    model = ConvModel.fit(timed.grid)
    error = heldout_error(model, timed.heldout)
    log.info(
        "fitted; convolution held-out error median %.1f %%, p90 %.1f %% (repeat timings "
        "differ %.1f %% at p90)",
        100 * error["median_ape"],
        100 * error["p90_ape"],
        100 * timed.repeat_p90,
    )
    model.exact.update(timed.heldout)
    if conv_native is None:
        native = "not measured (torch is not installed): the kernels' own time"
    else:
        model = model.with_native(conv_native.measure_native_scale(threads=threads))
        native = (f"measured: PyTorch's time over the kernels' on {len(conv_native.SHAPES)} "
                  f"CNN convolutions, total over total by kind and class")  # fmt: skip
    provenance: dict[str, TomlValue] = {
        "conv_native": native,
        "conv_grid_shapes": len(grid),
        "conv_heldout_shapes": len(held),
        "conv_heldout_median_ape": error["median_ape"],
        "conv_heldout_p90_ape": error["p90_ape"],
        "conv_heldout_max_ape": error["max_ape"],
        "conv_heldout_repeat_p90": timed.repeat_p90,
    }
    return model, error, provenance


def _op_model(
    plan: Plan, threads: int, progress: Progress | None, source: str
) -> tuple[OpModel | None, dict[str, float], dict[str, TomlValue]]:
    """The op model, fitted to the ops of a training step timed on this host
    (``op_timing``), its error on those items and its provenance; None without torch."""
    if op_timing is None:
        return None, {}, {"ops": "not measured: torch is not installed"}
    items = op_timing.measure_items(threads=threads, rounds=plan.rounds, progress=progress)
    model = op_timing.fit_op_model(items, source)
    error = op_timing.op_model_error(model, items)
    log.info(
        "op model fitted to %d timed items; error median %.1f %%, p90 %.1f %%",
        error["count"],
        100 * error["median_ape"],
        100 * error["p90_ape"],
    )
    provenance: dict[str, TomlValue] = {
        "ops": f"measured: {error['count']} items of a training step's other ops timed "
        f"(torch {op_timing.torch_version()}), fitted in log space",
        "ops_median_ape": error["median_ape"],
        "ops_p90_ape": error["p90_ape"],
    }
    return model, error, provenance


def _fit_or_say_why(bursts: Bursts, ambient_c: float, source: str) -> tuple[ThermalFit | None, str]:
    """``fit_thermal``, or None where the trace cannot give the model; what happened, logged.

    A failed fit is a warning, not an error: the compute model measured before it stands."""
    try:
        thermal = fit_thermal(bursts, ambient_c=ambient_c, source=source)
    except ValueError as exc:
        status = f"not fitted: {exc}"
        log.warning("thermal model %s", status)
        return None, status
    params = thermal.params
    status = (
        f"fitted: tau {params.tau_s:.3g} s, residual {thermal.rms_c:.3g} C rms over "
        f"{thermal.readings} temperature readings (see [thermal])"
    )
    log.info("thermal model %s", status)
    return thermal, status


def _trace_summary(bursts: Bursts, thermal: ThermalFit | None) -> dict[str, TomlValue]:
    """The trace for people: how long, how many samples, what it read, how the fit did
    (whether there is a fit, and why not, is in ``[provenance] thermal``)."""
    latency = bursts.latency_s
    s = bursts.shape
    summary: dict[str, TomlValue] = {
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
