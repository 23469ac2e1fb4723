"""Train a tiny GPT-2 (bundled config, seeded, no hub) for a few AdamW steps.

Used by tests/test_run.py, run natively and through ``morphling run``: prints the per-step
losses as one JSON line on stdout and saves the final state_dict to the path in argv[1].
GPT-2 projects with Conv1D, i.e. addmm on a [in, out] weight.
"""

import json
import sys

import torch
from morphling.proxy.hf_models import build_model, load_config

STEPS, BATCH, SEQ = 20, 2, 16


def main() -> None:
    torch.manual_seed(0)  # dropout draws from the global RNG: both runs must see the same
    model = build_model(load_config("gpt2-tiny"), seed=0)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    vocab = model.config.vocab_size
    losses = []
    for _ in range(STEPS):
        ids = torch.randint(0, vocab, (BATCH, SEQ))
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    torch.save(model.state_dict(), sys.argv[1])
    print(json.dumps(losses))


if __name__ == "__main__":
    main()
