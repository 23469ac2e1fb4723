"""The CUDA driver, opened at run time in cffi ABI mode, and host-memory pinning through it.

Nothing here is compiled (the declarations, the driver's and those of the plain cuBLAS
calls ``green_context`` makes, are ``_cffi_src/cuda_driver.py``), so a host
without CUDA imports it and ``cuda_status()`` says why the driver cannot be used,
the way ``cublasxt_status()`` does for cuBLASXt. ``CudaHostPinner`` page-locks buffer-pool
memory for GPU transfers with ``cuMemHostRegister`` (portable, so every context of the
process treats it as pinned, cuBLASXt's included).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator
from typing import Any

from cffi import FFI

from ._cffi_src import cuda_driver as decls
from .ctext import c_text

log = logging.getLogger(__name__)

ffi = FFI()
ffi.cdef(decls.DRIVER_TYPES + decls.DRIVER_FUNCTIONS + decls.CUBLAS_TYPES + decls.CUBLAS_FUNCTIONS)

DRIVER_SONAME = "libcuda.so.1"


class CudaError(RuntimeError):
    """A driver call that returned an error, with the driver's name for it."""

    def __init__(self, call: str, code: int) -> None:
        super().__init__(f"{call} failed: {error_name(code)}")
        self.call = call
        self.code = code


class CudaUnavailable(RuntimeError):
    """No usable CUDA driver or GPU here; the message says why."""


_lock = threading.Lock()
_driver: Any = None
_status: str | None = None  # "available" or "unavailable: <reason>"


def dlopen(path: str) -> Any:
    """Open a library against these declarations; ``OSError`` with dlerror()'s reason."""
    try:
        return ffi.dlopen(path)
    except OSError as exc:  # cffi appends a find_library() note; dlerror()'s part says it all
        raise OSError(str(exc).partition(".  Additionally")[0]) from None


def _open_driver() -> tuple[Any, str]:
    try:
        drv = dlopen(DRIVER_SONAME)
    except OSError as exc:
        return None, f"unavailable: {DRIVER_SONAME} not found ({exc})"
    rc = drv.cuInit(0)
    if rc != 0:
        return None, f"unavailable: cuInit failed: {_name_with(drv, rc)} (no usable GPU)"
    count = ffi.new("int *")
    rc = drv.cuDeviceGetCount(count)
    if rc != 0 or count[0] < 1:
        return None, "unavailable: no CUDA devices"
    return drv, "available"


def cuda_status() -> str:
    """``"available"`` or ``"unavailable: <reason>"``; opens and initialises the driver once."""
    global _driver, _status
    with _lock:
        if _status is None:
            _driver, _status = _open_driver()
    return _status


def driver() -> Any:
    """The opened driver library; raises ``CudaUnavailable`` with the reason where there is none."""
    status = cuda_status()
    if status != "available":
        raise CudaUnavailable(f"CUDA {status}")
    return _driver


def _name_with(drv: Any, code: int) -> str:
    name = ffi.new("const char **")
    if drv.cuGetErrorName(code, name) != 0 or name[0] == ffi.NULL:
        return f"CUresult {code}"
    return f"{c_text(ffi.string(name[0]))} ({code})"


def error_name(code: int) -> str:
    """``CUDA_ERROR_INVALID_VALUE (1)``, or the bare number without a driver."""
    return _name_with(_driver, code) if _driver is not None else f"CUresult {code}"


def check(code: int, call: str) -> None:
    """Raise ``CudaError`` for a nonzero ``CUresult``."""
    if code != 0:
        raise CudaError(call, code)


def driver_version() -> int:
    """The driver's CUDA version as ``1000 * major + 10 * minor`` (12050 is 12.5)."""
    version = ffi.new("int *")
    check(driver().cuDriverGetVersion(version), "cuDriverGetVersion")
    return version[0]


