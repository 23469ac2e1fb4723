"""Child ``morphling`` processes for end-to-end tests, and their logs.

Each process's stdout and stderr go to a log file under the test's tmp_path;
readiness is found by polling those logs, and ``Procs.stop_all`` (the ``procs``
fixture's finalizer, in conftest.py) stops every child.
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest

MORPHLING = [sys.executable, "-m", "morphling"]
MORPHLING_RUN = [*MORPHLING, "--log-level", "warning", "run"]
SCRIPTS = Path(__file__).parent / "scripts"  # the training scripts the runs train
# torchrun runs a reference script through it: see its docstring
WITHOUT_FINALIZING = Path(__file__).parents[1] / "scripts" / "without_finalizing.py"
TIMEOUT_S = 180


def _child(
    command: list[str], cwd: Path | None, env: dict[str, str] | None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, cwd=cwd, env=env or child_env(), capture_output=True,
                          text=True, timeout=TIMEOUT_S, check=False)  # fmt: skip


def morphling_run(
    *args: str | Path, cwd: Path | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``morphling run ARGS`` as a child process; its exit code, stdout and stderr."""
    return _child([*MORPHLING_RUN, *map(str, args)], cwd, env)


def morphling_here(capsys: pytest.CaptureFixture[str], *args: str | Path) -> tuple[int, str, str]:
    """``morphling ARGS`` in this process, for what a command refuses before it starts
    anything (a usage error: the same code as in a child, without its start-up); its exit
    code, stdout and stderr. The test runs it from the directory it means (``chdir``)."""
    from morphling.cli import main

    capsys.readouterr()
    try:
        code = main(["--log-level", "warning", *map(str, args)])
    except SystemExit as exc:  # argparse's own refusals
        code = exc.code if isinstance(exc.code, int) else 1
    out = capsys.readouterr()
    return code, out.out, out.err


def python(
    *args: str | Path, cwd: Path | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """The same command run natively, as the reference."""
    return _child([sys.executable, *map(str, args)], cwd, env)


def load_script(name: str) -> ModuleType:
    """A training script as a module (its ``main`` does not run): for its constants and
    its ``build``."""
    spec = importlib.util.spec_from_file_location(Path(name).stem, SCRIPTS / name)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(SCRIPTS))  # as when run: its directory first, for _training
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(SCRIPTS))
    return module


def succeeded(proc: subprocess.CompletedProcess[str]) -> subprocess.CompletedProcess[str]:
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc


