"""Run as a script by test_lightning: Lightning's own DDP launcher (2 CPU processes, gloo).

    python tests/integrations/lightning_ddp.py OUT_DIR

Each rank pickles what it saw to OUT_DIR/rank<r>.pkl.
"""

from __future__ import annotations

import pickle
import sys
from pathlib import Path

import torch
from lightning.pytorch import Trainer

from gradtrack.integrations.lightning import GradtrackCallback
from gradtrack.sinks.memory import MemorySink
from tests.integrations.test_lightning import GradientsSeen, TinyRegressor, _loader


def main(out: Path) -> None:
    torch.manual_seed(0)
    sink, seen = MemorySink(), GradientsSeen()
    callback = GradtrackCallback(sink, log_every=1, histograms=False)
    trainer = Trainer(
        accelerator="cpu", devices=2, strategy="ddp", max_steps=4, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[callback, seen],
    )  # fmt: skip
    trainer.fit(TinyRegressor(), _loader())
    assert callback.watcher is not None
    result = {
        "records": sink.records,
        "seen": seen.steps,
        "n_sinks": len(callback.watcher.sinks),
    }
    with (out / f"rank{trainer.global_rank}.pkl").open("wb") as f:
        pickle.dump(result, f)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
