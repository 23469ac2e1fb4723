"""End to end: real emulator, device and fleet processes talking over loopback sockets.

Nothing is mocked. Each test starts ``python -m morphling`` processes with their
stderr in a log file under ``tmp_path``, waits for readiness by polling those
logs, drives jobs through ``morphling.proxy.job.client`` and reads what happened from
the logs and from the ``Result`` messages (which say which devices computed
tiles and how many were re-queued). A fixture finalizer stops every child.
"""

from __future__ import annotations

import asyncio
import json
import re
import resource
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from morphling.devices.models.capacity import DEVICE_BYTES
from morphling.proxy.job.client import AsyncClient, Client, EmulatorError
from morphling.proxy.wire.messages import Gemm, Result
from processes import MORPHLING, Procs, child_env, free_port, gemm_cases, morphling_here

try:
    import torch
except ImportError:  # torch is optional; its cases are simply left out
    torch = None

JOINED = "joined as device"


# -- jobs ----------------------------------------------------------------------------------


class RecordingClient(AsyncClient):
    """An ``AsyncClient`` that remembers what every ``Result`` said."""

    def __init__(self, conn, job_id: int) -> None:
        super().__init__(conn, job_id)
        self.devices: set[int] = set()
        self.requeued = 0
        self.tiles = 0
        self.results: list[Result] = []

    async def submit(self, request: Gemm, *, timeout: float | None = None) -> Result:
        result = await super().submit(request, timeout=timeout)
        self.devices.update(result.devices)
        self.requeued += result.requeued
        self.tiles += result.tiles
        self.results.append(result)
        return result


def reference(a, b) -> np.ndarray:
    """``a @ b`` in float64 with numpy, for numpy arrays or torch tensors."""
    a = a.numpy() if torch is not None and isinstance(a, torch.Tensor) else a
    b = b.numpy() if torch is not None and isinstance(b, torch.Tensor) else b
    return np.matmul(a.astype(np.float64), b.astype(np.float64))


def check(c: np.ndarray, a, b) -> None:
    ref = reference(a, b)
    assert c.shape == ref.shape
    if c.dtype == np.float32:
        np.testing.assert_allclose(c, ref, rtol=1e-4, atol=1e-4)
    else:
        assert c.dtype == np.float64
        np.testing.assert_allclose(c, ref, rtol=1e-10, atol=1e-10)


