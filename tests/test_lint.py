"""The architecture's layering holds: import-linter's contracts (pyproject.toml) on the
package laid out as installed (scripts/package_tree.py), as ``make lint`` checks them, so
that ``make test`` (and CI) refuses an import across the layers too."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def package_tree(where: Path) -> Path:
    tree = where / "tree"
    subprocess.run(
        [sys.executable, str(REPO / "scripts" / "package_tree.py"), str(tree)],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    return tree


def lint_imports(tree: Path) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("lint-imports", path=str(Path(sys.executable).parent))
    assert exe is not None, "lint-imports is not installed (the dev extras: make setup)"
    return subprocess.run(
        [exe, "--no-logo", "--no-cache", str(REPO / "pyproject.toml")],
        cwd=tree, env={**os.environ, "PYTHONPATH": str(tree)},
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def add_module(tree: Path, package: str, name: str, source: str) -> None:
    """A module of the tree's ``package`` that the repository does not have: the linked
    folders down to it become real ones of links, so the repository is left alone."""
    folder = tree
    for part in package.split("."):
        folder = folder / part
        if folder.is_symlink():
            real = folder.resolve()
            folder.unlink()
            folder.mkdir()
            for entry in real.iterdir():
                (folder / entry.name).symlink_to(entry)
    (folder / name).write_text(source)


def test_the_import_contracts_hold(tmp_path: Path) -> None:
    proc = lint_imports(package_tree(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert " 0 broken" in proc.stdout


def test_an_import_across_the_layers_breaks_them(tmp_path: Path) -> None:
    tree = package_tree(tmp_path)
    probe = "from morphling.proxy.emulator import server\n\n__all__ = ['server']\n"
    add_module(tree, "morphling.proxy.wire", "probe.py", probe)
    proc = lint_imports(tree)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "wire (the sans-IO protocol) depends on nothing of Morphling's BROKEN" in proc.stdout
    assert "morphling.proxy.wire.probe -> morphling.proxy.emulator.server" in proc.stdout
