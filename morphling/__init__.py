"""Morphling: emulate distributed ML training on fleets of edge devices."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("morphling")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0+unknown"
