"""Each placement policy computes right and spreads the tiles; greedy prefers the
faster device."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from morphling.devices.models.links import LINKS
from morphling.proxy.job.client import EmulatorError
from morphling.proxy.wire.messages import Collective, Conv, Gemm, Open, Step, Wait
from serving import (
    TIMEOUT,
    assert_gemm_close,
    check_serving,
    gemm_request,
    result_array,
)


@pytest.mark.parametrize("policy", ["round-robin", "greedy", "load-balanced"])
async def test_policy_computes_and_spreads(fleet, policy):
    f = await fleet(policy=policy, block_size=16, window=2)
    for _ in range(4):
        await f.add_device("rpi4")
    client = await f.client()
    rng = np.random.default_rng(3)
    a = rng.standard_normal((2, 64, 24), dtype=np.float32)
    b = rng.standard_normal((24, 64), dtype=np.float32)
    request = gemm_request(a, b)
    result = await client.submit(request, timeout=TIMEOUT)
    assert_gemm_close(result_array(result, request), a, b, policy)
    assert result.tiles == 2 * 4 * 4
    completed = [f.record(agent).completed for agent in f.agents]
    assert sum(completed) == result.tiles
    assert set(result.devices) == {i for i, n in enumerate(completed) if n}
    if policy != "greedy":  # greedy may keep work on its fastest device; these must spread
        assert len(result.devices) > 1, completed
    if policy == "round-robin":
        assert len(result.devices) == 4 and max(completed) - min(completed) <= 2 * 2, completed
    # And a second, differently shaped GEMM through the same scheduler state.
    await check_serving(client)


async def test_greedy_prefers_the_faster_device(fleet):
    """Greedy places each tile by predicted finish in virtual time under the profiles.

    On the built-ins' gigabit LAN a Pi's tiles are link-bound (spreading them is the
    right call), so both boards are on the ideal link here: compute decides, and the
    Orin Nano (40x a Pi 4's FLOP/s) gets all of them.
    """
    f = await fleet(policy="greedy", block_size=256, window=64, high_water_bytes=64 << 20)
    pi, orin = f.agent("rpi4"), f.agent("orin-nano")
    for agent in (pi, orin):
        agent.profile = LINKS["ideal"].apply(agent.profile)
        f.run(agent)
        await f.wait_ready(agent)
    client = await f.client()
    rng = np.random.default_rng(4)
    a = rng.standard_normal((1024, 512), dtype=np.float32)
    b = rng.standard_normal((512, 1024), dtype=np.float32)
    request = gemm_request(a, b)
    result = await client.submit(request, timeout=TIMEOUT)
    assert_gemm_close(result_array(result, request, batched=False), a, b)
    pi_done, orin_done = f.record(pi).completed, f.record(orin).completed
    assert pi_done + orin_done == result.tiles == 16
    # 16 tiles of 67 MFLOP: 1.1 ms in all on the Orin, 2.8 ms for one on the Pi
    assert (orin_done, pi_done) == (16, 0)
    assert result.devices == [f.record(orin).id]


@pytest.mark.parametrize("policy", ["round-robin", "greedy"])
async def test_a_job_pinned_to_a_device_has_all_its_tiles_computed_there(fleet, policy):
    """OPEN ``device``: a rank's products go to its own board, whatever the policy says."""
    f = await fleet(policy=policy, block_size=16, window=2)
    agents = [await f.add_device("rpi4") for _ in range(3)]
    pinned = f.record(agents[1])
    client = await f.client(device=pinned.name)
    rng = np.random.default_rng(5)
    a = rng.standard_normal((64, 24), dtype=np.float32)
    b = rng.standard_normal((24, 64), dtype=np.float32)
    request = gemm_request(a, b)
    result = await client.submit(request, timeout=TIMEOUT)
    assert_gemm_close(result_array(result, request, batched=False), a, b)
    assert result.tiles == 16 and result.devices == [pinned.id]
    assert [f.record(agent).completed for agent in agents] == [0, 16, 0]


async def test_a_job_pinned_to_no_such_device_is_refused_naming_the_ready_ones(fleet):
    f = await fleet()
    agent = await f.add_device("rpi4")
    client = await f.client(device="rpi9-7")
    with pytest.raises(EmulatorError) as info:
        await client.matmul(np.ones((4, 4)), np.ones((4, 4)), timeout=TIMEOUT)
    assert info.value.code == "bad_open"
    assert "rpi9-7" in info.value.reason and f.record(agent).name in info.value.reason


async def test_ranks_and_collectives_that_do_not_fit_are_refused_naming_the_field(fleet):
    """A rank needs its device (named, or device RANK of the fleet) and a world it belongs
    to; only a rank sends COLLECTIVE, of an op Morphling knows, in a group that holds it.
    The emulator serves on."""
    f = await fleet()
    agent = await f.add_device("rpi4")
    name = f.record(agent).name
    cases = [
        (
            Open(rank=1, world=2),
            "bad_open",
            "OPEN.rank=1 without OPEN.device runs on device 1 "
            "of the fleet, and 1 are ready (rpi4-0)",
        ),
        (Open(device=name, rank=2, world=2), "bad_open", "OPEN.rank=2 is not a rank of world=2"),
        (Open(), "bad_collective", "the job is no rank"),
        (Open(device=name, rank=0, world=2), "bad_collective", "op 'gossip' is not one of"),
        (Open(device=name, rank=0, world=2), "bad_collective", "including the sender's (0)"),
        (Open(device=name, rank=0, world=2), "bad_collective", "wait=5 is not an earlier"),
        (Open(), "bad_collective", "WAIT 2: the job is no rank"),
    ]
    collectives = [None, None, Collective(gemm=1, op="allreduce", nbytes=4, ranks=[0, 1], seq=1),
                   Collective(gemm=1, op="gossip", nbytes=4, ranks=[0, 1], seq=1),
                   Collective(gemm=1, op="allreduce", nbytes=4, ranks=[1, 2], seq=1),
                   Wait(gemm=2, wait=5), Wait(gemm=2, wait=1)]  # fmt: skip
    for (open_msg, code, reason), collective in zip(cases, collectives, strict=True):
        raw = await f.raw_peer()
        await raw.hello("job", name="raw")
        raw.send(open_msg)
        if collective is not None:
            raw.send(collective)
        error = await raw.expect_error(code)
        assert reason in error.reason, error.reason
    await check_serving(await f.client())


def _own_gemm(gemm: int, **fields) -> Gemm:
    return Gemm(gemm=gemm, dtype="float32", ta=False, tb=False, m=64, n=32, k=16, lda=16,
                ldb=32, by_rank=True, segments=(b"", b""), **fields)  # fmt: skip


async def test_a_ranks_own_products_are_timed_on_its_device_and_sent_nowhere(fleet):
    """GEMM and CONV ``by_rank``: the rank computed them itself. Its device times them (its
    step's emulated time holds them) and computes nothing, keeps nothing of them once they
    ran (no panel to forget later), and nothing answers them. From a job that is no rank,
    carrying operands, or of a shape no array can have, one is refused naming why; the
    emulator serves on."""
    f = await fleet()
    agent = await f.add_device("rpi4")
    name = f.record(agent).name
    raw = await f.raw_peer()
    await raw.hello("job", name="rank")
    raw.send(Open(device=name, rank=0, world=1))
    raw.send(_own_gemm(1))
    raw.send(Conv(gemm=2, kind="forward", dtype="float32", input=[2, 3, 8, 8],
                  weight=[4, 3, 3, 3], stride=[1, 1], dilation=[1, 1], padding=[1, 1, 1, 1],
                  after=1, by_rank=True, segments=(b"", b"")))  # fmt: skip
    raw.send(Step(step=1, host_ns=0))
    reply = await raw.recv_skipping_heartbeats()
    assert isinstance(reply, Step), reply  # no RESULT came first
    assert (reply.gemms, reply.tiles, reply.bytes_down, reply.bytes_up) == (2, 2, 0, 0)
    assert reply.emulated_ns > 0 and reply.coord_ns == 0
    raw.send(_own_gemm(3, after=0))
    raw.send(Step(step=2, host_ns=0))
    assert isinstance(await raw.recv_skipping_heartbeats(), Step)
    record = f.record(agent)
    assert record.completed == 0 and record.drop_panels == []
    assert not f.emu.timeline.devices[record.id].memory.resident
    refused = [
        (Open(), _own_gemm(1), "GEMM 1: by_rank, but the job is no rank (OPEN.rank)"),
        (Open(device=name, rank=1, world=3), _own_gemm(1, ref_a=[0, 0]),
         "by_rank: ref_a is set, but a rank's own product has no operands"),
        (Open(device=name, rank=2, world=3),
         dataclasses.replace(_own_gemm(1), segments=(b"\0" * 4, b"")),
         "by_rank: a rank's own product carries no operand bytes"),
        (Open(device=name, rank=3, world=4),
         dataclasses.replace(_own_gemm(1), m=1 << 31, n=1 << 31, ldb=1 << 31, batch=4),
         "by_rank: a product of shape [4, 2147483648, 2147483648]"),
    ]  # fmt: skip
    for open_msg, gemm, reason in refused:
        raw = await f.raw_peer()
        await raw.hello("job", name="raw")
        raw.send(open_msg)
        raw.send(gemm)
        error = await raw.expect_error("bad_gemm")
        assert reason in error.reason, error.reason
    await check_serving(await f.client())
