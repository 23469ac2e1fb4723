"""``morphling-bench`` against a real emulator over real sockets, run as the user runs it."""

from __future__ import annotations

import asyncio
import json
import shutil
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from morphling.devices.bench import BenchError, ProbeClient
from morphling.proxy.emulator.server import Emulator
from morphling.proxy.emulator.settings import EmulatorConfig
from morphling.proxy.wire.messages import Message, ProbeEcho, ProbePush
from raw_peer import fake_emulator

from morphling.commands.bench import parse_size, parse_sizes
from morphling.text import format_size


@contextmanager
def running_emulator(**overrides: object) -> Iterator[str]:
    """An in-process emulator on its own event-loop thread; yields ``HOST:PORT``."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True, name="test-emulator")
    thread.start()

    async def start() -> tuple[Emulator, tuple[str, int]]:
        emulator = Emulator(EmulatorConfig(listen_ip="127.0.0.1", listen_port=0, **overrides))
        return emulator, await emulator.start()

    try:
        emulator, (host, port) = asyncio.run_coroutine_threadsafe(start(), loop).result(30)
        try:
            yield f"{host}:{port}"
        finally:
            asyncio.run_coroutine_threadsafe(emulator.stop(), loop).result(30)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)
        loop.close()


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    with running_emulator() as address:
        yield address


def bench(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "morphling.commands.bench", *args],
        capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


def free_port() -> int:
    """A port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_json_report_has_every_measurement(server: str) -> None:
    proc = bench("--server", server, "--sizes", "64KiB,1MiB,4MiB", "--latency-rounds", "10",
                 "--flops-dim", "128", "--json")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["server"] == server
    latency = report["latency"]
    assert latency["rounds"] == 10 and latency["bytes"] == 64
    assert 0 < latency["min_us"] <= latency["median_us"]
    assert latency["rtt_min_us"] == pytest.approx(2 * latency["min_us"], abs=0.02)
    rows = report["bandwidth"]
    assert [r["bytes"] for r in rows] == [64 << 10, 1 << 20, 4 << 20]
    assert [r["size"] for r in rows] == ["64KiB", "1MiB", "4MiB"]
    for row in rows:
        assert row["down_bytes_s"] > 0 and row["up_bytes_s"] > 0
        assert row["down_gbit_s"] > 0 and row["up_gbit_s"] > 0
    flops = report["flops"]
    assert flops["ok"] is True and flops["reason"] == ""
    assert flops["dim"] == 128 and flops["compute_ns"] > 0 and flops["runs"] >= 1
    assert flops["flops"] > 0
    # The verified FLOP/s is the challenge's work over the compute time we reported.
    assert flops["flops"] == pytest.approx(2 * 128**3 / flops["compute_ns"] * 1e9, rel=1e-6)


def test_by_default_sizes_from_64_kib_to_64_mib_are_measured(server: str) -> None:
    proc = bench("--server", server, "--repeats", "1", "--flops-dim", "32", "--json")
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout)["bandwidth"]
    assert [r["size"] for r in rows] == ["64KiB", "1MiB", "4MiB", "16MiB", "64MiB"]
    assert all(r["down_bytes_s"] > 0 and r["up_bytes_s"] > 0 for r in rows)


def test_table_output_and_progress_on_stderr(server: str) -> None:
    proc = bench("--server", server, "--sizes", "64KiB,1MiB", "--repeats", "2",
                 "--flops-dim", "64")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "latency (64 B echo" in out and "µs" in out
    assert "64KiB" in out and "1MiB" in out and "MB/s" in out
    assert "FLOPS challenge (64×64 float32): passed" in out
    assert "bandwidth" in proc.stderr  # the tqdm bar
    assert "{" not in out


def test_token_is_required_and_checked() -> None:
    with running_emulator(token="s3cret") as address:
        proc = bench("--server", address, "--sizes", "4KiB", "--flops-dim", "32", "--json",
                     "--token", "s3cret")  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        assert json.loads(proc.stdout)["flops"]["ok"] is True
        proc = bench("--server", address, "--sizes", "4KiB")
        assert proc.returncode == 2
        assert "requires a token" in proc.stderr
        proc = bench("--server", address, "--sizes", "4KiB", "--token", "wrong")
        assert proc.returncode == 2
        assert "auth" in proc.stderr and "token does not match" in proc.stderr


