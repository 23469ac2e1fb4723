"""The async job client takes the emulator's STEP and CLOSE answers in order, each in
kind: an answer of the other kind is the emulator's error, not the job's reply.

A hand-driven emulator on loopback (``raw_peer.fake_emulator``) answers as no real
emulator would."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest
from morphling.proxy.job.client import AsyncClient, EmulatorError
from morphling.proxy.wire.messages import Close, Message, Open, Step
from raw_peer import fake_emulator


async def _ask(
    answer: Callable[[], Message], ask: Callable[[AsyncClient], Awaitable[object]]
) -> object:
    """What ``ask`` returns from a client of an emulator answering all but OPEN so."""
    async with fake_emulator(lambda msg: None if isinstance(msg, Open) else answer()) as port:
        client = await AsyncClient.connect("127.0.0.1", port, timeout=10.0)
        try:
            return await asyncio.wait_for(ask(client), 10.0)
        finally:
            await client.close()


async def test_a_step_is_answered_by_its_account():
    reply = await _ask(lambda: Step(step=3, gemms=5), lambda client: client.step(3))
    assert isinstance(reply, Step) and (reply.step, reply.gemms) == (3, 5)


async def test_a_close_answering_a_step_is_an_error():
    with pytest.raises(EmulatorError) as caught:
        await _ask(lambda: Close(gemms=5), lambda client: client.step(3))
    assert caught.value.code == "bad_reply"
    assert "CLOSE in reply to STEP" in str(caught.value)


async def test_a_step_answering_a_close_is_an_error_and_close_says_none():
    """``close`` returns None when the emulator errs, as when the connection is gone."""
    assert await _ask(lambda: Step(step=0), lambda client: client.close()) is None
