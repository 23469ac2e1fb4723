"""One convolution call on a device, as the virtual clock prices it: ``ConvShape``.

The fields are what ``kernels/conv.py`` is called with (its module docstring is the
reference for the geometry): the kind of product, the NCHW sizes of the array the call
indexes, the output channels, the ``ConvGeometry`` fields, the dtype, and for the input
gradient the band of input rows computed and the grad-output rows given. The models are
the layer below the kernels, so the output-size rule is restated here (``out_size``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .compute import DTYPES
from .strict_map import check_keys

KINDS = ("forward", "grad_input", "grad_weight")
_INT_MAX = 2**31 - 1

_SIZE_FIELDS = ("n", "c", "h", "w", "oc", "groups", "rows", "dy_rows")
_PAIRS = {"kernel": (2, 1), "stride": (2, 1), "dilation": (2, 1), "padding": (4, 0)}
SHAPE_FIELDS = (
    "kind",
    "n",
    "c",
    "h",
    "w",
    "oc",
    "kernel",
    "stride",
    "dilation",
    "padding",
    "groups",
    "dtype",
    "rows",
    "dy_rows",
)


def _int(name: str, value: object, least: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not least <= value <= _INT_MAX:
        raise ValueError(
            f"conv field {name!r} must be an integer in {least}..{_INT_MAX}, got {value!r:.60}"
        )
    return value


def _ints(name: str, value: object, count: int, least: int) -> tuple[int, ...]:
    """``value`` as a tuple of ``count`` ints (TOML and msgpack give lists)."""
    if (  # (the common case: the emulator's own tiles')
        type(value) is tuple
        and len(value) == count
        and {type(v) for v in value} == {int}
        and least <= min(value)
        and max(value) <= _INT_MAX
    ):
        return value
    if not isinstance(value, (list, tuple)) or len(value) != count:
        raise ValueError(f"conv field {name!r} must be {count} integers, got {value!r:.60}")
    return tuple(_int(name, v, least) for v in value)


def _out_len(padded: int, kernel: int, stride: int, dilation: int) -> int:
    return (padded - dilation * (kernel - 1) - 1) // stride + 1


@dataclass(frozen=True, slots=True)
class ConvShape:
    """One ``kernels.conv`` call: ``kind`` is ``forward``, ``grad_input`` or ``grad_weight``.

    ``n, c, h, w``: the array the call indexes, padded by ``padding`` (top, bottom, left,
    right) — the region received for ``forward`` (``h`` may be 0: a band that reads only
    padding), the whole input for ``grad_weight``, and for ``grad_input`` its
    ``input_size`` (h, w). ``oc`` output channels, ``kernel`` (kh, kw), ``stride``,
    ``dilation``, ``groups`` as in ``ConvGeometry``. ``grad_input`` only: ``rows`` input
    rows computed (the band's i1 − i0) and ``dy_rows`` grad-output rows given (R); both are
    0 for the other kinds.
    """

    kind: str
    n: int
    c: int
    h: int
    w: int
    oc: int
    kernel: tuple[int, int]
    stride: tuple[int, int] = (1, 1)
    dilation: tuple[int, int] = (1, 1)
    padding: tuple[int, int, int, int] = (0, 0, 0, 0)
    groups: int = 1
    dtype: str = "float32"
    rows: int = 0
    dy_rows: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"conv field 'kind' must be one of {KINDS}, got {self.kind!r:.60}")
        if self.dtype not in DTYPES:
            raise ValueError(
                f"conv field 'dtype' must be one of {sorted(DTYPES)}, got {self.dtype!r:.60}"
            )
        for name, (count, least) in _PAIRS.items():
            object.__setattr__(self, name, _ints(name, getattr(self, name), count, least))
        gradient = self.kind == "grad_input"
        for name in _SIZE_FIELDS:
            least = 1
            if (name == "h" and self.kind == "forward") or name in ("rows", "dy_rows"):
                least = 0
            _int(name, getattr(self, name), least)
        for name in ("c", "oc"):
            if getattr(self, name) % self.groups:
                raise ValueError(
                    f"conv field {name!r} must be a multiple of groups={self.groups}, "
                    f"got {getattr(self, name)}"
                )
        top, bottom, left, right = self.padding
        (kh, kw), (sh, sw), (dh, dw) = self.kernel, self.stride, self.dilation
        if _out_len(top + self.h + bottom, kh, sh, dh) < 1:
            raise ValueError(
                f"conv field 'h' is {self.h}: with padding {top}+{bottom} it is shorter than "
                f"the dilated kernel's {dh * (kh - 1) + 1} rows"
            )
        if _out_len(left + self.w + right, kw, sw, dw) < 1:
            raise ValueError(
                f"conv field 'w' is {self.w}: with padding {left}+{right} it is narrower than "
                f"the dilated kernel's {dw * (kw - 1) + 1} columns"
            )
        for name, bound in (("rows", self.h), ("dy_rows", self.out_size[0])):
            value = getattr(self, name)
            if gradient and not 1 <= value <= bound:
                raise ValueError(f"conv field {name!r} must be in 1..{bound}, got {value}")
            if not gradient and value != 0:
                raise ValueError(f"conv field {name!r} is for grad_input only: must be 0")

    @property
    def itemsize(self) -> int:
        return DTYPES[self.dtype]

    @property
    def out_size(self) -> tuple[int, int]:
        """(OH, OW) of the whole output over the array the call indexes."""
        top, bottom, left, right = self.padding
        (kh, kw), (sh, sw), (dh, dw) = self.kernel, self.stride, self.dilation
        return (
            _out_len(top + self.h + bottom, kh, sh, dh),
            _out_len(left + self.w + right, kw, sw, dw),
        )

    @property
    def out_rows(self) -> int:
        """Rows of the output (forward, grad weight) or grad output (grad input) touched."""
        return self.dy_rows if self.kind == "grad_input" else self.out_size[0]

    @property
    def direct(self) -> bool:
        """Each output channel reads one input channel: the kernels' direct path
        (``c/depthwise.c``), for a depthwise convolution and for one of a single input
        channel alike."""
        return self.c == self.groups

    @property
    def depthwise(self) -> bool:
        """A depthwise convolution (a group per input channel, and more than one), as
        PyTorch tells them apart: one of a single input channel (audio, a grayscale
        image) it runs as any other, so a board's published rates price it so."""
        return self.c == self.groups > 1

    def computed(self) -> ConvShape:
        """The call the kernels really make for this one, which the models price: a
        stride-1 grad input off the depthwise path is the forward convolution of its dy
        rows, padded by the kernel's reach, through the flipped weight (``kernels/conv.py``);
        every other call is itself. Where the band lies is not recorded: its padding is put
        above, and of more dy rows than it reads (tiles are given exactly those), as many as
        its reach are counted, though at an edge the kernels use fewer."""
        if self.kind != "grad_input" or self.stride != (1, 1) or self.direct:
            return self
        (kh, kw), (dh, dw) = self.kernel, self.dilation
        left = self.padding[2]
        read = self.rows + dh * (kh - 1)  # dy rows the band reads, padding included
        dy_rows = min(self.dy_rows, read)
        first, last = left - dw * (kw - 1), self.w + left  # dy columns read, likewise
        c0, c1 = max(first, 0), min(last, self.out_size[1])
        padding = (read - dy_rows, 0, c0 - first, last - c1)
        return ConvShape(
            "forward", self.n, self.oc, dy_rows, c1 - c0, self.c, self.kernel, (1, 1),
            self.dilation, padding, self.groups, self.dtype,
        )  # fmt: skip

    @property
    def flops(self) -> int:
        """``kernels.conv.conv_flops``: 2 × the dense multiply-adds of the call."""
        kh, kw = self.kernel
        positions = self.n * self.oc * self.out_rows * self.out_size[1]
        return 2 * positions * (self.c // self.groups) * kh * kw

    def to_dict(self) -> dict[str, Any]:
        """A TOML- and msgpack-friendly map (tuples as lists)."""
        return {
            name: list(value) if isinstance(value, tuple) else value
            for name in SHAPE_FIELDS
            for value in (getattr(self, name),)
        }

    @classmethod
    def from_dict(cls, d: object) -> ConvShape:
        """Parse ``to_dict``'s map strictly: unknown or missing keys are errors."""
        return cls(**check_keys("conv shape", d, SHAPE_FIELDS))