def format_version(version: int) -> str:
    return f"{version // 1000}.{version % 1000 // 10}"


def device_handle(device: int) -> Any:
    """The ``CUdevice`` of GPU number ``device``; ``ValueError`` naming the valid range."""
    drv = driver()
    count = ffi.new("int *")
    check(drv.cuDeviceGetCount(count), "cuDeviceGetCount")
    if not 0 <= device < count[0]:
        raise ValueError(f"device={device}: this host has GPUs 0..{count[0] - 1}")
    handle = ffi.new("CUdevice *")
    check(drv.cuDeviceGet(handle, device), "cuDeviceGet")
    return handle[0]


def device_attribute(device: int, attribute: str) -> int:
    """``attribute`` by its ``cuda.h`` name, e.g. ``CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT``."""
    drv = driver()
    value = ffi.new("int *")
    code = getattr(drv, attribute)
    check(drv.cuDeviceGetAttribute(value, code, device_handle(device)), "cuDeviceGetAttribute")
    return value[0]


def device_name(device: int) -> str:
    name = ffi.new("char[256]")
    check(driver().cuDeviceGetName(name, 256, device_handle(device)), "cuDeviceGetName")
    return c_text(ffi.string(name))


class PrimaryContext:
    """A retained reference to a device's primary context (the one the runtime API,
    cuBLAS and cuBLASXt use), made current around driver calls that need a context."""

    def __init__(self, device: int = 0) -> None:
        self.device = device
        self.handle = device_handle(device)
        ctx = ffi.new("CUcontext *")
        check(driver().cuDevicePrimaryCtxRetain(ctx, self.handle), "cuDevicePrimaryCtxRetain")
        self.context = ctx[0]

    @contextlib.contextmanager
    def current(self, context: Any = None) -> Iterator[None]:
        """Make ``context`` (default: the primary context) current on this thread, then restore."""
        drv = driver()
        check(drv.cuCtxPushCurrent_v2(context or self.context), "cuCtxPushCurrent")
        try:
            yield
        finally:
            check(drv.cuCtxPopCurrent_v2(ffi.new("CUcontext *")), "cuCtxPopCurrent")

    def release(self) -> None:
        """Drop the reference; the caller has unbound every context derived from it."""
        if self.context is not None:
            self.context = None
            check(driver().cuDevicePrimaryCtxRelease_v2(self.handle), "cuDevicePrimaryCtxRelease")


class CudaHostPinner:
    """Page-locks host ranges with ``cuMemHostRegister(PORTABLE)`` for GPU transfers.

    Registration needs a current context; the primary context of ``device`` is pushed
    around each call, so any thread may register and unregister.
    """

    def __init__(self, device: int = 0) -> None:
        self._primary = PrimaryContext(device)
        self.description = f"cuMemHostRegister (portable) on CUDA device {device}"

    def register(self, address: int, nbytes: int) -> str | None:
        """``None`` once ``nbytes`` at ``address`` are pinned, else why they are not."""
        drv = driver()
        with self._primary.current():
            rc = drv.cuMemHostRegister_v2(
                ffi.cast("void *", address), nbytes, drv.CU_MEMHOSTREGISTER_PORTABLE
            )
        return None if rc == 0 else f"cuMemHostRegister: {error_name(rc)}"

    def unregister(self, address: int) -> None:
        with self._primary.current():
            rc = driver().cuMemHostUnregister(ffi.cast("void *", address))
        if rc != 0:  # the memory is freed next either way; say so rather than leak silently
            log.warning("cuMemHostUnregister(%#x): %s", address, error_name(rc))


_pinner_lock = threading.Lock()
_pinner: CudaHostPinner | None = None


def host_pinner() -> CudaHostPinner:
    """The process's pinner on GPU 0 (one primary-context reference for all pools)."""
    global _pinner
    with _pinner_lock:
        if _pinner is None:
            _pinner = CudaHostPinner(0)
    return _pinner
