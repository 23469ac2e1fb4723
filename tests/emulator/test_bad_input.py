"""Bad input to a live server: malformed bytes, frames and headers, messages outside a
peer's role, jobs that send without reading, devices that lie. Each gets an ERROR
naming the problem (or is held back) and everyone else carries on."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import re
import socket
import threading
import time
from typing import Any

import numpy as np
import pytest
from morphling.devices.models.profiles import BUILTIN
from morphling.kernels import WorkerPool
from morphling.proxy.emulator.peer import PeerConnection
from morphling.proxy.job.client import Client, EmulatorError
from morphling.proxy.wire import codec
from morphling.proxy.wire.messages import (
    Bye,
    Error,
    Gemm,
    Greeting,
    Heartbeat,
    Hello,
    MsgType,
    Open,
    ProbeEcho,
    Result,
    Step,
    TileResult,
    Welcome,
)
from raw_peer import RawPeer, blocking_exchange, prefix, raw_frame, tile_operand
from serving import (
    TIMEOUT,
    Fleet,
    GatedCpuBackend,
    assert_gemm_close,
    check_serving,
    gemm_request,
    make_operand,
    reference,
    result_array,
    rss_bytes,
    serving_fleet,
    wait_for_condition,
)


def _gemm_frame(size: int = 4) -> bytes:
    a = np.ones((size, size), np.float32)
    return codec.encode_bytes(gemm_request(a, a))


_ONE_SEG = {"seg": [["uint8", [4], 4]]}

BAD_PREFIXES = {  # sent before any HELLO: (bytes, the ERROR code)
    "garbage": (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + bytes(range(40)), "bad_magic"),
    "bad_version": (
        prefix(MsgType.HELLO, 8, 0, version=codec.VERSION + 1) + b"\x80" * 8,
        "bad_version",
    ),
    "unknown_type": (prefix(99, 1, 0) + b"\x80", "unknown_type"),
    "zero_header": (prefix(MsgType.HELLO, 0, 0), "too_large"),
    "huge_header": (prefix(MsgType.HELLO, codec.MAX_HEADER + 1, 0), "too_large"),
    "huge_payload": (prefix(MsgType.HELLO, 8, 1 << 40), "too_large"),
    "header_not_a_map": (raw_frame(MsgType.HELLO, [1]), "bad_frame"),
    "tile_result_first": (
        codec.encode_bytes(TileResult(tile=1, compute_ns=1, segments=(np.zeros(0, np.float32),))),
        "out_of_order",
    ),
    "gemm_first": (_gemm_frame(0), "out_of_order"),
    "hello_bad_role": (codec.encode_bytes(Hello(role="admin")), "bad_hello"),
    "hello_bad_profile": (
        codec.encode_bytes(Hello(role="device", profile={"name": "x"})),
        "bad_hello",
    ),
    "hello_wrong_field_type": (raw_frame(MsgType.HELLO, {"role": 7}), "bad_header"),
    "hello_unknown_field": (raw_frame(MsgType.HELLO, {"role": "job", "x": 1}), "bad_header"),
}


@pytest.mark.parametrize("case", sorted(BAD_PREFIXES))
async def test_bad_bytes_get_an_error_and_the_server_carries_on(fleet, case):
    data, code = BAD_PREFIXES[case]
    f, client = await serving_fleet(fleet)
    rng = np.random.default_rng(10)
    a = rng.standard_normal((3, 64, 40), dtype=np.float32)
    b = rng.standard_normal((40, 64), dtype=np.float32)
    running = asyncio.create_task(client.matmul(a, b, timeout=TIMEOUT))
    stats_before, rss_before = f.emu.pool.stats(), rss_bytes()

    messages, eof, _ = await asyncio.to_thread(blocking_exchange, f.host, f.port, data)

    assert [type(m) for m in messages] == [Greeting, Error], messages
    assert messages[1].code == code, messages[1]
    assert eof, "the server should close after its ERROR"
    if case == "huge_payload":  # refused from the prefix: nothing was allocated for it
        stats = f.emu.pool.stats()
        assert stats.leased_bytes <= stats_before.leased_bytes + (4 << 20)
        assert stats.allocations <= stats_before.allocations + 8
        assert rss_bytes() - rss_before < 64 << 20
    assert_gemm_close(await running, a, b, f"GEMM in flight during {case}")
    await check_serving(client)
    await wait_for_condition(lambda: len(f.emu.peers) == 3, 5, "the bad peer to be dropped")


async def test_payload_before_hello_is_refused_without_allocating(fleet):
    """A peer that has not said HELLO (here: not authenticated) cannot make the server
    commit memory by declaring a payload; HELLO itself carries none."""
    f = await fleet(token="s3cret", hello_timeout_s=2.0)
    await f.add_device(token="s3cret")
    client = await f.client(token="s3cret")
    nbytes = 64 << 20
    for msg_type, header in ((MsgType.HELLO, {"role": "job"}), (MsgType.TILE_RESULT, {"tile": 1})):
        before = f.emu.pool.stats().leased_bytes
        raw = await f.raw_peer()
        assert isinstance(await raw.recv(), Greeting)
        header = {**header, "seg": [["uint8", [nbytes], nbytes]]}
        raw.send_bytes(raw_frame(msg_type, header, nbytes))  # ...and never the payload
        await raw.writer.drain()
        msg = await raw.recv(timeout=1.0)
        leased = f.emu.pool.stats().leased_bytes - before
        assert leased < 1 << 20, f"{leased} bytes leased for a peer that has not said HELLO"
        assert isinstance(msg, Error) and msg.code in ("too_large", "out_of_order"), msg
        assert await raw.recv() is None
    await check_serving(client)


async def test_bad_frame_after_hello_is_refused(fleet):
    f, client = await serving_fleet(fleet, max_payload_bytes=1 << 24)
    stats_before, rss_before = f.emu.pool.stats(), rss_bytes()
    for data, code in (
        (prefix(MsgType.OPEN, 4, 0) + b"\xc1\xc1\xc1\xc1", "bad_frame"),  # invalid msgpack
        (codec.encode_bytes(Welcome(peer_id=1, heartbeat_s=1.0)), "out_of_order"),
        (codec.encode_bytes(Open(block=-1)), "bad_open"),
        (raw_frame(MsgType.GEMM, {"seg": [["uint8", [4], 4]]}, 5) + bytes(5), "bad_frame"),
        (raw_frame(MsgType.GEMM, {"seg": [["int7", [4], 4]]}, 4) + bytes(4), "bad_frame"),
        (raw_frame(MsgType.GEMM, {"seg": [["uint8", [-4], 4]]}, 4) + bytes(4), "bad_frame"),
        (raw_frame(MsgType.GEMM, {"seg": "x"}, 0), "bad_frame"),
        (raw_frame(MsgType.GEMM, _ONE_SEG, 4) + bytes(4), "bad_header"),  # GEMM has two
        (raw_frame(MsgType.OPEN, _ONE_SEG, 4) + bytes(4), ("bad_frame", "bad_header")),
        (prefix(MsgType.GEMM, 8, (1 << 24) + 1), "too_large"),  # past max_payload_bytes
        (prefix(MsgType.GEMM, 8, 1 << 62), "too_large"),
    ):
        raw = await f.raw_peer()
        await raw.hello("job", name="raw")
        raw.send_bytes(data)
        await raw.expect_error(code)
    stats = f.emu.pool.stats()
    assert stats.leased_bytes <= stats_before.leased_bytes + (4 << 20)
    assert rss_bytes() - rss_before < 64 << 20
    await check_serving(client)


EIGHTS = {"m": 8, "n": 8, "k": 8, "lda": 8, "ldb": 8}  # an 8×8×8 product, row-major
TWOS = {"m": 2, "n": 2, "k": 2, "lda": 2, "ldb": 2}
GEMM_LIES = {
    # name: (Gemm fields, a elements, b elements, text the reason must contain)
    "a_too_short": (EIGHTS, 63, 64, "operand a"),
    "b_too_short": (EIGHTS, 64, 56, "operand b"),
    "ld_lies": ({**EIGHTS, "ldb": 9}, 64, 64, "operand b"),
    "ld_too_small": ({**EIGHTS, "lda": 4}, 64, 64, "lda=4"),
    "stride_lies": ({**EIGHTS, "batch": 2, "stride_a": 64, "stride_b": 64}, 128, 64, "operand b"),
    "negative_stride": ({**TWOS, "batch": 2, "stride_a": -4}, 8, 4, "stride_a"),
    "transposed_lies": (
        {"m": 8, "n": 4, "k": 2, "lda": 8, "ldb": 4, "ta": True},
        15,
        8,
        "operand a",
    ),
    "negative_k": ({**TWOS, "k": -1}, 4, 4, "k=-1"),
    "zero_batch": ({**TWOS, "batch": 0}, 4, 4, "batch=0"),
    "dtype": ({**TWOS, "dtype": "uint8"}, 4, 4, "dtype"),
    "output_too_big": (
        {"m": 1 << 20, "n": 1 << 20, "k": 0, "lda": 1, "ldb": 1 << 20},
        0,
        0,
        "exceeds max_payload_bytes",
    ),
    # where the operands are: fields that contradict each other or the segments
    "handed_yet_in_the_frame": ({**EIGHTS, "local": True}, 64, 64, "local: operand a was handed"),
    "slab_offset_negative": ({**EIGHTS, "slab_a": -5}, 0, 64, "slab_a=-5: expected a byte offset"),
    "ref_not_offset_and_version": ({**EIGHTS, "ref_b": [0, 1, 2]}, 64, 0, "ref_b=[0, 1, 2]"),
}


@pytest.mark.parametrize("case", sorted(GEMM_LIES))
async def test_gemm_header_that_lies_is_refused(fleet, case):
    fields, a_len, b_len, text = GEMM_LIES[case]
    f, client = await serving_fleet(fleet)
    raw = await f.raw_peer()
    await raw.hello("job", name="liar")
    raw.send(Open(name="liar"))
    stats_before = f.emu.pool.stats()
    request = Gemm(
        **{"gemm": 1, "dtype": "float32", "ta": False, "tb": False, **fields},
        segments=(np.ones(a_len, np.float32), np.ones(b_len, np.float32)),
    )
    raw.send(request)
    error = await raw.expect_error("bad_gemm")
    assert text in error.reason, error.reason
    assert not f.emu.scheduler.queued, "no tile was queued"
    if case == "output_too_big":
        assert f.emu.pool.stats().leased_bytes <= stats_before.leased_bytes + (1 << 20)
    await check_serving(client)


BAD_SPLITS = {  # name: (the message's fields, the reason's text)
    "sum_differs": (
        {"host_ns": 10, "host_split": {"optimizer": 3}},
        "sums to 3 ns, not host_ns=10",
    ),
    "negative": ({"host_ns": 0, "host_split": {"other": -1, "gemm": 1}}, "'other'"),
    "not_an_int": ({"host_ns": 2, "host_split": {"other": 1.5}}, "is not an integer"),
    "empty_name": ({"host_ns": 5, "host_split": {"": 5}}, "is not a non-empty string"),
    "too_many": (
        {"host_ns": 33, "host_split": {f"c{i}": 1 for i in range(33)}},
        "33 op classes, at most 32",
    ),
    # host_alt: each profile's own host_split (a rank that others replay)
    "alt_not_a_split": ({"host_alt": {"rpi5": 3}}, "is not a profile's name and its host_split"),
    "alt_negative": ({"host_alt": {"rpi5": {"other": -1}}}, "-1 is not an integer >= 0"),
    "alt_too_many": (
        {"host_alt": {f"p{i}": {"other": 1} for i in range(17)}},
        "17 profiles, at most 16",
    ),
}


@pytest.mark.parametrize("kind", ["GEMM", "STEP"])
@pytest.mark.parametrize("case", sorted(BAD_SPLITS))
async def test_a_bad_host_split_is_refused_naming_the_field(fleet, case, kind):
    """A job's op classes of its host time that are not op class → ns summing to host_ns:
    ERROR bad_header naming the field, and the emulator serves the others."""
    fields, text = BAD_SPLITS[case]
    f, client = await serving_fleet(fleet)
    raw = await f.raw_peer()
    await raw.hello("job", name="splitter")
    raw.send(Open(name="splitter"))
    a = np.ones((4, 4), np.float32)
    request = gemm_request(a, a)
    raw.send(dataclasses.replace(request, **fields) if kind == "GEMM" else Step(step=1, **fields))
    error = await raw.expect_error("bad_header")
    field = "host_alt" if case.startswith("alt") else "host_split"
    assert f"{kind}.{field}" in error.reason and text in error.reason, error.reason
    await check_serving(client)


async def test_duplicate_gemm_id_is_refused(fleet):
    f = await fleet()  # no devices: the first GEMM stays in flight
    raw = await f.raw_peer()
    await raw.hello("job", name="dup")
    raw.send(Open())
    a = np.ones((4, 4), np.float32)
    request = gemm_request(a, a)
    raw.send(request)
    raw.send(request)
    error = await raw.expect_error("bad_gemm")
    assert "already in flight" in error.reason
    await wait_for_condition(lambda: not f.emu.scheduler.queued, 5, "its tiles to be dropped")


def _empty_gemm(gemm: int, rows: int) -> Gemm:
    """rows × 10 tiles of 1×1 at block 1, with k = 0: no operand bytes."""
    return Gemm(
        gemm=gemm,
        dtype="float32",
        ta=False,
        tb=False,
        m=rows,
        n=10,
        k=0,
        lda=1,
        ldb=10,
        segments=(b"", b""),
    )


def _server_end(f: Fleet, peer_id: int) -> PeerConnection:
    """The emulator's connection to the job (or probe peer) it welcomed as ``peer_id``."""
    return next(p for p in f.emu.peers if p.job is not None and p.job.id == peer_id)


