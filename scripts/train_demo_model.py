#!/usr/bin/env python3
"""The demo's model trained by a plain PyTorch script: what ``morphling run`` and
``morphling sweep`` take in the README (``python scripts/train_demo_model.py`` runs it
natively). Prints the loss of every step."""

from __future__ import annotations

import argparse

import torch
from demo import MODEL
from morphling.proxy.checkpoint.hf_models import build_model, load_config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3, help="AdamW steps (default 3)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    config = load_config("opt-tiny")
    config.update(MODEL)
    model = build_model(config, seed=args.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = torch.randint(0, config["vocab_size"], (4, 64))
    for step in range(1, args.steps + 1):
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        print(f"step {step}: loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
