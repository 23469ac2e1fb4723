#!/usr/bin/env python3
"""Network benchmarks: each figure beside its anchor, measured in the same run.

Writes ``bench-results/net.json`` with three groups:

- ``gemm_rtt_64``: the round trip of a 64×64×64 float32 ``Client.matmul`` (job in
  this process → emulator process → one ``morphling device --threads 1`` process →
  back), beside three anchors: a raw blocking-socket 64-byte ping-pong (TCP_NODELAY,
  echo server in another process); the same ping-pong through a minimal uvloop relay
  process to a uvloop echo process, the job → emulator → device topology with
  nothing done on the way; and ``torch.distributed.rpc`` (TensorPipe, default
  options) running the same 64×64 @ 64×64 on a worker process. Microseconds per call.

  A fourth anchor, ``protocol_floor_us``, is the least this protocol costs in Python:
  the same request through two stand-in processes (uvloop, Morphling's codec) that
  only decode and re-encode the four frames (GEMM → TILE → TILE_RESULT → RESULT) and
  multiply with numpy: no handshake, state checks, scheduling or virtual time.
  ``ratio_vs_protocol_floor`` is what the emulation adds on top of it. On the 2-vCPU
  VM the targets were set on, the floor alone (225 µs with all processes on one CPU)
  is above both bounds (2.5× the relay, a third of torch RPC).

  The target is against the relay, not the direct ping-pong: each hop wakes another
  process, whose caches other processes have filled since it last ran, so on a
  small machine two hops alone cost several times one before any work is done (on
  the 2-vCPU VM this was set on: about 9 µs for the direct echo, 30 to 85 µs
  through the bare relay unpinned, 22 µs with all three processes on one CPU). The
  ratio to the direct ping-pong is reported for information.
- ``bulk_64mib``: 64 MiB from the emulator to a peer (a probe-role client's
  PROBE_PULL, from the request to the last byte), beside plain Python
  ``sendall`` / ``recv_into`` of 64 MiB over loopback between two processes (same
  request-to-last-byte timing) and iperf3 when it is installed. Gbit/s.
- ``fleet_memory``: RSS growth of an emulator process from 10 to 1,000 connected
  virtual devices (``morphling fleet`` processes), per device.

Measurements of a figure and its anchors alternate in paired blocks (ours,
anchor, ours, ...) so that load from other work on a shared machine hits all
alike; each block's median per-call time is taken, and the median of the blocks
is reported. TensorPipe's shared-memory transport busy-polls a core per process
even when idle, so the torch processes are stopped (SIGSTOP) outside their own
blocks, lest they slow down everything else measured here.

Every child process is started through this script's ``--child exec`` wrapper,
which makes the kernel kill it if this script dies, and is stopped in a
``finally`` on the way out, whatever happened.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import itertools
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

PING_BYTES = 64
BULK_BYTES = 64 << 20
FLEET_SMALL, FLEET_LARGE = 10, 1000
GEMM_DIM = 64
_PARENT_ENV = "MORPHLING_BENCH_PARENT"


# -- child roles (``bench_net.py --child ROLE ...``): light imports only -------------------


def _die_with_parent() -> None:
    """Ask the kernel to SIGKILL this process when the bench script exits (Linux)."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    parent = os.environ.get(_PARENT_ENV)
    if parent is not None and os.getppid() != int(parent):
        os._exit(1)  # the parent is already gone


def _listen() -> socket.socket:
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    print(server.getsockname()[1], flush=True)
    return server


def _recv_exact(conn: socket.socket, view: memoryview) -> bool:
    """Fill ``view`` from ``conn``; False at end of stream."""
    got = 0
    while got < len(view):
        n = conn.recv_into(view[got:])
        if n == 0:
            return False
        got += n
    return True


def child_echo() -> None:
    """Echo 64-byte messages back on one connection until it closes."""
    with _listen() as server:
        conn, _ = server.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buf = memoryview(bytearray(PING_BYTES))
    while _recv_exact(conn, buf):
        conn.sendall(buf)


def child_bulk() -> None:
    """For each 8-byte request ``n`` on one connection, send ``n`` bytes back."""
    payload = memoryview(bytearray(b"\xa5" * BULK_BYTES))
    request = memoryview(bytearray(8))
    with _listen() as server:
        conn, _ = server.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    while _recv_exact(conn, request):
        conn.sendall(payload[: int.from_bytes(request, "little")])


