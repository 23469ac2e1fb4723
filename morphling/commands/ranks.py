"""``morphling run --ranks N``: N ranks of one script, each wholly on its own device.

The ranks are started as torchrun starts them: child processes with RANK, LOCAL_RANK,
WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT set (and OMP_NUM_THREADS=1
unless it is set, as torchrun does for several ranks on one host), so
``init_process_group("gloo")`` works unchanged and the numerics are torchrun's. Each
child is ``morphling run --server ... --device NAME``: a job of this process's embedded
emulator pinned to device r of the fleet (SPEC order), so everything rank r computes on
the fleet, device r computes. One rank failing stops the others, as torchrun does, and
the report says which and how, with its last lines of stderr (which every rank's lines
reach marked with its rank). A rank whose job the emulator dropped (silent past its
heartbeat timeout) but whose process lives on is stuck, and stops the run too: it is asked
for its Python stacks (``STACKS_SIGNAL``, which each rank's ``faulthandler`` answers),
which its stderr then shows, and stopped.

Each rank's collectives are priced on the emulated network (``proxy/vtime/collectives``)
and its own work by its device's op model.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from morphling.devices.models.profiles import device_names
from morphling.interrupt import Interrupted, Signals

if TYPE_CHECKING:
    from morphling.proxy.job.embedded import EmbeddedFleet

log = logging.getLogger("morphling.job")

STOP_GRACE_S = 10.0  # how long a rank stopped by SIGTERM may take to report before SIGKILL
LAST_WORDS = 6  # the lines of a rank's stderr kept to say why it failed
LAST_WORDS_CHARS = 600
ECHO_JOIN_S = 2.0  # how long its stderr may take to drain once it has exited
LOST_GRACE_S = 5.0  # how long a rank may outlive its job before it is taken for stuck
STACKS_SIGNAL = signal.SIGUSR1  # a rank dumps its threads' Python stacks on it
STACKS_WAIT_S = 1.0  # how long they may take to reach its stderr before it is stopped


@dataclass
class Rank:
    """One child: its rank, device, process and its report (``--json``), once read."""

    rank: int
    device: str
    process: subprocess.Popen[bytes]
    report_path: Path
    report: dict[str, Any] = field(default_factory=lambda: {"steps": []})
    exit_code: int | None = None
    ended_at: float | None = None  # when its process ended (monotonic), once it has
    stopped: bool = False  # stopped by us, another rank having failed (or on a signal)
    lost: str = ""  # why the emulator dropped its job while its process ran on
    lost_at: float = 0.0  # when that was seen
    stuck: bool = False  # it outlived its job by LOST_GRACE_S: it stopped the run
    last_words: deque[str] = field(default_factory=lambda: deque(maxlen=LAST_WORDS))
    echo: threading.Thread | None = None

    def why(self) -> str:
        """How it ended (or why it is being stopped), and the last lines it wrote (gloo's
        error, say)."""
        code = self.exit_code
        how = (f"was killed by {signal.Signals(-code).name}" if code is not None and code < 0
               else f"exited with code {code}")  # fmt: skip
        name = f"rank {self.rank} (device {self.device})"
        if self.stuck:  # its last words are its stacks' outer frames: not repeated here
            stopped = f"; it {how} when stopped" if code is not None else ""
            return (
                f"{name} was stuck: the emulator dropped its job ({self.lost}) and its "
                f"process did not end (its Python stacks are in its stderr){stopped}"
            )
        said = " | ".join(line for line in self.last_words if line.strip())
        return f"{name} {how}" + (f"; its last words: {said[-LAST_WORDS_CHARS:]}" if said else "")


def _echo(child: Rank, stream: IO[bytes]) -> None:
    """Copy a rank's stderr to ours, each line marked with its rank (as torchrun's
    ``--tee`` does), and keep its last lines."""
    mark = f"[rank{child.rank}]: "
    for raw in stream:
        line = raw.decode(errors="replace").rstrip("\n")
        child.last_words.append(line)
        sys.stderr.write(line + "\n" if line.startswith("[rank") else mark + line + "\n")
        sys.stderr.flush()


def child_env(rank: int, world: int, master_port: int, drop: set[str]) -> dict[str, str]:
    """This process's environment as torchrun gives it to rank ``rank`` on one host, less
    ``drop``: the variables of ``morphling run``'s settings, which its flags carry (a
    ``MORPHLING_RANKS`` would have each rank start ranks of its own)."""
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(
        RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0", ROLE_RANK=str(rank),
        WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world), ROLE_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(master_port),
    )  # fmt: skip
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def free_port() -> int:
    """A loopback port nothing listens on now (the rendezvous's, as torchrun picks one)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def launch(
    embedded: EmbeddedFleet,
    devices: list[str],
    job_flags: list[str],
    command: list[str],
    signals: Signals,
    settings_env: set[str],
    *,
    computed: int = 0,
) -> tuple[list[Rank], Interrupted | None]:
    """Start a rank on each of ``devices`` (names of the started ``embedded`` emulator's
    fleet, in rank order), wait for them all (one failing stops the others), and return
    them with the signal, if one came.

    ``job_flags`` are ``morphling run`` flags every rank takes (the coordinator's, say);
    ``settings_env`` the environment variables of its settings, which the ranks do not get;
    ``computed``: how many of the ranks run (0: all), a world of their own for torch; the
    emulator replays the others (``--numerics sample:K``), rank s copying rank s mod K, so
    rank r also prices its own work on the profiles of the ranks that copy it."""
    assert embedded.address is not None, "the embedded emulator is started"
    host, port = embedded.address
    profiles = dict(zip(device_names(embedded.profiles), embedded.profiles, strict=True))
    world, ranks = len(devices), computed or len(devices)
    level = logging.getLevelName(logging.getLogger("morphling").getEffectiveLevel()).lower()
    master = free_port()
    command = command[1:] if command[:1] == ["--"] else command
    workdir = Path(tempfile.mkdtemp(prefix="morphling-ranks-"))
    children: list[Rank] = []
    try:
        for r, name in enumerate(devices[:ranks]):
            report = workdir / f"rank-{r}.json"
            copies = sorted({profiles[d].name for d in devices[r + ranks :: ranks]})
            cmd = [
                sys.executable, "-m", "morphling", "--log-level", level, "run",
                "--server", f"{host}:{port}", "--device", name, "--rank", str(r),
                "--world", str(world), "--coordinator", profiles[name].name,
                *(["--replayed-on", ",".join(copies)] if copies else []),
                "--coordinator-time", "model", "--no-table", "--json", str(report),
                *job_flags, "--", *command,
            ]  # fmt: skip
            log.info("rank %d on device %s: %s", r, name, " ".join(command))
            env = child_env(r, ranks, master, settings_env)
            process = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE)
            child = Rank(r, name, process, report)
            assert process.stderr is not None
            child.echo = threading.Thread(target=_echo, args=(child, process.stderr), daemon=True)
            child.echo.start()
            threading.Thread(target=_reap, args=(child,), daemon=True).start()
            children.append(child)
        assert embedded.emulator is not None, "the embedded emulator is started"
        interrupted = _wait(children, signals, embedded.emulator.ranks_lost)
        for child in children:  # what it wrote last (a process it started may hold the pipe)
            if child.echo is not None:
                child.echo.join(timeout=ECHO_JOIN_S)
        for child in children:
            with contextlib.suppress(OSError, ValueError):  # none: it failed before writing
                child.report = json.loads(child.report_path.read_text())
        return children, interrupted
    finally:
        for child in children:  # an error of ours: no rank outlives this process
            if child.process.poll() is None:
                child.process.kill()
                child.process.wait()
        for path in workdir.iterdir():
            path.unlink()
        workdir.rmdir()


