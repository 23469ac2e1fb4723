"""A convolution's aten arguments in the form the fleet computes: 2-D, NCHW, explicit padding.

``aten.convolution`` and ``aten.convolution_backward`` describe a convolution with lists
of one entry per spatial dimension (or a single entry, which PyTorch repeats) and
symmetric padding. The devices compute 2-D convolutions (``morphling.kernels.conv``), so
a 1-D one goes as a 2-D one with H = kh = 1: its operands are viewed so, never copied,
and the results viewed back. This module only translates; the interceptor decides what
is sent.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from morphling.kernels.conv import ConvGeometry, conv_flops

Shape4 = tuple[int, int, int, int]


@dataclass(frozen=True)
class ConvCall:
    """One convolution as a 2-D one: the input [N, C, H, W], the weight [OC, C/groups,
    kh, kw] and the geometry; ``one_d`` when the script's operands have no H."""

    input: Shape4
    weight: Shape4
    geometry: ConvGeometry
    one_d: bool

    @property
    def output(self) -> Shape4:
        n, _, height, width = self.input
        return (n, self.weight[0], *self.geometry.output_size(height, width))

    @property
    def flops(self) -> int:
        """Of each product (forward, grad input, grad weight): they are the same size."""
        return conv_flops(self.output, self.weight)

    def as_2d(self, t: torch.Tensor) -> torch.Tensor:
        return t.unsqueeze(2) if self.one_d else t

    def from_2d(self, t: torch.Tensor) -> torch.Tensor:
        return t.squeeze(2) if self.one_d else t


def conv_call(
    x: torch.Tensor,
    w: torch.Tensor,
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    groups: int,
) -> ConvCall | None:
    """The 1-D or 2-D convolution of ``x`` by ``w`` as a ``ConvCall``; None for any other
    (3-D, or arguments PyTorch rejects: its own kernel then raises its own error)."""
    if x.dim() != w.dim() or x.dim() not in (3, 4) or groups < 1:
        return None
    one_d = x.dim() == 3
    pairs: list[Sequence[int]] = []
    for fill, param in zip((1, 0, 1), (stride, padding, dilation), strict=True):
        values = _expanded(param, x.dim() - 2)
        if values is None:
            return None
        pairs.append((fill, *values) if one_d else values)  # a 1-D one's H: as if not there
    (sh, sw), (ph, pw), (dh, dw) = pairs
    n, c, *size = x.shape
    oc, per_group, *kernel = w.shape
    height, width = (1, *size) if one_d else size
    kh, kw = (1, *kernel) if one_d else kernel
    if oc % groups or c != per_group * groups or min(sh, sw, dh, dw, kh, kw) < 1 or min(ph, pw) < 0:
        return None
    geometry = ConvGeometry((kh, kw), (sh, sw), (dh, dw), (ph, ph, pw, pw), groups)
    try:
        geometry.output_size(height, width)
    except ValueError:  # the dilated kernel does not fit the padded input
        return None
    return ConvCall((n, c, height, width), (oc, per_group, kh, kw), geometry, one_d)


def _expanded(param: Sequence[int], dims: int) -> list[int] | None:
    """One entry per spatial dimension, as PyTorch expands a single one; None if neither."""
    values = [int(v) for v in param]
    if len(values) == 1:
        return values * dims
    return values if len(values) == dims else None


def laid_out_like(result: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``result`` (NCHW-contiguous, from the fleet) in the memory format PyTorch's CPU
    convolution gives its results: channels_last when the input or the weight is."""
    if result.dim() == 4 and (_channels_last(x) or _channels_last(w)):
        return result.contiguous(memory_format=torch.channels_last)
    return result


def _channels_last(t: torch.Tensor) -> bool:
    return (
        t.dim() == 4
        and t.is_contiguous(memory_format=torch.channels_last)
        and not t.is_contiguous()
    )
