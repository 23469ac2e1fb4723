"""Render the stream-proxy configuration that physical devices reach the emulator through.

Every directive follows from a device's needs:

- ``proxy_timeout`` is the emulator's heartbeat timeout plus one heartbeat, so
  nginx never cuts a live device: both ends send a heartbeat after
  ``heartbeat_s`` without traffic, and the emulator, not the proxy, decides
  when a device is dead.
- ``so_keepalive`` (device side) and ``proxy_socket_keepalive`` (emulator
  side) let the kernel notice peers that vanished without a FIN (a board
  unplugged, a Wi-Fi drop).
- ``hash $remote_addr consistent`` with several emulators keeps a board on
  the same emulator across reconnects, and moves few boards when one is added.
- ``worker_connections`` counts two sockets per device (device and upstream).
- TLS, when asked for, terminates here; the emulator then sees plain frames.
"""

from __future__ import annotations

import ipaddress
import math
import re
import socket
from dataclasses import dataclass

from morphling.proxy.emulator.settings import check_heartbeats

from morphling.config import option as _opt
from morphling.runtime import format_address, parse_server

UPSTREAM = "morphling_emulators"
_SAFE_PATH = re.compile(r"[^\s;{}'\"#$\\]+")  # nginx takes these unquoted, without surprises
LOG_FORMAT = (
    "$remote_addr [$time_local] $protocol $status $bytes_sent $bytes_received "
    '$session_time "$upstream_addr"'
)


@dataclass(frozen=True)
class NginxConfig:
    """What ``morphling nginx-config`` asks for; ``render`` turns it into nginx.conf."""

    listen: str = _opt("0.0.0.0:39000", "address devices connect to, HOST:PORT")
    emulators: str = _opt(
        "127.0.0.1:39001",
        "emulator addresses, HOST:PORT separated by commas (several: each device "
        "sticks to one by a consistent hash of its address)",
    )
    tls_cert: str = _opt("", "certificate chain (PEM) to terminate TLS with; needs --tls-key")
    tls_key: str = _opt("", "private key (PEM) of --tls-cert")
    heartbeat_s: float = _opt(5.0, "the emulator's --heartbeat-s", min=0.01)
    heartbeat_timeout_s: float = _opt(15.0, "the emulator's --heartbeat-timeout-s", min=0.01)
    connect_timeout_s: float = _opt(
        5.0, "give up connecting to an emulator after this long", min=0.001
    )
    devices: int = _opt(4096, "devices to size worker_connections for", min=1)
    stream_module: str = _opt(
        "",
        "load_module this file first, where the stream module is dynamic "
        "(Debian: /usr/lib/nginx/modules/ngx_stream_module.so)",
    )
    access_log: str = _opt(
        "/var/log/nginx/morphling-stream.log", "one line per device session ('off': none)"
    )
    part: str = _opt(
        "full",
        "a whole nginx.conf, or only its stream {} block to include",
        choices=("full", "stream"),
    )

    def __post_init__(self) -> None:
        check_heartbeats(self.heartbeat_s, self.heartbeat_timeout_s)


def address(text: str, what: str) -> str:
    """``HOST:PORT`` as nginx writes it (IPv6 in brackets); ValueError names ``what``."""
    return format_address(*parse_server(text, what))


