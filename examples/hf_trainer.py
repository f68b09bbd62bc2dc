"""Hugging Face Trainer: add `GradtrackCallback`; it follows `report_to` (here the console).

python examples/hf_trainer.py                    # a tiny random GPT-2, no download
python examples/hf_trainer.py --report-to wandb  # into the Trainer's own W&B run
"""

from __future__ import annotations

import argparse
import tempfile

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from gradtrack.integrations.transformers import GradtrackCallback


class RandomTokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    def __init__(self, n: int = 512, length: int = 32, vocab: int = 256) -> None:
        self.ids = torch.randint(vocab, (n, length), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--report-to", default="none")
    args = parser.parse_args()

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=256, n_positions=32, n_embd=64, n_layer=2, n_head=2)
    with tempfile.TemporaryDirectory() as output_dir:
        trainer = Trainer(
            model=GPT2LMHeadModel(config),
            args=TrainingArguments(
                output_dir=output_dir, max_steps=args.steps, per_device_train_batch_size=8,
                gradient_accumulation_steps=2, learning_rate=3e-4, logging_steps=10,
                save_strategy="no", report_to=args.report_to, use_cpu=True, disable_tqdm=True,
            ),
            train_dataset=RandomTokens(),
            callbacks=[GradtrackCallback(log_every=10, console={"interval_s": 0})],
        )  # fmt: skip
        trainer.train()


if __name__ == "__main__":
    main()
