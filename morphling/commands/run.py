"""``morphling run [options] -- python train.py ARGS``: an unmodified script on a fleet.

The script runs in this process (as ``python`` would run it: ``__main__``,
its ``sys.argv``, its directory first on ``sys.path``) inside
``session.emulate``, so its GEMMs go to the emulator. At the end the
per-step report is printed to stderr (the script owns stdout) and, with
``--json``, written as JSON. With ``--embedded`` the virtual timeline is
written to a run directory and reported on (``morphling report`` reads it
again). The exit code is the script's; SIGTERM or SIGINT stops the script as Ctrl-C
does, and the run ends as usual (the fleet stopped, its shared memory removed, the
report printed, the run directory marked incomplete), exiting 143 or 130.
"""

from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import importlib.util
import json
import logging
import os
import runpy
import shutil
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path

from morphling import config as configuration
from morphling.config import option as _opt
from morphling.devices.models.capacity import MAX_DEVICES_HELP
from morphling.devices.models.links import LINKS
from morphling.devices.models.profiles import HOST, device_names, expand_fleet
from morphling.devices.models.thermal import COOLING
from morphling.exiting import exit_without_finalizing
from morphling.interrupt import Interrupted, Signals
from morphling.outputs import check_file_writable
from morphling.proxy.emulator.replay import NUMERICS_HELP, parse_numerics
from morphling.proxy.emulator.settings import (
    AVAILABILITY_HELP,
    CHURN_HELP,
    DEFAULT_MIN_FLOPS,
    ON_LEAVE_HELP,
    VERIFY_MODES,
    EmulatorConfig,
    availability_of,
    parse_mode,
)
from morphling.proxy.job.coordinator import MODES, PRODUCTS, coordinator_profile
from morphling.proxy.vtime.collectives import ALGORITHMS
from morphling.proxy.vtime.eventlog import EVENT_LEVELS
from morphling.proxy.vtime.placement import POLICIES
from morphling.proxy.vtime.timeline import ON_LEAVE
from morphling.runtime import parse_server

from . import ranks
from .run_dir import claim

log = logging.getLogger("morphling.job")


