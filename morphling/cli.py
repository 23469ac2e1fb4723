"""The ``morphling`` command: one entry point, one subcommand per role.

Each subcommand registers its parser here and runs a function that returns
an exit code; ``_SUBCOMMANDS`` lists them. Only the chosen one's module is
imported, so ``morphling device`` on a board never loads torch.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar, overload

from .version import __version__

LOG_LEVELS = ("debug", "info", "warning", "error")


def _version(args: argparse.Namespace) -> int:
    print(f"morphling {__version__}")
    if args.verbose:
        import resource

        from .kernels import blas_info, cublasxt_status, cuda_status, green_context_status

        info = blas_info()
        print(f"blas: {info.name} ({info.version}) from {info.path}; threading {info.threading}")
        if info.why_not_mkl:
            print(f"blas: not MKL because {info.why_not_mkl}")
        print(f"cuda driver: {cuda_status()}")
        print(f"cublasxt: {cublasxt_status()}")
        print(f"green contexts: {green_context_status()}")
        soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
        limit = "unlimited" if soft == resource.RLIM_INFINITY else f"{soft} bytes"
        print(f"memlock limit: {limit}")
    return 0


def _add_version(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("version", help="print the version (and, with -v, the kernel libraries)")
    p.add_argument(
        "-v", "--verbose", action="store_true", help="also describe BLAS, cuBLASXt and memlock"
    )
    p.set_defaults(func=_version)


# Each subcommand: the module that registers its parser, and the function that does. Only
# the chosen one is imported (the others pull in torch and scipy, seconds on a board that
# runs only ``morphling device``); ``morphling --help``, or no subcommand, imports them all.
_SUBCOMMANDS = {
    "emulator": ("emulator", "add_parser"),
    "device": ("device", "add_device_parser"),
    "fleet": ("device", "add_fleet_parser"),
    "run": ("run", "add_parser"),
    "save": ("save", "add_parser"),
    "profile": ("profile", "add_parser"),
    "report": ("report", "add_parser"),
    "sweep": ("sweep", "add_parser"),
    "nginx-config": ("nginx_config", "add_parser"),
    "status": ("status", "add_parser"),
}


def _chosen(argv: Sequence[str]) -> str | None:
    """The subcommand ``argv`` names, past the top-level options (None: none, or unknown)."""
    args = iter(argv)
    for arg in args:
        if arg == "--log-level":
            next(args, None)
        elif not arg.startswith("-"):
            return arg if arg in _SUBCOMMANDS or arg == "version" else None
    return None


def _subcommands(argv: Sequence[str]) -> list[Callable[[argparse._SubParsersAction], None]]:
    chosen = _chosen(argv)
    if chosen == "version":
        return [_add_version]
    names = [chosen] if chosen is not None else list(_SUBCOMMANDS)
    adders: list[Callable[[argparse._SubParsersAction], None]] = [] if chosen else [_add_version]
    for name in names:
        module, function = _SUBCOMMANDS[name]
        commands = importlib.import_module(f".commands.{module}", __package__)
        adders.append(getattr(commands, function))
    return adders


N = TypeVar("N")


class _SubcommandParser(argparse.ArgumentParser):
    """A subcommand's parser: an argument it does not know is its own error, shown with
    its own usage (argparse leaves unknown arguments to the top-level parser, whose usage
    lists only the subcommands)."""

    @overload  # argparse's own three forms
    def parse_known_args(
        self, args: Iterable[str] | None = None, namespace: None = None
    ) -> tuple[argparse.Namespace, list[str]]: ...
    @overload
    def parse_known_args(self, args: Iterable[str] | None, namespace: N) -> tuple[N, list[str]]: ...
    @overload
    def parse_known_args(self, *, namespace: N) -> tuple[N, list[str]]: ...

    def parse_known_args(
        self, args: Iterable[str] | None = None, namespace: N | None = None
    ) -> tuple[N | argparse.Namespace, list[str]]:
        parsed, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return parsed, extras


def command_parser(prog: str, description: str) -> tuple[argparse.ArgumentParser, Any]:
    """A parser with ``--log-level`` and an empty set of subcommands (``add_parser(sub)``)."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument(
        "--log-level", choices=LOG_LEVELS, default="info", help="logging level (default: info)"
    )
    sub = parser.add_subparsers(
        dest="command", metavar="COMMAND", required=True, parser_class=_SubcommandParser
    )
    return parser, sub


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The ``morphling`` parser: with only the subcommand ``argv`` names, or every one
    when it names none (or is not given)."""
    parser, sub = command_parser(
        "morphling", "Emulate distributed ML training on fleets of edge devices."
    )
    parser.add_argument("--version", action="version", version=f"morphling {__version__}")
    for add in _subcommands(argv or ()):
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    return run_command(build_parser(argv), argv)


def emulator_main(argv: Sequence[str] | None = None) -> int:
    """The ``morphling-emulator`` console script: ``morphling emulator``, whose flags it
    takes, with ``morphling``'s own ``--log-level`` among them."""
    level = argparse.ArgumentParser(add_help=False)
    level.add_argument("--log-level")
    known, rest = level.parse_known_args(sys.argv[1:] if argv is None else argv)
    lead = [] if known.log_level is None else ["--log-level", known.log_level]
    return main([*lead, "emulator", *rest])


def cmd_main(argv: Sequence[str] | None = None) -> int:
    """The ``morphling-cmd`` console script (upstream's ``morphling_cmd``): ``save`` only."""
    from .commands.save import add_parser

    parser, sub = command_parser("morphling-cmd", "Morphling model tools.")
    add_parser(sub)
    return run_command(parser, argv)


def run_command(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> int:
    """Parse, set up logging at the chosen level, run the subcommand; its exit code."""
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        return args.func(args)
    except KeyboardInterrupt:
        return 130
