"""The probes either side may ask of the other, and their answers (sans-IO).

PROBE_ECHO comes back with ``reply`` set, PROBE_PUSH is acknowledged with the bytes
counted (PROBE_ACK), PROBE_PULL is answered with the bytes it asked for (PROBE_PULLED).
The asker times them; the answerer only answers, at once.
"""

from __future__ import annotations

import numpy as np

from .errors import RemoteProtocolError
from .messages import Message, MsgType, ProbeAck, ProbeEcho, ProbePull, ProbePulled, ProbePush

REQUESTS = frozenset({MsgType.PROBE_ECHO, MsgType.PROBE_PUSH, MsgType.PROBE_PULL})


def is_request(msg: Message) -> bool:
    """``msg`` asks to be answered (a PROBE_ECHO with ``reply`` set is itself an answer)."""
    return msg.TYPE in REQUESTS and not (isinstance(msg, ProbeEcho) and msg.reply)


def answer(msg: Message, max_pull: int) -> Message:
    """The answer to the probe request ``msg``; a PROBE_PULL of more than ``max_pull``
    bytes (the largest payload this side takes) is refused."""
    if isinstance(msg, ProbeEcho):
        return ProbeEcho(probe=msg.probe, reply=True, segments=msg.segments)
    if isinstance(msg, ProbePush):
        return ProbeAck(probe=msg.probe, nbytes=memoryview(msg.segments[0]).nbytes)
    if isinstance(msg, ProbePull):
        if not 0 <= msg.nbytes <= max_pull:
            reason = f"PROBE_PULL.nbytes={msg.nbytes} is outside 0..{max_pull}"
            raise RemoteProtocolError(reason, "bad_probe")
        return ProbePulled(probe=msg.probe, segments=(np.zeros(msg.nbytes, np.uint8),))
    raise ValueError(f"{msg.TYPE.name} is not a probe request")
