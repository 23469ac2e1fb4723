"""``morphling sweep``: real ``morphling run`` children on a tiny script, and the table.

The end-to-end tests start ``morphling run --embedded --link ... --cooling ... --run-dir``
children exactly as a user's sweep would; the comparison figures are checked against
the run directories they leave. The table's arithmetic is checked on the hand-computed
run of ``hand_run``.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
from hand_run import run_events, write_run
from morphling.proxy.report.analysis import summarize
from morphling.proxy.report.load import load_run

from morphling.cli import command_parser, run_command
from morphling.commands import sweep as sweep_cli
from morphling.commands.sweep import (
    Combination,
    comparison_row,
    format_comparison,
    mean_step_s,
    with_speedups,
)

# GEMMs of 2·32·64·64 FLOPs: above morphling run's local threshold (2·32³), so on the fleet.
TRAIN = """\
import torch

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
x, y = torch.randn(32, 64), torch.randn(32, 64)
for _ in range(3):
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
print("done", loss.item())
"""


def sweep(*argv: str | Path) -> int:
    """``morphling sweep ARGV`` in this process, through the subcommand's own parser."""
    parser, sub = command_parser("morphling", "test")
    sweep_cli.add_parser(sub)
    return run_command(parser, ["--log-level", "warning", "sweep", "--no-progress",
                                *map(str, argv)])  # fmt: skip


