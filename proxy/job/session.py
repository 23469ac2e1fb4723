"""The job runtime: a PyTorch program's GEMMs and convolutions computed by an emulated
fleet.

``emulate()`` is the library form of ``morphling run``::

    with morphling.emulate(devices="rpi4:4") as session:   # or server="HOST:PORT"
        train()                                            # unchanged code
    print(session.table())

Inside, every eligible GEMM and convolution (see ``intercept``) goes to the
emulator over a blocking socket; attention uses PyTorch's math backend so that
its GEMMs are visible; each optimizer step closes a *step* whose report says
how long it would have taken on the fleet: the emulator's virtual timeline
places every GEMM (or convolution) after the coordinator time the script spent
on the host since the last one (measured, or modelled: see ``coordinator``),
and the step ends where its last one and the optimizer's work after it end.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from morphling.devices.models.profiles import HOST, DeviceProfile
from morphling.kernels.layout import as_array
from morphling.proxy.checkpoint.format import Checkpoint, CheckpointError
from morphling.proxy.emulator.host_products import HostProducts
from morphling.proxy.emulator.settings import DEFAULT_MIN_FLOPS, EmulatorConfig
from morphling.proxy.vtime.collectives import PAIR
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from morphling.interrupt import Interrupted
from morphling.runtime import parse_server
from morphling.text import elide, elided_line

from .client import Client
from .collectives import Collectives, Pending
from .conv import ConvCall
from .coordinator import PRODUCTS, HostWork, coordinator_profile
from .embedded import EmbeddedFleet
from .intercept import Interceptor, ProductCounts

log = logging.getLogger("morphling.job")
# A request's coordinator time: nanoseconds, by op class, and by op class on each profile
# replaying the rank (``Session._host_time``).
HostTime = tuple[int, dict[str, int], dict[str, dict[str, int]]]


@dataclass(frozen=True)
class StepReport:
    """One training step (one optimizer step) as the emulation saw it."""

    step: int
    emulated_s: float  # the step's span in virtual time
    coord_s: float  # of which the script computing on the host (coordinator time)
    fleet_s: float  # the rest: waiting for the fleet's GEMMs
    host_s: float  # wall time on this host
    gemms: int  # sent to the fleet
    local_gemms: int
    convs: int  # convolution products (forward, input and weight gradients) sent
    local_convs: int
    tiles: int
    bytes_down: int  # over the emulated links (resident weight blocks do not travel)
    bytes_up: int
    wire_down: int  # over this host's sockets
    wire_up: int
    oom: int  # tiles that did not fit a device's emulated memory
    coord_split: dict[str, float]  # coord_s by op class (modelled time; empty: measured)
    # a rank's collectives: their time on the network (beside its compute, for those it
    # did not wait for at once) and its time waiting in them for the other members
    comm_s: float = 0.0
    comm_wait_s: float = 0.0
    bytes_saved: int = 0  # over the emulated links: operand blocks the devices held already
    # the least the step's partitions send: each device's distinct operand blocks, once (a
    # ``bytes_down`` above it is blocks sent to a device more than once; below, residency)
    bytes_bound: int = 0
    # tiles placed again because their device left (availability), and the time their
    # passages had run by then
    interruptions: int = 0
    lost_s: float = 0.0


class Session:
    """A job connected to an emulator; collects per-step reports."""

    def __init__(
        self, client: Client, *, min_flops: int = DEFAULT_MIN_FLOPS,
        coordinator: DeviceProfile | None = None, scale: float = 1.0,
        own_products: bool = False, replayed_on: Sequence[DeviceProfile] = (),
    ) -> None:  # fmt: skip
        """``coordinator``: the profile whose op model prices the script's own work
        (modelled coordinator time); None: this host's wall time, times ``scale``.
        ``own_products``: a rank computes its products itself, its device only times them
        (``time_gemm``, ``time_conv``); ``replayed_on``: the coordinator profiles of the
        ranks that replay this one, on which its own work is priced too (``host_alt``)."""
        if not 0 <= scale < math.inf:  # 0: the script's own time does not count at all
            raise ValueError(f"coordinator scale={scale!r}: must be finite and >= 0")
        self.client = client
        self.checkpoint: Checkpoint | None = None
        self.work = HostWork(coordinator, replayed_on) if coordinator is not None else None
        self.scale = scale
        self.interceptor = Interceptor(self._remote, self._remote_conv, min_flops=min_flops,
                                       host_work=self.work,
                                       timer=self if own_products else None)  # fmt: skip
        self.steps: list[StepReport] = []
        self.totals: dict[str, int] = {}
        self._step_start: float | None = None  # step 1 starts at its first GEMM
        self._counts = ProductCounts()
        # an embedded emulator's products computed on this host (``--numerics sample:K``)
        self.host_products: HostProducts | None = None
        self._conv_counts = ProductCounts()
        self._marked_ns = 0  # when the last step mark went back to the script
        # modelled coordinator time sent with a collective the rank did not wait for (and
        # on the profiles replaying it): the next request comes after the same one, so its
        # time includes this too
        self._carried: dict[str, int] = {}
        self._carried_alt: dict[str, dict[str, int]] = {}
        self._collectives: dict[tuple[str, tuple[int, ...]], int] = {}  # each group's count

    def share_weights(self, ckpt: str) -> None:
        """Map the emulator's shared copy of checkpoint ``ckpt``; see ``bind``."""
        announced = self.client.weights
        if not announced:
            raise CheckpointError("the emulator shares no weights (start it with --ckpt-path)")
        try:
            checkpoint = Checkpoint.open(ckpt, verify=False, writable=True, data=announced["path"])
        except CheckpointError as exc:
            raise CheckpointError(f"cannot map the emulator's shared weights (they must be on "
                                  f"this host): {exc}") from exc  # fmt: skip
        if checkpoint.digest != announced["digest"]:
            raise CheckpointError(f"{ckpt} is not the checkpoint the emulator shares")
        if announced.get("trained"):
            log.warning("weights: continuing from the working copy that %s; --fresh-weights "
                        "restores the checkpoint as saved", _trained_by(announced))  # fmt: skip
        self.checkpoint = checkpoint
        buffer = checkpoint.buffer
        self.client.shared = (buffer.data_ptr(), buffer.numel())

    def bind(self, module: torch.nn.Module) -> int:
        """Make ``module``'s parameters views of the shared weights, by name; how many.

        The Parameter objects stay (an optimizer built on them keeps working); their
        data becomes the checkpoint's, so GEMMs on them go to devices by reference.
        """
        if self.checkpoint is None:
            raise RuntimeError("bind() needs shared weights (emulate(ckpt=...))")
        bound, skipped = 0, []
        names = set(self.checkpoint.names())
        for name, param in module.named_parameters():
            view = self.checkpoint.tensor(name) if name in names else None
            if view is None or view.shape != param.shape or view.dtype != param.dtype:
                skipped.append(name)
                continue
            param.data = view
            bound += 1
        log.info("%d parameters of %s are views of the shared weights; %d are not%s",
                 bound, type(module).__name__, len(skipped),
                 f" ({', '.join(skipped[:5])}{', ...' if len(skipped) > 5 else ''})"
                 if skipped else "")  # fmt: skip
        return bound

    @property
    def counts(self) -> ProductCounts:
        """GEMMs."""
        return self.interceptor.counts

    @property
    def conv_counts(self) -> ProductCounts:
        """Convolution products."""
        return self.interceptor.conv_counts

    def _host_time(self, until_ns: int) -> HostTime:
        """Coordinator time up to ``until_ns`` since the script last got control back from
        a fleet GEMM or a step mark, how it divides among op classes: modelled (by class),
        or measured (scaled; 0 before the first; not divided), and, modelled, how it
        divides on each profile replaying this rank.

        Measured from the interceptor's stamps, so the time Morphling itself spends on a
        GEMM (checking it, sending it, waiting, making the result a tensor) is not the
        script's: what is left is what the script would spend without Morphling.
        """
        if self.work is not None:
            split = _plus(self.work.take(), self._carried)
            alt = {name: _plus(s, self._carried_alt.get(name, {}))
                   for name, s in self.work.take_also().items()}  # fmt: skip
            self._carried, self._carried_alt = {}, {}
            return sum(split.values()), split, alt
        since = max(self.interceptor.returned_ns, self._marked_ns)
        return (round((until_ns - since) * self.scale) if since else 0), {}, {}

    def _request_host_time(self) -> HostTime:
        """The coordinator time before a product about to be sent (the step's first
        starts the step)."""
        if self._step_start is None:
            self._step_start = time.perf_counter()
        return self._host_time(self.interceptor.entered_ns)

    def collective(
        self, op: str, nbytes: int, ranks: list[int], root: int, blocking: bool,
        tensors: list[torch.Tensor],
    ) -> None:  # fmt: skip
        """A rank's collective (``collectives.Collectives`` reports each before it runs),
        numbered in its group as every member numbers it; modelled time only (a rank's
        waits in gloo are no work of its own). One it does not wait for at once is pending
        until an op uses its ``tensors`` (``_wait``)."""
        assert self.work is not None, "a rank's coordinator time is modelled (emulate)"
        host_ns, split, alt = self._request_host_time()
        if not blocking:
            self._carried, self._carried_alt = split, alt
        key = ("p2p" if op in PAIR else "group", tuple(ranks))
        seq = self._collectives[key] = self._collectives.get(key, 0) + 1
        request = self.client.collective(op, nbytes, ranks=ranks, seq=seq, root=root,
                                         blocking=blocking, host_ns=host_ns,
                                         host_split=split, host_alt=alt)  # fmt: skip
        if not blocking:
            if self.interceptor.pending is None:
                self.interceptor.pending = Pending(self._wait)
            self.interceptor.pending.add(request, tensors)

    def _wait(self, request: int) -> None:
        """The rank uses the tensors of its pending collective ``request``: it waits for it
        here, after the modelled time since its last request."""
        host_ns, split, alt = self._request_host_time()
        self.client.wait(request, host_ns=host_ns, host_split=split, host_alt=alt)

    def _remote(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        host_ns, split, _ = self._request_host_time()  # (no rank replays a fleet's product)
        return torch.from_numpy(self.client.matmul(a, b, host_ns=host_ns, host_split=split))

    def _remote_conv(
        self, kind: str, a: torch.Tensor, b: torch.Tensor, call: ConvCall
    ) -> torch.Tensor:
        host_ns, split, _ = self._request_host_time()
        geometry = call.geometry
        return torch.from_numpy(
            self.client.conv(
                kind, as_array(a, "a"), as_array(b, "b"),
                input_shape=call.input, weight_shape=call.weight, stride=geometry.stride,
                padding=geometry.padding, dilation=geometry.dilation, groups=geometry.groups,
                host_ns=host_ns, host_split=split,
            )
        )  # fmt: skip

    def time_gemm(self, a: torch.Tensor, b: torch.Tensor) -> None:
        """``a @ b``, which the rank computed itself, timed on its device."""
        host_ns, split, alt = self._request_host_time()
        self.client.rank_matmul(a, b, host_ns=host_ns, host_split=split, host_alt=alt)

    def time_conv(self, kind: str, call: ConvCall, dtype: torch.dtype) -> None:
        """A convolution's product, which the rank computed itself, timed on its device."""
        host_ns, split, alt = self._request_host_time()
        geometry = call.geometry
        self.client.rank_conv(
            kind, str(dtype).removeprefix("torch."), input_shape=call.input,
            weight_shape=call.weight, stride=geometry.stride, padding=geometry.padding,
            dilation=geometry.dilation, groups=geometry.groups, host_ns=host_ns,
            host_split=split, host_alt=alt,
        )  # fmt: skip

    def end_step(self) -> StepReport:
        """Close the current step (called after every optimizer step)."""
        if self.interceptor.pending:  # the step's end waits for all of them
            self.interceptor.pending.wait_all()
        host_ns, split, alt = self._host_time(time.perf_counter_ns())
        if self.work is not None:
            self.work.in_optimizer = False  # its step is over
        now = time.perf_counter()
        counts = self.counts.since(self._counts)
        convs = self.conv_counts.since(self._conv_counts)
        local = sum(counts.local.values())
        reply = self.client.step(
            len(self.steps) + 1,
            host_ns=host_ns,
            host_split=split,
            local_gemms=local,
            host_alt=alt,
        )
        emulated_s, coord_s = reply.emulated_ns / 1e9, reply.coord_ns / 1e9
        report = StepReport(
            step=reply.step,
            emulated_s=emulated_s,
            coord_s=coord_s,
            fleet_s=emulated_s - coord_s,
            host_s=now - (self._step_start if self._step_start is not None else now),
            gemms=counts.remote,
            local_gemms=local,
            convs=convs.remote,
            local_convs=sum(convs.local.values()),
            tiles=reply.tiles,
            bytes_down=reply.link_down,
            bytes_up=reply.link_up,
            wire_down=reply.bytes_down,
            wire_up=reply.bytes_up,
            oom=reply.oom,
            coord_split={cls: ns / 1e9 for cls, ns in reply.coord_split.items()},
            comm_s=reply.comm_ns / 1e9,
            comm_wait_s=reply.comm_wait_ns / 1e9,
            bytes_saved=reply.link_saved,
            bytes_bound=reply.link_bound,
            interruptions=reply.interruptions,
            lost_s=reply.lost_ns / 1e9,
        )
        self.steps.append(report)
        self._counts = self.counts.snapshot()
        self._conv_counts = self.conv_counts.snapshot()
        log.debug("step %d: %s", report.step, report)
        self._step_start = time.perf_counter()
        self._marked_ns = time.perf_counter_ns()  # the script's time starts again
        return report

    def close(self) -> None:
        reply = self.client.close()
        if reply is not None:
            keys = ("gemms", "tiles", "model_ns", "bytes_down", "bytes_up", "oom")
            self.totals = {k: getattr(reply, k) for k in keys}

    def table(self) -> str:
        """The per-step report as a fixed-width table."""
        head = (f"{'step':>5} {'emulated s':>11} {'fleet s':>9} {'coord s':>8} {'host s':>8} "
                f"{'GEMMs':>6} {'local':>6} {'tiles':>7} {'MiB down':>9} {'saved':>8} "
                f"{'bound':>8} {'MiB up':>8} {'OOM':>5}")  # fmt: skip
        rows = [head, "-" * len(head)]
        first, left_out, last = elide(self.steps)
        rows += [_step_row(r) for r in first]
        if left_out:
            rows.append(elided_line(left_out, "--json has every step"))
            rows += [_step_row(r) for r in last]
        rows.append(f"GEMMs: {self.counts.remote} on the fleet ({self.counts.copied} copied "
                    f"to a BLAS layout first); local: {_by_reason(self.counts)}")  # fmt: skip
        convs = self.conv_counts
        if convs.remote or convs.local:  # a model without convolutions does not mention them
            rows.append(f"convolutions: {convs.remote} products on the fleet ({convs.copied} "
                        f"copied to NCHW first); kept local: {_by_reason(convs)}")  # fmt: skip
        host = self.host_products
        if host is not None and host.sample_tiles:
            rows.append(f"tiles computed on this host: {host.on_host}, and {host.on_devices} "
                        f"on their devices ({host.sample_tiles} of each product of more; "
                        "--numerics sample:K); every tile timed on its device")  # fmt: skip
        interrupted = sum(r.interruptions for r in self.steps)
        if interrupted:  # a fleet whose devices come and go (--availability, --churn)
            rows.append(f"devices leaving: {interrupted} interruptions (tiles placed again, or "
                        f"a rank's device away), {sum(r.lost_s for r in self.steps):.4f} s of "
                        "work lost (every step; --json has each)")  # fmt: skip
        by_class = collections.Counter[str]()
        for r in self.steps:
            by_class.update(r.coord_split)
        if by_class:
            rows.append("coordinator time by op class, all steps: " + ", ".join(
                f"{cls} {s:.4f} s" for cls, s in by_class.most_common()))  # fmt: skip
        return "\n".join(rows)

    def summary(self) -> dict[str, Any]:
        """Machine-readable: every step, the totals and the local GEMMs by reason."""
        return {
            "steps": [asdict(r) for r in self.steps],
            "totals": self.totals,
            "gemms_remote": self.counts.remote,
            "gemms_copied": self.counts.copied,
            "gemms_local": dict(self.counts.local),
            "convs_remote": self.conv_counts.remote,
            "convs_copied": self.conv_counts.copied,
            "convs_local": dict(self.conv_counts.local),
            "collectives": sum(self._collectives.values()),
        }


def _by_reason(counts: ProductCounts) -> str:
    """Products kept local, by reason: "1 dtype float16, 3 small" (or "none")."""
    return ", ".join(f"{n} {why}" for why, n in sorted(counts.local.items())) or "none"


def _step_row(r: StepReport) -> str:
    return (
        f"{r.step:>5} {r.emulated_s:>11.4f} {r.fleet_s:>9.4f} {r.coord_s:>8.4f} {r.host_s:>8.3f} "
        f"{r.gemms:>6} {r.local_gemms:>6} {r.tiles:>7} "
        f"{r.bytes_down / 2**20:>9.1f} {r.bytes_saved / 2**20:>8.1f} "
        f"{r.bytes_bound / 2**20:>8.1f} {r.bytes_up / 2**20:>8.1f} {r.oom:>5}"
    )


@contextlib.contextmanager
def emulate(
    server: str | None = None,
    *,
    devices: str | None = None,
    config: EmulatorConfig | None = None,
    token: str = "",
    block: int = 0,
    min_flops: int = DEFAULT_MIN_FLOPS,
    name: str = "job",
    ckpt: str | None = None,
    coordinator: str = HOST,
    coordinator_time: str | None = None,
    scale: float = 1.0,
    link: str | None = None,
    cooling: str | None = None,
    share_memory: bool = True,
    max_devices: int = 0,
    device_wait_s: float = 0.0,
    fresh_weights: bool = False,
    device: str = "",
    rank: int | None = None,
    world: int = 0,
    products: str = "device",
    replayed_on: Sequence[str] = (),
) -> Iterator[Session]:
    """Run the body's GEMMs on a fleet: a running emulator at ``server``
    (``HOST:PORT``), or an embedded one with the virtual ``devices`` SPEC (the
    emulator's ``config`` may set its run directory, policy, ...; ``link`` and
    ``cooling`` override the devices' own).

    With ``ckpt``, the first module the body calls gets its parameters bound to the
    emulator's shared copy of that checkpoint (an embedded emulator loads it): as earlier
    jobs left it (a warning says which trained it), or with ``fresh_weights`` restored
    from the checkpoint first.
    ``coordinator`` is the hardware the script itself runs on: ``host``, or a profile (a
    built-in name or a file) whose op model prices its work (``cooling`` applies to it too);
    ``coordinator_time`` how that time counts (``coordinator.MODES``; default: measured for
    ``host``, model for a profile; measured time is multiplied by ``scale``).
    ``share_memory`` off sends operands and results as bytes even on the emulator's host.
    ``max_devices`` bounds the embedded fleet instead of the host's available memory
    (``devices.capacity``).
    ``device_wait_s`` (0: for ever) is how long the job's GEMMs may wait with no device
    ready before it fails (``Client``). ``device`` (a name) has every product computed by
    that one device. A ``rank`` (of ``world``) runs on ``device`` itself (none: device
    ``rank`` of the emulator's fleet, ``profiles.fleet_order``): its products
    cross no link, its torch.distributed operations are priced on the network
    (``collectives``), and its own work is modelled by the coordinator profile (its
    device's). ``products`` (``PRODUCTS``) says who computes a rank's products: its
    ``device``, or the ``rank`` itself, its device only timing them (for a device that is a
    model computing on this host: an embedded one). ``replayed_on``: the coordinator
    profiles (names or files) of the ranks replaying this one (``--numerics sample:K``),
    on which its own work is priced too. Should the body raise (Ctrl-C, say), the
    embedded emulator's run directory is marked incomplete, with the reason.
    """
    if (server is None) == (devices is None):
        raise ValueError("give exactly one of server='HOST:PORT' or devices='SPEC' (embedded)")
    if fresh_weights and ckpt is None:
        raise ValueError("fresh_weights needs ckpt: the weights to restore are a checkpoint's")
    profile = coordinator_profile(coordinator, coordinator_time, cooling=cooling)
    if rank is not None and profile is None:
        raise ValueError("a rank's own work is modelled by its board's op model: give a "
                         "modelled coordinator")  # fmt: skip
    if products not in PRODUCTS or (products == "rank" and rank is None):
        raise ValueError(f"products={products!r}: one of {', '.join(PRODUCTS)} ('rank' for a "
                         "rank only)")  # fmt: skip
    also = [coordinator_profile(name, "model", cooling=cooling) for name in replayed_on]
    with contextlib.ExitStack() as stack:
        if devices is not None:
            if ckpt is not None:
                config = dataclasses.replace(config or EmulatorConfig(), ckpt_path=str(ckpt))
            embedded = EmbeddedFleet(
                devices, config, link=link, cooling=cooling, max_devices=max_devices,
                run_info={"coordinator": coordinator,
                          "coordinator_time": "measured" if profile is None else "model",
                          "coordinator_scale": scale,
                          "link": link, "cooling": cooling, "devices": devices},
            )  # fmt: skip
            stack.callback(embedded.stop)
            host, port = embedded.start()
        else:
            assert server is not None, "exactly one of server and devices (checked above)"
            host, port = parse_server(server)
        session = Session(Client(host, port, token=token, name=name, block=block,
                                 share_memory=share_memory, device_wait_s=device_wait_s,
                                 map_weights=ckpt is not None, fresh_weights=fresh_weights,
                                 device=device, rank=-1 if rank is None else rank,
                                 world=world),
                          min_flops=min_flops, coordinator=profile,
                          own_products=products == "rank",
                          replayed_on=[p for p in also if p is not None],
                          scale=scale)  # fmt: skip
        stack.callback(session.close)
        if devices is not None and embedded.emulator is not None:
            session.host_products = embedded.emulator.host_products
        if ckpt is not None:
            session.share_weights(ckpt)
            stack.callback(_bind_first_module(session).remove)

        def end_step(*_: object) -> None:  # a post hook returns nothing
            session.end_step()

        hook = register_optimizer_step_post_hook(end_step)
        stack.callback(hook.remove)
        if session.work is not None:  # an optimizer's own ops are their own class
            work = session.work

            def in_optimizer(*_: object) -> None:
                work.in_optimizer = True

            hook = register_optimizer_step_pre_hook(in_optimizer)
            stack.callback(hook.remove)
        stack.enter_context(sdpa_kernel([SDPBackend.MATH]))
        if rank is not None:
            stack.enter_context(Collectives(session.collective))
        stack.enter_context(session.interceptor)
        try:
            yield session
        except BaseException as exc:  # Ctrl-C, SIGTERM (``interrupt``), an error
            if devices is not None:  # its run.json says the run did not end
                embedded.run_info["incomplete"] = _ended_by(exc)
            raise


def _ended_by(exc: BaseException) -> str:
    """Why a run did not end: "interrupted by SIGTERM", "KeyboardInterrupt", "OSError: ..."."""
    if isinstance(exc, Interrupted) or not str(exc):
        return str(exc) or type(exc).__name__
    return f"{type(exc).__name__}: {exc}"


def _trained_by(announced: dict[str, Any]) -> str:
    """Which jobs trained the shared weights (GREETING ``weights``), in words."""
    trained = announced["trained"]
    count = announced.get("trained_jobs", len(trained))

    def steps(entry: dict[str, Any]) -> str:
        return f"{entry['steps']} step{'s' if entry['steps'] != 1 else ''}"

    if count == 1:
        (entry,) = trained
        running = " and is still training" if entry["running"] else ""
        return f"job '{entry['job']}' trained for {steps(entry)}{running}"
    jobs = ", ".join(f"'{e['job']}' ({steps(e)}{', still running' if e['running'] else ''})"
                     for e in trained)  # fmt: skip
    earlier = f" and {count - len(trained)} earlier" if count > len(trained) else ""
    return f"jobs {jobs}{earlier} trained"


def _bind_first_module(session: Session) -> Any:
    """Bind the first module called (the model, when the script calls it) once."""

    def hook(module: torch.nn.Module, args: Any) -> None:
        handle.remove()
        session.bind(module)

    handle = register_module_forward_pre_hook(hook)
    return handle


def _plus(split: dict[str, int], more: dict[str, int]) -> dict[str, int]:
    """Two op-class splits added."""
    if not more:
        return split
    return {c: split.get(c, 0) + more.get(c, 0) for c in split.keys() | more.keys()}
