"""The training loop the test scripts share: what each prints and saves is the same.

Each script is run natively and through ``morphling run`` (its directory is first on
``sys.path`` either way): it prints the per-step losses as one JSON line on stdout and
saves the final state_dict to the path in argv[1]; argv[2], if given, is how many steps
(20).
"""

import json
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F

STEPS = int(sys.argv[2]) if len(sys.argv) > 2 else 20
BATCH, SEQ = 2, 16


def fit(model: torch.nn.Module, step_loss: Callable[[], torch.Tensor]) -> list[float]:
    """STEPS AdamW steps on ``step_loss()`` (which draws its own batch); the losses."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(STEPS):
        loss = step_loss()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def classification_loss(
    model: torch.nn.Module, input_shape: tuple[int, ...], classes: int
) -> Callable[[], torch.Tensor]:
    """The step loss of a classifier on random inputs of ``input_shape`` (batch first) and
    random labels: what the convolution scripts train on."""

    def step_loss() -> torch.Tensor:
        inputs = torch.randn(*input_shape)
        return F.cross_entropy(model(inputs), torch.randint(0, classes, (input_shape[0],)))

    return step_loss


def train(model: torch.nn.Module, step_loss: Callable[[], torch.Tensor]) -> None:
    """``fit``; report and save."""
    losses = fit(model, step_loss)
    torch.save(model.state_dict(), sys.argv[1])
    print(json.dumps(losses))


def train_causal_lm(config: dict) -> None:
    """A Hugging Face causal LM built from ``config`` (seeded, no hub) on random tokens."""
    from morphling.proxy.checkpoint.hf_models import build_model

    torch.manual_seed(0)  # dropout draws from the global RNG: both runs must see the same
    model = build_model(config, seed=0)
    model.train()
    vocab = model.config.vocab_size

    def step_loss() -> torch.Tensor:
        ids = torch.randint(0, vocab, (BATCH, SEQ))
        return model(input_ids=ids, labels=ids).loss

    train(model, step_loss)
