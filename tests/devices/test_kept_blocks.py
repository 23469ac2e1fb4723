"""A real device agent reading a tile's block within a panel it kept (TILE ``within_*``,
docs/PROTOCOL.md *Panels*), driven by hand on loopback: the block is read at its element
offset into the kept bytes with the TILE's leading dimension, and an offset past them is
refused with ERROR ``bad_tile``."""

from __future__ import annotations

import numpy as np
from hand_driven import serve_agent
from morphling.proxy.wire.messages import Error, Tile, TileResult

RNG = np.random.default_rng(3)
W = RNG.standard_normal((16, 80))  # a weight, sent whole to keep as panel 5
X = RNG.standard_normal((8, 80))
Y = RNG.standard_normal((8, 16))


def keep_w() -> Tile:
    """x·Wᵀ, W's bytes kept under panel 5."""
    return Tile(tile=1, dtype="float64", ta=False, tb=True, m=8, n=16, k=80, lda=80, ldb=80,
                panel_b=5, segments=(X.reshape(-1), W.reshape(-1)))  # fmt: skip


def columns_of_w(within: int) -> Tile:
    """y·W[:, c:c+16], W's column block read within panel 5 from its element ``within``."""
    return Tile(tile=2, dtype="float64", ta=False, tb=False, m=8, n=16, k=16, lda=16, ldb=80,
                panel_b=5, within_b=within, segments=(Y.reshape(-1), b""))  # fmt: skip


async def test_agent_reads_a_block_within_a_panel_it_kept():
    hello, answers = await serve_agent([keep_w(), columns_of_w(32)])
    assert hello.caps.get("panels") == 2
    got = {a.tile: np.frombuffer(a.segments[0]).reshape(8, 16) for a in answers}
    assert all(isinstance(a, TileResult) for a in answers) and sorted(got) == [1, 2]
    np.testing.assert_allclose(got[1], X @ W.T, rtol=1e-12)
    np.testing.assert_allclose(got[2], Y @ W[:, 32:48], rtol=1e-12)


async def test_agent_refuses_a_block_past_the_panel_it_kept():
    _, answers = await serve_agent([keep_w(), columns_of_w(16 * 80)])
    errors = [a for a in answers if isinstance(a, Error)]
    assert errors and errors[0].code == "bad_tile"
    assert "TILE 2: element 1280 is past the 10240 bytes kept" in errors[0].reason
