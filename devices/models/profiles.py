"""Device profiles: how fast a device computes and how fast its link moves bytes.

A profile is the plain analytic model the virtual clock falls back on: sustained fp32 GEMM
FLOP/s, declared memory, and a link with latency and bandwidth per direction. Built-ins are
derived from the published figures in ``REFERENCE.md`` and say so in ``source``; a profile
measured on a board by ``morphling profile`` is a TOML file in the same shape. The built-in
``host`` is such a file for this host, measured on first use and cached: the models cannot
measure (they are the layer below the kernels), so the device package registers it
(``register_measured``).
"""

from __future__ import annotations

import dataclasses
import math
import re
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .board_ops import cpu_board, gpu_board
from .capacity import check_fleet_size
from .compute import ComputeModel
from .conv import ConvModel
from .links import LINKS, link
from .ops import OpModel
from .strict_map import check_keys, short
from .thermal import COOLING, ThermalParams, thermal_for

_KINDS = ("cpu", "gpu")
_FLOAT_FIELDS = ("flops", "dl_bw", "ul_bw", "dl_lat_s", "ul_lat_s")
_LATENCY_FIELDS = ("dl_lat_s", "ul_lat_s")
_BANDWIDTH_FIELDS = ("dl_bw", "ul_bw")  # may be infinite: an ideal link
_STR_FIELDS = ("name", "kind", "blas", "source", "cooling")
# Optional fields holding a fitted model ({} = none), and what parses each.
_MODEL_FIELDS: dict[str, Callable[[object], object]] = {
    "compute": ComputeModel.from_dict,
    "conv": ConvModel.from_dict,
    "thermal": ThermalParams.from_dict,
    "ops": OpModel.from_dict,
}


@dataclass(frozen=True, slots=True)
class DeviceProfile:
    """One device's analytic model; validated on construction so a bad one never runs.

    Bandwidths are bytes/s, latencies one-way seconds (zero latency and infinite
    bandwidth allowed: an ideal link is a legitimate what-if); downlink is
    emulator→device, uplink device→emulator. ``compute`` is a fitted compute model
    (``ComputeModel.to_dict``; empty: the analytic 2·m·n·k/flops), ``conv`` a convolution
    model (``ConvModel.to_dict``; empty: the analytic conv FLOPs/flops, see ``conv_model``)
    and ``thermal`` a thermal model (``ThermalParams.to_dict``, with ``cooling`` applied;
    empty: none); ``ops`` the op model of everything else the board runs when it is a
    coordinator (``OpModel.to_dict``; empty: none, it cannot coordinate).
    """

    name: str
    flops: float
    memory_bytes: int
    dl_bw: float
    ul_bw: float
    dl_lat_s: float
    ul_lat_s: float
    kind: str
    blas: str
    source: str
    cooling: str = "none"
    compute: dict[str, Any] = field(default_factory=dict)
    thermal: dict[str, Any] = field(default_factory=dict)
    conv: dict[str, Any] = field(default_factory=dict)
    ops: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for key in _STR_FIELDS:
            value = getattr(self, key)
            if not isinstance(value, str) or not value:
                raise ValueError(
                    f"profile field {key!r} must be a non-empty string, got {short(value)}"
                )
        if self.kind not in _KINDS:
            raise ValueError(
                f"profile field 'kind' must be one of {_KINDS}, got {short(self.kind)}"
            )
        memory = self.memory_bytes
        if isinstance(memory, bool) or not isinstance(memory, int) or memory <= 0:
            raise ValueError(
                f"profile field 'memory_bytes' must be a positive integer, got {short(memory)}"
            )
        for key in _FLOAT_FIELDS:
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"profile field {key!r} must be a number, got {short(value)}")
            try:
                value = float(value)
            except OverflowError:  # an int past float range, e.g. from a hostile peer
                value = math.inf
            floor_ok = value >= 0 if key in _LATENCY_FIELDS else value > 0
            finite_ok = math.isfinite(value) or (key in _BANDWIDTH_FIELDS and value > 0)
            if not (finite_ok and floor_ok):
                bound = "finite and >= 0" if key in _LATENCY_FIELDS else "> 0"
                bound += "" if key in _LATENCY_FIELDS or key in _BANDWIDTH_FIELDS else " and finite"
                raise ValueError(f"profile field {key!r} must be {bound}, got {short(value)}")
            # TOML and msgpack may carry whole numbers as ints; store one type.
            object.__setattr__(self, key, value)
        if self.cooling not in COOLING:
            choices = tuple(COOLING)
            raise ValueError(
                f"profile field 'cooling' must be one of {choices}, got {short(self.cooling)}"
            )
        for key, parse in _MODEL_FIELDS.items():
            value = getattr(self, key)
            if not isinstance(value, dict):
                raise ValueError(f"profile field {key!r} must be a table, got {short(value)}")
            if value:
                try:
                    parse(value)
                except ValueError as exc:
                    raise ValueError(f"profile field {key!r}: {exc}") from None

    def compute_s(self, m: int, n: int, k: int, batch: int = 1) -> float:
        """Seconds for ``batch`` GEMMs of (m×k)·(k×n) at the sustained rate (2·m·n·k FLOPs
        each): the plain analytic model, for planning before the fitted one applies."""
        if min(m, n, k, batch) < 0:
            raise ValueError(f"GEMM dimensions must be >= 0, got m={m} n={n} k={k} batch={batch}")
        return 2.0 * m * n * k * batch / self.flops

    def conv_model(self) -> ConvModel:
        """The convolution model: the fitted ``conv`` table, else ``conv_flops / flops``
        (fp64 at half the rate). Parsing is not free: build it once per device."""
        if self.conv:
            return ConvModel.from_dict(self.conv)
        return ConvModel.analytic(self.flops)

    def download_s(self, nbytes: int) -> float:
        """Seconds to move ``nbytes`` emulator→device on an otherwise idle link."""
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        return nbytes / self.dl_bw + self.dl_lat_s

    def upload_s(self, nbytes: int) -> float:
        """Seconds to move ``nbytes`` device→emulator on an otherwise idle link."""
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        return nbytes / self.ul_bw + self.ul_lat_s

    def to_wire(self) -> dict[str, Any]:
        """A plain dict (msgpack- and TOML-friendly) with the field names as keys."""
        return {key: getattr(self, key) for key in _FIELD_NAMES}

    @classmethod
    def from_wire(cls, d: object) -> DeviceProfile:
        """Parse a dict from the network; strict, since a peer may send anything."""
        return cls(**check_keys("profile", d, _FIELD_NAMES, _REQUIRED))


