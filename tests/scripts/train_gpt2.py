"""Train a tiny GPT-2 (bundled config, seeded, no hub) for a few AdamW steps.

Used by tests/commands/test_run.py (see ``_training``).
GPT-2 projects with Conv1D, i.e. addmm on a [in, out] weight.
"""

from _training import train_causal_lm
from morphling.proxy.checkpoint.hf_models import load_config

if __name__ == "__main__":
    train_causal_lm(load_config("gpt2-tiny"))
