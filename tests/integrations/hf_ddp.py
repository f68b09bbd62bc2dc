"""Run by test_transformers under torchrun (2 CPU processes, gloo): the Trainer's own DDP.

    torchrun --nproc_per_node 2 tests/integrations/hf_ddp.py OUT_DIR

Each rank pickles what it saw to OUT_DIR/rank<r>.pkl.
"""

from __future__ import annotations

import pickle
import sys
from pathlib import Path

import torch.distributed as dist

from gradtrack.integrations.transformers import GradtrackCallback
from gradtrack.sinks.memory import MemorySink
from tests.integrations.test_transformers import STEPS, _train


def main(out: Path) -> None:
    sink = MemorySink()
    callback = GradtrackCallback(sink, log_every=1, histograms=False)
    seen, _ = _train(out, callback, max_grad_norm=0.0, ddp_backend="gloo")
    assert callback.watcher is not None
    result = {
        "records": sink.records,
        "seen": seen.steps,
        "n_sinks": len(callback.watcher.sinks),
        "steps": STEPS,
    }
    with (out / f"rank{dist.get_rank()}.pkl").open("wb") as f:
        pickle.dump(result, f)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