def child_torch(rank: int, port: int) -> None:
    """Rank 1 serves RPCs; rank 0 runs timed blocks of ``torch.mm`` RPCs on request.

    Rank 0 reads ``run CALLS WARM`` lines on stdin and answers each with a JSON
    list of per-call nanoseconds until its input ends. Neither calls
    ``rpc.shutdown()``, whose wait busy-polls a core: SIGTERM ends them.
    """
    import torch
    import torch.distributed.rpc as rpc

    torch.set_num_threads(1)
    options = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}")
    rpc.init_rpc(f"rank{rank}", rank=rank, world_size=2, rpc_backend_options=options)
    if rank == 0:
        gen = torch.Generator().manual_seed(0)
        a, b = (torch.randn(GEMM_DIM, GEMM_DIM, generator=gen) for _ in range(2))
        assert torch.allclose(rpc.rpc_sync("rank1", torch.mm, args=(a, b)), a @ b)
        print("ready", flush=True)
        for line in sys.stdin:
            words = line.split()
            if not words or words[0] != "run":
                break
            calls, warm = int(words[1]), int(words[2])
            times = []
            for i in range(warm + calls):
                start = time.perf_counter_ns()
                rpc.rpc_sync("rank1", torch.mm, args=(a, b))
                if i >= warm:
                    times.append(time.perf_counter_ns() - start)
            print(json.dumps(times), flush=True)
    else:
        signal.pause()
    os._exit(0)


def _nodelay(transport: Any) -> None:
    transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


async def _serve(factory: Callable[[], Any]) -> None:
    """Serve ``factory``'s protocols on a free loopback port, printed for the parent."""
    import asyncio

    server = await asyncio.get_running_loop().create_server(factory, "127.0.0.1", 0)
    print(server.sockets[0].getsockname()[1], flush=True)
    await server.serve_forever()


def child_relay_echo() -> None:
    """Echo what arrives on each connection, from a uvloop event loop (the device's place)."""
    import asyncio

    import uvloop

    class Echo(asyncio.Protocol):
        def connection_made(self, transport: Any) -> None:
            _nodelay(transport)
            self.transport = transport

        def data_received(self, data: bytes) -> None:
            self.transport.write(data)

    uvloop.run(_serve(Echo))


def child_relay(port: int) -> None:
    """Pass bytes both ways between a client and the echo server at ``port``, from a
    uvloop event loop: the emulator's place, doing nothing else."""
    import asyncio

    import uvloop

    class Forward(asyncio.Protocol):
        """One side of the relay: what it receives, ``peer`` sends on."""

        def __init__(self, peer: Forward | None = None) -> None:
            self.peer = peer

        def connection_made(self, transport: Any) -> None:
            _nodelay(transport)
            self.transport = transport

        def data_received(self, data: bytes) -> None:
            self.peer.transport.write(data)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        _, upstream = await loop.create_connection(Forward, "127.0.0.1", port)

        def accept() -> Forward:
            upstream.peer = Forward(upstream)
            return upstream.peer

        await _serve(accept)

    uvloop.run(main())


class _Frames:
    """An ``asyncio.BufferedProtocol`` that decodes frames with Morphling's codec and hands
    each message to ``handle(self, msg)``: the protocol floor's processes, nothing more."""

    def __init__(self, handle: Callable[[Any, Any], None]) -> None:
        from morphling.proxy.wire.codec import Decoder, encode

        self.decoder, self.encode, self.handle, self.peer = Decoder(), encode, handle, None

    def connection_made(self, transport: Any) -> None:
        _nodelay(transport)
        self.transport = transport

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.decoder.get_buffer(sizehint)

    def buffer_updated(self, nbytes: int) -> None:
        self.decoder.buffer_updated(nbytes)
        while (msg := self.decoder.next_message()) is not None:
            self.handle(self, msg)

    def send(self, msg: Any) -> None:
        self.transport.writelines(self.encode(msg))

    def connection_lost(self, exc: Exception | None) -> None:
        pass

    def eof_received(self) -> bool:
        return False