def random_cases(rng: np.random.Generator, count: int) -> list[tuple[str, object, object]]:
    """``count`` GEMM operand pairs: 2-D, batched, transposed, strided, fp32/fp64, torch."""

    def mat(rows, cols, dtype):
        return rng.uniform(-1, 1, (rows, cols)).astype(dtype)

    def bat(batch, rows, cols, dtype):
        return rng.uniform(-1, 1, (batch, rows, cols)).astype(dtype)

    def strided(rows, cols, dtype):  # a window of a larger array: ld > cols, offset start
        big = mat(rows + 5, cols + 7, dtype)
        return big[2 : 2 + rows, 3 : 3 + cols]

    def dims():
        sizes = (1, 7, 31, 32, 33, 45, 64, 65, 80, 97)
        m, n = rng.choice(sizes), rng.choice(sizes)
        if m * n < 32 * 33:  # keep most GEMMs at several tiles
            m = max(m, 40)
        return int(m), int(n), int(rng.integers(1, 70))

    kinds = [
        "plain", "a.T", "b.T", "both.T", "strided", "strided.T", "batch-a", "batch-b",
        "batch-both", "batch.T", "batch-strided", "batch-step",
    ] + (["torch", "torch.T"] if torch is not None else [])  # fmt: skip
    cases = []
    for i in range(count):
        kind = kinds[i % len(kinds)]
        dtype = np.float64 if i % 4 == 3 else np.float32
        m, n, k = dims()
        batch = int(rng.integers(2, 5))
        if kind == "plain":
            a, b = mat(m, k, dtype), mat(k, n, dtype)
        elif kind == "a.T":
            a, b = mat(k, m, dtype).T, mat(k, n, dtype)
        elif kind == "b.T":
            a, b = mat(m, k, dtype), mat(n, k, dtype).T
        elif kind == "both.T":
            a, b = mat(k, m, dtype).T, mat(n, k, dtype).T
        elif kind == "strided":
            a, b = strided(m, k, dtype), strided(k, n, dtype)
        elif kind == "strided.T":
            a, b = strided(k, m, dtype).T, strided(n, k, dtype)[:, ::1].T
        elif kind == "batch-a":  # 3-D A, one 2-D B shared by every pivot
            a, b = bat(batch, m, k, dtype), mat(k, n, dtype)
        elif kind == "batch-b":
            a, b = mat(m, k, dtype), bat(batch, k, n, dtype)
        elif kind == "batch-both":
            a, b = bat(batch, m, k, dtype), bat(batch, k, n, dtype)
        elif kind == "batch.T":
            a = bat(batch, k, m, dtype).transpose(0, 2, 1)
            b = bat(batch, n, k, dtype).transpose(0, 2, 1)
        elif kind == "batch-strided":  # padded pivots: ld and pivot stride both larger
            a = bat(batch, m + 3, k + 5, dtype)[:, 1 : 1 + m, 2 : 2 + k]
            b = mat(n + 4, k + 2, dtype)[3 : 3 + n, :k].T
        elif kind == "batch-step":  # every other pivot of a larger batch
            a = bat(2 * batch, m, k, dtype)[::2]
            b = bat(2 * batch - 1, k, n, dtype)[::2]
        elif kind == "torch":
            a = torch.from_numpy(bat(batch, m, k, dtype))
            b = torch.from_numpy(mat(k, n, dtype))
        else:  # torch.T
            a = torch.from_numpy(mat(k, m, dtype)).T
            b = torch.from_numpy(mat(n + 3, k, dtype))[1 : 1 + n].T
        cases.append((kind, a, b))
    return cases


async def run_all(client: AsyncClient, cases, concurrency: int = 16) -> None:
    """Compute every case (``concurrency`` GEMMs in flight) and check each result."""
    sem = asyncio.Semaphore(concurrency)

    async def one(kind, a, b):
        async with sem:
            c = await client.matmul(a, b, timeout=60)
        try:
            check(c, a, b)
        except AssertionError as exc:
            raise AssertionError(f"{kind} {tuple(a.shape)} @ {tuple(b.shape)}: {exc}") from None

    await asyncio.gather(*(one(*case) for case in cases))


def joined_ids(emulator_log: str) -> list[int]:
    return [int(m) for m in re.findall(r"joined as device (\d+)", emulator_log)]


# -- 1. a mixed fleet computes GEMMs of every layout correctly ----------------------------


async def test_eight_devices_compute_many_layouts_correctly(procs: Procs):
    emulator, port = procs.emulator(
        "--block-size", "32", "--policy", "round-robin", "--probe-bandwidth-bytes", "64KiB",
        "--probe-flops-dim", "64",
    )  # fmt: skip
    devices = [
        procs.device(port, f"dev-{i}", profile)
        for i, profile in enumerate(("rpi4", "rpi5", "jetson-nano", "orin-nano"))
    ]
    fleet = procs.fleet(port, "rpi4:2,orin-nano:2")
    text = procs.wait_for(emulator, JOINED, 8)
    assert sorted(joined_ids(text)) == list(range(8))
    procs.wait_for(emulator, "ready; scheduling with", 8)
    for device in devices:
        assert re.search(rf"{device.label} registered as device [0-7]\b", device.text())
    assert fleet.count("registered as device") == 4

    cases = random_cases(np.random.default_rng(20240611), 120)
    client = await RecordingClient.connect("127.0.0.1", port, name="layouts")
    try:
        await run_all(client, cases)
        totals = await client.close()
    finally:
        await client.close()
    assert len(client.results) == len(cases)
    assert totals.gemms == len(cases) and totals.tiles == client.tiles
    assert client.tiles > 4 * len(cases)  # several tiles per GEMM on average
    assert client.requeued == 0
    # Round-robin over the eight, all ready before the first GEMM: each gets tiles.
    assert client.devices == set(range(8)), f"tiles went only to {sorted(client.devices)}"
    assert all(p.alive for p in [emulator, *devices, fleet])