async def test_a_job_waits_while_its_gemms_in_flight_hold_max_job_tiles(fleet):
    """Past ``max_job_tiles`` tiles in flight the emulator reads no more of the job's
    requests (they wait, nothing is lost) until RESULTs bring it back below. A GEMM that
    alone has more is refused. Waiting is not silence: the job is not dropped."""
    f = await fleet(max_job_tiles=100, heartbeat_s=0.1, heartbeat_timeout_s=1.0)
    alone = await f.raw_peer()
    await alone.hello("job", name="one-too-many")
    alone.send(Open(block=1))
    alone.send(_empty_gemm(1, 11))
    error = await alone.expect_error("bad_gemm")
    assert "110 tiles" in error.reason and "max_job_tiles=100" in error.reason

    job = await f.raw_peer()
    welcome = await job.hello("job", name="pipelined")
    job.send(Open(block=1))
    for gemm in (1, 2, 3):  # 60 tiles each; no device yet, so none finishes
        job.send(_empty_gemm(gemm, 6))
    end = _server_end(f, welcome.peer_id)
    await wait_for_condition(lambda: not end.reading, 5, "the emulator to stop reading")
    await asyncio.sleep(1.5)  # past heartbeat_timeout_s
    assert end.open and end.job.tiles_in_flight == 120 and sorted(end.job.gemms) == [1, 2]
    job.send(Heartbeat())  # read once the emulator reads again, as a client's would be
    await f.add_device()
    results = [await job.recv_skipping_heartbeats(timeout=TIMEOUT) for _ in range(3)]
    assert sorted(r.gemm for r in results) == [1, 2, 3] and {r.tiles for r in results} == {60}
    assert end.job.tiles_in_flight == 0 and end.reading
    await check_serving(await f.client())