def child_floor_device() -> None:
    """The protocol floor's device: each TILE's C = A·B by numpy, sent back as TILE_RESULT."""

    import numpy as np
    import uvloop
    from morphling.proxy.wire.messages import TileResult

    def tile(conn: _Frames, msg: Any) -> None:
        a = np.frombuffer(msg.segments[0], np.float32).reshape(msg.m, msg.k)
        b = np.frombuffer(msg.segments[1], np.float32).reshape(msg.k, msg.n)
        start = time.perf_counter_ns()
        c = a @ b
        conn.send(TileResult(tile=msg.tile, compute_ns=time.perf_counter_ns() - start,
                             segments=(c,)))  # fmt: skip

    uvloop.run(_serve(lambda: _Frames(tile)))


def child_floor_emulator(port: int) -> None:
    """The protocol floor's emulator: each GEMM goes on to the device at ``port`` as one
    TILE with its operands, and the TILE_RESULT comes back as its RESULT; no handshake,
    scheduling, virtual time or checks beyond the codec's."""
    import asyncio

    import uvloop
    from morphling.proxy.wire.messages import Result, Tile

    def from_job(conn: _Frames, g: Any) -> None:
        conn.peer.send(Tile(tile=g.gemm, dtype=g.dtype, ta=g.ta, tb=g.tb, m=g.m, n=g.n, k=g.k,
                            lda=g.lda, ldb=g.ldb, segments=g.segments))  # fmt: skip

    def from_device(conn: _Frames, r: Any) -> None:
        conn.peer.send(Result(gemm=r.tile, tiles=1, segments=r.segments))

    async def main() -> None:
        loop = asyncio.get_running_loop()
        _, device = await loop.create_connection(lambda: _Frames(from_device), "127.0.0.1", port)

        def accept() -> _Frames:
            device.peer = job = _Frames(from_job)
            job.peer = device
            return job

        await _serve(accept)

    uvloop.run(main())


def child_main(argv: list[str]) -> int:
    role, rest = argv[0], argv[1:]
    _die_with_parent()
    if role == "exec":  # run a command that dies with us
        os.execv(rest[0], rest)
    if role == "echo":
        child_echo()
    elif role == "bulk":
        child_bulk()
    elif role == "relay-echo":
        child_relay_echo()
    elif role == "relay":
        child_relay(int(rest[0]))
    elif role == "floor-device":
        child_floor_device()
    elif role == "floor-emulator":
        child_floor_emulator(int(rest[0]))
    elif role == "torch":
        child_torch(int(rest[0]), int(rest[1]))
    else:
        raise SystemExit(f"unknown child role {role!r}")
    return 0


# -- child process management ----------------------------------------------------------


class ChildFailed(RuntimeError):
    pass


class Children:
    """The processes this benchmark started; ``close()`` stops every one of them."""

    def __init__(self, logdir: Path) -> None:
        self.logdir = logdir
        self.procs: list[tuple[str, subprocess.Popen]] = []

    def start(
        self, name: str, argv: list[str], *, pipes: bool = False, wrap: bool = True
    ) -> subprocess.Popen:
        """Start ``argv`` (stderr, and stdout unless ``pipes``, to ``logdir/name.log``).

        ``wrap`` runs it through ``--child exec`` so that it dies with this script
        (the ``--child`` roles see to that themselves).
        """
        log = open(self.logdir / f"{name}.log", "wb")  # noqa: SIM115 (the child owns it)
        env = {**os.environ, _PARENT_ENV: str(os.getpid())}
        try:
            proc = subprocess.Popen(
                [sys.executable, __file__, "--child", "exec", *argv] if wrap else argv,
                stdin=subprocess.PIPE if pipes else subprocess.DEVNULL,
                stdout=subprocess.PIPE if pipes else log,
                stderr=log,
                env=env,
                text=pipes,
                bufsize=1 if pipes else -1,
            )
        finally:
            log.close()
        self.procs.append((name, proc))
        return proc

    def start_child(self, name: str, role: str, *args: str, pipes: bool = True) -> subprocess.Popen:
        argv = [sys.executable, __file__, "--child", role, *args]
        return self.start(name, argv, pipes=pipes, wrap=False)

    def check(self) -> None:
        """Raise ``ChildFailed`` if a child has exited."""
        for name, proc in self.procs:
            if proc.poll() is not None:
                raise ChildFailed(f"{name} exited with status {proc.returncode}\n{self.tail(name)}")

    def tail(self, name: str, lines: int = 15) -> str:
        path = self.logdir / f"{name}.log"
        text = path.read_text(errors="replace") if path.exists() else ""
        return "\n".join(f"  {name}| {line}" for line in text.splitlines()[-lines:])

    def log(self, name: str) -> str:
        return (self.logdir / f"{name}.log").read_text(errors="replace")

    def stop(self, proc: subprocess.Popen, timeout: float = 10.0) -> None:
        """Stop ``proc`` (SIGTERM, then SIGKILL) and forget it."""
        self.procs = [(n, p) for n, p in self.procs if p is not proc]
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGCONT)  # a stopped process cannot act on SIGTERM
                proc.terminate()
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for stream in (proc.stdin, proc.stdout):
            if stream is not None:
                with contextlib.suppress(OSError):
                    stream.close()

    def stop_named(self, *names: str) -> None:
        for name, proc in list(self.procs):
            if name in names:
                self.stop(proc)

    def close(self) -> None:
        for proc in [p for _, p in self.procs]:  # everyone gets SIGTERM at once, then waits
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGCONT)
                    proc.terminate()
        for _, proc in reversed(self.procs):
            self.stop(proc)


