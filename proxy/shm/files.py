"""Files in shared memory that the emulator creates and peers on its host map.

Two kinds exist: a checkpoint's weights (``weights.py``) and the operand arena
(``arena.py``). The emulator creates the file and announces its path in
GREETING; a peer that can open the path is on the same host and sees the same
bytes, so operands in it travel as offsets instead of bytes. The name,
``morphling-KIND-PID-RANDOM``, carries the creator's pid, so files left by an
emulator that was killed are found and removed by the next one.
"""

from __future__ import annotations

import logging
import mmap
import os
import tempfile
from pathlib import Path
from typing import Any, ClassVar, Self

import numpy as np

log = logging.getLogger(__name__)

SHM = Path("/dev/shm")
_ATTACHED: dict[tuple[str, str, object], SharedFile | None] = {}  # one mapping per file per process


def shm_dir() -> Path:
    """Where shared files go: /dev/shm, or the temporary directory where there is none."""
    return SHM if SHM.is_dir() else Path(tempfile.gettempdir())


class SharedFile:
    """A mapping of one shared file; ``region`` hands out numpy views of it."""

    KIND: ClassVar[str] = "file"  # the second word of the file's name
    PEERS_WRITE: ClassVar[bool] = False  # whether ``shared`` maps it writable

    def __init__(self, path: Path, *, writable: bool, owner: bool) -> None:
        self.path = path
        self.owner = owner  # the emulator that created it removes it
        with open(path, "r+b" if writable else "rb") as f:
            self.nbytes = os.fstat(f.fileno()).st_size
            access = mmap.ACCESS_WRITE if writable else mmap.ACCESS_READ
            self._mmap = mmap.mmap(f.fileno(), 0, access=access) if self.nbytes else None
        self.array = (
            np.frombuffer(self._mmap, dtype=np.uint8)
            if self._mmap is not None
            else np.zeros(0, np.uint8)
        )
        self.base = self.array.ctypes.data

    @classmethod
    def new_file(cls) -> tuple[int, Path]:
        """An open descriptor and the path of a new, empty file of this kind."""
        where = shm_dir()
        remove_orphans(where, cls.KIND)
        fd, name = tempfile.mkstemp(prefix=f"morphling-{cls.KIND}-{os.getpid()}-", dir=where)
        return fd, Path(name)

    @classmethod
    def attach(cls, announced: dict[str, Any], *, writable: bool = False) -> Self | None:
        """Map what an emulator announced, or None when it is not on this host."""
        path = Path(str(announced.get("path", "")))
        try:
            if not path.name.startswith(f"morphling-{cls.KIND}-") or not path.is_file():
                return None
            shared = cls(path, writable=writable, owner=False)
        except OSError as exc:
            log.debug("cannot map the shared %s at %s: %s", cls.KIND, path, exc)
            return None
        if shared.nbytes != announced.get("nbytes"):
            return None
        shared.attached(announced)
        return shared

    def attached(self, announced: dict[str, Any]) -> None:
        """Hook: take what else the announcement says."""

    @classmethod
    def shared(cls, announced: dict[str, Any]) -> Self | None:
        """``attach`` once per process: a fleet's devices share one mapping."""
        key = (cls.KIND, str(announced.get("path", "")), announced.get("nbytes"))
        if key not in _ATTACHED:
            _ATTACHED[key] = cls.attach(announced, writable=cls.PEERS_WRITE)
        shared = _ATTACHED[key]
        return shared if isinstance(shared, cls) else None  # the key's KIND is cls's

    def announce(self) -> dict[str, Any]:
        """What GREETING tells peers."""
        return {"path": str(self.path), "nbytes": self.nbytes}

    def offset_of(self, array: np.ndarray) -> int | None:
        """The byte offset of ``array``'s memory in the mapping, or None when outside it."""
        start = array.ctypes.data - self.base
        return start if start >= 0 and start + array.nbytes <= self.nbytes else None

    def region(self, offset: int, count: int, dtype: str) -> np.ndarray:
        """``count`` elements of ``dtype`` at byte ``offset``; ValueError outside the mapping."""
        item = np.dtype(dtype).itemsize
        end = offset + count * item
        if offset < 0 or count < 0 or end > self.nbytes or offset % item:
            raise ValueError(
                f"{self.KIND} reference [{offset}, {end}) is not an aligned {dtype} range "
                f"inside the shared {self.KIND} ({self.nbytes} bytes)"
            )
        return self.array[offset:end].view(dtype)

    def block(self, offset: int, rows: int, cols: int, ld: int, dtype: str) -> np.ndarray:
        """The span of a ``rows × cols`` block stored with leading dimension ``ld`` (elements)
        from byte ``offset``: ``(rows - 1)·ld + cols`` elements, none for an empty block."""
        return self.region(offset, (rows - 1) * ld + cols if rows and cols else 0, dtype)

    def close(self) -> None:
        """Remove the file if this process created it (mappings stay valid until dropped)."""
        if self.owner:
            self.path.unlink(missing_ok=True)
            self.owner = False


def remove_orphans(where: Path, kind: str) -> None:
    """Delete files of ``kind`` whose creator is gone (an emulator killed by SIGKILL)."""
    for path in where.glob(f"morphling-{kind}-*-*"):
        pid = path.name.split("-")[2]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            path.unlink(missing_ok=True)
            log.info("removed %s, left by an emulator that is gone", path)
