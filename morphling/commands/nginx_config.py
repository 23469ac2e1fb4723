"""``morphling nginx-config``: write the stream-proxy configuration for physical devices."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from morphling import config as configuration
from morphling.nginx.conf import NginxConfig, render


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = configuration.add_command(
        sub,
        "nginx-config",
        NginxConfig,
        run,
        help="write an nginx stream-proxy configuration for physical devices",
        description="Render an nginx.conf that forwards devices to one or more emulators.",
    )
    parser.add_argument(
        "--output", "-o", default="-", help="file to write (default '-': standard output)"
    )
    parser.add_argument("--force", action="store_true", help="replace an existing --output")


def run(args: argparse.Namespace) -> int:
    try:
        cfg, _ = configuration.load(NginxConfig, args, section="nginx-config")
        text = render(cfg)
    except ValueError as exc:  # ConfigError is one
        print(f"morphling nginx-config: {exc}", file=sys.stderr)
        return 2
    if args.output == "-":
        sys.stdout.write(text)
        return 0
    out = Path(args.output)
    if out.exists() and not args.force:
        print(f"morphling nginx-config: {out} exists (use --force to replace it)", file=sys.stderr)
        return 2
    try:
        out.write_text(text)
    except OSError as exc:  # no such directory, a directory in the way, no permission
        print(f"morphling nginx-config: cannot write {out}: {exc.strerror}", file=sys.stderr)
        return 2
    print(f"wrote {out}; check it with: nginx -t -c {out.resolve()}", file=sys.stderr)
    return 0
