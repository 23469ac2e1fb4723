"""The emulator's configuration schema (loaded by ``morphling.config``)."""

from __future__ import annotations

import ipaddress
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from morphling.proxy.vtime.availability import (
    Availability,
    Churn,
    Presence,
    bind,
    parse_churn,
    read_trace,
)
from morphling.proxy.vtime.collectives import ALGORITHMS
from morphling.proxy.vtime.eventlog import DETAIL_STEPS, EVENT_LEVELS
from morphling.proxy.vtime.placement import POLICIES
from morphling.proxy.vtime.timeline import ON_LEAVE
from morphling.proxy.wire import challenge

from morphling.config import ConfigError
from morphling.config import option as _opt

from .auth import needs_token

PROFILE_SOURCES = ("auto", "declared", "measured")
VERIFY_MODES = "all, sample:P (0 < P <= 1) or off"


AVAILABILITY_HELP = (
    "a trace of when devices are there in virtual time: a CSV of device,start,end or "
    "FedScale's client_behave_trace as JSON (docs/TRAINING.md); a leaving "
    "device's tiles are placed again; empty: devices stay"
)
CHURN_HELP = (
    "devices leave and come back at random in virtual time: mtbf=SECONDS,mttr=SECONDS"
    "[,seed=N] (exponential up and down times); empty: none"
)

ON_LEAVE_HELP = (
    "what a rank whose device leaves does (--availability, --churn): wait (its work pauses "
    "until the device is back; a tile or collective under way starts again), restart "
    "(once back, it first does its step's work so far again) or drop (with --numerics "
    "sample:K, a replayed rank leaves the run when its device first leaves, and the "
    "others' collectives go on without it; a computed rank waits)"
)

# A job's GEMMs under 2·32³ FLOPs stay local: their round trip would dwarf their compute.
DEFAULT_MIN_FLOPS = 2 * 32**3


def parse_mode(text: str) -> float:
    """The fraction of tiles ``--verify text`` checks; ValueError naming the forms."""
    if text == "all":
        return 1.0
    if text == "off":
        return 0.0
    head, _, tail = text.partition(":")
    try:
        fraction = float(tail) if head == "sample" else math.nan
    except ValueError:
        fraction = math.nan
    if not 0 < fraction <= 1:
        raise ValueError(f"--verify {text!r}: expected {VERIFY_MODES}")
    return fraction


def _availability_source(config: EmulatorConfig) -> Churn | dict[str, Presence] | None:
    """``--churn``'s model, or the devices ``--availability``'s trace names; ValueError
    for both, or one that does not parse."""
    if config.availability and config.churn:
        raise ValueError("give --availability or --churn, not both")
    if config.churn:
        return parse_churn(config.churn)
    return read_trace(Path(config.availability)) if config.availability else None


def availability_of(config: EmulatorConfig, fleet: Sequence[str] | None) -> Availability | None:
    """``--availability``'s trace (for a fleet of these names, when known) or ``--churn``'s
    model; None for neither; ConfigError for both, or one that does not parse or bind."""
    try:
        source = _availability_source(config)
        if isinstance(source, dict):
            return bind(source, fleet, Path(config.availability))
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    return source


def check_heartbeats(heartbeat_s: float, heartbeat_timeout_s: float) -> None:
    """The rule the emulator and ``nginx-config`` share: a live peer is quiet for up to
    ``heartbeat_s`` before it heartbeats, so a timeout no longer than that drops it."""
    if heartbeat_timeout_s <= heartbeat_s:
        raise ConfigError(
            f"--heartbeat-timeout-s ({heartbeat_timeout_s}) must exceed --heartbeat-s "
            f"({heartbeat_s}): peers heartbeat only after --heartbeat-s of quiet, so a "
            "shorter timeout drops live ones"
        )


