"""cffi builder for ``morphling.kernels._native``.

Composes the per-topic declaration modules (``blas``, ``pool``, ``cublasxt``,
``conv``, ``screen``) with their C sources under ``c/``. Run by setuptools (``cffi_modules`` in
``setup.py``) at install time.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

from cffi import FFI

HERE = Path(__file__).resolve().parent
TOPICS = ("blas", "pool", "cublasxt", "conv", "screen")
# C sources in include order: the shared GEMM checks precede both executors, and the BLAS
# and the unfold precede the implicit GEMM that calls them.
C_SOURCES = (
    "gemm_check",
    "blas",
    "vector_width",
    "pool",
    "cublasxt",
    "depthwise",
    "unfold",
    "implicit_gemm",
    "screen",
)
# Included by a source above (depthwise.c and screen.c: their code once per dtype; the
# convolution sources: their geometry).
C_HEADERS = ("depthwise_typed.h", "conv_geom.h", "screen_typed.h")


def _load_topic(name: str) -> ModuleType:
    # Loaded by path: setuptools runs this file outside any package.
    spec = importlib.util.spec_from_file_location(f"_mg_cffi_{name}", HERE / f"{name}.py")
    assert spec is not None and spec.loader is not None, "a .py file has a source loader"
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build_ffi() -> FFI:
    topics = [_load_topic(name) for name in TOPICS]
    builder = FFI()
    builder.cdef("".join(t.TYPES + t.FUNCTIONS for t in topics))
    # One translation unit: the C files are #included so the module is a single object.
    source = "".join(t.INCLUDES for t in topics) + "".join(
        f'#include "{name}.c"\n' for name in C_SOURCES
    )
    builder.set_source(
        "morphling.kernels._native",
        source,
        # The depthwise kernels' row loops: vectorised and versioned for a unit stride (-O3),
        # their dot products' sums in vector lanes (-fopenmp-simd: the pragma, no runtime).
        extra_compile_args=[
            "-O3",
            "-fopenmp-simd",
            "-std=c11",
            "-D_GNU_SOURCE",
            "-pthread",
            "-Wall",
        ],
        include_dirs=[str(HERE / "c")],
        depends=[str(HERE / "c" / f"{name}.c") for name in C_SOURCES]
        + [str(HERE / "c" / name) for name in C_HEADERS],
        libraries=["dl", "pthread"],
    )
    return builder


ffi = build_ffi()

if __name__ == "__main__":
    ffi.compile(verbose=True)
