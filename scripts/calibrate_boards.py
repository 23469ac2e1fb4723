#!/usr/bin/env python3
"""Calibrate the built-in CPU boards' convolution models against end-to-end training.

``REFERENCE.md`` gives three published training measurements (Flower's Raspberry Pi
benchmark: seconds per batch of 16 3×224×224 images, SGD): ResNet-18 and MobileNetV2 on a
Pi 4, ResNet-18 on a Pi 5. ``devices/models/board_ops.py`` says how a board's models are
built from them; this script finds their two unknowns, the share of the board's GEMM rate a
dense convolution reaches (``e``) and a depthwise one (``d``), over the real path: each model
trained for one step under ``morphling.emulate`` on one board as its own coordinator
(``--devices BOARD:1 --coordinator BOARD --link ideal --cooling fan``: the published figures
do not say how the boards were cooled, so runs that do not throttle).

The emulated step is ``A + B/e + C/d``: the coordinator's work, the links and the classifier
(A) do not depend on e and d, the convolution tiles' FLOPs do, dense (B) and depthwise (C)
apart. Three runs with (e, d) = (1, 1), (1/2, 1), (1, 1/2) give A, B and C (two for a model
without depthwise convolutions); the Pi 4's two figures then fix its e and d, the Pi 5's one
its e, its d keeping the Pi 4's ratio d/e. ``--check`` trains each model for a step on
every built-in board as it is, beside the published figure where there is one: the
calibration table of BENCHMARKS.md (``make bench`` writes it to
``bench-results/calibration.json``); the other pairs are the profiles' predictions.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import tempfile
from pathlib import Path

import numpy as np
from edge_cnns import MODELS, train
from morphling.devices.models.profiles import BUILTIN
from morphling.devices.profiler.toml_writer import dump_toml
from morphling.proxy.emulator.settings import EmulatorConfig
from morphling.proxy.job.session import emulate

BATCH, SIZE = 16, 224
# (board, model): published seconds per batch (REFERENCE.md, Flower's benchmark)
PUBLISHED = {("rpi4", "resnet18"): 10.92, ("rpi4", "mobilenet_v2"): 15.27,
             ("rpi5", "resnet18"): 5.84}  # fmt: skip
_MODELS = ("flops", "depthwise_flops")
RUN = "--devices BOARD:1 --coordinator BOARD --link ideal --cooling fan"


def emulated_step(board: str, model: str, scale: tuple[float, float], where: Path) -> float:
    """Emulated seconds of one training step of ``model`` on ``board`` whose dense and
    depthwise convolution rates are multiplied by ``scale``."""
    profile = BUILTIN[board]
    conv = {**profile.conv, **{k: profile.conv[k] * s for k, s in zip(_MODELS, scale, strict=True)}}
    fields = dataclasses.asdict(profile)
    tables = {key: fields.pop(key) for key in ("compute", "conv", "thermal", "ops")}
    tables["conv"] = conv
    path = where / f"{board}-{scale[0]}-{scale[1]}.toml"
    path.write_text(dump_toml({"profile": fields, **{k: v for k, v in tables.items() if v}}))
    return one_board_step(str(path), model, where)


def one_board_step(board: str, model: str, where: Path) -> float:
    """Emulated seconds of one training step of ``model`` on ``board`` (a built-in name or
    a profile file) as its own coordinator, as ``RUN`` says."""
    config = EmulatorConfig(run_dir=str(where / f"run-{Path(board).stem}-{model}"), events="off")
    with emulate(devices=f"{board}:1", coordinator=board, link="ideal", cooling="fan",
                 config=config) as session:  # fmt: skip
        train(model, BATCH, SIZE, 1)
    return session.steps[-1].emulated_s


def solve(where: Path) -> dict[str, dict[str, float]]:
    """e and d per board (the module docstring says how)."""
    terms = {}
    for board, model in PUBLISHED:
        base = emulated_step(board, model, (1, 1), where)
        dense = emulated_step(board, model, (0.5, 1), where) - base  # B
        depthwise = 0.0
        if model != "resnet18":  # it has no depthwise convolution
            depthwise = emulated_step(board, model, (1, 0.5), where) - base
        terms[(board, model)] = (base - dense - depthwise, dense, depthwise)  # A, B, C
        print(f"{board} {model}: A {terms[(board, model)][0]:.3f} s, B {dense:.3f} s, "
              f"C {depthwise:.3f} s (at the built-in rates)")  # fmt: skip
    rows = [("rpi4", "resnet18"), ("rpi4", "mobilenet_v2")]
    a = np.array([[terms[r][1], terms[r][2]] for r in rows])
    b = np.array([PUBLISHED[r] - terms[r][0] for r in rows])
    inv_e, inv_d = np.linalg.solve(a, b)  # relative to the built-in rates
    now4 = BUILTIN["rpi4"].conv
    e4, d4 = now4["flops"] / inv_e, now4["depthwise_flops"] / inv_d
    r5 = terms[("rpi5", "resnet18")]
    e5 = BUILTIN["rpi5"].conv["flops"] * r5[1] / (PUBLISHED[("rpi5", "resnet18")] - r5[0])
    gemm4, gemm5 = BUILTIN["rpi4"].flops, BUILTIN["rpi5"].flops
    return {
        "rpi4": {"conv_efficiency": e4 / gemm4, "depthwise_efficiency": d4 / gemm4},
        "rpi5": {"conv_efficiency": e5 / gemm5, "depthwise_efficiency": e5 / gemm5 * d4 / e4},
    }


def check(where: Path) -> dict[str, object]:
    """Every built-in board and model, each published figure beside its emulated step, as
    ``bench-results/calibration.json``'s groups (BENCHMARKS.md's calibration table). The
    pairs REFERENCE.md has no figure for are the profiles' predictions."""
    meta = {"source": "REFERENCE.md, Flower's Raspberry Pi benchmark", "batch": BATCH,
            "image": f"3x{SIZE}x{SIZE}", "run": RUN, "steps": 1,
            "roles": "calibration: the profile was fitted to this figure; prediction: "
                     "REFERENCE.md has no figure for it"}  # fmt: skip
    groups: dict[str, object] = {"meta": meta}
    for board in BUILTIN:
        for model in MODELS:
            step = one_board_step(board, model, where)
            published = PUBLISHED.get((board, model))
            groups[f"{board}_{model}"] = {
                "board": board,
                "model": model,
                "role": "prediction" if published is None else "calibration",
                "published_s": published,
                "emulated_s": round(step, 3),
                "ratio": None if published is None else round(step / published, 3),
            }
            print(f"{board} {model}: emulated {step:.3f} s, published {published or '-'} s")
    return groups


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--check",
        action="store_true",
        help="only compare the built-in profiles with the published figures",
    )
    parser.add_argument("--json", help="also write the result here")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    with tempfile.TemporaryDirectory() as tmp:
        result: object = check(Path(tmp)) if args.check else solve(Path(tmp))
    print(json.dumps(result, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
