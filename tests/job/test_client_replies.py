"""The async job client takes the emulator's STEP and CLOSE answers in order, each in
kind: an answer of the other kind is the emulator's error, not the job's reply.

A hand-driven emulator on loopback (frames made with the codec alone) answers as no
real emulator would."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest
from morphling.proxy.job.client import AsyncClient, EmulatorError
from morphling.proxy.wire import codec
from morphling.proxy.wire.messages import (
    Close,
    Greeting,
    Hello,
    Message,
    Open,
    Step,
    Welcome,
)

Answer = Callable[[Message], Message]


async def _fake_emulator(answer: Answer) -> tuple[asyncio.Server, int, asyncio.Event]:
    """Greets, welcomes, takes OPEN, then answers every other message with ``answer``;
    the event is set once the job has hung up."""
    hung_up = asyncio.Event()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        decoder = codec.Decoder()

        async def receive() -> Message | None:
            while (msg := decoder.next_message()) is None:
                data = await reader.read(1 << 16)
                if not data:  # the job hung up
                    return None
                decoder.receive_data(data)
            return msg

        writer.write(codec.encode_bytes(Greeting(version=codec.VERSION, nonce=b"n", auth=False)))
        assert isinstance(await receive(), Hello)
        writer.write(codec.encode_bytes(Welcome(peer_id=7, heartbeat_s=60.0)))
        assert isinstance(await receive(), Open)
        while (msg := await receive()) is not None:
            writer.write(codec.encode_bytes(answer(msg)))
        writer.close()
        hung_up.set()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1], hung_up


async def _ask(answer: Answer, ask: Callable[[AsyncClient], Awaitable[object]]) -> object:
    server, port, hung_up = await _fake_emulator(answer)
    try:
        client = await AsyncClient.connect("127.0.0.1", port, timeout=10.0)
        try:
            return await asyncio.wait_for(ask(client), 10.0)
        finally:
            await client.close()
            await asyncio.wait_for(hung_up.wait(), 10.0)
    finally:
        server.close()


async def test_a_step_is_answered_by_its_account():
    reply = await _ask(lambda msg: Step(step=3, gemms=5), lambda client: client.step(3))
    assert isinstance(reply, Step) and (reply.step, reply.gemms) == (3, 5)


async def test_a_close_answering_a_step_is_an_error():
    with pytest.raises(EmulatorError) as caught:
        await _ask(lambda msg: Close(gemms=5), lambda client: client.step(3))
    assert caught.value.code == "bad_reply"
    assert "CLOSE in reply to STEP" in str(caught.value)


async def test_a_step_answering_a_close_is_an_error_and_close_says_none():
    """``close`` returns None when the emulator errs, as when the connection is gone."""
    assert await _ask(lambda msg: Step(step=0), lambda client: client.close()) is None