# -- 2. a device killed mid-run: its tiles are re-queued, every GEMM still right ----------


async def test_device_killed_mid_run_tiles_requeued(procs: Procs):
    emulator, port = procs.emulator("--block-size", "32", "--window", "2", "--no-probe")
    devices = [procs.device(port, f"dev-{i}") for i in range(3)]
    procs.wait_for(emulator, JOINED, 3)
    ids = {}
    for device in devices:
        text = procs.wait_for(device, "registered as device")
        ids[int(re.search(r"registered as device (\d+)", text)[1])] = device

    rng = np.random.default_rng(7)  # (for the GEMMs after the kill)
    cases = gemm_cases(7)  # ~1,500 tiles queued at once
    client = await RecordingClient.connect("127.0.0.1", port, name="killer")
    try:
        tasks = [asyncio.ensure_future(client.matmul(a, b, timeout=60)) for a, b in cases]
        while len(client.results) < 2:
            await asyncio.sleep(0.005)
        assert not all(t.done() for t in tasks), "the run finished before the kill"
        victim_id = min(client.devices & set(ids))
        victim = ids[victim_id]
        victim.signal(signal.SIGKILL)
        results = await asyncio.gather(*tasks)
        for (a, b), c in zip(cases, results, strict=True):
            check(c, a, b)
        # More work after the loss: only the survivors compute it.
        before = len(client.results)
        more = [(rng.standard_normal((128, 64)), rng.standard_normal((64, 100))) for _ in range(4)]
        for a, b in more:
            check(await client.matmul(a, b, timeout=30), a, b)
        late = set().union(*(r.devices for r in client.results[before:]))
    finally:
        await client.close()
    assert victim.wait(timeout=5) == -signal.SIGKILL

    text = procs.wait_for(emulator, "re-queued tiles")
    name = victim.label
    match = re.search(
        rf"device {victim_id} \({name}\) lost with (\d+) tiles in flight and (\d+) queued; "
        r"re-queued tiles \[([\d, ]+)\]",
        text,
    )
    assert match, f"no re-queue line for device {victim_id} ({name})"
    requeued = [int(t) for t in match[3].split(",")]
    assert int(match[1]) + int(match[2]) == len(requeued) >= 1
    assert client.requeued == len(requeued), "Result.requeued disagrees with the server log"
    assert victim_id not in late and late

    # The emulator survived and serves a new job.
    assert emulator.alive
    with Client("127.0.0.1", port, name="after") as job:
        a, b = rng.standard_normal((70, 50), np.float32), rng.standard_normal((50, 40), np.float32)
        check(job.matmul(a, b, timeout=30), a, b)


async def test_a_device_process_keeps_what_it_was_sent_and_a_restarted_one_loses_nothing(
    procs: Procs,
):
    """A ``morphling device`` process keeps the blocks it is sent: a weight's forward
    product sends it whole, its input-gradient product reads W's column blocks within it
    (only y crosses), the same product again sends nothing. Killed and replaced by a new
    process (whose memory holds nothing), it is sent every block again: every product
    exact, no tile lost."""
    emulator, port = procs.emulator("--block-size", "32", "--no-probe", "--arena-bytes", "0")
    device = procs.device(port, "dev-0")
    procs.wait_for(emulator, JOINED, 1)
    rng = np.random.default_rng(11)
    w = rng.standard_normal((32, 96), np.float32)  # one block of rows: sent whole
    x, y = rng.standard_normal((64, 96), np.float32), rng.standard_normal((64, 32), np.float32)
    client = await RecordingClient.connect("127.0.0.1", port, name="kept")
    try:
        check(await client.matmul(x, w.T, timeout=30), x, w.T)
        check(await client.matmul(y, w, timeout=30), y, w)
        check(await client.matmul(x, w.T, timeout=30), x, w.T)
        first, grad_input, again = (r.bytes_down for r in client.results)
        assert first == x.nbytes + w.nbytes and grad_input == y.nbytes and again == 0
        device.signal(signal.SIGKILL)
        assert device.wait(timeout=5) == -signal.SIGKILL
        procs.device(port, "dev-1")
        procs.wait_for(emulator, JOINED, 2)
        check(await client.matmul(x, w.T, timeout=30), x, w.T)
        assert client.results[-1].bytes_down == x.nbytes + w.nbytes
        assert client.requeued == 0 and all(r.resent == 0 for r in client.results)
    finally:
        await client.close()


