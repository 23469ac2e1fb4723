"""Measure a board's op model: the eager PyTorch ops a training step runs besides its GEMMs and
convolutions, timed and fitted (``devices.models.ops``).

Each item is a small piece of a training step — an activation, a residual add, a batch norm
forward and backward, a max pool forward and backward, a log-softmax forward and backward, an
SGD or AdamW step — at a few sizes, from a handful of elements (where the dispatch cost is
all there is) to tensors larger than the caches. Each item runs once under a dispatch mode
that counts its aten ops exactly as the job's interceptor counts a script's
(``op_count.count_op``), then is timed (the fastest of interleaved rounds, as GEMMs are); the
op model's parameters — dispatch cost, a bandwidth per class, the arithmetic rate — are
fitted to the items' times in log space, so a 10 µs item weighs as much as a 10 ms one.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from scipy.optimize import least_squares
from torch.utils._python_dispatch import TorchDispatchMode

from ..models.op_count import count_op
from ..models.ops import DISPATCH_CLASSES, KERNEL_CLASSES, OpModel
from .timing import Progress

Counted = list[tuple[str, int, int, float]]  # (class, bytes, fresh, flops) of each op run

# Elements of an item's main tensor: dispatch-bound, and large enough that its bytes (8 MiB and
# more) stream from memory on most boards, as a training step's activations do.
SIZES = (16, 256, 1 << 21, 1 << 22, 9 << 20)


@dataclass(frozen=True, slots=True)
class Item:
    """One timed piece of a step: its name, size, the ops it runs and its best seconds."""

    name: str
    elements: int
    ops: Counted
    seconds: float


class _Counting(TorchDispatchMode):
    def __init__(self, in_optimizer: bool) -> None:
        super().__init__()
        self.in_optimizer = in_optimizer
        self.ops: Counted = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.ops.append(count_op(func, args, kwargs, out, in_optimizer=self.in_optimizer))
        return out


def _image(elements: int, channels: int = 16) -> torch.Tensor:
    side = max(1, math.isqrt(elements // channels))
    return torch.randn(2, channels, side, max(1, elements // (2 * channels * side)))


def _backward(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> Callable[[], Any]:
    """``fn``'s forward and backward on ``x`` (a leaf that wants its gradient)."""
    x = x.requires_grad_()

    def run() -> None:
        y = fn(x)
        y.backward(torch.ones_like(y))
        x.grad = None

    return run


