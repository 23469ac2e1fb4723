"""The `morphling` command: help, version, errors with conventional exit codes, and the
defaults and server addresses every command shares."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from morphling.proxy.emulator.settings import EmulatorConfig
from morphling.proxy.shm.files import shm_dir
from processes import child_env, free_port, morphling_here

from morphling import __version__
from morphling import config as configuration
from morphling.cli import build_parser
from morphling.runtime import DEFAULT_PORT, parse_server


def morphling(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "morphling", *args], capture_output=True, text=True, timeout=120
    )


def test_help_lists_subcommands():
    proc = morphling("--help")
    assert proc.returncode == 0
    assert "version" in proc.stdout and "--log-level" in proc.stdout


@pytest.mark.parametrize("argv", [["device"], ["--log-level", "debug", "fleet"], ["emulator"]])
def test_a_board_side_command_never_loads_torch(argv: list[str]) -> None:
    """Only the chosen subcommand's module is imported: ``morphling device`` on a Pi
    would otherwise spend seconds importing torch (and scipy) it never uses."""
    probe = (
        "import sys\nfrom morphling.cli import build_parser\n"
        f"build_parser({[*argv, '--help']!r})\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'scipy', 'matplotlib'}))"
    )
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"
    assert "morphling device" in morphling("device", "--help").stdout


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


BIN = Path(sys.executable).parent


@pytest.mark.parametrize(
    ("argv", "prog"),
    [
        ([BIN / "morphling", "emulator"], "morphling emulator"),
        ([BIN / "morphling-emulator"], "morphling emulator"),
        ([BIN / "morphling", "device"], "morphling device"),
        ([BIN / "morphling", "fleet"], "morphling fleet"),
        ([BIN / "morphling", "run"], "morphling run"),
        ([BIN / "morphling", "save", "--model", "m", "--output", "o"], "morphling save"),
        ([BIN / "morphling", "profile", "--output", "p.toml"], "morphling profile"),
        ([BIN / "morphling", "report", "run-dir"], "morphling report"),
        ([BIN / "morphling", "sweep", "--fleet", "2"], "morphling sweep"),
        ([BIN / "morphling", "nginx-config"], "morphling nginx-config"),
        ([BIN / "morphling", "version"], "morphling version"),
    ],
    ids=lambda v: v if isinstance(v, str) else " ".join(Path(a).name for a in v[:2]),
)
def test_an_unknown_flag_is_the_subcommands_error_with_its_usage(
    argv, prog, tmp_path, capsys, monkeypatch
):
    """Not the top-level usage, which lists only the subcommands: the one whose flags
    were mistyped, so that the right ones are on screen. ``morphling SUBCOMMAND`` in this
    process (the same parser), the other console scripts as children."""
    if Path(argv[0]).name == "morphling":
        monkeypatch.chdir(tmp_path)
        code, _, stderr = morphling_here(capsys, *argv[1:], "--frob")
    else:
        proc = subprocess.run([*map(str, argv), "--frob"], capture_output=True, text=True,
                              timeout=60, cwd=tmp_path)  # fmt: skip
        code, stderr = proc.returncode, proc.stderr
    assert code == 2
    assert stderr.startswith(f"usage: {prog} "), stderr
    assert stderr.endswith(f"{prog}: error: unrecognized arguments: --frob\n")


def shared_files_of(pid: int) -> list[Path]:
    """The shared-memory files (operand arena, weights) process ``pid`` created."""
    return list(shm_dir().glob(f"morphling-*-{pid}-*"))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--listen-ip", "999.1.1.1"], "listen_ip '999.1.1.1' is not an IP address"),
        (["--listen-ip", "127.0.0.1"], "cannot listen on 127.0.0.1:{port}: Address already in use"),
        (
            ["--listen-ip", "127.0.0.1", "--ckpt-path", "nowhere.ckpt"],
            "cannot share the checkpoint's weights: ",
        ),
    ],
    ids=["bad-address", "port-in-use", "no-checkpoint"],
)
def test_an_emulator_that_cannot_start_exits_2_in_one_line_leaving_no_shared_file(args, message):
    """Exit 2 is what the unit does not restart: none of these is fixed by starting again.
    The operand arena, made before the bind, is removed when the bind fails."""
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        proc = subprocess.Popen(
            [sys.executable, "-m", "morphling", "--log-level", "warning", "emulator",
             "--listen-port", str(port), *args],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env(),
        )  # fmt: skip
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2
    assert err.startswith(f"morphling emulator: {message.format(port=port)}"), err
    assert err.count("\n") == 1, err
    assert not shared_files_of(proc.pid)


def test_a_device_that_may_not_reconnect_exits_1_when_the_emulator_is_unreachable():
    port = free_port()  # closed: nothing listens on it
    proc = subprocess.run(
        [sys.executable, "-m", "morphling", "device", "--server", f"127.0.0.1:{port}",
         "--no-reconnect", "--threads", "1", "--name", "pi"],
        capture_output=True, text=True, timeout=60, env=child_env(),
    )  # fmt: skip
    assert proc.returncode == 1
    assert f"ERROR morphling.devices.agent: pi: cannot reach 127.0.0.1:{port}: " in proc.stderr


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


def test_emulator_listens_on_loopback_port_39000_unless_told():
    """Port 39000 by default; on loopback, since an address other machines reach needs a
    token (or --insecure): with one, boards reach it from anywhere."""
    args = build_parser().parse_args(["emulator"])
    cfg, sources = configuration.load(EmulatorConfig, args, env={}, section="emulator")
    assert (cfg.listen_ip, cfg.listen_port) == ("127.0.0.1", DEFAULT_PORT) == ("127.0.0.1", 39000)
    assert sources["listen_ip"] == sources["listen_port"] == "default"
    args = build_parser().parse_args(["emulator", "--listen-ip", "0.0.0.0"])
    cfg, _ = configuration.load(EmulatorConfig, args, env={"MORPHLING_TOKEN": "s"},
                                section="emulator")  # fmt: skip
    assert (cfg.listen_ip, cfg.token) == ("0.0.0.0", "s")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("10.0.0.2:40000", ("10.0.0.2", 40000)),
        ("10.0.0.2", ("10.0.0.2", 39000)),
        ("emulator.lab:41000", ("emulator.lab", 41000)),  # a hostname, resolved on connect
        ("[fd00::3]:42000", ("fd00::3", 42000)),
        ("[fd00::3]", ("fd00::3", 39000)),
        ("fd00::3", ("fd00::3", 39000)),  # a bare IPv6 address: its colons are not a port
    ],
)
def test_server_addresses_parse(text, expected):
    assert parse_server(text) == expected


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (":39000", "no host"),
        ("host:0", "is not 1..65535"),
        ("host:65536", "is not 1..65535"),
        ("host:port", "'port' is not 1..65535"),
        ("[fd00::3", "expected [ADDRESS]:PORT"),
        ("[fd00::3]x", "expected [ADDRESS]:PORT"),
    ],
)
def test_bad_server_addresses_are_refused_naming_the_setting(text, message):
    with pytest.raises(ValueError, match=re.escape(message)) as info:
        parse_server(text, "--server")
    assert str(info.value).startswith(f"--server {text!r}")


def test_the_emulator_starts_without_torch_or_scipy():
    """``morphling emulator`` serves without either (torch is for the jobs, scipy for fitting
    profiles): each would cost every start of the service seconds and hundreds of MB."""
    code = (
        "import sys, morphling.commands.emulator; "
        "print(sorted({'torch', 'scipy'} & {m.split('.')[0] for m in sys.modules}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=child_env(), timeout=60, check=True).stdout  # fmt: skip
    assert out == "[]\n", out
