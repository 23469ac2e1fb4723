"""The coordinator's hardware identity: ``--coordinator host`` (measured or modelled) or a
profile whose op model prices the script's own work.

Over the real path: ``morphling run`` with ``--coordinator rpi4`` trains a ResNet on one
emulated Raspberry Pi 4, the same timeline twice; the work is priced by class; a board
without cooling throttles as its devices do.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from morphling.devices.models.profiles import BUILTIN, with_cooling
from morphling.proxy.job.coordinator import HostWork, coordinator_profile
from processes import SCRIPTS, morphling_run


def _single_board(tmp_path: Path, name: str) -> dict:
    out = tmp_path / f"{name}.json"
    proc = morphling_run(
        "--embedded", "--devices", "rpi4:1", "--coordinator", "rpi4", "--link", "ideal",
        "--run-dir", str(tmp_path / name), "--json", str(out), "--",
        "python", str(SCRIPTS / "train_resnet.py"), str(tmp_path / f"{name}.pt"), cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


def test_a_script_trained_on_one_board_is_the_same_timeline_on_any_run(tmp_path: Path) -> None:
    """The whole step on the board: its convolutions on the device, everything else on the
    coordinator, priced by the rpi4's op model, not by this (loaded) host's clock."""
    first, second = _single_board(tmp_path, "a"), _single_board(tmp_path, "b")
    steps = [(s["emulated_s"], s["coord_s"]) for s in first["steps"]]
    assert steps == [(s["emulated_s"], s["coord_s"]) for s in second["steps"]]
    assert all(coord > 0 and emulated > coord for emulated, coord in steps)
    assert all(s["convs"] > 0 for s in first["steps"])
    run = json.loads((tmp_path / "a" / "run.json").read_text())
    assert (run["coordinator"], run["coordinator_time"]) == ("rpi4", "model")


def test_host_stays_measured_by_default_and_a_profile_is_modelled() -> None:
    assert coordinator_profile("host") is None
    profile = coordinator_profile("rpi5", cooling="fan")
    assert profile is not None and profile.cooling == "fan" and profile.ops


@pytest.mark.parametrize(
    ("name", "mode", "message"),
    [
        ("pi9", None, "--coordinator pi9: unknown profile 'pi9'; built-ins are agx-orin, host"),
        ("rpi4", "measured", "only this host's (--coordinator host) can be measured"),
        ("host", "sometimes", "coordinator time 'sometimes': expected one of measured, model"),
    ],
)
def test_bad_coordinators_are_refused(name: str, mode: str | None, message: str) -> None:
    with pytest.raises(ValueError) as caught:
        coordinator_profile(name, mode)
    assert message in str(caught.value)


def test_work_is_priced_by_class() -> None:
    work = HostWork(with_cooling(BUILTIN["rpi4"], "fan"))
    work.op("normalization", 1 << 20, 0, 8.0 * (1 << 18))
    work.op("elementwise", 1 << 20, 0, 0.0)
    work.op("other", 0, 0, 0.0)
    work.product("gemm", 1e6)
    split = work.take()
    assert set(split) == {"normalization", "elementwise", "other", "gemm"}
    assert split["normalization"] > split["elementwise"] > split["other"] > 0
    assert work.take() == {}  # taken: nothing left


def test_an_uncooled_coordinator_throttles() -> None:
    """Minutes of back-to-back work: the rpi4 without cooling heats past its throttle point
    and runs slower; with a fan it keeps its top clock."""

    def minutes_of_work(cooling: str) -> list[int]:
        work = HostWork(with_cooling(BUILTIN["rpi4"], cooling))
        taken = []
        for _ in range(400):  # about a second of memory-bound work each
            work.op("elementwise", 4 << 30, 0, 0.0)
            taken.append(sum(work.take().values()))
        return taken

    fan, none = minutes_of_work("fan"), minutes_of_work("none")
    assert fan[0] == none[0]  # a cool board: the same at first
    assert len(set(fan)) == 1  # never throttled
    assert none[-1] > 1.2 * none[0]  # throttled: the same work takes longer
