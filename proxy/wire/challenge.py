"""The FLOPS challenge: matrices both sides regenerate from a seed, and the check.

Only ``seed`` and ``dim`` travel; A and B are defined by splitmix64 so that a
device in any language can rebuild them bit for bit (docs/PROTOCOL.md): element
``i`` (row-major) of A is ``u(seed ^ 0xA11AA11A, i)`` and of B
``u(seed ^ 0xB22BB22B, i)``, where ``u(s, i)`` takes the top 24 bits of
``splitmix64(s + (i + 1)·0x9E3779B97F4A7C15)`` as an integer ``t`` and
returns the float32 ``t / 2**23 − 1`` (exact, in [−1, 1)).
"""

from __future__ import annotations

import numpy as np

from .errors import RemoteProtocolError

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MASK = (1 << 64) - 1
SEED_A = 0xA11AA11A
SEED_B = 0xB22BB22B
# The largest challenge either side computes: a dim-4096 one is 64 MiB of result and half
# a minute on a Pi, past which a challenge measures patience, not FLOPS.
MAX_DIM = 4096


def check_dim(dim: int, field: str) -> None:
    """Refuse (ERROR ``bad_probe``) a challenge of a size outside 1..MAX_DIM; ``field``
    names the message field it came in."""
    if not 1 <= dim <= MAX_DIM:
        raise RemoteProtocolError(f"{field}={dim} outside 1..{MAX_DIM}", "bad_probe")


def _uniform(stream: int, count: int) -> np.ndarray:
    with np.errstate(over="ignore"):
        z = np.uint64(stream & _MASK) + (np.arange(1, count + 1, dtype=np.uint64) * _GOLDEN)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z ^= z >> np.uint64(31)
    return ((z >> np.uint64(40)).astype(np.float32) / np.float32(1 << 23)) - np.float32(1)


def matrices(seed: int, dim: int) -> tuple[np.ndarray, np.ndarray]:
    """The challenge's A and B, float32 [dim, dim] each."""
    count = dim * dim
    a = _uniform(seed ^ SEED_A, count).reshape(dim, dim)
    b = _uniform(seed ^ SEED_B, count).reshape(dim, dim)
    return a, b


def verify(result: np.ndarray, reference: np.ndarray, tolerance: float) -> str:
    """Empty when every element satisfies |ref − c| ≤ tol + tol·|ref|, else why not."""
    if result.shape != reference.shape:
        return f"result has shape {result.shape}, expected {reference.shape}"
    err = np.abs(reference - result)
    bad = ~(err <= tolerance + tolerance * np.abs(reference))  # NaN counts as bad
    if bad.any():
        i, j = np.unravel_index(int(bad.argmax()), bad.shape)  # the first one
        return (
            f"{int(bad.sum())} of {bad.size} elements off, first at ({i}, {j}): "
            f"{result[i, j]!r} vs {reference[i, j]!r} (tolerance {tolerance})"
        )
    return ""