def _wait(children: list[Rank], signals: Signals, lost: Mapping[int, str]) -> Interrupted | None:
    """Wait for every rank; the first to fail or to be stuck (its job in ``lost``, the
    emulator's, its process still running), or a signal, stops the others. The signal,
    if one came."""
    stopping_since: float | None = None
    interrupted: Interrupted | None = None
    while any(c.exit_code is None for c in children):
        try:
            signals.check()
        except Interrupted as exc:
            if interrupted is None:
                interrupted = exc
                print(f"morphling run: {exc}; stopping the ranks", file=sys.stderr)
                stopping_since = _stop(children, stopping_since)
        ended = [c for c in children if c.exit_code is None and c.ended_at is not None]
        for child in sorted(ended, key=_ended):  # the first to end is what the others died of
            child.exit_code = rc = child.process.returncode
            if rc != 0 and not child.stopped and stopping_since is None:
                if child.echo is not None:
                    child.echo.join(timeout=ECHO_JOIN_S)
                print(f"morphling run: {child.why()}{_left(children)}; stopping the other "
                      "ranks", file=sys.stderr)  # fmt: skip
                stopping_since = _stop(children, stopping_since)
        if stopping_since is None and (stuck := _stuck(children, lost)) is not None:
            print(f"morphling run: {stuck.why()}; stopping the ranks", file=sys.stderr)
            stopping_since = _stop(children, stopping_since)
        if stopping_since is not None and time.monotonic() - stopping_since > STOP_GRACE_S:
            for child in children:
                if child.exit_code is None:
                    child.process.kill()
        time.sleep(0.05)
    return interrupted


