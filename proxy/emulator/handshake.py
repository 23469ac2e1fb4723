"""The start of every connection: GREETING, the peer's HELLO checked, WELCOME.

GREETING gives the nonce a token's HMAC must sign, and what the emulator shares
with peers on its host (the weights, the operand arena) or in its process
(``local``). HELLO names the peer's role: a device is registered (and probed, see
``devices``), a job or probe peer gets an id and a ``Job``. Until HELLO is accepted
no frame may carry a payload, so a peer that has not authenticated cannot make the
emulator allocate anything sizeable.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from morphling.devices.models.profiles import DeviceProfile
from morphling.proxy.wire.errors import RemoteProtocolError
from morphling.proxy.wire.messages import Greeting, Hello, Welcome

from . import devices
from .jobs import Job
from .verify import device_key

if TYPE_CHECKING:
    from .peer import PeerConnection
    from .server import Emulator

log = logging.getLogger(__name__)


def _version(cap: object) -> int:
    """A capability's version in HELLO ``caps`` (an integer; 0: absent or not one)."""
    return cap if isinstance(cap, int) and not isinstance(cap, bool) else 0


def greeting(emulator: Emulator, nonce: bytes) -> Greeting:
    weights, arena = emulator.weights, emulator.arena
    return Greeting(
        version=1,
        nonce=nonce,
        auth=emulator.credentials.required,
        weights=emulator.trainers.announce(weights) if weights else {},
        arena=arena.announce() if arena else {},
        process=emulator.token,
    )


def hello(conn: PeerConnection, msg: Hello) -> None:
    """Check ``msg``, give the peer its role on ``conn`` and WELCOME it."""
    emulator = conn.emulator
    cfg = emulator.config
    emulator.credentials.check(msg, conn.nonce)
    caps = msg.caps
    local = caps.get("process") == emulator.token  # a peer in this process (``local``)
    weights, arena = emulator.weights, emulator.arena
    maps_weights = weights is not None and caps.get("weights") == str(weights.path)
    maps_arena = arena is not None and caps.get("arena") == str(arena.path)
    if msg.role == "device":
        refused = emulator.verifier.refused(device_key(msg.name or conn.peername, conn.peername))
        if refused:
            raise RemoteProtocolError(refused, "quarantined")
        try:
            declared = DeviceProfile.from_wire(msg.profile)
        except ValueError as exc:
            raise RemoteProtocolError(f"HELLO.profile: {exc}", "bad_hello") from None
        device = conn.device = emulator.registry.add(
            msg.name or conn.peername,
            declared,
            conn,
            virtual=bool(caps.get("virtual", False)),
            colocated=maps_weights,
            arena=maps_arena,
            local=local,
            conv=_version(caps.get("conv")) >= 1,
            panels=max(0, _version(caps.get("panels"))),
        )
        peer_id = device.id
        if local:  # TILE and TILE_RESULT without bytes may skip the socket
            conn.pair_in_process()
    elif msg.role in ("job", "probe"):
        job = conn.job = Job(conn, emulator.next_client_id(), maps_arena=maps_arena, local=local)
        peer_id = job.id
        if msg.role == "job" and maps_weights:
            job.map_weights()
    else:
        raise RemoteProtocolError(
            f"HELLO.role {msg.role!r} is not device, job or probe", "bad_hello"
        )
    conn.wire.max_payload = cfg.max_payload_bytes
    conn.send(Welcome(peer_id=peer_id, heartbeat_s=cfg.heartbeat_s))
    conn.leave_gate()
    log.info("%s joined as %s %d (%s)", conn.peername, msg.role, peer_id, msg.name or "-")
    if conn.device is not None:
        devices.arrived(conn, conn.device, msg.uuid)