_FIELD_NAMES = tuple(f.name for f in dataclasses.fields(DeviceProfile))
_REQUIRED = tuple(
    f.name
    for f in dataclasses.fields(DeviceProfile)
    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
)

GIB = 1 << 30

# Links: every built-in defaults to a wired LAN (all of these boards have a gigabit
# Ethernet port); ``--link`` swaps in another preset.
_LAN = LINKS["lan"]

# CPU boards: REFERENCE.md gives HPL (FP64). HPL is dominated by DGEMM, and NEON holds twice
# as many fp32 lanes as fp64, so fp32 GEMM ≈ 2 × the HPL figure. This is an estimate, not a
# measurement: it ignores that DGEMM usually runs a little faster than HPL as a whole and
# that fp32 may hit the memory wall sooner. `morphling profile` on a board replaces it.
_FP32_PER_FP64_SIMD = 2.0

# GPU boards: REFERENCE.md gives FP32 peak (2 × CUDA cores × clock). Large cuBLAS SGEMM
# typically sustains 70-80 % of peak; we assume 75 %. That fraction is our assumption, not
# a figure measured on a Jetson.
_CUBLAS_SGEMM_FRACTION = 0.75

_PUBLISHED = "derived from published figures: "


def _lan_profile(
    name: str, flops: float, memory_bytes: int, kind: str, blas: str, cite: str,
    models: tuple[dict[str, Any], dict[str, Any]],
) -> DeviceProfile:  # fmt: skip
    """A built-in on the default wired LAN, its provenance spelled out, with its op and
    convolution ``models`` (``board_ops``) and its thermal model (``devices/models/
    thermal.py``, also from REFERENCE.md) when it has one."""
    thermal = thermal_for(name, "none")
    ops, conv = models
    return DeviceProfile(
        name=name,
        flops=flops,
        memory_bytes=memory_bytes,
        dl_bw=_LAN.dl_bw,
        ul_bw=_LAN.ul_bw,
        dl_lat_s=_LAN.dl_lat_s,
        ul_lat_s=_LAN.ul_lat_s,
        kind=kind,
        blas=blas,
        source=f"{_PUBLISHED}{cite}; LAN: {_LAN.source}",
        thermal=thermal.to_dict() if thermal is not None else {},
        conv=conv,
        ops=ops,
    )