# -- 3. a thousand virtual devices in one fleet all get tiles -----------------------------


FLEET_SIZE = 1000
NOFILE_NEEDED = 2100


def _raise_nofile() -> None:
    """preexec_fn: raise the soft RLIMIT_NOFILE to 4096 (or the hard limit, if lower)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 4096 if hard == resource.RLIM_INFINITY else min(4096, hard)
    if soft != resource.RLIM_INFINITY and soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))


async def test_thousand_virtual_devices_all_receive_tiles(procs: Procs):
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < NOFILE_NEEDED:
        pytest.skip(f"RLIMIT_NOFILE hard limit {hard} < {NOFILE_NEEDED}: cannot hold "
                    f"{FLEET_SIZE} sockets per process")  # fmt: skip
    started = time.monotonic()
    emulator, port = procs.emulator(
        "--no-probe", "--heartbeat-s", "5", "--heartbeat-timeout-s", "60", "--block-size", "8",
        "--policy", "load-balanced", preexec_fn=_raise_nofile,
    )  # fmt: skip
    fleet = procs.fleet(port, str(FLEET_SIZE), preexec_fn=_raise_nofile)
    text = procs.wait_for(emulator, JOINED, FLEET_SIZE, timeout=60)
    assert sorted(joined_ids(text)) == list(range(FLEET_SIZE))
    procs.wait_for(emulator, "ready; scheduling with", FLEET_SIZE, timeout=20)

    m, n, k = 256, 256, 16  # 32 × 32 = 1,024 tiles of 8 × 8 per GEMM
    rng = np.random.default_rng(1000)
    client = await AsyncClient.connect("127.0.0.1", port, name="thousand")
    seen: set[int] = set()
    tiles = 0
    gemm = 0
    try:
        while (seen != set(range(FLEET_SIZE)) or tiles < 4000) and gemm < 40:
            assert time.monotonic() - started < 90, f"only {len(seen)} devices got tiles"
            batch = []
            for _ in range(2):
                gemm += 1
                a = rng.standard_normal((m, k), np.float32)
                b = rng.standard_normal((k, n), np.float32)
                request = Gemm(
                    gemm=gemm, dtype="float32", ta=False, tb=False, m=m, n=n, k=k, lda=k,
                    ldb=n, segments=(a.reshape(-1), b.reshape(-1)),
                )  # fmt: skip
                batch.append((a, b, client.submit(request, timeout=60)))
            results = await asyncio.gather(*(sub for _, _, sub in batch))
            for (a, b, _), result in zip(batch, results, strict=True):
                assert result.tiles == (m // 8) * (n // 8)
                assert result.requeued == 0
                c = np.frombuffer(result.segments[0], np.float32).reshape(m, n)
                check(c, a, b)
                seen.update(result.devices)
                tiles += result.tiles
    finally:
        await client.close()
    assert seen == set(range(FLEET_SIZE)), f"{FLEET_SIZE - len(seen)} devices got no tile"
    assert tiles >= 4000
    assert emulator.alive and fleet.alive
    assert fleet.count("registered as device") == FLEET_SIZE


# -- 4. clean shutdown on signals -----------------------------------------------------------


async def test_a_device_finds_the_emulator_by_hostname_and_both_log_their_settings(procs):
    """``--server localhost:PORT`` is resolved when connecting; each side logs the settings
    it runs with and where each came from."""
    emulator, port = procs.emulator("--no-probe", "--window", "3")
    device = procs.device(port, "by-name", host="localhost")
    procs.wait_for(emulator, JOINED)
    procs.wait_for(device, "registered as device 0")
    text = emulator.text()
    assert "effective configuration:" in text
    for line in ("listen_ip = '127.0.0.1'  (flag)", "window = 3  (flag)",
                 "block_size = 256  (default)", "probe = False  (flag)"):  # fmt: skip
        assert line in text, line
    assert f"server = 'localhost:{port}'  (flag)" in device.text()


async def test_sigterm_emulator_and_sigint_device_exit_cleanly(procs: Procs):
    emulator, port = procs.emulator("--no-probe")
    device = procs.device(port, "dev-0")
    fleet = procs.fleet(port, "2")
    procs.wait_for(emulator, JOINED, 3)
    client = await AsyncClient.connect("127.0.0.1", port, name="bystander")
    a = np.ones((40, 30), np.float32)
    np.testing.assert_array_equal(await client.matmul(a, a.T, timeout=30), a @ a.T)

    emulator.signal(signal.SIGTERM)
    assert emulator.wait(timeout=5) == 0
    assert "stopping: saying goodbye to 4 peers" in emulator.text()
    procs.wait_for(device, "dev-0: emulator said goodbye: emulator shutting down", timeout=5)
    procs.wait_for(fleet, "emulator said goodbye: emulator shutting down", 2, timeout=5)
    with pytest.raises(EmulatorError) as info:
        await client.matmul(a, a.T, timeout=5)
    assert info.value.code in ("bye", "disconnected")
    await client.close()

    # The agents outlive the emulator (they retry); a signal still ends them cleanly.
    procs.wait_for(device, "reconnecting in", timeout=5)
    device.signal(signal.SIGINT)
    assert device.wait(timeout=5) == 0
    fleet.signal(signal.SIGTERM)
    assert fleet.wait(timeout=5) == 0


async def test_a_standalone_emulators_run_directory_is_reported(procs: Procs, tmp_path):
    run_dir = tmp_path / "run"
    emulator, port = procs.emulator("--no-probe", "--run-dir", str(run_dir))
    procs.fleet(port, "2")
    procs.wait_for(emulator, JOINED, 2)
    client = await AsyncClient.connect("127.0.0.1", port, name="job")
    a = np.ones((40, 30), np.float32)
    np.testing.assert_array_equal(await client.matmul(a, a.T, timeout=30), a @ a.T)
    await client.step(1)
    await client.close()
    emulator.signal(signal.SIGTERM)
    assert emulator.wait(timeout=5) == 0
    report = subprocess.run([*MORPHLING, "report", "--no-plots", str(run_dir)],
                            capture_output=True, text=True, timeout=60)  # fmt: skip
    assert report.returncode == 0, report.stderr
    assert "coordinator time per job" in report.stdout


async def test_sigint_connected_device_exits_0_and_emulator_sees_it_leave(procs: Procs):
    emulator, port = procs.emulator("--no-probe")
    device = procs.device(port, "dev-0")
    procs.wait_for(emulator, "device 0 (dev-0) ready")
    device.signal(signal.SIGINT)
    assert device.wait(timeout=5) == 0
    procs.wait_for(emulator, "device 0 (dev-0) disconnected", timeout=5)
    assert emulator.alive


# -- a fleet no larger than the host can hold ----------------------------------------------

# A fleet that a regression let grow fails its test at this much address space, instead of
# filling the memory of a host others share.
FLEET_ADDRESS_SPACE = 4 << 30


def mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    pytest.skip("no MemAvailable in /proc/meminfo")


def bounded_address_space() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (FLEET_ADDRESS_SPACE, FLEET_ADDRESS_SPACE))


# A fresh, small Python starts the command in a bounded address space and reports its exit
# code and peak RSS: a child forked from pytest itself (a preexec_fn forks) counts pytest's
# resident pages, hundreds of MB late in the suite, in its ru_maxrss.
BOUNDED_RUN = """
import os, resource, subprocess, sys
limit = int(sys.argv[1])
def bound():
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
proc = subprocess.Popen(sys.argv[2:], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                        text=True, preexec_fn=bound)
sys.stderr.write(proc.stderr.read())
_, status, usage = os.wait4(proc.pid, 0)
print(os.waitstatus_to_exitcode(status), usage.ru_maxrss)
"""


@pytest.mark.parametrize(
    "command",
    [
        ["fleet", "--server", "127.0.0.1:9", "--devices", "rpi4:{count}"],
        ["run", "--embedded", "--devices", "{count}", "--", "python", "train.py"],
        ["sweep", "--fleet", "rpi4:{count}", "--", "python", "train.py"],
    ],
    ids=["fleet", "run", "sweep"],
)
def test_a_fleet_larger_than_the_host_can_hold_is_refused_before_anything_is_made(command):
    count = 2 * mem_available() // DEVICE_BYTES
    argv = [*MORPHLING, *(arg.format(count=count) for arg in command)]
    run = subprocess.run(
        [sys.executable, "-c", BOUNDED_RUN, str(FLEET_ADDRESS_SPACE), *argv],
        capture_output=True, text=True, env=child_env(), timeout=120, check=False,
    )  # fmt: skip
    err = run.stderr
    returncode, maxrss_kib = map(int, run.stdout.split())
    assert returncode == 2, err
    refusal = err.splitlines()[-1]
    assert refusal.startswith(f"morphling {command[0]}: a fleet of {count} devices needs "), err
    assert f"({DEVICE_BYTES >> 10} KiB per device), but " in refusal
    assert refusal.endswith(" is available; --max-devices N allows N devices whatever the memory")
    assert maxrss_kib < 512 << 10  # the interpreter and its imports; no devices


def test_a_fleet_stopped_while_its_devices_are_made_exits_143_before_connecting(procs: Procs):
    """SIGTERM is acted on while a large fleet is still being made, not once it is."""
    count = min(mem_available() // DEVICE_BYTES // 2, 1_000_000)
    if count < 200_000:
        pytest.skip(f"this host holds {count} devices: too few to catch them being made")
    fleet = procs.start(
        "fleet", "fleet", "--server", f"127.0.0.1:{free_port()}", "--devices", str(count),
        "--workers", "1", "--threads", "1", preexec_fn=bounded_address_space,
    )  # fmt: skip
    procs.wait_for(fleet, f"fleet: making {count} virtual devices")
    fleet.signal(signal.SIGTERM)
    assert fleet.wait(timeout=60) == 143
    text = fleet.text()
    assert "SIGTERM while making the devices: stopping" in text
    assert "virtual devices connecting to" not in text


# -- 5. configuration errors --------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "env", "toml", "expect"),
    [
        (["--window", "0"], {}, None, "flag --window: '0' is below the minimum 1"),
        (["--policy", "nope"], {}, None, "flag --policy: 'nope' is not one of"),
        (["--block-size", "big"], {}, None, "flag --block-size: expected int"),
        ([], {"MORPHLING_WINDOW": "0"}, None, "env MORPHLING_WINDOW: '0' is below the minimum"),
        ([], {}, "[emulator]\nwindoww = 3\n", "unknown key 'windoww'"),
        ([], {}, "[emulator]\nwindow = true\n", "window: expected int, got True"),
        (["--listen-ip", "0.0.0.0"], {}, None, "refusing to listen on 0.0.0.0 without a token"),
        (["--auto-block", "--policy", "round-robin"], {}, None, "auto_block: the tile edge"),
    ],
    ids=[
        "window-0",
        "policy-nope",
        "block-size-text",
        "env-window-0",
        "toml-unknown-key",
        "toml-bool-window",
        "reachable-without-token",
        "auto-block-not-greedy",
    ],
)
def test_bad_configuration_exits_2_naming_the_key(
    tmp_path, capsys, monkeypatch, args, env, toml, expect
):
    """Refused before it listens (in this process: the exit code is the command's own)."""
    cmd = ["emulator", "--listen-ip", "127.0.0.1", "--listen-port", "0", *args]
    if toml is not None:
        path = tmp_path / "emulator.toml"
        path.write_text(toml)
        cmd += ["--config", str(path)]
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    code, _, stderr = morphling_here(capsys, *cmd)
    assert code == 2, stderr
    assert expect in stderr
    if toml is not None and "unknown key" in expect:
        assert "did you mean 'window'?" in stderr
    assert "listening" not in stderr


def test_sighup_rereads_the_device_tokens(procs: Procs, tmp_path):
    """A board given a secret after the emulator started joins once SIGHUP re-read the
    file; the boards already there stay."""
    tokens = tmp_path / "tokens"
    tokens.write_text("pi01 aaa\n")
    emulator, port = procs.emulator("--no-probe", "--device-tokens", str(tokens))
    procs.device(port, "pi01", "rpi4", "--token", "aaa")
    procs.wait_for(emulator, "device 0 (pi01) ready")
    tokens.write_text("pi01 aaa\npi02 bbb\n")
    emulator.signal(signal.SIGHUP)
    procs.wait_for(emulator, "1 added, 0 removed, 0 secrets changed")
    procs.device(port, "pi02", "rpi4", "--token", "bbb")
    procs.wait_for(emulator, "device 1 (pi02) ready")
    assert emulator.alive and "device 0 (pi01) lost" not in emulator.text()


async def test_emulator_killed_and_restarted_a_job_gets_an_error_and_devices_come_back(
    procs: Procs,
):
    """The emulator killed mid-run: the job's pending GEMMs fail at once with an error
    that says what happened (no hang); the emulator started again on its port gets its
    devices back by themselves, and a new job computes."""
    emulator, port = procs.emulator("--no-probe", "--block-size", "32", "--window", "2")
    for i in range(2):
        procs.device(port, f"dev-{i}")
    procs.wait_for(emulator, ") ready", 2)
    cases = gemm_cases(11)
    client = await AsyncClient.connect("127.0.0.1", port, name="cut-off")
    blocking = Client("127.0.0.1", port, name="cut-off-too")  # morphling run's client
    tasks = [asyncio.ensure_future(client.matmul(a, b, timeout=120)) for a, b in cases]
    await asyncio.wait_for(asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED), 60)
    emulator.signal(signal.SIGKILL)
    killed = time.monotonic()
    outcomes = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 30)
    errors = [o for o in outcomes if isinstance(o, BaseException)]
    assert errors, "every GEMM finished before the kill"
    assert time.monotonic() - killed < 10
    said = (
        "the emulator closed the connection without a goodbye",  # FIN, or a reset:
        "connection to the emulator lost",
    )  # (the kernel resets what had bytes unread)
    assert all(isinstance(e, EmulatorError) and e.code == "disconnected"
               and e.reason.startswith(said) for e in errors), errors[:3]  # fmt: skip
    await client.close()
    with pytest.raises(EmulatorError, match=r"the emulator closed the connection|connection lost"):
        await asyncio.to_thread(blocking.matmul, *cases[0], timeout=30)
    blocking.close()

    again = procs.start("emulator-again", "emulator", "--listen-port", str(port), "--no-probe")
    procs.wait_for(again, ") ready", 2, timeout=60)  # the devices reconnected by themselves
    with Client("127.0.0.1", port, name="after") as job:
        a, b = cases[0]
        check(job.matmul(a, b, timeout=30), a, b)


