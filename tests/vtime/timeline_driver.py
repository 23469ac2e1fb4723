"""Driving a ``Timeline`` by hand, as the emulator does: device profiles, GEMM and
convolution tasks from the emulator's partition, and a recorder of what the timeline hands
back."""

from __future__ import annotations

import io
import itertools
import json

import numpy as np
from morphling.devices.models.profiles import DeviceProfile
from morphling.proxy.emulator.conv_partition import ConvTask, make_conv_task
from morphling.proxy.emulator.partition import GemmTask, make_task
from morphling.proxy.vtime.eventlog import EventLog
from morphling.proxy.vtime.timeline import Timeline
from morphling.proxy.wire.messages import Conv, Gemm

MB = 1e6


def profile(
    name: str = "t",
    *,
    flops: float = 1e9,
    bw: float = MB,
    lat: float = 0.001,
    memory: int = 1 << 30,
    thermal: dict | None = None,
) -> DeviceProfile:
    return DeviceProfile(
        name=name,
        flops=flops,
        memory_bytes=memory,
        dl_bw=bw,
        ul_bw=bw,
        dl_lat_s=lat,
        ul_lat_s=lat,
        kind="cpu",
        blas="test",
        source="test",
        thermal=thermal or {},
    )


_seeds = itertools.count()


def task(gemm: int, m: int, n: int, k: int, *, weight_b: tuple[int, int] | None = None) -> GemmTask:
    # values of its own: devices keep panels by their bytes (blocks of ones are one panel)
    rng = np.random.default_rng(next(_seeds))
    a = rng.standard_normal((m, k), np.float32)
    b = rng.standard_normal((k, n), np.float32)
    request = Gemm(
        gemm=gemm,
        dtype="float32",
        ta=False,
        tb=False,
        m=m,
        n=n,
        k=k,
        lda=k,
        ldb=n,
        segments=(memoryview(a).cast("B"), memoryview(b).cast("B")),
    )
    t = make_task(request)
    if weight_b is not None:  # as if B lay in the shared weights at this offset, version
        t.weights["b"] = weight_b
    return t


def sustained(gemm: int, batch: int) -> GemmTask:
    """``batch`` pivots of one 64×64×65536 GEMM (22.6 ms on a Pi 4): a load that heats."""
    m = n = 64
    k = 65536
    a, b = np.ones((m, k), np.float32), np.ones((k, n), np.float32)
    segments = (memoryview(a).cast("B"), memoryview(b).cast("B"))
    return make_task(
        Gemm(
            gemm=gemm,
            dtype="float32",
            ta=False,
            tb=False,
            m=m,
            n=n,
            k=k,
            lda=k,
            ldb=n,
            batch=batch,
            segments=segments,
        )
    )


def conv_task(
    gemm: int,
    kind: str,
    input_shape: tuple[int, int, int, int],
    weight_shape: tuple[int, int, int, int],
    *,
    stride: tuple[int, int] = (1, 1),
    padding: tuple[int, int, int, int] = (1, 1, 1, 1),
    groups: int = 1,
) -> ConvTask:
    """A convolution's product ``kind`` over operands of ones."""
    n, _, h, w = input_shape
    oh = (h + padding[0] + padding[1] - weight_shape[2]) // stride[0] + 1
    ow = (w + padding[2] + padding[3] - weight_shape[3]) // stride[1] + 1
    shapes = {
        "input": input_shape,
        "weight": weight_shape,
        "grad_output": (n, weight_shape[0], oh, ow),
    }
    first, second = {
        "forward": ("input", "weight"),
        "grad_input": ("grad_output", "weight"),
        "grad_weight": ("input", "grad_output"),
    }[kind]
    a, b = (np.ones(shapes[name], np.float32).reshape(-1) for name in (first, second))
    request = Conv(
        gemm=gemm,
        kind=kind,
        dtype="float32",
        input=list(input_shape),
        weight=list(weight_shape),
        stride=list(stride),
        dilation=[1, 1],
        padding=list(padding),
        groups=groups,
        segments=(a, b),
    )
    return make_conv_task(request)


class Recorder:
    """Collects what the timeline hands out: placements and GEMM ends."""

    def __init__(self) -> None:
        self.placed: list[tuple[int, int]] = []  # (tile id, device id)
        self.tiles: list = []  # the tiles themselves, in placement order
        self.ended: dict[int, tuple[float, float]] = {}

    def place(self, placed):
        self.placed.extend((tile.id, device) for tile, device, _ in placed)
        self.tiles.extend(tile for tile, _, _ in placed)

    def done_for(self, gemm_id: int):
        return lambda issue, end: self.ended.__setitem__(gemm_id, (issue, end))


def submit(
    tl: Timeline,
    rec: Recorder,
    job: int,
    t: GemmTask | ConvTask,
    block: int,
    *,
    after: int = 0,
    host_s: float = 0.0,
    host_split: dict[str, int] | None = None,
) -> None:
    tiles = t.tiles(block) if isinstance(t, GemmTask) else t.tiles(block, 1 << 20)
    tl.submit(
        job, t, tiles, after=after, host_s=host_s, host_split=host_split, place=rec.place,
        done=rec.done_for(t.id),
    )  # fmt: skip


def records(sink: io.BytesIO, kind: str) -> list[dict]:
    return [r for r in map(json.loads, sink.getvalue().splitlines()) if r["ev"] == kind]


def new_timeline(
    policy: str = "greedy", level: str = "full", detail_steps: int = 1000, **kw
) -> tuple[Timeline, io.BytesIO]:
    sink = io.BytesIO()
    return Timeline(policy, log=EventLog(sink, level=level, detail_steps=detail_steps), **kw), sink