def wait_for(what: str, ready: Callable[[], Any], children: Children, timeout: float) -> Any:
    """Poll ``ready()`` until it returns something truthy; fail if a child dies first."""
    deadline = time.monotonic() + timeout
    while True:
        value = ready()
        if value:
            return value
        children.check()
        if time.monotonic() > deadline:
            raise ChildFailed(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(0.05)


def read_line(proc: subprocess.Popen, what: str, children: Children, timeout: float) -> str:
    """The next stdout line of a piped child (polling, so a dead child is noticed)."""
    import selectors

    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        deadline = time.monotonic() + timeout
        while not sel.select(0.2):
            children.check()
            if time.monotonic() > deadline:
                raise ChildFailed(f"timed out after {timeout:g} s waiting for {what}")
    line = proc.stdout.readline()
    if not line:
        proc.wait(5)
        children.check()
        raise ChildFailed(f"{what}: the child closed its output")
    return line.strip()


def morphling_cmd(*args: str, log_level: str = "info") -> list[str]:
    return [sys.executable, "-m", "morphling", "--log-level", log_level, *args]


_LISTENING = re.compile(r"emulator listening on [\d.]+:(\d+)")
_READY = re.compile(r"device \d+ \(.*?\) ready")


def start_emulator(children: Children, name: str, *args: str) -> tuple[subprocess.Popen, int]:
    """An emulator on 127.0.0.1 and an ephemeral port; (process, port)."""
    cmd = morphling_cmd("emulator", "--listen-ip", "127.0.0.1", "--listen-port", "0", *args)
    proc = children.start(name, cmd)

    def port() -> int | None:
        match = _LISTENING.search(children.log(name))
        return int(match.group(1)) if match else None

    return proc, wait_for(f"{name} to listen", port, children, 60)


def ready_devices(children: Children, emulator: str) -> int:
    return len(_READY.findall(children.log(emulator)))


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmRSS in /proc/{pid}/status")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


# -- measuring -----------------------------------------------------------------------------


def block_ns(fn: Callable[[], object], calls: int, warm: int) -> float:
    """Median ns per call of ``calls`` calls of ``fn``, after ``warm`` uncounted ones."""
    for _ in range(warm):
        fn()
    times = []
    for _ in range(calls):
        start = time.perf_counter_ns()
        fn()
        times.append(time.perf_counter_ns() - start)
    return statistics.median(times)


class TorchRpc:
    """The two torch RPC processes; stopped except while their block runs."""

    def __init__(self, children: Children) -> None:
        self.children = children
        for attempt in range(3):  # Gloo's rendezvous on a just-freed port can race
            port = str(free_port())
            self.worker = children.start_child("torch-rank1", "torch", "1", port, pipes=False)
            self.master = children.start_child("torch-rank0", "torch", "0", port)
            try:
                read_line(self.master, "torch RPC to start", children, 120)
                break
            except ChildFailed:
                if attempt == 2:
                    raise
                children.stop(self.master)
                children.stop(self.worker)
        self.pause()

    def _signal(self, sig: int) -> None:
        for proc in (self.master, self.worker):
            proc.send_signal(sig)

    def pause(self) -> None:
        self._signal(signal.SIGSTOP)

    def block_ns(self, calls: int, warm: int) -> float:
        self._signal(signal.SIGCONT)
        try:
            self.master.stdin.write(f"run {calls} {warm}\n")
            self.master.stdin.flush()
            times = json.loads(read_line(self.master, "a torch RPC block", self.children, 120))
        finally:
            self.pause()
        return statistics.median(times)


def floor_matmul(sock: socket.socket, a: Any, b: Any) -> Callable[[], Any]:
    """``a @ b`` through the protocol floor's emulator on ``sock``, as ``Client.matmul``
    does it: the same request, encoding, decoding and result, with no handshake."""
    from morphling.proxy.job.client import gemm_request, result_array
    from morphling.proxy.wire.codec import Decoder, encode

    decoder, ids = Decoder(), itertools.count(1)

    def once() -> Any:
        request, shape = gemm_request(next(ids), a, b)
        buffers = encode(request)
        if sock.sendmsg(buffers) != sum(map(len, buffers)):  # a blocking socket: all, or
            raise ChildFailed("a short send to the protocol floor's emulator")  # a signal
        while (msg := decoder.next_message()) is None:
            nbytes = sock.recv_into(decoder.get_buffer())
            if nbytes == 0:
                raise ChildFailed("the protocol floor's emulator closed the connection")
            decoder.buffer_updated(nbytes)
        return result_array(request, msg, shape, None)

    return once


def bench_gemm_rtt(children: Children, port: int, reps: int, bar: Any) -> dict:
    import numpy as np
    from morphling.proxy.job.client import Client

    calls, warm = 200, 20
    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal((GEMM_DIM, GEMM_DIM)).astype(np.float32) for _ in range(2))
    echo = children.start_child("echo-server", "echo")
    relay_echo = children.start_child("relay-echo", "relay-echo")
    relay_to = read_line(relay_echo, "the relay's echo server's port", children, 30)
    relay = children.start_child("relay", "relay", relay_to)
    floor_device = children.start_child("floor-device", "floor-device")
    floor_to = read_line(floor_device, "the protocol floor's device's port", children, 30)
    floor_emulator = children.start_child("floor-emulator", "floor-emulator", floor_to)
    bar.set_description("gemm_rtt_64: starting torch RPC")
    torch_rpc = TorchRpc(children)
    direct = connect(int(read_line(echo, "the echo server's port", children, 30)))
    relayed = connect(int(read_line(relay, "the relay's port", children, 30)))
    floored = connect(int(read_line(floor_emulator, "the protocol floor's port", children, 30)))
    floor_once = floor_matmul(floored, a, b)
    buf = memoryview(bytearray(PING_BYTES))

    def pingpong(sock: socket.socket) -> Callable[[], None]:
        def once() -> None:
            sock.sendall(buf)
            if not _recv_exact(sock, buf):
                raise ChildFailed("an echo server closed the connection")

        return once

    bar.set_description("gemm_rtt_64")
    ours, sock, via_relay, floor, rpc = [], [], [], [], []
    with direct, relayed, floored, Client("127.0.0.1", port, name="bench-net",
                                          block=GEMM_DIM) as client:  # fmt: skip
        for c in (client.matmul(a, b, timeout=30), floor_once()):
            assert np.allclose(c, a @ b, rtol=1e-4, atol=1e-4), "wrong GEMM result"
        for _ in range(reps):
            ours.append(block_ns(lambda: client.matmul(a, b, timeout=30), calls, warm))
            sock.append(block_ns(pingpong(direct), calls, warm))
            via_relay.append(block_ns(pingpong(relayed), calls, warm))
            floor.append(block_ns(floor_once, calls, warm))
            rpc.append(torch_rpc.block_ns(calls, warm))
            bar.update()
    morphling_us = statistics.median(ours) / 1e3
    socket_us = statistics.median(sock) / 1e3
    relay_us = statistics.median(via_relay) / 1e3
    torch_us = statistics.median(rpc) / 1e3
    floor_us = statistics.median(floor) / 1e3
    ratio, speedup = morphling_us / relay_us, torch_us / morphling_us
    return {
        "morphling_us": round(morphling_us, 1),
        "socket_pingpong_us": round(socket_us, 1),
        "relay_pingpong_us": round(relay_us, 1),
        "torch_rpc_us": round(torch_us, 1),
        "protocol_floor_us": round(floor_us, 1),
        "ratio_vs_relay": round(ratio, 3),
        "ratio_vs_pingpong": round(morphling_us / socket_us, 3),
        "speedup_vs_torch_rpc": round(speedup, 3),
        "ratio_vs_protocol_floor": round(morphling_us / floor_us, 3),
        "target_ratio_vs_relay_max": 2.5,
        "target_speedup_vs_torch_rpc_min": 3.0,
        "met": ratio <= 2.5 and speedup >= 3.0,
    }