async def test_a_job_waits_while_its_gemms_in_flight_hold_max_job_bytes(fleet):
    """The operands the emulator received count, as well as the outputs it holds."""
    f = await fleet(max_job_bytes=1 << 20)
    job = await f.raw_peer()
    welcome = await job.hello("job", name="wide")
    job.send(Open())
    k = 1 << 16  # 1×k times k×1: 512 KiB of operands for a 4-byte C
    for gemm in (1, 2, 3):
        a, b = np.ones((1, k), np.float32), np.full((k, 1), gemm, np.float32)
        job.send(dataclasses.replace(gemm_request(a, b), gemm=gemm))
    end = _server_end(f, welcome.peer_id)
    await wait_for_condition(lambda: not end.reading, 5, "the emulator to stop reading")
    assert sorted(end.job.gemms) == [1, 2] and end.job.bytes_in_flight == 2 * (8 * k + 4)
    await f.add_device()
    results = [await job.recv_skipping_heartbeats(timeout=TIMEOUT) for _ in range(3)]
    assert {r.gemm: np.frombuffer(r.segments[0], np.float32)[0] for r in results} == {
        1: k,
        2: 2 * k,
        3: 3 * k,
    }
    assert end.job.bytes_in_flight == 0


async def test_the_blocking_client_reads_replies_while_its_send_waits(fleet):
    """A GEMM that timed out leaves its RESULT (32 MiB: more than the kernel's socket
    buffers hold) unread, past the high-water mark: the emulator reads no more from the
    job. The next GEMM's 32 MiB of operands cannot all fit in the socket buffers either, so
    the client's send must read that RESULT while it waits, or both sides would wait on
    each other (until the job was dropped)."""
    f = await fleet(high_water_bytes=64 << 10, block_size=256, heartbeat_timeout_s=3.0)
    rng = np.random.default_rng(31)
    stale = rng.standard_normal((2048, 8), dtype=np.float32)
    a = rng.standard_normal((1024, 4096), dtype=np.float32)
    b = rng.standard_normal((4096, 1024), dtype=np.float32)

    def job() -> np.ndarray:
        with Client(f.host, f.port, name="patient", share_memory=False) as client:
            with pytest.raises(TimeoutError):
                client.matmul(np.vstack([stale, stale]), stale.T, timeout=0.2)  # no device
            assert added.wait(10)
            end = _server_end(f, client.job_id)
            deadline = time.monotonic() + 10
            while end.reading and time.monotonic() < deadline:
                time.sleep(0.01)  # until its RESULT is queued, unread
            assert not end.reading, "the emulator still reads the job"
            return client.matmul(a, b, timeout=60)

    added = threading.Event()
    running = asyncio.create_task(asyncio.to_thread(job))
    await asyncio.sleep(0.5)
    await f.add_device()
    added.set()
    c = await asyncio.wait_for(running, 90)
    np.testing.assert_allclose(c, reference(a, b), rtol=1e-3, atol=1e-3)


