"""Reports of a fleet too large for a row or a bar per device (``at_scale``): the heat
map's occupancy to the second, and every plot of a 2,000-device run drawn in summary."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest
from hand_run import FLEET, T, schedule_events, write_run
from morphling.proxy.report.at_scale import group_means, occupancy, rank_groups
from morphling.proxy.report.files import write_reports
from morphling.proxy.report.plots import MAX_TIMELINE_DEVICES


def test_occupancy_shares_each_span_among_the_bins_it_crosses() -> None:
    """Bins of 1 s over [0, 4): a span inside one bin, one across three, one reaching past
    the end (cut there), one before the start (left out), on two rows."""
    spans = np.array([[0.25, 0.75], [0.5, 2.25], [3.5, 9.0], [-2.0, -1.0]])
    rows = np.array([0, 0, 1, 1])
    got = occupancy(spans, rows, 2, 0.0, 4.0, 4)
    assert got.tolist() == [[1.0, 1.0, 0.25, 0.0], [0.0, 0.0, 0.0, 0.5]]


def test_groups_of_ranked_devices_and_their_means() -> None:
    starts = rank_groups(10, 4)
    assert starts.tolist() == [0, 2, 5, 7]
    assert group_means(list(range(10)), starts).tolist() == [0.5, 3.0, 5.5, 8.0]
    assert rank_groups(3, 200).tolist() == [0, 1, 2]  # no more groups than devices


def _png_height(path: Path) -> int:
    return struct.unpack(">I", path.read_bytes()[20:24])[0]


@pytest.mark.parametrize("devices", [MAX_TIMELINE_DEVICES, 2000])
def test_a_large_fleets_plots_summarise_it(tmp_path: Path, devices: int) -> None:
    """One GEMM with a tile on each device, of four durations. Past MAX_TIMELINE_DEVICES the
    timeline gains the heat map of every device above its busiest rows (a taller image);
    every plot is drawn."""
    fleet = [{**FLEET[0], "id": i, "name": f"d-{i}"} for i in range(devices)]
    tiles = [T(i, 0.25, 0.25 * (1 + i % 4), 0.25) for i in range(devices)]
    run_dir = write_run(tmp_path / "run", schedule_events([[0.5, tiles, 0.25]]), fleet=fleet)
    paths = {p.name: p for p in write_reports(run_dir)}
    assert {"timeline.png", "utilisation.png", "device_time.png"} <= paths.keys()
    rows = 0.35 * MAX_TIMELINE_DEVICES  # inches of busiest rows, 120 dots each
    heat = devices > MAX_TIMELINE_DEVICES
    assert _png_height(paths["timeline.png"]) == round(120 * ((4.6 if heat else 1.6) + rows))
