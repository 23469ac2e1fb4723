"""Convolution tiles in virtual time: placed only on devices that compute them (waiting
until one has joined), their links charged the bytes of what they are sent (input rows,
output-gradient rows, weight blocks), their compute priced as the FLOPs they compute, and the
event log saying which product each was."""

from __future__ import annotations

import dataclasses
import math

import pytest
from morphling.devices.models.conv import ConvModel
from morphling.kernels import conv_flops
from morphling.proxy.emulator.conv_partition import ConvTileTask
from timeline_driver import MB, Recorder, conv_task, new_timeline, profile, records, submit, task


@pytest.mark.parametrize("policy", ["round-robin", "load-balanced", "greedy"])
def test_conv_tiles_go_only_to_devices_that_compute_them(policy):
    tl, _ = new_timeline(policy)
    for device in range(4):
        tl.add_device(device, f"d{device}", profile(), convolutions=device in (1, 3))
    tl.open_job(1, "job")
    gemms, convs = Recorder(), Recorder()
    submit(tl, gemms, 1, task(1, 400, 400, 64), block=100)  # sixteen tiles
    conv = conv_task(2, "forward", (2, 8, 16, 16), (8, 8, 3, 3))
    submit(tl, convs, 1, conv, block=16)
    assert {device for _, device in convs.placed} == {1, 3}
    assert len(convs.placed) == conv.remaining > 4
    assert {device for _, device in gemms.placed} >= {0, 2}  # GEMM tiles go anywhere
    assert set(convs.ended) == {2}


def test_a_convolution_waits_for_a_device_that_computes_them():
    """With no such device its tiles stay unplaced while other work goes on; the first
    that joins takes them all."""
    tl, _ = new_timeline("round-robin")
    tl.add_device(0, "old", profile(), convolutions=False)
    tl.open_job(1, "conv job")
    tl.open_job(2, "gemm job")
    convs, gemms = Recorder(), Recorder()
    submit(tl, convs, 1, conv_task(1, "grad_weight", (2, 4, 8, 8), (4, 4, 3, 3)), block=4)
    submit(tl, gemms, 2, task(1, 100, 100, 100), block=50)
    assert tl.stalled == 1 and not convs.placed and not convs.ended
    assert gemms.placed and set(gemms.ended) == {1}
    tl.close_job(2)  # (an open job idle on the host holds the clock back)
    tl.add_device(1, "new", profile(), convolutions=True)
    assert tl.stalled == 0 and convs.placed
    assert {device for _, device in convs.placed} == {1} and set(convs.ended) == {1}


@pytest.mark.parametrize("kind", ["forward", "grad_input", "grad_weight"])
def test_a_conv_tile_costs_what_it_is_sent_and_its_dense_flops(kind):
    """Down: its two operands as sent (input region with its halo, or output-gradient
    rows, and the weight block; for grad_weight the channels' input and output gradient)
    over the link, but for those an earlier tile left on the device (its panels);
    compute: the dense formulation's FLOPs at the device's rate (a grad input tile of one
    channel takes the depthwise path, which computes its band's share of the whole, not
    every dy row it is sent); up: its block of the product. The log records each tile as
    the convolution's."""
    tl, sink = new_timeline()
    flops = 1e9
    tl.add_device(0, "d0", profile(flops=flops))
    tl.open_job(1, "job")
    conv = conv_task(1, kind, (2, 6, 12, 10), (4, 3, 3, 3), stride=(1, 2), groups=2)
    rec = Recorder()
    submit(tl, rec, 1, conv, block=2)
    tiles: list[ConvTileTask] = rec.tiles
    logged = records(sink, "tile")
    assert len(logged) == len(tiles) > 3
    held: set[int] = set()
    for tile, record in zip(tiles, logged, strict=True):
        assert record["op"] == f"conv_{kind}"
        operands = tile.operands()
        assert record["bytes_down"] == sum(x.nbytes for x in operands if x.panel not in held)
        held.update(x.panel for x in operands)
        assert record["bytes_up"] == 4 * math.prod(tile.shape)
        dy, weight = {
            "forward": (tile.shape, tile.b.shape),
            "grad_input": (tile.a.shape, tile.b.shape),
            "grad_weight": (tile.b.shape, tile.shape),
        }[kind]
        work = conv_flops(dy, weight)
        if kind == "grad_input" and weight[1] == 1:
            n, _, height, _ = conv.input_shape
            whole = conv_flops((n, weight[0], *conv.output_shape[2:]), weight)
            work = whole * tile.shape[2] / height
        start, end = record["compute"]
        assert end - start == pytest.approx(work / flops)
        down0, down1 = record["down"]
        sent = record["bytes_down"]  # (nothing to send: nothing crosses, no latency either)
        assert down1 - down0 == pytest.approx(0.001 + sent / MB if sent else 0.0)
    (gemm,) = records(sink, "gemm")
    assert gemm["op"] == f"conv_{kind}" and gemm["tiles"] == len(tiles)


def test_a_conv_tile_is_priced_by_the_devices_convolution_model():
    """A profile's own convolution model ([conv]: here a quarter of its GEMM rate, as a
    memory-bound depthwise kernel might be) prices its conv tiles; its GEMM tiles keep the
    GEMM model's price. (The clock priced conv tiles as their implicit GEMM, whatever the
    profile's convolution model said.)"""
    tl, sink = new_timeline()
    slow_convs = ConvModel.analytic(0.25e9).to_dict()
    tl.add_device(0, "d0", dataclasses.replace(profile(flops=1e9), conv=slow_convs))
    tl.open_job(1, "job")
    submit(tl, Recorder(), 1, task(1, 64, 64, 64), block=64)
    conv = conv_task(2, "forward", (2, 4, 8, 8), (4, 4, 3, 3))
    rec = Recorder()
    submit(tl, rec, 1, conv, block=64)
    gemm_tile, *conv_tiles = records(sink, "tile")
    start, end = gemm_tile["compute"]
    assert end - start == pytest.approx(2 * 64**3 / 1e9)
    for tile, record in zip(rec.tiles, conv_tiles, strict=True):
        start, end = record["compute"]
        assert end - start == pytest.approx(conv_flops(tile.shape, tile.b.shape) / 0.25e9)
