"""Lay the ``morphling`` package out as it is installed, in symbolic links, for the checkers.

pyproject.toml maps the package's parts to top-level folders (``morphling.proxy`` is
``proxy/``, ...). An editable install resolves that at import time, but the import
linter and the type checker walk folders: they need ``morphling/proxy/...`` on disk.
This writes such a tree of links to the real folders under ``build/package-tree`` (or
the folder given) and prints it, for ``PYTHONPATH`` / ``MYPYPATH``.
"""

from __future__ import annotations

import shutil
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main(argv: list[str]) -> int:
    tree = Path(argv[0]) if argv else ROOT / "build" / "package-tree"
    mapping = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-dir"
    ]
    if tree.exists():
        shutil.rmtree(tree)
    top = tree / "morphling"
    top.mkdir(parents=True)
    for entry in (ROOT / mapping["morphling"]).iterdir():
        (top / entry.name).symlink_to(entry)
    for package, folder in mapping.items():
        parts = package.split(".")
        if len(parts) == 2:  # a part of morphling kept in its own top-level folder
            (top / parts[1]).symlink_to(ROOT / folder)
    print(tree)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
