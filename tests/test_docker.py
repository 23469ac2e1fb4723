"""The Docker image and compose file, checked without a Docker engine (none runs here).

What can be checked is checked for real: every ``morphling`` command in
docker-compose.yml parses and validates with the real CLI (the nginx
configuration is rendered), and the image installs through the README's
``make setup`` with nothing it needs left out of the build context.
"""

from __future__ import annotations

import fnmatch
import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml
from morphling.devices.models.profiles import expand_fleet
from morphling.proxy.emulator.settings import EmulatorConfig
from processes import MORPHLING, child_env

from morphling import config as configuration
from morphling.cli import build_parser
from morphling.commands.device import FleetConfig

REPO = Path(__file__).resolve().parent.parent
SCHEMAS = {"emulator": EmulatorConfig, "fleet": FleetConfig}


def compose() -> dict:
    return yaml.safe_load((REPO / "docker-compose.yml").read_text())


def test_compose_commands_are_valid_morphling_invocations(tmp_path):
    services = compose()["services"]
    ours = {name: s for name, s in services.items() if s.get("image") == "morphling"}
    assert set(ours) == {"emulator", "nginx-config", "fleet"}
    assert "build" in services["emulator"]
    for service in ours.values():
        command = list(service["command"])
        if command[0] == "nginx-config":  # render it for real, into tmp_path
            out = command.index("--output") + 1
            command[out] = str(tmp_path / "nginx.conf")
            done = subprocess.run([*MORPHLING, *command], capture_output=True, text=True,
                                  timeout=60, env=child_env())  # fmt: skip
            assert done.returncode == 0, done.stderr
            conf = (tmp_path / "nginx.conf").read_text()
            assert "server emulator:39000;" in conf and "access_log /dev/stdout" in conf
            continue
        args = build_parser().parse_args(command)
        # the variables compose interpolates (``${MORPHLING_TOKEN:?...}``), given a value
        env = {k: "from-the-shell" for k in service.get("environment", {})}
        cfg, _ = configuration.load(SCHEMAS[command[0]], args, env=env, section=command[0])
        if command[0] == "emulator":  # on every interface: only with the token
            assert cfg.listen_ip == "0.0.0.0" and cfg.token == "from-the-shell"
            with pytest.raises(configuration.ConfigError, match="without a token"):
                configuration.load(EmulatorConfig, args, env={}, section="emulator")
        if command[0] == "fleet":
            assert cfg.server == "nginx:39000"  # through the proxy, like a board
            assert len(expand_fleet(cfg.devices)) == 16
    nginx = services["nginx"]
    assert nginx["ports"] == ["39000:39000"]
    assert nginx["depends_on"]["nginx-config"]["condition"] == "service_completed_successfully"


def test_image_installs_what_the_readme_installs_from_a_complete_context():
    dockerfile = (REPO / "Dockerfile").read_text()
    runs = [line for line in dockerfile.splitlines() if line.startswith("RUN ")]
    assert any("make setup" in line for line in runs)
    assert "COPY . ." in dockerfile
    ignored = [p for p in (REPO / ".dockerignore").read_text().split() if p]
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True,
                             check=True).stdout.split()  # fmt: skip
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    files = {"Makefile", "pyproject.toml", "setup.py", "README.md"}
    folders = tuple(f"{d}/" for d in pyproject["tool"]["setuptools"]["package-dir"].values())
    for path in tracked:
        if path in files or path.startswith(folders):
            hit = [p for p in ignored if fnmatch.fnmatch(path, p) or path.startswith(f"{p}/")]
            assert not hit, f"make setup needs {path} but .dockerignore drops it ({hit})"
