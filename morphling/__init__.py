"""Morphling: emulate distributed ML training on fleets of edge devices."""

from .version import __version__ as __version__


def __getattr__(name: str):
    """``morphling.emulate`` without importing torch for every ``morphling`` command."""
    if name == "emulate":
        from .proxy.job.session import emulate

        return emulate
    raise AttributeError(f"module 'morphling' has no attribute {name!r}")
