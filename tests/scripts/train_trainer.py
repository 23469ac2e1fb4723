"""Train a tiny GPT-2 (bundled config, seeded, no hub) with Hugging Face's ``Trainer``
(accelerate underneath) on a synthetic dataset.

Used by tests/commands/test_run.py (see ``_training``): it prints the losses the Trainer
logs at every step and saves the final state_dict, as the other scripts do.
"""

import json
import sys
import tempfile

import torch
from _training import BATCH, SEQ, STEPS
from morphling.proxy.checkpoint.hf_models import build_model, load_config
from transformers import Trainer, TrainingArguments


class Tokens(torch.utils.data.Dataset):
    """Random token sequences, each its own label (the model shifts them)."""

    def __init__(self, vocab: int, count: int) -> None:
        self.ids = torch.randint(0, vocab, (count, SEQ), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main() -> None:
    model = build_model(load_config("gpt2-tiny"), seed=0)
    with tempfile.TemporaryDirectory() as output_dir:
        args = TrainingArguments(
            output_dir=output_dir,
            max_steps=STEPS,
            per_device_train_batch_size=BATCH,
            learning_rate=1e-3,
            logging_steps=1,
            save_strategy="no",
            report_to="none",
            use_cpu=True,
            seed=0,
            disable_tqdm=True,
        )
        trainer = Trainer(
            model=model, args=args, train_dataset=Tokens(model.config.vocab_size, BATCH * STEPS)
        )
        trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    torch.save(model.state_dict(), sys.argv[1])
    print(json.dumps(losses))


if __name__ == "__main__":
    main()