def iperf3_gbps(children: Children) -> tuple[float | None, str]:
    """iperf3's loopback throughput (Gbit/s, 5 s, one stream), or None and why not."""
    exe = shutil.which("iperf3")
    if exe is None:
        return None, "iperf3 is not installed"
    port = str(free_port())
    server = children.start("iperf3-server", [exe, "-s", "-1", "-B", "127.0.0.1", "-p", port])
    time.sleep(0.5)
    try:
        out = subprocess.run([exe, "-c", "127.0.0.1", "-p", port, "-t", "5", "-J"],
                             capture_output=True, text=True, timeout=60)  # fmt: skip
        report = json.loads(out.stdout)
        bps = report["end"]["sum_received"]["bits_per_second"]
        return round(bps / 1e9, 2), "iperf3 -c 127.0.0.1 -t 5, one stream, receiver side"
    except (subprocess.SubprocessError, ValueError, KeyError) as exc:
        return None, f"iperf3 failed: {exc}"
    finally:
        children.stop(server)


def bench_bulk(children: Children, port: int, reps: int, bar: Any) -> dict:
    import uvloop
    from morphling.devices.bench import ProbeClient

    transfers = 3
    bar.set_description("bulk_64mib")
    server = children.start_child("bulk-server", "bulk")
    sock = connect(int(read_line(server, "the bulk server's port", children, 30)))
    dest = memoryview(bytearray(b"\0" * BULK_BYTES))
    request = BULK_BYTES.to_bytes(8, "little")

    def socket_transfer() -> None:
        sock.sendall(request)
        if not _recv_exact(sock, dest):
            raise ChildFailed("the bulk server closed the connection")

    loop = uvloop.new_event_loop()
    try:
        probe = loop.run_until_complete(ProbeClient.connect("127.0.0.1", port, timeout=60))

        def morphling_transfer() -> None:
            loop.run_until_complete(probe.pull(BULK_BYTES))

        ours, anchor = [], []
        with sock:
            for _ in range(reps):
                ours.append(block_ns(morphling_transfer, transfers, 1))
                anchor.append(block_ns(socket_transfer, transfers, 1))
                bar.update()
        loop.run_until_complete(probe.close())
    finally:
        loop.close()
    gbps = BULK_BYTES * 8 / statistics.median(ours)
    socket_gbps = BULK_BYTES * 8 / statistics.median(anchor)
    bar.set_description("bulk_64mib: iperf3")
    iperf, note = iperf3_gbps(children)
    return {
        "method": "PROBE_PULL of 64 MiB by a probe-role client: emulator → client, timed from "
        "the request to the last byte; socket_gbps is timed the same way (8-byte request, "
        "64 MiB sendall from another process, recv_into a preallocated buffer)",
        "morphling_gbps": round(gbps, 2),
        "socket_gbps": round(socket_gbps, 2),
        "iperf3_gbps": iperf,
        "note": note,
        "ratio": round(gbps / socket_gbps, 3),
        "target_ratio_min": 0.8,
        "met": gbps >= 0.8 * socket_gbps,
    }


