"""The installed version, read without importing the rest of the package."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("morphling")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0+unknown"
