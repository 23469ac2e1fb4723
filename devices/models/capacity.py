"""How many virtual devices this host can hold.

A fleet larger than the host's memory is not slow, it is fatal: the kernel's OOM
killer ends the process, or another one it picks. So a fleet SPEC is checked when it
is expanded, before anything is built: its devices at ``DEVICE_BYTES`` each must fit
in the memory available now, unless ``--max-devices`` says how many to allow instead.
"""

from __future__ import annotations

import psutil

from morphling.text import format_bytes

# Host memory one virtual device costs: its agent and connection in the fleet, its
# peer in the emulator (one process under `morphling run --embedded`; usually one host
# for `morphling fleet` too), and the kernel's memory for the two ends of its socket.
# scripts/measure_device_memory.py measures these (embedded_per_device_kib plus
# kernel_slab_per_device_kib); this is their sum rounded up.
DEVICE_BYTES = 32 << 10

MAX_DEVICES_HELP = (
    f"refuse a fleet SPEC of more devices than this; 0: as many as the host's available "
    f"memory holds at {DEVICE_BYTES >> 10} KiB each"
)


def check_fleet_size(count: int, max_devices: int = 0) -> None:
    """ValueError, naming the numbers, when a fleet of ``count`` devices is more than
    ``max_devices`` or, where that is 0, more than the available memory holds."""
    if max_devices:
        if count > max_devices:
            raise ValueError(f"a fleet of {count} devices is more than --max-devices {max_devices}")
        return
    # MemAvailable of /proc/meminfo on Linux; psutil estimates it where that is absent.
    available = psutil.virtual_memory().available
    needed = count * DEVICE_BYTES
    if needed > available:
        raise ValueError(
            f"a fleet of {count} devices needs about {format_bytes(needed)} of memory "
            f"({DEVICE_BYTES >> 10} KiB per device), but {format_bytes(available)} is "
            f"available; --max-devices N allows N devices whatever the memory"
        )