def settled_rss_mib(pid: int, samples: int = 5) -> float:
    """Median VmRSS (MiB) of a few readings, once it stopped moving."""
    previous = -1
    for _ in range(50):  # up to 5 s for allocations after the last registration to settle
        current = rss_kib(pid)
        if current == previous:
            break
        previous = current
        time.sleep(0.1)
    readings = []
    for _ in range(samples):
        readings.append(rss_kib(pid))
        time.sleep(0.1)
    return statistics.median(readings) / 1024


def bench_fleet_memory(children: Children, bar: Any) -> dict:
    bar.set_description("fleet_memory: 10 devices")
    emulator, port = start_emulator(children, "fleet-emulator", "--no-probe")
    server = f"127.0.0.1:{port}"

    def fleet(name: str, count: int) -> None:
        children.start(name, morphling_cmd("fleet", "--server", server, "--devices", str(count),
                                           "--threads", "1", log_level="warning"))  # fmt: skip

    def registered(count: int) -> Callable[[], bool]:
        return lambda: ready_devices(children, "fleet-emulator") >= count

    fleet("fleet-10", FLEET_SMALL)
    wait_for(f"{FLEET_SMALL} devices", registered(FLEET_SMALL), children, 120)
    rss_small = settled_rss_mib(emulator.pid)
    bar.update()
    bar.set_description("fleet_memory: 1000 devices")
    fleet("fleet-990", FLEET_LARGE - FLEET_SMALL)
    wait_for(f"{FLEET_LARGE} devices", registered(FLEET_LARGE), children, 300)
    rss_large = settled_rss_mib(emulator.pid)
    bar.update()
    per_device = (rss_large - rss_small) * 1024 / (FLEET_LARGE - FLEET_SMALL)
    return {
        "per_device_kib": round(per_device, 1),
        "rss_10_mib": round(rss_small, 1),
        "rss_1000_mib": round(rss_large, 1),
        "target_kib_max": 64,
        "met": per_device <= 64,
    }


