"""Train a small ResNet (BasicBlocks with BatchNorm, one downsampling by a strided 3×3
convolution and a 1×1 shortcut) on random images.

Used by tests/commands/test_run.py and tests/job/test_intercept_conv.py (see ``_training``);
``build`` gives the seeded model and its loss, ``CONVS`` is its number of convolutions.
"""

from collections.abc import Callable

import torch
import torch.nn.functional as F
from _training import classification_loss, train
from torch import nn

BATCH, SIZE, CLASSES = 4, 16, 10
CONVS = 6  # the stem, two per block, the shortcut


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Identity()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


def build() -> tuple[nn.Module, Callable[[], torch.Tensor]]:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),  # with a bias: the stem has no BatchNorm after it
        nn.ReLU(),
        BasicBlock(8, 8, 1),
        BasicBlock(8, 16, 2),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(16, CLASSES),
    )

    return model, classification_loss(model, (BATCH, 3, SIZE, SIZE), CLASSES)


if __name__ == "__main__":
    train(*build())