@dataclass(frozen=True)
class RunConfig:
    server: str = _opt(
        "", "emulator address HOST:PORT (one of --server, --embedded)", aliases=("--proxy_host",)
    )
    embedded: bool = _opt(False, "start an emulator and a virtual fleet in this process")
    ranks: int = _opt(
        0,
        "start N ranks of the script as torchrun would (RANK, WORLD_SIZE, MASTER_ADDR, ...), "
        "rank r wholly on device r of the --embedded fleet; 0: one script, its products "
        "spread over the fleet",
        min=0,
    )
    rank_devices: str = _opt(
        "",
        "with --ranks: the device of each rank in rank order, as names of the --embedded "
        "fleet (e.g. rpi5-3,rpi4-0); empty: rank r on device r",
    )
    device: str = _opt(
        "",
        "compute every product on this one device of the fleet (a name, e.g. rpi5-1), as a "
        "single board trains; empty: spread over the fleet (--ranks sets each rank's)",
    )
    rank: int = _opt(
        -1,
        "run as rank R of --world ranks of a distributed script, on --device itself (none: "
        "device R of the emulator's fleet): its collectives priced on the emulated network, "
        "its own work by --coordinator's op model (--ranks starts each rank so); -1: no "
        "rank, or with --server the environment's RANK of WORLD_SIZE (torchrun's)",
        min=-1,
    )
    world: int = _opt(0, "with --rank: how many ranks the distributed script has", min=0)
    numerics: str = _opt("all", NUMERICS_HELP)
    replayed_on: str = _opt(
        "",
        "with --rank: the coordinator profiles (comma-separated) of the ranks that replay "
        "this one, on which its own work is priced too (--numerics sample:K sets it)",
    )
    products: str = _opt(
        "",
        "who computes a rank's GEMMs and convolutions: its device, or the rank itself, its "
        "device only timing them (the same virtual time; for devices that are models "
        "computing on this host anyway); empty: rank with --ranks (an --embedded fleet), "
        "device otherwise",
        choices=("", *PRODUCTS),
    )
    devices: str = _opt(
        "4",
        "fleet SPEC for --embedded: NAME:COUNT,... or a count (NAME 'host': "
        "this host, measured on first use and cached)",
    )
    max_devices: int = _opt(0, f"--embedded: {MAX_DEVICES_HELP}", min=0)
    token: str = _opt("", "shared secret, if the emulator requires one", secret=True)
    ckpt: str = _opt(
        "",
        "checkpoint (morphling save) the emulator shares: the model's "
        "parameters become views of it, sent to devices by reference",
    )
    fresh_weights: bool = _opt(
        False,
        "with --ckpt: start from the checkpoint as saved, restoring the emulator's working "
        "copy first (refused while another job maps it); otherwise the job continues from "
        "what earlier jobs trained",
    )
    block_size: int = _opt(0, "tile edge (0: the emulator's default)", min=0)
    policy: str = _opt("greedy", "tile placement policy (--embedded)", choices=POLICIES)
    auto_block: bool = _opt(
        False,
        "greedy cuts each GEMM into tiles of the edge (the block size, its half or its "
        "quarter) it predicts ends it soonest on the fleet (--embedded)",
    )
    residency: bool = _opt(
        True,
        "devices keep a request's operand blocks for its other tiles (--embedded; "
        "--no-residency: every tile carries its blocks, to compare)",
    )
    verify: str = _opt(
        "all",
        f"which devices' tiles the embedded emulator checks before they reach the script "
        f"(--embedded; docs/PROTOCOL.md, Verification): {VERIFY_MODES}",
    )
    link: str = _opt(
        "",
        "link preset for every device (--embedded; empty: the profiles' own)",
        choices=("", *LINKS),
    )
    cooling: str = _opt(
        "",
        "cooling of every device (--embedded) and of a --coordinator profile (empty: the "
        "profiles' own)",
        choices=("", *COOLING),
    )
    bottleneck_bw: float = _opt(
        0.0,
        "bytes/s of a FIFO all transfers share, e.g. the access point (--embedded; 0: none)",
        min=0.0,
    )
    collective: str = _opt(
        "ring",
        "how --ranks' collectives move their bytes (--embedded): ring (gloo's), tree (a "
        "binary tree from the root) or star (a parameter server on this host)",
        choices=ALGORITHMS,
    )
    coordinator: str = _opt(
        HOST,
        "the hardware the script itself runs on: host (this machine) or a profile (a "
        "built-in name or a .toml file) whose op model prices the script's own work",
    )
    coordinator_time: str = _opt(
        "",
        "the script's own time between fleet products: measured (wall time x "
        "--coordinator-scale; host only) or model (counted work priced by the coordinator's "
        "op model: the same timeline on any host, however loaded); empty: measured for "
        "host, model for a profile",
        choices=("", *MODES),
    )
    coordinator_scale: float = _opt(1.0, "multiplies measured coordinator time", min=0.0)
    share_memory: bool = _opt(
        True,
        "on the emulator's host, pass GEMM operands and results through its operand arena, "
        "and in its process (--embedded) hand them over as arrays "
        "(off: as bytes over the socket, like a job on another host)",
    )
    arena_bytes: int = _opt(
        EmulatorConfig.arena_bytes,
        "operand arena the embedded devices read operands from (--embedded; 0: none, "
        "operands go as bytes)",
        min=0,
    )
    min_flops: int = _opt(DEFAULT_MIN_FLOPS, "GEMMs with fewer FLOPs run locally", min=0)
    device_wait_s: float = _opt(
        300.0,
        "fail the job once its GEMMs have waited this long with no device ready "
        "(it is told while they wait); 0: wait for ever",
        min=0.0,
    )
    run_dir: str = _opt(
        "",
        "where the virtual timeline and its reports go (--embedded; empty: "
        "morphling-runs/SCRIPT-TIME, a new directory)",
    )
    events: str = _opt(
        EmulatorConfig.events,
        "what the run directory's event log keeps (--embedded): auto (every tile of each "
        "job's first --events-detail-steps steps, then each step's and device's totals: "
        "bounded for long runs), full (every tile of every step: trace, timeline, "
        "stragglers of any step), steps (only the totals) or off (none, and no report)",
        choices=EVENT_LEVELS,
    )
    events_detail_steps: int = _opt(
        EmulatorConfig.events_detail_steps,
        "with --events auto: the steps of each job whose every tile the log keeps",
        min=1,
    )
    force: bool = _opt(False, "replace an earlier run in --run-dir (refused without it)")
    report: bool = _opt(True, "write the reports (summary, trace, plots) into the run directory")
    table: bool = _opt(True, "print the per-step table on stderr at the end")
    json: str = _opt("", "also write the per-step report as JSON to this file")
    availability: str = _opt("", AVAILABILITY_HELP + " (--embedded)")
    churn: str = _opt("", CHURN_HELP + " (--embedded)")
    on_leave: str = _opt("wait", ON_LEAVE_HELP + " (--embedded)", choices=ON_LEAVE)


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = configuration.add_command(
        sub,
        "run",
        RunConfig,
        run,
        help="run an unmodified PyTorch script with its GEMMs on an emulated fleet",
        description="Run SCRIPT with its GEMMs (forward and backward) computed by the "
        "fleet: morphling run --embedded --devices rpi4:4 -- python train.py ARGS.",
    )
    parser.add_argument(
        "command", nargs=argparse.REMAINDER, metavar="-- [python] SCRIPT.py|-m MODULE [ARGS]"
    )


