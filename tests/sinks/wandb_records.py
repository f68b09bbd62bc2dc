"""Reads back what the W&B SDK wrote to an offline run, with W&B's own inspector."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


def run_python(code: str, cwd: Path, timeout_s: float) -> subprocess.CompletedProcess[str]:
    """``python -c code`` in a fresh process that imports this checkout's gradtrack."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-c", code], cwd=cwd, env=env, timeout=timeout_s,
        capture_output=True, text=True,
    )  # fmt: skip


def run_dirs(root: Path) -> list[Path]:
    return sorted((root / "wandb").glob("offline-run-*"))


def read_records(run_dir: Path) -> list[dict[str, Any]]:
    """Every record of the run's ``.wandb`` transaction log, as JSON objects."""
    result = subprocess.run(
        [sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(run_dir)],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    return [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]


def _number(value: Any) -> Any:
    if value in ("NaN", "Infinity", "-Infinity"):
        return float(value.replace("Infinity", "inf"))
    return value


def history(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """History rows in order, ``_step`` included, NaN/Inf restored as floats."""
    return [
        {key: _number(value) for key, value in record["history"]["item"].items()}
        for record in records
        if record["type"] == "history"
    ]


def of_type(records: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [record[kind] for record in records if record["type"] == kind]


def summary(records: list[dict[str, Any]]) -> dict[str, Any]:
    merged: dict[str, Any] = {}
    for update in of_type(records, "summary"):
        merged.update(update.get("update", {}))
    return merged


def same(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or a == b