def gemm_cases(seed: int, count: int = 24) -> list[tuple[np.ndarray, np.ndarray]]:
    """``count`` float32 GEMMs [256, 96] · [96, 256]: 64 tiles each at block 32, enough
    that every device has tiles in flight when a test cuts something mid-run."""
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal((256, 96), np.float32),
             rng.standard_normal((96, 256), np.float32)) for _ in range(count)]  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env(**extra: str) -> dict[str, str]:
    """The environment minus MORPHLING_* settings, which would override test defaults,
    plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MORPHLING_")}
    return {**env, **extra}


@dataclass
class Proc:
    label: str
    popen: subprocess.Popen
    log: Path

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def count(self, needle: str) -> int:
        return self.text().count(needle)

    @property
    def alive(self) -> bool:
        return self.popen.poll() is None

    def signal(self, sig: int) -> None:
        self.popen.send_signal(sig)

    def wait(self, timeout: float) -> int:
        return self.popen.wait(timeout=timeout)


class Procs:
    """The child processes of one test; ``stop_all`` runs in the fixture's finalizer."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp = tmp_path
        self.procs: list[Proc] = []

    def start(
        self, label: str, *args: str, preexec_fn=None, wrap: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
    ) -> Proc:  # fmt: skip
        """``morphling ARGS`` (after ``wrap``), with ``env`` added to a clean environment."""
        log = self.tmp / f"{label}.log"
        with log.open("wb") as fh:
            popen = subprocess.Popen(
                [*wrap, *MORPHLING, *args],
                stdin=subprocess.DEVNULL,
                stdout=fh,
                stderr=fh,
                env={**child_env(), **(env or {})},
                preexec_fn=preexec_fn,
            )
        proc = Proc(label, popen, log)
        self.procs.append(proc)
        return proc

    def emulator(
        self, *args: str, preexec_fn=None, env: dict[str, str] | None = None
    ) -> tuple[Proc, int]:
        """Start an emulator on a free loopback port and wait until it listens."""
        for attempt in range(3):
            port = free_port()
            proc = self.start(
                f"emulator-{attempt}",
                "emulator", "--listen-ip", "127.0.0.1", "--listen-port", str(port), *args,
                preexec_fn=preexec_fn, env=env,
            )  # fmt: skip
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                if "emulator listening on" in proc.text():
                    return proc, port
                if not proc.alive:
                    break
                time.sleep(0.05)
            if proc.alive or "cannot listen" not in proc.text():
                self.fail(f"emulator did not start listening on port {port}")
        self.fail("emulator could not bind a free port in three attempts")
        raise AssertionError  # unreachable

    def device(
        self,
        port: int,
        name: str,
        profile: str = "rpi4",
        *extra: str,
        host: str = "127.0.0.1",
        wrap: tuple[str, ...] = (),
    ) -> Proc:
        """A ``morphling device`` reaching ``host:port``; ``wrap`` prefixes the command
        (``ip netns exec NS``)."""
        return self.start(
            name, "device", "--server", f"{host}:{port}", "--profile", profile,
            "--name", name, "--threads", "1", *extra, wrap=wrap,
        )  # fmt: skip

    def fleet(self, port: int, devices: str, label: str = "fleet", preexec_fn=None) -> Proc:
        return self.start(
            label, "fleet", "--server", f"127.0.0.1:{port}", "--devices", devices,
            "--threads", "1", preexec_fn=preexec_fn,
        )  # fmt: skip

    def wait_for(self, proc: Proc, needle: str, count: int = 1, timeout: float = 30.0) -> str:
        """Poll ``proc``'s log until ``needle`` occurs ``count`` times; the log text."""
        deadline = time.monotonic() + timeout
        while True:
            text = proc.text()
            if text.count(needle) >= count:
                return text
            if not proc.alive:
                self.fail(f"{proc.label} exited ({proc.popen.returncode}) before {count}× "
                          f"{needle!r}")  # fmt: skip
            if time.monotonic() > deadline:
                self.fail(f"{proc.label}: {text.count(needle)} of {count}× {needle!r} "
                          f"after {timeout} s")  # fmt: skip
            time.sleep(0.05)

    def fail(self, why: str) -> None:
        tails = "\n".join(
            f"--- {p.label} (rc {p.popen.poll()}) ---\n" + "\n".join(p.text().splitlines()[-15:])
            for p in self.procs
        )
        pytest.fail(f"{why}\n{tails}", pytrace=False)

    def stop_all(self) -> None:
        for p in self.procs:
            if p.alive:
                p.popen.terminate()
        for p in self.procs:
            try:
                p.popen.wait(timeout=5)
            except subprocess.TimeoutExpired:
                p.popen.kill()
                p.popen.wait(timeout=5)


def torchrun(script: str, *args: str, ranks: int = 2) -> subprocess.CompletedProcess[str]:
    """``torchrun`` (a free rendezvous port) of ``tests/scripts/SCRIPT ARGS`` on one host,
    through ``WITHOUT_FINALIZING``: the reference a run under Morphling is held to."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", str(ranks), str(WITHOUT_FINALIZING), str(SCRIPTS / script),
               *args]  # fmt: skip
    return _child(command, None, None)


def rank_objects(stdout: str) -> list[dict[str, Any]]:
    """The JSON objects ranks printed (``{"rank": ...}``): they share stdout, so two may end
    up on one line."""
    decoder, found, at = json.JSONDecoder(), [], stdout.find('{"rank"')
    while at != -1:
        obj, end = decoder.raw_decode(stdout, at)
        found.append(obj)
        at = stdout.find('{"rank"', end)
    return found