def _reap(child: Rank) -> None:
    """Wait for a rank's process and note when it ended: ranks seen to have ended at one
    look are told apart so (a rank fails in gloo just after its peer ended)."""
    child.process.wait()
    child.ended_at = time.monotonic()


def _ended(child: Rank) -> float:
    return math.inf if child.ended_at is None else child.ended_at


def _stuck(children: list[Rank], lost: Mapping[int, str]) -> Rank | None:
    """A rank that outlived its job by ``LOST_GRACE_S`` (asked for its stacks, and given
    ``STACKS_WAIT_S`` to write them), if any."""
    now = time.monotonic()
    for child in children:
        if child.exit_code is not None or child.rank not in lost:
            continue
        if not child.lost:
            child.lost, child.lost_at = lost[child.rank], now
        elif now - child.lost_at > LOST_GRACE_S:
            with contextlib.suppress(ProcessLookupError):
                child.process.send_signal(STACKS_SIGNAL)
            time.sleep(STACKS_WAIT_S)
            child.stuck = True
            return child
    return None


def _left(children: list[Rank]) -> str:
    """The ranks that ended well before the others (whose collectives then fail), if any."""
    gone = [c for c in children if c.exit_code == 0]
    if not gone or len(gone) == len(children):
        return ""
    named = ", ".join(f"rank {c.rank}" for c in gone[:4])
    return (f" (after {named} had exited with code 0, leaving collectives the others still "
            "make: a rank that stops early fails the others)")  # fmt: skip


def failed(children: list[Rank]) -> Rank | None:
    """The rank that was stuck or else failed first (not one stopped for it), if any."""
    failures = [c for c in children if c.exit_code and not c.stopped]
    return next((c for c in children if c.stuck), None) or min(failures, key=_ended, default=None)


def _stop(children: list[Rank], since: float | None) -> float:
    """SIGTERM every rank still running (each reports what it ran, as on Ctrl-C)."""
    for child in children:
        if child.exit_code is None and child.process.poll() is None:
            child.stopped = True
            child.process.send_signal(signal.SIGTERM)
    return since if since is not None else time.monotonic()


