"""The CNNs edge-training benchmarks train, in torchvision's layouts, written out so that
no download or torchvision is needed: ResNet-18 and MobileNetV2 (width 1.0).

Flower's Raspberry Pi benchmark (``REFERENCE.md``) trains timm's ``resnet18`` and
``mobilenetv2_100``, which have these layouts. ``python scripts/edge_cnns.py MODEL BATCH SIZE
STEPS`` trains one on random images with SGD (lr 0.1, as there) and prints each step's wall
seconds as JSON on its last line: the script ``morphling run`` runs for the calibration
table and the CNN benchmarks.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

CLASSES = 1000


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)), inplace=True)
        return F.relu(self.bn2(self.conv2(out)) + self.downsample(x), inplace=True)


def resnet18(classes: int = CLASSES) -> nn.Module:
    layers: list[nn.Module] = [
        nn.Conv2d(3, 64, 7, 2, 3, bias=False),
        nn.BatchNorm2d(64),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(3, 2, 1),
    ]
    cin = 64
    for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        layers += [BasicBlock(cin, cout, stride), BasicBlock(cout, cout, 1)]
        cin = cout
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, classes)]
    return nn.Sequential(*layers)


def _conv_bn(cin: int, cout: int, kernel: int, stride: int, groups: int = 1,
             act: bool = True) -> list[nn.Module]:  # fmt: skip
    layers: list[nn.Module] = [
        nn.Conv2d(cin, cout, kernel, stride, kernel // 2, groups=groups, bias=False),
        nn.BatchNorm2d(cout),
    ]
    return [*layers, nn.ReLU6(inplace=True)] if act else layers


class InvertedResidual(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int, expand: int) -> None:
        super().__init__()
        hidden = cin * expand
        layers = _conv_bn(cin, hidden, 1, 1) if expand != 1 else []
        layers += _conv_bn(hidden, hidden, 3, stride, groups=hidden)
        layers += _conv_bn(hidden, cout, 1, 1, act=False)
        self.block = nn.Sequential(*layers)
        self.residual = stride == 1 and cin == cout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.block(x) if self.residual else self.block(x)


def mobilenet_v2(classes: int = CLASSES) -> nn.Module:
    layers = _conv_bn(3, 32, 3, 2)
    cin = 32
    # (expansion, channels, repeats, first stride), as in the paper and torchvision
    for expand, cout, repeats, stride in (
        (1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2),
        (6, 96, 3, 1), (6, 160, 3, 2), (6, 320, 1, 1),
    ):  # fmt: skip
        for i in range(repeats):
            layers.append(InvertedResidual(cin, cout, stride if i == 0 else 1, expand))
            cin = cout
    layers += _conv_bn(cin, 1280, 1, 1)
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(0.2), nn.Linear(1280, classes)]
    return nn.Sequential(*layers)


MODELS: dict[str, Callable[[], nn.Module]] = {"resnet18": resnet18, "mobilenet_v2": mobilenet_v2}


def train(name: str, batch: int, size: int, steps: int) -> list[float]:
    """Seconds of each of ``steps`` SGD steps on random ``batch``×3×``size``² images."""
    torch.manual_seed(0)
    model = MODELS[name]()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    images = torch.randn(batch, 3, size, size)
    labels = torch.randint(0, CLASSES, (batch,))
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        F.cross_entropy(model(images), labels).backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - start)
    return times


if __name__ == "__main__":
    model_name, batch_text, size_text, steps_text = sys.argv[1:5]
    print(json.dumps(train(model_name, int(batch_text), int(size_text), int(steps_text))))
