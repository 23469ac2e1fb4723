"""Running under systemd: sd_notify from real processes, and the units themselves.

A Unix datagram socket stands in for systemd's ``NOTIFY_SOCKET``; the units
are staged by ``scripts/install-service.sh`` and checked by
``systemd-analyze verify`` where it exists.
"""

from __future__ import annotations

import asyncio
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
from morphling.proxy.emulator.settings import EmulatorConfig
from processes import Procs, free_port

from morphling import config as configuration
from morphling.commands.device import DeviceConfig
from morphling.sdnotify import Notifier

REPO = Path(__file__).resolve().parent.parent
UNITS = ("morphling-emulator.service", "morphling-device@.service")


class FakeSystemd:
    """The receiving end of ``NOTIFY_SOCKET``: a bound datagram socket."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.messages: list[dict[str, str]] = []

    def receive(self, key: str, timeout: float = 30.0) -> dict[str, str]:
        """The next message that sets ``key``, keeping every message seen."""
        deadline = time.monotonic() + timeout
        while True:
            self.sock.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                data = self.sock.recv(4096)
            except TimeoutError:
                raise AssertionError(f"no {key} within {timeout} s; got {self.messages}") from None
            message = dict(line.split("=", 1) for line in data.decode().splitlines())
            self.messages.append(message)
            if key in message:
                return message

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def systemd(tmp_path: Path):
    fake = FakeSystemd(tmp_path / "notify.sock")
    yield fake
    fake.close()


def test_emulator_is_ready_only_when_listening_pets_the_watchdog_and_says_stopping(
    procs: Procs, systemd: FakeSystemd
):
    env = {"NOTIFY_SOCKET": str(systemd.path), "WATCHDOG_USEC": "300000"}
    emulator, port = procs.emulator("--no-probe", env=env)
    ready = systemd.receive("READY")
    assert ready["READY"] == "1" and ready["STATUS"].startswith("listening on 127.0.0.1:")
    with socket.create_connection(("127.0.0.1", port), timeout=5):
        pass  # it accepts connections once READY=1 has been sent
    procs.device(port, "dev-0")
    procs.wait_for(emulator, "device 0 (dev-0) ready")
    deadline = time.monotonic() + 10  # beats sent before the device was ready are queued
    while systemd.receive("WATCHDOG")["STATUS"] != "1 devices ready, 0 jobs and probes":
        assert time.monotonic() < deadline
    start = time.monotonic()
    beats = [systemd.receive("WATCHDOG") for _ in range(4)]
    assert all(b["WATCHDOG"] == "1" for b in beats)
    assert time.monotonic() - start < 2.0  # every 150 ms: half of WATCHDOG_USEC
    emulator.signal(signal.SIGTERM)
    assert systemd.receive("STOPPING")["STOPPING"] == "1"
    assert emulator.wait(timeout=10) == 0


def test_device_is_ready_without_an_emulator_and_reports_registration(
    procs: Procs, systemd: FakeSystemd
):
    port = free_port()  # nothing listens yet: the service must still start
    env = {"NOTIFY_SOCKET": str(systemd.path), "WATCHDOG_USEC": "300000"}
    device = procs.start("dev-0", "device", "--server", f"127.0.0.1:{port}", "--name", "dev-0",
                         "--threads", "1", env=env)  # fmt: skip
    assert systemd.receive("READY")["STATUS"] == "0 registered with the emulator"
    procs.wait_for(device, "cannot reach")
    emulator = procs.start("emulator", "emulator", "--listen-ip", "127.0.0.1",
                           "--listen-port", str(port), "--no-probe")  # fmt: skip
    procs.wait_for(emulator, "device 0 (dev-0) ready")
    deadline = time.monotonic() + 10
    while systemd.receive("WATCHDOG")["STATUS"] != "1 registered with the emulator":
        assert time.monotonic() < deadline
    device.signal(signal.SIGTERM)
    assert "STOPPING" in systemd.receive("STOPPING")
    assert device.wait(timeout=10) == 0


def test_a_receiver_that_stops_reading_costs_dropped_notifications_not_a_stall(
    systemd: FakeSystemd, caplog: pytest.LogCaptureFixture
):
    """A datagram queue holds a handful of messages: sending into a full one blocked the
    service's event loop for good (a device's watchdog beats while nobody read them)."""
    notifier = Notifier({"NOTIFY_SOCKET": str(systemd.path)})
    sent = [notifier.notify(WATCHDOG=1, STATUS=f"beat {i}") for i in range(200)]
    assert sent[0] and not sent[-1]  # delivered until the queue was full, then dropped
    assert caplog.text.count("systemd is not reading") == 1  # said once, not per beat
    assert systemd.receive("WATCHDOG")["STATUS"] == "beat 0"
    while sent.count(True) > len(systemd.messages):
        systemd.receive("WATCHDOG")
    assert notifier.notify(READY=1)  # room again: delivered
    assert systemd.receive("READY")["READY"] == "1"
    notifier.close()


def test_abstract_socket_and_a_watchdog_meant_for_another_process(tmp_path):
    receiver = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    name = f"morphling-test-{tmp_path.name}"
    receiver.bind("\0" + name)
    receiver.settimeout(5)
    try:
        notifier = Notifier({"NOTIFY_SOCKET": "@" + name, "WATCHDOG_USEC": "1000000",
                             "WATCHDOG_PID": "1"})  # fmt: skip
        assert notifier.notify(READY=1, STATUS="up")
        assert receiver.recv(100) == b"READY=1\nSTATUS=up"
        assert notifier.watchdog_s is None  # WATCHDOG_PID names another process
        notifier.close()
    finally:
        receiver.close()
    outside = Notifier({})
    assert not outside.enabled and not outside.notify(READY=1)


async def test_an_unhealthy_service_withholds_the_watchdog(systemd: FakeSystemd):
    notifier = Notifier({"NOTIFY_SOCKET": str(systemd.path), "WATCHDOG_USEC": "40000"})
    health = {"ok": True}
    task = asyncio.ensure_future(notifier.keep_alive(lambda: health["ok"], lambda: "fine"))
    await asyncio.sleep(0.2)
    health["ok"] = False
    await asyncio.sleep(0.05)  # a beat already on its way may still land
    systemd.sock.setblocking(False)
    while True:
        try:
            systemd.sock.recv(4096)
        except BlockingIOError:
            break
    await asyncio.sleep(0.2)  # ten periods unhealthy
    with pytest.raises(BlockingIOError):
        systemd.sock.recv(4096)
    task.cancel()
    notifier.close()


# -- the units ----------------------------------------------------------------------------


def test_units_ask_for_what_the_services_need():
    for unit in UNITS:
        text = (REPO / "scripts" / unit).read_text()
        settings = [line for line in text.splitlines() if line and not line.startswith("#")]
        for needed in ("Type=notify", "WatchdogSec=30s", "LimitMEMLOCK=infinity",
                       "Restart=on-failure", "DeviceAllow=char-nvidia* rw"):  # fmt: skip
            assert needed in settings, f"{unit}: {needed}"
        # libffi and CUDA need writable executable pages; this would break them.
        assert not any(s.startswith("MemoryDenyWriteExecute") for s in settings), unit
        assert not any(s.startswith("PrivateDevices") for s in settings), unit


def test_installed_units_pass_systemd_analyze_verify(tmp_path):
    stage = tmp_path / "root"
    subprocess.run(["sh", str(REPO / "scripts" / "install-service.sh"), str(stage)], check=True,
                   capture_output=True)  # fmt: skip
    installed = stage / "etc" / "systemd" / "system"
    emulator = (installed / UNITS[0]).read_text()
    assert f"ExecStart={REPO}/.venv/bin/morphling emulator" in emulator
    # The example settings are valid for the commands they configure.
    etc = stage / "etc" / "morphling"
    cfg, _ = configuration.load(EmulatorConfig, {}, env={}, toml_path=etc / "emulator.toml",
                                section="emulator")  # fmt: skip
    assert (cfg.listen_ip, cfg.listen_port) == ("127.0.0.1", 39001)
    configuration.load(DeviceConfig, {}, env={}, toml_path=etc / "device-example.toml",
                       section="device")  # fmt: skip
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed; the units were checked by content only")
    device = installed / "morphling-device@board.service"
    device.symlink_to(installed / UNITS[1])
    for unit in (installed / UNITS[0], device):
        done = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True,
                              text=True, timeout=60)  # fmt: skip
        # verify exits 0 even after ignoring a line it cannot parse: any output is a finding.
        assert done.returncode == 0 and not done.stderr.strip(), f"{unit.name}: {done.stderr}"
