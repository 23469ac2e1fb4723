"""Types of the compiled extension ``_cffi_src/build_native.py`` builds, for the checker.

Its ``lib`` holds the C functions and constants the cffi declarations name, which the
checker cannot see through; calls into it are checked by the C compiler and at run time.
"""

from typing import Any

from _cffi_backend import FFI

ffi: FFI
lib: Any
