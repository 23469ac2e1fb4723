"""Coordinator time: what the script does on its own hardware between two fleet products.

The virtual timeline needs it before every GEMM or convolution the fleet computes. The
coordinator — the board the script itself runs on — is ``host`` (this machine) or a device
profile (``--coordinator rpi4``: the script as it would run on a Raspberry Pi 4).

``measured`` (``host`` only) takes the host's wall time (times ``scale``, for a host faster
or slower than the coordinator being studied) from the moment a fleet product's result is
back in the script to the moment its next product reaches the interceptor: Morphling's own
work on a product (checking it, sending it, waiting, turning the result into a tensor) is
left out, local GEMMs are in. Faithful, but it changes with the host's load.
``model`` counts the work instead — every aten op run locally, by class, with the bytes it
moves and its arithmetic (``devices.models.op_count``) — and prices each op as it is
counted with the coordinator profile's op model (``devices.models.ops``), GEMMs and
convolutions kept local at the profile's GEMM rate; so the same script gives the same
timeline on any host, however busy, and the time comes split by op class.
"""

from __future__ import annotations

from collections.abc import Sequence

from morphling.devices.models.ops import OP_CLASSES, OpModel
from morphling.devices.models.profiles import HOST, DeviceProfile, load_profile, with_cooling
from morphling.devices.models.thermal import ThermalParams, ThermalState

MODES = ("measured", "model")
# Who computes a rank's GEMMs and convolutions: its device, or the rank itself, on its own
# hardware, while its device only times them (``session.emulate``'s ``products``).
PRODUCTS = ("device", "rank")


def coordinator_mode(name: str, mode: str | None) -> str:
    """The coordinator-time mode for coordinator ``name``: ``mode`` when given, else measured
    for ``host`` and model for a profile, which cannot be measured here."""
    if mode is None:
        return "measured" if name == HOST else "model"
    if mode not in MODES:
        raise ValueError(f"coordinator time {mode!r}: expected one of {', '.join(MODES)}")
    if mode == "measured" and name != HOST:
        raise ValueError(
            f"--coordinator {name} runs on modelled time: only this host's (--coordinator "
            f"host) can be measured"
        )
    return mode


def coordinator_profile(
    name: str, mode: str | None = None, *, cooling: str | None = None
) -> DeviceProfile | None:
    """The profile that prices coordinator ``name``'s work (``cooling`` applied), checked to
    have an op model; None for measured time. A ValueError says what is wrong: an unknown
    profile (naming the known ones), a malformed op model (naming the field)."""
    if coordinator_mode(name, mode) == "measured":
        return None
    try:
        profile = load_profile(name)
        profile = with_cooling(profile, cooling) if cooling is not None else profile
        op_model_of(profile)
    except ValueError as exc:
        raise ValueError(f"--coordinator {name}: {exc}") from None
    return profile


def op_model_of(profile: DeviceProfile) -> OpModel:
    """``profile``'s op model; a ValueError naming the profile when it has none."""
    if not profile.ops:
        raise ValueError(
            f"profile {profile.name!r} ({profile.source}) has no op model (an [ops] table): "
            f"measure the board with morphling profile, or use a built-in profile"
        )
    return OpModel.from_dict(profile.ops)


class HostWork:
    """Local work since the last fleet product, priced as it is counted: seconds by op class
    at the coordinator's top clock, and on its clock when it has a thermal model.

    Between its bursts the coordinator is taken as busy (the board that runs the script is
    computing or waiting on a link, never cooling long): a burst starts where the last ended.
    ``also``: profiles the same work is priced on besides (those of the ranks that replay
    this one, ``take_also``), each with its own thermal state.
    """

    def __init__(self, profile: DeviceProfile, also: Sequence[DeviceProfile] = ()) -> None:
        self.also = {p.name: HostWork(p) for p in also if p.name != profile.name}
        self.model = op_model_of(profile)
        self.gemm_flops = profile.flops
        self.seconds = dict.fromkeys(OP_CLASSES, 0.0)
        self.in_optimizer = False  # between an optimizer's step pre- and post-hooks
        thermal = profile.thermal
        self._thermal = ThermalState(ThermalParams.from_dict(thermal)) if thermal else None
        self._t = 0.0  # the coordinator's own virtual time, for its thermal state

    def op(self, cls: str, nbytes: int, fresh: int, flops: float) -> None:
        """An op of class ``cls`` (``op_count.count_op``) ran."""
        self.seconds[cls] += self.model.op_s(cls, nbytes, fresh, flops)
        for other in self.also.values():
            other.op(cls, nbytes, fresh, flops)

    def product(self, cls: str, flops: float) -> None:
        """A GEMM (``GEMM``) or a convolution product (``CONV``) of ``flops`` ran locally."""
        self.seconds[cls] += self.model.dispatch_s["elementwise"] + flops / self.gemm_flops
        for other in self.also.values():
            other.product(cls, flops)

    def take(self) -> dict[str, int]:
        """The work so far in nanoseconds by class (those with any), and start again."""
        nominal = sum(self.seconds.values())
        speed = 1.0
        if self._thermal is not None and nominal > 0:
            burst = self._thermal.run(self._t, nominal)
            self._t += burst.duration_s
            speed = nominal / burst.duration_s
        split = {cls: round(s / speed * 1e9) for cls, s in self.seconds.items() if s > 0}
        self.seconds = dict.fromkeys(OP_CLASSES, 0.0)
        return split

    def take_also(self) -> dict[str, dict[str, int]]:
        """``take`` on each profile of ``also``, by name."""
        return {name: other.take() for name, other in self.also.items()}
