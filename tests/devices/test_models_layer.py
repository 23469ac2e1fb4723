"""The device models are the bottom layer: they import neither the kernels nor the profiler,
and the built-in ``host`` profile, which needs both, still resolves wherever devices start.

The ``host`` tests read this host's profile from a user cache filled once per module with
a small plan (measuring it on first use, and again when stale, is ``test_profiler``'s).
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest
from morphling.devices.models.profiles import load_profile
from morphling.devices.profiler.host_cache import cached_host_profile
from processes import MORPHLING, Procs, child_env
from test_profiler import SMALL

MODELS = Path(__file__).resolve().parents[2] / "devices" / "models"
PACKAGE = "morphling.devices.models"
ABOVE = ("morphling.kernels", "morphling.devices.profiler")
MEASURING = "measuring this host for the 'host' profile"


def _imported(path: Path) -> set[str]:
    """Every module an import statement anywhere in ``path`` (functions too) may load."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = PACKAGE.rsplit(".", node.level - 1)[0] if node.level else ""
            module = ".".join(part for part in (base, node.module) if part)
            names.add(module)
            names.update(f"{module}.{alias.name}" for alias in node.names)
    return names


IMPORT_THE_MODELS = f"""
import importlib, json, pkgutil, sys
import {PACKAGE} as models
for module in pkgutil.iter_modules(models.__path__):
    importlib.import_module(f"{PACKAGE}.{{module.name}}")
from {PACKAGE}.profiles import expand_fleet
expand_fleet("rpi4:2,orin-nano")
print(json.dumps(sorted(sys.modules)))
"""


def test_the_models_import_neither_the_kernels_nor_the_profiler():
    for path in sorted(MODELS.glob("*.py")):
        above = sorted(name for name in _imported(path) if name.startswith(ABOVE))
        assert above == [], f"{path.name} imports {above}"
    proc = subprocess.run(
        [sys.executable, "-c", IMPORT_THE_MODELS],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    loaded = json.loads(proc.stdout)
    assert "morphling.devices.models.thermal" in loaded
    assert [name for name in loaded if name.startswith(ABOVE)] == []


RESOLVE_HOST = """
import json, sys
from morphling.devices.models.profiles import load_profile
before = sorted(name for name in sys.modules if name.startswith("morphling.devices.profiler"))
print(json.dumps({"before": before, "profile": load_profile("host").to_wire()}))
"""


@pytest.fixture(scope="module")
def host_cache(tmp_path_factory) -> Path:
    """A user cache (``XDG_CACHE_HOME``) holding this host's profile on one thread."""
    cache = tmp_path_factory.mktemp("xdg-cache")
    cached_host_profile(threads=1, directory=cache / "morphling", plan=SMALL)
    return cache


def _env(cache: Path) -> dict[str, str]:
    return {"XDG_CACHE_HOME": str(cache), "MORPHLING_HOST_THREADS": "1"}


def test_host_resolves_where_only_the_models_were_imported(host_cache):
    proc = subprocess.run(
        [sys.executable, "-c", RESOLVE_HOST],
        env=child_env(**_env(host_cache)),
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    got = json.loads(proc.stdout)
    assert got["before"] == [], "the profiler loaded before host was asked for"
    cached = host_cache / "morphling" / "host-1t.toml"
    assert got["profile"] == json.loads(json.dumps(load_profile(str(cached)).to_wire()))
    assert got["profile"]["name"] == "host" and MEASURING not in proc.stderr


def test_fleet_and_device_start_with_the_host_profile(procs: Procs, host_cache):
    cached = host_cache / "morphling" / "host-1t.toml"
    written = cached.stat().st_mtime_ns
    emulator, port = procs.emulator("--no-probe")
    server = f"127.0.0.1:{port}"
    one_thread = ("--server", server, "--threads", "1")
    env = _env(host_cache)
    fleet = procs.start("fleet", "fleet", *one_thread, "--devices", "host:1", env=env)
    device = procs.start(
        "device", "device", *one_thread, "--profile", "host", "--name", "board", env=env
    )
    log = procs.wait_for(emulator, "ready; scheduling", 2, timeout=120)
    assert "(host-0) ready" in log and "(board) ready" in log
    assert MEASURING not in fleet.text() + device.text()
    assert cached.stat().st_mtime_ns == written


def test_an_embedded_run_starts_a_host_fleet(tmp_path, host_cache):
    script = tmp_path / "job.py"
    script.write_text("print('the job ran')\n")
    command = [*MORPHLING, "--log-level", "warning", "run", "--embedded", "--devices", "host:2"]
    proc = subprocess.run(
        [*command, "--", "python", str(script)],
        cwd=tmp_path,
        env=child_env(**_env(host_cache)),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert "the job ran" in proc.stdout and MEASURING not in proc.stderr
    [run] = tmp_path.glob("morphling-runs/*/run.json")
    assert [device["profile"] for device in json.loads(run.read_text())["fleet"]] == ["host"] * 2
