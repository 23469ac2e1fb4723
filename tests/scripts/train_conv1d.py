"""Train a small 1-D convolutional classifier (padding, dilation, groups, stride, biases)
on random sequences.

Used by tests/commands/test_run.py and tests/job/test_intercept_conv.py (see ``_training``);
``build`` gives the seeded model and its loss, ``CONVS`` is its number of convolutions.
"""

from collections.abc import Callable

import torch
from _training import classification_loss, train
from torch import nn

BATCH, CHANNELS, LENGTH, CLASSES = 4, 4, 32, 5
CONVS = 3


class Conv1dNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.convs = nn.Sequential(
            nn.Conv1d(CHANNELS, 8, 5, padding=2),
            nn.GELU(),
            nn.Conv1d(8, 8, 3, padding=2, dilation=2, groups=2),
            nn.GELU(),
            nn.Conv1d(8, 16, 3, stride=2),
        )
        self.head = nn.Linear(16, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.convs(x).mean(-1))


def build() -> tuple[nn.Module, Callable[[], torch.Tensor]]:
    torch.manual_seed(0)
    model = Conv1dNet()
    return model, classification_loss(model, (BATCH, CHANNELS, LENGTH), CLASSES)


if __name__ == "__main__":
    train(*build())
