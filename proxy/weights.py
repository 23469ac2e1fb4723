"""A checkpoint's weights in shared memory: one copy per host, however many devices.

``morphling emulator --ckpt-path CKPT`` copies the checkpoint's data file once
into a shared-memory file, the *working copy* (training updates weights in
place, and the checkpoint on disk must not change), and announces it in its
GREETING. On the same host, a job maps it read-write and its model's
parameters become views of it, and virtual devices map it read-only and read
weight blocks from it by reference; a thousand devices cost one mapping.
Peers on other hosts cannot open the file, so they get bytes (then cached).

The file's name carries a random id, so a peer that can open it is on the
same host and sees the same bytes.
"""

from __future__ import annotations

import logging
import mmap
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

_SHM = Path("/dev/shm")
_ATTACHED: dict[tuple[str, Any], SharedWeights | None] = {}


class SharedWeights:
    """A mapping of the working copy; ``region`` hands out numpy views of it."""

    def __init__(self, path: Path, digest: str, *, writable: bool, owner: bool) -> None:
        self.path = path
        self.digest = digest
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
    def create(cls, ckpt: str | os.PathLike[str]) -> SharedWeights:
        """Validate the checkpoint ``ckpt`` and copy its data into a new shared file."""
        from .checkpoint import Checkpoint  # verifies checksums; torch only here

        with Checkpoint.open(ckpt, verify=True) as checkpoint:
            source, digest = checkpoint.data_path, checkpoint.digest
        where = _SHM if _SHM.is_dir() else Path(tempfile.gettempdir())
        _remove_orphans(where)
        fd, name = tempfile.mkstemp(prefix=f"morphling-weights-{os.getpid()}-", dir=where)
        try:
            with os.fdopen(fd, "wb") as out, open(source, "rb") as src:
                shutil.copyfileobj(src, out, 16 << 20)
            weights = cls(Path(name), digest, writable=False, owner=True)
        except BaseException:
            os.unlink(name)
            raise
        log.info("weights of %s (%d bytes) shared at %s", ckpt, weights.nbytes, name)
        return weights

    @classmethod
    def attach(cls, announced: dict[str, Any], *, writable: bool = False) -> SharedWeights | None:
        """Map what an emulator announced, or None when it is not on this host."""
        path = Path(str(announced.get("path", "")))
        try:
            if not path.name.startswith("morphling-weights-") or not path.is_file():
                return None
            weights = cls(path, str(announced.get("digest", "")), writable=writable, owner=False)
        except OSError as exc:
            log.debug("cannot map the shared weights at %s: %s", path, exc)
            return None
        if weights.nbytes != announced.get("nbytes"):
            return None
        return weights

    @classmethod
    def shared(cls, announced: dict[str, Any]) -> SharedWeights | None:
        """``attach`` read-only, once per process: a fleet's devices share one mapping."""
        key = (str(announced.get("path", "")), announced.get("nbytes"))
        if key not in _ATTACHED:
            _ATTACHED[key] = cls.attach(announced)
        return _ATTACHED[key]

    def announce(self) -> dict[str, Any]:
        """What GREETING tells peers."""
        return {"path": str(self.path), "digest": self.digest, "nbytes": self.nbytes}

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
                f"weight reference [{offset}, {end}) is not an aligned {dtype} range inside "
                f"the shared weights ({self.nbytes} bytes)"
            )
        return self.array[offset:end].view(dtype)

    def close(self) -> None:
        """Remove the file if this process created it (mappings stay valid until dropped)."""
        if self.owner:
            self.path.unlink(missing_ok=True)
            self.owner = False


def _remove_orphans(where: Path) -> None:
    """Delete working copies left by emulators that died without cleaning up (SIGKILL);
    the creator's pid is in the name."""
    for path in where.glob("morphling-weights-*-*"):
        pid = path.name.split("-")[2]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            path.unlink(missing_ok=True)
            log.info("removed %s, left by an emulator that is gone", path)