def script_target(command: list[str]) -> tuple[str, str, list[str]]:
    """("path" or "module", what, argv) for a ``[python] script.py ARGS`` command line."""
    if command and command[0] == "--":
        command = command[1:]
    if command and Path(command[0]).name.startswith("python") and not command[0].endswith(".py"):
        command = command[1:]
    if not command:
        raise ValueError("no script given: morphling run [options] -- python train.py ARGS")
    if command[0] == "-m":
        if len(command) < 2:
            raise ValueError("-m needs a module name")
        return "module", command[1], [command[1], *command[2:]]
    if command[0].startswith("-"):
        raise ValueError(f"python option {command[0]!r} is not supported; give a script or -m")
    if not Path(command[0]).is_file():
        raise ValueError(f"script {command[0]!r} not found")
    return "path", command[0], command


def check_module(name: str) -> None:
    """ValueError unless ``python -m name`` finds something to run (the current directory
    first on ``sys.path``, as there; parent packages are imported, as there)."""
    sys.path.insert(0, os.getcwd())
    try:
        spec = importlib.util.find_spec(name)
        package = spec is not None and spec.submodule_search_locations is not None
        if package and importlib.util.find_spec(f"{name}.__main__") is None:
            raise ValueError(f"{name!r} is a package without __main__: it cannot be run")
    except ImportError as exc:  # a parent package is missing
        raise ValueError(f"no module named {name!r} ({exc})") from exc
    finally:
        del sys.path[0]
    if spec is None:
        raise ValueError(f"no module named {name!r}")


def check_output(path: str, flag: str) -> Path:
    """``path`` made absolute (the script may change directory), ValueError unless a file
    can be written there: opened for writing before the script runs, not after."""
    target = Path(path).absolute()
    if not target.parent.is_dir():
        raise ValueError(f"{flag} {path}: no such directory {target.parent}")
    try:
        check_file_writable(target)
    except OSError as exc:
        raise ValueError(f"{flag} {path}: cannot write it: {exc.strerror}") from exc
    return target


