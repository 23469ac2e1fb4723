"""The op model: what prices every op that is neither a GEMM nor a convolution.

Its parsing (every error naming the field), the classes aten ops fall in, how ops are
counted (bytes read and written, new memory, arithmetic) over real torch ops, the fit
(recovering a known model from items priced by it), and the op timing of ``morphling
profile`` on this host.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from morphling.devices.models.op_count import count_op
from morphling.devices.models.ops import (
    FRESH_MIN_BYTES,
    KERNEL_CLASSES,
    OTHER,
    OpModel,
    op_class,
    op_flops,
)
from morphling.devices.models.profiles import BUILTIN, load_profile
from morphling.devices.profiler.op_timing import (
    Item,
    fit_op_model,
    measure_items,
    op_model_error,
)
from torch.utils._python_dispatch import TorchDispatchMode

MODEL = OpModel(
    dispatch_s={
        "elementwise": 2e-6,
        "normalization": 1e-5,
        "pooling": 8e-6,
        "softmax": 3e-6,
        "optimizer": 4e-6,
        "other": 1e-6,
    },
    bandwidth={
        "elementwise": 2e10,
        "normalization": 5e9,
        "pooling": 2e9,
        "softmax": 8e9,
        "optimizer": 3e10,
    },
    fresh_bw=3e9,
    flops=1e10,
    source="test",
)


# -- parsing ---------------------------------------------------------------------------------


def test_round_trip() -> None:
    assert OpModel.from_dict(MODEL.to_dict()) == MODEL


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"flops": -1.0}, "ops field 'flops' must be finite and > 0"),
        ({"fresh_bw": "fast"}, "ops field 'fresh_bw' must be a number"),
        ({"dispatch_s": {**MODEL.dispatch_s, "pooling": -1e-6}},
         "ops field 'dispatch_s.pooling' must be finite and >= 0"),
        ({"bandwidth": {**MODEL.bandwidth, "softmax": 0}},
         "ops field 'bandwidth.softmax' must be finite and > 0"),
        ({"bandwidth": {k: v for k, v in MODEL.bandwidth.items() if k != "optimizer"}},
         "ops field 'bandwidth' is missing key(s): 'optimizer'"),
        ({"bandwidth": {**MODEL.bandwidth, "conv": 1e9}},
         "ops field 'bandwidth' has unknown key(s): 'conv'"),
        ({"speed": 1}, "ops has unknown key(s): 'speed'"),
        ({"source": ""}, "ops field 'source' must be a non-empty string"),
    ],
)  # fmt: skip
def test_a_malformed_model_is_refused_naming_the_field(change: dict, message: str) -> None:
    with pytest.raises(ValueError) as caught:
        OpModel.from_dict({**MODEL.to_dict(), **change})
    assert message in str(caught.value)


def test_a_profile_file_with_a_malformed_op_model_is_refused_naming_it(tmp_path: Path) -> None:
    profile = tmp_path / "board.toml"
    profile.write_text(
        '[profile]\nname = "board"\nflops = 1e10\nmemory_bytes = 1073741824\n'
        'dl_bw = 1e8\nul_bw = 1e8\ndl_lat_s = 0.0\nul_lat_s = 0.0\nkind = "cpu"\n'
        'blas = "OpenBLAS"\n[ops]\ndispatch_s = {elementwise = 1e-6, normalization = 1e-6, '
        "pooling = 1e-6, softmax = 1e-6, optimizer = 1e-6, other = 1e-6}\n"
        "bandwidth = {elementwise = 1e9, normalization = 1e9, pooling = -1, softmax = 1e9, "
        'optimizer = 1e9}\nfresh_bw = 1e9\nflops = 1e9\nsource = "hand-written"\n'
    )
    with pytest.raises(ValueError) as caught:
        load_profile(str(profile))
    assert "profile field 'ops': ops field 'bandwidth.pooling' must be finite and > 0" in str(
        caught.value
    )


def test_every_builtin_has_an_op_model_that_says_where_it_comes_from() -> None:
    for name, profile in BUILTIN.items():
        model = OpModel.from_dict(profile.ops)
        if name.startswith("rpi"):
            assert "calibrated against end-to-end training" in model.source
        else:
            assert "derived from published figures" in model.source
            assert "not calibrated" in model.source


# -- classes and counting -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "in_optimizer", "cls"),
    [
        ("add_", False, "elementwise"),
        ("threshold_backward", False, "elementwise"),
        ("native_batch_norm_backward", False, "normalization"),
        ("native_layer_norm", False, "normalization"),
        ("max_pool2d_with_indices_backward", False, "pooling"),
        ("_adaptive_avg_pool2d", False, "pooling"),
        ("_log_softmax_backward_data", False, "softmax"),
        ("_foreach_add_", False, "optimizer"),
        ("add_", True, "optimizer"),
        ("empty_like", False, OTHER),
    ],
)
def test_classes(name: str, in_optimizer: bool, cls: str) -> None:
    assert op_class(name, in_optimizer=in_optimizer) == cls


class _Record(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, tuple[str, int, int, float]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.ops.append((func.overloadpacket.__name__, count_op(func, args, kwargs, out)))
        return out


def _counted(fn) -> list[tuple[str, tuple[str, int, int, float]]]:  # type: ignore[no-untyped-def]
    with _Record() as record:
        fn()
    return record.ops


@pytest.mark.parametrize(
    ("name", "flops"),
    [("exp", 80.0), ("tanh_backward", 80.0), ("sigmoid_", 80.0), ("logical_and", 0.0),
     ("add", 0.0)],
)  # fmt: skip
def test_only_transcendental_elementwise_ops_count_arithmetic(name: str, flops: float) -> None:
    assert op_flops(name, "elementwise", 10) == flops


def test_counting_bytes_new_memory_and_arithmetic() -> None:
    a, b = torch.randn(1000), torch.randn(1000)
    ((name, add),) = _counted(lambda: a + b)
    assert (name, add) == ("add", ("elementwise", 3 * 4000, 0, 0.0))  # small: heap memory
    ((_, exp),) = _counted(lambda: torch.exp(a))
    assert exp[0] == "elementwise" and exp[3] > 0  # a transcendental counts its arithmetic
    ((_, view),) = _counted(lambda: a.view(10, 100))
    assert view == (OTHER, 0, 0, 0.0)  # a view moves nothing


def test_only_large_outputs_in_new_memory_count_as_fresh() -> None:
    elements = FRESH_MIN_BYTES // 4 + 1024  # just over glibc's largest mmap threshold
    big = torch.zeros(elements)
    ((_, out_of_place),) = _counted(lambda: big + 1)
    ((_, in_place),) = _counted(lambda: big.add_(1))
    assert out_of_place[2] == elements * 4  # a new output, mapped afresh
    assert in_place[1] == 2 * elements * 4 and in_place[2] == 0  # written where it was read


# -- the fit and the profiler's timing ------------------------------------------------------


def test_the_fit_recovers_a_known_model() -> None:
    """Items priced by MODEL itself: the fit finds a model that prices them the same."""
    shapes = [
        (cls, 8 << size, (8 << size) * fresh, 2.0 * (1 << size) * arith)
        for cls in KERNEL_CLASSES
        for size in (0, 10, 20, 24)
        for fresh in (0, 1)
        for arith in (0, 40)
    ]
    other = (OTHER, 0, 0, 0.0)
    items = [Item("synthetic", 1, [op, other], MODEL.op_s(*op) + MODEL.op_s(*other))
             for op in shapes]  # fmt: skip
    fitted = fit_op_model(items, "fitted")
    error = op_model_error(fitted, items)
    assert error["p90_ape"] < 0.02, (error, fitted)


def test_profiler_times_every_class_on_this_host() -> None:
    """One quick round of the op timing: every class is exercised, every time is real."""
    items = measure_items(threads=1, rounds=1, min_batch_s=1e-4)
    classes = {op[0] for item in items for op in item.ops}
    assert set(KERNEL_CLASSES) <= classes
    assert all(item.seconds > 0 and math.isfinite(item.seconds) for item in items)
    model = fit_op_model(items, "this host")
    assert all(0 < model.op_s(c, 1 << 20, 0, 0) < 1 for c in KERNEL_CLASSES)
