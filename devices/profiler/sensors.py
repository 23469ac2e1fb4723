"""What the host's sensors read: the hottest thermal zone and the CPU's clocks.

Where they are read is a parameter everywhere (``sysfs``), so a test can hand a directory
tree that stands in for ``/sys``. Temperatures there are millidegrees C, clocks kHz.
"""

from __future__ import annotations

from pathlib import Path

SYSFS = Path("/sys")
TEMPERATURES = "class/thermal/thermal_zone*/temp"
CLOCKS = "devices/system/cpu/cpu*/cpufreq/scaling_cur_freq"
MAX_CLOCK = "devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq"
UNKNOWN_CLOCK_MHZ = 1000.0


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