def _run_script(kind: str, what: str, argv: list[str]) -> int:
    """Run like ``python`` would; the exit code (SystemExit honoured, a traceback is 1).

    The emulator ending the job (no device left in time, a refused request) is one line:
    where the script was, its next GEMM, says nothing the error does not."""
    from morphling.proxy.job.client import EmulatorError

    saved_argv, saved_path = sys.argv[:], sys.path[:]
    sys.argv = argv
    sys.path.insert(0, str(Path(what).resolve().parent) if kind == "path" else os.getcwd())
    try:
        if kind == "path":
            runpy.run_path(what, run_name="__main__")  # sets argv[0] = what, as python does
        else:
            runpy.run_module(what, run_name="__main__", alter_sys=True)
        return 0
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            return exc.code or 0
        print(exc.code, file=sys.stderr)
        return 1
    except EmulatorError as exc:
        log.debug("the job ended in the script", exc_info=True)
        print(f"morphling run: the emulator ended the job: {exc}", file=sys.stderr)
        return 1
    except Exception:
        traceback.print_exc()
        return 1
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path


def run(args: argparse.Namespace) -> int:
    with Signals() as signals:
        try:
            return _run(args, signals)
        except Interrupted as exc:  # before the script started: nothing ran to report
            print(f"morphling run: {exc}", file=sys.stderr)
            return exc.exit_code


