"""Host as device: a training step emulated on a one-device ``host`` fleet vs run natively.

The real path once: the demo model's step script (``scripts/bench_host.py``, torch on one
thread) runs natively and through ``morphling run --embedded --devices host:1 --link ideal
--coordinator-time measured`` with the ``host`` profile (one BLAS thread) read from a
cache this test fills first. The emulated step (the GEMMs' time on the device's compute
model plus the script's own time between them) must come within 35 % of the native one.

Why 35 % and not the issue's 10 %: the 10 % is a timed target, and ``bench_host.py``
reports it (``bench-results/host.json``) from more reps; a unit test runs on a shared,
noisy 2-core host, where measured coordinator time moves with the load (that is what
measured means), and its profile is a smaller plan than the built-in's (400 shapes, two
rounds). The native and emulated runs alternate, three of each, and the median of the
three ratios is held to the bound: a native reference timed once read 0.62× when the
other test worker's load landed on it alone. What 35 % still catches: coordinator time
that counts Morphling's own work (routing every op through Python, or the GEMMs' round
trips) reads 1.5× and more, and a step that lost its GEMM part reads about 0.5×.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from morphling.devices.profiler.host_cache import cached_host_profile
from morphling.devices.profiler.profile_file import Plan

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from bench_host import THREADS, emulated, host_env, native, write_step_script

# Two rounds: with one, a busy moment while measuring moved the fleet part by up to 30 %.
PLAN = Plan(grid=400, heldout=20, conv_grid=50, conv_heldout=5, rounds=2, duration_s=0.2)
STEPS = 10
REPS = 3
TOLERANCE = 0.35


def test_host_fleet_emulates_a_training_step_close_to_native(tmp_path):
    cached_host_profile(threads=THREADS, directory=tmp_path / "cache" / "morphling", plan=PLAN)
    env = host_env(tmp_path / "cache")
    script = write_step_script(tmp_path)
    readings = []
    for rep in range(REPS):
        reference = native(script, STEPS, env)
        emulation = emulated(script, STEPS, env, tmp_path / f"run{rep}")
        assert "measuring this host" not in emulation["stderr"]  # the cached profile was used
        assert emulation["fleet_s"] > 0 and emulation["coord_s"] > 0
        readings.append((emulation["emulated_s"] / reference["step_s"], emulation, reference))

    run = json.loads((tmp_path / "run0" / "run.json").read_text())
    assert [d["profile"] for d in run["fleet"]] == ["host"]
    assert run["coordinator_time"] == "measured" and run["link"] == "ideal"
    ratio, emulation, reference = sorted(readings, key=lambda r: r[0])[REPS // 2]
    assert abs(ratio - 1) <= TOLERANCE, (
        f"median of {REPS} alternating reps: emulated {emulation['emulated_s'] * 1e3:.1f} ms "
        f"(fleet {emulation['fleet_s'] * 1e3:.1f} + coordinator "
        f"{emulation['coord_s'] * 1e3:.1f}) vs native {reference['step_s'] * 1e3:.1f} ms: "
        f"ratio {ratio:.3f}; all ratios {[round(r[0], 3) for r in readings]}"
    )