@pytest.fixture
def train(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The tiny script; MORPHLING_* settings cleared, as they would override the sweep's flags."""
    for name in os.environ:
        if name.startswith("MORPHLING_"):
            monkeypatch.delenv(name)
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    return script


# -- end to end ------------------------------------------------------------------------------


def test_sweep_end_to_end(train: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    fleets = ["rpi4:2", "orin-nano:1,rpi4:1"]
    code = sweep(*(f for spec in fleets for f in ("--fleet", spec)), "--link", "lan",
                 "--cooling", "none", "--out", out, "--", "python", train)  # fmt: skip
    stdout, stderr = capsys.readouterr()
    assert code == 0, stderr
    combos = [Combination(spec, "lan", "none") for spec in fleets]
    assert [c.label for c in combos] == ["rpi4-2_lan_none", "orin-nano-1-rpi4-1_lan_none"]
    summaries = [summarize(load_run(out / c.label)) for c in combos]
    for c, s in zip(combos, summaries, strict=True):
        assert [len(j["steps"]) for j in s["jobs"]] == [3]
        assert s["totals"]["tiles"] > 0 and s["totals"]["devices"] == 2
        assert "done" in (out / f"{c.label}.log").read_text()  # the script's output
    rows = with_speedups([comparison_row(c, s, 1) for c, s in zip(combos, summaries, strict=True)])
    assert stdout.strip() == format_comparison(rows)
    # steps 2 and 3 (the first is warm-up); the baseline's speed-up is 1
    for row, s in zip(rows, summaries, strict=True):
        steps = s["jobs"][0]["steps"]
        assert row["mean_step_s"] == (steps[1]["emulated_s"] + steps[2]["emulated_s"]) / 2
    assert rows[0]["speedup"] == 1.0
    assert rows[1]["speedup"] == rows[0]["mean_step_s"] / rows[1]["mean_step_s"]


def test_events_level_reaches_every_run(
    train: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--events steps``: each run keeps per-step totals only, which the table needs."""
    out = tmp_path / "out"
    code = sweep("--fleet", "rpi4:2", "--events", "steps", "--json", "--out", out,
                 "--", "python", train)  # fmt: skip
    stdout, stderr = capsys.readouterr()
    assert code == 0, stderr
    (row,) = json.loads(stdout)["runs"]
    run_dir = out / "rpi4-2_default_default"
    assert json.loads((run_dir / "run.json").read_text())["event_log"] == "steps"
    assert row["steps"] == 3 and row["mean_step_s"] > 0 and row["bytes_moved"] > 0


def test_auto_block_reaches_every_run(
    train: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    code = sweep("--fleet", "rpi4:2", "--auto-block", "--out", out, "--", "python", train)
    assert code == 0, capsys.readouterr().err
    run_dir = out / "rpi4-2_default_default"
    assert json.loads((run_dir / "run.json").read_text())["auto_block"] is True


def test_unknown_link_preset_is_reported(
    train: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = sweep("--fleet", "rpi4:2", "--link", "carrier-pigeon", "--link", "lan",
                 "--out", tmp_path / "out", "--", "python", train)  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2
    assert "run rpi4-2_carrier-pigeon_default failed: exit 2" in err
    assert "carrier-pigeon" in err.split("failed:", 1)[1]  # morphling run's own message
    assert "remaining runs are skipped" in err
    assert not (tmp_path / "out" / "rpi4-2_lan_default.log").exists()


# -- arguments -------------------------------------------------------------------------------


def test_no_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert sweep("--fleet", "rpi4:2") == 2
    assert capsys.readouterr().err.startswith("morphling sweep: no training command")
    assert sweep("--fleet", "rpi4:2", "--") == 2


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--fleet", "rpi4:zero"], "count 'zero' is not an integer"),
        (["--fleet", "rpi4:2", "--fleet", "rpi4:2"], "given twice"),
        (["--fleet", "rpi4:2", "--steps-from", "-1"], "--steps-from must be >= 0"),
    ],
)
def test_bad_arguments(
    train: Path, argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert sweep(*argv, "--", "python", train) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv",
    [
        ["--cooling", "ice", "--fleet", "rpi4"],
        ["--link", "lan"],
        ["--fleet"],
        ["--fleet", "rpi4", "--events", "off"],  # the comparison needs a log
    ],
)
def test_argparse_errors(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        sweep(*argv, "--", "python", "train.py")
    assert exc.value.code == 2
    assert "morphling sweep: error:" in capsys.readouterr().err


def test_existing_run_directory_is_not_reused(
    train: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "out" / "rpi4-2_default_fan").mkdir(parents=True)
    assert sweep("--fleet", "rpi4:2", "--cooling", "fan", "--out", tmp_path / "out", "--",
                 "python", train) == 2  # fmt: skip
    assert "already holds rpi4-2_default_fan" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("out", "problem"),
    [
        ("/proc", "cannot write in it: No such file or directory"),  # root may, says access()
        ("/proc/x", "cannot create it: No such file or directory"),
    ],
)
def test_unwritable_out_is_refused_before_any_run(
    train: Path, out: str, problem: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """--out is written to before the first run starts: one line, exit 2 (a traceback when
    the first run's log was opened, before)."""
    assert sweep("--fleet", "rpi4:2", "--out", out, "--", "python", train) == 2
    assert capsys.readouterr().err == f"morphling sweep: --out {out}: {problem}\n"


# -- the table -------------------------------------------------------------------------------


@pytest.fixture
def summary(tmp_path: Path) -> dict[str, Any]:
    """hand_run's run: step 0 lasts 6 s, step 1 3 s; 9 s in all; 1 OOM."""
    return summarize(load_run(write_run(tmp_path / "run", run_events())))


def test_mean_step_skips_warm_up(summary: dict[str, Any]) -> None:
    assert mean_step_s(summary, 1) == 3.0
    assert mean_step_s(summary, 0) == 4.5
    assert mean_step_s(summary, 2) == 4.5  # no more than 2 steps: none is skipped
    summary["jobs"][0]["steps"][1]["complete"] = False
    assert mean_step_s(summary, 1) == 6.0  # an incomplete step counts for nothing


def test_format_comparison(summary: dict[str, Any], tmp_path: Path) -> None:
    # The same run with every time doubled: half the speed.
    doubled = tmp_path / "slow"
    shutil.copytree(summary["run"]["path"], doubled)
    events = [json.loads(line) for line in (doubled / "events.jsonl").read_text().splitlines()]
    for e in events:
        for key in ("t", "t0", "t1", "issue", "end"):
            if key in e:
                e[key] *= 2
        for key in ("down", "compute", "up"):
            if key in e:
                e[key] = [2 * t for t in e[key]]
    write_run(doubled, events)
    slow = summarize(load_run(doubled))
    rows = with_speedups([
        comparison_row(Combination("a-0:1,b-1:1,c-2:1", "lan", None), summary, 1),
        comparison_row(Combination("a-0:1,b-1:1,c-2:1", "lte", "fan"), slow, 1),
    ])  # fmt: skip
    assert [(r["mean_step_s"], r["total_s"], r["speedup"]) for r in rows] == [
        (3.0, 9.0, 1.0),
        (6.0, 18.0, 0.5),
    ]
    # 2.5 + 3.5 × 4096 B moved (hand_run's schedule); mean utilisation (2 + 5.25 + 1) / 27
    assert rows[0]["bytes_moved"] == 6.0 * 4096 and rows[0]["oom"] == 1
    table = format_comparison(rows).splitlines()
    assert table[0].split() == ["fleet", "link", "cooling", "devices", "step", "s", "total", "s",
                                "util", "%", "moved", "OOM", "speed-up"]  # fmt: skip
    assert table[2].split() == ["a-0:1,b-1:1,c-2:1", "lan", "default", "3", "3.0000", "9.0000",
                                "30.6", "24.0", "KiB", "1", "1.00x"]  # fmt: skip
    assert table[3].split()[1:3] == ["lte", "fan"] and table[3].split()[-1] == "0.50x"
    assert len({len(line) for line in table}) == 1  # aligned columns
