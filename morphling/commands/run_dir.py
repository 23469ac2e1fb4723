"""Claiming ``morphling run --embedded``'s run directory before the script starts.

A run directory is one run's record: a second run writing into it would mix two event
logs or replace the first without a word. So the default name is created exclusively
(``mkdir`` fails when it exists: two runs started in the same second cannot share one),
and a directory given that already holds files is refused unless ``--force`` says to
replace an earlier run's, proven one (``outputs.prove``). Claimed, and written to, before
the script starts, a directory that cannot be used is an error at once, not after the
training.
"""

from __future__ import annotations

import time
from pathlib import Path

from morphling import outputs
from morphling.proxy.report.files import REPORT_FILES
from morphling.proxy.vtime.eventlog import COMPRESSED_EVENTS_FILE, EVENTS_FILE, RUN_FILE, RUN_FORMAT

DEFAULT_PARENT = Path("morphling-runs")
# Everything the engine and the reports write to a run directory.
RUN_FILES = (RUN_FILE, EVENTS_FILE, COMPRESSED_EVENTS_FILE, *REPORT_FILES)
RUN = outputs.Kind("a run directory", RUN_FILE, RUN_FORMAT, lambda _header: RUN_FILES)


def claim(given: str, script: str, *, force: bool = False) -> tuple[Path, bool]:
    """The run directory, empty, ours and writable, and whether it was created (ValueError:
    why not).

    ``given`` empty: ``morphling-runs/SCRIPT-DATE-TIME``, with ``-2``, ``-3``, ... when
    that is taken. A directory given may exist empty; one holding files is refused
    unless ``force`` and it is a run directory (then its files are removed), as
    ``morphling save --force`` replaces only a checkpoint.
    """
    try:
        if given:
            path, created = Path(given), _make(Path(given))
        else:
            stamp = time.strftime("%Y%m%d-%H%M%S")
            path, created = _new(DEFAULT_PARENT / f"{Path(script).stem}-{stamp}"), True
    except OSError as exc:
        raise ValueError(
            f"cannot create run directory {exc.filename or given}: {exc.strerror or exc}"
        ) from exc
    try:
        earlier = [] if created else _earlier_run(path, force)
        outputs.check_dir_writable(path)  # before deleting anything, and before the script
        outputs.delete(earlier)
    except OSError as exc:
        if created:
            path.rmdir()
        raise ValueError(f"run directory {path}: cannot write in it: {exc.strerror}") from exc
    return path, created


def _make(path: Path) -> bool:
    """Whether ``path`` was created (it may exist as a directory already)."""
    try:
        path.mkdir(parents=True)
        return True
    except FileExistsError:
        if not path.is_dir():
            raise ValueError(f"run directory {path}: exists and is not a directory") from None
        return False


def _new(base: Path) -> Path:
    base.parent.mkdir(parents=True, exist_ok=True)
    path, n = base, 1
    while True:
        try:
            path.mkdir()
            return path
        except FileExistsError:
            n += 1
            path = base.with_name(f"{base.name}-{n}")


def _earlier_run(path: Path, force: bool) -> list[Path]:
    """What to delete from ``path`` before the run: nothing when it is empty; an earlier
    run's files when ``force`` says so and it is proven one (ValueError otherwise)."""
    if not any(path.iterdir()):
        return []
    if not force:
        raise ValueError(
            f"run directory {path} already exists and is not empty "
            "(choose another --run-dir, or --force to replace it)"
        )
    try:
        return outputs.prove(path, RUN)
    except outputs.NotAnOutput as exc:
        raise ValueError(
            f"run directory {path}: not a Morphling run directory ({exc}); "
            "refusing to replace it even with --force"
        ) from None
