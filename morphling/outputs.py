"""What Morphling writes to the user's paths: proven its own before anything deletes it, and
found writable before a long command starts.

``morphling save --force`` and ``morphling run --force`` replace an earlier output. A name
alone proves nothing (any web app has an ``index.json``, any project may have a
``run.json``), so a directory is taken as Morphling's only when its header file says so
(``"format"``) and it holds nothing but the regular files that kind of output has: no
subdirectory, no file of the user's. Then only those files are deleted, by name, so what
appears in the directory after the proof is never deleted with it.

Writability is probed by writing, not with ``os.access``, which says yes to root
everywhere (``/proc``) and knows nothing of read-only mounts or full quotas.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class NotAnOutput(ValueError):
    """A directory is not the Morphling output it was taken for; the message says why."""


@dataclass(frozen=True)
class Kind:
    """One kind of Morphling output directory."""

    name: str  # "a checkpoint": how messages name it
    header: str  # the JSON file that says what the directory is
    format: str  # the header's "format"
    # Every file such a directory may hold, given its parsed header (NotAnOutput: the header
    # is wrong); it includes the header.
    files: Callable[[dict[str, Any]], Collection[str]]


def prove(directory: Path, kind: Kind) -> list[Path]:
    """The files of ``directory``, shown to be ``kind``'s output; NotAnOutput says why not."""
    with os.scandir(directory) as scan:
        entries = {entry.name: entry for entry in scan}
    header = entries.get(kind.header)
    if header is None:
        raise NotAnOutput(f"no {kind.header}")
    if not header.is_file(follow_symlinks=False):  # a FIFO would block the read below
        raise NotAnOutput(f"{kind.header} is not a regular file")
    try:
        document = json.loads(Path(header.path).read_bytes())
    except (OSError, ValueError) as exc:  # ValueError: not JSON, not UTF-8
        reason = getattr(exc, "strerror", None) or exc
        raise NotAnOutput(f"{kind.header} is unreadable: {reason}") from None
    if not isinstance(document, dict) or document.get("format") != kind.format:
        raise NotAnOutput(f"{kind.header} does not say format {kind.format!r}")
    allowed = kind.files(document)
    foreign = sorted(
        name
        for name, entry in entries.items()
        if name not in allowed or not entry.is_file(follow_symlinks=False)
    )
    if foreign:
        raise NotAnOutput(f"it holds {', '.join(foreign)}, which {kind.name} does not")
    return [Path(entry.path) for entry in entries.values()]


def delete(files: list[Path]) -> None:
    """Delete the files ``prove`` returned, and nothing else (missing ones are skipped)."""
    for path in files:
        path.unlink(missing_ok=True)


def check_file_writable(path: Path) -> None:
    """OSError unless ``path`` can be opened for writing: opened to append (its content is
    kept), created if absent and then removed again. Non-blocking, so a FIFO without a
    reader is refused instead of hanging."""
    flags = os.O_WRONLY | os.O_NONBLOCK
    try:
        os.close(os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o666))
    except FileExistsError:
        os.close(os.open(path, flags | os.O_APPEND))
    else:
        os.unlink(path)


def check_dir_writable(directory: Path) -> None:
    """OSError unless a file can be created in ``directory`` (a probe, removed again)."""
    fd, probe = tempfile.mkstemp(dir=directory, prefix=".morphling-probe-")
    os.close(fd)
    os.unlink(probe)