async def test_a_send_cut_short_leaves_the_blocking_client_closed_not_stuck(fleet):
    """Ctrl-C in the middle of a large request: what went out is part of a frame, so the
    connection is given up at once (``close`` does not wait 30 s for a CLOSE that cannot
    come, and the next call fails instead of hanging)."""
    f = await fleet()
    await f.add_device()
    a = np.ones((2048, 4096), np.float32)  # 32 MiB: more than one send takes

    def job() -> tuple[EmulatorError | None, float, str]:
        client = Client(f.host, f.port, name="interrupted", share_memory=False)

        channel = client._channel
        wait = channel._await_room

        def interrupted() -> None:
            channel._await_room = wait  # once: a second Ctrl-C would stop the test run
            raise KeyboardInterrupt

        channel._await_room = interrupted  # as if Ctrl-C came while the send waited
        with pytest.raises(KeyboardInterrupt):
            client.matmul(a, a[:1].T, timeout=30)
        start = time.monotonic()
        client.close()
        closing = time.monotonic() - start
        with pytest.raises(EmulatorError) as info:
            client.matmul(a[:4], a[:1].T, timeout=30)
        return client.error, closing, info.value.code

    error, closing, code = await asyncio.wait_for(asyncio.to_thread(job), 60)
    assert error is not None and "cut off" in error.reason
    assert closing < 2.0 and code == "disconnected"
    await check_serving(await f.client())