def test_status_and_metrics_of_a_running_emulator(procs: Procs, capsys):
    """``morphling status`` prints the fleet (a table, or --json) and the metrics port
    serves Prometheus text, from the same emulator process; a refused token or an
    emulator that cannot be reached is exit 2 with the reason; a metrics port in use is
    exit 2 naming it. (The commands run in this process: a fresh one costs seconds.)"""
    metrics_port = free_port()
    emulator, port = procs.emulator("--token", "t0k", "--metrics-port", str(metrics_port))
    procs.device(port, "pi01", "rpi4", "--token", "t0k")
    procs.wait_for(emulator, "device 0 (pi01) ready")
    server = ("--server", f"127.0.0.1:{port}", "--token", "t0k")
    with Client("127.0.0.1", port, token="t0k", name="status-job") as job:
        a = np.eye(64, dtype=np.float32)
        np.testing.assert_array_equal(job.matmul(a, a), a)
        code, shown, _ = morphling_here(capsys, "status", *server)
        assert code == 0
        code, as_json, _ = morphling_here(capsys, "status", *server, "--json")
    assert "1 devices, 1 jobs" in shown
    [row] = [line for line in shown.splitlines() if line.startswith("0 ")]
    assert re.match(r"0\s+pi01\s+127\.0\.0\.1:\d+\s+rpi4\s+idle\s+0\s+\d+\s+[\d.]+ ms", row)
    assert "GFLOP/s" in row
    status = json.loads(as_json)
    assert status["devices"][0]["completed"] >= 1 and status["tiles"]["returned"] >= 1
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as r:
        text = r.read().decode()
    assert 'morphling_devices{state="idle"} 1.0' in text
    assert re.search(r"^morphling_tiles_returned_total [1-9]", text, re.M)
    assert re.search(r"^morphling_virtual_clock_held_seconds_total \d", text, re.M)
    assert re.search(r"virtual time [\d.]+ s.*, held [\d.]+ s in all", shown)

    code, _, err = morphling_here(capsys, "status", "--server", f"127.0.0.1:{port}")
    assert code == 2 and "requires a token" in err
    code, _, err = morphling_here(capsys, "status", "--server", f"127.0.0.1:{free_port()}")
    assert code == 2 and "cannot reach" in err
    code, _, err = morphling_here(capsys, "emulator", "--listen-port", "0", "--metrics-port",
                                  str(metrics_port))  # fmt: skip
    assert code == 2 and f"cannot serve metrics on 127.0.0.1:{metrics_port}" in err


