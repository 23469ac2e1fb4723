"""Train a tiny OPT (bundled config, seeded, no hub) for a few AdamW steps.

Used by tests/test_run.py, run natively and through ``morphling run``: prints the per-step
losses as one JSON line on stdout and saves the final state_dict to the path in argv[1].
OPT in transformers 5 uses scaled_dot_product_attention.

The bundled opt-tiny config is used as is except for its activation: GELU instead of ReLU.
With ReLU the comparison is ill-conditioned, not the emulation: native attention is PyTorch's
fused kernel, ``morphling run`` decomposes it, and a pre-activation within rounding of 0
then switches a unit on in one run and off in the other; AdamW turns the different gradient
into a full lr-sized step (final parameters 3.3e-3 apart, while the emulated run is
bit-identical to a native run with math attention). GEMMs are the same either way.
"""

import json
import sys

import torch
from morphling.proxy.hf_models import build_model, load_config

STEPS, BATCH, SEQ = 20, 2, 16


def main() -> None:
    torch.manual_seed(0)  # dropout draws from the global RNG: both runs must see the same
    config = load_config("opt-tiny")
    config["activation_function"] = "gelu"  # see above
    model = build_model(config, seed=0)
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