def summary(children: list[Rank]) -> dict[str, Any]:
    """``--json``: every rank's report (its device and exit code added) and, per step, the
    slowest rank's: a step of the run ends when its slowest rank's does."""
    ranks = [
        {"rank": child.rank, "device": child.device, "exit_code": child.exit_code,
         "stopped": child.stopped, "last_words": list(child.last_words) if child.exit_code
         else [], **child.report}
        for child in children
    ]  # fmt: skip
    steps = []
    for index in range(max((len(r["steps"]) for r in ranks), default=0)):
        times = [(r["steps"][index]["emulated_s"], r["rank"]) for r in ranks
                 if index < len(r["steps"])]  # fmt: skip
        slowest, rank = max(times)
        steps.append({"step": index + 1, "emulated_s": slowest, "rank": rank,
                      "ranks": len(times)})  # fmt: skip
    return {"ranks": ranks, "steps": steps}


def table(run: dict[str, Any]) -> str:
    """Each rank's steps and each step's slowest rank, as fixed-width tables, and what the
    ranks' collectives say: who waited for whom, or that there were none."""
    head = (f"{'rank':>4} {'device':<14} {'steps':>5} {'emulated s/step':>15} {'comm s':>8} "
            f"{'wait s':>8} {'GEMMs':>6} {'convs':>6} {'exit':>5}")  # fmt: skip
    rows = [head, "-" * len(head)]
    for r in run["ranks"]:
        steps = r["steps"]
        count = len(steps) or float("nan")
        mean = sum(s["emulated_s"] for s in steps) / count
        comm = sum(s["comm_s"] for s in steps) / count
        wait = sum(s["comm_wait_s"] for s in steps) / count
        exit_code = f"{r['exit_code']}" + ("*" if r["stopped"] else "")
        rows.append(
            f"{r['rank']:>4} {r['device']:<14} {len(steps):>5} {mean:>15.4f} {comm:>8.4f} "
            f"{wait:>8.4f} {r.get('gemms_remote', 0):>6} {r.get('convs_remote', 0):>6} "
            f"{exit_code:>5}"
        )
    rows.append("comm s, wait s: per step, the time its collectives took on the network, and "
                "the time it waited in them for the other ranks")  # fmt: skip
    if any(r["stopped"] for r in run["ranks"]):
        rows.append("* stopped by morphling run when another rank failed or on a signal")
    rows += _collective_notes(run["ranks"])
    replay = run.get("replay")
    if replay:
        rows.append(
            f"{replay['replayed']} more ranks replayed ({replay['copies']}) on their own "
            f"devices, {replay['timed']} timed and the others mirroring one timed on a device "
            "alike: their steps are in the run directory (morphling report)"
        )
        if replay["diverged_steps"]:
            rows.append(f"replay may be wrong: in {replay['diverged_steps']} steps the computed "
                        "ranks' shapes differed")  # fmt: skip
    if run["steps"]:
        rows += ["", f"{'step':>5} {'emulated s':>11} {'slowest rank':>12}"]
        rows += [f"{s['step']:>5} {s['emulated_s']:>11.4f} {s['rank']:>12}" for s in run["steps"]]
    return "\n".join(rows)


def _collective_notes(ranks: list[dict[str, Any]]) -> list[str]:
    """No collectives at all (independent copies), or the ranks that waited most."""
    ran = [r for r in ranks if r["steps"]]
    if len(ranks) > 1 and ran and not any(r.get("collectives") for r in ran):
        return [f"no rank made a collective: {len(ranks)} independent copies of the script "
                "(it never initialised a process group, or never used it)"]  # fmt: skip
    waits = {r["rank"]: sum(s["comm_wait_s"] for s in r["steps"]) for r in ran}
    if not waits or max(waits.values()) <= 0:
        return []
    slowest = min(waits, key=lambda r: waits[r])  # the one the others wait for
    waiting = sorted((r for r in waits if waits[r] > 0), key=lambda r: -waits[r])
    named = ", ".join(f"rank {r} {waits[r]:.4f} s" for r in waiting[:4])
    return [f"stragglers: rank {slowest} waited least; in collectives the others waited "
            f"for it: {named}"]  # fmt: skip
