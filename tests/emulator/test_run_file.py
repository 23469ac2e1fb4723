"""``run.json``'s fleet: each device's figures, never its long fitted models."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from morphling.devices.models.conv import ConvModel
from morphling.devices.models.profiles import load_profile
from morphling.proxy.emulator.server import Emulator
from morphling.proxy.emulator.settings import EmulatorConfig
from morphling.proxy.vtime.eventlog import RUN_FILE


def test_run_json_leaves_out_a_devices_convolution_model(tmp_path: Path) -> None:
    """A measured profile's [conv] table (a whole fitted model: 200 KB for this host's) was
    copied into run.json for every device of the fleet, as its GEMM model is not."""
    fitted = ConvModel.analytic(2e10, mem_bw=1e10).to_dict()
    profile = dataclasses.replace(load_profile("rpi4"), conv=fitted)
    emulator = Emulator(EmulatorConfig(run_dir=str(tmp_path), events="off"))
    emulator.timeline.add_device(1, "board", profile)
    emulator.write_run()
    (entry,) = json.loads((tmp_path / RUN_FILE).read_text())["fleet"]
    assert entry["name"] == "board" and entry["profile"] == "rpi4"
    assert "conv" not in entry and "compute" not in entry
    assert entry["thermal"] is True  # whether it heats up, not its model
