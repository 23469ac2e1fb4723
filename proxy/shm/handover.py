"""Operands handed over as arrays inside one process: the embedded emulator's.

Under ``morphling run --embedded`` the training script, the emulator and the
fleet share one process, yet the job copied every operand into its slab of the
operand arena and every C back out of it: a quarter of a training step's wall
time on the benchmark model, all of it on the script's thread. Here the job
hands the emulator its operand arrays and an output array themselves, and the
emulator hands each device in the process the blocks of a tile and the part of
C it writes: nothing is copied. Messages still go over the sockets (but for TILE
and TILE_RESULT between paired ends, ``connection``); the arrays pass through
this registry, under keys the messages name (the emulator's token with the
job's id and the GEMM's, or with the device's id and the tile's: a tile offered
again to another device is that device's).

Each emulator gets a token (``new_emulator``) and announces it in GREETING; a
peer that finds it registered here is in the emulator's process and says so in
HELLO (``caps.process``). A peer elsewhere that claims it finds nothing under
its keys and gets an error.

Lifetimes: an entry holds its arrays (numpy views hold the torch tensors they
view) until taken, and a device holds what it took until its kernel has run.
A device lost while its kernel writes into C may still write after the tile
was computed again elsewhere, so each GEMM's ``Writers`` counts the kernels
writing into it, and the emulator answers the job only once none is.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

_emulators: set[str] = set()  # the tokens of the emulators running in this process


@dataclass(slots=True)
class Writers:
    """Kernels writing into one GEMM's output; what ``then`` was given runs once none is."""

    count: int = 0
    _then: list[Callable[[], None]] = field(default_factory=list)

    def enter(self) -> None:
        self.count += 1

    def leave(self) -> None:
        self.count -= 1
        if not self.count:
            then, self._then = self._then, []
            for action in then:
                action()

    def then(self, action: Callable[[], None]) -> None:
        """Run ``action`` when the last kernel now writing leaves (call it while one is)."""
        self._then.append(action)


@dataclass(frozen=True, slots=True)
class JobOperands:
    """A job's GEMM: A's and B's spans as bytes (as on the wire) and C, ``[batch, m, n]``."""

    a: np.ndarray
    b: np.ndarray
    out: np.ndarray


@dataclass(frozen=True, slots=True)
class TileOperands:
    """A tile's blocks: spans of op(A)'s rows and op(B)'s columns, and where its C goes
    (a span of the output from the tile's first element, rows ``TILE.ldc`` apart)."""

    a: np.ndarray
    b: np.ndarray
    c: np.ndarray
    writers: Writers


Key = tuple[str, int, int]  # (emulator token, job id, GEMM id) or (token, device id, tile id)
_gemms: dict[Key, JobOperands] = {}
_tiles: dict[Key, TileOperands] = {}


def new_emulator() -> str:
    """A token for an emulator starting in this process."""
    token = secrets.token_hex(16)
    _emulators.add(token)
    return token


def in_this_process(token: str) -> bool:
    return token in _emulators


def end_emulator(token: str) -> None:
    """The emulator stopped: forget it and whatever was left for it."""
    _emulators.discard(token)
    for registry in (_gemms, _tiles):
        for key in [k for k in registry if k[0] == token]:
            del registry[key]


def offer_gemm(key: Key, operands: JobOperands) -> None:
    _gemms[key] = operands


def take_gemm(key: Key) -> JobOperands | None:
    return _gemms.pop(key, None)


def offer_tile(key: Key, operands: TileOperands) -> None:
    _tiles[key] = operands


def take_tile(key: Key) -> TileOperands | None:
    return _tiles.pop(key, None)