BUILTIN: dict[str, DeviceProfile] = {
    # Raspberry Pi 4 B: HPL 11.889 GFLOPS FP64 at 1.8 GHz, 7.2 W, with a source-built OpenBLAS
    # (geerlingguy/top500-benchmark README). fp32 ≈ 2 × 11.9 = 23.8 GFLOP/s. A distribution
    # BLAS gives ~8 GFLOPS FP64 instead (REFERENCE.md): write a TOML profile for that case.
    # Memory: the 4 GB board (1, 2 and 8 GB variants exist). Thermal throttling is not in
    # this number; it belongs to the thermal model.
    "rpi4": _lan_profile(
        "rpi4",
        flops=_FP32_PER_FP64_SIMD * 11.9e9,
        memory_bytes=4 * GIB,
        kind="cpu",
        blas="OpenBLAS",
        cite="Raspberry Pi 4 HPL 11.9 GFLOPS FP64 (geerlingguy/top500-benchmark README), "
        "fp32 GEMM estimated as 2x",
        models=cpu_board("rpi4", _FP32_PER_FP64_SIMD * 11.9e9),
    ),
    # Raspberry Pi 5: HPL 30.249 GFLOPS FP64 at 2.4 GHz, 11 W (geerlingguy/top500-benchmark
    # README). fp32 ≈ 2 × 30.2 = 60.4 GFLOP/s. Memory: the 8 GB board (2, 4, 16 GB exist).
    "rpi5": _lan_profile(
        "rpi5",
        flops=_FP32_PER_FP64_SIMD * 30.2e9,
        memory_bytes=8 * GIB,
        kind="cpu",
        blas="OpenBLAS",
        cite="Raspberry Pi 5 HPL 30.2 GFLOPS FP64 (geerlingguy/top500-benchmark README), "
        "fp32 GEMM estimated as 2x",
        models=cpu_board("rpi5", _FP32_PER_FP64_SIMD * 30.2e9),
    ),
    # Jetson Nano: 128 Maxwell cores at 921 MHz (10 W mode) = 236 GFLOPS FP32 peak (public spec
    # comparisons); × 0.75 ≈ 177 GFLOP/s. Memory: 4 GB LPDDR4 (25.6 GB/s), shared by CPU and
    # GPU, so less is free for tiles than declared here.
    "jetson-nano": _lan_profile(
        "jetson-nano",
        flops=_CUBLAS_SGEMM_FRACTION * 236e9,
        memory_bytes=4 * GIB,
        kind="gpu",
        blas="cuBLAS",
        cite="Jetson Nano GPU 236 GFLOPS FP32 peak (public spec comparisons), "
        "assumed 75% sustained in SGEMM",
        models=gpu_board(
            _CUBLAS_SGEMM_FRACTION * 236e9,
            236e9,
            25.6e9,
            20e-6,
            "Jetson Nano: 236 GFLOPS FP32, LPDDR4 25.6 GB/s; public spec comparisons",
        ),
    ),
    # Jetson Orin Nano 8 GB in its 15 W mode: 1024 cores × 2 × 625 MHz = 1.28 TFLOPS FP32 peak
    # (NVIDIA Orin Nano guides); × 0.75 = 0.96 TFLOP/s. 15 W is the mode every module has;
    # the 25 W "Super" mode is `orin-nano-super`. Memory: 8 GB LPDDR5, shared with the CPU.
    "orin-nano": _lan_profile(
        "orin-nano",
        flops=_CUBLAS_SGEMM_FRACTION * 1024 * 2 * 625e6,
        memory_bytes=8 * GIB,
        kind="gpu",
        blas="cuBLAS",
        cite="Jetson Orin Nano 8 GB, 15 W: 1024 CUDA cores x 2 x 625 MHz = 1.28 TFLOPS FP32 "
        "peak (NVIDIA Orin Nano guides), assumed 75% sustained in SGEMM",
        models=gpu_board(
            _CUBLAS_SGEMM_FRACTION * 1024 * 2 * 625e6,
            1024 * 2 * 625e6,
            68e9,
            10e-6,
            "Jetson Orin Nano 8 GB, 15 W: 1.28 TFLOPS FP32, 68 GB/s; NVIDIA Orin Nano guides",
        ),
    ),
    # Jetson Orin Nano 8 GB in the 25 W "Super" mode: 1024 × 2 × 1.02 GHz = 2.09 TFLOPS FP32
    # peak (NVIDIA Orin Nano guides); × 0.75 ≈ 1.57 TFLOP/s. Same board and memory.
    "orin-nano-super": _lan_profile(
        "orin-nano-super",
        flops=_CUBLAS_SGEMM_FRACTION * 1024 * 2 * 1.02e9,
        memory_bytes=8 * GIB,
        kind="gpu",
        blas="cuBLAS",
        cite="Jetson Orin Nano 8 GB, 25 W Super: 1024 CUDA cores x 2 x 1.02 GHz = 2.09 TFLOPS "
        "FP32 peak (NVIDIA Orin Nano guides), assumed 75% sustained in SGEMM",
        models=gpu_board(
            _CUBLAS_SGEMM_FRACTION * 1024 * 2 * 1.02e9,
            1024 * 2 * 1.02e9,
            102e9,
            10e-6,
            "Jetson Orin Nano 8 GB, 25 W Super: 2.09 TFLOPS FP32, "
            "102 GB/s; NVIDIA Orin Nano guides",
        ),
    ),
    # Jetson AGX Orin: 2048 cores, 5.3 TFLOPS FP32 peak (NVIDIA technical brief); × 0.75 ≈
    # 3.98 TFLOP/s. The 2048-core GPU is the 64 GB module's, so memory is 64 GB (the 32 GB
    # module has a smaller GPU: write a TOML profile for it). The developer kit's port can
    # do 10 GbE; we still assume the gigabit LAN the rest of the fleet shares.
    "agx-orin": _lan_profile(
        "agx-orin",
        flops=_CUBLAS_SGEMM_FRACTION * 5.3e12,
        memory_bytes=64 * GIB,
        kind="gpu",
        blas="cuBLAS",
        cite="Jetson AGX Orin 2048 CUDA cores, 5.3 TFLOPS FP32 peak (NVIDIA technical brief), "
        "assumed 75% sustained in SGEMM",
        models=gpu_board(
            _CUBLAS_SGEMM_FRACTION * 5.3e12,
            5.3e12,
            204.8e9,
            10e-6,
            "Jetson AGX Orin 64 GB: 5.3 TFLOPS FP32, LPDDR5 204.8 GB/s; NVIDIA technical brief",
        ),
    ),
}

