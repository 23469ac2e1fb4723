"""Token authentication: a peer without the token's proof is refused while the others
carry on; an emulator without a token accepts anyone."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from morphling.proxy.job.client import Client, EmulatorError
from morphling.proxy.wire.handshake import expected_mac
from morphling.proxy.wire.messages import (
    Greeting,
    Hello,
)
from serving import (
    TIMEOUT,
    assert_gemm_close,
    check_serving,
)


async def test_token_authentication(fleet):
    f = await fleet(token="s3cret")
    good = await f.add_device(token="s3cret", name="good")
    job = await f.client(token="s3cret", name="good-job")
    rng = np.random.default_rng(8)
    a = rng.standard_normal((4, 64, 32), dtype=np.float32)
    b = rng.standard_normal((32, 48), dtype=np.float32)
    running = asyncio.create_task(job.matmul(a, b, timeout=TIMEOUT))

    for token in ("wrong", ""):  # devices: refused for good, run() gives up with 2
        bad = f.agent(token=token, name=f"bad-{token or 'none'}")
        code = await asyncio.wait_for(f.run(bad, reconnect=True), 10)
        assert code == 2
        assert bad.last_error is not None and bad.last_error[0] == "auth", bad.last_error
    for token in ("wrong", ""):  # jobs
        with pytest.raises(EmulatorError) as info:
            await f.client(token=token)
        assert info.value.code == "auth"
    with pytest.raises(EmulatorError) as info:  # the blocking client raises the same
        await asyncio.to_thread(Client, f.host, f.port, token="nope")
    assert info.value.code == "auth"
    raw = await f.raw_peer()  # a MAC over the wrong nonce
    greeting = await raw.recv()
    assert isinstance(greeting, Greeting) and greeting.auth
    raw.send(Hello(role="job", mac=expected_mac("s3cret", bytes(16))))
    await raw.expect_error("auth")

    assert_gemm_close(await running, a, b, "job started before the refusals")
    assert list(f.emu.registry.devices) == [good.device_id]
    await check_serving(job)


async def test_no_token_configured_accepts_anyone(fleet):
    f = await fleet()
    await f.add_device(token="whatever")  # a MAC the emulator does not ask for is ignored
    client = await f.client(token="also-ignored")
    await check_serving(client)
