"""Train a small MobileNetV2 (inverted residuals: a 1×1 expansion, a depthwise 3×3, a
linear 1×1 projection; BatchNorm and ReLU6) on random images.

Used by tests/commands/test_run.py and tests/job/test_intercept_conv.py (see ``_training``);
``build`` gives the seeded model and its loss, ``CONVS`` is its number of convolutions.

Unlike MobileNetV2, nothing leads from a BatchNorm to the next BatchNorm through 1×1
convolutions and sums alone: training-mode BatchNorm removes any per-channel constant, so
the first one's bias would have an exact gradient of 0, and AdamW (which normalises each
update) would turn its rounding noise into lr-sized steps that differ from run to run,
native or not. So the downsampling block has no expansion (MobileNetV2's first block's
form: its depthwise convolution's zero padding sees the constant), and the head's 1×1
convolution has a bias instead of a BatchNorm.
"""

from collections.abc import Callable

import torch
from _training import classification_loss, train
from torch import nn

BATCH, SIZE, CLASSES = 4, 16, 10
CONVS = 1 + 3 + 2 + 1  # the stem, the inverted residuals (one without expansion), the head


def conv_bn(cin: int, cout: int, kernel: int, stride: int = 1, groups: int = 1) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(cin, cout, kernel, stride, padding=kernel // 2, groups=groups, bias=False),
        nn.BatchNorm2d(cout),
    )


class InvertedResidual(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int, expand: int) -> None:
        super().__init__()
        hidden = cin * expand
        expansion = [conv_bn(cin, hidden, 1), nn.ReLU6()] if expand > 1 else []
        self.block = nn.Sequential(
            *expansion,
            conv_bn(hidden, hidden, 3, stride, groups=hidden),  # depthwise
            nn.ReLU6(),
            conv_bn(hidden, cout, 1),  # linear bottleneck: no activation
        )
        self.residual = stride == 1 and cin == cout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.block(x) if self.residual else self.block(x)


def build() -> tuple[nn.Module, Callable[[], torch.Tensor]]:
    torch.manual_seed(0)
    model = nn.Sequential(
        conv_bn(3, 8, 3, stride=2),
        nn.ReLU6(),
        InvertedResidual(8, 8, 1, expand=2),
        InvertedResidual(8, 16, 2, expand=1),
        nn.Conv2d(16, 32, 1),  # see above
        nn.ReLU6(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(32, CLASSES),
    )

    return model, classification_loss(model, (BATCH, 3, SIZE, SIZE), CLASSES)


if __name__ == "__main__":
    train(*build())
