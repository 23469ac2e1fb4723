"""BENCHMARKS.md's rendering: target groups as figure rows, published measurements as a
table of their own (the calibration table)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from bench_report import render


def test_published_measurements_get_their_own_table(tmp_path):
    calibration = {
        "meta": {"batch": 16},
        "rpi4_resnet18": {"board": "rpi4", "model": "resnet18", "role": "calibration",
                          "published_s": 10.92, "emulated_s": 10.9, "ratio": 0.998},
        "rpi5_mobilenet_v2": {"board": "rpi5", "model": "mobilenet_v2", "role": "prediction",
                              "published_s": None, "emulated_s": 7.9, "ratio": None},
    }  # fmt: skip
    (tmp_path / "calibration.json").write_text(json.dumps(calibration))
    (tmp_path / "net.json").write_text(
        json.dumps({"verify": {"detected": 1.0, "met": True, "target_detected_min": 1.0}})
    )
    text = render(tmp_path)
    assert "| `rpi4` | resnet18 | 10.92 | 10.9 | 0.998 | calibration |" in text
    assert "| `rpi5` | mobilenet_v2 | — | 7.9 | — | prediction |" in text
    assert "| `verify` | `verify.detected` = 1.0 | detected_min = 1.0 | met |" in text
    assert text.index("## calibration") < text.index("## net")
