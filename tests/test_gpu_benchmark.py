"""`benchmarks.gpu` on the CPU at tiny sizes, so the accelerator benchmark's code path never
rots where no accelerator is lent; and its one line where there is no CUDA device."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from functools import partial
from pathlib import Path
from typing import NoReturn

import pytest
import torch

from benchmarks import gpu, models

ROOT = Path(__file__).resolve().parents[1]
CPU = torch.device("cpu")
CUDA_ONLY = ("syncs", "event_waits", "copies", "pinned", "host_allocs", "memory_mib")


@pytest.mark.parametrize(
    "build",
    [
        partial(models.stress, tensors=8, width=4),
        partial(models.bf16_transformer, layers=1, width=16, batch=2, tokens=4),
    ],
    ids=["stress", "bf16_transformer"],
)
@pytest.mark.slow
def test_every_variant_is_measured_on_the_cpu(offline_wandb: Path, build: gpu.Build) -> None:
    with gpu.wandb_offline():
        rows = gpu.measure("tiny", build, CPU, rounds=2, steps=2, count_steps=2)
    assert [row.variant for row in rows] == list(gpu.VARIANTS)
    for row in rows:
        assert row.error is None, row.error
        assert len(row.times) == 2  # one per round
        assert row.step_ms > 0 and math.isfinite(row.vs_none) and math.isfinite(row.vs_floor)
        assert all(getattr(row, name) is None for name in CUDA_ONLY)  # n/a on the CPU
        assert row.check == "—"
        cells = gpu.format_row(row).strip("|").split(" | ")
        assert len(cells) == gpu.HEADER.strip("|").count(" | ") + 1
        assert "n/a" in cells
    by_name = {row.variant: row for row in rows}
    assert by_name["none"].vs_none == 1.0 and by_name["floor"].vs_floor == 1.0
    assert by_name["wandb.watch"].vs_none == pytest.approx(
        by_name["wandb.watch"].step_ms / by_name["none"].step_ms
    )


@pytest.mark.slow
def test_a_failing_variant_is_a_row_of_its_own(
    offline_wandb: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> NoReturn:
        raise RuntimeError("no such kernel")

    monkeypatch.setitem(gpu.VARIANTS, "guard", broken)
    build = partial(models.stress, tensors=4, width=4)
    rows = gpu.measure("tiny", build, CPU, ["guard", "logged step"], rounds=1, steps=1)
    assert [row.variant for row in rows] == ["none", "floor", "guard", "logged step"]
    failed = rows[2]
    assert failed.error == "RuntimeError: no such kernel" and failed.check == "failed"
    assert gpu.format_row(failed) == "| tiny | guard | failed: RuntimeError: no such kernel |"
    assert math.isfinite(rows[3].vs_none)


def test_the_check_compares_counts_with_what_the_design_expects() -> None:
    def check(variant: str, syncs: float, waits: float, copies: float, pinned: float,
              host_allocs: float = 0.0) -> str:  # fmt: skip
        row = gpu.Row("m", variant, syncs=syncs, event_waits=waits, copies=copies)
        row.pinned, row.host_allocs = pinned, host_allocs
        return row.check

    assert check("guard", 0.0, 0.0, 0.0, 0.0) == "ok"
    assert check("guard", 0.2, 0.0, 0.0, 0.0) == "UNEXPECTED"  # a sync every fifth step
    assert check("logged step", 0.0, 0.0, 2.0, 2.0) == "ok"
    assert check("logged step", 0.0, 0.0, 3.0, 3.0) == "UNEXPECTED"  # a third host copy
    assert check("logged step", 0.0, 0.0, 2.0, 1.0) == "UNEXPECTED"  # one of them blocking
    assert check("logged step", 0.0, 0.0, 2.0, 2.0, 0.5) == "UNEXPECTED"  # cudaHostAlloc
    assert check("raise rule", 1.0, 0.0, 1.0, 0.0) == "ok"
    assert check("raise rule", 0.0, 1.0, 1.0, 0.0) == "ok"  # the read as an event wait
    assert check("raise rule", 1.0, 1.0, 1.0, 0.0) == "UNEXPECTED"
    assert check("wandb.watch", 7.0, 0.0, 7.0, 0.0) == "—"  # not gradtrack's to promise


@pytest.mark.slow
def test_main_prints_one_table_on_the_cpu(
    offline_wandb: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["--device", "cpu", "--models", "bf16", "--big-width", "16", "--big-layers", "1",
            "--big-tokens", "4", "--rounds", "1", "--steps", "1", "--count-steps", "1"]  # fmt: skip
    assert gpu.main(args) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1] == gpu.HEADER
    table = [line for line in lines[3:] if line.startswith("| bf16 |")]
    assert [line.split(" | ")[1] for line in table] == list(gpu.VARIANTS)


@pytest.mark.slow
def test_without_cuda_it_says_so_in_one_line_and_exits_0() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout == gpu.NO_CUDA + "\n"