async def test_the_blocking_client_gives_up_on_a_silent_emulator():
    """An emulator heartbeats a quiet peer; one that says nothing for three periods (a
    SIGSTOPped process, a host gone without a FIN) is given up, as ``AsyncClient`` does,
    instead of waiting for ever."""

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(codec.encode_bytes(Greeting(version=1, nonce=bytes(16), auth=False)))
        await reader.read(1 << 16)  # HELLO
        writer.write(codec.encode_bytes(Welcome(peer_id=1, heartbeat_s=0.2)))
        while await reader.read(1 << 20):  # then reads everything and answers nothing
            pass

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]

    def job() -> tuple[str, float]:
        with Client("127.0.0.1", port, name="patient", share_memory=False) as client:
            start = time.monotonic()
            with pytest.raises(EmulatorError) as info:
                client.matmul(np.ones((8, 8), np.float32), np.ones((8, 8), np.float32))
            return info.value.code, time.monotonic() - start

    try:
        code, waited = await asyncio.wait_for(asyncio.to_thread(job), 20)
    finally:
        server.close()
    assert code == "timeout" and 0.5 < waited < 5.0, (code, waited)


def _outer_gemm(gemm: int, rows: int, cols: int) -> Gemm:
    """A rows × cols C of ``gemm``s from a rows × 1 and a 1 × cols operand: little in, much
    out."""
    a, b = np.ones((rows, 1), np.float32), np.full((1, cols), float(gemm), np.float32)
    return dataclasses.replace(gemm_request(a, b), gemm=gemm)


async def _job_not_reading(f: Fleet, name: str, gemms: list[Gemm]) -> tuple[RawPeer, Any]:
    """A job that sends ``gemms`` and reads nothing from its socket (with a small receive
    buffer, so that its RESULTs soon back up), and the emulator's end of it."""
    job = await f.raw_peer(rcvbuf=16 << 10)
    welcome = await job.hello("job", name=name)
    job.stop_reading()
    job.send(Open())
    for gemm in gemms:
        job.send(gemm)
    return job, _server_end(f, welcome.peer_id)


async def test_a_job_that_does_not_read_its_results_is_held_back_then_dropped(fleet):
    """RESULTs a job leaves unread fill the send buffer: past its high-water mark the
    emulator reads no more requests from it, so what it holds for the job stays within
    the send buffer's mark plus ``max_job_bytes`` of outputs in flight; a job that reads
    nothing for heartbeat_timeout_s is dropped. Before, it buffered every RESULT."""
    high_water, max_bytes, side, count = 64 << 10, 1 << 20, 256, 96  # 256 KiB a RESULT
    f = await fleet(
        high_water_bytes=high_water,
        max_job_bytes=max_bytes,
        block_size=256,
        heartbeat_s=0.2,
        heartbeat_timeout_s=1.5,
    )
    await f.add_device()
    gemms = [_outer_gemm(gemm, side, side) for gemm in range(1, count + 1)]
    _, end = await _job_not_reading(f, "deaf", gemms)
    most, deadline = 0, time.monotonic() + 20
    while end.transport is not None and time.monotonic() < deadline:
        most = max(most, end.transport.get_write_buffer_size())
        await asyncio.sleep(0.005)
    assert most <= high_water + max_bytes + 2 * side * side * 4, most
    assert end.job.totals["gemms"] < count / 2, end.job.totals  # the rest were never read
    # Dropped for good, and what it held with it: not left closing behind unread bytes.
    assert end.transport is None and end not in f.emu.peers
    await check_serving(await f.client())


