"""Train a tiny OPT (bundled config, seeded, no hub) for a few AdamW steps.

Used by tests/commands/test_run.py (see ``_training``).
OPT in transformers 5 uses scaled_dot_product_attention.

The bundled opt-tiny config is used as is except for its activation: GELU instead of ReLU.
With ReLU the comparison is ill-conditioned, not the emulation: native attention is PyTorch's
fused kernel, ``morphling run`` decomposes it, and a pre-activation within rounding of 0
then switches a unit on in one run and off in the other; AdamW turns the different gradient
into a full lr-sized step (final parameters 3.3e-3 apart, while the emulated run is
bit-identical to a native run with math attention). GEMMs are the same either way.
"""

from _training import train_causal_lm
from morphling.proxy.checkpoint.hf_models import load_config

if __name__ == "__main__":
    config = load_config("opt-tiny")
    config["activation_function"] = "gelu"  # see above
    train_causal_lm(config)