@dataclass(frozen=True)
class EmulatorConfig:
    """Every emulator setting; flags > MORPHLING_* environment > TOML [emulator] > these."""

    listen_ip: str = _opt(
        "127.0.0.1",
        "IP address to listen on (0.0.0.0: every IPv4 interface; one other machines reach "
        "needs a token, or --insecure)",
        aliases=("--listen_ip",),
    )
    listen_port: int = _opt(
        39000,
        "TCP port to listen on (0: any free one)",
        min=0,
        max=65535,
        aliases=("--listen_port",),
    )
    token: str = _opt(
        "", "shared secret peers must prove (HMAC); empty: no authentication", secret=True
    )
    device_tokens: str = _opt(
        "",
        "file of per-peer secrets, one 'NAME SECRET' per line: a peer of a listed name must "
        "prove its own (the shared token does not do); re-read on SIGHUP",
    )
    insecure: bool = _opt(
        False,
        "listen on an address other machines reach without a token: anyone reaching the "
        "port may then join as a device and send tiles, or run jobs",
    )
    max_unwelcomed: int = _opt(
        256,
        "connections one address may hold before its HELLO is accepted (through nginx every "
        "board is nginx's address); past it a connection is refused with ERROR busy",
        min=1,
    )
    ckpt_path: str = _opt(
        "",
        "checkpoint (morphling save) whose weights jobs and devices "
        "on this host share; empty: none",
        aliases=("--ckpt_path",),
    )
    block_size: int = _opt(
        256, "tile edge: output blocks of at most N×N", min=1, aliases=("--block_size",)
    )
    auto_block: bool = _opt(
        False,
        "greedy cuts each GEMM into tiles of the edge (the block size, its half or its "
        "quarter, at least 32) it predicts ends it soonest on the fleet as it stands, where "
        "one edge for all would leave a slow link's fleet waiting on a few large tiles",
    )
    policy: str = _opt(
        "greedy",
        "tile placement policy (decided in virtual time)",
        choices=POLICIES,
        aliases=("--sched_policy",),
    )
    residency: bool = _opt(
        True,
        "devices keep the operand blocks a request sent them for its other tiles, and greedy "
        "places a request's tiles as blocks of rows × columns; --no-residency: every tile "
        "carries its blocks (what upstream does), to compare",
    )
    window: int = _opt(4, "tiles in flight per device", min=1, aliases=("--max_inflight",))
    inflight_bytes: int = _opt(
        64 << 20,
        "tile operand bytes on the wire over all devices (one tile "
        "always may go; blocks a device reads in place do not count): "
        "bounds what a fleet process holds however many devices it runs",
        min=1,
    )
    high_water_bytes: int = _opt(
        4 << 20,
        "send buffer per peer past which no tile is sent to a device and no request is "
        "read from a job",
        min=1,
        aliases=("--send_high_water_mark",),
    )
    max_payload_bytes: int = _opt(1 << 30, "largest frame payload accepted", min=1)
    max_job_tiles: int = _opt(
        1 << 20,
        "tiles of a job's GEMMs in flight past which its next requests wait (each holds "
        "emulator memory and event-loop time; the GEMM that crosses the mark is taken); "
        "one GEMM with more is refused",
        min=1,
    )
    max_job_bytes: int = _opt(
        1 << 30,
        "bytes a job's GEMMs in flight hold (operands received, outputs) past which its "
        "next requests wait (the GEMM that crosses the mark is taken)",
        min=1,
    )
    arena_bytes: int = _opt(
        1 << 30,
        "shared-memory arena for jobs' GEMM operands, which devices on this "
        "host read in place instead of receiving them as bytes (reserved as "
        "used); 0: none",
        min=0,
    )
    heartbeat_s: float = _opt(5.0, "send a heartbeat after this long without traffic", min=0.01)
    heartbeat_timeout_s: float = _opt(15.0, "drop a peer silent for this long", min=0.01)
    hello_timeout_s: float = _opt(10.0, "drop a connection that sends no HELLO in time", min=0.01)
    device_wait_notice_s: float = _opt(
        10.0, "while a job's tiles wait because no device is ready, tell it this often", min=0.01
    )
    probe: bool = _opt(True, "probe latency, bandwidth and FLOPS of each device on arrival")
    probe_concurrency: int = _opt(
        8,
        "devices probed at once (concurrent bandwidth probes "
        "measure each other, and their buffers add up)",
        min=1,
    )
    probe_latency_bytes: int = _opt(64, "latency probe payload", min=1)
    probe_bandwidth_bytes: int = _opt(4 << 20, "bandwidth probe payload, each direction", min=1)
    probe_flops_dim: int = _opt(256, "FLOPS challenge matrix size", min=1, max=challenge.MAX_DIM)
    probe_timeout_s: float = _opt(5.0, "time limit of each probe", min=0.01)
    probe_tolerance: float = _opt(1e-3, "FLOPS check: |ref - c| <= tol + tol*|ref|", min=0.0)
    run_dir: str = _opt(
        "",
        "directory for the virtual timeline's event log (events.jsonl.gz, run.json) that "
        "morphling report reads; empty: keep only its hash",
    )
    events: str = _opt(
        "auto",
        "what the event log keeps: auto (every tile, GEMM and coordinator span of each "
        "job's first --events-detail-steps steps, then each step's and each device's "
        "totals: bounded for long runs), full (every tile of every step: the trace, "
        "timeline and stragglers of any step), steps (only the totals: per-step times, "
        "utilisation) or off (no log)",
        choices=EVENT_LEVELS,
    )
    events_detail_steps: int = _opt(
        DETAIL_STEPS,
        "with --events auto: the steps of each job whose every tile the log keeps",
        min=1,
    )
    sync_timeout_s: float = _opt(
        1.0,
        "with several jobs, how long virtual time waits for a job computing on the host "
        "before going on without it",
        min=0.01,
    )
    bottleneck_dl_bw: float = _opt(
        0.0,
        "bytes/s of a FIFO every download also crosses (the access point or this "
        "host's NIC); 0: none",
        min=0.0,
    )
    bottleneck_ul_bw: float = _opt(
        0.0, "bytes/s of the same shared FIFO for uploads; 0: as downloads", min=0.0
    )
    collective: str = _opt(
        "ring",
        "how ranks' collectives move their bytes in virtual time: ring (gloo's), tree (a "
        "binary tree from the root) or star (a parameter server on this host)",
        choices=ALGORITHMS,
    )
    profile_source: str = _opt(
        "auto",
        "which profile plans the schedule: declared, measured, or auto (measured for physical "
        "devices, declared for virtual ones, whose host is not the board they model)",
        choices=PROFILE_SOURCES,
    )

    metrics_port: int = _opt(
        0,
        "serve Prometheus metrics over HTTP on this port (docs/DEPLOY.md); 0: none",
        min=0,
        max=65535,
    )
    metrics_ip: str = _opt("127.0.0.1", "IP address the metrics listen on (they need no token)")

    verify: str = _opt(
        "all",
        f"which devices' tiles are checked before they reach a job (Freivalds' check, "
        f"docs/PROTOCOL.md): {VERIFY_MODES}; a device that sends a wrong one is quarantined",
    )
    quarantine_s: float = _opt(
        60.0,
        "how long a device whose tile was wrong is refused when it reconnects (doubled each "
        "further time it is caught)",
        min=0.0,
    )

    sample_tiles: int = _opt(
        0,
        "tiles of each offloaded GEMM or convolution computed on their devices, the rest of "
        "it on this host, every tile timed on its device all the same (a fast what-if); "
        "0: every tile on its device",
        min=0,
    )

    availability: str = _opt("", AVAILABILITY_HELP)
    churn: str = _opt("", CHURN_HELP)
    on_leave: str = _opt("wait", ON_LEAVE_HELP, choices=ON_LEAVE)

    def __post_init__(self) -> None:
        check_heartbeats(self.heartbeat_s, self.heartbeat_timeout_s)
        try:  # (it binds to the fleet's names once they are known: ``availability_of``)
            _availability_source(self)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        try:
            parse_mode(self.verify)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        if self.auto_block and self.policy != "greedy":
            raise ConfigError(
                f"auto_block: the tile edge is chosen by greedy's predictions, and policy is "
                f"{self.policy!r}; use policy greedy or leave auto_block off"
            )
        # A malformed address is a configuration error now, not a failed bind later.
        try:
            ipaddress.ip_address(self.listen_ip)
        except ValueError:
            raise ConfigError(
                f"listen_ip {self.listen_ip!r} is not an IP address (e.g. 0.0.0.0, 127.0.0.1, ::)"
            ) from None
        if needs_token(self.listen_ip) and not (self.token or self.device_tokens or self.insecure):
            raise ConfigError(
                f"refusing to listen on {self.listen_ip} without a token: anyone who reaches "
                "the port could join as a device and send wrong tiles, or run jobs. Give "
                "--token-file (or --device-tokens), listen on 127.0.0.1 (behind nginx, say), "
                "or pass --insecure"
            )