# -- jobs stay connected while idle ---------------------------------------------------------


async def test_idle_job_outlives_heartbeat_timeout(procs: Procs):
    """PROTOCOL.md: each side heartbeats when idle, so an idle job is not dropped."""
    emulator, port = procs.emulator(
        "--no-probe", "--heartbeat-s", "0.2", "--heartbeat-timeout-s", "1"
    )
    procs.device(port, "dev-0")
    procs.wait_for(emulator, "device 0 (dev-0) ready")
    client = await AsyncClient.connect("127.0.0.1", port, name="idle")
    try:
        a = np.eye(3, dtype=np.float32)
        await client.matmul(a, a, timeout=10)
        await asyncio.sleep(2.0)  # idle, as a job between steps: only heartbeats flow
        np.testing.assert_array_equal(await client.matmul(a, a, timeout=10), a)
    finally:
        await client.close()


@pytest.mark.parametrize(("stop", "code"), [(signal.SIGTERM, 0), (signal.SIGKILL, 1)])
def test_a_device_that_may_not_reconnect_exits_by_how_its_connection_ended(
    procs: Procs, stop: signal.Signals, code: int
):
    """With --no-reconnect an emulator that says goodbye (stopping: BYE) ends the device
    cleanly, but one that vanishes is a failure, as an unreachable one is."""
    emulator, port = procs.emulator("--no-probe")
    device = procs.device(port, "pi", "rpi4", "--no-reconnect")
    procs.wait_for(emulator, "device 0 (pi) ready")
    emulator.signal(stop)
    assert device.wait(timeout=30) == code, device.text()
    if code:
        assert f"ERROR morphling.devices.agent: pi: lost the connection to 127.0.0.1:{port}" in (
            device.text()
        )
