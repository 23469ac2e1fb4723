"""A hand-driven emulator on loopback for one real device agent: it greets the agent,
sends it the messages a test built, and collects its answers."""

from __future__ import annotations

import asyncio

from morphling.devices.agent import DeviceAgent
from morphling.devices.models.profiles import BUILTIN
from morphling.kernels import BufferPool, CpuBackend, WorkerPool
from morphling.proxy.wire import codec
from morphling.proxy.wire.messages import (
    Bye,
    Error,
    Greeting,
    Hello,
    Message,
    TileResult,
    Welcome,
)


async def serve_agent(tiles: list[Message]) -> tuple[Hello, list[Message]]:
    """Greet a real agent, send it ``tiles`` and collect its answers: one per tile, or its
    ERROR. Then BYE, and the agent's run ends."""
    hello: list[Hello] = []
    answers: list[Message] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        decoder = codec.Decoder()

        async def receive() -> Message | None:
            while (msg := decoder.next_message()) is None:
                data = await reader.read(1 << 16)
                if not data:
                    return None
                decoder.receive_data(data)
            return msg

        writer.write(
            codec.encode_bytes(Greeting(version=codec.VERSION, nonce=b"n" * 16, auth=False))
        )
        msg = await receive()
        assert isinstance(msg, Hello), msg
        hello.append(msg)
        writer.write(codec.encode_bytes(Welcome(peer_id=3, heartbeat_s=60.0)))
        for t in tiles:
            writer.write(codec.encode_bytes(t))
        while len(answers) < len(tiles) and (msg := await receive()) is not None:
            if isinstance(msg, TileResult | Error):
                answers.append(msg)
            if isinstance(msg, Error):
                break
        writer.write(codec.encode_bytes(Bye(reason="done")))
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    with WorkerPool([CpuBackend(1)]) as workers:
        agent = DeviceAgent(
            BUILTIN["rpi4"],
            workers,
            BufferPool(pin=False),
            name="agent",
            share_memory=False,
            inline_flops=0,
        )
        await asyncio.wait_for(agent.run("127.0.0.1", port, reconnect=False), 30)
    server.close()
    return hello[0], answers
