"""Run a real nginx in the foreground with a generated configuration, for tests and trials.

The process gets its own prefix directory (configuration, pid file, logs), so
several can run side by side without root's ``/etc/nginx`` or ``/run``.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from .conf import NginxConfig, render

# Where distributions put a dynamic stream module (Debian's libnginx-mod-stream, RPMs).
STREAM_MODULES = (
    Path("/usr/lib/nginx/modules/ngx_stream_module.so"),
    Path("/usr/share/nginx/modules/ngx_stream_module.so"),
    Path("/usr/lib64/nginx/modules/ngx_stream_module.so"),
)


class NginxUnavailable(RuntimeError):
    """No nginx with a stream module here; the message says what is missing."""


@dataclass(frozen=True)
class NginxInstall:
    binary: str
    version: str
    stream_module: str  # the file to load_module, "" when stream is built in


def find_nginx() -> NginxInstall:
    """The local nginx and how to get its stream module, or NginxUnavailable saying why."""
    binary = shutil.which("nginx") or next(
        (p for p in ("/usr/sbin/nginx", "/usr/local/sbin/nginx") if os.access(p, os.X_OK)), None
    )
    if binary is None:
        raise NginxUnavailable(
            "nginx is not installed (Debian: apt-get install nginx libnginx-mod-stream)"
        )
    built = subprocess.run([binary, "-V"], capture_output=True, text=True, check=False).stderr
    version = built.splitlines()[0].rpartition("/")[2] if built else "?"
    if "--with-stream=dynamic" in built:
        module = next((p for p in STREAM_MODULES if p.is_file()), None)
        if module is None:
            raise NginxUnavailable(
                f"nginx {version} loads its stream module dynamically and it is missing "
                "(Debian: apt-get install libnginx-mod-stream)"
            )
        return NginxInstall(binary, version, str(module))
    if "--with-stream" in built:
        return NginxInstall(binary, version, "")
    raise NginxUnavailable(f"nginx {version} at {binary} was built without the stream module")


class Nginx:
    """One foreground nginx serving ``cfg`` from ``workdir``; a context manager."""

    def __init__(self, cfg: NginxConfig, workdir: Path, install: NginxInstall | None = None):
        self.install = install or find_nginx()
        self.workdir = Path(workdir)
        self.access_log = self.workdir / "access.log"
        self.error_log = self.workdir / "error.log"
        self.cfg = dataclasses.replace(
            cfg,
            stream_module=self.install.stream_module,
            access_log=str(self.access_log),
            part="full",
        )
        self.conf = self.workdir / "nginx.conf"
        self._pid = self.workdir / "nginx.pid"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 10.0) -> Nginx:
        """Start nginx and return once it listens (it writes its pid file after binding)."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._pid.unlink(missing_ok=True)  # a killed nginx's, which would read as started
        self.conf.write_text(render(self.cfg))
        with open(self.error_log, "ab") as errors:
            self.process = subprocess.Popen(
                [
                    self.install.binary,
                    "-e",
                    "stderr",
                    "-p",
                    str(self.workdir),
                    "-c",
                    str(self.conf),
                    "-g",
                    f"daemon off; pid {self._pid}; error_log stderr info;",
                ],
                stdout=errors,
                stderr=errors,
            )
        deadline = time.monotonic() + timeout_s
        while not self._pid.exists():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"nginx did not start: {self.errors()}")
            time.sleep(0.02)
        return self

    def errors(self) -> str:
        return self.error_log.read_text(errors="replace") if self.error_log.exists() else ""

    def stop(self, *, fast: bool = False) -> None:
        """Graceful stop (SIGQUIT lets sessions finish), then a kill if it lingers;
        ``fast``: SIGTERM, which cuts every session at once (``systemctl restart``)."""
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        process.send_signal(signal.SIGTERM if fast else signal.SIGQUIT)
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    def __enter__(self) -> Nginx:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