def meta(args: argparse.Namespace) -> dict:
    from benchlib import run_meta

    return run_meta(
        args.reps,
        cpus=os.cpu_count(),
        iperf3=shutil.which("iperf3") or "not installed",
        pinned_cpus=sorted(args.cpus) if args.cpus else "no (scheduler's choice)",
    )


@contextlib.contextmanager
def sigterm_unwinds() -> Iterator[None]:
    """Turn SIGTERM into SystemExit so that ``finally`` blocks stop the children."""

    def handler(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def run(args: argparse.Namespace) -> dict:
    from tqdm import tqdm

    if args.cpus:
        os.sched_setaffinity(0, args.cpus)  # inherited by every child process
    with (
        sigterm_unwinds(),
        tempfile.TemporaryDirectory(prefix="bench-net-") as logdir,
        tqdm(total=2 * args.reps + 2, desc="net benchmarks", unit="rep") as bar,
    ):
        children = Children(Path(logdir))
        try:
            results = {}
            _, port = start_emulator(children, "emulator", "--no-probe", "--block-size",
                                     str(GEMM_DIM))  # fmt: skip
            children.start("device", morphling_cmd(
                "device", "--server", f"127.0.0.1:{port}", "--threads", "1", "--name",
                "bench-device", log_level="warning"))  # fmt: skip
            wait_for("the device", lambda: ready_devices(children, "emulator") >= 1, children, 60)
            results["gemm_rtt_64"] = bench_gemm_rtt(children, port, args.reps, bar)
            results["bulk_64mib"] = bench_bulk(children, port, args.reps, bar)
            children.stop_named("torch-rank0", "torch-rank1", "echo-server", "relay",
                                "relay-echo", "floor-emulator", "floor-device", "bulk-server",
                                "device", "emulator")  # fmt: skip
            results["fleet_memory"] = bench_fleet_memory(children, bar)
        except ChildFailed as exc:
            raise SystemExit(f"bench_net: {exc}") from None
        finally:
            children.close()
    results["meta"] = meta(args)
    return results


def _cpu_list(text: str) -> set[int]:
    try:
        cpus = {int(c) for c in text.split(",") if c.strip()}
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a list of CPU numbers") from None
    if not cpus or not cpus <= os.sched_getaffinity(0):
        raise argparse.ArgumentTypeError(f"{text!r}: choose from {sorted(os.sched_getaffinity(0))}")
    return cpus


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        return child_main(argv[1:])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=15, help="paired repetitions (>= 5)")
    parser.add_argument("--output", type=Path, default=Path("bench-results/net.json"))
    parser.add_argument("--cpus", type=_cpu_list, default=None, metavar="LIST",
                        help="pin this script and every process it starts to these CPUs "
                        "(e.g. 0 or 0,1); default: no pinning")  # fmt: skip
    args = parser.parse_args(argv)
    if args.reps < 5:
        parser.error("--reps must be at least 5 (medians of at least 5 repetitions)")
    from benchlib import write_results

    write_results(run(args), args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