async def test_a_job_that_reads_slower_than_its_results_come_gets_them_all(fleet):
    """Held back, not dropped, while it reads, however slowly, and every RESULT arrives in
    full. What it takes is judged from the emulator's buffer and the kernel's send queue
    together: on loopback the queue holds megabytes, and drains first."""
    count, rows, cols = 32, 256, 1024  # 1 MiB a RESULT
    f = await fleet(
        high_water_bytes=64 << 10,
        max_job_bytes=8 << 20,
        block_size=256,
        heartbeat_s=0.2,
        heartbeat_timeout_s=1.5,
    )
    await f.add_device()
    gemms = [_outer_gemm(gemm, rows, cols) for gemm in range(1, count + 1)]
    job, end = await _job_not_reading(f, "slow", gemms)
    await wait_for_condition(lambda: not end.reading, 5, "the emulator to stop reading")
    job.writer.transport.resume_reading()
    start = time.monotonic()
    while time.monotonic() - start < 4.0:  # over twice heartbeat_timeout_s, at ~400 KB/s
        job.decoder.receive_data(await job.reader.read(40_000))
        job.send(Heartbeat())
        await asyncio.sleep(0.1)
    assert end.open, "dropped while it read"
    seen: set[int] = set()
    while len(seen) < count:
        result = await job.recv_skipping_heartbeats(timeout=TIMEOUT)
        assert isinstance(result, Result), result
        c = np.frombuffer(result.segments[0], np.float32)
        assert c.size == rows * cols and np.all(c == result.gemm)
        seen.add(result.gemm)
    assert seen == set(range(1, count + 1))


async def test_probe_requests_past_the_high_water_mark_are_refused(fleet):
    """Past the send buffer's high-water mark (``pause_writing``, called here as the transport
    would), a peer's probe request is refused as ``overload``: one that asks without reading
    cannot make the replies pile up. Everyone else is served throughout."""
    f, client = await serving_fleet(fleet)
    device = await f.raw_peer()
    await device.hello("device", name="flood", profile=BUILTIN["rpi4"].to_wire())
    next(p for p in f.emu.peers if p.device and p.device.name == "flood").pause_writing()
    device.send(ProbeEcho(probe=1, segments=(np.zeros(64, np.uint8),)))
    await device.expect_error("overload")
    await check_serving(client)


async def test_silent_connection_times_out_waiting_for_hello(fleet):
    f, client = await serving_fleet(fleet, hello_timeout_s=0.4)
    messages, eof, elapsed = await asyncio.to_thread(blocking_exchange, f.host, f.port, b"")
    assert [type(m) for m in messages] == [Greeting, Error]
    assert messages[1].code == "timeout" and "HELLO" in messages[1].reason
    assert eof
    assert 0.35 <= elapsed < 2.0, elapsed
    await check_serving(client)


async def test_truncated_frame_then_disconnect(fleet):
    f, client = await serving_fleet(fleet)
    for cut in (3, codec.PREFIX.size, codec.PREFIX.size + 5, len(_gemm_frame()) - 7):
        raw = await f.raw_peer()
        await raw.hello("job", name="cut")
        raw.send(Open())
        raw.send_bytes(_gemm_frame()[:cut])
        await raw.writer.drain()
        raw.close()
        await wait_for_condition(lambda: len(f.emu.peers) == 3, 5, "the peer to be dropped")
    # And before HELLO, from a blocking socket that leaves mid-header.
    frame = codec.encode_bytes(Hello(role="job", name="x" * 40))
    with socket.create_connection((f.host, f.port)) as sock:
        sock.sendall(frame[:20])
    await wait_for_condition(lambda: len(f.emu.peers) == 3, 5, "the peer to be dropped")
    await check_serving(client)
    assert len(f.emu.registry.devices) == 2


async def test_job_disconnecting_mid_gemm_does_not_disturb_others(fleet):
    f, client = await serving_fleet(fleet, block_size=8)
    quitter = await f.client(name="quitter")
    rng = np.random.default_rng(12)
    a = rng.standard_normal((8, 64, 32), dtype=np.float32)
    b = rng.standard_normal((32, 64), dtype=np.float32)
    doomed = asyncio.create_task(quitter.matmul(a, b, timeout=TIMEOUT))
    await wait_for_condition(lambda: f.emu.scheduler.queued, 5, "tiles to be queued")
    quitter._conn.transport.abort()
    with pytest.raises(EmulatorError):
        await doomed
    await wait_for_condition(lambda: not f.emu.scheduler.queued, 5, "its tiles to be dropped")
    await check_serving(client)