def _optimizer(kind: str, elements: int) -> Callable[[], Any]:
    params = [torch.nn.Parameter(torch.randn(max(1, elements // 8))) for _ in range(8)]
    for p in params:
        p.grad = torch.randn_like(p)
    if kind == "sgd":
        opt: torch.optim.Optimizer = torch.optim.SGD(params, lr=1e-3, momentum=0.9)
    else:
        opt = torch.optim.AdamW(params, lr=1e-3)
    opt.step()  # the state (momentum buffers, moments) exists from the first step on
    return opt.step


def _items(elements: int) -> dict[str, tuple[Callable[[], Any], bool]]:
    """The items at one size: name → (call, whether it is an optimizer step)."""
    a, b = torch.randn(elements), torch.randn(elements)
    image = _image(elements)
    channels = image.shape[1]
    weight, bias = torch.ones(channels), torch.zeros(channels)
    logits = torch.randn(max(1, elements // 1000), 1000)

    def batch_norm(x: torch.Tensor) -> torch.Tensor:
        return F.batch_norm(x, None, None, weight, bias, training=True)

    return {
        "relu": (lambda: F.relu(a), False),
        "add": (lambda: a + b, False),
        "mul_": (lambda: a.mul_(1.0), False),
        "exp": (lambda: torch.exp(a), False),
        "relu_backward": (_backward(F.relu, image.clone()), False),
        "batch_norm": (_backward(batch_norm, image.clone()), False),
        "max_pool": (_backward(lambda x: F.max_pool2d(x, 3, 2, 1), image.clone()), False),
        "avg_pool": (_backward(lambda x: F.adaptive_avg_pool2d(x, 1), image.clone()), False),
        "log_softmax": (_backward(lambda x: F.log_softmax(x, -1), logits.clone()), False),
        "sgd": (_optimizer("sgd", elements), True),
        "adamw": (_optimizer("adamw", elements), True),
    }


def _count(call: Callable[[], Any], in_optimizer: bool) -> Counted:
    with _Counting(in_optimizer) as mode:
        call()
    return mode.ops


def measure_items(
    *, threads: int = 1, rounds: int = 3, min_batch_s: float = 2e-3,
    progress: Progress | None = None,
) -> list[Item]:  # fmt: skip
    """Every item at every size in ``SIZES``, counted once and timed: the fastest of
    ``rounds`` rounds, each after a warm-up call one call, or where that is shorter than
    ``min_batch_s`` the mean of back-to-back calls lasting that long. On ``threads`` torch
    threads."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        calls = [
            (name, size, call, _count(call, optimizer))
            for size in SIZES
            for name, (call, optimizer) in _items(size).items()
        ]
        best = [math.inf] * len(calls)
        rng = np.random.default_rng(0)
        for _ in range(rounds):
            for i in rng.permutation(len(calls)):
                call = calls[i][2]
                call()
                start = time.perf_counter()
                call()
                seconds = time.perf_counter() - start
                if seconds < min_batch_s:  # too short to time alone: a batch of them
                    count = math.ceil(min_batch_s / max(seconds, 1e-7))
                    start = time.perf_counter()
                    for _ in range(count):
                        call()
                    seconds = (time.perf_counter() - start) / count
                best[i] = min(best[i], seconds)
                if progress is not None:
                    progress(1)
    finally:
        torch.set_num_threads(previous)
    return [Item(n, size, ops, s) for (n, size, _, ops), s in zip(calls, best, strict=True)]


def torch_version() -> str:
    """The torch the items ran on: its ops, and so its op model, change between versions."""
    return str(torch.__version__)


def items_count(rounds: int) -> int:
    """Timed item-rounds ``measure_items`` reports to its progress callback."""
    return len(SIZES) * len(_items(SIZES[0])) * rounds


def _predict(model: OpModel, ops: Counted) -> float:
    return sum(model.op_s(*op) for op in ops)


def _model(params: np.ndarray, source: str) -> OpModel:
    values = np.exp(params).tolist()
    dispatch = dict(zip(DISPATCH_CLASSES, values, strict=False))
    bandwidth = dict(zip(KERNEL_CLASSES, values[len(DISPATCH_CLASSES) :], strict=False))
    return OpModel(dispatch, bandwidth, values[-2], values[-1], source)


def fit_op_model(items: list[Item], source: str) -> OpModel:
    """The op model whose predictions of ``items`` are closest in log space (robust loss)."""
    measured = np.log([item.seconds for item in items])

    def residuals(params: np.ndarray) -> np.ndarray:
        model = _model(params, source)
        return np.log([_predict(model, item.ops) for item in items]) - measured

    start = np.log([*[2e-6] * len(DISPATCH_CLASSES), *[5e9] * len(KERNEL_CLASSES), 5e9, 1e9])
    # Plausible ranges: a class whose items the arithmetic bounds leaves its bandwidth free,
    # and a free parameter must not wander off to a meaningless 1e16.
    low = np.log([*[1e-9] * len(DISPATCH_CLASSES), *[1e8] * (len(KERNEL_CLASSES) + 2)])
    high = np.log([*[1e-2] * len(DISPATCH_CLASSES), *[1e12] * (len(KERNEL_CLASSES) + 1), 1e13])
    # Plain least squares first: the robust loss alone, from afar, stalls where a max() of the
    # model leaves a parameter without slope; then the robust loss, so that an item a busy
    # host slowed down weighs less.
    fit = least_squares(residuals, start, bounds=(low, high), max_nfev=2000)
    fit = least_squares(residuals, fit.x, bounds=(low, high), loss="soft_l1", f_scale=0.1,
                        max_nfev=2000)  # fmt: skip
    return _model(fit.x, source)


def op_model_error(model: OpModel, items: list[Item]) -> dict[str, float]:
    """How far ``model`` predicts ``items``: median and p90 absolute percentage errors."""
    ape = np.array([abs(_predict(model, i.ops) / i.seconds - 1) for i in items])
    return {"median_ape": float(np.median(ape)), "p90_ape": float(np.quantile(ape, 0.9)),
            "count": len(items)}  # fmt: skip
