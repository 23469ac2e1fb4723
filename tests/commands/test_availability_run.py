"""``morphling run --churn`` and ``--availability``: devices leaving and coming back in
virtual time, end to end, and the settings it refuses before anything runs."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
from processes import morphling_here, morphling_run, python, succeeded

SCRIPT = """\
import json, torch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.Tanh(), torch.nn.Linear(512, 64))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
x, y = torch.randn(128, 256), torch.randn(128, 64)
losses = []
for _ in range(4):
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    losses.append(loss.item())
print(json.dumps(losses))
"""
# the whole step priced by a Pi 4's models: a timeline of its own, whatever the host does
FLEET = ("--embedded", "--devices", "rpi4:4", "--min-flops", "0", "--block-size", "64",
         "--coordinator", "rpi4", "--coordinator-time", "model", "--no-report")  # fmt: skip


def test_churn_places_a_leaving_devices_tiles_again_and_the_losses_stay_native(
    tmp_path: Path,
) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    native = json.loads(succeeded(python(script, cwd=tmp_path)).stdout)
    report = tmp_path / "report.json"
    run = succeeded(morphling_run(*FLEET, "--churn", "mtbf=0.02,mttr=0.01,seed=1", "--json",
                                  report, "--run-dir", tmp_path / "run", "--", "python",
                                  script, cwd=tmp_path))  # fmt: skip
    assert json.loads(run.stdout) == pytest.approx(native, rel=1e-5)
    steps = json.loads(report.read_text())["steps"]
    interrupted = sum(s["interruptions"] for s in steps)
    assert interrupted > 0 and sum(s["lost_s"] for s in steps) > 0
    assert f"devices leaving: {interrupted} interruptions" in run.stderr
    lines = gzip.decompress((tmp_path / "run" / "events.jsonl.gz").read_bytes()).splitlines()
    away = [json.loads(line) for line in lines if b'"ev":"away"' in line]
    assert sum(a["tiles"] for a in away) == interrupted
    assert {a["device"] for a in away} <= {0, 1, 2, 3}


def test_a_trace_keeps_a_device_away_for_its_gap(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    trace = tmp_path / "trace.csv"
    trace.write_text("device,start,end\nrpi4-0,0,0.001\nrpi4-0,1000,\n")  # away after 1 ms
    succeeded(morphling_run(*FLEET, "--availability", trace, "--run-dir", tmp_path / "run",
                            "--", "python", script, cwd=tmp_path))  # fmt: skip
    lines = gzip.decompress((tmp_path / "run" / "events.jsonl.gz").read_bytes()).splitlines()
    tiles = [json.loads(line) for line in lines if b'"ev":"tile"' in line]
    on_0 = [t for t in tiles if t["device"] == 0]
    assert all(t["up"][1] <= 0.001 for t in on_0)  # none while it was away
    assert {t["device"] for t in tiles} >= {1, 2, 3}


def test_a_job_of_another_emulator_is_told_these_settings_are_the_emulators(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("print('ran')\n")
    for flags in (["--churn", "mtbf=1,mttr=1"], ["--on-leave", "restart"]):
        code, out, err = morphling_here(
            capsys, "run", "--server", "127.0.0.1:9", *flags, "--", "python", "train.py"
        )
        assert code == 2 and "ran" not in out
        assert "--on-leave are the emulator's: give them to the one at 127.0.0.1:9" in err


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--churn", "mtbf=10"], "--churn 'mtbf=10': mttr missing"),
        (["--availability", "TRACE"], "names devices the fleet lacks: ghost"),
        (["--availability", "nowhere.csv"], "nowhere.csv: cannot read it"),
        (["--churn", "mtbf=1,mttr=1", "--availability", "TRACE"], "not both"),
        (["--on-leave", "leave"], "--on-leave: 'leave' is not one of 'wait', 'restart', 'drop'"),
        (["--on-leave", "drop"], "--on-leave drop drops replayed ranks, whose numerics nobody"),
    ],
)
def test_bad_availability_settings_are_refused_before_anything_runs(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    flags: list[str],
    expected: str,
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "trace.csv").write_text("rpi4-0,0,5\nghost,0,5\n")
    (tmp_path / "train.py").write_text("print('ran')\n")
    flags = [str(tmp_path / "trace.csv") if f == "TRACE" else f for f in flags]
    code, out, err = morphling_here(
        capsys, "run", "--embedded", "--devices", "rpi4:2", *flags, "--", "python", "train.py"
    )
    assert code == 2 and "ran" not in out
    assert expected in err, err
