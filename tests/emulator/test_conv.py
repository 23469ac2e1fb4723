"""Convolutions served for real: a real emulator cuts them into tiles (forward: output
channels × output rows, each with its input region and halo; grad_input: input channels ×
input rows; grad_weight: output × input channels) that real device agents compute, over
loopback sockets (bytes on the wire), and the product equals torch's own.

The reference is torch (``F.conv2d``, ``torch.nn.grad.conv2d_input`` and
``conv2d_weight``) in float64 over the same operands, the padding applied with ``F.pad``
so that it may be asymmetric; a result is within RTOL of it relative to the same product
over absolute values, as in the kernels' tests. References are computed before the
emulator starts: torch's first calls would stall the event loop it shares.
"""

from __future__ import annotations

import asyncio
import logging
import math
import signal
import threading
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from morphling.devices.models.profiles import BUILTIN
from morphling.kernels import ConvGeometry, WorkerPool
from morphling.proxy.emulator.settings import EmulatorConfig
from morphling.proxy.job.client import Client, EmulatorError, conv_request, product_array
from morphling.proxy.job.embedded import EmbeddedFleet
from morphling.proxy.wire.messages import Conv, MsgType, Tile, TileResult
from serving import (
    TIMEOUT,
    GatedCpuBackend,
    check_serving,
    needs_torch,
    torch,
    wait_for_condition,
)

if torch is not None:
    import torch.nn.functional as F

RTOL = {np.dtype(np.float32): 1e-5, np.dtype(np.float64): 1e-12}
KINDS = ("forward", "grad_input", "grad_weight")

# name: (N, C, H, W, OC, kernel, stride, padding (top, bottom, left, right), dilation, groups)
CASES = {
    "3x3 pad 1": (2, 3, 8, 7, 4, (3, 3), (1, 1), (1, 1, 1, 1), (1, 1), 1),
    "stride 2": (2, 3, 9, 8, 5, (3, 3), (2, 2), (1, 1, 1, 1), (1, 1), 1),
    "dilation 2": (1, 4, 9, 9, 3, (3, 3), (1, 1), (2, 2, 2, 2), (2, 2), 1),
    "stride, dilation, asymmetric padding": (
        2, 3, 11, 10, 4, (3, 2), (2, 3), (2, 0, 0, 3), (2, 1), 1,
    ),
    "groups 2": (2, 8, 6, 5, 8, (3, 3), (1, 1), (1, 1, 1, 1), (1, 1), 2),
    "groups 3, stride 2": (1, 6, 8, 8, 3, (2, 2), (2, 2), (0, 0, 0, 0), (1, 1), 3),
    "depthwise": (2, 5, 8, 7, 5, (3, 3), (1, 1), (1, 1, 1, 1), (1, 1), 5),
    "depthwise, multiplier 2, stride 2, dilation 2": (
        2, 3, 11, 9, 6, (3, 3), (2, 2), (2, 1, 2, 1), (2, 2), 3,
    ),
    "1x1": (2, 6, 5, 4, 3, (1, 1), (1, 1), (0, 0, 0, 0), (1, 1), 1),
    "1x1 stride 2 (rows and columns never read)": (
        1, 4, 6, 7, 5, (1, 1), (2, 2), (0, 0, 0, 0), (1, 1), 1,
    ),
    "1-D": (3, 4, 1, 17, 5, (1, 5), (1, 2), (0, 0, 2, 2), (1, 1), 1),
    "1-D grouped, dilated": (2, 6, 1, 20, 6, (1, 3), (1, 1), (0, 0, 1, 1), (1, 3), 2),
}  # fmt: skip


