"""How long the ops that are neither GEMMs nor convolutions take on a device: its op model.

An eager PyTorch op costs a dispatch (the Python call, the dispatcher, the kernel's set-up)
and then its kernel, which, for everything but GEMMs and convolutions, is bound by memory or
by arithmetic. So an op of class ``c`` that moves ``bytes`` (its operands read, its outputs
written), of which ``fresh`` are outputs in new memory, and does ``flops`` takes

    dispatch_s[c] + max(bytes / bandwidth[c] + fresh / fresh_bw, flops / flops_rate)

New memory costs more than its bytes: an eager step allocates its activations afresh, and
glibc's allocator maps blocks over ``FRESH_MIN_BYTES`` from the OS anew each time
(smaller ones, once freed, come back from its heap), so their first write takes a page fault
per page (``fresh_bw``, one figure for the board).

Kernels of different classes reach different shares of the memory bandwidth (an elementwise
add streams; a batch norm reads its input twice, a max pool gathers windows; an optimizer's
update touches four tensors per parameter), hence a bandwidth per class. Views and other
metadata ops (``other``) cost their dispatch alone. GEMMs and convolutions a coordinator keeps
local are priced by the profile's GEMM rate (``gemm``, ``conv``).

Which class an aten op is in, and how much arithmetic it does, is decided from its name
here, so the job that counts ops and the profiler that times them agree; counting the bytes
needs torch and lives with them (``op_count``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from .strict_map import check_keys, positive, short

# glibc's largest mmap threshold on 64-bit systems (DEFAULT_MMAP_THRESHOLD_MAX): larger blocks
# are always mapped afresh, and returned to the OS when freed.
FRESH_MIN_BYTES = 32 << 20

# Classes with a kernel of their own, each priced at its bandwidth.
KERNEL_CLASSES = ("elementwise", "normalization", "pooling", "softmax", "optimizer")
OTHER = "other"  # views and metadata: dispatch only
GEMM, CONV = "gemm", "conv"  # products kept local
DISPATCH_CLASSES = (*KERNEL_CLASSES, OTHER)
OP_CLASSES = (GEMM, CONV, *DISPATCH_CLASSES)

# Arithmetic per element of an op's largest tensor, where it can bound the kernel: a
# transcendental function costs a polynomial, a normalisation computes mean, variance and the
# affine map, a softmax an exponential, a sum and a division, a pool compares or adds a
# window. A plain add, copy or optimizer update does too little arithmetic per byte to be
# anything but memory-bound: none is counted for it.
_TRANSCENDENTAL = frozenset(("exp", "exp2", "expm1", "log", "log2", "log10", "log1p", "tanh",
                             "sigmoid", "log_sigmoid_forward", "gelu", "erf", "silu", "pow",
                             "sqrt", "rsqrt", "sin", "cos", "softplus", "elu", "mish",
                             "hardswish"))  # fmt: skip
_FLOPS_PER_ELEMENT = {"normalization": 8.0, "softmax": 8.0, "pooling": 2.0}
_TRANSCENDENTAL_FLOPS = 8.0

_NORMALIZATION = ("batch_norm", "layer_norm", "group_norm", "instance_norm", "rms_norm")
# aten ops that only allocate: their bytes are not moved by a kernel
_ALLOCATIONS = ("empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided")


def op_class(name: str, *, is_view: bool = False, in_optimizer: bool = False) -> str:
    """The class of aten op ``name`` (its overload packet's name, e.g. ``add_``,
    ``native_batch_norm_backward``, ``_foreach_mul_``). ``in_optimizer``: it runs inside an
    optimizer's ``step`` (an optimizer's elementwise work is its own class)."""
    if is_view or name in _ALLOCATIONS:
        return OTHER
    if in_optimizer or name.startswith(("_foreach_", "_fused_")):
        return "optimizer"
    if any(norm in name for norm in _NORMALIZATION):
        return "normalization"
    if "pool" in name:
        return "pooling"
    if "softmax" in name:
        return "softmax"
    return "elementwise"


def op_flops(name: str, cls: str, elements: int) -> float:
    """Arithmetic of op ``name`` of class ``cls`` whose largest tensor has ``elements``."""
    if cls == "elementwise" and name.strip("_").removesuffix("_backward") in _TRANSCENDENTAL:
        return _TRANSCENDENTAL_FLOPS * elements
    return _FLOPS_PER_ELEMENT.get(cls, 0.0) * elements


@dataclass(frozen=True, slots=True)
class OpModel:
    """One device's op model (the module docstring has its form); validated on
    construction, every error naming its field. The dispatch cost is per class: a batch
    norm's set-up or an optimizer's Python loop around its update costs more than an add's."""

    dispatch_s: dict[str, float]  # seconds per op of each ``DISPATCH_CLASSES``
    bandwidth: dict[str, float]  # bytes/s per ``KERNEL_CLASSES``
    fresh_bw: float  # bytes/s of outputs in new memory, on top of their bandwidth (inf: free)
    flops: float  # non-GEMM arithmetic, FLOP/s
    source: str

    def __post_init__(self) -> None:
        check_keys("ops field 'dispatch_s'", self.dispatch_s, DISPATCH_CLASSES)
        dispatch = {c: _at_least_zero(f"dispatch_s.{c}", self.dispatch_s[c])
                    for c in DISPATCH_CLASSES}  # fmt: skip
        object.__setattr__(self, "dispatch_s", dispatch)
        check_keys("ops field 'bandwidth'", self.bandwidth, KERNEL_CLASSES)
        bandwidth = {c: positive("ops", f"bandwidth.{c}", self.bandwidth[c])
                     for c in KERNEL_CLASSES}  # fmt: skip
        object.__setattr__(self, "bandwidth", bandwidth)
        fresh = self.fresh_bw  # infinite: new memory costs nothing extra (a caching allocator)
        if not (isinstance(fresh, (int, float)) and fresh == math.inf):
            fresh = positive("ops", "fresh_bw", fresh)
        object.__setattr__(self, "fresh_bw", float(fresh))
        object.__setattr__(self, "flops", positive("ops", "flops", self.flops))
        if not isinstance(self.source, str) or not self.source:
            raise ValueError(f"ops field 'source' must be a non-empty string, got "
                             f"{short(self.source)}")  # fmt: skip

    def op_s(self, cls: str, nbytes: int, fresh: int, flops: float) -> float:
        """Seconds for one op of class ``cls`` (``OTHER``: dispatch only)."""
        if cls == OTHER:
            return self.dispatch_s[OTHER]
        memory = nbytes / self.bandwidth[cls] + fresh / self.fresh_bw
        return self.dispatch_s[cls] + max(memory, flops / self.flops)

    def scaled(self, *, dispatch: float = 1.0, memory: float = 1.0, arithmetic: float = 1.0,
               source: str) -> OpModel:  # fmt: skip
        """This model with its dispatch costs × ``dispatch``, bandwidths × ``memory`` and
        arithmetic rate × ``arithmetic``: another board, its ratios to this one given."""
        return OpModel(
            dispatch_s={c: s * dispatch for c, s in self.dispatch_s.items()},
            bandwidth={c: bw * memory for c, bw in self.bandwidth.items()},
            fresh_bw=self.fresh_bw * memory,
            flops=self.flops * arithmetic,
            source=source,
        )

    def to_dict(self) -> dict[str, Any]:
        """A TOML- and msgpack-friendly map."""
        return {"dispatch_s": dict(self.dispatch_s), "bandwidth": dict(self.bandwidth),
                "fresh_bw": self.fresh_bw, "flops": self.flops, "source": self.source}  # fmt: skip

    @classmethod
    def from_dict(cls, d: object) -> OpModel:
        """Parse ``to_dict``'s map strictly: unknown or missing keys are errors."""
        fields = check_keys("ops", d, _FIELDS)
        return cls(**fields)


_FIELDS = ("dispatch_s", "bandwidth", "fresh_bw", "flops", "source")


def _at_least_zero(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"ops field {name!r} must be a number, got {short(value)}")
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"ops field {name!r} must be finite and >= 0, got {short(value)}")
    return float(value)
