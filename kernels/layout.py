"""Turn numpy/torch views into row-major BLAS arguments, without copying.

A GEMM here is ``out = alpha * a @ b + beta * out`` where ``a`` is ``[m, k]``
(or ``[batch, m, k]``) and ``b`` is ``[k, n]`` (or ``[batch, k, n]``), given as
views with arbitrary strides. A transposed operand is just a transposed view
(``x.T``): its strides say so, and the planner maps it to BLAS's ``trans``
flag and leading dimension. Layouts BLAS cannot express (no unit stride,
negative strides, overlapping rows) are refused with a ``ValueError`` naming
the operand and its strides; packing is the caller's explicit decision.

Both the CPU (MKL/OpenBLAS) and GPU (cuBLASXt) executors run a ``GemmPlan``.
This sits on the per-tile hot path, so it avoids per-call allocations it can
do without (see ``_pointer``).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from ._native import ffi, lib
from .pool import Lease

DTYPE_CODES = {np.dtype(np.float32): 0, np.dtype(np.float64): 1}
# Lookups by the spellings callers use, so the hot path skips np.dtype().
_DTYPE_ALIASES = {
    **DTYPE_CODES, np.float32: 0, np.float64: 1, "float32": 0, "float64": 1,
}  # fmt: skip
_INT_MAX = 2**31 - 1


class GemmPlan(NamedTuple):
    """Arguments of one (possibly batched) row-major BLAS GEMM, in C call order.

    ``lib.mg_gemm(*plan)`` runs it; the pointers borrow the operands' memory,
    so the operands must outlive the call.
    """

    dtype: int
    trans_a: int
    trans_b: int
    m: int
    n: int
    k: int
    alpha: float
    a: Any
    lda: int
    stride_a: int
    a_len: int
    b: Any
    ldb: int
    stride_b: int
    b_len: int
    beta: float
    c: Any
    ldc: int
    stride_c: int
    c_len: int
    batch: int

    @property
    def flops(self) -> int:
        return 2 * self.m * self.n * self.k * self.batch


def check_failure(rc: int, plan: GemmPlan) -> Exception:
    """The exception for a nonzero ``mg_gemm``/``mg_xt_gemm`` return code."""
    p = plan
    messages = {
        lib.MG_GEMM_EDIMS: f"m, n, k, batch = {p.m}, {p.n}, {p.k}, {p.batch}: must be >= 0",
        lib.MG_GEMM_ELDA: f"lda={p.lda} is smaller than A's row length (trans_a={p.trans_a})",
        lib.MG_GEMM_ELDB: f"ldb={p.ldb} is smaller than B's row length (trans_b={p.trans_b})",
        lib.MG_GEMM_ELDC: f"ldc={p.ldc} is smaller than n={p.n}",
        lib.MG_GEMM_EA: f"A does not fit its buffer of {p.a_len} bytes (or stride_a < 0)",
        lib.MG_GEMM_EB: f"B does not fit its buffer of {p.b_len} bytes (or stride_b < 0)",
        lib.MG_GEMM_EC: f"C does not fit its buffer of {p.c_len} bytes (or stride_c < 0)",
        lib.MG_GEMM_EOVERLAP: f"stride_c={p.stride_c} makes the {p.batch} output pivots overlap",
        lib.MG_GEMM_EDTYPE: f"dtype code {p.dtype} is not supported (0=float32, 1=float64)",
    }
    if rc in messages:
        return ValueError(messages[rc])
    if rc == lib.MG_GEMM_ENOLIB:
        return RuntimeError("BLAS library is not loaded")
    return RuntimeError(f"GEMM failed: cuBLAS status {rc - 100}")


_new_plan = tuple.__new__


def _buffer(x: Any, name: str, writable: bool = False) -> tuple[Any, int]:
    """(pointer, byte length) of a lease or any contiguous buffer.

    A lease's pointer is the one it tracks, so the lease cannot be released
    while a plan (or a queued task holding one) still points at it.
    """
    if type(x) is Lease:
        ptr = x.pointer()
        return ptr, len(ptr)
    try:
        ptr = ffi.from_buffer(x, require_writable=True) if writable else ffi.from_buffer(x)
    except (BufferError, TypeError) as exc:
        need = "a writable contiguous buffer" if writable else "a contiguous buffer"
        raise ValueError(f"{name}: {type(x).__name__} is not {need} ({exc})") from None
    return ptr, len(ptr)


def plan_explicit(
    dtype: Any,
    trans_a: bool,
    trans_b: bool,
    m: int,
    n: int,
    k: int,
    a: Any,
    lda: int,
    b: Any,
    ldb: int,
    c: Any,
    ldc: int,
    *,
    alpha: float = 1.0,
    beta: float = 0.0,
    batch: int = 1,
    stride_a: int = 0,
    stride_b: int = 0,
    stride_c: int = 0,
) -> GemmPlan:
    """A plan from the explicit BLAS contract, as tiles arrive on the wire.

    ``a``, ``b`` and ``c`` are pool ``Lease``s or contiguous buffers
    (``bytes``, ``memoryview``, arrays; ``c`` writable); every pointer starts
    at its buffer's first byte, and strides and leading dimensions are in
    elements. Bounds and output overlap are checked in C when the plan runs.
    """
    code = _DTYPE_ALIASES.get(dtype)
    if code is None:
        code = DTYPE_CODES.get(np.dtype(dtype))
        if code is None:
            raise ValueError(f"dtype {dtype} is not supported (float32, float64)")
    pa, la = _buffer(a, "a")
    pb, lb = _buffer(b, "b")
    pc, lc = _buffer(c, "c", writable=True)
    # tuple.__new__ skips NamedTuple's Python-level __new__ (half the cost).
    return _new_plan(GemmPlan, (
        code, int(trans_a), int(trans_b), m, n, k, float(alpha), pa, lda, stride_a, la,
        pb, ldb, stride_b, lb, float(beta), pc, ldc, stride_c, lc, batch,
    ))  # fmt: skip


def as_array(x: Any, name: str) -> np.ndarray:
    """A numpy view of ``x`` (numpy array or CPU torch tensor), never a copy.

    Through DLPack, not ``Tensor.numpy()``: that marks the tensor's storage as never to be
    resized again, and FSDP frees its all-gather buffers by resizing their storage to 0."""
    if isinstance(x, np.ndarray):
        return x
    if type(x).__module__.startswith("torch"):
        if x.device.type != "cpu":
            raise ValueError(f"{name}: tensor is on {x.device}; the CPU kernels take host memory")
        if str(x.layout) != "torch.strided":
            raise ValueError(f"{name}: layout {x.layout} is not strided")
        return np.from_dlpack(x.detach())
    raise ValueError(f"{name}: expected a numpy array or torch tensor, got {type(x).__name__}")


def _pointer(arr: np.ndarray) -> tuple[Any, int]:
    """(cdata pointer to ``arr``'s first element, bytes spanned from there).

    ``ffi.from_buffer`` is several times cheaper than ``arr.ctypes`` but needs
    a contiguous buffer; a Fortran-ordered array's transpose is C-ordered and
    starts at the same address. Strides are non-negative here (``_split``).
    """
    # numpy's stubs give an array the buffer protocol only from Python 3.12 (PEP 688)
    if arr.flags.c_contiguous:
        ptr = ffi.from_buffer(arr)  # type: ignore[call-overload]
        return ptr, len(ptr)
    if arr.flags.f_contiguous:
        ptr = ffi.from_buffer(arr.T)  # type: ignore[call-overload]
        return ptr, len(ptr)
    span = arr.itemsize + sum((d - 1) * s for d, s in zip(arr.shape, arr.strides, strict=True))
    return ffi.cast("void *", arr.ctypes.data), span if arr.size else 0


class LayoutError(ValueError):
    """A view whose strides BLAS cannot read as it is (a broadcast, a double stride):
    a caller may copy it into a BLAS layout and try again."""


def _split(arr: np.ndarray, name: str) -> tuple[int, int, int, int, int, int]:
    """(batch or -1, batch stride, rows, cols, row stride, col stride), strides in elements."""
    if not arr.flags.aligned:
        raise LayoutError(f"{name}: data is not aligned to its {arr.itemsize}-byte element size")
    item = arr.itemsize
    strides = arr.strides
    if any(s % item or s < 0 for s in strides):
        raise LayoutError(
            f"{name}: byte strides {strides} must be non-negative multiples of {item}"
        )
    if arr.ndim == 2:
        return -1, 0, *arr.shape, strides[0] // item, strides[1] // item
    if arr.ndim == 3:
        s0, s1, s2 = strides
        return arr.shape[0], s0 // item, arr.shape[1], arr.shape[2], s1 // item, s2 // item
    raise ValueError(f"{name}: expected 2 or 3 dimensions, got shape {arr.shape}")


def _matrix_layout(rows: int, cols: int, s0: int, s1: int, name: str) -> tuple[int, int]:
    """(transposed, ld) such that the view is a row-major matrix, or its transpose."""
    if rows == 0 or cols == 0:  # nothing is addressed; numpy's strides are arbitrary here
        return 0, max(1, cols)
    # Row-major: element (i, j) at i*ld + j. A single row makes ld free.
    if cols <= 1 or s1 == 1:
        ld = max(1, cols) if rows <= 1 else s0
        if ld >= max(1, cols):
            return 0, ld
    # Column-major: the transpose of a row-major [cols, rows] matrix.
    if rows <= 1 or s0 == 1:
        ld = max(1, rows) if cols <= 1 else s1
        if ld >= max(1, rows):
            return 1, ld
    raise LayoutError(
        f"{name}: shape ({rows}, {cols}) with element strides ({s0}, {s1}) is not a BLAS "
        "layout (needs one unit stride and a leading dimension >= the other extent); "
        "pack it explicitly"
    )


class Operand(NamedTuple):
    """A GEMM operand as BLAS (and the wire) takes it: the span of memory it
    addresses, from its first element to its last, and how to read it."""

    span: np.ndarray  # 1-D over the operand's memory, no copy
    batch: int  # -1 for a 2-D operand
    stride: int  # elements between batch pivots
    rows: int  # of the logical (untransposed) matrix
    cols: int
    trans: int  # 1: stored as the row-major transpose
    ld: int


def blas_operand(x: Any, name: str) -> Operand:
    """Describe a numpy/torch view as an ``Operand``; ``ValueError`` if BLAS cannot read it."""
    arr = as_array(x, name)
    batch, stride, rows, cols, s0, s1 = _split(arr, name)
    trans, ld = _matrix_layout(rows, cols, s0, s1, name)
    if arr.size == 0:
        span = np.empty(0, arr.dtype)
    elif arr.flags.c_contiguous:  # the common layouts, without as_strided's microseconds
        span = arr.reshape(-1)
    elif arr.flags.f_contiguous:
        span = arr.T.reshape(-1)
    else:
        count = 1 + sum(
            (d - 1) * (s // arr.itemsize) for d, s in zip(arr.shape, arr.strides, strict=True)
        )
        span = np.lib.stride_tricks.as_strided(arr, shape=(count,), strides=(arr.itemsize,))
    return Operand(span, batch, stride, rows, cols, trans, ld)


def plan_gemm(
    a: Any, b: Any, out: Any = None, *, alpha: float = 1.0, beta: float = 0.0
) -> tuple[GemmPlan, np.ndarray]:
    """Validate operands and build the plan; allocates ``out`` when not given.

    Returns the plan and the numpy view of ``out``. The caller keeps ``a``,
    ``b`` and ``out`` alive until the plan has run.
    """
    a = as_array(a, "a")
    b = as_array(b, "b")
    dtype = a.dtype
    code = DTYPE_CODES.get(dtype)
    if code is None:
        raise ValueError(f"a: dtype {dtype} is not supported (float32, float64)")
    if b.dtype != dtype:
        raise ValueError(f"b: dtype {b.dtype} does not match a's {dtype}")
    batch_a, sa, m, k, a0, a1 = _split(a, "a")
    batch_b, sb, kb, n, b0, b1 = _split(b, "b")
    if k != kb:
        raise ValueError(f"inner dimensions differ: a is {a.shape}, b is {b.shape}")
    if batch_a >= 0 and batch_b >= 0 and batch_a != batch_b:
        raise ValueError(f"batch sizes differ: a is {a.shape}, b is {b.shape}")
    batch = max(batch_a, batch_b)
    out_shape = (m, n) if batch < 0 else (batch, m, n)
    if out is None:
        if beta != 0.0:
            raise ValueError("beta is nonzero but no out array was given to accumulate into")
        out = np.empty(out_shape, dtype=dtype)
    else:
        out = as_array(out, "out")
        if out.shape != out_shape:
            raise ValueError(f"out: shape {out.shape}, expected {out_shape}")
        if out.dtype != dtype:
            raise ValueError(f"out: dtype {out.dtype} does not match a's {dtype}")
        if not out.flags.writeable:
            raise ValueError("out: array is read-only")
        if np.may_share_memory(out, a) or np.may_share_memory(out, b):
            raise ValueError("out: overlaps an input operand")
    if max(m, n, k) > _INT_MAX:
        raise ValueError(f"(m, n, k)={(m, n, k)} exceeds the 32-bit BLAS interface")
    if batch == 0:  # nothing to compute; numpy's strides of empty arrays are arbitrary
        return _new_plan(GemmPlan, (
            code, 0, 0, m, n, k, float(alpha), ffi.NULL, max(1, k), 0, 0,
            ffi.NULL, max(1, n), 0, 0, float(beta), ffi.NULL, max(1, n), 0, 0, 0,
        )), out  # fmt: skip
    _, sc, _, _, c0, c1 = _split(out, "out")
    trans_a, lda = _matrix_layout(m, k, a0, a1, "a")
    trans_b, ldb = _matrix_layout(k, n, b0, b1, "b")
    c_trans, ldc = _matrix_layout(m, n, c0, c1, "out")
    if c_trans:
        # A column-major out: compute out^T = b^T a^T into its row-major transpose.
        plan, _ = plan_gemm(
            np.swapaxes(b, -1, -2), np.swapaxes(a, -1, -2), np.swapaxes(out, -1, -2),
            alpha=alpha, beta=beta,
        )  # fmt: skip
        return plan, out
    # The same rule as gemm_check.c: stacked or row-interleaved pivots.
    stacked = sc >= (m - 1) * ldc + n
    interleaved = n <= sc and (batch - 1) * sc + n <= ldc
    if batch > 1 and m and n and not (stacked or interleaved):
        raise ValueError(f"out: batch stride {sc} makes pivots overlap")
    if max(lda, ldb, ldc) > _INT_MAX:
        raise ValueError(f"leading dimensions {(lda, ldb, ldc)} exceed the 32-bit BLAS interface")
    pa, la = _pointer(a)
    pb, lb = _pointer(b)
    pc, lc = _pointer(out)
    plan = GemmPlan(
        code, trans_a, trans_b, m, n, k, float(alpha), pa, lda, sa, la,
        pb, ldb, sb, lb, float(beta), pc, ldc, sc, lc, max(batch, 1),
    )  # fmt: skip
    return plan, out