@pytest.mark.parametrize(
    ("role", "opened", "make", "code"),
    [
        ("job", False, lambda: gemm_request(np.ones((2, 2)), np.ones((2, 2))), "out_of_order"),
        (
            "job",
            True,
            lambda: TileResult(tile=1, compute_ns=1, segments=(np.zeros(1, np.float32),)),
            "out_of_order",
        ),
        ("job", True, lambda: Hello(role="job"), "out_of_order"),
        ("job", True, lambda: Open(), "out_of_order"),
        ("device", False, lambda: gemm_request(np.ones((2, 2)), np.ones((2, 2))), "out_of_order"),
        ("device", False, lambda: Open(), "out_of_order"),
    ],
    ids=[
        "gemm_before_open",
        "job_tile_result",
        "second_hello",
        "second_open",
        "device_gemm",
        "device_open",
    ],
)
async def test_messages_outside_the_role_are_refused(fleet, role, opened, make, code):
    f, client = await serving_fleet(fleet)
    raw = await f.raw_peer()
    if role == "job":
        await raw.hello("job", name="raw")
    else:
        await raw.hello("device", name="raw-dev", profile=BUILTIN["rpi4"].to_wire())
    if opened:
        raw.send(Open())
    raw.send(make())
    await raw.expect_error(code)
    await check_serving(client)
    assert len(f.emu.registry.devices) == 2


async def raw_tile_device(peer: RawPeer, *, bogus: bool, stop_after: int | None = None) -> int:
    """Compute TILEs with numpy straight from the wire format; ``bogus`` first sends a result
    for a tile never given and then every result twice. Returns the tiles answered."""
    answered = 0
    if bogus:
        peer.send(TileResult(tile=10**9, compute_ns=1, segments=(np.zeros(4, np.float32),)))
    while (msg := await peer.recv(timeout=10)) is not None:
        if msg.TYPE != MsgType.TILE:
            continue
        a = tile_operand(msg.segments[0], msg.dtype, msg.ta, msg.m, msg.k, msg.lda)
        b = tile_operand(msg.segments[1], msg.dtype, msg.tb, msg.k, msg.n, msg.ldb)
        c = np.ascontiguousarray(a @ b, dtype=msg.dtype)
        for _ in range(2 if bogus else 1):
            peer.send(TileResult(tile=msg.tile, compute_ns=1, segments=(c,)))
        answered += 1
        if stop_after is not None and answered >= stop_after:
            break
    return answered


@pytest.mark.parametrize("bogus", [False, True], ids=["honest", "duplicates"])
async def test_raw_device_computing_from_the_wire_format(fleet, bogus):
    """A device written against the protocol alone (numpy, not the agent) gets every layout
    right; results for unknown tiles and duplicates are ignored, not counted twice."""
    f = await fleet(block_size=8, policy="round-robin", window=3)
    await f.add_device(name="agent")
    peer = await f.raw_peer()
    welcome = await peer.hello("device", name="raw-dev", profile=BUILTIN["rpi4"].to_wire())
    await wait_for_condition(
        lambda: (
            f.emu.registry.devices.get(welcome.peer_id) is not None
            and f.emu.registry.devices[welcome.peer_id].ready
        ),
        5,
        "the raw device to be ready",
    )
    worker = asyncio.create_task(raw_tile_device(peer, bogus=bogus))
    client = await f.client()
    rng = np.random.default_rng(20)
    cases = [
        ("t", "pad", 3, 0),
        ("pad_t", "t", 0, 0),
        ("interleaved", "step", 2, 2),
        ("c", "pad_t", 0, 4),
    ]
    for la, lb, batch_a, batch_b in cases:
        for dtype in (np.float32, np.float64):
            a = make_operand(rng, 21, 13, dtype, batch_a, la)
            b = make_operand(rng, 13, 19, dtype, batch_b, lb)
            c = await client.matmul(a, b, timeout=TIMEOUT)
            assert_gemm_close(c, a, b, f"{la} @ {lb} {np.dtype(dtype)}")
    record = f.emu.registry.devices[welcome.peer_id]
    assert record.completed > 0 and not record.outstanding
    peer.close()
    assert await worker == record.completed


