"""Run by test_transformers under torch.distributed.run (2 CPU processes, gloo): the Trainer
with ``deepspeed=`` (ZeRO stage ARGV[2]) and the callback, no optimizer= given.

    python -m torch.distributed.run --nproc_per_node 2 tests/integrations/hf_deepspeed.py OUT STAGE

Each rank pickles its memory sink's records and the Trainer's logged ``grad_norm`` (DeepSpeed's
own global norm, before it clips) to OUT/rank<r>.pkl.
"""

from __future__ import annotations

import os
import pickle
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch
import torch.distributed as dist
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

from gradtrack.integrations.transformers import GradtrackCallback
from gradtrack.sinks.memory import MemorySink
from tests.integrations.test_transformers import ACCUMULATE, STEPS, Tokens


class GradNorms(TrainerCallback):  # type: ignore[misc]
    def __init__(self) -> None:
        self.logged: list[tuple[int, float]] = []

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **_: Any) -> None:
        if logs and "grad_norm" in logs:
            self.logged.append((state.global_step, float(logs["grad_norm"])))


def main(out: Path, stage: int) -> None:
    sink, norms = MemorySink(), GradNorms()
    callback = GradtrackCallback(sink, log_every=1, histograms=False)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(
        GPT2Config(vocab_size=100, n_positions=16, n_embd=32, n_layer=2, n_head=2)
    )
    deepspeed = {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
    }
    arguments = TrainingArguments(
        output_dir=str(out / "out"), max_steps=STEPS, per_device_train_batch_size=4,
        gradient_accumulation_steps=ACCUMULATE, learning_rate=1e-3, logging_steps=1,
        save_strategy="no", report_to="none", disable_tqdm=True, deepspeed=deepspeed,
        max_grad_norm=1.0,
    )  # fmt: skip
    Trainer(
        model=model, args=arguments, train_dataset=Tokens(), callbacks=[callback, norms]
    ).train()
    assert callback.watcher is not None
    result = {
        "records": sink.records,
        "grad_norms": norms.logged,
        "n_sinks": len(callback.watcher.sinks),
    }
    with (out / f"rank{dist.get_rank()}.pkl").open("wb") as f:
        pickle.dump(result, f)


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]))
    # The results are on disk; DeepSpeed's CPU communication has been seen to abort in its
    # C++ destructors at interpreter exit on a loaded machine: leave without them.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
