"""The shared token reaches every command without the command line, and no log shows it.

Each command logs its effective configuration at start, which under systemd lands in the
journal; it printed ``token = 'secret'``. Real processes on loopback: an emulator, devices,
a fleet, a job and morphling-bench, each given the token another way.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

from processes import Procs, child_env

SECRET = "s3cret-Token-7f1c"  # no log prints this by chance


def token_file(tmp_path: Path, text: str = SECRET, name: str = "token") -> str:
    path = tmp_path / name
    path.write_text(text + "\n")
    path.chmod(0o600)
    return str(path)


def assert_no_log_shows_the_token(procs: Procs) -> None:
    for proc in procs.procs:
        assert "token = <secret>" in proc.text(), proc.label  # the configuration was logged
        assert SECRET not in proc.text(), proc.label


def test_no_log_shows_the_token_given_on_the_command_line_or_in_the_environment(procs: Procs):
    emulator, port = procs.emulator("--no-probe", "--token", SECRET)  # the case
    procs.device(port, "dev-0", "rpi4", "--token", SECRET)
    procs.start("fleet", "fleet", "--server", f"127.0.0.1:{port}", "--devices", "2",
                "--threads", "1", env={"MORPHLING_TOKEN": SECRET})  # fmt: skip
    procs.wait_for(emulator, "joined as device", 3, timeout=60)
    emulator.signal(signal.SIGTERM)
    assert emulator.wait(timeout=10) == 0
    assert_no_log_shows_the_token(procs)


def test_the_token_authenticates_from_a_file_for_every_command(procs: Procs, tmp_path):
    path = token_file(tmp_path)
    emulator, port = procs.emulator("--no-probe", "--token-file", path)
    server = ["--server", f"127.0.0.1:{port}"]
    procs.device(port, "dev-0", "rpi4", "--token-file", path)
    procs.start("fleet", "fleet", *server, "--devices", "2", "--threads", "1",
                env={"MORPHLING_TOKEN_FILE": path})  # fmt: skip
    procs.wait_for(emulator, "joined as device", 3, timeout=60)

    script = tmp_path / "job.py"
    script.write_text(
        "import torch\n"
        "x = torch.ones(128, 128)\n"
        "assert torch.equal(x @ x, torch.full((128, 128), 128.0))\n"
    )
    job = procs.start("job", "run", *server, "--token-file", path, "--", "python", str(script))
    assert job.wait(timeout=180) == 0, job.text()
    assert "GEMMs: 1 on the fleet" in job.text()  # it computed there, authenticated

    bench = subprocess.run(
        [sys.executable, "-m", "morphling.commands.bench", *server, "--token-file", path,
         "--sizes", "64KiB", "--repeats", "1", "--latency-rounds", "2", "--flops-dim", "32",
         "--no-progress", "--log-level", "debug"],
        capture_output=True, text=True, timeout=120, env=child_env(),
    )  # fmt: skip
    assert bench.returncode == 0, bench.stderr
    assert SECRET not in bench.stdout + bench.stderr

    wrong = token_file(tmp_path, "not-the-token", "wrong")
    refused = procs.device(port, "dev-x", "rpi4", "--token-file", wrong)
    assert refused.wait(timeout=60) == 2, refused.text()
    assert "token does not match" in refused.text()

    emulator.signal(signal.SIGTERM)
    assert emulator.wait(timeout=10) == 0
    assert_no_log_shows_the_token(procs)
