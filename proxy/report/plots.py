"""PNG plots of a run: timeline, utilisation, devices' time by class, thermal state, step
times by class.

matplotlib is imported inside the functions (``morphling --help`` must not pay for it) and
drawn through its Agg canvas on a bare ``Figure``, never through pyplot: no GUI backend,
no global figure state, safe to call from anywhere.

A large fleet is summarised (``at_scale``): past ``MAX_TIMELINE_DEVICES`` the timeline
shows the busiest devices' rows under a heat map of the whole fleet's compute occupancy,
and past ``MAX_DEVICE_BARS`` the utilisation and device-time plots show groups of devices
ranked busiest first instead of a bar per device.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from .at_scale import group_means, occupancy, rank_groups
from .load import Run
from .summary import DeviceRow, StepRow, Summary

if TYPE_CHECKING:
    from matplotlib.figure import Figure

PLOT_FILES = {
    "timeline": "timeline.png",
    "utilisation": "utilisation.png",
    "device_time": "device_time.png",
    "thermal": "thermal.png",
    "steps": "steps.png",
}

# More rows than this make a timeline unreadable; the rest are named in the title.
MAX_TIMELINE_DEVICES = 32
MAX_THERMAL_DEVICES = 16
MAX_LEGEND_DEVICES = 10
MAX_NAMED_TICKS = 40
MAX_STEP_LINES = 50
MAX_STEP_BARS = 500
MAX_DEVICE_BARS = 200  # devices (or, past it, groups of ranked devices) as bars
HEAT_ROWS = 64  # groups of ranked devices in the timeline's heat map
HEAT_BINS = 240  # and its bins of virtual time
DPI = 120
COLOURS = {"compute": "tab:blue", "downlink": "tab:green", "uplink": "tab:orange"}
# A device's time by what it did (``DeviceTime``), stacked in this order.
DEVICE_TIME = {
    "gemm_s": ("GEMM", "tab:blue"),
    "conv_s": ("convolution", "tab:purple"),
    "link_s": ("links (down + up)", "tab:green"),
    "waiting_s": ("waiting", "lightgray"),
}
# A step's time by op class (``ByClass``, then what neither covers), stacked in this order.
STEP_CLASSES = {
    "fleet_gemm_s": ("GEMMs on the fleet", "tab:blue"),
    "fleet_conv_s": ("convolutions on the fleet", "tab:purple"),
    "coordinator_gemm_s": ("host: GEMMs", "tab:cyan"),
    "coordinator_conv_s": ("host: convolutions", "tab:pink"),
    "coordinator_other_s": ("host: other ops", "tab:olive"),
    "coordinator_unclassified_s": ("host: unclassified", "tab:gray"),
    "unattributed_s": ("neither (unlogged)", "tab:red"),
}
# Where each stage's bars lie in a device's row of the timeline: (offset, height).
BAR_ROWS = {"downlink": (-0.45, 0.12), "compute": (-0.25, 0.5), "uplink": (0.33, 0.12)}


def _figure(width: float, height: float) -> Figure:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _busiest(devices: list[DeviceRow], limit: int) -> tuple[list[DeviceRow], str]:
    """The ``limit`` busiest devices, and a note for the title when some are left out."""
    devices = sorted(devices, key=lambda d: (-d["busy_s"], d["id"]))
    if len(devices) <= limit:
        return devices, ""
    return devices[:limit], f" (busiest {limit} of {len(devices)} devices shown)"


def _steps(summary: Summary) -> list[StepRow]:
    return [s for job in summary["jobs"] for s in job["steps"]]


def plot_timeline(run: Run, summary: Summary, path: Path) -> Path | None:
    """One row per device over the steps shown tile by tile (``Run.shows``): compute bars,
    thin downlink bars above, uplink bars below; None (and no file) when there are none,
    as from a ``steps`` log."""
    from matplotlib.patches import Patch

    steps = [s for s in run.steps if run.shows(s.step)]
    if not run.tiles or not steps:
        return None
    shown, note = _busiest(summary["devices"], MAX_TIMELINE_DEVICES)
    start, end = min(s.t0 for s in steps), max(s.t1 for s in steps)
    end = end if end > start else start + 1.0
    row = {d["id"]: i for i, d in enumerate(shown)}
    bars: dict[int, dict[str, list[tuple[float, float]]]] = {
        d: {kind: [] for kind in COLOURS} for d in row
    }
    for t in run.tiles:
        for device in (d for d in run.devices_of(t) if d in row):
            for kind, (t0, t1) in (("downlink", t.down), ("compute", t.compute), ("uplink", t.up)):
                bars[device][kind].append((t0, t1 - t0))
    rows_high = 0.35 * len(shown)
    if note:  # a fleet too large for a row each: its heat map above the busiest rows
        fig = _figure(11, 4.6 + rows_high)
        heat_ax, ax = fig.subplots(2, 1, sharex=True, height_ratios=[3.0, rows_high])
        _heat_map(fig, heat_ax, run, summary, start, end)
    else:
        fig = _figure(11, 1.6 + rows_high)
        ax = fig.subplots()
    # No antialiasing: back-to-back tiles would show hairline seams between them.
    for device, y in row.items():  # y grows downwards (inverted axis): downlink on top
        for kind, (offset, height) in BAR_ROWS.items():
            span = (y + offset, height)
            ax.broken_barh(
                bars[device][kind], span, color=COLOURS[kind], linewidth=0, antialiased=False
            )
    if len(steps) <= MAX_STEP_LINES:
        for s in steps:
            ax.axvline(s.t1, color="black", linewidth=0.8, linestyle=":", zorder=3)
    ax.set_yticks(range(len(shown)), [d["name"] for d in shown])
    ax.set_ylim(len(shown) - 0.5, -0.5)
    ax.set_xlim(start, end)
    ax.set_xlabel("virtual time (s)")
    which = (
        "every step" if len(steps) == len(run.steps) else f"{len(steps)} of {len(run.steps)} steps"
    )
    ax.set_title(f"Per-device timeline of {which}{note}; dotted lines end steps")
    ax.legend(
        handles=[Patch(color=c, label=kind) for kind, c in COLOURS.items()],
        loc="upper left",
        bbox_to_anchor=(1.0, 1.0),
        fontsize="small",
    )
    fig.savefig(path)
    return path


def _heat_map(fig: Figure, ax: Any, run: Run, summary: Summary, start: float, end: float) -> None:
    """Every device's compute occupancy over [start, end): devices ranked busiest first,
    in ``HEAT_ROWS`` groups, in ``HEAT_BINS`` bins of time (``at_scale.occupancy``)."""
    import numpy as np

    ranked = sorted(summary["devices"], key=lambda d: (-d["busy_s"], d["id"]))
    starts = rank_groups(len(ranked), HEAT_ROWS)
    sizes = np.diff(np.append(starts, len(ranked)))
    groups = np.repeat(np.arange(len(starts)), sizes)
    group_of = {d["id"]: int(g) for d, g in zip(ranked, groups, strict=True)}
    # each device with tiles' occupancy, then each group's: its devices' and mirrors' sum
    source = {d: i for i, d in enumerate(dict.fromkeys(t.device for t in run.tiles))}
    spans = np.array([t.compute for t in run.tiles], dtype=np.float64).reshape(-1, 2)
    rows = np.array([source[t.device] for t in run.tiles], dtype=np.int64)
    each = occupancy(spans, rows, len(source), start, end, HEAT_BINS)
    members = np.zeros((len(starts), len(source)))
    for device, i in source.items():
        for d in (device, *run.mirrors.get(device, ())):
            if d in group_of:
                members[group_of[d], i] += 1
    seconds = members @ each
    share = 100 * seconds / (sizes[:, None] * (end - start) / HEAT_BINS)
    image = ax.imshow(share, aspect="auto", interpolation="nearest", cmap="viridis", vmin=0,
                      vmax=100, extent=(start, end, len(starts), 0))  # fmt: skip
    fig.colorbar(image, ax=ax, label="compute busy (%)")
    ticks = range(0, len(starts), max(1, len(starts) // 8))
    ax.set_yticks([t + 0.5 for t in ticks], [f"#{starts[t] + 1}" for t in ticks])
    ax.set_ylabel("devices by rank")
    ax.set_title(f"Compute occupancy of all {len(ranked)} devices, busiest first "
                 f"({len(starts)} rows of ~{len(ranked) // len(starts)} devices)")  # fmt: skip


def plot_utilisation(summary: Summary, path: Path) -> Path:
    """Compute, downlink and uplink utilisation per device, busiest compute first (past
    ``MAX_DEVICE_BARS`` devices, the means of groups of ranked devices, as lines)."""
    import numpy as np

    devices = sorted(summary["devices"], key=lambda d: (-d["utilisation"], d["id"]))
    fig = _figure(max(6.0, min(16.0, 0.3 * len(devices) + 3)), 4.5)
    ax = fig.subplots()
    shares = (
        [d["utilisation"] for d in devices],
        [d["downlink_utilisation"] for d in devices],
        [d["uplink_utilisation"] for d in devices],
    )
    kinds = ("compute", "downlink", "uplink")
    if len(devices) > MAX_DEVICE_BARS:
        starts = rank_groups(len(devices), MAX_DEVICE_BARS)
        x = 100 * np.append(starts, len(devices)) / len(devices)
        for kind, share in zip(kinds, shares, strict=True):
            means = 100 * group_means(share, starts)
            ax.stairs(means, x, color=COLOURS[kind], label=kind, linewidth=1.5)
        ax.set_xlim(0, 100)
        ax.set_xlabel(f"devices ranked by compute utilisation (% of {len(devices)}; means of "
                      f"{len(starts)} groups)")  # fmt: skip
    else:
        x = np.arange(len(devices), dtype=np.float64)
        width = 0.27
        for i, (kind, share) in enumerate(zip(kinds, shares, strict=True)):
            values = [100 * v for v in share]
            ax.bar(x + (i - 1) * width, values, width, color=COLOURS[kind], label=kind)
        _device_axis(ax, x, devices)
    ax.set_ylabel("utilisation (% of the run)")
    ax.set_ylim(0, 100)
    ax.set_title(
        f"Device utilisation over {summary['totals']['span_s']:.3g} s of virtual time "
        f"(mean compute {100 * summary['totals']['mean_utilisation']:.1f}%)"
    )
    ax.legend(fontsize="small")
    fig.savefig(path)
    return path


def _device_axis(ax: Any, x: Any, devices: list[DeviceRow]) -> None:
    """Devices along the x axis, busiest first: named while few, ranked when many."""
    if len(devices) <= MAX_NAMED_TICKS:
        ax.set_xticks(x, [d["name"] for d in devices], rotation=90, fontsize="small")
        ax.set_xlabel("device")
    else:
        ax.set_xlabel("devices, by compute utilisation (rank)")


def plot_device_time(summary: Summary, path: Path) -> Path:
    """Each device's time over the run, stacked: GEMMs, convolutions, links, waiting (in
    % of the run span; links overlapping compute can take a bar past 100), busiest first
    (past ``MAX_DEVICE_BARS`` devices, the means of groups of ranked devices)."""
    import numpy as np

    devices = sorted(summary["devices"], key=lambda d: (-d["utilisation"], d["id"]))
    span = summary["totals"]["span_s"] or 1.0
    fig = _figure(max(6.0, min(16.0, 0.3 * len(devices) + 3)), 4.5)
    ax = fig.subplots()
    many = len(devices) > MAX_DEVICE_BARS
    starts = rank_groups(len(devices), MAX_DEVICE_BARS)
    x = 100 * starts / len(devices) if many else np.arange(len(devices))
    width = 100 / len(devices) * np.diff(np.append(starts, len(devices))) if many else 0.8
    bottom = np.zeros(len(x))
    for key, (label, colour) in DEVICE_TIME.items():
        values = np.array([100 * d["time"][key] / span for d in devices])  # type: ignore[literal-required]
        if many:
            values = group_means(values, starts)
        ax.bar(x, values, width, bottom=bottom, color=colour, label=label,
               align="edge" if many else "center")  # fmt: skip
        bottom += values
    if many:
        ax.set_xlim(0, 100)
        ax.set_xlabel(f"devices ranked by compute utilisation (% of {len(devices)}; means of "
                      f"{len(starts)} groups)")  # fmt: skip
    else:
        _device_axis(ax, x, devices)
    ax.set_ylabel("% of the run")
    ax.set_title(f"Where each device's {span:.3g} s of virtual time went")
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.savefig(path)
    return path


def plot_thermal(run: Run, summary: Summary, path: Path) -> Path | None:
    """Temperature and frequency over time of the devices with a thermal model; None (and
    no file) when no device has one."""
    samples = run.thermal
    if not samples:
        return None
    modelled = [d for d in summary["devices"] if d["id"] in samples]
    shown, note = _busiest(modelled, MAX_THERMAL_DEVICES)
    fig = _figure(11, 6)
    temp_ax, freq_ax = fig.subplots(2, 1, sharex=True)
    for d in shown:
        for ax, index in ((temp_ax, 2), (freq_ax, 1)):
            held = [(p[0], p[index]) for p in samples[d["id"]] if p[index] is not None]
            if held:  # each value holds until the next, the last one to the run's end
                ts, values = zip(*held, strict=True)
                ax.step([*ts, run.span_s], [*values, values[-1]], where="post", label=d["name"])
    temp_ax.set_ylabel("temperature (°C)")
    freq_ax.set_ylabel("frequency (MHz)")
    freq_ax.set_xlabel("virtual time (s)")
    freq_ax.set_xlim(0, run.span_s or 1.0)
    temp_ax.set_title(f"Thermal state of the devices with a thermal model{note}")
    if len(shown) <= MAX_LEGEND_DEVICES:
        temp_ax.legend(fontsize="small")
    fig.savefig(path)
    return path


def plot_steps(summary: Summary, path: Path) -> Path:
    """Emulated time per step, stacked by op class (``STEP_CLASSES``: the fleet's products,
    the host's time by class, and any time neither covers), the classes the run has.
    Bars up to ``MAX_STEP_BARS`` steps, stacked areas beyond (as many bars take minutes)."""
    steps = _steps(summary)
    jobs = len(summary["jobs"])
    labels = [str(s["step"]) if jobs == 1 else f"{s['job']}:{s['step']}" for s in steps]
    fig = _figure(max(6.0, min(16.0, 0.25 * len(steps) + 3)), 4.5)
    ax = fig.subplots()
    # one job: its step numbers; several: the steps in order, labelled job:step when few
    x = [s["step"] for s in steps] if jobs == 1 else list(range(len(steps)))
    # Rounding leaves ~1e-16 s; only a class with real time is worth a legend entry.
    longest = max((s["emulated_s"] for s in steps), default=0.0)
    parts = []
    for key, (label, colour) in STEP_CLASSES.items():
        values = [s["critical_path"]["by_class"][key] for s in steps]
        if any(v > 1e-9 * longest for v in values):
            parts.append((values, colour, label))
    if len(steps) <= MAX_STEP_BARS:
        bottom = [0.0] * len(steps)
        for values, colour, label in parts:
            ax.bar(x, values, bottom=bottom, color=colour, label=label)
            bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    else:
        colours, labels = [c for _, c, _ in parts], [label for _, _, label in parts]
        areas = (values for values, _, _ in parts)
        ax.stackplot(x, *areas, colors=colours, labels=labels, step="mid")
    if len(steps) <= MAX_NAMED_TICKS:
        ax.set_xticks(x, labels)
    ax.set_xlabel("step" if jobs == 1 else "job:step")
    ax.set_ylabel("emulated time (s)")
    ax.set_title("Emulated time per training step")
    ax.legend(fontsize="small")
    fig.savefig(path)
    return path


def write_plots(run: Run, summary: Summary, out_dir: Path) -> list[Path]:
    """Every plot that applies to this run, as PNGs in ``out_dir``; their paths."""
    paths = [
        plot_timeline(run, summary, out_dir / PLOT_FILES["timeline"]),
        plot_utilisation(summary, out_dir / PLOT_FILES["utilisation"]),
        plot_device_time(summary, out_dir / PLOT_FILES["device_time"]),
        plot_thermal(run, summary, out_dir / PLOT_FILES["thermal"]),
        plot_steps(summary, out_dir / PLOT_FILES["steps"]),
    ]
    return [p for p in paths if p is not None]
