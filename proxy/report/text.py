"""A run's summary as text: the header, the steps and devices tables, stragglers, the
slowest step's critical path, OOMs (what ``morphling report`` and ``morphling run`` print)."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from morphling.text import elide, elided_line, format_bytes

from .analysis import BY_CLASS, OTHER_STEPS, STRAGGLER_LATENESS
from .load import StepRange, steps_text
from .summary import DeviceRow, StepRow, Summary, VerificationInfo

STEPS_LOG_LACKS = (
    "per-GEMM critical path segments, stragglers and lateness, and the per-tile trace and "
    "timeline plot"
)


def _maybe(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def _percent(x: float | None) -> str:
    return _maybe(None if x is None else 100 * x, ".1f")


TOP_DEVICES = 10
# The columns of the time by op class (``analysis.BY_CLASS``'s), and those of them only a
# run with convolutions or a split coordinator time has.
CLASS_COLUMNS = (
    "fleet GEMM",
    "fleet conv",
    "coord GEMM",
    "coord conv",
    "coord other",
    "unclassified",
)
SPLIT_ONLY = ("fleet_conv_s", "coordinator_gemm_s", "coordinator_conv_s", "coordinator_other_s")


def format_summary(summary: Summary) -> str:
    """The summary as text: steps, busiest devices, stragglers, the slowest step's critical
    path, OOMs."""
    run, totals = summary["run"], summary["totals"]
    auto = " (or its half or quarter: --auto-block)" if run["auto_block"] else ""
    out = [
        f"run {run['path']}: policy {run['policy']}, block {run['block']}{auto}, coordinator "
        f"time {run['coordinator_time']}, {totals['devices']} devices, "
        f"{totals['span_s']:.4f} s emulated in all",
    ]
    if run["event_log"] == "steps":
        out.append(
            f"event log: steps (each step's and each device's totals), so this report has no "
            f"{STEPS_LOG_LACKS}: run with --events auto or full for them"
        )
    else:
        out += _detail_text(summary)
    if run["incomplete"] is not None:
        why = run["incomplete"]
        out.append(f"incomplete: the run ended early ({why}); this is what it logged until then")
    if run["verification"] is not None:
        out += _verification_text(run["verification"])
    b = run["bottleneck"]
    if b is not None:
        parameters = ", ".join(f"{k} {v:.4g}" for k, v in b["parameters"].items())
        out.append(
            f"shared bottleneck ({parameters}): downlink {_percent(b['downlink_utilisation'])}%, "
            f"uplink {_percent(b['uplink_utilisation'])}% busy"
        )
    out += ["", *_steps_table(summary), *_classes_table(summary)]
    out += ["", *_devices_table(summary), *_device_time_table(summary), ""]
    out += _stragglers_text(summary)
    steps = [s for j in summary["jobs"] for s in j["steps"]]
    if steps:
        out += ["", *_critical_text(max(steps, key=lambda s: s["emulated_s"]))]
    out += ["", *_untimed_text(summary)]
    ooms = summary["ooms"]
    out += ["", f"OOM events: {ooms['count']}"]
    out += [
        f"  job {o['job']} step {o['step']} gemm {o['gemm']} tile {o['tile']} on "
        f"{o['device_name']} at {o['t']:.4f} s: needs {format_bytes(o['need_bytes'])} of "
        f"{format_bytes(o['capacity_bytes'])}"
        for o in ooms["events"][:TOP_DEVICES]
    ]
    if ooms["count"] > TOP_DEVICES:
        out.append(f"  ... and {ooms['count'] - TOP_DEVICES} more (summary.json lists all)")
    out += _collectives_table(summary)
    return "\n".join(out)


def _tail(text: str, width: int) -> str:
    """``text``, or its end when it is wider (a job's name ends with its script and rank)."""
    return text if len(text) <= width else "…" + text[-(width - 1) :]


def _collectives_table(summary: Summary) -> list[str]:
    """The ranks' collectives over the steps shown, by rank and kind (none: nothing)."""
    collectives = summary["collectives"]
    if not collectives["rows"]:
        return []
    shown = summary["run"]["detail"]["window"]
    head = (f"{'job':>4} {'name':<24} {'op':<14} {'count':>6} {'bytes':>10} {'network s':>10} "
            f"{'waited s':>9}")  # fmt: skip
    out = ["", f"collectives ({collectives['algorithm'] or 'algorithm not recorded'}; steps "
           f"{shown}):", head, "-" * len(head)]  # fmt: skip
    out += [
        f"{r['job']:>4} {_tail(r['name'], 24):<24} {r['op']:<14} {r['count']:>6} "
        f"{format_bytes(r['bytes']):>10} {r['network_s']:>10.4f} {r['waited_s']:>9.4f}"
        for r in collectives["rows"]
    ]
    return out


def _steps_table(summary: Summary) -> list[str]:
    head = (
        f"{'job':>4} {'step':>5} {'emulated s':>11} {'coord s':>9} {'GEMM s':>9} "
        f"{'GEMMs':>6} {'local':>6} {'tiles':>7} {'down':>10} {'up':>10} {'OOM':>4}"
    )
    rows = [head, "-" * len(head), *_each_step(summary, _step_row)]
    t = summary["totals"]
    rows.append(
        f"{'all':>10} {t['emulated_s']:>11.4f} {t['coordinator_s']:>9.4f} {t['gemm_s']:>9.4f} "
        f"{t['gemms']:>6} {t['local_gemms']:>6} {t['tiles']:>7} "
        f"{format_bytes(t['bytes_down']):>10} {format_bytes(t['bytes_up']):>10} {t['oom']:>4}"
    )
    return rows


def _each_step(summary: Summary, row: Callable[[StepRow], str]) -> list[str]:
    """A table's row per step, each job's elided (``elide``)."""
    rows = []
    for job in summary["jobs"]:
        first, left_out, last = elide(job["steps"])
        rows += [row(s) for s in first]
        if left_out:
            rows.append(elided_line(left_out, "summary.json or --json has every step"))
            rows += [row(s) for s in last]
    return rows


def _classes_table(summary: Summary) -> list[str]:
    """Each step's time by op class: the fleet's products (GEMMs, convolutions), the
    coordinator's by the classes its job gave, and what it did not split. Left out when
    that says no more than the table above (GEMMs only, the coordinator's time unsplit)."""
    totals: Mapping[str, object] = summary["totals"]["by_class"]
    if not any(totals[key] for key in SPLIT_ONLY):
        return []
    head = f"{'job':>4} {'step':>5} " + " ".join(f"{name:>12}" for name in CLASS_COLUMNS)
    rows = ["", "time by op class (s):", head, "-" * len(head)]
    rows += _each_step(
        summary,
        lambda s: _class_row(f"{s['job']:>4} {s['step']:>5}", s["critical_path"]["by_class"]),
    )
    rows.append(_class_row(f"{'all':>10}", totals))
    return rows


def _class_row(label: str, by_class: Mapping[str, object]) -> str:
    return f"{label} " + " ".join(f"{by_class[key]:>12.4f}" for key in BY_CLASS)


def _step_row(s: StepRow) -> str:
    mark = "" if s["complete"] else "  (incomplete)"
    return (
        f"{s['job']:>4} {s['step']:>5} {s['emulated_s']:>11.4f} "
        f"{s['coordinator_s']:>9.4f} {s['gemm_s']:>9.4f} {s['gemms']:>6} "
        f"{s['local_gemms']:>6} {s['tiles']:>7} {format_bytes(s['bytes_down']):>10} "
        f"{format_bytes(s['bytes_up']):>10} {s['oom']:>4}{mark}"
    )


def _devices_table(summary: Summary) -> list[str]:
    devices = sorted(summary["devices"], key=lambda d: (-d["utilisation"], d["id"]))
    shown = devices[:TOP_DEVICES]
    every = summary["run"]["detail"]["every_step_logged"]
    rows = [
        f"devices by compute utilisation ({len(shown)} of {len(devices)}; mean "
        f"{_percent(summary['totals']['mean_utilisation'])}%):",
        f"{'id':>5} {'name':<16} {'profile':<12} {'tiles':>7} {'compute%':>9} {'down%':>6} "
        f"{'up%':>6} {'°C end':>7} {'MHz top':>8} {'below s':>8} {'lateness':>9} {'last in':>9}",
    ]
    for d in shown:
        rows.append(
            f"{d['id']:>5} {d['name']:<16} {d['profile']:<12} {d['tiles']:>7} "
            f"{_percent(d['utilisation']):>9} {_percent(d['downlink_utilisation']):>6} "
            f"{_percent(d['uplink_utilisation']):>6} {_maybe(d['final_temp_c'], '.1f'):>7} "
            f"{_maybe(d['top_freq_mhz'], '.0f'):>8} {_maybe(d['below_top_s'], '.3f'):>8} "
            f"{_maybe(d['lateness'], '+.3f'):>9} {_last_in(d, every):>9}"
        )
    return rows


def _device_time_table(summary: Summary) -> list[str]:
    """The devices of the table above: their time over the run by what they did."""
    devices = sorted(summary["devices"], key=lambda d: (-d["utilisation"], d["id"]))
    rows = [
        "their time over the run (s; links overlap compute when a tile downloads while "
        "another computes, so waiting is at least what is shown), the bytes their links "
        "carried down and those they held already (saved):",
        f"{'id':>5} {'name':<16} {'GEMM':>10} {'conv':>10} {'links':>10} {'waiting':>10} "
        f"{'down':>10} {'saved':>10}",
    ]
    for d in devices[:TOP_DEVICES]:
        t = d["time"]
        rows.append(
            f"{d['id']:>5} {d['name']:<16} {t['gemm_s']:>10.4f} {t['conv_s']:>10.4f} "
            f"{t['link_s']:>10.4f} {t['waiting_s']:>10.4f} {format_bytes(d['bytes_down']):>10} "
            f"{format_bytes(d['bytes_saved']):>10}"
        )
    return rows


def _untimed_text(summary: Summary) -> list[str]:
    """What has no op class, and why; the products the script kept on the host."""
    u = summary["untimed"]
    if u["reason"] is None:
        rows = ["untimed work: none (every coordinator second has an op class)"]
    else:
        rows = [
            f"untimed work: {u['coordinator_unclassified_s']:.4f} s of coordinator time in "
            f"{u['steps']} step{'' if u['steps'] == 1 else 's'} is unclassified ({u['reason']})"
        ]
    if u["local_gemms"]:
        rows.append(f"  {u['local_gemms']} GEMMs kept on the host: {u['local_note']}")
    return rows


def _last_in(device: DeviceRow, every: bool) -> str:
    """Critical tiles of GEMMs taken part in; their count alone where the log lacks the
    tiles of some steps (``every`` False), which the GEMMs taken part in need."""
    if not every:
        return str(device["last_in"])
    return f"{device['last_in']}/{device['gemms']}"


def _detail_text(summary: Summary) -> list[str]:
    """Which steps the trace, timeline.png and the critical-path segments show, when that
    is not every step, and how to see others."""
    detail, steps = summary["run"]["detail"], summary["totals"]["steps"]
    shown = sum(s["steps"] for s in detail["shown"])
    if shown == steps:
        return []
    shown_text = [
        f"job {s['job']} step {s['first']}"
        if s["first"] == s["last"]
        else f"job {s['job']} steps {s['first']}-{s['last']}"
        for s in detail["shown"]
    ]
    which = "; ".join(shown_text) or "no step"
    assert detail["logged"] is not None  # a log with tiles (not a steps log) says which
    logged = StepRange.parse(detail["logged"])
    return [
        f"detail: trace.json, timeline.png and the critical-path segments show {which} of "
        f"{steps} steps (--detail-steps {detail['window']}); the log has every tile of "
        f"{steps_text(logged)}"
        + ("" if logged == StepRange() else " of each job, and each step's totals after them"),
        f"  {OTHER_STEPS.replace('RUN_DIR', summary['run']['path'])}",
    ]


def _stragglers_text(summary: Summary) -> list[str]:
    stragglers = summary["stragglers"]["devices"]
    head = f"stragglers (lateness >= {STRAGGLER_LATENESS} of a GEMM's duration):"
    if stragglers is None:
        return [f"{head} not known from a steps log"]
    if not summary["run"]["detail"]["every_step_logged"]:
        head = head[:-2] + ", over the steps whose tiles the log has):"
    if not stragglers:
        return [f"{head} none"]
    return [head] + [
        f"  {s['name']}: {s['lateness']:+.3f}, last in {s['last_in']} of its {s['gemms']} "
        f"GEMMs ({s['expected_last']:.1f} expected by chance)"
        for s in stragglers
    ]


def _share_row(key: str, seconds: float, total: float, indent: int = 2) -> str:
    """A part of a step's time, in seconds and as a share of ``total``."""
    share = f"{100 * seconds / total:6.1f}%" if total > 0 else ""
    name = key.removesuffix("_s").replace("_", " ")
    return f"{' ' * indent}{name:<{30 - indent}} {seconds:>10.4f} s {share}"


def _critical_text(step: StepRow) -> list[str]:
    total = step["emulated_s"]
    path = step["critical_path"]
    rows = [
        f"critical path of the slowest step (job {step['job']} step {step['step']}, {total:.4f} s):"
    ]
    for key, seconds in path["breakdown"].items():
        rows.append(_share_row(key, seconds, total))
    rows.append("  by op class:")
    rows += [_share_row(key, path["by_class"][key], total, 4) for key in BY_CLASS]
    ops_by = path["ops"]
    for where, ops in (("fleet", ops_by["fleet"]), ("coordinator", ops_by["coordinator"])):
        if ops:
            parts = ", ".join(f"{op} {seconds:.4f}" for op, seconds in ops.items())
            rows.append(f"    {where} ops (s): {parts}")
    devices = ", ".join(f"{name} ({n})" for name, n in list(path["devices"].items())[:TOP_DEVICES])
    rows.append(f"  last tile on: {devices or 'no GEMM'}")
    return rows


def _verification_text(v: VerificationInfo) -> list[str]:
    """What was checked, what a sample left unchecked, and each quarantine's evidence."""
    line = (
        f"verification (--verify {v['mode']}): {v['checked']} tiles checked "
        f"({v['screened_out']} recomputed in float64), {v['wrong']} wrong"
    )
    if v["sampled_out"]:
        line += f", {v['sampled_out']} left unchecked by the sample"
    if v["check_errors"]:
        line += f", {v['check_errors']} taken unchecked: their check failed (see the log)"
    out = [line]
    for q in v["quarantines"]:
        out.append(
            f"  quarantined: device {q['device']} ({q['name']}), tile {q['tile']} of request "
            f"{q.get('request', '?')}: {q['evidence']}"
        )
    return out
