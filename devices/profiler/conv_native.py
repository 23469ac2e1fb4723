"""How fast this board's PyTorch runs a convolution beside the device kernels: the convolution
model's ``native`` scale.

A device computes a convolution tile with ``kernels/conv.py`` (im2col and BLAS, or the
depthwise C kernels), but a script on the board would run PyTorch's own convolution (oneDNN,
XNNPACK or its im2col fallback, depending on the build: ``REFERENCE.md``). Convolutions
typical of CNN training — 3×3 and 1×1, strided, a 7×7 stem, the 512-channel last stage of a
ResNet or VGG on a few positions, depthwise — are timed both ways,
whole, on the profile's threads, for each product (forward, input gradient, weight
gradient; not the stem's input gradient, an image's, which training never asks for). Each
kind's and class's (``NATIVE_KEYS``: k×k, pointwise, depthwise) scale is PyTorch's total
time over the kernels' on its convolutions: a step's time is a sum, so the large
convolutions that dominate it dominate the scale, where a mean of ratios would weigh a
small odd one as much.

Both are timed as a training process runs them, past its first step (``_settle_allocator``):
in a fresh process the C library maps many of the outputs afresh, and the page faults
cost more than some of the convolutions.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from morphling.kernels import set_threads
from morphling.kernels.conv import ConvGeometry, conv_forward, conv_grad_input, conv_grad_weight

from ..models.conv import NATIVE_KEYS, native_class
from ..models.conv_shape import KINDS

# Bumped when what ``measure_native_scale`` times changes: a cached ``host`` profile whose
# scale was measured another way is measured again (``host_cache.HOST_KEY``).
REVISION = 2

# (N, C, H=W, OC, kernel, stride, groups): CNN layers at batch 8 on small images, so that the
# whole set takes seconds on an x86 core. PyTorch's time over the kernels' varies with the
# layer, and the largest weigh most in a class's total: the set spans up to 512 channels and
# from 16 to 3136 output positions per image.
SHAPES = (
    (8, 64, 28, 64, 3, 1, 1),
    (8, 128, 14, 128, 3, 1, 1),
    (8, 256, 7, 256, 3, 1, 1),
    (8, 512, 7, 512, 3, 1, 1),
    (8, 512, 4, 512, 3, 1, 1),
    (8, 32, 28, 64, 3, 2, 1),
    (8, 256, 8, 512, 3, 2, 1),
    (8, 64, 28, 128, 1, 2, 1),
    (8, 256, 14, 64, 1, 1, 1),
    (8, 32, 28, 192, 1, 1, 1),
    (8, 3, 56, 32, 7, 2, 1),
    (8, 3, 112, 64, 7, 2, 1),
    (8, 96, 28, 96, 3, 1, 96),
    (8, 144, 14, 144, 3, 2, 144),
    (8, 384, 7, 384, 3, 1, 384),
    (8, 32, 56, 32, 3, 1, 32),
)


# glibc's malloc maps each block of at least its mmap threshold (128 KiB at first) afresh,
# and raises the threshold to the size of each mapped block freed, up to 32 MiB. A training
# step frees blocks of several MiB, so from the second on its tensors come from the heap.
_SETTLE_BYTES = 24 << 20


def _settle_allocator() -> None:
    """Take this process where a training process is after its first step: one block
    larger than any here, touched and freed, lifts the mmap threshold above them."""
    np.ones(_SETTLE_BYTES, dtype=np.uint8)


def _best(call: Callable[[], Any], rounds: int) -> float:
    call()  # warm-up
    best = math.inf
    for _ in range(rounds):
        start = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - start)
    return best


def _pair(shape: tuple[int, ...], kind: str) -> tuple[Callable[[], Any], Callable[[], Any]]:
    """(PyTorch's call, the kernels' call) of ``kind`` for ``shape``."""
    n, c, size, oc, k, stride, groups = shape
    pad = k // 2
    x, w = torch.randn(n, c, size, size), torch.randn(oc, c // groups, k, k)
    dy = torch.randn_like(F.conv2d(x, w, stride=stride, padding=pad, groups=groups))
    geom = ConvGeometry((k, k), (stride, stride), (1, 1), (pad,) * 4, groups)
    xn, wn, dyn = x.numpy(), w.numpy(), dy.numpy()
    if kind == "forward":
        return (lambda: F.conv2d(x, w, stride=stride, padding=pad, groups=groups),
                lambda: conv_forward(xn, wn, geom))  # fmt: skip
    mask = [kind == "grad_input", kind == "grad_weight", False]
    args = (dy, x, w, None, [stride] * 2, [pad] * 2, [1, 1], False, [0, 0], groups, mask)

    def native() -> Any:
        return torch.ops.aten.convolution_backward(*args)

    if kind == "grad_input":
        return native, lambda: conv_grad_input(dyn, wn, geom, input_size=(size, size))
    return native, lambda: conv_grad_weight(xn, dyn, geom)


def measure_native_scale(*, threads: int = 1, rounds: int = 5) -> dict[str, float]:
    """``ConvModel.native``: PyTorch's time over the kernels', by kind and class."""
    _settle_allocator()
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    set_threads(threads)
    totals = {key: np.zeros(2) for key in NATIVE_KEYS}  # (PyTorch's, the kernels') seconds
    try:
        for shape in SHAPES:
            _, c, _, _, k, _, groups = shape
            for kind in KINDS:
                if kind == "grad_input" and c == 3:  # an image's gradient
                    continue
                native, kernels = _pair(shape, kind)
                key = kind + native_class((k, k), c == groups > 1)
                totals[key] += (_best(native, rounds), _best(kernels, rounds))
    finally:
        torch.set_num_threads(previous)
    unmeasured = [key for key, t in totals.items() if not t[1]]
    assert not unmeasured, f"SHAPES has no convolution of {unmeasured}"
    return {key: float(t[0] / t[1]) for key, t in totals.items()}
