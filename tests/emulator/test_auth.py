"""Who may connect: a peer without its token's proof is refused while the others carry
on (a shared token, per-device secrets re-read on SIGHUP); an emulator without a token
accepts anyone, and only on loopback unless told --insecure; connections not yet
welcomed are bounded per address."""

from __future__ import annotations

import asyncio
import re

import numpy as np
import pytest
from morphling.proxy.emulator.server import Emulator
from morphling.proxy.emulator.settings import EmulatorConfig
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

from morphling.config import ConfigError


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


def write_tokens(path, text: str) -> str:
    path.write_text(text)
    return str(path)


async def test_per_device_tokens(fleet, tmp_path, caplog):
    """A listed name proves its own secret (not another's, not the shared one); an
    unlisted name needs the shared token; SIGHUP's reload takes a changed file, and keeps
    the old secrets when the new file does not parse."""
    path = write_tokens(tmp_path / "tokens", "# board  secret\npi01 a#a\npi02 bbb  # rack 2\n")
    f = await fleet(token="shared", device_tokens=path)
    await f.add_device(name="pi01", token="a#a")  # a '#' within a secret is no comment
    await f.add_device(name="pi03", token="shared")  # unlisted: the shared token
    for name, token in (("pi02", "a#a"), ("pi02", "shared"), ("pi04", "bbb"), ("pi01", "a")):
        bad = f.agent(name=name, token=token)
        assert await asyncio.wait_for(f.run(bad), 10) == 2
        assert bad.last_error is not None and bad.last_error[0] == "auth", (name, token)

    write_tokens(tmp_path / "tokens", "pi01 a#a\npi02 new\n")
    f.emu.reload_tokens()
    await f.add_device(name="pi02", token="new")
    write_tokens(tmp_path / "tokens", "pi01 a#a\npi02 new extra\n")
    f.emu.reload_tokens()
    assert f"{path}:2: expected NAME SECRET, got 3 field(s)" in caplog.text
    assert f.emu.credentials.per_peer == {"pi01": "a#a", "pi02": "new"}  # kept
    assert len(f.emu.registry.ready()) == 3


async def test_tokens_file_alone_refuses_unlisted_names(fleet, tmp_path):
    f = await fleet(device_tokens=write_tokens(tmp_path / "tokens", "pi01 aaa\n"))
    await f.add_device(name="pi01", token="aaa")
    bad = f.agent(name="stranger", token="aaa")
    assert await asyncio.wait_for(f.run(bad), 10) == 2
    assert bad.last_error == ("auth", "no token for 'stranger' in this emulator's tokens file")


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("pi01\n", "tokens:1: expected NAME SECRET, got 1 field(s)"),
        ("pi01 a\n\npi01 b\n", "tokens:3: 'pi01' is listed twice"),
        ("# nobody\n", "names no peer"),
    ],
)
def test_a_malformed_tokens_file_is_refused_naming_the_line(tmp_path, text, error):
    path = write_tokens(tmp_path / "tokens", text)
    with pytest.raises(ConfigError, match=re.escape(error)):
        Emulator(EmulatorConfig(device_tokens=path))
    with pytest.raises(ConfigError, match="cannot read"):
        Emulator(EmulatorConfig(device_tokens=str(tmp_path / "absent")))


@pytest.mark.parametrize("ip", ["0.0.0.0", "::", "10.1.2.3"])
def test_a_reachable_address_needs_a_token_or_insecure(ip):
    with pytest.raises(ConfigError, match=f"refusing to listen on {re.escape(ip)} without a "
                       "token.*--insecure"):  # fmt: skip
        EmulatorConfig(listen_ip=ip)
    EmulatorConfig(listen_ip=ip, token="t")
    EmulatorConfig(listen_ip=ip, device_tokens="/some/file")
    EmulatorConfig(listen_ip=ip, insecure=True)
    for loopback in ("127.0.0.1", "::1", "127.8.0.1"):
        EmulatorConfig(listen_ip=loopback)


async def test_connections_not_yet_welcomed_are_bounded_per_address(fleet):
    """Past ``max_unwelcomed`` silent connections from one address, the next is refused
    with ERROR busy; a welcomed peer no longer counts, and one that leaves frees its place."""
    f = await fleet(max_unwelcomed=2, hello_timeout_s=30.0)
    silent = [await f.raw_peer() for _ in range(2)]
    for peer in silent:
        assert isinstance(await peer.recv(), Greeting)
    refused = await f.raw_peer()
    error = await refused.expect_error("busy")
    assert "127.0.0.1 already holds 2 connections not yet welcomed" in error.reason
    silent[0].close()
    await asyncio.sleep(0.2)
    for name in ("d1", "d2", "d3"):  # each welcomed in turn: places are given back
        await f.add_device(name=name)
    assert f.emu.gate.waiting() == 1
    await check_serving(await f.client())