def test_failed_verdict_exits_1() -> None:
    # The emulator allows 10 ms for the answer; a 2048² challenge takes longer to build.
    with running_emulator(probe_timeout_s=0.01) as address:
        proc = bench("--server", address, "--sizes", "4KiB", "--flops-dim", "2048", "--json")
    assert proc.returncode == 1, proc.stderr
    flops = json.loads(proc.stdout)["flops"]
    assert flops["ok"] is False and "no result within" in flops["reason"]
    assert "FLOPS challenge failed" in proc.stderr


def test_help_describes_every_option() -> None:
    proc = bench("--help")
    assert proc.returncode == 0
    for option in ("--server", "--token", "--sizes", "--repeats", "--latency-rounds",
                   "--flops-dim", "--timeout", "--json", "--no-progress", "--log-level",
                   "Exit status"):  # fmt: skip
        assert option in proc.stdout


def test_console_script_is_installed() -> None:
    exe = shutil.which("morphling-bench", path=str(Path(sys.executable).parent))
    assert exe is not None
    proc = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "usage: morphling-bench" in proc.stdout


@pytest.mark.parametrize("sizes", ["4MB", "0", "1,,x", "2GiB", ""])
def test_bad_sizes_exit_2(sizes: str) -> None:
    proc = bench("--server", "127.0.0.1:1", "--sizes", sizes)
    assert proc.returncode == 2
    assert "--sizes" in proc.stderr


@pytest.mark.parametrize(
    "args",
    [
        [],  # --server is required
        ["--server", "127.0.0.1:99999"],
        ["--server", "127.0.0.1:39000", "--flops-dim", "5000"],
        ["--server", "127.0.0.1:39000", "--latency-rounds", "0"],
        ["--server", "127.0.0.1:39000", "--timeout", "-1"],
    ],
)
def test_usage_errors_exit_2(args: list[str]) -> None:
    proc = bench(*args)
    assert proc.returncode == 2
    assert "usage: morphling-bench" in proc.stderr


def test_unreachable_server_exits_2() -> None:
    port = free_port()
    proc = bench("--server", f"127.0.0.1:{port}", "--timeout", "5")
    assert proc.returncode == 2
    assert f"cannot reach 127.0.0.1:{port}" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_server_that_is_not_an_emulator_exits_2() -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        proc = bench("--server", f"127.0.0.1:{port}", "--timeout", "1")
    assert proc.returncode == 2
    assert "did not welcome us" in proc.stderr


async def test_a_reply_of_the_wrong_kind_is_a_bench_error() -> None:
    """An emulator answering PROBE_PUSH with an echo: a one-line error, not a crash."""

    def echo(msg: Message) -> Message | None:
        if isinstance(msg, ProbePush):
            return ProbeEcho(probe=msg.probe, reply=True, segments=msg.segments)
        return None

    async with fake_emulator(echo) as port:
        client = await ProbeClient.connect("127.0.0.1", port, timeout=10.0)
        try:
            with pytest.raises(BenchError, match="answered PROBE_PUSH with PROBE_ECHO"):
                await client.push(4096)
        finally:
            await client.close()


def test_size_parsing() -> None:
    assert parse_size("65536") == 65536
    assert parse_size("64KiB") == 64 << 10
    assert parse_size(" 4MiB ") == 4 << 20
    assert parse_size("1GiB") == 1 << 30
    assert parse_size("100B") == 100
    assert parse_sizes("64KiB,1MiB,4MiB") == [64 << 10, 1 << 20, 4 << 20]
    for bad in ("4MB", "4 mib", "-1", "1.5MiB", "0", "2GiB"):
        with pytest.raises(ValueError):
            parse_size(bad)
    with pytest.raises(ValueError):
        parse_sizes(" , ")
    assert [format_size(n) for n in (64 << 10, 4 << 20, 1 << 30, 1000)] == [
        "64KiB", "4MiB", "1GiB", "1000B",
    ]  # fmt: skip
