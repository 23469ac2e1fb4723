"""The built-in ``host`` profile: this host measured once and kept in the user's cache.

A cached profile stands for this host while the CPU, the BLAS library, the revisions of the
convolution kernels and of the native scale's timing, and the thread count it was measured
with are this host's now and it has every model a profile measures; otherwise the host is
measured again (the quick plan).
A lock keeps two processes from measuring at once, which would time each other.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import tomllib
from collections.abc import Iterator
from pathlib import Path

from morphling.kernels import blas_info
from morphling.kernels import conv as conv_kernels
from tqdm import tqdm

from ..models.conv import FORM as CONV_FORM
from ..models.links import LINKS
from ..models.profiles import HOST
from .host_facts import cpu_model
from .profile_file import QUICK, Plan, native_revision, op_timing, plan_size, profile

log = logging.getLogger(__name__)

HOST_THREADS_ENV = "MORPHLING_HOST_THREADS"
# What a cached ``host`` profile must have been measured with ([provenance] keys) to stand for
# this host now: another CPU, BLAS build, revision of the convolution kernels or thread count
# computes at another speed, and another way of timing PyTorch's convolutions beside the
# kernels (``conv_native.REVISION``; 0: not timed, torch absent) prices them otherwise.
HOST_KEY = ("cpu", "blas", "blas_version", "conv_kernels", "conv_native_revision", "threads")


def host_threads() -> int:
    """BLAS threads the ``host`` profile is measured with: ``MORPHLING_HOST_THREADS``, else
    every core (as ``morphling profile`` defaults). Compare it with a script on as many."""
    text = os.environ.get(HOST_THREADS_ENV)
    if text is None:
        return os.cpu_count() or 1
    if not text.strip().isdigit() or int(text) < 1:
        raise ValueError(f"{HOST_THREADS_ENV}={text!r}: expected a positive integer")
    return int(text)


def cache_dir() -> Path:
    """Morphling's directory in the user cache: ``$XDG_CACHE_HOME/morphling``, else
    ``~/.cache/morphling``."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "morphling"


def host_key(threads: int) -> dict[str, str | int]:
    """``HOST_KEY`` for this host now, measuring on ``threads`` threads."""
    info = blas_info()
    return {
        "cpu": cpu_model(),
        "blas": info.name,
        "blas_version": info.version,
        "conv_kernels": conv_kernels.REVISION,
        "conv_native_revision": native_revision(),
        "threads": threads,
    }


def why_stale(path: Path, key: dict[str, str | int]) -> str | None:
    """Why the cached profile at ``path`` cannot be used for ``key``; None when it can."""
    try:
        with path.open("rb") as f:
            doc = tomllib.load(f)
    except FileNotFoundError:
        return "no cached profile"
    except (OSError, tomllib.TOMLDecodeError) as exc:
        return f"the cached profile is unreadable ({exc})"
    provenance = doc.get("provenance", {})
    changed = [name for name in HOST_KEY if provenance.get(name) != key[name]]
    if changed:
        return f"the cached profile was measured with another {', '.join(changed)}"
    if "ops" not in doc and op_timing is not None:  # measured before the op model was
        return "the cached profile has no op model"
    conv = doc.get("conv", {})
    if conv.get("kind") == "fitted" and conv.get("form", 1) != CONV_FORM:
        return "the cached profile's convolution model counts another form of work terms"
    return None


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive lock on ``path``: two processes measuring at once would time each other."""
    with path.open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def cached_host_profile(
    *, threads: int | None = None, directory: Path | None = None, plan: Plan = QUICK
) -> Path:
    """The file of the built-in ``host`` profile: this host on ``threads`` BLAS threads
    (default ``host_threads()``), cached in ``directory`` (default ``cache_dir()``).

    A cached file is used while its ``HOST_KEY`` matches this host; otherwise the host is
    measured first (``plan``, the quick one by default: about 30 s on one x86 core) and the
    file replaced atomically. Its links are the ``ideal`` preset: the host is its own device.
    """
    threads = host_threads() if threads is None else threads
    directory = cache_dir() if directory is None else directory
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{HOST}-{threads}t.toml"
    key = host_key(threads)
    with _locked(directory / f"{HOST}.lock"):
        why = why_stale(path, key)
        if why is None:
            log.debug("host profile: using the cached %s", path)
            return path
        log.warning(
            "measuring this host for the %r profile (%s; %d BLAS thread(s), once): cached in %s",
            HOST,
            why,
            threads,
            path,
        )
        _measure(path, threads, plan)
    return path


def _measure(path: Path, threads: int, plan: Plan) -> None:
    """Measure this host into ``path``, replacing it atomically (a partial file beside it,
    renamed over it once whole)."""
    partial = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        bar = tqdm(
            total=plan_size(plan), desc=f"{HOST} profile", unit="shape", disable=None, leave=False
        )
        with bar:
            profile(
                partial,
                threads=threads,
                plan=plan,
                name=HOST,
                force=True,
                link=LINKS["ideal"],
                progress=bar.update,
            )
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)