def _run(args: argparse.Namespace, signals: Signals) -> int:
    signals.raising = True  # until the script ends, SIGTERM and SIGINT raise Interrupted
    try:
        cfg, sources = configuration.load(RunConfig, args, section="run")
        if cfg.embedded == bool(cfg.server):
            raise configuration.ConfigError("give exactly one of --server HOST:PORT, --embedded")
        if cfg.fresh_weights and not cfg.ckpt:
            raise configuration.ConfigError("--fresh-weights needs --ckpt")
        try:
            parse_mode(cfg.verify)
        except ValueError as exc:
            raise configuration.ConfigError(str(exc)) from None
        if cfg.ranks:
            _check_ranks(cfg)
        elif cfg.rank_devices:
            raise configuration.ConfigError("--rank-devices needs --ranks")
        _check_numerics(cfg)
        cfg = _rank_from_env(cfg)
        if cfg.rank >= 0 and not cfg.rank < cfg.world:
            raise configuration.ConfigError(
                f"--rank {cfg.rank} needs --world above it (got --world {cfg.world})"
            )
        if cfg.products == "rank" and cfg.rank < 0 and not cfg.ranks:
            raise configuration.ConfigError(
                "--products rank needs ranks (--ranks, or --rank): one script's products are "
                "spread over the fleet, which computes them"
            )
        if cfg.embedded:
            fleet = expand_fleet(cfg.devices, max_devices=cfg.max_devices)
            if cfg.ranks > len(fleet):
                raise configuration.ConfigError(
                    f"--ranks {cfg.ranks} needs {cfg.ranks} devices, one per rank: the fleet "
                    f"{cfg.devices!r} has {len(fleet)}"
                )
            if cfg.rank_devices:
                rank_devices(cfg.rank_devices, cfg.ranks, device_names(fleet))
            availability_of(_emulator_config(cfg, None), device_names(fleet))
        elif cfg.availability or cfg.churn or sources["on_leave"] == "flag":
            raise configuration.ConfigError(
                "--availability, --churn and --on-leave are the emulator's: give them to "
                f"the one at {cfg.server}"
            )
        elif cfg.numerics != "all" and not cfg.ranks:
            raise configuration.ConfigError(
                f"--numerics {cfg.numerics} of an offloaded run is the emulator's: start the "
                f"one at {cfg.server} with --sample-tiles K"
            )
        else:
            parse_server(cfg.server)
        profile = coordinator_profile(cfg.coordinator, cfg.coordinator_time or None,
                                      cooling=cfg.cooling or None)  # fmt: skip
        if cfg.rank >= 0 and profile is None:
            raise configuration.ConfigError(
                f"--rank {cfg.rank}: its own work is priced by its board's op model: give "
                "--coordinator PROFILE (its device's), or --coordinator-time model (a rank's "
                "wall time holds its waits for the others)"
            )
        target = script_target(args.command)
        if target[0] == "module":
            check_module(target[1])
        json_path = check_output(cfg.json, "--json") if cfg.json else None
    except ValueError as exc:
        print(f"morphling run: {exc}", file=sys.stderr)
        return 2
    log.info("effective configuration:\n%s", configuration.describe(cfg, sources))

    if cfg.ranks:
        return _run_ranks(cfg, target[1], args.command, json_path, signals)

    from morphling.proxy.job.session import emulate  # torch is imported only now

    session, run_dir, created = None, None, False
    try:
        if cfg.embedded:
            run_dir, created = claim(cfg.run_dir, target[1], force=cfg.force)
        emulator = _emulator_config(cfg, run_dir)
        if cfg.rank >= 0:  # a launcher asks a stuck rank where it is (``ranks``)
            faulthandler.register(ranks.STACKS_SIGNAL, all_threads=True)
        with emulate(
            cfg.server or None,
            devices=cfg.devices if cfg.embedded else None,
            config=emulator,
            token=cfg.token,
            block=cfg.block_size,
            min_flops=cfg.min_flops,
            name=target[1] if cfg.rank < 0 else f"{target[1]} rank {cfg.rank}",
            ckpt=cfg.ckpt or None,
            coordinator=cfg.coordinator,
            coordinator_time=cfg.coordinator_time or None,
            scale=cfg.coordinator_scale,
            link=cfg.link or None,
            cooling=cfg.cooling or None,
            share_memory=cfg.share_memory,
            max_devices=cfg.max_devices,
            device_wait_s=cfg.device_wait_s,
            fresh_weights=cfg.fresh_weights,
            device=cfg.device,
            rank=cfg.rank if cfg.rank >= 0 else None,
            world=cfg.world,
            products=cfg.products or "device",
            replayed_on=[name for name in cfg.replayed_on.split(",") if name],
        ) as session:
            try:
                code = _run_script(*target)
                signals.check()
            finally:
                signals.raising = False  # the session ends cleanly, whatever arrives now
    except Interrupted as exc:
        if session is None:  # while the fleet started
            raise
        print(f"morphling run: {exc}; reporting what ran until then", file=sys.stderr)
        code = exc.exit_code
    except ValueError as exc:  # bad input: the run directory, a checkpoint
        print(f"morphling run: {exc}", file=sys.stderr)
        return 2
    except (OSError, RuntimeError) as exc:
        print(f"morphling run: {exc}", file=sys.stderr)
        return 1
    finally:
        if session is None and created and run_dir is not None:
            shutil.rmtree(run_dir, ignore_errors=True)  # nothing ran: leave no empty run directory
    if cfg.table:
        print(session.table(), file=sys.stderr)
    if json_path is not None:
        try:
            json_path.write_text(json.dumps(session.summary(), indent=1) + "\n")
        except OSError as exc:
            print(f"morphling run: cannot write --json {cfg.json}: {exc.strerror}", file=sys.stderr)
            code = code or 1
    if run_dir and cfg.report and cfg.events != "off":
        _report(run_dir)
    code = code if signals.exit_code is None else signals.exit_code
    if cfg.rank >= 0:  # its report is written: see ``exiting``
        exit_without_finalizing(code)
    return code


def _emulator_config(cfg: RunConfig, run_dir: Path | None) -> EmulatorConfig:
    """The embedded emulator's settings (its run directory ``run_dir``, if any)."""
    emulator = dataclasses.replace(
        EmulatorConfig(),
        policy=cfg.policy,
        auto_block=cfg.auto_block,
        residency=cfg.residency,
        run_dir=str(run_dir or ""),
        bottleneck_dl_bw=cfg.bottleneck_bw,
        collective=cfg.collective,
        arena_bytes=cfg.arena_bytes,
        events=cfg.events,
        events_detail_steps=cfg.events_detail_steps,
        verify=cfg.verify,
        availability=cfg.availability,
        churn=cfg.churn,
        on_leave=cfg.on_leave,
        sample_tiles=0 if cfg.ranks else parse_numerics(cfg.numerics, 0) or 0,
    )
    if cfg.block_size:
        emulator = dataclasses.replace(emulator, block_size=cfg.block_size)
    return emulator


