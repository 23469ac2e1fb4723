"""Claiming ``morphling run --embedded``'s run directory before the script starts.

A run directory is one run's record: a second run writing into it would mix two event
logs or replace the first without a word. So the default name is created exclusively
(``mkdir`` fails when it exists: two runs started in the same second cannot share one),
and a directory given that already holds files is refused unless ``--force`` says to
replace an earlier run's. Claimed before the script starts, a directory that cannot be
created is an error at once, not after the training.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

from .report import COMPRESSED_EVENTS_FILE, EVENTS_FILE, RUN_FILE

DEFAULT_PARENT = Path("morphling-runs")


def claim(given: str, script: str, *, force: bool = False) -> tuple[Path, bool]:
    """The run directory, empty and ours, and whether it was created (ValueError: why not).

    ``given`` empty: ``morphling-runs/SCRIPT-DATE-TIME``, with ``-2``, ``-3``, ... when
    that is taken. A directory given may exist empty; one holding files is refused
    unless ``force`` and it is a run directory (then its files are removed), as
    ``morphling save --force`` replaces only a checkpoint.
    """
    try:
        if not given:
            return _new(DEFAULT_PARENT / f"{Path(script).stem}-{time.strftime('%Y%m%d-%H%M%S')}")
        path = Path(given)
        try:
            path.mkdir(parents=True)
            return path, True
        except FileExistsError:
            pass
        if not path.is_dir():
            raise ValueError(f"run directory {path}: exists and is not a directory")
        if any(path.iterdir()):
            _replace(path, force)
        return path, False
    except OSError as exc:
        raise ValueError(f"cannot create run directory {exc.filename or given}: "
                         f"{exc.strerror or exc}") from exc  # fmt: skip


def _new(base: Path) -> tuple[Path, bool]:
    base.parent.mkdir(parents=True, exist_ok=True)
    path, n = base, 1
    while True:
        try:
            path.mkdir()
            return path, True
        except FileExistsError:
            n += 1
            path = base.with_name(f"{base.name}-{n}")


def _replace(path: Path, force: bool) -> None:
    """Empty ``path``, an earlier run's directory, when ``force`` says so."""
    if not force:
        raise ValueError(f"run directory {path} already exists and is not empty "
                         "(choose another --run-dir, or --force to replace it)")  # fmt: skip
    if not any((path / name).is_file() for name in (RUN_FILE, EVENTS_FILE, COMPRESSED_EVENTS_FILE)):
        raise ValueError(f"run directory {path} is not empty and not a run directory (no "
                         f"{RUN_FILE} or {EVENTS_FILE}); refusing to replace it even with "
                         "--force")  # fmt: skip
    for child in path.iterdir():
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child)
        else:
            child.unlink()
