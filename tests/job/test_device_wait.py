"""A job whose fleet vanishes is told, and fails after its deadline unless devices return.

Real processes throughout: an emulator, a fleet, and ``morphling run --server`` running a
small training script. The script trains three steps, then waits for a file before the
rest, so the fleet is SIGKILLed while the job is mid-run but between steps: its next GEMM
finds no device at all. The emulator then tells the job (NOTICE), again every
``--device-wait-notice-s``, and fails it past its ``--device-wait-s``; or a new fleet
arrives, the job is told, and training ends with the results of a native run.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from processes import Procs, child_env

STEPS = 6
SCRIPT = f"""\
import json, pathlib, sys, time
import torch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
losses = []
for step in range({STEPS}):
    if step == 3:  # the test kills the fleet, then lets the script go on
        print("waiting for go", file=sys.stderr, flush=True)
        while not pathlib.Path(sys.argv[1]).exists():
            time.sleep(0.05)
    loss = model(torch.randn(32, 64)).square().mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    losses.append(loss.item())
print(json.dumps(losses))
"""
NOTICE = "no device is ready (0 connected): the job waits with"
PROGRESS = "waiting for devices: 0 connected,"


def start_job(procs: Procs, tmp_path: Path, port: int, wait_s: float):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    job = procs.start(
        "job", "run", "--server", f"127.0.0.1:{port}", "--min-flops", "0",
        "--device-wait-s", str(wait_s), "--", "python", str(script), str(tmp_path / "go"),
    )  # fmt: skip
    return job


def fleet_killed_mid_run(procs: Procs, tmp_path: Path, wait_s: float):
    emulator, port = procs.emulator("--no-probe", "--device-wait-notice-s", "1")
    fleet = procs.fleet(port, "rpi4:2")
    procs.wait_for(emulator, "ready; scheduling", 2)
    job = start_job(procs, tmp_path, port, wait_s)
    procs.wait_for(job, "waiting for go", timeout=120)
    fleet.signal(signal.SIGKILL)
    assert fleet.wait(timeout=10) == -signal.SIGKILL
    procs.wait_for(emulator, "disconnected", 2)
    (tmp_path / "go").touch()
    return emulator, port, job


def test_a_job_without_devices_is_told_and_fails_after_its_deadline(procs: Procs, tmp_path):
    emulator, _, job = fleet_killed_mid_run(procs, tmp_path, wait_s=4)
    procs.wait_for(job, NOTICE, timeout=30)
    procs.wait_for(job, PROGRESS, timeout=30)
    code = job.wait(timeout=60)
    text = job.text()
    assert code == 1, text
    assert (
        "morphling run: the emulator ended the job: no_devices: no device was ready for "
        "4 s (device_wait_s)"
    ) in text
    assert "Traceback" not in text  # one line, not the script's stack
    assert NOTICE in emulator.text() and "no_devices" in emulator.text()
    assert emulator.alive, "the emulator serves on"


def test_a_job_whose_devices_return_before_its_deadline_finishes_right(procs: Procs, tmp_path):
    emulator, port, job = fleet_killed_mid_run(procs, tmp_path, wait_s=120)
    procs.wait_for(job, NOTICE, timeout=30)
    procs.wait_for(job, PROGRESS, timeout=30)
    procs.fleet(port, "rpi4:2", label="fleet-2")
    assert job.wait(timeout=120) == 0, job.text()
    text = job.text()
    assert "emulator: devices are back: " in text
    assert "devices are back: " in emulator.text()
    native = subprocess.run(
        [sys.executable, str(tmp_path / "train.py"), str(tmp_path / "go")],
        capture_output=True, text=True, env=child_env(), timeout=120, check=True,
    )  # fmt: skip
    got = json.loads([line for line in text.splitlines() if line.startswith("[")][-1])
    want = json.loads(native.stdout.splitlines()[-1])
    assert len(got) == len(want) == STEPS
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-4, atol=0)


@pytest.mark.parametrize("wait_s", ["-1", "nan"])
def test_a_bad_device_wait_is_a_usage_error(procs: Procs, tmp_path, wait_s):
    job = procs.start("job", "run", "--server", "127.0.0.1:1", "--device-wait-s", wait_s,
                      "--", "python", str(tmp_path / "none.py"))  # fmt: skip
    assert job.wait(timeout=60) == 2
    assert "device-wait-s" in job.text() or "device_wait_s" in job.text()