def _rank_from_env(cfg: RunConfig) -> RunConfig:
    """A job of an emulator elsewhere (``--server``) started by torchrun, or with its
    environment, without ``--rank``: the rank RANK of WORLD_SIZE it says."""
    if cfg.rank >= 0 or not cfg.server or not {"RANK", "WORLD_SIZE"} <= os.environ.keys():
        return cfg
    try:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    except ValueError:
        raise configuration.ConfigError(
            f"RANK={os.environ['RANK']!r}, WORLD_SIZE={os.environ['WORLD_SIZE']!r}: a "
            "distributed script's environment has integers there"
        ) from None
    log.info("rank %d of %d, as the environment (RANK, WORLD_SIZE) says", rank, world)
    return dataclasses.replace(cfg, rank=rank, world=world)


def _check_ranks(cfg: RunConfig) -> None:
    """What ``--ranks`` does not combine with (yet), refused by name."""
    if not cfg.embedded:
        raise configuration.ConfigError(
            "--ranks needs --embedded for now: ranks joining an emulator elsewhere "
            "(--server) are not supported yet"
        )
    refused = {
        "--device": (cfg.device, "it sets each rank's own"),
        "--rank": (cfg.rank >= 0, "it sets each rank's own"),
        "--ckpt": (cfg.ckpt, "each rank trains a replica of its own, which one shared copy "
                   "of the weights cannot be"),
        "--coordinator": (cfg.coordinator != HOST, "each rank's own work is priced by its "
                          "device's op model"),
        "--coordinator-time measured": (cfg.coordinator_time == "measured", "a rank's wall "
                                        "time holds its waits for the others"),
    }  # fmt: skip
    for flag, (given, why) in refused.items():
        if given:
            raise configuration.ConfigError(f"--ranks does not take {flag}: {why}")


def _check_numerics(cfg: RunConfig) -> None:
    """``--numerics``: parsed against ``--ranks``; replay times ranks' own products only.
    (Without ``--ranks``, ``sample:K`` is the embedded emulator's ``sample_tiles``.)"""
    try:
        computed = parse_numerics(cfg.numerics, cfg.ranks)
    except ValueError as exc:
        raise configuration.ConfigError(str(exc)) from None
    if cfg.on_leave == "drop" and (computed is None or not cfg.ranks):
        raise configuration.ConfigError(
            "--on-leave drop drops replayed ranks, whose numerics nobody computes: give "
            "--ranks N --numerics sample:K (a computed rank takes part in every collective "
            "for real, so it cannot be dropped)"
        )
    if computed is not None and cfg.ranks and cfg.products == "device":
        raise configuration.ConfigError(
            f"--numerics {cfg.numerics} needs --products rank: a replayed rank's products are "
            "timed on its device, and no device can compute them for it"
        )


def rank_devices(spec: str, ranks: int, names: list[str]) -> list[str]:
    """``--rank-devices``: one device of the fleet (``names``) per rank, each once."""
    chosen = [name.strip() for name in spec.split(",")]
    if not ranks or len(chosen) != ranks:
        raise configuration.ConfigError(
            f"--rank-devices names {len(chosen)} devices: it needs one per rank (--ranks {ranks})"
        )
    unknown = [name for name in chosen if name not in names]
    if unknown or len(set(chosen)) != len(chosen):
        why = f"{', '.join(unknown)} not in the fleet" if unknown else "a device named twice"
        raise configuration.ConfigError(
            f"--rank-devices {spec!r}: {why} (its devices: {', '.join(names[:8])}"
            f"{', ...' if len(names) > 8 else ''})"
        )
    return chosen


def _rank_flags(cfg: RunConfig) -> list[str]:
    """The ``morphling run`` flags each rank's job takes from this command's."""
    flags = ["--min-flops", str(cfg.min_flops), "--device-wait-s", str(cfg.device_wait_s),
             "--share-memory" if cfg.share_memory else "--no-share-memory",
             "--products", cfg.products or "rank"]  # fmt: skip
    if cfg.cooling:
        flags += ["--cooling", cfg.cooling]
    if cfg.block_size:
        flags += ["--block-size", str(cfg.block_size)]
    return flags


