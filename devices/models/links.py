"""Link presets: the network between the emulator and a device, each direction apart.

A what-if often changes only the network ("the same fleet on Wi-Fi"), so a
preset replaces a profile's four link fields. Wired Ethernet figures follow
from the standard; the wireless ones are typical figures we chose, labelled
as such in ``source`` — measure your own with ``morphling-bench`` and write
a profile file when it matters.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, TypeVar


class _OnALink(Protocol):
    """What a link applies to: a ``DeviceProfile``, described rather than imported, since the
    profiles import the links."""

    __dataclass_fields__: ClassVar[dict[str, dataclasses.Field[Any]]]

    @property
    def source(self) -> str: ...


_Profile = TypeVar("_Profile", bound=_OnALink)

MBIT = 1e6 / 8  # bytes/s per Mbit/s

# TCP goodput on gigabit Ethernet: 1448 payload bytes per 1538 bytes on the wire (1500 MTU
# less 20 B IP, 20 B TCP, 12 B timestamps; plus 14 B header, 4 B FCS, 8 B preamble, 12 B
# gap): the ~940 Mbit/s iperf reports.
GIGABIT_TCP_BW = 125e6 * 1448 / 1538


@dataclass(frozen=True)
class Link:
    """Bandwidth (bytes/s) and one-way latency (s) per direction; down = emulator→device."""

    name: str
    dl_bw: float
    ul_bw: float
    dl_lat_s: float
    ul_lat_s: float
    source: str

    def apply(self, profile: _Profile) -> _Profile:
        """``profile`` on this link instead of its own."""
        return dataclasses.replace(
            profile,
            dl_bw=self.dl_bw,
            ul_bw=self.ul_bw,
            dl_lat_s=self.dl_lat_s,
            ul_lat_s=self.ul_lat_s,
            source=f"{profile.source}; link preset {self.name!r}",
        )


def _preset(name: str, dl_bw: float, ul_bw: float, one_way_s: float, source: str) -> Link:
    """A link with the same latency both ways, as every preset here has."""
    return Link(name, dl_bw, ul_bw, one_way_s, one_way_s, source)


# Where each preset's figures come from, said in its ``source``.
_LAN = "gigabit Ethernet TCP goodput; 0.15 ms one-way (REFERENCE.md, Links)"
_WIFI = (
    "our assumption: a board's 1x1 802.11ac radio indoors, 100 Mbit/s down, 40 Mbit/s up "
    "(uplinks are slower, REFERENCE.md), 3 ms one-way"
)
_LTE = "our assumption: typical LTE, 30 Mbit/s down, 8 Mbit/s up, 25 ms one-way"
_5G = (
    "our assumption: mid-band 5G, 300 Mbit/s down, 40 Mbit/s up; 12.5 ms one-way "
    "(REFERENCE.md's CDN delay)"
)
_CLOUD = "40 ms one-way (REFERENCE.md's cloud delay); 100 Mbit/s each way is our assumption"
_IDEAL = "zero cost: no latency, unbounded bandwidth (to isolate compute)"

LINKS: dict[str, Link] = {
    link.name: link
    for link in (
        _preset("lan", GIGABIT_TCP_BW, GIGABIT_TCP_BW, 0.15e-3, _LAN),
        _preset("wifi", 100 * MBIT, 40 * MBIT, 3e-3, _WIFI),
        _preset("lte", 30 * MBIT, 8 * MBIT, 25e-3, _LTE),
        _preset("5g", 300 * MBIT, 40 * MBIT, 12.5e-3, _5G),
        _preset("cloud", 100 * MBIT, 100 * MBIT, 40e-3, _CLOUD),
        _preset("ideal", math.inf, math.inf, 0.0, _IDEAL),
    )
}


def link(name: str) -> Link:
    try:
        return LINKS[name]
    except KeyError:
        raise ValueError(f"unknown link preset {name!r}; presets are {', '.join(LINKS)}") from None