DEFAULT_PROFILE = "rpi4"


def with_cooling(profile: DeviceProfile, cooling: str) -> DeviceProfile:
    """``profile`` with another cooling (``COOLING``): its thermal model changes with it."""
    if cooling not in COOLING:
        raise ValueError(f"unknown cooling {cooling!r}; choose from {', '.join(COOLING)}")
    if cooling == profile.cooling:
        return profile
    thermal = profile.thermal
    if thermal:
        thermal = ThermalParams.from_dict(thermal).with_cooling(cooling).to_dict()
    return dataclasses.replace(profile, cooling=cooling, thermal=thermal)


def _load_toml(path: Path) -> DeviceProfile:
    """Read a profile file: its ``[profile]`` table, and the fitted models that
    ``morphling profile`` writes beside it (``[compute]``, ``[conv]``, ``[thermal]``,
    ``[ops]``).

    Other top-level tables (provenance, the trace summary) are for people; inside
    ``[profile]`` every key must be a field.
    """
    try:
        with path.open("rb") as f:
            doc = tomllib.load(f)
    except OSError as exc:
        raise ValueError(f"cannot read profile file {str(path)!r}: {exc.strerror}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"profile file {str(path)!r} is not valid TOML: {exc}") from exc
    table = doc.get("profile")
    if not isinstance(table, dict):
        raise ValueError(f"profile file {str(path)!r} has no [profile] table")
    models = {key: doc[key] for key in _MODEL_FIELDS if key in doc}
    try:
        return DeviceProfile.from_wire({"source": str(path), **table, **models})
    except ValueError as exc:
        raise ValueError(f"profile file {str(path)!r}: {exc}") from exc


# This host as a device, measured on first use (``morphling.devices`` registers it).
HOST = "host"

# Built-in names whose profile file is made on first use by a layer above the models: name ->
# a function that returns the file (measuring first where it must).
_MEASURED: dict[str, Callable[[], Path]] = {}


def register_measured(name: str, profile_file: Callable[[], Path]) -> None:
    """Make ``name`` a built-in whose profile is the TOML file ``profile_file()`` returns,
    called each time the name is loaded. How a profile is measured (the profiler, the real
    kernels) is no business of the models, which the virtual clock imports alone."""
    _MEASURED[name] = profile_file


def load_profile(name_or_path: str) -> DeviceProfile:
    """A built-in by name (``host``: this host, measured once and cached), else a TOML file
    (anything ending ``.toml`` or holding a ``/``)."""
    if name_or_path in BUILTIN:
        return BUILTIN[name_or_path]
    if name_or_path in _MEASURED:
        return _load_toml(_MEASURED[name_or_path]())
    path = Path(name_or_path)
    if path.suffix == ".toml" or "/" in name_or_path:
        return _load_toml(path)
    raise ValueError(
        f"unknown profile {name_or_path!r}; built-ins are "
        f"{', '.join(sorted([*BUILTIN, *_MEASURED]))}, or give a path to a .toml file"
    )


_COUNT = re.compile(r"[+-]?\d+")


def _parse_count(text: str, entry: str) -> int:
    """A device count: a positive decimal integer."""
    if not _COUNT.fullmatch(text):
        raise ValueError(f"fleet entry {entry!r}: count {text!r} is not an integer")
    count = int(text)
    if count <= 0:
        raise ValueError(f"fleet entry {entry!r}: count must be positive, got {count}")
    return count


def parse_fleet_spec(
    spec: str, *, link_name: str | None = None, cooling: str | None = None
) -> list[tuple[DeviceProfile, int]]:
    """Parse ``"rpi4:12,orin-nano:4"``, ``"16"`` (of ``DEFAULT_PROFILE``) or ``"rpi4"`` (one),
    every device on link preset ``link_name`` and with ``cooling`` when given.

    Entries may be TOML profile paths (``lab/pi.toml:3``); the count is after the last ``:``.
    Every error quotes the offending entry, since specs are typed by hand.
    """
    fleet = _parse_entries(spec)
    preset = link(link_name) if link_name is not None else None
    if cooling is not None:
        fleet = [(with_cooling(p, cooling), n) for p, n in fleet]
    if preset is not None:
        fleet = [(preset.apply(p), n) for p, n in fleet]
    return fleet


def _parse_entries(spec: str) -> list[tuple[DeviceProfile, int]]:
    stripped = spec.strip()
    if not stripped:
        raise ValueError("empty fleet spec: give e.g. 'rpi4:12,orin-nano:4' or a count")
    if _COUNT.fullmatch(stripped):
        return [(BUILTIN[DEFAULT_PROFILE], _parse_count(stripped, stripped))]
    fleet = []
    for raw in stripped.split(","):
        entry = raw.strip()
        if not entry:
            raise ValueError(f"fleet spec {spec!r} has an empty entry")
        name, sep, count_text = entry.rpartition(":")
        if not sep:
            name, count_text = entry, "1"
        name = name.strip()
        if not name:
            raise ValueError(f"fleet entry {entry!r} has no profile name")
        count = _parse_count(count_text.strip(), entry)
        try:
            profile = load_profile(name)
        except ValueError as exc:
            raise ValueError(f"fleet entry {entry!r}: {exc}") from exc
        fleet.append((profile, count))
    return fleet


def device_names(profiles: list[DeviceProfile]) -> list[str]:
    """The names a fleet of ``profiles`` gives its devices, in order: ``<profile>-<index>``."""
    return [f"{p.name}-{i}" for i, p in enumerate(profiles)]


def fleet_order(name: str) -> tuple[float, str]:
    """A key that sorts devices as their fleet's SPEC made them (by the index
    ``device_names`` ends a name with), then boards named otherwise, by name."""
    _, _, index = name.rpartition("-")
    return (int(index) if index.isdigit() else math.inf, name)


def expand_fleet(
    spec: str, *, link_name: str | None = None, cooling: str | None = None, max_devices: int = 0
) -> list[DeviceProfile]:
    """One profile per device, in spec order: what a fleet instantiates. A fleet the host
    cannot hold (more than ``max_devices``, or where that is 0 more than its available
    memory) is a ValueError before anything is made (``capacity.check_fleet_size``)."""
    fleet = parse_fleet_spec(spec, link_name=link_name, cooling=cooling)
    check_fleet_size(sum(count for _, count in fleet), max_devices)
    return [profile for profile, count in fleet for _ in range(count)]