def _run_ranks(
    cfg: RunConfig, script: str, command: list[str], json_path: Path | None, signals: Signals
) -> int:
    """``--ranks N``: the embedded emulator and fleet here, the ranks as child processes
    (``ranks``); each rank's report and the slowest rank's per step, then the run's."""
    from morphling.proxy.job.embedded import EmbeddedFleet

    run_dir, created = None, False
    computed = parse_numerics(cfg.numerics, cfg.ranks) or cfg.ranks  # (checked: main)
    try:
        run_dir, created = claim(cfg.run_dir, script, force=cfg.force)
        names = device_names(expand_fleet(cfg.devices, max_devices=cfg.max_devices))
        chosen = (rank_devices(cfg.rank_devices, cfg.ranks, names) if cfg.rank_devices
                  else names[: cfg.ranks])  # fmt: skip
        embedded = EmbeddedFleet(
            cfg.devices, _emulator_config(cfg, run_dir), link=cfg.link or None,
            cooling=cfg.cooling or None, max_devices=cfg.max_devices,
            run_info={"ranks": cfg.ranks, "coordinator": "each rank's device",
                      "coordinator_time": "model", "link": cfg.link, "cooling": cfg.cooling,
                      "devices": cfg.devices, "numerics": cfg.numerics},
            replay=(computed, chosen) if computed < cfg.ranks else None,
        )  # fmt: skip
        try:
            embedded.start()
            signals.raising = False  # from now on the ranks report what they ran, and we wait
            children, interrupted = ranks.launch(
                embedded, chosen, _rank_flags(cfg), command, signals,
                configuration.env_names(RunConfig), computed=computed,
            )  # fmt: skip
            failure = ranks.failed(children)
            if interrupted is not None:  # run.json says the run did not end
                embedded.run_info["incomplete"] = str(interrupted)
            elif failure is not None:
                embedded.run_info["incomplete"] = failure.why()
        finally:
            embedded.stop()
    except Interrupted:  # while the fleet started: nothing ran
        if created and run_dir is not None:
            shutil.rmtree(run_dir, ignore_errors=True)
        raise
    except ValueError as exc:
        print(f"morphling run: {exc}", file=sys.stderr)
        return 2
    except (OSError, RuntimeError) as exc:
        print(f"morphling run: {exc}", file=sys.stderr)
        return 1
    run = ranks.summary(children)
    if embedded.emulator is not None and embedded.emulator.replay is not None:
        run["replay"] = embedded.emulator.replay.summary()
    if cfg.table:
        print(ranks.table(run), file=sys.stderr)
    code = 0
    if failure is not None and failure.stuck:  # its signal was ours
        code = 1
    elif failure is not None and failure.exit_code is not None:  # a signal's: as a shell has it
        code = failure.exit_code if failure.exit_code > 0 else 128 - failure.exit_code
    if json_path is not None:
        try:
            json_path.write_text(json.dumps(run, indent=1) + "\n")
        except OSError as exc:
            print(f"morphling run: cannot write --json {cfg.json}: {exc.strerror}", file=sys.stderr)
            code = code or 1
    if cfg.report and cfg.events != "off":
        _report(run_dir)
    return interrupted.exit_code if interrupted is not None else code


def _report(run_dir: Path) -> None:
    """Summarise the run directory on stderr and write its reports beside it."""
    from morphling.proxy.report.analysis import summarize
    from morphling.proxy.report.files import write_report_files
    from morphling.proxy.report.load import load_run
    from morphling.proxy.report.text import format_summary

    try:
        run = load_run(run_dir)
        summary = summarize(run)
        written = write_report_files(run, summary)
    except ValueError as exc:
        print(f"morphling run: no report: {exc}", file=sys.stderr)
        return
    print(format_summary(summary), file=sys.stderr)
    print(f"run directory {run_dir}: " + ", ".join(p.name for p in written), file=sys.stderr)