def geometry(case: tuple) -> dict[str, Any]:
    """``Client.conv``'s keyword arguments for a case."""
    n, c, h, w, oc, kernel, stride, padding, dilation, groups = case
    return {
        "input_shape": (n, c, h, w),
        "weight_shape": (oc, c // groups, *kernel),
        "stride": stride,
        "padding": padding,
        "dilation": dilation,
        "groups": groups,
    }


def torch_product(kind: str, x: np.ndarray, w: np.ndarray, dy: np.ndarray, geo: dict) -> Any:
    """The product ``kind`` by torch's own functions, in float64."""
    top, bottom, left, right = geo["padding"]
    xp = F.pad(torch.tensor(x, dtype=torch.float64), (left, right, top, bottom))
    wt = torch.tensor(w, dtype=torch.float64)
    how = {"stride": geo["stride"], "dilation": geo["dilation"], "groups": geo["groups"]}
    if kind == "forward":
        return F.conv2d(xp, wt, **how).numpy()
    dyt = torch.tensor(dy, dtype=torch.float64)
    if kind == "grad_input":
        height, width = x.shape[2:]
        dxp = torch.nn.grad.conv2d_input(xp.shape, wt, dyt, **how)
        return dxp[:, :, top : top + height, left : left + width].numpy()
    return torch.nn.grad.conv2d_weight(xp, wt.shape, dyt, **how).numpy()


class Problem:
    """One convolution's operands, and torch's three products with their magnitudes."""

    def __init__(self, case: tuple, dtype: Any, seed: int) -> None:
        rng = np.random.default_rng(seed)
        self.geo = geo = geometry(case)
        ref = ConvGeometry(
            geo["weight_shape"][2:], geo["stride"], geo["dilation"], geo["padding"], geo["groups"]
        )
        n, _, h, w = geo["input_shape"]
        out = (n, geo["weight_shape"][0], *ref.output_size(h, w))
        self.x = rng.standard_normal(geo["input_shape"]).astype(dtype)
        self.w = rng.standard_normal(geo["weight_shape"]).astype(dtype)
        self.dy = rng.standard_normal(out).astype(dtype)
        self.want = {k: torch_product(k, self.x, self.w, self.dy, geo) for k in KINDS}
        absolute = (np.abs(self.x), np.abs(self.w), np.abs(self.dy))
        self.scale = {k: torch_product(k, *absolute, geo) for k in KINDS}

    def operands(self, kind: str) -> tuple[np.ndarray, np.ndarray]:
        return {
            "forward": (self.x, self.w),
            "grad_input": (self.dy, self.w),
            "grad_weight": (self.x, self.dy),
        }[kind]

    def check(self, kind: str, got: np.ndarray) -> None:
        assert got.dtype == self.x.dtype, kind
        want = self.want[kind]
        assert got.shape == want.shape, kind
        excess = np.abs(got.astype(np.float64) - want) - RTOL[got.dtype] * self.scale[kind]
        worst = np.unravel_index(np.argmax(excess), excess.shape)
        assert excess.max() <= 0, f"{kind} at {worst}: got {got[worst]}, want {want[worst]}"


async def conv_fleet(fleet: Any, **config: Any) -> Any:
    """An emulator with two device agents: one computes small tiles inline, the other
    sends every tile to the worker pool."""
    f = await fleet(**config)
    await f.add_device(name="inline")
    await f.add_device(name="pooled", workers=f.workers)
    return f


@needs_torch
@pytest.mark.parametrize("block", [3, 16])
@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("case", CASES)
async def test_every_kind_matches_torch(fleet, case, dtype, block):
    """Block 3 cuts channels inside groups and bands of one row (a strided grad_input: of
    twice the kernel's halo); block 16, whole groups and bands of several rows."""
    problem = Problem(CASES[case], dtype, seed=len(case))
    f = await conv_fleet(fleet, block_size=block, policy="round-robin")
    client = await f.client()
    for kind in KINDS:
        got = await client.conv(kind, *problem.operands(kind), **problem.geo, timeout=TIMEOUT)
        problem.check(kind, got)
    assert all(f.record(a).completed for a in f.agents), "both devices computed tiles"


@needs_torch
@pytest.mark.parametrize("case", CASES)
async def test_convolutions_computed_on_the_emulators_host_match_torch(fleet, case):
    """``sample_tiles=1``: every kind of convolution cut in several tiles is computed
    tile by tile on the emulator's host but one, which its device computes."""
    problem = Problem(CASES[case], np.float32, seed=len(case))
    f = await conv_fleet(fleet, block_size=3, policy="round-robin", sample_tiles=1)
    client = await f.client()
    for kind in KINDS:
        got = await client.conv(kind, *problem.operands(kind), **problem.geo, timeout=TIMEOUT)
        problem.check(kind, got)
    host = f.emu.host_products
    assert host.on_host > 0 and 1 <= host.on_devices <= len(KINDS)  # (one of several each)
    # (and every tile of a kind its block leaves whole)
    assert sum(f.record(a).completed for a in f.agents) <= len(KINDS)


BAD = [  # (what is changed in a good forward CONV, what the refusal names)
    ({"kind": "sideways"}, "kind 'sideways' is not one of forward, grad_input, grad_weight"),
    ({"dtype": "float16"}, "dtype 'float16' is not supported"),
    ({"input": [2, 3, 8]}, "input=[2, 3, 8]: expected 4 integers, [N, C, H, W]"),
    ({"weight": [4, 3, 0, 3]}, "weight=[4, 3, 0, 3]: every dimension must be >= 1"),
    ({"stride": [0, 1]}, "stride=[0, 1]: expected 2 integers >= 1"),
    ({"padding": [1, 1, 1]}, "padding=[1, 1, 1]: expected 4 integers >= 0"),
    ({"groups": 2}, "groups=2 does not divide the input's 3 channels"),
    ({"weight": [4, 2, 3, 3]}, "weight: 2 input channels per group, but the input's 3"),
    ({"weight": [4, 3, 11, 3]}, "input 8x7: padded input 10x9 is smaller than the dilated kernel"),
    ({"cut": 1}, "segment 0 (input [2, 3, 8, 7] [N, C, H, W], float32, contiguous): 1340 "),
    ({"kind": "grad_weight"}, "segment 1 (grad_output [2, 4, 8, 7] [N, OC, OH, OW]"),
    ({"local": True}, "local: no operands were handed over in this emulator's process"),
]


@pytest.mark.parametrize("change, named", BAD, ids=[str(c) for c, _ in BAD])
async def test_bad_conv_is_refused_naming_the_problem(fleet, change, named):
    """Each refusal is ERROR bad_gemm naming the problem, to that job only: another job's
    GEMMs and convolutions go on being served."""
    f = await conv_fleet(fleet, block_size=8)
    bystander = await f.client()
    client = await f.client()
    rng = np.random.default_rng(5)
    geo = geometry(CASES["3x3 pad 1"])
    x = rng.standard_normal(geo["input_shape"]).astype(np.float32)
    w = rng.standard_normal(geo["weight_shape"]).astype(np.float32)
    request, _ = conv_request(7, "forward", x, w, **geo)
    fields = {k: v for k, v in change.items() if k != "cut"}
    if "cut" in change:
        fields["segments"] = (request.segments[0][: -change["cut"]], request.segments[1])
    with pytest.raises(EmulatorError) as info:
        await client.submit(
            Conv(**{**request.header(), "segments": request.segments, **fields}), timeout=TIMEOUT
        )
    assert info.value.code == "bad_gemm"
    assert info.value.reason.startswith("CONV 7: "), info.value.reason
    assert named in info.value.reason, info.value.reason
    y = await bystander.conv("forward", x, w, **geo, timeout=TIMEOUT)
    assert y.shape == (2, 4, 8, 7)
    await check_serving(bystander)


def test_client_refuses_what_makes_no_convolution():
    """``conv_request`` says what is wrong before anything is sent."""
    x, w = np.ones((1, 4, 5, 5), np.float32), np.ones((2, 2, 3, 3), np.float32)
    geo = {
        "input_shape": x.shape,
        "weight_shape": w.shape,
        "stride": (1, 1),
        "padding": (0, 0, 0, 0),
        "dilation": (1, 1),
        "groups": 2,
    }
    conv_request(1, "forward", x, w, **geo)  # (good)
    cases = [
        (("backward", x, w), {}, "convolution kind 'backward'"),
        (("forward", x[:, :, ::2], w), {}, "a must be a C-contiguous numpy array"),
        (("forward", x, w.astype(np.float64)), {}, "b is float64; a and b are one of"),
        (("forward", x.astype(np.float16), w), {}, "a is float16"),
        (("grad_input", x, w), {}, "grad_input: a has shape (1, 4, 5, 5), the output is"),
        (("forward", x, w), {"groups": 3}, "groups=3: the input's 4 channels and the weight"),
        (("forward", x, w), {"stride": (0, 1)}, "stride=(0, 1): expected 2 integers >= 1"),
        (("forward", x, w), {"input_shape": (1, 4, 5)}, "input_shape=(1, 4, 5): expected 4"),
    ]
    for args, changed, named in cases:
        with pytest.raises(ValueError) as info:
            conv_request(1, *args, **{**geo, **changed})
        assert named in str(info.value), (named, str(info.value))


@needs_torch
async def test_device_lost_mid_convolution_loses_nothing(fleet, caplog):
    """The device holding convolution tiles (its kernels gated) is cut off: its tiles,
    sent and queued, go to the others, and the product is whole and right."""
    caplog.set_level(logging.INFO, logger="morphling")
    problem = Problem(CASES["groups 2"], np.float32, seed=6)
    f = await fleet(block_size=3, window=2, policy="round-robin")
    gate = threading.Event()
    stuck_workers = WorkerPool([GatedCpuBackend(gate)])
    try:
        await f.add_device(name="steady")
        victim = await f.add_device(name="victim", workers=stuck_workers)
        client = await f.client()
        request, shape = conv_request(1, "forward", problem.x, problem.w, **problem.geo)
        running = asyncio.create_task(client.submit(request, timeout=TIMEOUT))
        record = f.record(victim)
        await wait_for_condition(lambda: len(record.outstanding) == 2, 5, "tiles on the victim")
        held, queued = sorted(record.outstanding), len(record.queue)
        victim.connection.transport.abort()
        victim.stop()
        result = await running
    finally:
        gate.set()
        stuck_workers.close()
    problem.check("forward", product_array(request, result, shape))
    assert result.requeued == len(held) + queued
    assert victim.device_id in result.devices
    lost = [r.getMessage() for r in caplog.records if "re-queued tiles" in r.getMessage()]
    assert len(lost) == 1 and "lost with 2 tiles in flight" in lost[0], lost
    await check_serving(client)


async def raw_old_device(peer: Any, seen: list[int]) -> None:
    """A device as an agent before convolutions: no ``caps.conv``; it computes TILEs from
    the wire format and notes every message type it is sent."""
    while (msg := await peer.recv(timeout=30)) is not None:
        seen.append(msg.TYPE)
        if isinstance(msg, Tile):
            a = np.frombuffer(msg.segments[0], msg.dtype)
            b = np.frombuffer(msg.segments[1], msg.dtype)
            sa = np.lib.stride_tricks.as_strided
            item = a.itemsize
            rows_a, cols_a = (msg.k, msg.m) if msg.ta else (msg.m, msg.k)
            rows_b, cols_b = (msg.n, msg.k) if msg.tb else (msg.k, msg.n)
            a2 = sa(a, (rows_a, cols_a), (msg.lda * item, item))
            b2 = sa(b, (rows_b, cols_b), (msg.ldb * item, item))
            c = (a2.T if msg.ta else a2) @ (b2.T if msg.tb else b2)
            peer.send(
                TileResult(
                    tile=msg.tile, compute_ns=1, segments=(np.ascontiguousarray(c, msg.dtype),)
                )
            )


async def test_no_convolution_tile_goes_to_a_device_without_caps_conv(fleet, caplog):
    """With only a device that does not say ``caps.conv``, a convolution's tiles wait (the
    job is told so, NOTICE) while its GEMMs are served; a device that computes
    convolutions joins and they go to it. The old device never sees a CONV_TILE."""
    caplog.set_level(logging.INFO, logger="morphling")
    f = await fleet(block_size=4, device_wait_notice_s=0.2)
    old = await f.raw_peer()
    welcome = await old.hello("device", name="old", profile=BUILTIN["rpi4"].to_wire())
    await wait_for_condition(
        lambda: (d := f.emu.registry.devices.get(welcome.peer_id)) is not None and d.ready,
        5,
        "the old device to be ready",
    )
    assert not f.emu.registry.devices[welcome.peer_id].conv
    seen: list[int] = []
    computing = asyncio.create_task(raw_old_device(old, seen))
    client = await f.client()
    rng = np.random.default_rng(7)
    geo = geometry(CASES["stride 2"])
    x = rng.standard_normal(geo["input_shape"]).astype(np.float64)
    w = rng.standard_normal(geo["weight_shape"]).astype(np.float64)
    waiting = asyncio.create_task(client.conv("forward", x, w, **geo, timeout=TIMEOUT))
    notice = "no device that computes convolutions (HELLO caps.conv) is ready"
    await wait_for_condition(
        lambda: any(notice in r.getMessage() for r in caplog.records), 5, "the job to be told"
    )
    await check_serving(client)  # GEMMs still go to the old device
    assert not waiting.done()
    agent = await f.add_device(name="new")
    y = await waiting
    assert f.record(agent).completed > 0
    assert MsgType.TILE in seen and MsgType.CONV_TILE not in seen, seen
    ref = ConvGeometry(
        geo["weight_shape"][2:], geo["stride"], geo["dilation"], geo["padding"], geo["groups"]
    )
    assert y.shape == (2, 5, *ref.output_size(9, 8))
    back = "devices are back"
    await wait_for_condition(
        lambda: any(back in r.getMessage() for r in caplog.records), 5, "the job to be told"
    )
    old.close()
    await computing


GRAD_INPUT_BANDS = {  # stride: (tiles, the dy rows each is given)
    # strided, the fold: bands of twice the halo, 4 rows, each given its 2 or 3 dy rows
    2: (4, [3, 3, 3, 2]),
    # stride 1, a forward convolution of dy: bands of one row, with one dy row above and below
    1: (16, [2, *[3] * 14, 2]),
}


@needs_torch
@pytest.mark.parametrize("stride", sorted(GRAD_INPUT_BANDS))
async def test_grad_input_bands_are_twice_the_halo_only_where_the_tile_folds(fleet, stride):
    """A strided grad_input tile computes every grad-output row that reaches its band, halo
    included; where the block would give bands of one row (a 3×3 kernel: three dy rows
    each, two thirds of the work outside the band), its bands are of twice the halo. A
    stride-1 tile computes its band alone, so its bands are as the block gives them. Each
    tile is given the dy rows that reach its band, and the product is torch's; the weight
    block, which every tile needs, crosses once to each device, which keeps it."""
    case = (2, 8, 16, 16, 8, (3, 3), (stride, stride), (1, 1, 1, 1), (1, 1), 1)
    problem = Problem(case, np.float32, seed=9)
    f = await conv_fleet(fleet, block_size=8)  # 64 outputs: less than one row's 256
    client = await f.client()
    request, shape = conv_request(1, "grad_input", problem.dy, problem.w, **problem.geo)
    result = await client.submit(request, timeout=TIMEOUT)
    problem.check("grad_input", product_array(request, result, shape))
    tiles, rows = GRAD_INPUT_BANDS[stride]
    assert result.requeued == 0 and result.tiles == tiles
    dy_row = problem.dy.nbytes // problem.dy.shape[2]
    weights = len(result.devices) * problem.w.nbytes
    assert (result.bytes_down - weights) / dy_row == sum(rows)
    await f.close()


@needs_torch
async def test_virtual_time_charges_regions_not_the_unfolded_matrix(fleet, tmp_path):
    """A 3×3 convolution's tiles carry their input rows (halo included) and weight block
    (once to each device, which keeps it for the convolution's other tiles): the emulated
    links are charged exactly the bytes the tiles were sent, far less than
    the unfolded (im2col) matrix, and its output's bytes back; the event log says the
    tiles were convolution tiles."""
    case = (2, 8, 16, 16, 8, (3, 3), (1, 1), (1, 1, 1, 1), (1, 1), 1)
    problem = Problem(case, np.float32, seed=8)
    run_dir = tmp_path / "run"
    f = await conv_fleet(fleet, block_size=32, run_dir=str(run_dir), events="full")
    client = await f.client()
    request, shape = conv_request(1, "forward", problem.x, problem.w, **problem.geo)
    result = await client.submit(request, timeout=TIMEOUT)
    problem.check("forward", product_array(request, result, shape))
    step = await client.step(1)
    # Tiles of about 32² outputs: all 8 output channels × bands of 4 of the 16 rows, each
    # band reading its rows and the 3×3 kernel's halo, [4·o0 − 1, 4·o1 + 1) within [0, 16).
    assert result.requeued == 0 and result.tiles == 4
    rows_read = sum(
        min(o1 + 1, 16) - max(o0 - 1, 0) for o0, o1 in ((0, 4), (4, 8), (8, 12), (12, 16))
    )
    regions = rows_read * 2 * 8 * 16 * 4  # [N, C, rows, W] float32
    weights = len(result.devices) * problem.w.nbytes
    assert step.link_down == result.bytes_down == regions + weights
    im2col = 2 * 8 * 9 * 16 * 16 * 4  # the unfolded input, [C·kh·kw, N·OH·OW] float32
    assert step.link_down < im2col / 4
    assert step.link_up == result.bytes_up == math.prod(shape) * 4
    await f.close()
    import gzip
    import json

    with gzip.open(run_dir / "events.jsonl.gz", "rt") as fh:
        events = [json.loads(line) for line in fh]
    tiles = [e for e in events if e["ev"] == "tile"]
    assert len(tiles) == result.tiles
    assert {e.get("op") for e in tiles} == {"conv_forward"}
    assert sum(e["bytes_down"] for e in tiles) == step.link_down
    (gemm,) = [e for e in events if e["ev"] == "gemm"]
    assert gemm["op"] == "conv_forward"
    assert (gemm["m"], gemm["n"], gemm["k"]) == (8, 2 * 16 * 16, 8 * 9)


@needs_torch
def test_device_process_killed_mid_convolution_loses_nothing(procs):
    """Real processes over loopback: ``morphling emulator``, a ``morphling device`` holding
    a convolution's tiles (stopped with SIGSTOP, so it keeps them) and then killed, and a
    ``morphling fleet`` that computes them all again; the job's operands and product cross
    the sockets as bytes, and the product is torch's."""
    problem = Problem((4, 16, 24, 24, 16, (3, 3), (1, 1), (1, 1, 1, 1), (1, 1), 2), np.float32, 10)
    emulator, port = procs.emulator("--block-size", "32", "--no-probe")
    victim = procs.device(port, "victim", "rpi4", "--no-share-memory", "--no-reconnect")
    procs.wait_for(emulator, "device 0 (victim) ready")
    victim.signal(signal.SIGSTOP)
    with Client("127.0.0.1", port, share_memory=False, timeout=30) as client:
        request, shape = conv_request(1, "forward", problem.x, problem.w, **problem.geo)
        answer: dict[str, Any] = {}
        job = threading.Thread(
            target=lambda: answer.update(result=client.submit(request, timeout=120))
        )
        job.start()
        procs.fleet(port, "rpi4:1", label="fleet")
        procs.wait_for(emulator, "device 1 (rpi4-0) ready")
        victim.signal(signal.SIGKILL)
        job.join(150)
        result = answer["result"]
    problem.check("forward", product_array(request, result, shape))
    assert result.devices == [0, 1] and result.requeued >= 1  # (all of them, unless the
    # fleet joined before the CONV was read)
    assert result.bytes_up == math.prod(shape) * 4  # each tile's product came back once
    procs.wait_for(emulator, "device 0 (victim) lost with")


@pytest.fixture(scope="module")
def embedded():
    """An emulator and three virtual devices in this process (``morphling run
    --embedded``'s); ``embedded(block)`` is a job on it with that block, made once."""
    fleet = EmbeddedFleet("rpi4:3", EmulatorConfig(probe=False, policy="round-robin"))
    host, port = fleet.start()
    clients: dict[int, Client] = {}

    def client(block: int) -> Client:
        if block not in clients:
            clients[block] = Client(host, port, block=block, timeout=30)
        return clients[block]

    try:
        yield client
    finally:
        for c in clients.values():
            c.close()
        fleet.stop()


@st.composite
def convolutions(draw: Any) -> tuple[tuple, Any, int]:
    """A small convolution (a case of ``CASES``' form) that fits, a dtype and a block."""
    groups = draw(st.integers(1, 3))
    kernel = (draw(st.integers(1, 3)), draw(st.integers(1, 3)))
    stride = (draw(st.integers(1, 3)), draw(st.integers(1, 3)))
    dilation = (draw(st.integers(1, 2)), draw(st.integers(1, 2)))
    padding = tuple(draw(st.integers(0, 2)) for _ in range(4))
    reach = [d * (k - 1) + 1 for d, k in zip(dilation, kernel, strict=True)]
    h = draw(st.integers(max(1, reach[0] - padding[0] - padding[1]), 8))
    w = draw(st.integers(max(1, reach[1] - padding[2] - padding[3]), 8))
    c, oc = groups * draw(st.integers(1, 3)), groups * draw(st.integers(1, 3))
    case = (draw(st.integers(1, 2)), c, h, w, oc, kernel, stride, padding, dilation, groups)
    return (
        case,
        draw(st.sampled_from([np.float32, np.float64])),
        draw(st.sampled_from([1, 2, 5, 64])),
    )


@needs_torch
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(convolution=convolutions(), seed=st.integers(0, 2**16))
def test_any_small_convolution_in_the_emulators_process_matches_torch(embedded, convolution, seed):
    """Every kind, whatever the geometry and block, computed by an in-process fleet that
    is handed the job's arrays (nothing crosses a socket) — while virtual time still
    charges the emulated links the bytes of every tile's operands."""
    case, dtype, block = convolution
    problem = Problem(case, dtype, seed)
    client = embedded(block)
    for kind in KINDS:
        problem.check(
            kind, client.conv(kind, *problem.operands(kind), **problem.geo, timeout=TIMEOUT)
        )
    step = client.step(client.steps + 1)
    assert step.bytes_down == step.bytes_up == 0  # handed over, not sent
    # grad_weight's tiles alone carry all of x and dy, forward's all of w, unless a device
    # held those bytes already (an example run again, as hypothesis does)
    operands = sum(x.nbytes for x in (problem.x, problem.w, problem.dy))
    assert step.link_down + step.link_saved >= operands
    item = np.dtype(dtype).itemsize  # every tile's block of the product, back once
    assert step.link_up == sum(problem.want[k].size * item for k in KINDS)


async def raw_conv_device(peer: Any) -> int:
    """A device written from docs/PROTOCOL.md (*Convolution tiles*) alone, in torch: each
    CONV_TILE's product by the formulas there, not by ``kernels.conv``. Returns the tiles
    answered."""
    answered = 0
    while (msg := await peer.recv(timeout=30)) is not None:
        if msg.TYPE != MsgType.CONV_TILE:
            continue
        a, b = (
            torch.from_numpy(np.frombuffer(segment, msg.dtype).reshape(shape).copy())
            for segment, shape in zip(msg.segments, (msg.a_shape, msg.b_shape), strict=True)
        )
        top, bottom, left, right = msg.padding
        how = {"stride": msg.stride, "dilation": msg.dilation, "groups": msg.groups}
        if msg.kind == "forward":
            c = F.conv2d(F.pad(a, (left, right, top, bottom)), b, **how)
        elif msg.kind == "grad_input":
            (h, w), (i0, i1) = msg.input_size, msg.rows
            channels = msg.groups * b.shape[1]
            padded = (a.shape[0], channels, top + h + bottom, left + w + right)
            oh = (padded[2] - msg.dilation[0] * (b.shape[2] - 1) - 1) // msg.stride[0] + 1
            dy = torch.zeros((a.shape[0], a.shape[1], oh, a.shape[3]), dtype=a.dtype)
            dy[:, :, msg.oh_lo : msg.oh_lo + a.shape[2]] = a  # the rows not sent are zero
            dxp = torch.nn.grad.conv2d_input(padded, b, dy, **how)
            c = dxp[:, :, top + i0 : top + i1, left : left + w]
        else:
            weight = (b.shape[1], a.shape[1] // msg.groups, *msg.kernel)
            c = torch.nn.grad.conv2d_weight(F.pad(a, (left, right, top, bottom)), weight, b, **how)
        peer.send(
            TileResult(tile=msg.tile, compute_ns=1, segments=(np.ascontiguousarray(c.numpy()),))
        )
        answered += 1
    return answered


@needs_torch
@pytest.mark.parametrize(
    "case",
    [
        "stride, dilation, asymmetric padding",
        "depthwise, multiplier 2, stride 2, dilation 2",
        "groups 2",
        "1x1 stride 2 (rows and columns never read)",
    ],
)
async def test_a_device_written_from_the_protocol_computes_conv_tiles(fleet, case):
    """The emulator's tiles are what the protocol document says: a device that computes
    them from its formulas (in torch, not ``kernels.conv``) gives every product right."""
    problem = Problem(CASES[case], np.float64, seed=11)
    f = await fleet(block_size=3)
    peer = await f.raw_peer()
    welcome = await peer.hello(
        "device", name="from-the-doc", profile=BUILTIN["rpi4"].to_wire(), caps={"conv": 1}
    )
    await wait_for_condition(
        lambda: (d := f.emu.registry.devices.get(welcome.peer_id)) is not None and d.ready,
        5,
        "the raw device to be ready",
    )
    computing = asyncio.create_task(raw_conv_device(peer))
    client = await f.client()
    for kind in KINDS:
        got = await client.conv(kind, *problem.operands(kind), **problem.geo, timeout=TIMEOUT)
        problem.check(kind, got)
    record = f.emu.registry.devices[welcome.peer_id]
    peer.close()
    assert await computing == record.completed > 3 * 2
