"""A checkpoint's weights in shared memory: one copy per host, however many devices.

``morphling emulator --ckpt-path CKPT`` copies the checkpoint's data file once
into a shared-memory file, the *working copy* (training updates weights in
place, and the checkpoint on disk must not change), and announces it in its
GREETING. On the same host, a job maps it read-write and its model's
parameters become views of it, and virtual devices map it read-only and read
weight blocks from it by reference; a thousand devices cost one mapping.
Peers on other hosts cannot open the file, so they get bytes (then cached).
(``shm.py`` says how a peer knows it is on the emulator's host.)
"""

from __future__ import annotations

import logging
import os
import shutil
from typing import Any

from .shm import SharedFile

log = logging.getLogger(__name__)


class SharedWeights(SharedFile):
    """The working copy of a checkpoint's data, mapped; ``digest`` says which checkpoint."""

    KIND = "weights"
    digest = ""

    @classmethod
    def create(cls, ckpt: str | os.PathLike[str]) -> SharedWeights:
        """Validate the checkpoint ``ckpt`` and copy its data into a new shared file."""
        from .checkpoint import Checkpoint  # verifies checksums; torch only here

        with Checkpoint.open(ckpt, verify=True) as checkpoint:
            source, digest = checkpoint.data_path, checkpoint.digest
        fd, path = cls.new_file()
        try:
            with os.fdopen(fd, "wb") as out, open(source, "rb") as src:
                shutil.copyfileobj(src, out, 16 << 20)
            weights = cls(path, writable=False, owner=True)
        except BaseException:
            path.unlink()
            raise
        weights.digest = digest
        log.info("weights of %s (%d bytes) shared at %s", ckpt, weights.nbytes, path)
        return weights

    def attached(self, announced: dict[str, Any]) -> None:
        self.digest = str(announced.get("digest", ""))

    def announce(self) -> dict[str, Any]:
        return {**super().announce(), "digest": self.digest}
