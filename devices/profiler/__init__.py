"""Measure this host as a device: ``morphling profile`` and the built-in ``host`` profile.

- ``shapes``: the GEMM shapes measured, a grid to fit and a held-out set to score the fit;
- ``conv_shapes``: likewise the convolution calls;
- ``timing``: timing GEMMs with the real kernels, interleaved rounds on fresh buffers;
- ``conv_timing``: timing convolutions (``kernels.conv``) the same way;
- ``sensors``, ``sustained_load``: a sustained-load thermal trace read from sysfs, and the RC
  thermal model fitted to it;
- ``profile_file``, ``toml_writer``, ``host_facts``: measuring it all and writing the
  profile TOML that ``devices.models.profiles.load_profile`` reads;
- ``host_cache``: the ``host`` profile, this host measured once and cached until its CPU,
  BLAS or thread count changes.
"""

from .host_cache import (
    HOST_KEY,
    HOST_THREADS_ENV,
    cache_dir,
    cached_host_profile,
    host_key,
    host_threads,
)
from .profile_file import FULL, LARGE_GEMM, QUICK, Plan, ProfileResult, plan_size, profile

__all__ = [
    "FULL",
    "HOST_KEY",
    "HOST_THREADS_ENV",
    "LARGE_GEMM",
    "QUICK",
    "Plan",
    "ProfileResult",
    "cache_dir",
    "cached_host_profile",
    "host_key",
    "host_threads",
    "plan_size",
    "profile",
]
