"""A CONV_TILE as a device reads it: the ``kernels.conv`` call its fields describe.

The emulator sends each convolution tile its operands and the geometry of the call that
computes it (docs/PROTOCOL.md, *Convolution tiles*): the input region and the weight block
(forward), output-gradient rows and the weight block (grad_input), or the input and output
gradient channels (grad_weight). The agent runs the call on its worker pool.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, cast

import numpy as np
from morphling.kernels.conv import (
    ConvGeometry,
    conv_flops,
    conv_forward,
    conv_grad_input,
    conv_grad_weight,
)
from morphling.proxy.wire.messages import CONV_KINDS, GEMM_DTYPES, ConvTile


def operand(msg: ConvTile, index: int, segment: Any) -> np.ndarray:
    """Operand ``index``'s bytes (``segment``: its segment's, or a panel's kept from an
    earlier tile) as the array ``a_shape`` or ``b_shape`` says; ValueError if they are not
    that many bytes."""
    name, shape = ("a", msg.a_shape) if index == 0 else ("b", msg.b_shape)
    if len(shape) != 4 or any(not isinstance(d, int) or d < 0 for d in shape):
        raise ValueError(f"{name}_shape={shape!r:.60}: expected 4 integers >= 0")
    dtype = _dtype(msg)
    need = math.prod(shape) * dtype.itemsize
    if memoryview(segment).nbytes != need:
        raise ValueError(
            f"operand {name}: {memoryview(segment).nbytes} bytes, but {name}_shape "
            f"{shape} of {msg.dtype} is {need}"
        )
    return np.frombuffer(segment, dtype).reshape(shape)


Product = Callable[[np.ndarray | None], np.ndarray]  # the call, given where it writes (or None)


def prepare(msg: ConvTile, a: Any, b: Any) -> tuple[Product, int]:
    """The call that computes the tile's product from ``a`` and ``b`` (into the array it is
    given, a view of the job's output in this process, or a new one), and its FLOPs
    (``conv_flops``); ValueError naming the field where the tile describes no convolution.
    The call raises ValueError too where the operands' shapes disagree with the geometry."""
    _dtype(msg)
    if msg.kind not in CONV_KINDS:
        raise ValueError(f"kind {msg.kind!r} is not one of {', '.join(CONV_KINDS)}")
    geom = ConvGeometry(  # (which checks the lists' lengths and values)
        cast("tuple[int, int]", msg.kernel),
        cast("tuple[int, int]", msg.stride),
        cast("tuple[int, int]", msg.dilation),
        cast("tuple[int, int, int, int]", msg.padding),
        msg.groups,
    )
    if msg.kind == "forward":
        oh, ow = geom.output_size(a.shape[2], a.shape[3])
        flops = conv_flops((a.shape[0], b.shape[0], oh, ow), b.shape)
        return lambda out: conv_forward(a, b, geom, out), flops
    if msg.kind == "grad_input":
        if len(msg.input_size) != 2 or len(msg.rows) != 2:
            raise ValueError(
                f"input_size={msg.input_size!r:.40} and rows={msg.rows!r:.40}: "
                "a grad_input tile needs [H, W] and [i0, i1]"
            )
        size, rows = (msg.input_size[0], msg.input_size[1]), (msg.rows[0], msg.rows[1])
        oh_lo = msg.oh_lo

        def grad_input(out: np.ndarray | None) -> np.ndarray:
            return conv_grad_input(a, b, geom, input_size=size, oh_lo=oh_lo, rows=rows, out=out)

        return grad_input, conv_flops(a.shape, b.shape)
    weight = (b.shape[1], a.shape[1] // geom.groups, *geom.kernel)
    return lambda out: conv_grad_weight(a, b, geom, out), conv_flops(b.shape, weight)


def _dtype(msg: ConvTile) -> np.dtype[Any]:
    if msg.dtype not in GEMM_DTYPES:
        raise ValueError(f"dtype {msg.dtype!r} is not supported ({', '.join(GEMM_DTYPES)})")
    return np.dtype(msg.dtype)