@pytest.mark.parametrize(
    "lie",
    [
        {"segments": (np.zeros(3, np.float32),)},  # a tile of the wrong size
        {"in_place": True, "segments": (b"",)},  # "written in place", unasked (no arena here)
    ],
    ids=["wrong_size", "in_place_unasked"],
)
async def test_device_returning_a_wrong_tile_is_dropped(fleet, caplog, lie):
    caplog.set_level(logging.INFO, logger="morphling")
    f = await fleet(block_size=8, policy="round-robin", window=2)
    peer = await f.raw_peer()
    welcome = await peer.hello("device", name="liar", profile=BUILTIN["rpi4"].to_wire())
    await f.add_device(name="honest")
    client = await f.client()
    rng = np.random.default_rng(21)
    a = rng.standard_normal((2, 32, 16), dtype=np.float32)
    b = rng.standard_normal((16, 32), dtype=np.float32)
    request = gemm_request(a, b)
    running = asyncio.create_task(client.submit(request, timeout=TIMEOUT))
    tile = await peer.recv_skipping_heartbeats()
    assert tile is not None and tile.TYPE == MsgType.TILE, tile
    peer.send(TileResult(tile=tile.tile, compute_ns=1, **lie))
    while (msg := await peer.recv()) is not None and msg.TYPE in (MsgType.TILE, MsgType.HEARTBEAT):
        pass  # the window's other tile
    assert isinstance(msg, Error) and msg.code == "bad_result", msg
    assert str(tile.tile) in msg.reason
    assert await peer.recv() is None
    result = await running
    assert_gemm_close(result_array(result, request), a, b)
    assert welcome.peer_id in result.devices
    assert welcome.peer_id not in f.emu.registry.devices
    # The wrong tile counts as re-queued, beside those the liar held when it was dropped.
    lost = [r.getMessage() for r in caplog.records if "re-queued tiles" in r.getMessage()]
    held = re.search(r"lost with (\d+) tiles in flight and (\d+) queued", "".join(lost))
    assert result.requeued == 1 + (int(held[1]) + int(held[2]) if held else 0), lost
    await check_serving(client)


async def test_a_tile_every_device_answers_wrongly_ends_its_job(fleet):
    """Three devices answer every TILE with a result of the wrong size: each is dropped
    and the tile sent to the next; after the third the job gets ``tile_failed`` naming
    the tile and the last device's wrong result, instead of a tile that goes round for
    ever. The emulator serves on."""
    f = await fleet(block_size=8, window=1)
    liars = []
    for i in range(3):
        peer = await f.raw_peer()
        await peer.hello("device", name=f"liar-{i}", profile=BUILTIN["rpi4"].to_wire())
        liars.append(asyncio.create_task(wrong_sized(peer)))
    client = await f.client()
    with pytest.raises(EmulatorError) as info:
        await client.matmul(
            np.ones((8, 8), np.float32), np.ones((8, 8), np.float32), timeout=TIMEOUT
        )
    assert info.value.code == "tile_failed"
    reason = (
        r"GEMM 1: tile \d+ was sent 3 times and failed each time; the last device, \d+ "
        r"\(liar-\d\), ended with: bad_result: .+"
    )
    assert re.fullmatch(reason, info.value.reason), info.value.reason
    assert sorted(await asyncio.gather(*liars)) == [1, 1, 1], "one tile each"
    await f.add_device(name="honest")
    await check_serving(await f.client())


async def wrong_sized(peer: Any) -> int:
    """Answer each TILE with three floats, whatever it asked; how many it answered."""
    answered = 0
    while (msg := await peer.recv(timeout=30)) is not None:
        if msg.TYPE == MsgType.TILE:
            peer.send(TileResult(tile=msg.tile, compute_ns=1, segments=(np.zeros(3, np.float32),)))
            answered += 1
    return answered


async def test_emulator_stop_says_bye_to_jobs_and_devices(fleet):
    f = await fleet()
    gate = threading.Event()  # the device holds its tile: the GEMM is in flight at shutdown
    stuck_workers = WorkerPool([GatedCpuBackend(gate)])
    try:
        agent = await f.add_device(name="bystander", workers=stuck_workers)
        client = await f.client()
        running = asyncio.create_task(client.matmul(np.ones((9, 9)), np.ones((9, 9)), timeout=5))
        raw = await f.raw_peer()
        await raw.hello("job")
        record = f.record(agent)
        await wait_for_condition(lambda: record.outstanding, 5, "the tile to be in flight")
        await f.emu.stop()
        with pytest.raises(EmulatorError) as info:
            await running
        assert info.value.code == "bye"
        assert isinstance(await raw.recv_skipping_heartbeats(), Bye)
        assert await raw.recv() is None
        assert await asyncio.wait_for(f.tasks[agent], 5) == 0
        assert agent.last_error is None
    finally:
        gate.set()
        stuck_workers.close()
