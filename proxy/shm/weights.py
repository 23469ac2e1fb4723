"""A checkpoint's weights in shared memory: one copy per host, however many devices.

``morphling emulator --ckpt-path CKPT`` copies the checkpoint's data file once
into a shared-memory file, the *working copy* (training updates weights in
place, and the checkpoint on disk must not change), and announces it in its
GREETING. On the same host, a job maps it read-write and its model's
parameters become views of it, and virtual devices map it read-only and read
weight blocks from it by reference; a thousand devices cost one mapping.
Peers on other hosts cannot open the file, so they get bytes (then cached).
(``shm.py`` says how a peer knows it is on the emulator's host.) A job that asks
for it (``morphling run --fresh-weights``) has the working copy restored from the
checkpoint first: otherwise it starts from whatever earlier jobs trained.
"""

from __future__ import annotations

import logging
import os
import shutil
from typing import IO, Any

from .files import SharedFile

log = logging.getLogger(__name__)


class SharedWeights(SharedFile):
    """The working copy of a checkpoint's data, mapped; ``digest`` says which checkpoint."""

    KIND = "weights"
    digest = ""
    ckpt = ""  # the checkpoint's directory, on the emulator's side (``restore``)

    @classmethod
    def create(cls, ckpt: str | os.PathLike[str]) -> SharedWeights:
        """Validate the checkpoint ``ckpt`` and copy its data into a new shared file."""
        fd, path = cls.new_file()
        try:
            with os.fdopen(fd, "wb") as out:
                digest = _copy_data(ckpt, out)
            weights = cls(path, writable=False, owner=True)
        except BaseException:
            path.unlink()
            raise
        weights.digest, weights.ckpt = digest, str(ckpt)
        log.info("weights of %s (%d bytes) shared at %s", ckpt, weights.nbytes, path)
        return weights

    def restore(self) -> None:
        """Copy the checkpoint's data over the working copy again, once it verifies and is
        still the checkpoint announced (``CheckpointError`` otherwise)."""
        with open(self.path, "r+b") as out:
            _copy_data(self.ckpt, out, self.digest)
        log.info("weights of %s restored at %s", self.ckpt, self.path)

    def attached(self, announced: dict[str, Any]) -> None:
        self.digest = str(announced.get("digest", ""))

    def announce(self) -> dict[str, Any]:
        return {**super().announce(), "digest": self.digest}


def _copy_data(ckpt: str | os.PathLike[str], out: IO[bytes], digest: str = "") -> str:
    """Verify the checkpoint ``ckpt`` (and that its digest is ``digest``, when given), copy
    its data file into ``out``; its digest."""
    from morphling.proxy.checkpoint.format import (  # verifies checksums; torch only here
        Checkpoint,
        CheckpointError,
    )

    with Checkpoint.open(ckpt, verify=True) as checkpoint:
        source, found = checkpoint.data_path, checkpoint.digest
    if digest and found != digest:
        raise CheckpointError(
            f"{ckpt} is no longer the checkpoint the emulator loaded (its index.json changed)"
        )
    with open(source, "rb") as src:
        shutil.copyfileobj(src, out, 16 << 20)
    return found