def _addresses(host: str) -> set[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    """The IP addresses ``host`` names (itself, for an address); none if it does not resolve."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return set()
    return {ipaddress.ip_address(info[4][0]) for info in infos}


def _is_local(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    """Whether connecting to ``ip`` reaches this machine: loopback, the wildcard, or an
    address of one of its interfaces (the only addresses a socket can bind)."""
    if ip.is_loopback or ip.is_unspecified:
        return True
    family = socket.AF_INET6 if ip.version == 6 else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((str(ip), 0))
        except OSError:
            return False
    return True


def _refuse_itself(listen: str, emulator: str) -> None:
    """ValueError if ``emulator`` is nginx's own ``listen`` address: nginx would proxy each
    connection to itself until it ran out of sockets. A wildcard listen address is every
    address of this machine in its family: 0.0.0.0 the IPv4 ones, :: the IPv6 ones (nginx
    listens on [::] with ipv6only=on unless told otherwise)."""
    listen_host, listen_port = parse_server(listen, "--listen")
    host, port = parse_server(emulator, "--emulators")
    if port != listen_port:
        return
    listening = _addresses(listen_host)
    targets = _addresses(host)
    wildcards = {ip.version for ip in listening if ip.is_unspecified}
    if wildcards:
        itself = any(ip.version in wildcards and _is_local(ip) for ip in targets)
    else:
        itself = bool(listening & targets)
    if itself:
        raise ValueError(
            f"--emulators {emulator!r} (port {port}) is nginx's own --listen {listen!r}: "
            "nginx would proxy to itself; give the emulator's address (its --listen-port "
            "differs from nginx's)"
        )


def _path(text: str, what: str) -> str:
    if not _SAFE_PATH.fullmatch(text):
        raise ValueError(
            f"{what} {text!r}: spaces, quotes, ';', '{{', '}}', '#', '$' and '\\' "
            "are not allowed in a path here"
        )
    return text


def _duration(seconds: float) -> str:
    """nginx time: whole seconds where exact, else milliseconds (rounded up)."""
    ms = max(1, math.ceil(seconds * 1000))
    return f"{ms // 1000}s" if ms % 1000 == 0 else f"{ms}ms"


def worker_connections(devices: int) -> int:
    """Two sockets per device, plus room for the listeners and a few spare."""
    return 2 * devices + 64


def render(cfg: NginxConfig) -> str:
    """The configuration text; ValueError names the first setting that is wrong."""
    listen = address(cfg.listen, "--listen")
    names = [e.strip() for e in cfg.emulators.split(",") if e.strip()]
    if not names:
        raise ValueError("--emulators: give at least one HOST:PORT")
    upstreams = [address(e, "--emulators") for e in names]
    for name in names:
        _refuse_itself(cfg.listen, name)
    if bool(cfg.tls_cert) != bool(cfg.tls_key):
        raise ValueError("--tls-cert and --tls-key go together: give both or neither")
    tls = bool(cfg.tls_cert)
    log = "off" if cfg.access_log == "off" else f"{_path(cfg.access_log, '--access-log')} morphling"

    stream = ["stream {", f"    log_format morphling '{LOG_FORMAT}';", f"    access_log {log};", ""]
    stream += [f"    upstream {UPSTREAM} {{"]
    if len(upstreams) > 1:
        stream += ["        hash $remote_addr consistent;"]
    stream += [f"        server {u};" for u in upstreams]
    keepalive = "so_keepalive=60s:10s:3"  # probe after 60 s idle, every 10 s, give up after 3
    stream += [
        "    }",
        "",
        "    server {",
        f"        listen {listen}{' ssl' if tls else ''} {keepalive};",
        f"        proxy_pass {UPSTREAM};",
        f"        proxy_connect_timeout {_duration(cfg.connect_timeout_s)};",
        f"        proxy_timeout {_duration(cfg.heartbeat_timeout_s + cfg.heartbeat_s)};",
        "        proxy_socket_keepalive on;",
        "        proxy_buffer_size 64k;  # tiles are MiBs: fewer reads (128 KiB per device)",
    ]
    if tls:
        stream += [
            f"        ssl_certificate {_path(cfg.tls_cert, '--tls-cert')};",
            f"        ssl_certificate_key {_path(cfg.tls_key, '--tls-key')};",
            "        ssl_protocols TLSv1.2 TLSv1.3;",
            "        ssl_session_cache shared:morphling_tls:10m;",
            "        ssl_handshake_timeout 10s;",
        ]
    stream += ["    }", "}"]
    if cfg.part == "stream":
        return "\n".join(stream) + "\n"

    connections = worker_connections(cfg.devices)
    head = ["# Generated by `morphling nginx-config`: a stream proxy for Morphling devices."]
    if cfg.stream_module:
        head += [f"load_module {_path(cfg.stream_module, '--stream-module')};"]
    head += [
        "worker_processes auto;",
        f"worker_rlimit_nofile {2 * connections};",
        "",
        "events {",
        f"    worker_connections {connections};",
        "}",
        "",
    ]
    return "\n".join(head + stream) + "\n"
