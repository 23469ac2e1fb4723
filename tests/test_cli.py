"""The `morphling` command: help, version, and errors with conventional exit codes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from morphling import __version__


def morphling(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "morphling", *args], capture_output=True, text=True, timeout=120
    )


def test_help_lists_subcommands():
    proc = morphling("--help")
    assert proc.returncode == 0
    assert "version" in proc.stdout and "--log-level" in proc.stdout


def test_version_and_verbose_kernel_report():
    assert morphling("version").stdout.strip() == f"morphling {__version__}"
    proc = morphling("version", "-v")
    assert proc.returncode == 0
    assert "blas: mkl" in proc.stdout or "blas: openblas" in proc.stdout
    assert "cublasxt: " in proc.stdout
    assert "memlock limit: " in proc.stdout


def test_unknown_flag_and_missing_command_exit_2():
    proc = morphling("version", "--frobnicate")
    assert proc.returncode == 2
    assert "unrecognized arguments: --frobnicate" in proc.stderr
    assert morphling().returncode == 2


def test_console_script_is_installed():
    import shutil

    exe = shutil.which("morphling", path=str(__import__("pathlib").Path(sys.executable).parent))
    assert exe is not None
    proc = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=60)
    assert proc.stdout.strip() == f"morphling {__version__}"


def test_emulator_alias_takes_log_level_and_the_emulators_flags():
    """``morphling-emulator`` is ``morphling emulator``, ``--log-level`` included: here it
    gets as far as refusing a port no TCP socket has."""
    exe = Path(sys.executable).parent / "morphling-emulator"
    proc = subprocess.run([str(exe), "--listen_port", "70000", "--log-level", "warning"],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 2
    assert "flag --listen-port: '70000' is above the maximum 65535" in proc.stderr, proc.stderr


def test_profile_refuses_to_overwrite_without_force(tmp_path):
    existing = tmp_path / "host.toml"
    existing.write_text("kept")
    proc = morphling("profile", "--quick", "--output", str(existing))
    assert proc.returncode == 2 and "--force" in proc.stderr
    assert existing.read_text() == "kept"
    assert morphling("profile", "--help").returncode == 0
