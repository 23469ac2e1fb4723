"""Morphling: emulate distributed ML training on fleets of edge devices."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("morphling")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0+unknown"


def __getattr__(name: str):
    """``morphling.emulate`` without importing torch for every ``morphling`` command."""
    if name == "emulate":
        from .proxy.job.session import emulate

        return emulate
    raise AttributeError(f"module 'morphling' has no attribute {name!r}")
