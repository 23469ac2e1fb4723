"""Device side: the agent for physical boards, the virtual fleet, profiles and models.

The device models (``models``) are the bottom layer: the virtual clock imports them alone, so
they load neither the kernels nor the profiler. The built-in ``host`` profile, this host
measured with the real kernels, is wired in here instead, where importing any part of the
device side (the models too) passes, so every fleet spec, ``--profile`` and
``morphling.emulate`` knows it; the profiler is imported only when ``host`` is first loaded.
"""

from pathlib import Path

from .models.profiles import HOST, register_measured


def _host_profile_file() -> Path:
    """This host's cached profile, measured first where there is none for it yet."""
    from .profiler.host_cache import cached_host_profile  # loads the kernels: only when asked

    return cached_host_profile()


register_measured(HOST, _host_profile_file)
