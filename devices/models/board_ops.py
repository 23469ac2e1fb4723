"""The built-in boards' op and convolution models: what prices a training step's convolutions
and every other op on a board nobody here has measured.

CPU boards (the Raspberry Pis) are calibrated against end-to-end training on the boards
(``REFERENCE.md``: Flower's benchmark, seconds per batch of 16 3×224×224 images, SGD) by
``scripts/calibrate_boards.py``. A board's op model is ``TEMPLATE`` — measured by
``morphling profile`` on an x86 host, the shape of a CPU's op costs class by class — with its
bandwidths and arithmetic rate × ``memory`` and its dispatch costs × ``DISPATCH``; its
convolution model is ``ConvModel.analytic``: dense convolutions at ``conv_efficiency`` × the
board's GEMM rate (``flops``, from HPL), depthwise ones at ``depthwise_efficiency`` × it,
their memory traffic at the op model's elementwise bandwidth.

- ``memory`` comes from published memory figures, not from the fit: the Pi 4's STREAM copy
  rate (``STREAM``) over the template's elementwise bandwidth; the Pi 5's is the Pi 4's ×
  the ratio of their memories' data rates (LPDDR4X-4267 against LPDDR4-3200).
- The Pi 4's two training figures then fix its two efficiencies (ResNet-18 is nearly all
  dense convolutions; MobileNetV2's extra time is its depthwise ones). The Pi 5's one figure
  fixes its dense efficiency; its depthwise one keeps the Pi 4's ratio to the dense one
  (the same PyTorch kernels on a core of the same family).
- ``DISPATCH`` is an assumption: at batch 16 a step's few thousand ops cost well under 1 %
  of it, so the published figures cannot fix it.

GPU boards (the Jetsons) have no published training figure in ``REFERENCE.md``: their models
are derived from published peak figures and our assumptions, and say so.
"""

from __future__ import annotations

import math
from typing import Any

from .conv import ConvModel
from .ops import OpModel

# Measured on an x86 host (AMD EPYC, one thread, torch 2.13, 2026-11-25) by ``morphling
# profile``'s op timing: the shape of a CPU board's op costs, class by class.
TEMPLATE = OpModel(
    dispatch_s={
        "elementwise": 1.22e-6,
        "normalization": 1.07e-5,
        "pooling": 7.69e-6,
        "softmax": 1e-9,
        "optimizer": 2.53e-6,
        "other": 7.37e-6,
    },
    bandwidth={
        "elementwise": 3.56e10,
        "normalization": 5.05e9,
        "pooling": 1.77e9,
        "softmax": 6.68e9,
        "optimizer": 5.49e10,
    },
    fresh_bw=3.42e9,
    flops=9.68e9,
    source="measured on an x86 host (AMD EPYC, 1 thread, torch 2.13) by morphling profile",
)

# Eager dispatch on the board's cores against the template host's: our assumption (a
# Cortex-A72 at 1.8 GHz runs Python and the dispatcher about 4x slower than a current x86
# server core, a Cortex-A76 at 2.4 GHz about 2x), not a measurement.
DISPATCH = {"rpi4": 4.0, "rpi5": 2.0}

# Pi 4 STREAM copy, one thread: 5527 MB/s (sci-pi.org.uk/bench/stream.html).
STREAM = {"rpi4": 5.527e9}
# Pi 5 LPDDR4X at 4267 MT/s, Pi 4 LPDDR4 at 3200 MT/s, both on a 32-bit bus.
MEMORY = {"rpi4": STREAM["rpi4"] / TEMPLATE.bandwidth["elementwise"]}
MEMORY["rpi5"] = MEMORY["rpi4"] * 4267 / 3200

# scripts/calibrate_boards.py's solution (see the module docstring). A dense efficiency above
# 1 says the board's convolutions run faster than the GEMM rate its profile estimates from HPL
# (2 x the FP64 figure, an estimate; the Cortex-A72's NEON peak is several times higher), once
# the tiles' memory traffic is charged apart.
CALIBRATION = {
    "rpi4": {"conv_efficiency": 1.04, "depthwise_efficiency": 0.00879},
    "rpi5": {"conv_efficiency": 0.991, "depthwise_efficiency": 0.00836},
}

_FLOWER = (
    "Flower's Raspberry Pi training benchmark (jafermarq/federated-embedded-vision, Flower "
    "blog 2023-12): ResNet-18 10.92 s and MobileNetV2 15.27 s per batch of 16 on a Pi 4, "
    "ResNet-18 5.84 s on a Pi 5"
)


def cpu_board(name: str, flops: float) -> tuple[dict[str, Any], dict[str, Any]]:
    """(op model, convolution model) of built-in CPU board ``name`` of GEMM rate ``flops``,
    as the profile's ``ops`` and ``conv`` tables."""
    calibration, memory = CALIBRATION[name], MEMORY[name]
    source = (
        f"calibrated against end-to-end training ({_FLOWER}) by scripts/calibrate_boards.py: "
        f"the template op model ({TEMPLATE.source}) with memory x{memory:.3g} (from "
        f"published memory figures), dispatch x{DISPATCH[name]:g} (assumed)"
    )
    ops = TEMPLATE.scaled(dispatch=DISPATCH[name], memory=memory, arithmetic=memory,
                          source=source)  # fmt: skip
    conv = ConvModel.analytic(
        calibration["conv_efficiency"] * flops,
        depthwise_flops=calibration["depthwise_efficiency"] * flops,
        mem_bw=ops.bandwidth["elementwise"],
    )
    return ops.to_dict(), conv.to_dict()


# GPU boards: a kernel launch from the board's ARM cores costs some 10 µs in eager PyTorch
# (our assumption, x2 on the Nano's older A57 cores); elementwise kernels stream at 70 % of
# the memory's peak, normalisation and softmax at 50 %, pooling at 40 %, the optimizer's
# multi-tensor updates at 60 % (our assumptions, typical of CUDA kernels of each kind);
# non-GEMM arithmetic at half the FP32 peak; the caching allocator reuses memory, so no
# page faults (``fresh_bw`` infinite). Convolutions (cuDNN) at the profile's GEMM rate,
# their traffic at the elementwise bandwidth.
_GPU_SHARES = {"elementwise": 0.7, "normalization": 0.5, "pooling": 0.4, "softmax": 0.5,
               "optimizer": 0.6}  # fmt: skip


def gpu_board(
    flops: float, peak_flops: float, memory_bw: float, launch_s: float, cite: str
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(op model, convolution model) of a GPU board: GEMM rate ``flops``, FP32 peak
    ``peak_flops``, memory ``memory_bw`` bytes/s, ``launch_s`` per op; ``cite`` the figures'
    source."""
    ops = OpModel(
        dispatch_s={c: launch_s for c in (*_GPU_SHARES, "other")},
        bandwidth={c: share * memory_bw for c, share in _GPU_SHARES.items()},
        fresh_bw=math.inf,
        flops=0.5 * peak_flops,
        source=f"derived from published figures ({cite}) and our assumptions (shares of the "
        f"memory bandwidth per op class, {launch_s * 1e6:g} us per launch), not calibrated",
    )
    conv = ConvModel.analytic(flops, mem_bw=_GPU_SHARES["elementwise"] * memory_bw)
    return ops.to_dict(), conv.to_dict()
